"""Suffix drafting (``--draft suffix``): model-free drafts from continuation frequencies over this request's text
and over earlier requests' outputs, sized per round by the length of the match (after SuffixDecoding, Oliaro et
al., arXiv 2411.04975, §3: a per-request structure over prompt and output, a global one over earlier outputs,
speculation length ``alpha x match length``, paths scored by empirical continuation probability).

This first version proposes one path per round (the most frequent continuation at each step), verified by the
chain / block rules like every deterministic draft; the tree of several continuations is the next step.

The structure is a :class:`ContinuationIndex`: for every context of 1..``max_depth`` tokens that occurs in its
sequences, how often each token followed it. A round (:func:`speculate`):

1. match: the longest suffix of the request's history (up to ``max_depth`` tokens) that occurs as a context in
   the request's own index or in the global one: its length ``m`` is the match length;
2. budget: at most ``min(max_tokens, ceil(factor x m))`` tokens (SuffixDecoding's adaptive speculation length:
   a long match predicts a long repeat, a one-token match a short guess);
3. grow: repeatedly take the token that most often followed the longest matching context of history + drafts so
   far (counts of the request's index and the global one added), with estimated probability ``count / total``;
   stop when the path's probability (the product) falls below ``min_prob`` or no context of the extended text
   occurs.

Exactness: the draft is deterministic (``q`` is one-hot on each drafted token), so the chain and block rules accept
draft ``i`` with probability ``p_i(x_i)`` and the output's law is the target's, exactly as for ``ngram`` (tested
by exact enumeration and chi-square in tests/test_suffix.py).

Adaptive verification: each draft's :func:`step_confidence` is the estimator's feature
(``DraftProposal.confidence``), since a one-hot q row says nothing about how likely the draft is.

Memory: an index holds up to ``max_depth`` entries per indexed token; the global index keeps at most
``global_tokens`` tokens of earlier outputs, evicting whole oldest requests first (0: per request only).
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import torch

from .drafts import Draft, empty_proposal, fill_deterministic_row

__all__ = ["ContinuationIndex", "SuffixConfig", "SuffixDraft", "speculate", "step_confidence"]


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of the suffix draft.

    Attributes:
        max_depth: longest context matched, tokens (>= 1).
        factor: speculation length per matched token (> 0): a round drafts at most ``ceil(factor x match)``.
        min_prob: stop a path when its estimated probability falls below this (in [0, 1)).
        global_tokens: earlier requests' output tokens kept in the global index (>= 0; 0 = per request only).

    Raises:
        ValueError: naming the field, for a value out of range.
    """

    max_depth: int = 8
    factor: float = 1.0
    min_prob: float = 0.1
    global_tokens: int = 16384

    def __post_init__(self) -> None:
        if int(self.max_depth) < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"factor must be a finite number > 0, got {self.factor}")
        if not 0 <= self.min_prob < 1:
            raise ValueError(f"min_prob must be in [0, 1), got {self.min_prob}")
        if int(self.global_tokens) < 0:
            raise ValueError(f"global_tokens must be >= 0, got {self.global_tokens}")


class ContinuationIndex:
    """Continuation counts of every context of 1..``max_depth`` tokens of some token sequences.

    ``counts(context)`` is ``{token: how often token followed context}``. Sequences are added whole
    (:meth:`add`), extended as they grow (:meth:`extend`) and removed whole (:meth:`remove`).
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._table: dict[tuple, dict[int, int]] = defaultdict(dict)
        self.tokens = 0  # positions indexed

    def _count(self, seq: list[int], start: int, stop: int, delta: int) -> None:
        depth, table = self.max_depth, self._table
        for i in range(max(start, 1), stop):
            nxt = seq[i]
            for n in range(1, min(depth, i) + 1):
                key = tuple(seq[i - n:i])
                row = table[key]
                c = row.get(nxt, 0) + delta
                if c > 0:
                    row[nxt] = c
                else:
                    row.pop(nxt, None)
                    if not row:
                        del table[key]
        self.tokens += delta * max(stop - max(start, 1), 0)

    def add(self, seq: list[int]) -> None:
        """Index every position of ``seq``."""
        self._count(seq, 0, len(seq), +1)

    def extend(self, seq: list[int], start: int) -> None:
        """Index positions ``start ..`` of ``seq`` (its earlier positions are indexed already)."""
        self._count(seq, start, len(seq), +1)

    def remove(self, seq: list[int]) -> None:
        """Undo :meth:`add` of ``seq``."""
        self._count(seq, 0, len(seq), -1)

    def counts(self, context: tuple) -> dict[int, int] | None:
        """The continuation counts of ``context`` (a tuple of ids), or ``None`` when it never occurred."""
        return self._table.get(context)

    def __len__(self) -> int:
        return len(self._table)


def _counts(indexes, context: tuple) -> dict[int, int] | None:
    merged = None
    for index in indexes:
        row = index.counts(context)
        if row:
            if merged is None:
                merged = dict(row)
            else:
                for t, c in row.items():
                    merged[t] = merged.get(t, 0) + c
    return merged


def step_confidence(count: int, total: int) -> float:
    """The estimator's feature of a drafted token that followed its context ``count`` times out of ``total``:
    ``logit(count / (total + 1))`` (one unseen outcome added, so a context seen once gives 0 and one seen five
    times with one continuation 1.6, never the saturated value of a one-hot q)."""
    return math.log(count) - math.log(total + 1 - count)


def speculate(indexes, history: list[int], max_tokens: int,
              config: SuffixConfig) -> tuple[list[int], int, list[float]]:
    """One round's draft after ``history`` from the continuation counts of ``indexes`` (added together).

    Returns:
        ``(tokens, match length, confidences)``: at most ``min(max_tokens, ceil(factor x match))`` ids (see the
        module docstring), the length of the longest suffix of ``history`` found as a context (0: none), and
        each token's :func:`step_confidence` (the adaptive verification estimator's feature).
    """
    depth = config.max_depth
    tail = list(history[-depth:])
    match = 0
    for n in range(min(depth, len(tail)), 0, -1):
        if _counts(indexes, tuple(tail[-n:])) is not None:
            match = n
            break
    if match == 0 or max_tokens <= 0:
        return [], match, []
    budget = min(int(max_tokens), math.ceil(config.factor * match))
    out: list[int] = []
    confidences: list[float] = []
    prob = 1.0
    n = match
    while len(out) < budget:
        row = None
        for k in range(min(n, len(tail)), 0, -1):  # the longest context of the extended text that occurred
            row = _counts(indexes, tuple(tail[-k:]))
            if row is not None:
                n = k
                break
        if row is None:
            break
        token, count = max(row.items(), key=lambda kv: (kv[1], -kv[0]))  # ties: the smaller id (deterministic)
        total = sum(row.values())
        prob *= count / total
        if prob < config.min_prob:
            break
        out.append(token)
        confidences.append(step_confidence(count, total))
        tail.append(token)
        n = min(n + 1, depth)
    return out, match, confidences


class SuffixDraft(Draft):
    """``--draft suffix``: :func:`speculate` over each request's own :class:`ContinuationIndex` (prompt and output,
    extended as the history grows) and a global one over earlier requests' outputs (kept across batches of this
    draft, at most ``config.global_tokens`` tokens, oldest requests evicted first). ``q`` is one-hot on each
    drafted token.

    A request's output enters the global index when its row leaves the batch (:meth:`select`) or the batch ends
    (:meth:`start` of the next one).
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.global_index = ContinuationIndex(self.config.max_depth)
        self._global: OrderedDict[int, list[int]] = OrderedDict()  # request number -> its output tokens
        self._next_id = 0
        self._rows: list[dict] = []  # per row: prompt_len, index, indexed, history
        #: the last round's match length per row (``[B] int64``), for the estimator's features and the report
        self.last_match = torch.zeros(0, dtype=torch.int64)

    # ---- rows ---------------------------------------------------------------------------------------------
    def _new_row(self, history) -> dict:
        return {"prompt_len": len(history), "index": ContinuationIndex(self.config.max_depth), "indexed": 0,
                "history": None}

    def start(self, histories):
        self._retire(range(len(self._rows)))
        self._rows = [self._new_row(h) for h in histories]

    def join(self, histories, features=None):
        self._rows += [self._new_row(h) for h in histories]

    def select(self, rows):
        keep = [int(r) for r in rows.tolist()] if isinstance(rows, torch.Tensor) else [int(r) for r in rows]
        kept = set(keep)
        self._retire([r for r in range(len(self._rows)) if r not in kept])
        self._rows = [self._rows[r] for r in keep]

    def _retire(self, rows) -> None:
        """Move the outputs of ``rows`` into the global index (bounded)."""
        limit = self.config.global_tokens
        for r in rows:
            row = self._rows[r]
            history = row["history"]
            if limit <= 0 or history is None:
                continue
            output = list(history[row["prompt_len"]:])
            if len(output) < 2:
                continue
            output = output[-limit:]
            self.global_index.add(output)
            self._global[self._next_id] = output
            self._next_id += 1
            while self.global_index.tokens > limit and self._global:
                _, old = self._global.popitem(last=False)
                self.global_index.remove(old)

    # ---- drafting -------------------------------------------------------------------------------------------
    def propose(self, histories, max_tokens, vocab_size, draft_filter=None):
        batch = len(histories)
        if len(self._rows) != batch:  # rows the engine did not announce (a caller without start / join)
            self._rows = [self._new_row(h) for h in histories]
        limits = max_tokens.tolist()
        proposal = empty_proposal(batch, max(limits, default=0), vocab_size)
        proposal.confidence = torch.zeros(proposal.tokens.shape, dtype=torch.float32)
        counts, matches = [], []
        for r, history in enumerate(histories):
            if not isinstance(history, list):
                history = [int(t) for t in history]
            row = self._rows[r]
            if row["history"] is not history or len(history) < row["indexed"]:  # a new list: index it afresh
                row["index"] = ContinuationIndex(self.config.max_depth)
                row["indexed"] = 0
                row["history"] = history
            row["index"].extend(history, row["indexed"])
            row["indexed"] = len(history)
            found, match, conf = speculate((row["index"], self.global_index), history, int(limits[r]), self.config)
            fill_deterministic_row(proposal, r, found, torch.tensor(conf, dtype=torch.float32))
            counts.append(len(found))
            matches.append(match)
        proposal.num_tokens = torch.tensor(counts, dtype=torch.int64)
        self.last_match = torch.tensor(matches, dtype=torch.int64)
        return proposal
