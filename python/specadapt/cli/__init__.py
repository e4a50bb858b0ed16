"""Command line: ``specadapt <command> [options]`` (also ``python -m specadapt``).

Commands:
    generate        long-generation speculative decoding on benchmark prompts with the embedded engine.
    serve           the embedded engine as an OpenAI-compatible server (continuous batching, SSE, metrics).
    bench-kernels   microbenchmark of the fused verification kernels against the reference.
    bench-forward   target / draft forwards (hf, native, compiled; every weight format) against the roofline.
    eval-estimator  calibration (AUC, log-loss, ECE) of the acceptance estimator from a --log-drafts file.
    demo            every technique side by side on the same prompts: one table and one plot.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .common import UsageError, OneLineErrorParser

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    from . import bench_forward, bench_kernels, demo, eval_estimator, generate, serve

    parser = OneLineErrorParser(prog="specadapt", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench_kernels.add_parser(sub)
    bench_forward.add_parser(sub)
    eval_estimator.add_parser(sub)
    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specadapt`` console script. Returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except UsageError as exc:
        print(f"specadapt {args.command}: error: {exc}", file=sys.stderr)
        return 2
