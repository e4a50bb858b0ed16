#!/usr/bin/env python
"""Run `specadapt generate` over a grid of drafts and temperatures and tabulate the results as Markdown.

Each configuration is one `specadapt generate --baseline` run, so every row carries the target-only speed
measured in the same run (same prompts, same sampling). Example (the study of docs/results.md):

    python scripts/main_job_study.py --drafts ngram self:2 --temperatures 1.0 0.6 \
        --limit 3 --max-new-tokens 1024 --out results/study

writes one JSON per configuration under --out and prints (and writes to --out/table.md) the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def table(reports: list[dict]) -> str:
    """One row per report: end-to-end tok/s and speedup, then decode tok/s (the rounds only) and the decode speedup
    (the report's ``speedup``). Reports written before prefill and decode were timed apart have no
    ``end_to_end_speedup``: their ``speedup`` was end to end, and their decode columns are blank."""
    edges = [b["start"] for b in reports[0]["summary"]["acceptance_by_position"] if b["rounds"]] if reports else []
    head = (
        "| draft | T | acc. length | tok/s | target-only tok/s | end-to-end speedup | decode tok/s | "
        "target-only decode tok/s | decode speedup | repeat rate | "
        + " | ".join(f"acc. len [{e}, …)" for e in edges)
        + " |"
    )
    lines = [head, "|" + "---|" * (10 + len(edges))]
    for r in reports:
        c, s = r["config"], r["summary"]
        by_pos = {b["start"]: b["acceptance_length"] for b in s["acceptance_by_position"]}
        timed_apart = "end_to_end_speedup" in s
        end_to_end = s["end_to_end_speedup"] if timed_apart else s["speedup"]
        decode = s["speedup"] if timed_apart else None
        lines.append(
            f"| {c['draft']} | {c['temperature']} | {_fmt(s['acceptance_length'])} | {_fmt(s['tokens_per_s'], '.1f')} | "
            f"{_fmt(s['baseline_tokens_per_s'], '.1f')} | {_fmt(end_to_end)} | "
            f"{_fmt(s.get('decode_tokens_per_s'), '.1f')} | {_fmt(s.get('baseline_decode_tokens_per_s'), '.1f')} | "
            f"{_fmt(decode)} | {_fmt(s['ngram_repeat_rate'])} | "
            + " | ".join(_fmt(by_pos.get(e)) for e in edges)
            + " |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", default=["ngram", "self:2"])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[1.0, 0.6])
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--num-draft-tokens", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=3)
    ap.add_argument("--verify", default="chain")
    ap.add_argument("--out", default="results/study")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="passed to specadapt generate")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for temperature in args.temperatures:
        for draft in args.drafts:
            path = out / f"{draft.replace(':', '')}_T{temperature}.json"
            cmd = [
                sys.executable, "-m", "specadapt", "generate", "--draft", draft, "--temperature", str(temperature),
                "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
                "--num-draft-tokens", str(args.num_draft_tokens), "--batch-size", str(args.batch_size),
                "--verify", args.verify, "--baseline", "--json", str(path), *args.extra,
            ]
            print("$", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)
            reports.append(json.loads(path.read_text()))
    md = table(reports)
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
