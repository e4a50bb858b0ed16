"""The EAGLE-style draft proposer (``--draft eagle``): drives an :class:`~specadapt.engine.eagle.EagleHead`
with its own ragged KV cache from the target's hidden states.

Bookkeeping. The head's cache holds pairs ``(f_i, x_{i+1})`` (target features of position ``i``, next token)
for the committed positions ``i <= n-2`` of each request, where ``x_{n-1}`` is the newest committed token (the
round's slot 0, which the target has not scored yet). Its output at position ``n-2`` is ``q(x_n)``, the first
draft. Each further draft feeds ``(g, drafted token)`` with the head's own output ``g`` in place of target
features; those entries are dropped after verification and the round's real pairs are fed at the start of the
next round: the target's features of slots ``0..tau`` paired with the ``tau + 1`` tokens the round emitted.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, logits_to_probs_rows
from .drafts import (Draft, DraftProposal, _step_history, apply_draft_filter, draft_coins, draw_tokens, empty_proposal,
                     pad_token_lists, trim_proposal)
from .eagle import EagleHead
from .kv import RaggedKVCache

__all__ = ["EagleDraft"]


class EagleDraft(Draft):
    """Draft proposer over an EAGLE head (see the module docstring).

    Args:
        head: an attached :class:`EagleHead`.
        sampling: the run's sampling transform (applied to the head's logits over its draft vocabulary).
        seed: the draft's own seed (mixed into the coins it samples with, :func:`~specadapt.engine.drafts.draft_coins`).
        name: label in reports.
        window: recent ``(feature, token)`` pairs kept per request for Test-Time Speculation snapshots (kept
            only once :meth:`tts_student` has been asked for: without TTS nothing reads them).
    """

    needs_target_hidden = True
    supports_paths = True

    def __init__(
        self, head: EagleHead, sampling: SamplingParams, seed: int = 0, name: str = "eagle", window: int = 64,
        native=None,
    ) -> None:
        self.head = head
        self.native = native  # a specadapt.engine.native.NativeEagleHead, or None for transformers' modules
        self.feature_layers = tuple(head.feature_layers)  # target hidden_states the engine must capture
        self.model = head  # the module Test-Time Speculation trains
        self.sampling = sampling
        self.seed = int(seed)
        self.name = name
        self.window = window
        self.record_context = False  # set by tts_student(): keep the recent pairs TTS trains on
        self.kv: RaggedKVCache | None = None
        self._pending: torch.Tensor | None = None  # [B, m, 3h] features not yet fed
        self._pending_counts: torch.Tensor | None = None  # [B]
        self._round_features: torch.Tensor | None = None
        self._awaiting_prefill = False
        self._prompt_pairs: torch.Tensor | None = None
        self._fed_before: torch.Tensor | None = None
        self._paths = 1
        self.recent_features: list[torch.Tensor] = []  # per request [w, 3h], the last `window` fed pairs
        self.recent_tokens: list[torch.Tensor] = []  # per request [w] int64

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``[B, n, 3h]`` features of one target forward (its ``hidden_states`` tuple)."""
        return self.head.target_features(hidden_states)

    def start(self, histories):
        batch = len(histories)
        if self.native is not None:
            from .native import SlotKVCache

            self.kv = SlotKVCache(self.native, batch, capacity=self.context_capacity)
        else:
            self.kv = RaggedKVCache(self.head, batch)
        self._awaiting_prefill = True
        self._prompt_pairs = torch.tensor([len(h) - 1 for h in histories], dtype=torch.int64)
        self._pending = None
        self._pending_counts = torch.zeros(batch, dtype=torch.int64)
        self._fed_before = None
        self._paths = 1
        hidden3 = 3 * self.head.hidden_size
        self.recent_features = [torch.zeros(0, hidden3) for _ in range(batch)]
        self.recent_tokens = [torch.zeros(0, dtype=torch.int64) for _ in range(batch)]

    def observe_target(self, features: torch.Tensor) -> None:
        """Receive ``[B, n, 3h]`` target features: of the prompt prefill (positions ``0..P-2``) right after
        :meth:`start`, or of the round's verified slots (slot 0 first) before :meth:`commit`."""
        features = features.detach()
        if self._awaiting_prefill:
            self._awaiting_prefill = False
            self._pending = features
            self._pending_counts = self._prompt_pairs.clone()
        else:
            self._round_features = features

    def _feed_pending(self, histories: list[list[int]], rows: torch.Tensor | None = None):
        """Feed the pending real pairs of ``rows`` (``[B]`` bool, default all; the other rows keep theirs: their
        catch-up is deferred to a later round, one chunk then); return ``(g [B, h], logits [B, Vd], has_context
        [B] bool)`` (meaningful for the fed rows)."""
        batch = len(histories)
        pending = self._pending_counts if self._pending_counts is not None else torch.zeros(batch, dtype=torch.int64)
        fed = torch.ones(batch, dtype=torch.bool) if rows is None else rows.cpu().to(torch.bool)
        counts = torch.where(fed, pending, torch.zeros_like(pending))
        width = int(counts.max()) if batch else 0
        hidden = self.head.hidden_size
        if width == 0:
            has = self.kv.lengths.cpu() > 0
            if bool((has & fed).any()):
                raise RuntimeError("EAGLE draft has context but no pending pairs: observe_target was not called")
            dtype = self.head.fuse.weight.dtype
            return torch.zeros(batch, hidden, dtype=dtype), torch.zeros(batch, self.head.draft_vocab.numel()), has
        ids, _ = pad_token_lists([h[len(h) - int(c) :] if c else []
                                  for h, c in zip(histories, counts.tolist())])  # [B, width]
        feats = self._pending[:, :width]
        out = self.kv.forward(ids, counts, return_outputs=True, features=feats)
        last = (counts - 1).clamp_min(0)
        index = torch.arange(batch)
        for r in range(batch if self.record_context else 0):
            c = int(counts[r])
            if c:
                self.recent_features[r] = torch.cat([self.recent_features[r], feats[r, :c].float().cpu()])[-self.window :]
                self.recent_tokens[r] = torch.cat([self.recent_tokens[r], ids[r, :c]])[-self.window :]
        left = pending - counts  # deferred rows keep their pairs, at the front of the buffer
        self._pending = None if not bool(left.any()) else self._pending
        self._pending_counts = left
        return out.hidden[index, last], out.logits[index, last].float(), self.kv.lengths.cpu() > 0

    def _sample(self, logits: torch.Tensor, coins: torch.Tensor, history=None):
        """Sample ``n`` tokens per row of the head's logits ``[R, Vd]`` (over ``head.draft_vocab``) with
        ``coins [R, n]``; ``history``: the rows' ``TokenCounts`` ``[R, V]`` over the target vocabulary (the
        penalties and logit bias are keyed by target ids) or ``None``. Returns ``(ids [R, n]`` target ids,
        ``q_small [R, Vd])``."""
        q = logits_to_probs_rows(logits, self.sampling_for_rows(logits.shape[0]), history,
                                 vocab_ids=self.head.draft_vocab).cpu()
        picks = draw_tokens(q, coins)
        return self.head.draft_vocab.cpu()[picks], q

    def _step(self, tokens: torch.Tensor, g: torch.Tensor):
        out = self.kv.forward(tokens[:, None], torch.ones(tokens.shape[0], dtype=torch.int64), return_outputs=True, features=g[:, None])
        return out.hidden[:, -1], out.logits[:, -1].float()

    def propose(self, histories, max_tokens, vocab_size, draft_filter=None) -> DraftProposal:
        assert self.kv is not None, "start() must be called first"
        batch = len(histories)
        drafting = max_tokens.to(torch.int64) > 0
        if not bool(drafting.any()):  # speculation off for every row: no draft work, the catch-up is deferred
            self._fed_before = self.kv.lengths.cpu().clone()
            proposal = empty_proposal(batch, 0, vocab_size)
            proposal.num_tokens = torch.zeros(batch, dtype=torch.int64)
            return proposal
        g, logits, has_context = self._feed_pending(histories, rows=drafting)
        self._fed_before = self.kv.lengths.cpu().clone()
        num = torch.where(has_context & drafting, max_tokens.to(torch.int64), torch.zeros_like(max_tokens, dtype=torch.int64))
        length = int(num.max()) if batch else 0
        proposal = empty_proposal(batch, length, vocab_size)
        proposal.num_tokens = num
        vocab = self.head.draft_vocab.cpu()
        history = _step_history(self.history_counts, self.sampling)  # committed + drafts[:i]
        for i in range(length):
            token, q = self._sample(logits, draft_coins(self, histories, torch.full((batch, 1), i)), history)
            token = token[:, 0]
            if history is not None:
                history.add_(token)
            proposal.tokens[:, i] = token
            proposal.probs[:, i].index_copy_(1, vocab, q)
            if not apply_draft_filter(draft_filter, proposal, i):
                break
            if i + 1 < length:
                g, logits = self._step(token, g)
        trim_proposal(proposal)
        num = proposal.num_tokens
        length = proposal.tokens.shape[1]
        live = torch.arange(length)[None, :] < num[:, None]
        proposal.tokens = torch.where(live, proposal.tokens, torch.zeros_like(proposal.tokens))
        proposal.probs = proposal.probs * live[:, :, None]
        return proposal

    def propose_paths(self, histories, num_drafts, vocab_size, num_paths):
        assert self.kv is not None, "start() must be called first"
        if num_drafts < 1 or num_paths < 1:
            raise ValueError("propose_paths needs num_drafts >= 1 and num_paths >= 1")
        batch = len(histories)
        g, logits, has_context = self._feed_pending(histories)
        if not bool(has_context.all()):
            raise ValueError("GBV with the EAGLE draft needs prompts of at least 2 tokens")
        self._fed_before = self.kv.lengths.cpu().clone()
        vocab = self.head.draft_vocab.cpu()
        tokens = torch.zeros(batch, num_paths, num_drafts, dtype=torch.int64)
        probs = torch.zeros(batch, num_paths, num_drafts, vocab_size, dtype=torch.float32)
        history = _step_history(self.history_counts, self.sampling)
        first, q = self._sample(logits, draft_coins(self, histories, torch.arange(num_paths).expand(batch, -1)),
                                history)
        tokens[:, :, 0] = first
        probs[:, :, 0].index_copy_(2, vocab, q[:, None].expand(batch, num_paths, -1).contiguous())
        self._paths = 1
        if num_drafts > 1:
            self.kv.repeat_interleave(num_paths)
            g = g.repeat_interleave(num_paths, dim=0)
            self._paths = num_paths
            if history is not None:
                history = history.repeat_interleave(num_paths)  # row b * K + k: path k of request b
        for i in range(1, num_drafts):
            g, logits = self._step(tokens[:, :, i - 1].reshape(-1), g)
            if history is not None:
                history.add_(tokens[:, :, i - 1].reshape(-1))
            index = (i * num_paths + torch.arange(num_paths)).expand(batch, -1)
            token, q = self._sample(logits, draft_coins(self, histories, index).reshape(-1, 1), history)
            tokens[:, :, i] = token.reshape(batch, num_paths)
            probs[:, :, i].index_copy_(2, vocab, q.reshape(batch, num_paths, -1))
        return tokens, probs

    def select_path(self, chosen):
        if self.kv is not None and self._paths > 1:
            self.kv.select(torch.arange(chosen.shape[0]) * self._paths + chosen.to(torch.int64))
        self._paths = 1

    def commit(self, accept_len):
        if self.kv is None or self._fed_before is None:
            return
        self.kv.truncate(self._fed_before)  # drop the entries fed with the head's own outputs
        self._fed_before = None
        if self._round_features is None:
            raise RuntimeError("EAGLE draft: the loop did not pass the round's target features (observe_target)")
        counts = accept_len.to(torch.int64) + 1
        self._append_pending(self._round_features, counts)
        self._round_features = None

    def _append_pending(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first ``counts[r]`` of ``features [B, n, 3h]`` to row ``r``'s pending pairs (after the pairs
        a deferred catch-up left there); the buffer grows by doubling, so rounds of deferral cost O(1) each."""
        old_counts = self._pending_counts
        if self._pending is None or old_counts is None or not bool(old_counts.any()):
            self._pending = features[:, : int(counts.max())]
            self._pending_counts = counts
            return
        total = old_counts + counts
        buffer = self._pending
        need = int(total.max())
        if need > buffer.shape[1]:
            grown = buffer.new_zeros(buffer.shape[0], max(need, 2 * buffer.shape[1]), buffer.shape[2])
            grown[:, : buffer.shape[1]] = buffer
            buffer = grown
        width = int(counts.max())
        offsets = torch.arange(width)
        new = offsets[None, :] < counts[:, None]  # [B, width]: the pairs this round adds
        row_index = torch.arange(buffer.shape[0])[:, None].expand_as(new)
        buffer[row_index[new], (old_counts[:, None] + offsets[None, :])[new]] = features[:, :width][new].to(buffer.dtype)
        self._pending = buffer
        self._pending_counts = total

    def select(self, rows):
        if self.kv is not None:
            self.kv.select(rows)
        rows_cpu = rows.cpu()
        if self.row_seeds is not None:
            self.row_seeds = self.row_seeds.index_select(0, rows_cpu)
        if self._pending is not None:
            self._pending = self._pending.index_select(0, rows.to(self._pending.device))
        if self._pending_counts is not None:
            self._pending_counts = self._pending_counts.index_select(0, rows_cpu)
        if self._fed_before is not None:
            self._fed_before = self._fed_before.index_select(0, rows_cpu)
        keep = rows_cpu.tolist()
        self.recent_features = [self.recent_features[r] for r in keep]
        self.recent_tokens = [self.recent_tokens[r] for r in keep]

    def join(self, histories, features=None):
        """New rows between rounds: an empty cache row each, their prompt prefill's features pending (fed at
        the next proposal together with the other rows' accepted pairs, as after :meth:`start`)."""
        count = len(histories)
        if count == 0:
            return
        self.kv.add_rows(count)
        new_counts = torch.tensor([len(h) - 1 for h in histories], dtype=torch.int64)
        old = self._pending
        old_counts = self._pending_counts if self._pending_counts is not None else torch.zeros(0, dtype=torch.int64)
        width = max(int(old_counts.max()) if old_counts.numel() else 0, int(new_counts.max()))
        hidden3 = 3 * self.head.hidden_size
        ref = features if features is not None else old
        dtype = ref.dtype if ref is not None else torch.float32
        device = ref.device if ref is not None else "cpu"
        pending = torch.zeros(old_counts.numel() + count, width, hidden3, dtype=dtype, device=device)
        if old is not None and old_counts.numel():
            w = min(width, old.shape[1])
            pending[: old_counts.numel(), :w] = old[:, :w].to(dtype)
        if features is not None and features.shape[1]:
            w = min(width, features.shape[1])
            pending[old_counts.numel():, :w] = features[:, :w].detach().to(device, dtype)
        self._pending = pending
        self._pending_counts = torch.cat([old_counts, new_counts])
        self.recent_features += [torch.zeros(0, hidden3) for _ in range(count)]
        self.recent_tokens += [torch.zeros(0, dtype=torch.int64) for _ in range(count)]

    def tts_student(self):
        """Test-Time Speculation trains the head (:class:`~.tts_students.EagleDraftStudent`)."""
        from .tts_students import EagleDraftStudent

        self.record_context = True
        return EagleDraftStudent(self)
