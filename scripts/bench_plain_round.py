#!/usr/bin/env python
"""What a round with speculation off costs over a target-only round, timed in lock-step.

Two engines on the same target decode the same prompts side by side, one round each in turn (which of the two
goes first alternates), so the host's drift hits both alike: a target-only engine and the engine
``specadapt generate`` builds with the EAGLE draft and speculation off (``--mode off``: ``--speculation off``,
every round a plain target step that queues the head's features) or with adaptive verification (``--mode av``:
``--adaptive-verification``; only the rounds its budget switched off are compared, a probe or speculative round
is left out). Prints the CPU, the machine's copy rate and the target's weight floor measured in the same run,
the two engines' median round, and the median and mean of the paired per-round difference. In ``off`` mode both
engines draw the same coins, so their text must be equal (checked); in ``av`` mode a probe's accepted draft can
change the text that follows. Then the whole run, every round and each prompt's join (prefill) included: the two
engines' tokens/s ratio, and the measured engine's time by round kind (rounds off, probes, speculative rounds,
joins) against what target-only spent per token on the same number of tokens -- where an AV run's time over
target-only goes.

    python scripts/bench_plain_round.py --mode av --limit 3 --max-new-tokens 700

Run nothing else meanwhile: the differences are tens of microseconds on a 4-ms round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["off", "av"], default="off",
                    help="off: the EAGLE draft loaded with --speculation off (every round plain); av: adaptive "
                         "verification, its rounds off only (default: off)")
    ap.add_argument("--model", default="smollm2-135m", help="target model spec (default: smollm2-135m)")
    ap.add_argument("--dataset", default="aime24", help="prompts: a bundled dataset or a .jsonl file (default: aime24)")
    ap.add_argument("--limit", type=int, default=3, help="prompts, decoded one after another at batch 1")
    ap.add_argument("--max-new-tokens", type=int, default=700)
    ap.add_argument("--num-draft-tokens", type=int, default=7, help="L of the AV engine")
    args = ap.parse_args()
    if args.limit < 1 or args.max_new_tokens < 1 or args.num_draft_tokens < 1:
        ap.error("--limit, --max-new-tokens and --num-draft-tokens must be positive")
    import torch

    from specadapt.bench.forward import cpu_name, measure_machine
    from specadapt.cli import generate as generate_cli
    from specadapt.cli.engine_args import _tokenize, build_engine, validate_engine_args
    from specadapt.datasets import load_prompts
    from specadapt.engine import NoDraft, SpeculativeEngine
    from specadapt.engine.loop import Request

    parser = argparse.ArgumentParser()
    generate_cli.add_parser(parser.add_subparsers())
    mode_flags = (["--adaptive-verification", "--num-draft-tokens", str(args.num_draft_tokens)] if args.mode == "av"
                  else ["--speculation", "off", "--num-draft-tokens", "1"])
    flags = parser.parse_args(["generate", "--model", args.model, "--draft", "eagle", "--batch-size", "1",
                               *mode_flags])
    validate_engine_args(flags)
    built = build_engine(flags, 1)  # the target, the draft and the engine as `specadapt generate` builds them
    other, adaptive = built.engine, built.adaptive
    plain = SpeculativeEngine(built.target, NoDraft(), built.sampling, 0, seed=flags.seed)
    prompts = [_tokenize(built.target.tokenizer, p.text) for p in load_prompts(args.dataset, limit=args.limit)]
    ms = {"target-only": [], args.mode: []}
    # whole-run accounting (every round, probes and speculative rounds included, and the joins' prefills): round
    # ms and emitted tokens per engine, join ms per engine, and the measured engine's ms / rounds / tokens by kind
    round_ms = {"target-only": 0.0, args.mode: 0.0}
    total_tokens = {"target-only": 0, args.mode: 0}
    kinds = {kind: [0.0, 0, 0] for kind in ("off", "probe", "on")}
    join_ms = {"target-only": 0.0, args.mode: 0.0}
    for prompt in prompts:
        texts = {"target-only": [], args.mode: []}
        for name, engine in (("target-only", plain), (args.mode, other)):
            engine.open_batch()
            start = time.perf_counter()
            engine.join([Request(prompt, args.max_new_tokens, flags.seed)])
            join_ms[name] += (time.perf_counter() - start) * 1e3
        turn = 0
        while plain.num_active and other.num_active:
            order = [("target-only", plain), (args.mode, other)]
            times, off_round = {}, True
            for name, engine in order if turn % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                events = engine.step()
                times[name] = (time.perf_counter() - start) * 1e3
                texts[name].extend(events[0][1])
                round_ms[name] += times[name]
                total_tokens[name] += len(events[0][1])
                if engine is other:
                    kind = "off" if adaptive is None else adaptive.round_kind
                    off_round = kind == "off"  # a probe or speculative round is not compared
                    kinds[kind][0] += times[name]
                    kinds[kind][1] += 1
                    kinds[kind][2] += len(events[0][1])
            turn += 1
            if off_round:
                for name, value in times.items():
                    ms[name].append(value)
        for engine in (plain, other):
            engine.close_batch()
        shorter = min(len(texts["target-only"]), len(texts[args.mode]))
        if args.mode == "off" and texts["target-only"][:shorter] != texts["off"][:shorter]:
            raise SystemExit("the two engines decoded different text: the plain round's coins changed")
    built.close()
    if not ms["target-only"]:
        raise SystemExit("no round to compare (every adaptive-verification round drafted)")
    machine = measure_machine("cpu")
    floor_ms = built.target.native.weight_bytes / (machine["copy_gbps"] * 1e9) * 1e3 if built.target.native else None
    diffs = [b - a for a, b in zip(ms["target-only"], ms[args.mode])]
    base = statistics.median(ms["target-only"])
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {len(diffs)} paired rounds "
          f"(batch 1, {args.dataset}, {args.limit} prompts); copy {machine['copy_gbps']:.1f} GB/s"
          + (f", target weight floor {floor_ms:.2f} ms" if floor_ms else ""))
    print(f"median ms: target-only {base:.3f}" + (f" ({base / floor_ms:.2f}x the floor)" if floor_ms else "")
          + f", {args.mode} {statistics.median(ms[args.mode]):.3f}; paired difference: median "
          f"{statistics.median(diffs) * 1e3:.0f} us ({100 * statistics.median(diffs) / base:.1f}% of a target-only "
          f"round), mean {statistics.fmean(diffs) * 1e3:.0f} us")
    run_ms = {name: round_ms[name] + join_ms[name] for name in round_ms}  # rounds and joins
    per_token = {name: run_ms[name] / max(total_tokens[name], 1) for name in run_ms}
    print(f"whole run (every round and join): target-only {total_tokens['target-only']} tokens in "
          f"{run_ms['target-only']:.0f} ms, {args.mode} {total_tokens[args.mode]} tokens in {run_ms[args.mode]:.0f} ms; "
          f"{args.mode} / target-only tokens/s {per_token['target-only'] / per_token[args.mode]:.3f}")
    round_ms_per_token = round_ms["target-only"] / max(total_tokens["target-only"], 1)
    for kind, (kind_ms, rounds, tokens) in kinds.items():
        if rounds:
            extra = kind_ms - tokens * round_ms_per_token
            print(f"  {args.mode} {kind}: {rounds} rounds, {tokens} tokens, {kind_ms:.0f} ms ({kind_ms / rounds:.2f} ms "
                  f"each); over target-only's ms for the same tokens {extra:+.0f} ms "
                  f"({100 * extra / run_ms[args.mode]:+.1f}% of the run)")
    extra = join_ms[args.mode] - join_ms["target-only"]
    print(f"  {args.mode} joins: {len(prompts)}, {join_ms[args.mode]:.0f} ms; over target-only's joins {extra:+.0f} ms "
          f"({100 * extra / run_ms[args.mode]:+.1f}% of the run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
