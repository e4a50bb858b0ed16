"""Running ``specadapt generate`` in-process for CLI tests."""

from __future__ import annotations

from specadapt.cli import main


def run_generate(capsys, *argv):
    """``specadapt generate --no-progress *argv`` -> ``(exit code, stdout, stderr)`` (argparse exits caught)."""
    try:
        code = main(["generate", "--no-progress", *argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
