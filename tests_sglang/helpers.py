"""Helpers of the tests_sglang modules: the probe programs run in fresh subprocesses (``_probes.py``) and the
``launch_server`` arguments on the tiny config-only models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


PROBES = Path(__file__).resolve().parent / "_probes.py"


def _probe(*args, env=None, timeout=600):
    proc = subprocess.run([sys.executable, str(PROBES), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _args(tiny_models, *extra, algorithm="EAGLE3"):
    draft = tiny_models["eagle3"] if algorithm == "EAGLE3" else tiny_models["target"]
    return ["--model-path", tiny_models["target"], "--speculative-algorithm", algorithm,
            "--speculative-draft-model-path", draft, "--device", "cuda", "--skip-tokenizer-init", *extra]
