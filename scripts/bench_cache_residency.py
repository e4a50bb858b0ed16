#!/usr/bin/env python
"""How much of a target forward's speed is the CPU cache holding its weights: the forward of q tokens timed
back to back ("warm": the weights of the previous forward are still in the last-level cache) and after a copy
that evicts the cache ("flushed": each forward reads its weights from memory, as when a draft forward, sampling
and Python ran in between).

    python scripts/bench_cache_residency.py --queries 1 2 6 --context 400 --flush-mb 600

On a VM that reports a last-level cache larger than the quantised model (the AMX Xeon of docs/native_forward.md
reports 480 MB of L3 against 96 MB of int4 weights) the warm figure runs far below the flushed one, so a forward
inside a speculative round costs more than the same forward in a microbenchmark loop. ``--gaps-ms`` times the
forwards with a pause between them instead (the main thread busy in Python for that long, as while a round
samples, verifies and drafts): how a forward's cost depends on the time since the previous one. Prints the CPU,
the machine's copy bandwidth measured in the same run, the weight floor of one forward (the native weights'
bytes at that rate) and the median ms of each setting with its ratio to the floor; run nothing else on the
machine meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", help="weight format (auto = the engine's default)")
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 2, 6], help="query tokens per forward")
    ap.add_argument("--context", type=int, default=400, help="cached positions before the timed forwards")
    ap.add_argument("--flush-mb", type=int, default=600, help="bytes copied between flushed forwards (MB)")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[],
                    help="also time each q with the main thread busy this many ms before every forward (each "
                         "repeat runs back to back and every gap in turn, so the host's drift hits all alike)")
    args = ap.parse_args()
    if min(args.queries) < 1 or args.context < 1 or args.flush_mb < 1 or args.repeats < 1:
        ap.error("--queries, --context, --flush-mb and --repeats must be positive")
    if any(g < 0 for g in args.gaps_ms):
        ap.error("--gaps-ms must be >= 0")
    import torch

    from specadapt.bench.forward import cpu_name, measure_machine
    from specadapt.cli.engine_args import load_target_and_draft
    from specadapt.sampling import SamplingParams

    target, _ = load_target_and_draft(args.model, "none", SamplingParams(1.0), 0, args.dtype, "cpu", forward="native")
    kv = target.new_cache(1, capacity=args.context + max(args.queries) + 16)
    kv.forward(torch.randint(0, 1000, (1, args.context)), torch.tensor([args.context]))
    source = torch.empty(args.flush_mb * 2**20 // 4)
    sink = torch.empty_like(source)

    def timed_forward_ms(q: int, gap_ms: float) -> float:
        """One forward of q tokens after the main thread was busy gap_ms (rolled back after)."""
        until = time.perf_counter() + gap_ms / 1e3
        while time.perf_counter() < until:
            pass
        start = time.perf_counter()
        kv.forward(torch.randint(0, 1000, (1, q)), torch.tensor([q]))
        elapsed = time.perf_counter() - start
        kv.truncate(kv.lengths.cpu() - q)
        return 1e3 * elapsed

    def median_ms(q: int, flush: bool) -> float:
        times = []
        for _ in range(args.repeats):
            if flush:
                sink.copy_(source)
            times.append(timed_forward_ms(q, 0.0))
        return statistics.median(times)

    machine = measure_machine("cpu")
    weight_mb = target.native.weight_bytes / 1e6
    floor_ms = weight_mb / machine["copy_gbps"]  # MB / (GB/s) = ms
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.model} native {target.weight_format} ({weight_mb:.0f} MB of weights), context {args.context}; "
          f"copy {machine['copy_gbps']:.1f} GB/s -> weight floor {floor_ms:.2f} ms")
    print(f"{'q':>3s} {'warm ms':>9s} {'(x floor)':>9s} {'flushed ms':>11s} {'(x floor)':>9s} {'flushed / warm':>15s}")
    for q in args.queries:
        warm, flushed = median_ms(q, False), median_ms(q, True)
        print(f"{q:3d} {warm:9.2f} {warm / floor_ms:8.2f}x {flushed:11.2f} {flushed / floor_ms:8.2f}x "
              f"{flushed / warm:15.2f}")
    if args.gaps_ms:
        gaps = [0.0] + list(args.gaps_ms)
        print("after a busy pause (median ms; x back to back):")
        print(f"{'q':>3s} " + " ".join(f"{f'gap {g:g} ms':>17s}" for g in gaps))
        for q in args.queries:
            samples = {g: [] for g in gaps}
            for _ in range(args.repeats):
                for g in gaps:
                    samples[g].append(timed_forward_ms(q, g))
            medians = [statistics.median(samples[g]) for g in gaps]
            cells = [f"{medians[0]:17.2f}"] + [f"{ms:9.2f} ({ms / medians[0]:4.2f}x)" for ms in medians[1:]]
            print(f"{q:3d} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
