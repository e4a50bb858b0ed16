"""Per-request random streams: every coin of a request is a function of (its seed, the round, the role of the
draw, its index), so a request's output depends on its own seed and prompt only, not on what else is in the
batch or in which order requests run.

A coin is ``u = (h >> 11) * 2^-53`` in ``[0, 1)`` with ``h`` the SplitMix64 finaliser (Steele, Lea, Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014) applied twice to a key combining

- ``seed``: the request's seed;
- ``counter``: the request's committed length (prompt + output) at the start of the round: unique per round,
  since every round commits at least one token;
- ``role``: what the coin decides (:data:`ACCEPT` coins of the verification rule, one per draft slot; the
  :data:`FINAL` coin of the extra token; :data:`DRAFT` coins the draft samples its tokens with);
- ``index``: the draft slot (and for multi-path drafting ``slot * K + path``).

Counter-based draws need no state to carry between rounds, survive requests leaving the batch, and are cheap
(a few integer operations per coin). What stays batch-dependent is stated in docs/engine.md: adaptive verification
chooses one budget for the whole batch, and Test-Time Speculation with a shared draft learns from every request.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ACCEPT", "FINAL", "DRAFT", "request_coins"]

ACCEPT = 1
FINAL = 2
DRAFT = 3

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_K_SEED = np.uint64(0x2545F4914F6CDD1D)
_K_COUNTER = np.uint64(0xDABA0B6EB09322E3)
_K_ROLE = np.uint64(0x1B873593)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


_M64 = (1 << 64) - 1
# the constants above as Python integers, for the small-call path
_GOLDEN_I, _MIX1_I, _MIX2_I = int(_GOLDEN), int(_MIX1), int(_MIX2)
_K_SEED_I, _K_COUNTER_I, _K_ROLE_I = int(_K_SEED), int(_K_COUNTER), int(_K_ROLE)
#: At most this many coins per call go through Python integers (a few microseconds per coin, where NumPy's fixed
#: cost is about a hundred per call); larger calls use NumPy. Both give the same bits (tests/test_coins.py).
SMALL_CALL = 64


def _mix_int(z: int) -> int:
    """:func:`_mix` on one Python integer in [0, 2^64)."""
    z = (z + _GOLDEN_I) & _M64
    z = ((z ^ (z >> 30)) * _MIX1_I) & _M64
    z = ((z ^ (z >> 27)) * _MIX2_I) & _M64
    return z ^ (z >> 31)


def _coins_small(seeds: list[int], counters: list[int], role: int, index: list[list[int]]) -> torch.Tensor:
    """The rule of :func:`request_coins` on Python integers (int64 inputs wrap to uint64 as NumPy's cast does)."""
    rows = []
    role_key = (role * _K_ROLE_I) & _M64
    for seed, counter, idx in zip(seeds, counters, index):
        key = _mix_int(((seed & _M64) * _K_SEED_I + role_key) & _M64)
        key = _mix_int(key ^ (((counter & _M64) * _K_COUNTER_I) & _M64))
        rows.append([(_mix_int((key + (i & _M64)) & _M64) >> 11) * 2.0 ** -53 for i in idx])
    return torch.tensor(rows, dtype=torch.float64).reshape(len(seeds), -1)


def request_coins(seeds: torch.Tensor, counters: torch.Tensor, role: int, index: torch.Tensor | int,
                  small_call: int = SMALL_CALL) -> torch.Tensor:
    """Coins of one role for a batch of requests.

    Args:
        seeds: ``[B] int64`` per-request seeds.
        counters: ``[B] int64`` per-request round counters (committed length at the round's start).
        role: :data:`ACCEPT`, :data:`FINAL` or :data:`DRAFT`.
        index: ``[B, n] int64`` coin indices per request, or ``n`` for indices ``0 .. n-1``.

    Returns:
        ``[B, n] float64`` in ``[0, 1)``.

    Raises:
        ValueError: mismatched shapes.
    """
    seeds_t = torch.as_tensor(seeds, dtype=torch.int64).cpu()
    counters_t = torch.as_tensor(counters, dtype=torch.int64).cpu()
    if seeds_t.dim() == 1 and counters_t.shape == seeds_t.shape:
        batch = seeds_t.shape[0]
        if isinstance(index, int):
            if batch * index <= small_call:
                row = list(range(index))
                return _coins_small(seeds_t.tolist(), counters_t.tolist(), role, [row] * batch)
        else:
            index_t = torch.as_tensor(index, dtype=torch.int64).cpu()
            if index_t.dim() == 2 and index_t.shape[0] == batch and index_t.numel() <= small_call:
                return _coins_small(seeds_t.tolist(), counters_t.tolist(), role, index_t.tolist())
    seeds = np.asarray(torch.as_tensor(seeds, dtype=torch.int64).cpu().numpy()).astype(np.uint64)
    counters = np.asarray(torch.as_tensor(counters, dtype=torch.int64).cpu().numpy()).astype(np.uint64)
    if seeds.ndim != 1 or counters.shape != seeds.shape:
        raise ValueError(f"seeds and counters must both be [B], got {seeds.shape} and {counters.shape}")
    if isinstance(index, int):
        index = np.broadcast_to(np.arange(index, dtype=np.uint64), (seeds.shape[0], index))
    else:
        index = torch.as_tensor(index, dtype=torch.int64).cpu().numpy().astype(np.uint64)
    if index.ndim != 2 or index.shape[0] != seeds.shape[0]:
        raise ValueError(f"index must be [B, n] with B = {seeds.shape[0]}, got {index.shape}")
    with np.errstate(over="ignore"):
        key = _mix(seeds * _K_SEED + np.uint64(role) * _K_ROLE)
        key = _mix(key ^ (counters * _K_COUNTER))
        z = _mix(key[:, None] + index)
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * (2.0 ** -53))
