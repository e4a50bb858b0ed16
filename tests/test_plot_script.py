"""scripts/plot_acceptance.py draws one curve per JSON report; scripts/tts_study.py aggregates fine buckets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from specadapt.cli.long_gen.plot import acceptance_buckets, setting_label

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
    assert plot.main([files[0], "--out", str(out), "--context"]) == 2  # no session buckets: a clear error
    session = _report([2.0, 1.5, 1.2])
    session["sessions"] = {"acceptance_by_context_position": [{"start": 4096, "end": 8192, "rounds": 3,
                                                               "acceptance_length": 1.7}]}
    assert plot.curve(session, context=True) == ([6144.0], [1.7])


def test_study_bucket_aggregation_weights_by_rounds():
    study = _load("tts_study")
    summary = {"acceptance_by_position": [
        {"start": 0, "end": 256, "rounds": 10, "acceptance_length": 2.0},
        {"start": 256, "end": 512, "rounds": 30, "acceptance_length": 1.0},
        {"start": 512, "end": 1024, "rounds": 0, "acceptance_length": None},
    ]}
    buckets = summary["acceptance_by_position"]
    assert study.bucket_acceptance(buckets, 0, 512) == pytest.approx((20 + 30) / 40)
    assert study.bucket_acceptance(buckets, 512, 1024) is None
    # a --session table buckets by context position, from the sessions' own buckets
    context = [{"start": 0, "end": 512, "rounds": 4, "acceptance_length": 3.0}]
    report = {"config": {"draft": "eagle"}, "summary": dict(summary, acceptance_length=1.5, tokens_per_s=10.0,
                                                              ngram_repeat_rate=0.1),
              "sessions": {"acceptance_by_context_position": context}}
    assert acceptance_buckets(report, context=True) == context
    by_context = study.table([report], 20.0, [(0, 512)], context=True)
    assert "| context [0, 512) |" in by_context and "| eagle | 1.50 | 3.00 | 10.0 | 0.50 |" in by_context
    by_output = study.table([report], 20.0, [(0, 512)])
    assert "| output [0, 512) |" in by_output and "| eagle | 1.50 | 1.25 | 10.0 | 0.50 |" in by_output
    with pytest.raises(ValueError, match="session"):
        acceptance_buckets({"summary": summary}, context=True)
    assert setting_label({"config": {"draft": "eagle", "tts": True, "tts_stride": 2, "tts_params": "lora"}}) == "eagle + TTS S=2 (LoRA)"
    assert setting_label({"config": {"draft": "eagle:runs/old_head.safetensors"}}) == "eagle (old_head)"
    assert setting_label({}, "fallback") == "fallback"


class _FakeEngine:
    """Each step emits 2 tokens per running row (its seed and the step); a row finishes after 3 steps, or, for a
    forced request, when its forced tokens are used up."""

    def __init__(self):
        self.rows, self.joined, self.opened = [], [], 0

    def open_batch(self):
        self.opened += 1

    def join(self, requests):
        self.joined.extend(requests)
        for r in requests:
            r.result = SimpleNamespace(output_ids=[])
        self.rows.extend([r, 0] for r in requests)

    def step(self):
        events = []
        for row in self.rows:
            req = row[0]
            row[1] += 1
            if req.forced is not None:
                done_so_far = len(req.result.output_ids)
                tokens = req.forced[done_so_far : done_so_far + 2]
                finished = done_so_far + len(tokens) >= len(req.forced)
            else:
                tokens, finished = [req.seed, row[1]], row[1] == 3
            req.result.output_ids.extend(tokens)
            events.append((req, tokens, finished))
            row.append(finished)
        self.rows = [row[:2] for row in self.rows if not row[2]]
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


def test_av_sweep_replays_a_cells_text_and_joins_nothing_after_its_last_round():
    sweep = _load("av_sweep")
    engine = _FakeEngine()
    # 12 tokens: both rows finish in the round that reaches the budget, and nobody joins after it
    cell = sweep.run_cell(engine, [[5], [6, 7]], batch=2, budget_tokens=12, max_new=9, seed=100)
    assert cell["rounds"] == 3 and [r.seed for r in engine.joined] == [100, 101]
    assert cell["texts"] == [[100, 1, 100, 2, 100, 3], [101, 1, 101, 2, 101, 3]]
    cell = sweep.run_cell(_FakeEngine(), [[5], [6, 7]], batch=2, budget_tokens=20, max_new=9, seed=100)
    replayer = _FakeEngine()
    replay = sweep.run_cell(replayer, [[5], [6, 7]], batch=2, budget_tokens=0, max_new=9, seed=100,
                            forced=cell["texts"])
    # the same requests, in the same order, with the same text (the unfinished ones cut where the cell stopped)
    assert [r.seed for r in replayer.joined] == [100, 101, 102, 103]
    assert [list(r.prompt) for r in replayer.joined] == [[5], [6, 7], [5], [6, 7]]
    assert [r.max_new_tokens for r in replayer.joined] == [6, 6, 4, 4]
    assert replay["texts"] == cell["texts"] and replay["tokens"] == cell["tokens"] == 20
    cells = [{"setting": "target-only", "speedup_same_text": 1.0}, {"setting": "L=1", "speedup_same_text": 0.8},
             {"setting": "AV", "speedup_same_text": 0.97}]
    reference, ratio = sweep.av_over_reference_same_text(cells)
    assert reference["setting"] == "target-only" and ratio == pytest.approx(0.97)


class _LiveFakeEngine(_FakeEngine):
    """A sampling row emits ``[seed, step]`` per step and ``[seed, -1]`` (-1: EOS) at its third; a forced row
    (a replay) emits one token per step, its next forced one, and ends at EOS or ``max_new_tokens``; a forced
    token that was not written yet raises (a replay must never run ahead of its source)."""

    def __init__(self):
        super().__init__()
        self.cancelled = []

    def cancel(self, requests):
        self.cancelled.extend(requests)
        self.rows = [row for row in self.rows if all(row[0] is not r for r in requests)]

    def step(self):
        events, keep = [], []
        for row in self.rows:
            req = row[0]
            row[1] += 1
            out = req.result.output_ids
            if req.forced is not None:
                if len(req.forced) <= len(out):
                    raise AssertionError("the replay ran ahead of its source")
                tokens = [req.forced[len(out)]]
                finished = tokens[0] == -1 or len(out) + 1 >= req.max_new_tokens
            else:
                finished = row[1] == 3
                tokens = [req.seed, -1 if finished else row[1]]
            out.extend(tokens)
            events.append((req, tokens, finished))
            if not finished:
                keep.append(row)
        self.rows = keep
        return events


def test_av_sweep_lockstep_replay_follows_its_source_live():
    """--lockstep: a replay steps just behind the run it replays, reading that run's text as it is written (one
    token a round against the source's two), joins the source's requests in order, and drops the rows the
    source left unfinished once it has replayed their tokens: the same text, token for token."""
    sweep = _load("av_sweep")
    engine, replayer, other = _LiveFakeEngine(), _LiveFakeEngine(), _LiveFakeEngine()
    source = sweep.CellRun(engine, [[5], [6, 7]], 2, 20, 9, 100)
    replay = sweep.CellRun(replayer, [[5], [6, 7]], 2, 0, 9, 100, source=source)
    plain = sweep.CellRun(other, [[5], [6, 7]], 2, 20, 9, 100)
    cells = sweep.run_lockstep([plain, source, replay])
    assert [c["tokens"] for c in cells] == [20, 20, 20]
    assert cells[2]["texts"] == cells[1]["texts"]
    # 6 tokens a request, 2 rows: the 20-token budget is reached inside the 4th pair of requests
    assert [r.seed for r in replayer.joined] == [r.seed for r in engine.joined] == [100, 101, 102, 103]
    assert [r.prompt for r in replayer.joined] == [[5], [6, 7], [5], [6, 7]]
    assert len(replayer.cancelled) == 2 and cells[2]["requests_finished"] == 2
    assert cells[1]["rounds"] == 5 and cells[2]["rounds"] == 10 and cells[2]["acceptance_length"] == 1.0
    assert engine.opened == replayer.opened == other.opened == 0


def test_av_sweep_splits_av_time_over_its_replay_by_round_kind():
    """An AV cell's time over target-only on its own text, by round kind: each kind's ms minus the replay's ms
    per token (its rounds only, joins apart) times the kind's tokens; joins against the replay's joins."""
    sweep = _load("av_sweep")
    cell = {"seconds": 1.0, "time_by_kind": {"off": {"ms": 600.0, "rounds": 100, "tokens": 100},
                                             "probe": {"ms": 100.0, "rounds": 2, "tokens": 3},
                                             "on": {"ms": 0.0, "rounds": 0, "tokens": 0},
                                             "join": {"ms": 300.0, "rounds": 3, "tokens": 0}}}
    replay = {"seconds": 0.85, "tokens": 103, "join_ms": 335.0}  # 515 ms of rounds: 5 ms a token
    extra = sweep.extra_over_same_text(cell, replay)
    assert extra["replay_ms_per_token"] == pytest.approx(5.0)
    assert extra["off"]["extra_ms"] == pytest.approx(100.0) and extra["off"]["share"] == pytest.approx(0.1)
    assert extra["probe"]["extra_ms"] == pytest.approx(85.0) and extra["probe"]["ms_each"] == pytest.approx(50.0)
    assert extra["join"]["extra_ms"] == pytest.approx(-35.0)
    assert extra["on"]["extra_ms"] == 0.0
