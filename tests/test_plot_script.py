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


class _FakeEngine:
    """Each step emits 2 tokens per running row; a row finishes after 3 steps."""

    def __init__(self):
        self.rows, self.joined, self.opened = [], [], 0

    def open_batch(self):
        self.opened += 1

    def join(self, requests):
        self.joined.extend(requests)
        self.rows.extend([r, 0] for r in requests)

    def step(self):
        events = []
        for row in self.rows:
            row[1] += 1
            events.append((row[0], [1, 2], row[1] == 3))
        self.rows = [row for row in self.rows if row[1] < 3]
        return events

    def close_batch(self):
        self.opened -= 1


def test_av_sweep_cell_refills_at_eos_and_reference():
    sweep = _load("av_sweep")
    engine = _FakeEngine()
    cell = sweep.run_cell(engine, [[5], [6, 7]], batch=2, budget_tokens=20, max_new=9, seed=100)
    # 2 rows x 2 tokens per step: 5 steps reach 20 tokens; rows finish at step 3 and are refilled
    assert cell["tokens"] == 20 and cell["rounds"] == 5 and cell["requests_finished"] == 2
    assert cell["acceptance_length"] == 2.0 and engine.opened == 0
    assert cell["ms_per_round"] == pytest.approx(1e3 * cell["seconds"] / 5)
    assert [r.seed for r in engine.joined] == [100, 101, 102, 103]
    assert [list(r.prompt) for r in engine.joined] == [[5], [6, 7], [5], [6, 7]]
    cells = [{"setting": "target-only", "tokens_per_s": 10.0}, {"setting": "L=1", "tokens_per_s": 12.0},
             {"setting": "L=3", "tokens_per_s": 11.0}, {"setting": "AV", "tokens_per_s": 11.4}]
    reference, ratio = sweep.av_over_reference(cells)
    assert reference["setting"] == "L=1" and ratio == pytest.approx(0.95)
