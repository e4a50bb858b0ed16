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
    out, best = [], 0.0
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


@dataclass
class CostTable:
    """Measured costs, made monotone (non-decreasing); linear extrapolation past the last size.

    Attributes:
        target_ms: ``target_ms[n - 1]`` = ms of one target forward over n tokens (n = 1..len).
        draft_ms: ``draft_ms[r - 1]`` = ms of drafting one round for r requests.
    """

    target_ms: list[float]
    draft_ms: list[float]

    def __post_init__(self) -> None:
        if not self.target_ms or not self.draft_ms:
            raise ValueError("a cost table needs at least one target and one draft entry")
        self.target_ms = _monotone([float(x) for x in self.target_ms])
        self.draft_ms = _monotone([float(x) for x in self.draft_ms])

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

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"target_ms": self.target_ms, "draft_ms": self.draft_ms}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        """Raises ValueError naming the file when it is not a cost table."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(list(data["target_ms"]), list(data["draft_ms"]))
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
