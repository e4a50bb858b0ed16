"""``specadapt bench-kernels``: fused verification kernels against the float64 reference.

Prints one row per case (median ms, GB/s, fraction of the copy bandwidth measured in the same run, speedup over
the reference) and optionally writes JSON ``{"copy_bandwidth_gbps", "cases": [{"op", "device", "B", "L", "V",
"K", "median_ms", "gbps", "bandwidth_fraction", "speedup_vs_reference"}]}``. On ``--device cuda`` it also times the
external baselines that are importable (flashinfer's chain kernel against ``chain``, SGLang's Triton kernel
against ``chain`` and ``block``) and adds ``"baselines": {name: {"median_ms", "speedup"}}`` to those cases
(speedup = baseline ms / our ms); ``baseline_status`` says which were found and why the others were skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..verification.rules import RULES, join_names
from .common import UsageError, add_threads_argument, apply_threads


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-kernels",
        help="microbenchmark of the verification kernels",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a representative subset (under a minute on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--ops", default=",".join(RULES), help=f"comma-separated subset of {','.join(RULES)}")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats of the fused kernel per case")
    p.add_argument("--reference-repeats", type=int, default=1, help="timed repeats of the slow reference")
    p.add_argument("--no-reference", action="store_true", help="skip timing the reference")
    p.add_argument("--no-baselines", action="store_true",
                   help="do not time flashinfer / SGLang baselines (CUDA only, when importable)")
    p.add_argument("--impl", choices=["compiled", "cupy"], default="compiled",
                   help="time specadapt._C, or the CuPy (NVRTC) JIT of the same CUDA kernels (cuda only)")
    p.add_argument("--json", default=None, metavar="PATH")
    add_threads_argument(p)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    apply_threads(args)
    import torch

    from ..bench.kernels import FULL_SWEEP, QUICK_CASES, run_benchmark

    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    if args.repeats < 1 or args.reference_repeats < 1:
        raise UsageError("--repeats and --reference-repeats must be >= 1")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(RULES))
    if unknown or not ops:
        raise UsageError(f"--ops must name {join_names(RULES)}, got {args.ops!r}")
    cases = [c for c in (QUICK_CASES if args.quick else FULL_SWEEP) if c.op in ops]
    try:
        report = run_benchmark(cases, torch.device(args.device), args.repeats, args.reference_repeats,
                               not args.no_reference, progress=not args.no_progress,
                               with_baselines=not args.no_baselines, impl=args.impl)
    except ValueError as exc:
        raise UsageError(f"--device / --impl: {exc}") from None
    print(f"copy bandwidth {report['copy_bandwidth_gbps']:.1f} GB/s on {report['device']} "
          f"({report['threads']} threads)")
    print(report["baseline_status"]["line"])
    print(f"{'op':>6} {'B':>4} {'L':>3} {'V':>7} {'K':>2} {'ms':>9} {'GB/s':>7} {'of copy':>8} {'vs ref':>8}"
          "  baselines (their ms / our ms)")
    for c in report["cases"]:
        speed = "-" if c["speedup_vs_reference"] is None else f"{c['speedup_vs_reference']:.1f}x"
        print(f"{c['op']:>6} {c['B']:>4} {c['L']:>3} {c['V']:>7} {c['K']:>2} {c['median_ms']:>9.3f} "
              f"{c['gbps']:>7.1f} {c['bandwidth_fraction']:>8.0%} {speed:>8}  {_baseline_cell(c)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _baseline_cell(case: dict) -> str:
    parts = []
    for name, b in case.get("baselines", {}).items():
        if b.get("speedup") is None:
            parts.append(f"{name} failed")
        else:
            parts.append(f"{name} {b['median_ms']:.3f} ms = {b['speedup']:.2f}x")
    return ", ".join(parts) or "-"
