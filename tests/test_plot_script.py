"""scripts/plot_acceptance.py draws one curve per JSON report; scripts/tts_study.py aggregates fine buckets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(accs, tts=False):
    buckets = [{"start": s, "end": e, "rounds": 10, "acceptance_length": a}
               for (s, e), a in zip([(0, 256), (256, 512), (512, 1024)], accs)]
    config = {"draft": "eagle", "tts": tts, "tts_stride": 5}
    return {"config": config, "summary": {"acceptance_by_position": buckets}}


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _load("plot_acceptance")
    files = []
    for i, tts in enumerate([False, True]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(_report([2.0, 1.5, 1.2 + i], tts)))
        files.append(str(path))
    out = tmp_path / "fig.png"
    assert plot.main([*files, "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert plot.curve(_report([2.0, 1.5, 1.2])) == ([128.0, 384.0, 768.0], [2.0, 1.5, 1.2])
    assert plot.main([str(tmp_path / "missing.json"), "--out", str(out)]) == 2


def test_study_bucket_aggregation_weights_by_rounds():
    study = _load("tts_study")
    summary = {"acceptance_by_position": [
        {"start": 0, "end": 256, "rounds": 10, "acceptance_length": 2.0},
        {"start": 256, "end": 512, "rounds": 30, "acceptance_length": 1.0},
        {"start": 512, "end": 1024, "rounds": 0, "acceptance_length": None},
    ]}
    assert study.bucket_acceptance(summary, 0, 512) == pytest.approx((20 + 30) / 40)
    assert study.bucket_acceptance(summary, 512, 1024) is None
    assert study.label({"config": {"draft": "eagle", "tts": True, "tts_stride": 2, "tts_params": "lora"}}) == "eagle + TTS S=2 (LoRA)"


def test_av_sweep_pareto_front_and_gap():
    sweep = _load("av_sweep")
    points = [(12.3, 45.8), (11.5, 44.5), (10.1, 38.4), (19.0, 19.0)]
    assert sorted(sweep.pareto_front(points)) == [0, 3]
    gaps = [sweep.front_gap(points, i) for i in range(len(points))]
    assert gaps[0] == 0.0 and gaps[3] == 0.0
    # (11.5, 44.5) needs x1.0293 in both coordinates to escape (12.3, 45.8): within 5%
    assert gaps[1] == pytest.approx(45.8 / 44.5 - 1)
    assert gaps[2] == pytest.approx(min(12.3 / 10.1, 45.8 / 38.4) - 1) and gaps[2] > 0.05
