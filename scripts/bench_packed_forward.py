#!/usr/bin/env python
"""Packed vs padded target forwards over ragged chunks (the crossover behind RaggedKVCache's ``pack_below``).

    python scripts/bench_packed_forward.py [--model smollm2-135m] [--context 200] [--repeats 12]

For each (batch, width, real tokens per row) case: a cache with ``--context`` tokens per row, then the median ms
of one forward over the chunk (with hidden states, as the EAGLE draft needs), padded and packed, twice each in
alternation (the same run, so the ratio is what counts). Measured 2026-11-30 on the 2-core VM (SmolLM2-135M,
fp32, 200 tokens of context): 7 of 12 slots real: padded 66 ms, packed 75 ms; 12 of 32: 94 vs 72 ms; 27 of 128:
234-271 vs 108-123 ms -- hence packing only chunks at most half full.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from specadapt.engine import load_model  # noqa: E402
from specadapt.engine.kv import RaggedKVCache  # noqa: E402

CASES = [(4, 3, [3, 1, 2, 1]), (4, 8, [2, 1, 8, 1]), (16, 8, [1] * 12 + [8, 3, 2, 2])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=200, help="tokens already in each row's cache")
    ap.add_argument("--repeats", type=int, default=12, help="timed forwards per measurement (first 2 dropped)")
    args = ap.parse_args()
    target = load_model(args.model)
    torch.manual_seed(0)
    for batch, width, counts in CASES:
        res: dict[bool, list[float]] = {False: [], True: []}
        for packed in (False, True, False, True):
            kv = RaggedKVCache(target.model, batch, packed=packed, pack_below=1.0)
            kv.forward(torch.randint(0, 1000, (batch, args.context)), torch.full((batch,), args.context))
            ids, num = torch.randint(0, 1000, (batch, width)), torch.tensor(counts)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                kv.forward(ids, num, output_hidden_states=True)
                times.append(time.perf_counter() - start)
                kv.truncate(kv.lengths - num)
            res[packed].append(statistics.median(times[2:]) * 1e3)
        real = sum(counts)
        print(f"B={batch} n={width} real {real}/{batch * width}: padded ms {[round(x, 1) for x in res[False]]}, "
              f"packed ms {[round(x, 1) for x in res[True]]}, padded/packed "
              f"{statistics.mean(res[False]) / statistics.mean(res[True]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
