"""Test-Time Speculation in the embedded engine: turns each verified round into supervision
(:class:`specadapt.tts.TTSExample`) for :class:`specadapt.tts.TTSUpdater`, whose loss is
:func:`specadapt.tts.distillation_loss` over the draft's student (:meth:`~specadapt.engine.drafts.Draft.tts_student`,
:mod:`specadapt.engine.tts_students`).

Per request and round the snapshot holds: the draft's context (the last ``context_window`` committed tokens,
or for the EAGLE head its last real (feature, token) pairs), the drafted tokens, the target's ``p`` rows at the
verified positions (the teacher, restricted and renormalised to the draft vocabulary for a reduced-vocabulary
head), the ``q`` rows the round was drafted from (the proximal term) and the position weights. The update
re-runs the draft differentiably from scratch on the shadow copy over that context only: positions older than
``context_window`` are not attended at all (serving attends to the whole history), so the student is a
short-context version of the serving draft and its q rows differ from the serving ones even at equal weights
(tests check they are equal when the whole history fits the window). Snapshotting the serving cache's keys and
values as a constant prefix would remove that gap at the cost of memory per example.
"""

from __future__ import annotations

import logging

import torch

from ..sampling import SamplingParams
from ..tts import (
    TTSConfig,
    TTSExample,
    TTSUpdater,
    add_lora,
    add_per_request_lora,
    background_trainer_pays,
    distillation_loss,
    position_weights,
    supervised_counts,
    top_k_rows,
)
from ..tts.lora import PerRequestLoRALinear

logger = logging.getLogger(__name__)

__all__ = ["EngineTTS"]


class EngineTTS:
    """Test-Time Speculation of one model draft (``self:N``, a standalone LM, or the EAGLE head).

    Args:
        draft: a draft whose :meth:`~specadapt.engine.drafts.Draft.tts_student` is an
            :class:`~specadapt.engine.tts_students.EngineStudent` (:class:`~specadapt.engine.drafts.ModelDraft`,
            :class:`~specadapt.engine.eagle_draft.EagleDraft`).
        config: :class:`~specadapt.tts.TTSConfig`.
        sampling: the run's sampling settings (the student's temperature).
        asynchronous: ``True`` background updates (a thread; a side stream on CUDA), ``False`` inline at round
            boundaries; ``None`` (default) background only where the trainer has compute of its own
            (:func:`specadapt.tts.background_trainer_pays`: CUDA, or a CPU with a core the decoder does not use).
        max_requests: concurrent requests (adapter slots of ``scope="request"``).

    Raises:
        ValueError: a draft without trainable layers (``ngram``, target-only).
    """

    def __init__(
        self, draft, config: TTSConfig, sampling: SamplingParams, asynchronous: bool | None = None,
        max_requests: int = 1,
    ) -> None:
        student = draft.tts_student()
        if student is None:
            raise ValueError(f"--tts needs a model draft (eagle, self:N or a model path), not {draft.name!r}")
        module = student.module
        self.draft = draft
        self.student = student
        self.config = config
        self.sampling = sampling
        prefixes = list(student.trainable_prefixes)
        self.slots = None
        if config.scope == "request":
            self.slots = add_per_request_lora(module, config.lora_rank, max_requests, prefixes)
            logger.info("TTS: per-request LoRA rank %d, %d slots", config.lora_rank, max_requests)

            def trainable(name, _):
                return ".lora_a" in name or ".lora_b" in name
        elif config.params == "lora":
            adapted = add_lora(module, config.lora_rank, prefixes)
            logger.info("TTS: LoRA rank %d on %d layers", config.lora_rank, len(adapted))

            def trainable(name, _):
                return ".lora_a" in name or ".lora_b" in name or name.startswith(("lora_a", "lora_b"))
        else:
            trainable = student.trainable

        student.keep_context(config.context_window)
        self.vocab = student.draft_vocab
        if asynchronous is None:
            asynchronous = background_trainer_pays(next(module.parameters()).device)
            if not asynchronous:
                logger.info("TTS: updates run inline at round boundaries: the decoder's %d threads use every core "
                            "this process has, and a background trainer would contend with them",
                            torch.get_num_threads())
        self.updater = TTSUpdater(
            module, trainable, self._loss, config, share=student.shared(), asynchronous=asynchronous,
            example_bytes=lambda ex: ex.nbytes, on_publish=student.refresh,
        )
        logger.info("TTS: training %d tensors (%.1f MB), stride %d, lr %g",
                    len(self.updater.names), self.updater.memory_bytes()["trainable"] / 1e6, config.stride, config.lr)

    @property
    def stats(self):
        return self.updater.stats

    def end_round(
        self,
        histories: list[list[int]],
        drafts: torch.Tensor,
        num_drafted: torch.Tensor,
        accept_len: torch.Tensor,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
    ) -> None:
        """Snapshot one verified round and advance the updater.

        Args:
            histories: committed tokens per request before the round.
            drafts: ``[B, w] int64``; num_drafted: ``[B]``; accept_len: ``[B]`` (``tau``).
            target_probs: ``[B, >= w, V]`` the target rows at slots ``0..w-1`` (slot ``k-1`` verifies draft k).
            draft_probs: ``[B, w, V]`` the rows the drafts were sampled from.
        """
        counts = supervised_counts(num_drafted.cpu(), accept_len.cpu(), self.config.supervise)
        width = drafts.shape[1]
        weights = position_weights(counts, width, self.config.position_decay)
        examples = []
        for r in range(drafts.shape[0]):
            c = int(counts[r])
            if c == 0:
                continue
            teacher = target_probs[r, :c].float().cpu().clone()  # own storage: a view would pin [B, w, V]
            proximal = draft_probs[r, :c].float().cpu().clone()
            if self.vocab is not None:
                teacher = teacher.index_select(1, self.vocab)
                proximal = proximal.index_select(1, self.vocab)
                mass = teacher.sum(dim=1, keepdim=True)
                keep = mass[:, 0] > 0
                teacher = torch.where(keep[:, None], teacher / mass.clamp_min(1e-30), torch.zeros(()))
                w = weights[r, :c] * keep
            else:
                w = weights[r, :c]
            if not bool((w > 0).any()):
                continue
            context = self.student.context(r, histories[r], self.config.context_window)
            slot = int(self.slots.rows[r]) if self.slots is not None else 0
            vocab = teacher.shape[1]
            teacher_index = proximal_index = None
            if 0 < self.config.topk < vocab:
                teacher, teacher_index = top_k_rows(teacher, self.config.topk)
                proximal, proximal_index = top_k_rows(proximal, self.config.topk)
            examples.append(TTSExample(teacher=teacher, weights=w.clone(), proximal=proximal,
                                       teacher_index=teacher_index, proximal_index=proximal_index, vocab=vocab,
                                       context=context, drafts=drafts[r, :c].clone(), slot=slot))
        drafted = num_drafted > 0
        mean_accept = float((accept_len[drafted] + 1).double().mean()) if bool(drafted.any()) else None
        self.updater.end_round(examples, mean_accept)

    def _loss(self, module: torch.nn.Module, examples: list[TTSExample]) -> torch.Tensor:
        return distillation_loss(self.student, module, examples, self.sampling.temperature,
                                 self.config.proximal_weight)

    def start_batch(self, batch: int) -> None:
        """A new batch of requests: with ``scope="request"`` every request gets a fresh adapter slot."""
        if self.slots is None:
            return
        if batch > self.updater.serving_params[0].shape[0]:
            raise ValueError(f"--tts-scope request has {self.updater.serving_params[0].shape[0]} adapter slots, "
                             f"the batch has {batch} requests")

        def fresh(module):
            for m in module.modules():
                if isinstance(m, PerRequestLoRALinear):
                    m.reset_slots()

        self.updater.reinitialize(fresh)
        self.slots.rows = torch.arange(batch)

    def join(self, count: int) -> None:
        """``count`` requests joined a running batch: with ``scope="request"`` each takes a free adapter slot,
        reset to a fresh adapter (in the serving and the shadow copy; buffered supervision is dropped and the
        optimizer restarts, as at :meth:`start_batch`).

        Raises:
            ValueError: more requests than free adapter slots.
        """
        if self.slots is None or count == 0:
            return
        total = self.updater.serving_params[0].shape[0]
        used = set(self.slots.rows.tolist())
        free = [s for s in range(total) if s not in used]
        if len(free) < count:
            raise ValueError(f"--tts-scope request has {total} adapter slots, {len(used)} in use, {count} joining")
        taken = free[:count]

        def fresh(module):
            for m in module.modules():
                if isinstance(m, PerRequestLoRALinear):
                    m.reset_slots(taken)

        self.updater.reinitialize(fresh)
        self.slots.rows = torch.cat([self.slots.rows, torch.tensor(taken, dtype=torch.int64)])

    def select(self, rows: torch.Tensor) -> None:
        """Requests finished: keep the slots of the remaining rows."""
        if self.slots is not None:
            self.slots.rows = self.slots.rows.index_select(0, rows.cpu())

    def close(self) -> None:
        self.updater.close()

    def summary(self) -> dict:
        """Counters and memory for reports (JSON-serialisable)."""
        s = self.stats
        return {
            "updates": s.updates, "skipped": s.skipped, "rollbacks": s.rollbacks, "publishes": s.publishes,
            "publish_wait_seconds": s.publish_wait_seconds, "train_seconds": s.train_seconds,
            "mean_loss_first10": sum(s.losses[:10]) / max(len(s.losses[:10]), 1),
            "mean_loss_last10": sum(s.losses[-10:]) / max(len(s.losses[-10:]), 1),
            "memory_bytes": self.updater.memory_bytes(),
        }
