"""Cost tables: milliseconds of a target forward over n tokens and of a draft step over r requests."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["CostTable", "profile_costs"]


def _monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a noisy high sample is
    averaged with its neighbours instead of raising every later size, as a running maximum would."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            prev = blocks[-1]
            prev[0] = (prev[0] * prev[1] + mean * count) / (prev[1] + count)
            prev[1] += count
    return [mean for mean, count in blocks for _ in range(int(count))]


@dataclass
class CostTable:
    """Measured costs, made monotone (non-decreasing, least-squares closest); linear extrapolation past the last
    size.

    Attributes:
        target_ms: ``target_ms[n - 1]`` = ms of one target forward over n tokens (n = 1..len).
        draft_ms: ``draft_ms[r - 1]`` = ms of drafting one round for r requests (all L positions).
        draft_first_ms: ``draft_first_ms[r - 1]`` = ms of a round that drafts position 1 only (the catch-up
            forward and one q row), or ``None``: a drafting round then costs ``draft_ms * depth / L``.
    """

    target_ms: list[float]
    draft_ms: list[float]
    draft_first_ms: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.target_ms or not self.draft_ms:
            raise ValueError("a cost table needs at least one target and one draft entry")
        self.target_ms = _monotone([float(x) for x in self.target_ms])
        self.draft_ms = _monotone([float(x) for x in self.draft_ms])
        if self.draft_first_ms is not None:
            if len(self.draft_first_ms) != len(self.draft_ms):
                raise ValueError("draft_first_ms needs one entry per draft_ms entry")
            self.draft_first_ms = [min(float(f), d) for f, d in zip(_monotone(self.draft_first_ms), self.draft_ms)]

    @staticmethod
    def _lookup(table: list[float], n: int) -> float:
        if n <= 0:
            return 0.0
        if n <= len(table):
            return table[n - 1]
        slope = (table[-1] - table[0]) / (len(table) - 1) if len(table) > 1 else table[-1]
        return table[-1] + slope * (n - len(table))

    def verify_cost(self, tokens: int) -> float:
        """ms of a target forward over ``tokens`` tokens."""
        return self._lookup(self.target_ms, tokens)

    def draft_cost(self, requests: int) -> float:
        """ms of one drafting round for ``requests`` requests."""
        return self._lookup(self.draft_ms, requests)

    def draft_depth_cost(self, requests: int, depth: int, steps: int) -> float:
        """ms of a drafting round for ``requests`` requests that drafts ``depth`` of ``steps`` (L) positions:
        ``first + (all - first) * (depth - 1) / (L - 1)`` with a measured first position, else
        ``all * depth / L``; 0 for ``depth <= 0``."""
        if depth <= 0:
            return 0.0
        full = self.draft_cost(requests)
        if self.draft_first_ms is None or steps <= 1:
            return full * min(depth, steps) / steps
        first = self._lookup(self.draft_first_ms, requests)
        return first + (full - first) * (min(depth, steps) - 1) / (steps - 1)

    def save(self, path: str | Path) -> None:
        data = {"target_ms": self.target_ms, "draft_ms": self.draft_ms}
        if self.draft_first_ms is not None:
            data["draft_first_ms"] = self.draft_first_ms
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        """Raises ValueError naming the file when it is not a cost table."""
        try:
            data = json.loads(Path(path).read_text())
            first = data.get("draft_first_ms")
            return cls(list(data["target_ms"]), list(data["draft_ms"]), None if first is None else list(first))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a cost table ({exc})") from None


def profile_costs(target_forward: Callable[[int], None], draft_round: Callable[[int], None], max_tokens: int,
                  max_requests: int, repeats: int = 5) -> CostTable:
    """Median of ``repeats`` timed calls per size (after one warm-up per size).

    Args:
        target_forward: runs one target forward over ``n`` tokens.
        draft_round: runs one drafting round for ``r`` requests.
        max_tokens, max_requests: largest sizes profiled.
    """
    def timed(fn, n):
        fn(n)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(n)
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return CostTable([timed(target_forward, n) for n in range(1, max_tokens + 1)],
                     [timed(draft_round, r) for r in range(1, max_requests + 1)])
