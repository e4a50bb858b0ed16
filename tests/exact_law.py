"""Exact output laws of speculative decoding on small vocabularies, for the losslessness oracle tests.

Context-dependent target and draft tables ``p(. | u)``, ``q(. | u)`` (``u`` = tokens emitted so far) are drawn
at random with some exact zeros. The law of the first ``n`` emitted tokens is computed by enumerating every draft
path of every round and integrating the coins analytically with the rule's round law; it must equal the
target's joint law ``prod_i p(t_i | t_<i)``.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import torch


class RandomTables:
    """Deterministic random ``p(. | u)`` and ``q(. | u)`` for every prefix ``u`` (a tuple of token ids)."""

    def __init__(self, vocab: int, seed: int, zero_fraction: float = 0.25) -> None:
        self.vocab = vocab
        self.seed = seed
        self.zero_fraction = zero_fraction

    def _row(self, u: tuple, which: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, which, len(u), *u])
        row = rng.dirichlet(np.full(self.vocab, 0.7))
        zeros = rng.random(self.vocab) < self.zero_fraction
        row = np.where(zeros, 0.0, row)
        if row.sum() == 0:
            row[rng.integers(self.vocab)] = 1.0
        return row / row.sum()

    def p(self, u: tuple) -> np.ndarray:
        return self._row(u, 0)

    def q(self, u: tuple) -> np.ndarray:
        return self._row(u, 1)


def target_joint(tables: RandomTables, n: int) -> np.ndarray:
    """``[V]*n`` array of ``prod_i p(t_i | t_<i)``."""
    out = np.zeros((tables.vocab,) * n)
    for seq in itertools.product(range(tables.vocab), repeat=n):
        prob = 1.0
        for i in range(n):
            prob *= tables.p(seq[:i])[seq[i]]
        out[seq] = prob
    return out


def speculative_law(tables: RandomTables, round_law, num_drafts: int, n: int) -> np.ndarray:
    """``[V]*n`` law of the first ``n`` tokens emitted by repeated rounds of ``round_law`` with draft length L.

    ``round_law(target_probs [L+1, V], draft_probs [L, V], drafts [L]) -> (tau_probs [L+1], extra [L+1, V])``.
    """
    V = tables.vocab

    @lru_cache(maxsize=None)
    def law(u: tuple, m: int) -> np.ndarray:
        result = np.zeros((V,) * m)
        if m == 0:
            return np.ones(())
        for path in itertools.product(range(V), repeat=num_drafts):
            q_path = 1.0
            for i, x in enumerate(path):
                q_path *= tables.q(u + path[:i])[x]
            if q_path == 0.0:
                continue
            P = torch.tensor(np.stack([tables.p(u + path[:i]) for i in range(num_drafts + 1)]))
            Q = torch.tensor(np.stack([tables.q(u + path[:i]) for i in range(num_drafts)])).reshape(num_drafts, V)
            tau_probs, extra = round_law(P, Q, torch.tensor(path, dtype=torch.int64))
            tau_probs, extra = tau_probs.numpy(), extra.numpy()
            for tau in range(num_drafts + 1):
                if tau_probs[tau] == 0.0:
                    continue
                for y in range(V):
                    w = q_path * tau_probs[tau] * extra[tau, y]
                    if w == 0.0:
                        continue
                    emitted = path[:tau] + (y,)
                    if len(emitted) >= m:
                        result[emitted[:m]] += w
                    else:
                        result[emitted] += w * law(u + emitted, m - len(emitted))
        return result

    return law((), n)


def round_outcome_law(tables: RandomTables, round_law, num_drafts: int) -> dict[tuple, float]:
    """Law of what ONE round emits (a tuple of ``tau + 1`` tokens) from the empty context, drafts from q."""
    V = tables.vocab
    out: dict[tuple, float] = {}
    for path in itertools.product(range(V), repeat=num_drafts):
        q_path = float(np.prod([tables.q(path[:i])[x] for i, x in enumerate(path)]))
        if q_path == 0.0:
            continue
        P = torch.tensor(np.stack([tables.p(path[:i]) for i in range(num_drafts + 1)]))
        Q = torch.tensor(np.stack([tables.q(path[:i]) for i in range(num_drafts)])).reshape(num_drafts, V)
        tau_probs, extra = round_law(P, Q, torch.tensor(path, dtype=torch.int64))
        for tau in range(num_drafts + 1):
            for y in range(V):
                w = q_path * float(tau_probs[tau]) * float(extra[tau, y])
                if w > 0:
                    key = path[:tau] + (y,)
                    out[key] = out.get(key, 0.0) + w
    return out
