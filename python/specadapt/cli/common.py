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
