"""Exact output laws of speculative decoding on small vocabularies, for the losslessness oracle tests.

Context-dependent target and draft tables ``p(. | u)``, ``q(. | u)`` (``u`` = tokens emitted so far) are drawn
at random with some exact zeros. The law of the first ``n`` emitted tokens is computed by enumerating every
draft path (every K-tuple of paths for GBV) of every round, integrating the coins analytically with the rule's
round law; it must equal the target's joint law ``prod_i p(t_i | t_<i)``.
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

    @lru_cache(maxsize=None)
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

    def path_rows(self, u: tuple, path: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P [L+1, V], Q [L, V])`` float64 along ``path`` after context ``u``."""
        L = len(path)
        P = torch.tensor(np.stack([self.p(u + path[:i]) for i in range(L + 1)]))
        Q = torch.tensor(np.stack([self.q(u + path[:i]) for i in range(L)])).reshape(L, self.vocab)
        return P, Q

    def path_prob(self, u: tuple, path: tuple) -> float:
        return float(np.prod([self.q(u + path[:i])[x] for i, x in enumerate(path)]))


def target_joint(tables: RandomTables, n: int) -> np.ndarray:
    """``[V]*n`` array of ``prod_i p(t_i | t_<i)``."""
    out = np.zeros((tables.vocab,) * n)
    for seq in itertools.product(range(tables.vocab), repeat=n):
        prob = 1.0
        for i in range(n):
            prob *= tables.p(seq[:i])[seq[i]]
        out[seq] = prob
    return out


def _add_outcomes(out: dict, weight: float, path: tuple, tau_probs, extra) -> None:
    for tau in range(len(path) + 1):
        if tau_probs[tau] == 0.0:
            continue
        for y in range(extra.shape[1]):
            w = weight * float(tau_probs[tau]) * float(extra[tau, y])
            if w > 0.0:
                key = path[:tau] + (y,)
                out[key] = out.get(key, 0.0) + w


def single_path_outcomes(tables: RandomTables, round_law, num_drafts: int, u: tuple = ()) -> dict[tuple, float]:
    """Law of what ONE round emits after context ``u`` (a tuple of ``tau + 1`` tokens), one path drafted from q.

    ``round_law(P [L+1, V], Q [L, V], drafts [L]) -> (tau_probs [L+1], extra [L+1, V])``.
    """
    out: dict[tuple, float] = {}
    for path in itertools.product(range(tables.vocab), repeat=num_drafts):
        q_path = tables.path_prob(u, path)
        if q_path == 0.0:
            continue
        P, Q = tables.path_rows(u, path)
        tau_probs, extra = round_law(P, Q, torch.tensor(path, dtype=torch.int64))
        _add_outcomes(out, q_path, path, tau_probs.numpy(), extra.numpy())
    return out


def gbv_outcomes(tables: RandomTables, num_paths: int, num_drafts: int, u: tuple = ()) -> dict[tuple, float]:
    """Law of what ONE GBV round emits: every K-tuple of i.i.d. paths, the walk, then block verification."""
    from specadapt.verification.block import block_round_law
    from specadapt.verification.gbv import gbv_select

    paths = [p for p in itertools.product(range(tables.vocab), repeat=num_drafts) if tables.path_prob(u, p) > 0]
    rows = {p: tables.path_rows(u, p) for p in paths}
    out: dict[tuple, float] = {}
    for combo in itertools.product(paths, repeat=num_paths):
        weight = float(np.prod([tables.path_prob(u, p) for p in combo]))
        drafts = torch.tensor(combo, dtype=torch.int64).reshape(num_paths, num_drafts)
        P = torch.stack([rows[p][0] for p in combo])
        Q = torch.stack([rows[p][1] for p in combo])
        chosen, q_g = gbv_select(drafts, P, Q)
        path = combo[chosen]
        tau_probs, extra = block_round_law(rows[path][0], q_g, torch.tensor(path, dtype=torch.int64))
        _add_outcomes(out, weight, path, tau_probs.numpy(), extra.numpy())
    return out


def multi_round_law(vocab: int, outcomes, n: int) -> np.ndarray:
    """``[V]*n`` law of the first ``n`` tokens emitted by repeated rounds; ``outcomes(u) -> {emitted: prob}``."""

    @lru_cache(maxsize=None)
    def law(u: tuple, m: int) -> np.ndarray:
        if m == 0:
            return np.ones(())
        result = np.zeros((vocab,) * m)
        for emitted, w in outcomes(u).items():
            if len(emitted) >= m:
                result[emitted[:m]] += w
            else:
                result[emitted] += w * law(u + emitted, m - len(emitted))
        return result

    return law((), n)


def speculative_law(tables: RandomTables, round_law, num_drafts: int, n: int) -> np.ndarray:
    """Law of the first ``n`` tokens with a single-path rule of draft length L."""
    return multi_round_law(tables.vocab, lambda u: single_path_outcomes(tables, round_law, num_drafts, u), n)


def gbv_law(tables: RandomTables, num_paths: int, num_drafts: int, n: int) -> np.ndarray:
    """Law of the first ``n`` tokens with GBV (K paths of length L)."""
    return multi_round_law(tables.vocab, lambda u: gbv_outcomes(tables, num_paths, num_drafts, u), n)


def sample_path_batch(tables, L, K, rounds, seed):
    """K i.i.d. paths per round from the context-free tables, with the p / q rows along each path."""
    V = tables.vocab
    paths = list(itertools.product(range(V), repeat=L))
    weights = np.array([tables.path_prob((), p) for p in paths])
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(paths), size=(rounds, K), p=weights / weights.sum())
    P = np.stack([tables.path_rows((), p)[0].numpy() for p in paths]).astype(np.float32)
    Q = np.stack([tables.path_rows((), p)[1].numpy() for p in paths]).astype(np.float32)
    cand = np.concatenate([np.zeros((len(paths), 1), dtype=np.int64), np.array(paths)], axis=1)
    return torch.from_numpy(cand[idx]), torch.from_numpy(P[idx]), torch.from_numpy(Q[idx])


def chi_square_pvalue(outputs, accept, exact: dict, rounds: int) -> float:
    """Pearson chi-square of the emitted (accepted drafts + extra token) tuples against their exact law, cells
    with expected count < 5 pooled; p-value from the regularised upper incomplete gamma (no scipy here)."""
    counts: dict[tuple, int] = {}
    for row, tau in zip(outputs.tolist(), accept.tolist()):
        key = tuple(row[: tau + 1])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "an outcome of zero probability was emitted"
    keys = sorted(exact)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([exact[k] for k in keys]) * rounds
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


class Float32Tables(RandomTables):
    """The exact law of the float32-rounded rows the kernel sees."""

    def _row(self, u, which):
        return RandomTables._row(self, u, which).astype(np.float32).astype(np.float64)
