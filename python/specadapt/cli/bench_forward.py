"""``specadapt bench-forward``: target and draft forwards against the machine's roofline, in one run.

Times a forward of q new tokens per request over ctx cached positions for every (forward, weight format, batch,
q, ctx) of the sweep, with the copy bandwidth, read bandwidth and GEMM rates measured first in the same process,
and prints per case the median ms, the roofline max(weight floor, FLOP floor), the ratio to it, and the
per-phase times of the native stack; then the ratios q=6 / q=1, draft step / target step and native / hf.
Layout of ``--json``: ``{"machine": {...}, "results": [...], "ratios": {...}}`` (specadapt/bench/forward.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import UsageError, add_threads_argument, apply_threads

_FORMATS = ("float32", "bfloat16", "int8", "int4", "gguf")
_FORWARDS = ("hf", "native", "native-compiled")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} must list integers >= 1, got {text!r}")
    return values


def _names(text: str, choices, flag: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in choices]
    if bad or not values:
        raise UsageError(f"{flag} must be a comma-separated subset of {','.join(choices)}, got {text!r}")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("bench-forward", help="target / draft forwards against the machine's roofline",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="target model spec")
    p.add_argument("--formats", default=",".join(_FORMATS), help="weight formats")
    p.add_argument("--forwards", default=",".join(_FORWARDS), help="hf, native, native-compiled")
    p.add_argument("--batches", default="1,4,16", help="requests per forward")
    p.add_argument("--queries", default="1,2,4,6,8", help="new tokens per request")
    p.add_argument("--contexts", default="512,4096", help="cached positions per request")
    p.add_argument("--repeats", type=int, default=10, help="timed forwards per case (hf: a third)")
    p.add_argument("--compile-cases", type=int, default=2, help="query sizes compiled for native-compiled")
    p.add_argument("--no-draft", action="store_true", help="skip the EAGLE draft step")
    p.add_argument("--quick", action="store_true", help="batch 1, q 1 and 6, ctx 512, native and hf (about a minute)")
    p.add_argument("--json", default=None, metavar="PATH")
    add_threads_argument(p)
    p.set_defaults(run=run)


def run(args) -> int:
    apply_threads(args)
    from ..bench.forward import run_forward_benchmark

    formats = _names(args.formats, _FORMATS, "--formats")
    forwards = _names(args.forwards, _FORWARDS, "--forwards")
    batches, queries, contexts = (_ints(args.batches, "--batches"), _ints(args.queries, "--queries"),
                                  _ints(args.contexts, "--contexts"))
    if args.quick:
        batches, queries, contexts = [1], [1, 6], [512]
        forwards = [f for f in forwards if f != "native-compiled"]
    report = run_forward_benchmark(formats, forwards, batches, queries, contexts, repeats=args.repeats,
                                   draft=not args.no_draft, model_spec=args.model, compile_cases=args.compile_cases,
                                   progress=lambda line: print(line, flush=True))
    m = report["machine"]
    print(f"\nmachine: {m['name']}, {m['threads']} threads, torch {m['torch']}: copy {m['copy_gbps']:.1f} GB/s, "
          f"read {m['read_gbps']:.1f} GB/s, GEMM fp32 {m['gemm_fp32_gflops']:.0f} / bf16 {m['gemm_bf16_gflops']:.0f} "
          "GFLOP/s")
    print(f"{'model':<7}{'forward':<17}{'format':<9}{'B':>3}{'q':>3}{'ctx':>6}{'ms':>9}{'roofline':>9}{'x roof':>8}"
          f"{'MB':>7}{'kv ms':>7}")
    for r in report["results"]:
        print(f"{r['model']:<7}{r['forward']:<17}{r['weight_format']:<9}{r['batch']:>3}{r['query']:>3}{r['context']:>6}"
              f"{r['median_ms']:>9.2f}{r['roofline_ms']:>9.2f}{r['x_roofline']:>8.2f}{r['weight_mb']:>7.0f}"
              f"{r['kv_floor_ms']:>7.2f}" + (f"  compile {r['compile_seconds']:.1f}s" if r["compile_seconds"] else ""))
        if r["phases_ms"]:
            print("      phases (ms): " + "  ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items()))
    for name, values in report["ratios"].items():
        if values:
            print(f"\n{name}:")
            for key, value in values.items():
                print(f"  {key}: {value:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0
