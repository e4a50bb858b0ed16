#!/usr/bin/env python
"""Block efficiency of chain vs block vs GBV (K = 2, 3, 4) on the embedded model pair, across temperatures.

Block efficiency = tokens emitted per target forward (= acceptance length: one target forward per round).
The target is SmolLM2-135M-Instruct; the draft its EAGLE head (``eagle``, issue 4) or a layer-truncated copy
of it (``self:N``); GBV needs a sampled draft (the ngram draft's q is one-hot, so its K paths would all be the
same). Every configuration decodes the same AIME 2024 prompts with the same seed; tokens/s of each run is
reported beside the target-only baseline measured in the same process.

    python scripts/block_efficiency_study.py --draft eagle --limit 3 --max-new-tokens 384 \
        --json results/block_efficiency_eagle.json --markdown docs/block_efficiency_table.md \
        --plot docs/figures/block_efficiency.png
    python scripts/block_efficiency_study.py --replot results/block_efficiency_eagle.json --plot out.png
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
    ap.add_argument("--plot", default=None, metavar="PNG", help="block efficiency and tokens/s against temperature")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw --plot / --markdown from a JSON")
    args = ap.parse_args()
    if args.replot:
        rows = json.loads(Path(args.replot).read_text())["rows"]
        _write_outputs(rows, args.markdown, args.plot)
        return 0

    from specadapt.cli.engine_args import _tokenize
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
    _write_outputs(rows, args.markdown, args.plot)
    return 0


def _label(row: dict) -> str:
    return row["rule"] if row["rule"] != "gbv" else f"gbv K={row['num_paths']}"


def _write_outputs(rows: list[dict], markdown: str | None, plot: str | None) -> None:
    lines = ["| T | rule | K | block efficiency | tok/s | target-only tok/s | speedup |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['temperature']} | {r['rule']} | {r['num_paths']} | {r['block_efficiency']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} | {r['speedup']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if markdown:
        Path(markdown).write_text(table + "\n")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_be, ax_tps) = plt.subplots(1, 2, figsize=(10, 4))
        for label in dict.fromkeys(_label(r) for r in rows):
            mine = sorted((r for r in rows if _label(r) == label), key=lambda r: r["temperature"])
            temps = [r["temperature"] for r in mine]
            ax_be.plot(temps, [r["block_efficiency"] for r in mine], marker="o", label=label)
            ax_tps.plot(temps, [r["tokens_per_s"] for r in mine], marker="o", label=label)
        base = sorted({(r["temperature"], r["baseline_tokens_per_s"]) for r in rows})
        ax_tps.plot([t for t, _ in base], [b for _, b in base], "k--", label="target only")
        ax_be.set(xlabel="temperature", ylabel="block efficiency (tokens / target forward)")
        ax_tps.set(xlabel="temperature", ylabel="tokens / s")
        draft = rows[0].get("draft", "?") if rows else "?"
        fig.suptitle(f"chain vs block vs GBV, draft {draft}, SmolLM2-135M target")
        ax_be.legend(fontsize=8)
        ax_tps.legend(fontsize=8)
        fig.tight_layout()
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120)
        print(f"wrote {plot}")


if __name__ == "__main__":
    sys.exit(main())
