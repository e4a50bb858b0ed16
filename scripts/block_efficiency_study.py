#!/usr/bin/env python
"""Block efficiency of chain vs block vs GBV (K = 2, 3, 4) on the embedded model pair, across temperatures.

Block efficiency = tokens emitted per target forward (= acceptance length: one target forward per round).
The target is SmolLM2-135M-Instruct; the draft a layer-truncated copy of it (GBV needs a sampled draft:
the ngram draft's q is one-hot, so its K paths would all be the same). Every configuration decodes the same
AIME 2024 prompts with the same seed; tokens/s of each run is reported beside the target-only baseline
measured in the same process.

    python scripts/block_efficiency_study.py --draft self:8 --limit 2 --max-new-tokens 256 \
        --json results/block_efficiency.json --markdown docs/block_efficiency_table.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="self:8")
    ap.add_argument("--dataset", default="aime24")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.2, 0.6, 1.0])
    ap.add_argument("--paths", type=int, nargs="+", default=[2, 3, 4], help="K values for GBV")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="results/block_efficiency.json")
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()

    from specadapt.cli.generate import _tokenize
    from specadapt.datasets import load_prompts
    from specadapt.engine import NoDraft, SpeculativeEngine, build_draft, load_model
    from specadapt.engine.metrics import acceptance_length
    from specadapt.sampling import SamplingParams

    target = load_model(args.model)
    prompts = [_tokenize(target.tokenizer, p.text) for p in load_prompts(args.dataset, limit=args.limit)]
    configs = [("chain", 1), ("block", 1)] + [("gbv", k) for k in args.paths]
    rows = []
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature, top_p=args.top_p)
        t0 = time.perf_counter()
        base = SpeculativeEngine(target, NoDraft(), sampling, 0, seed=args.seed).generate(
            prompts, args.max_new_tokens, batch_size=len(prompts))
        base_tps = sum(len(r.output_ids) for r in base) / (time.perf_counter() - t0)
        for rule, k in configs:
            draft = build_draft(args.draft, target, sampling, args.seed)
            engine = SpeculativeEngine(target, draft, sampling, args.num_draft_tokens, rule, seed=args.seed,
                                       num_paths=k)
            t0 = time.perf_counter()
            results = engine.generate(prompts, args.max_new_tokens, batch_size=len(prompts))
            seconds = time.perf_counter() - t0
            rounds = [r for res in results for r in res.rounds]
            tokens = sum(len(res.output_ids) for res in results)
            row = {
                "temperature": temperature, "rule": rule, "num_paths": k, "draft": args.draft,
                "block_efficiency": acceptance_length(rounds), "tokens_per_s": tokens / seconds,
                "baseline_tokens_per_s": base_tps, "speedup": tokens / seconds / base_tps,
                "output_tokens": tokens, "rounds": len(rounds),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": vars(args), "torch_threads": torch.get_num_threads(),
                                           "rows": rows}, indent=2) + "\n")
    lines = ["| T | rule | K | block efficiency | tok/s | target-only tok/s | speedup |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['temperature']} | {r['rule']} | {r['num_paths']} | {r['block_efficiency']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} | {r['speedup']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
