"""Test-Time Speculation for DFLASH drafts inside SGLang (block diffusion: one draft forward per block).

The DFLASH draft reads the target's features of the committed tokens as its context and predicts a whole block
``[bonus, mask, ..., mask]`` at once (:class:`specadapt.sglang.students.DFlashStudent`). One
:class:`specadapt.tts.TTSExample` per request and round:

* context (``features``): the request's committed target features (at most ``--tts-context-window``), recorded as SGLang
  materialises them into the draft KV cache (AROUND ``DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc``:
  the prompt's tokens at prefill, the committed block rows after each verification);
* block (``tokens``): ``[bonus, mask, ...]`` of the round (``candidates[:, 0]`` and the worker's mask token);
* teacher: the target's law at the block's draft positions -- the draft's output at block position ``j``
  predicts the token at ``L + j``, the target's verify row ``j - 1`` (AROUND ``_accept_block``; the logits after
  SGLang's in-place penalties and grammar masks, temperature applied); supervised up to the first rejection
  plus one, as the EAGLE path (a DFLASH block is deterministic: no proximal term).

Updates, publishes, rollbacks and the loss (:func:`specadapt.tts.distillation_loss` over
:meth:`~specadapt.sglang.students.dflash.DFlashStudent.example_logits`) are :class:`.tts.SGLangTTS`'s; a
publish also rebuilds SGLang's fused context-KV helper, which keeps copies of the draft's K/V weights.
"""

from __future__ import annotations

import torch

from ..tts import TTSExample
from ..tts.topk import top_k_rows
from .tts import SGLangTTS

__all__ = ["SGLangDFlashTTS"]


class SGLangDFlashTTS(SGLangTTS):
    """TTS state of one scheduler process serving a DFLASH draft.

    Args:
        student: a :class:`~specadapt.sglang.students.DFlashStudent`.
        config: plugin settings; mask_token_id: the worker's mask token (``DFlashWorkerV2._mask_token_id``).
        asynchronous: background trainer (``False``: inline updates, for tests).
    """

    def __init__(self, student, config, mask_token_id: int, asynchronous: bool = True,
                 max_histories: int = 4096) -> None:
        super().__init__(student, config, asynchronous=asynchronous, max_histories=max_histories)
        self.mask_token_id = int(mask_token_id)

    # ---- the serving loop's side ---------------------------------------------------------------------------
    def append_context(self, rids, target_hidden: torch.Tensor, commit_lens=None, extend_lens=None) -> None:
        """Record the committed target features SGLang materialises into the draft KV cache.

        Args:
            rids: the batch's request ids, in row order.
            target_hidden: ``[B*S, F]`` verified block rows (with ``commit_lens [B]``: rows ``< commit_lens[b]``
                of request ``b`` are committed) or ``[sum(extend_lens), F]`` prompt rows (with ``extend_lens
                [B]``).

        Raises:
            ValueError: neither or both of ``commit_lens`` / ``extend_lens``, or rows that do not match them.
        """
        if (commit_lens is None) == (extend_lens is None):
            raise ValueError("append_context needs exactly one of commit_lens (decode) and extend_lens (prefill)")
        feats = target_hidden.detach()
        window = self.config.context_window
        if commit_lens is not None:
            commits = [int(c) for c in torch.as_tensor(commit_lens).reshape(-1).tolist()]
            if feats.shape[0] % max(len(commits), 1):
                raise ValueError(f"{feats.shape[0]} block rows do not split over {len(commits)} requests")
            rows = feats.reshape(len(commits), -1, feats.shape[-1])
            spans = [rows[b, :c] for b, c in enumerate(commits)]
        else:
            lens = [int(n) for n in torch.as_tensor(extend_lens).reshape(-1).tolist()]
            if sum(lens) > feats.shape[0]:
                raise ValueError(f"extend_lens sum to {sum(lens)} rows, target_hidden has {feats.shape[0]}")
            spans = list(feats[: sum(lens)].split(lens))
        for rid, span in zip(rids, spans):
            hist = self._history(rid, window)
            for row in span[-window:].clone():
                hist.append(row)

    def record_block(self, rids, candidates: torch.Tensor, target_logits: torch.Tensor | None, temperatures,
                     accepted) -> None:
        """One example per request with committed context: the round's block and the target law at its drafts.

        Args:
            candidates: ``[B, S]`` verified block (slot 0 the bonus token, then the drafts).
            target_logits: ``[B*S, V]`` the target's verify logits (``None``: skipped round, e.g. logits not
                gathered); temperatures: ``[B]`` or ``[B, 1]`` (0 is treated as 1).
            accepted: ``[B]`` drafts accepted (tau).
        """
        if target_logits is None:
            return
        batch, slots = candidates.shape
        logits = target_logits.reshape(batch, slots, -1)
        temps = torch.as_tensor(temperatures).reshape(batch).float().tolist()
        taus = [int(a) for a in torch.as_tensor(accepted).reshape(-1).tolist()]
        block = torch.full((slots,), self.mask_token_id, dtype=torch.int64, device=candidates.device)
        for b, rid in enumerate(rids):
            hist = self.history.get(rid)
            if not hist or slots < 2:
                continue
            tau = taus[b]
            if not 0 <= tau <= slots - 1:
                raise ValueError(f"accepted[{b}] = {tau} outside [0, {slots - 1}]")
            # only the supervised rows (up to the first rejection plus one): the rest carry zero weight
            temp = temps[b] if temps[b] > 0 else 1.0
            rows = self._draft_rows(torch.softmax(logits[b, : min(tau + 1, slots - 1)].float() / temp, dim=-1),
                                    renormalise=True)
            vocab = rows.shape[-1]
            index = None
            if 0 < self.config.topk < rows.shape[-1]:
                rows, index = top_k_rows(rows, self.config.topk)
            example_block = block.clone()
            example_block[0] = candidates[b, 0]
            self.history.move_to_end(rid)
            weights = self._weights(slots - 1, tau)[: rows.shape[0]]  # every kept row is supervised
            self._pending.append(TTSExample(teacher=rows.detach().clone(), weights=weights, teacher_index=index,
                                            vocab=vocab, tokens=example_block, features=torch.stack(list(hist)),
                                            accepted=tau))
        if taus:
            self._pending_acceptance.append(sum(t + 1 for t in taus) / len(taus))
