#!/usr/bin/env python
"""Throughput sweep of adaptive verification: fixed L in {2, 3, 5, 7} vs adaptive verification with L = 7, at
batch sizes 1, 4, 8, 16 (AIME 2024 prompts, temperature 1.0). Loads the target and draft once (in-process).

    python scripts/av_sweep.py --draft eagle --batch-sizes 1 4 8 16 --max-new-tokens 256 --out results/av_sweep

A target-only row (no draft) per batch size is the reference speculation has to beat (``--no-target-only``
skips it). Per (batch size, setting): total tokens/s (all output tokens / wall time of the batch) and mean per-request
tokens/s (each request's tokens / its own decode time); writes --out/sweep.json, --out/table.md and the Pareto
plot --out/pareto.png (x: per-request tokens/s, y: total tokens/s, one panel per batch size). Each batch uses
the first ``batch size`` prompts (cycled if the dataset is shorter), so every setting of one batch size decodes
the same requests; the cost table is profiled once per batch size, as the engine does at start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from specadapt.datasets import load_prompts  # noqa: E402
from specadapt.engine import NoDraft, SpeculativeEngine, build_draft, load_model  # noqa: E402
from specadapt.engine.adaptive import AdaptiveVerification, profile_engine_costs  # noqa: E402
from specadapt.estimator import AcceptanceEstimator  # noqa: E402
from specadapt.sampling import SamplingParams  # noqa: E402


def chat_ids(tokenizer, text):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def run_setting(target, draft, sampling, prompts, L, adaptive, max_new, seed, packed_forward=True):
    engine = SpeculativeEngine(target, draft, sampling, L, "chain", seed=seed, adaptive=adaptive,
                               packed_forward=packed_forward)
    start = time.perf_counter()
    results = engine.generate(prompts, max_new, batch_size=len(prompts))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in results)
    per_request = [len(r.output_ids) / r.seconds for r in results if r.seconds > 0]
    rounds = sum(len(r.rounds) for r in results)
    out = {"total_tokens_per_s": tokens / seconds, "per_request_tokens_per_s": sum(per_request) / len(per_request),
           "acceptance_length": tokens / max(rounds, 1), "tokens": tokens, "seconds": seconds}
    if adaptive is not None:
        out.update(pruned=adaptive.pruned, verified=adaptive.verified, refits=adaptive.estimator.refits)
    return out


def pareto_front(points):
    """Indices of points not dominated in (per-request, total) tokens/s (both larger is better)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return front


def front_gap(points, i):
    """Smallest eps >= 0 such that point i scaled by (1 + eps) in both coordinates is dominated by no point
    (0 on the Pareto front; "within 5% of the front" means eps <= 0.05)."""
    x, y = points[i]
    worst = max(min(x2 / x, y2 / y) for x2, y2 in points) if x > 0 and y > 0 else float("inf")
    return max(0.0, worst - 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="eagle")
    ap.add_argument("--dataset", default="aime24")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--fixed-l", nargs="+", type=int, default=[2, 3, 5, 7])
    ap.add_argument("--adaptive-l", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--no-target-only", dest="target_only", action="store_false",
                    help="skip the target-only row (no draft) of each batch size")
    ap.add_argument("--refit-interval", type=int, default=20, help="estimator refit interval (decode steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-packed-forward", dest="packed_forward", action="store_false",
                    help="pad the target's ragged forwards (default: packed, pruned drafts cost no compute)")
    ap.add_argument("--out", default="results/av_sweep")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sampling = SamplingParams(args.temperature, args.top_p)
    target = load_model(args.model)
    texts = [p.text for p in load_prompts(args.dataset)]
    rows = []
    settings = [(f"L={L}", L, False) for L in args.fixed_l] + [(f"adaptive L={args.adaptive_l}", args.adaptive_l, True)]
    if args.target_only:
        settings = [("target-only", 0, False)] + settings
    bar = tqdm(total=len(args.batch_sizes) * len(settings), desc="sweep", unit="run")
    for batch in args.batch_sizes:
        prompts = [chat_ids(target.tokenizer, texts[i % len(texts)]) for i in range(batch)]
        draft = build_draft(args.draft, target, sampling, args.seed)
        costs = profile_engine_costs(target.model, getattr(draft, "model", None), (args.adaptive_l + 1) * batch,
                                     batch, args.adaptive_l)
        SpeculativeEngine(target, draft, sampling, 2, "chain").generate(prompts[:1], 4)  # warm-up
        for name, L, adaptive in settings:
            draft = NoDraft() if L == 0 else build_draft(args.draft, target, sampling, args.seed)
            av = None
            if adaptive:
                av = AdaptiveVerification(AcceptanceEstimator(L, refit_interval=args.refit_interval), costs)
            result = run_setting(target, draft, sampling, prompts, L, av, args.max_new_tokens, args.seed,
                                 args.packed_forward)
            rows.append({"batch_size": batch, "setting": name, **result})
            bar.update(1)
            bar.set_postfix(batch=batch, setting=name, tps=f"{result['total_tokens_per_s']:.1f}")
    bar.close()
    lines = ["| batch | setting | total tok/s | per-request tok/s | acc. length | on Pareto front | gap to front |",
             "|---|---|---|---|---|---|---|"]
    for batch in args.batch_sizes:
        group = [r for r in rows if r["batch_size"] == batch]
        points = [(r["per_request_tokens_per_s"], r["total_tokens_per_s"]) for r in group]
        front = set(pareto_front(points))
        for i, r in enumerate(group):
            r["gap_to_front"] = front_gap(points, i)
            lines.append(f"| {batch} | {r['setting']} | {r['total_tokens_per_s']:.1f} | {r['per_request_tokens_per_s']:.1f} | "
                         f"{r['acceptance_length']:.2f} | {'yes' if i in front else ''} | {100 * r['gap_to_front']:.1f}% |")
    (out / "sweep.json").write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))
    md = "\n".join(lines)
    (out / "table.md").write_text(md + "\n")
    print(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.batch_sizes), figsize=(4 * len(args.batch_sizes), 3.6), squeeze=False)
        for ax, batch in zip(axes[0], args.batch_sizes):
            group = [r for r in rows if r["batch_size"] == batch]
            for r in group:
                marker = "*" if r["setting"].startswith("adaptive") else "o"
                ax.scatter(r["per_request_tokens_per_s"], r["total_tokens_per_s"], marker=marker, s=80 if marker == "*" else 30)
                ax.annotate(r["setting"], (r["per_request_tokens_per_s"], r["total_tokens_per_s"]), fontsize=7)
            ax.set_title(f"batch {batch}")
            ax.set_xlabel("per-request tok/s")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("total tok/s")
        fig.tight_layout()
        fig.savefig(out / "pareto.png", dpi=110)
        print(f"wrote {out / 'pareto.png'}")
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
