#!/usr/bin/env python
"""Cost of one target verify forward against context length (the ragged KV cache of the embedded engine).

Prefills a context of random tokens, then times a chunk forward of ``--chunk`` tokens (the L + 1 slots of a
speculative round) ``--repeats`` times, rolling the cache back after each, and reports the median per context
for the cache as built (``fast_append``: preallocated capacity + grouped-query SDPA) and for the baseline in the
same run (transformers' concatenating ``DynamicCache``), with the speedup. Example (docs/tts.md):

    python scripts/bench_kv_context.py --contexts 100 1000 2000 4300 --chunk 6

Machine and torch version are printed with the table; timings are wall-clock on whatever else runs there.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="target model (as specadapt generate --model)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[100, 1000, 2000, 4300], help="context lengths")
    ap.add_argument("--chunk", type=int, default=6, help="tokens per timed forward (L + 1)")
    ap.add_argument("--batch", type=int, default=1, help="rows")
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args(argv)
    if min(args.contexts) < 1 or args.chunk < 1 or args.batch < 1 or args.repeats < 1:
        ap.error("--contexts, --chunk, --batch and --repeats must be >= 1")

    from specadapt.engine.kv import RaggedKVCache
    from specadapt.engine.models import load_model

    torch.manual_seed(0)
    model = load_model(args.model).model
    vocab = int(model.config.vocab_size)
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, model {args.model}")
    print(f"median ms per {args.chunk}-token forward, batch {args.batch}")
    print("| context | baseline (DynamicCache) ms | fast_append ms | speedup |")
    print("|---|---|---|---|")
    for context in args.contexts:
        medians = {}
        for fast in (False, True):
            kv = RaggedKVCache(model, args.batch, fast_append=fast)
            kv.forward(torch.randint(vocab, (args.batch, context)), torch.full((args.batch,), context),
                       logits_to_keep=1)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                kv.forward(torch.randint(vocab, (args.batch, args.chunk)), torch.full((args.batch,), args.chunk))
                times.append(1000 * (time.perf_counter() - start))
                kv.truncate(kv.lengths - args.chunk)
            medians[fast] = statistics.median(times)
        print(f"| {context} | {medians[False]:.1f} | {medians[True]:.1f} | {medians[False] / medians[True]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
