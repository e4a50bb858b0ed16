#!/usr/bin/env python
"""Forward benchmark against the roofline, the same as `specadapt bench-forward` (see `--help`).

    python scripts/bench_forward.py --json results/bench_forward.json
    python scripts/bench_forward.py --quick
"""

import sys

from specadapt.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-forward", *sys.argv[1:]]))
