#!/usr/bin/env python
"""Plot acceptance length against output (or context) position, one curve per `specadapt generate --json` file.

    python scripts/plot_acceptance.py results/tts_T1.0/*.json --out docs/figures/tts_acceptance.png

x: the middle of each output-position bucket of the runs' ``summary.acceptance_by_position`` (choose fine
buckets with ``--bucket-edges``), or with ``--context`` of the long sessions' absolute context-position buckets
(``specadapt generate --session N``); y: acceptance length (tokens per round) in that bucket. Needs matplotlib
(``pip install specadapt[plot]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specadapt.cli.long_gen.plot import acceptance_curve as curve
from specadapt.cli.long_gen.plot import setting_label


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="JSON files written by specadapt generate --json")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--title", default=None, help="default: acceptance length vs output / context position")
    ap.add_argument("--context", action="store_true",
                    help="x = absolute context position (reports of specadapt generate --session N)")
    args = ap.parse_args(argv)
    axis = "context" if args.context else "output"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_acceptance: matplotlib is not installed (pip install 'specadapt[plot]')", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for path in args.files:
        if not path.is_file():
            print(f"plot_acceptance: {path} does not exist", file=sys.stderr)
            return 2
        report = json.loads(path.read_text())
        try:
            xs, ys = curve(report, context=args.context)
        except ValueError as exc:
            print(f"plot_acceptance: {path}: {exc}", file=sys.stderr)
            return 2
        ax.plot(xs, ys, marker="o", label=setting_label(report, path.stem))
    ax.set_xlabel(f"{axis} position (tokens)")
    ax.set_ylabel("acceptance length (tokens / round)")
    ax.set_title(args.title or f"acceptance length vs {axis} position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
