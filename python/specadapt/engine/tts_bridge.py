"""Test-Time Speculation in the embedded engine: turns each verified round into supervision for
:class:`specadapt.tts.TTSUpdater` and supplies the draft's differentiable forward as its loss.

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
from dataclasses import dataclass
from typing import Any

import torch

from ..sampling import SamplingParams
from ..tts import (
    TTSConfig,
    TTSUpdater,
    add_lora,
    add_per_request_lora,
    dense_rows,
    find_lora_slots,
    position_weights,
    supervised_counts,
    top_k_rows,
    tts_loss,
)
from ..tts.lora import PerRequestLoRALinear

logger = logging.getLogger(__name__)

__all__ = ["TTSExample", "EngineTTS"]


@dataclass
class TTSExample:
    """Supervision of one request in one round (CPU tensors).

    Attributes:
        context: draft-specific context (see the module docstring).
        drafts: ``[C] int64`` drafted tokens of the supervised positions.
        teacher: ``[C, V'] float32`` target rows (over the draft vocabulary ``V'``), or with ``--tts-topk k`` the
            ``[C, k]`` renormalised top-k values whose token ids are ``teacher_index``.
        proximal: ``[C, V'] float32`` the draft's rows ``q_t`` that drafted the round (top-k as ``teacher``).
        weights: ``[C] float32`` position weights.
        slot: the request's adapter slot (``--tts-scope request``), else 0.
        teacher_index, proximal_index: ``[C, k] int32`` ids of the kept entries; ``None`` for dense rows.
        vocab: ``V'``, the width of the dense rows.
    """

    context: Any
    drafts: torch.Tensor
    teacher: torch.Tensor
    proximal: torch.Tensor
    weights: torch.Tensor
    slot: int = 0
    teacher_index: torch.Tensor | None = None
    proximal_index: torch.Tensor | None = None
    vocab: int | None = None

    @property
    def nbytes(self) -> int:
        parts = list(self.context) if isinstance(self.context, tuple) else [self.context]
        tensors = parts + [self.drafts, self.teacher, self.proximal, self.weights, self.teacher_index,
                           self.proximal_index]
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    def teacher_rows(self) -> torch.Tensor:
        """``[C, V']`` dense teacher rows (zeros outside the top-k when truncated)."""
        return dense_rows(self.teacher, self.teacher_index, self.vocab)

    def proximal_rows(self) -> torch.Tensor:
        """``[C, V']`` dense drafting rows ``q_t`` (zeros outside the top-k when truncated)."""
        return dense_rows(self.proximal, self.proximal_index, self.vocab)


class EngineTTS:
    """Test-Time Speculation of one model draft (``self:N``, a standalone LM, or the EAGLE head).

    Args:
        draft: a draft with the ``tts_*`` hooks (:class:`~specadapt.engine.drafts.ModelDraft`,
            :class:`~specadapt.engine.eagle_draft.EagleDraft`).
        config: :class:`~specadapt.tts.TTSConfig`.
        sampling: the run's sampling settings (the student's temperature).
        asynchronous: background-thread updates (default) or inline.
        max_requests: concurrent requests (adapter slots of ``scope="request"``).

    Raises:
        ValueError: a draft without trainable layers (``ngram``, target-only).
    """

    def __init__(
        self, draft, config: TTSConfig, sampling: SamplingParams, asynchronous: bool = True, max_requests: int = 1
    ) -> None:
        module = getattr(draft, "model", None)
        if module is None or not hasattr(draft, "tts_student_logits"):
            raise ValueError(f"--tts needs a model draft (eagle, self:N or a model path), not {draft.name!r}")
        self.draft = draft
        self.config = config
        self.sampling = sampling
        prefixes = list(draft.tts_trainable_prefixes)
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

            def trainable(name, _):
                return any(name == p or name.startswith(p + ".") for p in prefixes) and ".lora_" not in name

        if hasattr(draft, "window"):  # the EAGLE proposer keeps this many recent (feature, token) pairs
            draft.window = max(draft.window, config.context_window)
        self.vocab = draft.tts_vocab()
        self.updater = TTSUpdater(
            module, trainable, self._loss, config, share=draft.tts_shared(), asynchronous=asynchronous,
            example_bytes=lambda ex: ex.nbytes, on_publish=getattr(draft, "tts_refresh", None),
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
            context = self.draft.tts_context(r, histories[r], self.config.context_window)
            slot = int(self.slots.rows[r]) if self.slots is not None else 0
            vocab = teacher.shape[1]
            teacher_index = proximal_index = None
            if 0 < self.config.topk < vocab:
                teacher, teacher_index = top_k_rows(teacher, self.config.topk)
                proximal, proximal_index = top_k_rows(proximal, self.config.topk)
            examples.append(TTSExample(context, drafts[r, :c].clone(), teacher, proximal, w.clone(), slot,
                                       teacher_index, proximal_index, vocab))
        drafted = num_drafted > 0
        mean_accept = float((accept_len[drafted] + 1).double().mean()) if bool(drafted.any()) else None
        self.updater.end_round(examples, mean_accept)

    def _loss(self, module: torch.nn.Module, examples: list[TTSExample]) -> torch.Tensor:
        width = max(ex.drafts.shape[0] for ex in examples)
        vocab = examples[0].vocab if examples[0].vocab is not None else examples[0].teacher.shape[1]
        n = len(examples)
        device = next(p for p in module.parameters()).device
        student = []
        teacher = torch.zeros(n, width, vocab)
        proximal = torch.zeros(n, width, vocab)
        weights = torch.zeros(n, width)
        shadow_slots = find_lora_slots(module) if self.slots is not None else None
        batched = getattr(self.draft, "tts_student_logits_batch", None)
        if batched is not None:  # one padded pass over all examples
            if shadow_slots is not None:
                shadow_slots.rows = torch.tensor([ex.slot for ex in examples])
            student = batched(module, [ex.context for ex in examples], [ex.drafts for ex in examples]).float()
        for i, ex in enumerate(examples):
            c = ex.drafts.shape[0]
            if batched is None:
                if shadow_slots is not None:
                    shadow_slots.rows = torch.tensor([ex.slot])
                logits = self.draft.tts_student_logits(module, ex.context, ex.drafts).float()
                if c < width:
                    logits = torch.cat([logits, logits.new_zeros(width - c, logits.shape[1])])
                student.append(logits)
            teacher[i, :c] = ex.teacher_rows()
            proximal[i, :c] = ex.proximal_rows()
            weights[i, :c] = ex.weights
        if batched is None:
            student = torch.stack(student)
        return tts_loss(
            student, teacher.to(device), weights.to(device), self.sampling.temperature,
            proximal.to(device), self.config.proximal_weight,
        )

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
