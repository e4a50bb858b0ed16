#!/usr/bin/env python
"""What a round with speculation off costs over a target-only round, timed in lock-step.

Two engines on the same target decode the same prompts side by side, alternating rounds (which of the two goes
first alternates too), so the host's drift hits both alike: a target-only engine and one with the EAGLE draft
loaded and speculation off (``--mode off``: ``--speculation off``, every round a plain target step that queues the
head's features), or with adaptive verification (``--mode av``: only the rounds its budget switched off are
compared, a probe or speculative round is left out). Prints the median and mean of the paired per-round
difference (us) beside the two medians, and the CPU. In ``off`` mode both engines draw the same coins, so their
text must be equal (checked); in ``av`` mode a probe's accepted draft can change the text that follows.

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

    from specadapt.bench.forward import cpu_name
    from specadapt.cli import generate as generate_cli
    from specadapt.cli.engine_args import _adaptive, _tokenize, load_target_and_draft
    from specadapt.datasets import load_prompts
    from specadapt.engine.drafts import NoDraft
    from specadapt.engine.loop import Request, SpeculativeEngine
    from specadapt.sampling import SamplingParams

    sampling = SamplingParams(1.0, top_p=0.95)
    target, draft = load_target_and_draft(args.model, "eagle", sampling, 0, "auto", "cpu", forward="native")
    prompts = [_tokenize(target.tokenizer, p.text) for p in load_prompts(args.dataset, limit=args.limit)]
    plain = SpeculativeEngine(target, NoDraft(), sampling, 0, seed=0)
    adaptive = None
    if args.mode == "av":
        parser = argparse.ArgumentParser()
        generate_cli.add_parser(parser.add_subparsers())
        flags = parser.parse_args(["generate", "--draft", "eagle", "--adaptive-verification", "--batch-size", "1",
                                   "--num-draft-tokens", str(args.num_draft_tokens)])
        adaptive = _adaptive(flags, target, draft, 1)
        other = SpeculativeEngine(target, draft, sampling, args.num_draft_tokens, seed=0, adaptive=adaptive)
    else:
        other = SpeculativeEngine(target, draft, sampling, 1, seed=0, speculation="off")
    ms = {"target-only": [], args.mode: []}
    for prompt in prompts:
        texts = {"target-only": [], args.mode: []}
        for engine in (plain, other):
            engine.open_batch()
            engine.join([Request(prompt, args.max_new_tokens, 0)])
        turn = 0
        while plain.num_active and other.num_active:
            times = {}
            order = [("target-only", plain), (args.mode, other)]
            for name, engine in order if turn % 2 == 0 else order[::-1]:
                off_before = adaptive.rounds_off if adaptive is not None else 0
                start = time.perf_counter()
                events = engine.step()
                times[name] = (time.perf_counter() - start) * 1e3
                texts[name].extend(events[0][1])
                if adaptive is not None and name == "av" and adaptive.rounds_off == off_before:
                    times = None  # a probe or speculative round: not a round off
                    break
            turn += 1
            if times is not None and len(times) == 2:
                for name, value in times.items():
                    ms[name].append(value)
        for engine in (plain, other):
            engine.close_batch()
        if args.mode == "off" and texts["target-only"] != texts["off"][: len(texts["target-only"])]:
            raise SystemExit("the two engines decoded different text: the plain round's coins changed")
    diffs = [b - a for a, b in zip(ms["target-only"], ms[args.mode])]
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {len(diffs)} paired rounds "
          f"(batch 1, {args.dataset}, {args.limit} prompts)")
    print(f"median ms: target-only {statistics.median(ms['target-only']):.3f}, {args.mode} "
          f"{statistics.median(ms[args.mode]):.3f}; paired difference: median {statistics.median(diffs) * 1e3:.0f} us, "
          f"mean {statistics.fmean(diffs) * 1e3:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
