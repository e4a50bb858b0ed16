"""specadapt.timing.median_seconds: warm-up calls untimed, the median of the timed ones, bad counts refused."""

from __future__ import annotations

import pytest

from specadapt import timing


def test_median_seconds_counts_calls_and_takes_the_median(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # timed calls last 1, 3 and 2 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls = []
    assert timing.median_seconds(lambda: calls.append(1), repeats=3, warmup=2) == 2.0
    assert len(calls) == 5


@pytest.mark.parametrize("repeats, warmup, name", [(0, 1, "repeats"), (3, -1, "warmup")])
def test_median_seconds_refuses_bad_counts(repeats, warmup, name):
    with pytest.raises(ValueError, match=name):
        timing.median_seconds(lambda: None, repeats, warmup)
