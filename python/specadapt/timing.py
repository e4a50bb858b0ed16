"""Wall-clock medians of a callable: the one timer of the cost-table profile and the forward benchmark."""

from __future__ import annotations

import statistics
import time
from typing import Callable

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` calls, after ``warmup`` untimed calls.

    The caller synchronises inside ``fn`` when it times device work. Raises ``ValueError`` if ``repeats < 1`` or
    ``warmup < 0``."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
