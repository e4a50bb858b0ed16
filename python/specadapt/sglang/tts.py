"""Test-Time Speculation inside SGLang: per-round snapshots, strided asynchronous updates, in-place publishes.

The technique is :class:`specadapt.tts.TTSUpdater` (shadow copy, background trainer on a side CUDA stream,
publish by ``torch._foreach_copy_`` into the serving tensors, rollback); this module feeds it from SGLang:

* :meth:`SGLangTTS.snapshot` -- called around ``eagle_sample`` right after the target's verify forward -- clones
  what distillation needs out of SGLang's graph-owned buffers (they are rewritten at the next replay): per
  request the verified tokens ``[S]``, the target's aux hidden states ``[S, H]``, the target law on the draft
  vocabulary ``[S, V_d]`` (temperature applied) and the rows ``q`` the round was drafted from ``[S-1, V_d]``.
* :meth:`SGLangTTS.record` -- after acceptance -- turns the snapshot into one example per request, with the
  request's committed history (features and tokens, at most ``tts_context_window``) as context.
* :meth:`SGLangTTS.on_round_start` -- at the entry of the worker's ``forward_batch_generation`` for decode
  batches, on the forward stream -- hands the round's examples to the updater, which at every S-th round
  publishes the update in flight (stream-ordered before the next draft replay) and launches the next one.
  Every TP rank counts the same rounds, so publishes happen at the same round everywhere.

The differentiable draft forward is a :class:`~.students.SGLangStudent` (:mod:`specadapt.sglang.students`):
SGLang's own draft modules run fused kernels without autograd, so the student re-implements the draft in plain
torch over parameters that alias SGLang's tensors (publishes land in the storage CUDA graphs replay). Examples are
:class:`specadapt.tts.TTSExample`; the loss is :func:`specadapt.tts.distillation_loss`.
"""

from __future__ import annotations

import collections
import logging

import torch
from torch import nn

from ..tts import TTSExample, TTSUpdater, distillation_loss
from ..tts.loss import position_weights, supervised_counts
from ..tts.topk import top_k_rows
from .config import PluginConfig
from .students._common import SGLangStudent

logger = logging.getLogger("specadapt.sglang")

__all__ = ["SGLangTTS"]


class SGLangTTS:
    """TTS state of one scheduler process.

    Args:
        student: the draft's :class:`~.students.SGLangStudent`.
        config: plugin settings.
        asynchronous: background trainer (``False``: inline updates, for tests and debugging).
        max_histories: request histories kept at most (least recently updated dropped first).

    Raises:
        ValueError: the student selects no trainable parameter.
    """

    def __init__(self, student: SGLangStudent, config: PluginConfig, asynchronous: bool = True,
                 max_histories: int = 4096) -> None:
        self.student = student
        self.config = config.tts_config()
        self.updater = TTSUpdater(student.module, student.trainable, self._loss, self.config,
                                  on_publish=student.refresh, asynchronous=asynchronous,
                                  example_bytes=lambda ex: ex.nbytes)
        # request id -> committed context; least recently used first. Bounded: a request that finishes at
        # prefill (or is aborted there) never reaches SGLang's note_request_finished for decode results.
        self.history: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self.max_histories = int(max_histories)
        self._pending: list[TTSExample] = []
        self._pending_acceptance: list[float] = []
        self.rounds = 0

    # ---- the serving loop's side ---------------------------------------------------------------------------
    def snapshot(self, rids, tokens, features, target_logits, temperatures, draft_probs=None) -> dict:
        """Clone one verify round out of SGLang's buffers (call before acceptance mutates the logits).

        Args:
            rids: request ids, ``B`` of them.
            tokens: ``[B*S]`` or ``[B, S]`` int verified tokens (slot 0 = last committed token, then L drafts).
            features: ``[B*S, H]`` target aux hidden states at those slots, or ``None`` for a student that reads
                none (``uses_features = False``: a STANDALONE draft).
            target_logits: ``[B*S, V]`` the target's raw logits.
            temperatures: ``[B]`` or ``[B, 1]`` sampling temperatures (0 is treated as 1: greedy decoding
                only needs the argmax, and a tempered law is a better teacher than a one-hot).
            draft_probs: ``[B, L, V]`` q rows of the round or ``None``.

        Returns:
            An opaque snapshot for :meth:`record`.
        """
        batch = len(rids)
        tokens = tokens.reshape(batch, -1)
        slots = tokens.shape[1]
        logits = target_logits.reshape(batch, slots, -1).float()
        temps = temperatures.reshape(batch, 1, 1).float().to(logits.device)
        temps = torch.where(temps > 0, temps, torch.ones_like(temps))
        teacher = self._draft_rows(torch.softmax(logits / temps, dim=-1), renormalise=True)
        drafted = self._draft_rows(draft_probs.float()) if draft_probs is not None else None
        if features is None or not self.student.uses_features:
            features = teacher.new_zeros(batch, slots, 0)  # a STANDALONE draft reads no target features
        snap = {
            "rids": list(rids),
            "tokens": tokens.to(torch.int64).clone(),
            "features": features.reshape(batch, slots, -1).detach().clone(),
            "teacher": teacher.detach(),  # fresh tensors already
            "drafted": drafted.detach().clone() if drafted is not None else None,
        }
        if self.updater.stream is not None:  # the update reading these runs on the trainer's side stream
            for value in snap.values():
                if isinstance(value, torch.Tensor):
                    value.record_stream(self.updater.stream)
        return snap

    def _draft_rows(self, rows: torch.Tensor, renormalise: bool = False) -> torch.Tensor:
        """``[..., V]`` target-vocabulary rows -> the draft's output vocabulary ``[..., V_d]`` (hot ids of an EAGLE-3
        head; the first ``vocab_size`` ids of a padded target vocabulary), renormalised for a teacher."""
        vocab_ids = self.student.draft_vocab
        draft_width = self.student.vocab_size
        if vocab_ids is not None:
            rows = rows.index_select(-1, vocab_ids.to(rows.device))
        elif rows.shape[-1] != draft_width:
            if rows.shape[-1] < draft_width:
                raise ValueError(f"TTS: the target's logits have {rows.shape[-1]} columns, fewer than the "
                                 f"draft's vocabulary ({draft_width})")
            rows = rows[..., :draft_width]  # a padded target vocabulary: the draft cannot propose the rest
        else:
            return rows
        return rows / rows.sum(-1, keepdim=True).clamp_min(1e-30) if renormalise else rows

    def select_path(self, snap: dict, path_nodes: torch.Tensor, draft_probs: torch.Tensor | None) -> dict:
        """Keep one root-to-leaf path per request of a snapshot taken over a verify tree (GBV: the chosen path).

        Args:
            snap: :meth:`snapshot` of all ``N`` tree nodes (``draft_probs=None``).
            path_nodes: ``[B, L+1]`` local node ids (root first) of the path to keep.
            draft_probs: ``[B, L, V]`` the q rows the path's drafts were sampled from, or ``None``.

        Returns:
            A snapshot of the path in chain layout (slot ``j`` = the path's depth-``j`` node), for :meth:`record`.
        """
        nodes = path_nodes.to(torch.int64).to(snap["tokens"].device)
        gather = lambda t: t.gather(1, nodes.reshape(*nodes.shape, *([1] * (t.dim() - 2))).expand(  # noqa: E731
            -1, -1, *t.shape[2:]))
        out = dict(snap)
        out["tokens"] = snap["tokens"].gather(1, nodes)
        out["features"] = gather(snap["features"])
        out["teacher"] = gather(snap["teacher"])
        out["drafted"] = None if draft_probs is None else self._draft_rows(draft_probs.float()).detach().clone()
        return out

    def record(self, snap: dict, accepted) -> None:
        """Build the round's examples from ``snap`` and ``accepted`` (``[B]`` drafts accepted, bonus excluded)
        and extend each request's committed history."""
        accepted = [int(a) for a in torch.as_tensor(accepted).reshape(-1).tolist()]
        window = self.config.context_window
        slots = snap["tokens"].shape[1]
        for b, rid in enumerate(snap["rids"]):
            tau = accepted[b]
            if not 0 <= tau <= slots - 1:
                raise ValueError(f"accepted[{b}] = {tau} outside [0, {slots - 1}]")
            hist = self._history(rid, window + 1)
            feats = snap["features"][b]
            toks = snap["tokens"][b]
            if slots >= 2:  # a round with drafts: one example
                # inputs: the context's tokens after its first (each with its predecessor's feature), then the
                # round's slots 0..L-1; slot 0's predecessor is the newest context entry (zeros without context)
                ctx_feats = [f for f, _ in hist]
                ctx_toks = [t for _, t in hist]
                prev = ctx_feats[-1] if hist else torch.zeros_like(feats[0])
                in_tokens = torch.stack(ctx_toks[1:] + list(toks[: slots - 1]))
                in_feats = torch.stack(ctx_feats[:-1] + [prev] + list(feats[: slots - 2]))
                teacher = snap["teacher"][b, : slots - 1]
                drafted = None if snap["drafted"] is None else snap["drafted"][b]
                vocab = teacher.shape[-1]
                teacher_index = drafted_index = None
                if 0 < self.config.topk < vocab:
                    teacher, teacher_index = top_k_rows(teacher, self.config.topk)
                    if drafted is not None:
                        drafted, drafted_index = top_k_rows(drafted, self.config.topk)
                self._pending.append(TTSExample(
                    teacher=teacher, weights=self._weights(slots - 1, tau, first_valid=not hist), proximal=drafted,
                    teacher_index=teacher_index, proximal_index=drafted_index, vocab=vocab, tokens=in_tokens,
                    features=in_feats, accepted=tau, first_valid=0 if hist else 1,
                ))
            for j in range(tau + 1):  # committed slots: the last committed token and the accepted drafts
                hist.append((feats[j], toks[j]))
        if accepted:
            self._pending_acceptance.append(sum(a + 1 for a in accepted) / len(accepted))

    def on_round_start(self) -> None:
        """Round boundary (entry of ``forward_batch_generation`` of a decode batch): hand over the last round."""
        if not self._pending and not self._pending_acceptance:
            return
        acceptance = self._pending_acceptance[-1] if self._pending_acceptance else None
        examples, self._pending, self._pending_acceptance = self._pending, [], []
        self.rounds += 1
        self.updater.end_round(examples, acceptance)

    def _history(self, rid: str, maxlen: int) -> collections.deque:
        """The request's history (created empty), marked most recently used; evicts beyond ``max_histories``."""
        hist = self.history.get(rid)
        if hist is None:
            hist = self.history[rid] = collections.deque(maxlen=maxlen)
            while len(self.history) > self.max_histories:
                self.history.popitem(last=False)
        self.history.move_to_end(rid)
        return hist

    def request_finished(self, rid: str) -> None:
        """Drop a finished request's history."""
        self.history.pop(rid, None)

    def close(self) -> None:
        self.updater.close()

    def _weights(self, num: int, accepted: int, first_valid: bool = False) -> torch.Tensor:
        """``[num] float32`` position weights of a round of ``num`` drafts with ``accepted`` of them accepted:
        ``gamma^(k-1)`` up to the first rejection plus one, 0 after; position 1 unsupervised when it has no
        preceding feature (``first_valid``).

        Raises:
            ValueError: ``accepted`` outside ``[0, num]``.
        """
        counts = supervised_counts(torch.tensor([num]), torch.tensor([accepted]), "accepted")
        weights = position_weights(counts, num, self.config.position_decay)[0].clone()
        if first_valid:
            weights[0] = 0.0
        return weights

    # ---- the trainer's side --------------------------------------------------------------------------------
    def _loss(self, module: nn.Module, examples: list[TTSExample]) -> torch.Tensor:
        return distillation_loss(self.student, module, examples, 1.0, self.config.proximal_weight)
