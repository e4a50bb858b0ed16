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
                     pad_token_lists, path_step_counts, trim_proposal, zero_hole_rows)
from .eagle import EagleHead
from .kv import RaggedKVCache
from .pending import PendingFeatures

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
        self._pending: PendingFeatures | None = None  # target features not fed to the head yet, per row
        self._round_features: torch.Tensor | None = None
        self._awaiting_prefill = False
        self._prompt_pairs: torch.Tensor | None = None
        # a probe's scratch context (probe_window): (rows [B] bool, their cache lengths before it, skipped pairs)
        self._scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._fed_before: torch.Tensor | None = None  # the head's cache lengths before this round's feed
        self._round_open = False  # propose / propose_paths ran and commit has not yet
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
        self._fed_before = None
        self._scratch = None
        self._round_open = False
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
            self._pending = self._new_pending(features.shape[-1], features.dtype, features.device)
            self._pending.add_rows(features, self._prompt_pairs)
        else:
            self._round_features = features

    def _new_pending(self, feature_size: int, dtype: torch.dtype, device) -> PendingFeatures:
        """The deferred catch-up queues; on CPU their store reserves the batch's context capacity (a row's
        queue never holds more pairs than its context, within the store's 2 GiB cap), so it is copied to grow
        only when the batch outgrows its slots or the cap binds."""
        device = torch.device(device)
        return PendingFeatures(feature_size, dtype, device,
                               reserve=int(self.context_capacity) if device.type == "cpu" else 0)

    def _feed_pending(self, histories: list[list[int]], rows: torch.Tensor | None = None):
        """Feed the pending real pairs of ``rows`` (``[B]`` bool, default all; the other rows keep theirs: their
        catch-up is deferred to a later round, one chunk then); return ``(g [B, h], logits [B, Vd], has_context
        [B] bool)`` (meaningful for the fed rows). With :attr:`probe_window` set, a fed row outside
        :attr:`catch_up_rows` with more pending pairs than the window reads only its newest ``probe_window``
        (a scratch context, rolled back at :meth:`commit`)."""
        batch = len(histories)
        fed = torch.ones(batch, dtype=torch.bool) if rows is None else rows.cpu().to(torch.bool)
        self._scratch = None
        window = self.probe_window
        if self._pending is None:
            feats, counts = None, torch.zeros(batch, dtype=torch.int64)
        elif window is None:
            feats, counts = self._pending.take(fed)
        else:  # a probe, or a speculative round with catch_up "budget": rows with more than `window` pending
            # pairs (not named in catch_up_rows) draft from a scratch context (rolled back at commit)
            have = self._pending.counts.clone()
            if self.catch_up_rows is not None:  # these rows feed their whole queue (caught up for good)
                exact = self.catch_up_rows.to("cpu", torch.bool)
                if exact.shape[0] != batch:
                    raise ValueError(f"catch_up_rows must have {batch} entries (one per row), got {exact.shape[0]}")
                window = torch.where(exact, have.clamp_min(window), torch.full_like(have, window))
            feats, counts = self._pending.peek(fed, window)
            scratch = fed & (have > counts)
            self._pending.drop(fed & ~scratch)  # rows whose whole queue fits are caught up for good
            if bool(scratch.any()):
                self._scratch = (scratch, self.kv.lengths.cpu().clone(), torch.where(scratch, have - counts, 0))
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
        # only each row's last fed pair is read (its g and q row): the caches compute no more than that
        out = self.kv.forward(ids, counts, return_outputs=True, features=feats, logit_columns=counts - 1,
                              **self._shift_kwargs(batch, width))
        logits, hidden = out.logits[:, 0], out.hidden[:, 0]
        for r in range(batch if self.record_context else 0):
            c = int(counts[r])
            if self._scratch is not None and bool(self._scratch[0][r]):
                continue  # a scratch window is rolled back: its pairs are recorded when fed for good
            if c:
                self.recent_features[r] = torch.cat([self.recent_features[r], feats[r, :c].float().cpu()])[-self.window :]
                self.recent_tokens[r] = torch.cat([self.recent_tokens[r], ids[r, :c]])[-self.window :]
        return hidden, logits.float(), self.kv.lengths.cpu() > 0

    def _shift_kwargs(self, rows: int, width: int) -> dict:
        """``chunk_positions`` of a chunk of ``width`` columns for ``rows`` cache rows while a probe's scratch
        context is open: a scratch row's entries sit at the end of its caught-up cache but at their true
        positions, ``skipped`` further on (``{}`` otherwise: positions follow the cache)."""
        if self._scratch is None:
            return {}
        shift = self._scratch[2]
        if rows != shift.shape[0]:  # GBV's paths: row b * K + k is path k of request b
            shift = shift.repeat_interleave(rows // shift.shape[0])
        return {"chunk_positions": shift[:, None] + torch.arange(width)[None, :]}

    def _end_scratch(self) -> None:
        """Roll the scratch rows' cache back to where their caught-up context ended (their pairs stay queued)."""
        if self._scratch is not None and self._fed_before is not None:
            scratch, before, _ = self._scratch
            self._fed_before = torch.where(scratch, before, self._fed_before)
        self._scratch = None

    def _sample(self, logits: torch.Tensor, coins: torch.Tensor, history=None):
        """Sample ``n`` tokens per row of the head's logits ``[R, Vd]`` (over ``head.draft_vocab``) with
        ``coins [R, n]``; ``history``: the rows' ``TokenCounts`` ``[R, V]`` over the target vocabulary (the
        penalties and logit bias are keyed by target ids) or ``None``. Returns ``(ids [R, n]`` target ids,
        ``q_small [R, Vd])``."""
        q = logits_to_probs_rows(logits, self.sampling_for_rows(logits.shape[0]), history,
                                 vocab_ids=self.head.draft_vocab).cpu()
        picks = draw_tokens(q, coins)
        return self.head.draft_vocab.cpu()[picks], q

    def _step(self, tokens: torch.Tensor, g: torch.Tensor, valid: torch.Tensor | None = None):
        """One draft step of every row: ``tokens [R] int64`` (the rows' last drafts) and ``g [R, h]`` (the head's
        outputs before them) -> ``(g [R, h], logits [R, Vd] float32)``. ``valid [R] bool``: only these rows step;
        the others get a hole (their outputs are meaningless), so a row that drafts fewer tokens than the batch's
        longest never writes past its own drafts, e.g. past the end of the context window."""
        num_valid = torch.ones(tokens.shape[0], dtype=torch.int64) if valid is None else valid.to(torch.int64)
        out = self.kv.forward(tokens[:, None], num_valid, return_outputs=True, features=g[:, None],
                              **self._shift_kwargs(tokens.shape[0], 1))
        return out.hidden[:, -1], out.logits[:, -1].float()

    def propose(self, histories, max_tokens, vocab_size, draft_filter=None) -> DraftProposal:
        assert self.kv is not None, "start() must be called first"
        batch = len(histories)
        drafting = max_tokens.to(torch.int64) > 0
        if not bool(drafting.any()):  # speculation off for every row: no draft work, the catch-up is deferred
            self._fed_before, self._round_open = None, True  # nothing fed: nothing to roll back at commit
            proposal = empty_proposal(batch, 0, vocab_size)
            proposal.num_tokens = torch.zeros(batch, dtype=torch.int64)
            return proposal
        g, logits, has_context = self._feed_pending(histories, rows=drafting)
        self._fed_before, self._round_open = self.kv.lengths.cpu().clone(), True
        num = torch.where(has_context & drafting, max_tokens.to(torch.int64), torch.zeros_like(max_tokens, dtype=torch.int64))
        length = int(num.max()) if batch else 0
        proposal = empty_proposal(batch, length, vocab_size)
        proposal.num_tokens = num
        vocab = self.head.draft_vocab.cpu()
        history = _step_history(self.history_counts, self.sampling)  # committed + drafts[:i]
        greedy = _greedy_rows(self.sampling_for_rows(batch), batch) if self.wants_confidence else None
        if greedy is not None and bool(greedy.any()):  # one-hot q rows: the estimator reads the head's confidence
            proposal.confidence = torch.zeros(batch, length, dtype=torch.float32)
        for i in range(length):
            token, q = self._sample(logits, draft_coins(self, histories, torch.full((batch, 1), i)), history)
            token = token[:, 0]
            if history is not None:
                history.add_(token)
            proposal.tokens[:, i] = token
            proposal.probs[:, i].index_copy_(1, vocab, q)
            if proposal.confidence is not None:
                proposal.confidence[:, i] = greedy_confidence(logits.cpu(), q, greedy)  # [B, Vd] rows
            if not apply_draft_filter(draft_filter, proposal, i):
                break
            if i + 1 < length:  # rows whose drafts end here take no step (they may sit at the context's end)
                g, logits = self._step(token, g, valid=i + 1 < proposal.num_tokens)
        trim_proposal(proposal)
        num = proposal.num_tokens
        length = proposal.tokens.shape[1]
        if any(n < length for n in num.tolist()):  # rows that drafted fewer: their unused columns are zeros
            live = torch.arange(length)[None, :] < num[:, None]
            proposal.tokens = torch.where(live, proposal.tokens, torch.zeros_like(proposal.tokens))
            proposal.probs = proposal.probs * live[:, :, None]
        return proposal

    def plain_round(self, histories, vocab_size, features=None):
        """Nothing drafted this round: the verified slot's features wait for the next catch-up (one pair a row)."""
        if self.kv is None:
            raise RuntimeError("start() must be called first")
        if features is None or self._pending is None:
            raise RuntimeError("EAGLE draft: the loop did not pass the round's target features")
        self._pending.append_one(features)

    def propose_paths(self, histories, num_drafts, vocab_size, num_paths, depths=None):
        assert self.kv is not None, "start() must be called first"
        if num_drafts < 1 or num_paths < 1:
            raise ValueError("propose_paths needs num_drafts >= 1 and num_paths >= 1")
        batch = len(histories)
        steps = path_step_counts(depths, batch, num_paths)
        g, logits, has_context = self._feed_pending(histories)
        if not bool(has_context.all()):
            raise ValueError("GBV with the EAGLE draft needs prompts of at least 2 tokens")
        self._fed_before, self._round_open = self.kv.lengths.cpu().clone(), True
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
            live = None if steps is None else i < steps  # [B*K]: rows drafting position i (the others: a hole)
            g, logits = self._step(tokens[:, :, i - 1].reshape(-1), g, valid=live)
            if history is not None:
                history.add_(tokens[:, :, i - 1].reshape(-1))
            index = (i * num_paths + torch.arange(num_paths)).expand(batch, -1)
            token, q = zero_hole_rows(*self._sample(logits, draft_coins(self, histories, index).reshape(-1, 1), history),
                                      live)
            tokens[:, :, i] = token.reshape(batch, num_paths)
            probs[:, :, i].index_copy_(2, vocab, q.reshape(batch, num_paths, -1))
        return tokens, probs

    def select_path(self, chosen):
        if self.kv is not None and self._paths > 1:
            self.kv.select(torch.arange(chosen.shape[0]) * self._paths + chosen.to(torch.int64))
        self._paths = 1

    def commit(self, accept_len):
        if self.kv is None or not self._round_open:
            return
        self._round_open = False
        if self._round_features is None:
            raise RuntimeError("EAGLE draft: the loop did not pass the round's target features (observe_target)")
        if self._fed_before is None:  # the head fed and drafted nothing this round: its verified pairs wait
            if self._round_features.shape[1] == 1:  # a plain round: one pair per row
                self._pending.append_one(self._round_features)
            else:  # another drafter's tokens were verified (the hybrid draft): every accepted pair + the bonus
                self._pending.append(self._round_features, accept_len.to(torch.int64) + 1)
        else:
            self._end_scratch()  # a probe's scratch rows roll back past their window too
            self.kv.truncate(self._fed_before)  # drop the entries fed with the head's own outputs
            self._fed_before = None
            self._pending.append(self._round_features, accept_len.to(torch.int64) + 1)
        self._round_features = None

    def select(self, rows):
        if self.kv is not None:
            self.kv.select(rows)
        rows_cpu = rows.cpu()
        if self.row_seeds is not None:
            self.row_seeds = self.row_seeds.index_select(0, rows_cpu)
        if self._pending is not None:
            self._pending.select(rows_cpu)
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
        hidden3 = 3 * self.head.hidden_size
        if self._pending is None:
            self._pending = self._new_pending(hidden3, torch.float32 if features is None else features.dtype,
                                              "cpu" if features is None else features.device)
        self._pending.add_rows(features, new_counts)
        self.recent_features += [torch.zeros(0, hidden3) for _ in range(count)]
        self.recent_tokens += [torch.zeros(0, dtype=torch.int64) for _ in range(count)]

    def tts_student(self):
        """Test-Time Speculation trains the head (:class:`~.tts_students.EagleDraftStudent`)."""
        from .tts_students import EagleDraftStudent

        self.record_context = True
        return EagleDraftStudent(self)


def _greedy_rows(sampling, rows: int) -> torch.Tensor:
    """``[rows] bool``: the rows that decode greedily (``sampling``: one :class:`SamplingParams` or one per row)."""
    if isinstance(sampling, (list, tuple)):
        return torch.tensor([bool(p.greedy) for p in sampling], dtype=torch.bool)
    return torch.full((rows,), bool(sampling.greedy), dtype=torch.bool)


def greedy_confidence(logits: torch.Tensor, q: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """The acceptance estimator's feature of one draft position: for greedy rows ``logit(q_max)`` of the head's
    distribution at temperature 1 (their sampling row ``q`` is one-hot, whose feature is the same clamp for every
    draft and tells the estimator nothing), for the others that of their ``q`` row (what the estimator reads
    anyway). It depends on the prefix only (the head's logits), never on a coin, so pruning on it stays lossless.

    Args:
        logits: ``[B, Vd] float`` the head's logits; q: ``[B, Vd]`` the rows the tokens were drawn from;
        greedy: ``[B] bool``.

    Returns:
        ``[B] float32``.
    """
    from ..estimator.features import draft_confidence_feature, feature_from_probs

    out = torch.empty(greedy.shape[0], dtype=torch.float32)
    if bool(greedy.any()):
        out[greedy] = draft_confidence_feature(logits[greedy].float(), 1.0)
    if not bool(greedy.all()):
        out[~greedy] = feature_from_probs(q[~greedy])
    return out
