#!/usr/bin/env python
"""Kernel microbenchmark, the same as `specadapt bench-kernels` (see `--help`).

    python scripts/bench_kernels.py --quick --device cpu --json results/bench_cpu_quick.json
"""

import sys

from specadapt.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-kernels", *sys.argv[1:]]))
