#!/usr/bin/env python
"""What a request joining a running batch costs with the EAGLE draft loaded, over target-only, timed in lock-step.

Two engines on the same target each hold a running batch of ``--batch-size`` requests: a target-only engine and
the engine ``specadapt generate`` builds with the EAGLE draft and ``--speculation off`` (its join also captures
the target's feature layers over the new prompt and queues them for the head's deferred catch-up; a speculating
engine's join is the same call). Each turn, in both engines (which goes first alternates), the oldest request is
cancelled and the next prompt joins in its place, then one round runs; only the joins are timed. Prints the CPU,
the machine's copy rate measured in the same run, the two engines' median join and the median / mean of the
paired difference.

    python scripts/bench_join.py --batch-size 32 --joins 40

Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="target model spec (default: smollm2-135m)")
    ap.add_argument("--dataset", default="aime24", help="prompts: a bundled dataset or a .jsonl file (default: aime24)")
    ap.add_argument("--batch-size", type=int, default=32, help="running requests in each engine (default: 32)")
    ap.add_argument("--joins", type=int, default=40, help="timed joins per engine (default: 40)")
    args = ap.parse_args()
    if args.batch_size < 1 or args.joins < 1:
        ap.error("--batch-size and --joins must be positive")
    import torch

    from specadapt.bench.forward import cpu_name, measure_machine
    from specadapt.cli import generate as generate_cli
    from specadapt.cli.engine_args import _tokenize, build_engine, validate_engine_args
    from specadapt.datasets import load_prompts
    from specadapt.engine import NoDraft, SpeculativeEngine
    from specadapt.engine.loop import Request

    parser = argparse.ArgumentParser()
    generate_cli.add_parser(parser.add_subparsers())
    flags = parser.parse_args(["generate", "--model", args.model, "--draft", "eagle", "--batch-size",
                               str(args.batch_size), "--speculation", "off", "--num-draft-tokens", "1"])
    validate_engine_args(flags)
    built = build_engine(flags, args.batch_size)
    engines = {"target-only": SpeculativeEngine(built.target, NoDraft(), built.sampling, 0, seed=flags.seed),
               "eagle": built.engine}
    prompts = [_tokenize(built.target.tokenizer, p.text) for p in load_prompts(args.dataset)]
    running = {name: [] for name in engines}
    for name, engine in engines.items():
        engine.open_batch()
        running[name] = [Request(prompts[i % len(prompts)], 2048, flags.seed + i, ignore_eos=True) for i in range(args.batch_size)]
        engine.join(running[name])
        engine.step()
    ms = {name: [] for name in engines}
    for turn in range(args.joins + 2):  # the first two joins warm up
        order = list(engines.items()) if turn % 2 == 0 else list(engines.items())[::-1]
        index = args.batch_size + turn
        for name, engine in order:
            engine.cancel([running[name].pop(0)])
            new = Request(prompts[index % len(prompts)], 2048, flags.seed + index, ignore_eos=True)
            start = time.perf_counter()
            engine.join([new])
            elapsed = (time.perf_counter() - start) * 1e3
            running[name].append(new)
            engine.step()
            if turn >= 2:
                ms[name].append(elapsed)
    for engine in engines.values():
        engine.close_batch()
    built.close()
    machine = measure_machine("cpu")
    diffs = [b - a for a, b in zip(ms["target-only"], ms["eagle"])]
    base = statistics.median(ms["target-only"])
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; copy "
          f"{machine['copy_gbps']:.1f} GB/s; batch {args.batch_size}, {len(diffs)} paired joins ({args.dataset})")
    print(f"median join ms: target-only {base:.2f}, eagle (features captured and queued) "
          f"{statistics.median(ms['eagle']):.2f}; paired difference: median {statistics.median(diffs):.2f} ms "
          f"({100 * statistics.median(diffs) / base:.1f}%), mean {statistics.fmean(diffs):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
