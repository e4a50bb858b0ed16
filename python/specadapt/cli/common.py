"""Helpers shared by the CLI commands: one-line usage errors with exit code 2."""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """Bad user input: reported as one line naming the flag, exit code 2, no traceback."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line (``prog: error: message``) and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_threads_argument(p) -> None:
    """Add ``--threads N`` to the argparse parser ``p`` (applied by :func:`apply_threads`)."""
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads of torch and of specadapt's kernels (default: the cores torch sees). On a shared "
                        "machine give each job its own: two jobs that both use every core slow each other about "
                        "tenfold on 2 cores")


def apply_threads(args) -> int:
    """Set torch's intra-op thread count (which specadapt's C++ kernels also follow: ``at::parallel_for``) from
    ``args.threads`` and store the count in use back in ``args.threads`` (so a run's JSON records it).

    Returns:
        The number of threads in use.

    Raises:
        UsageError: ``--threads`` below 1.
    """
    import torch

    threads = getattr(args, "threads", None)
    if threads is None:
        threads = torch.get_num_threads()
    elif int(threads) < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    threads = int(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    args.threads = threads
    return threads
