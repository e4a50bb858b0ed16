"""Prefill and decode timed apart: the engine's PhaseTimes and ``specadapt generate``'s summary keys (issue 45)."""

import json
import time

import pytest

from tests.helpers.cli import run_generate
from tests.helpers.models import WORDS, loaded, tiny_llama

PHASE_KEYS = ("prefill_tokens", "prefill_seconds", "prefill_tokens_per_s", "decode_seconds", "decode_tokens_per_s")


def _check_phases(s, prefix, prompt_tokens, output_tokens, seconds):
    for key in PHASE_KEYS:
        assert s[prefix + key] is not None and s[prefix + key] > 0, (prefix + key, s[prefix + key])
    assert s[prefix + "prefill_tokens"] == prompt_tokens
    assert s[prefix + "prefill_seconds"] + s[prefix + "decode_seconds"] <= seconds
    assert s[prefix + "prefill_tokens_per_s"] == pytest.approx(prompt_tokens / s[prefix + "prefill_seconds"])
    assert s[prefix + "decode_tokens_per_s"] == pytest.approx(output_tokens / s[prefix + "decode_seconds"])


@pytest.mark.parametrize("batch_size", [1, 2])
def test_generate_reports_prefill_and_decode_apart(capsys, tiny_model_dir, tmp_path, batch_size):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"q": f"what is the sum of two and {w}"}) + "\n" for w in WORDS[:3]))
    out = tmp_path / "run.json"
    code, stdout, err = run_generate(
        capsys, "--model", str(tiny_model_dir), "--draft", "ngram", "--dataset", str(data), "--prompt-field", "q",
        "--max-new-tokens", "16", "--batch-size", str(batch_size), "--baseline", "--json", str(out),
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    s = report["summary"]
    prompt_tokens = sum(r["prompt_tokens"] for r in report["requests"])
    _check_phases(s, "", prompt_tokens, s["output_tokens"], s["seconds"])
    # the paired baseline prefills the same prompts and decodes the same text
    _check_phases(s, "baseline_", prompt_tokens, s["baseline_output_tokens"], s["baseline_seconds"])
    assert s["speedup"] == pytest.approx(s["decode_tokens_per_s"] / s["baseline_decode_tokens_per_s"])
    assert s["end_to_end_speedup"] == pytest.approx(s["tokens_per_s"] / s["baseline_tokens_per_s"])
    # end to end counts the prefill too: slower than decoding alone
    assert s["tokens_per_s"] < s["decode_tokens_per_s"]
    assert s["baseline_tokens_per_s"] < s["baseline_decode_tokens_per_s"]
    assert "decode speedup" in stdout and "end to end" in stdout
    phases = [line for line in stdout.splitlines() if line.startswith("speculative: prefill")]
    assert len(phases) == 1 and "target-only: prefill" in phases[0] and f"({prompt_tokens} tokens" in phases[0]


def test_generate_without_baseline_has_null_baseline_phases(capsys, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"q": "what is the sum of two and three"}) + "\n")
    out = tmp_path / "run.json"
    code, stdout, err = run_generate(capsys, "--model", str(tiny_model_dir), "--dataset", str(data),
                                     "--prompt-field", "q", "--max-new-tokens", "8", "--json", str(out))
    assert code == 0, err
    s = json.loads(out.read_text())["summary"]
    assert s["prefill_tokens"] == json.loads(out.read_text())["requests"][0]["prompt_tokens"]
    assert s["decode_tokens_per_s"] > 0
    for key in PHASE_KEYS:
        assert s["baseline_" + key] is None
    assert s["speedup"] is None and s["end_to_end_speedup"] is None
    assert "speculative: prefill" in stdout and "target-only: prefill" not in stdout


def test_generate_sessions_report_prefill_and_decode(capsys, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is the sum of two and {w}"}) + "\n" for w in WORDS[:2]))
    out = tmp_path / "sessions.json"
    code, _, err = run_generate(capsys, "--model", str(tiny_model_dir), "--dataset", str(data), "--draft", "ngram",
                                "--session", "1", "--session-reserve", "300", "--max-new-tokens", "8",
                                "--batch-size", "1", "--baseline", "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    s = report["summary"]
    # every turn is a request of its own whose prompt is the whole conversation so far
    prompt_tokens = sum(r["prompt_tokens"] for r in report["requests"])
    assert len(report["requests"]) >= 2
    _check_phases(s, "", prompt_tokens, s["output_tokens"], s["seconds"])
    _check_phases(s, "baseline_", prompt_tokens, s["baseline_output_tokens"], s["baseline_seconds"])
    assert s["speedup"] == pytest.approx(s["decode_tokens_per_s"] / s["baseline_decode_tokens_per_s"])


def _engine(target, draft=None):
    from specadapt.engine import NgramDraft, SpeculativeEngine
    from specadapt.sampling import SamplingParams

    return SpeculativeEngine(target, draft or NgramDraft(), SamplingParams(temperature=1.0), 2, seed=0)


def test_phase_times_count_prompts_rounds_and_tokens():
    target = loaded(tiny_llama(seed=0))
    engine = _engine(target)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5]]
    results = engine.generate(prompts, [6, 0, 4], batch_size=2)
    times = engine.phase_times
    # the request of 0 new tokens finishes without a prefill; a one-token prompt still counts its token
    assert times.prefill_tokens == 5 + 1 and times.prefills == 2  # batches [0, 1] and [2]
    assert times.decode_tokens == sum(len(r.output_ids) for r in results) == 10
    assert times.decode_rounds == max(len(results[0].rounds), len(results[1].rounds)) + len(results[2].rounds)
    assert times.prefill_seconds > 0 and times.decode_seconds > 0
    assert times.decode_tokens_per_s == pytest.approx(10 / times.decode_seconds)
    engine.generate([[7, 7, 7]], 3)  # accumulates over runs
    assert engine.phase_times.prefill_tokens == 9 and engine.phase_times.decode_tokens == 13
    previous = engine.reset_phase_times()
    assert previous.prefill_tokens == 9
    fresh = engine.phase_times
    assert (fresh.prefill_tokens, fresh.prefill_seconds, fresh.decode_tokens, fresh.decode_seconds) == (0, 0.0, 0, 0.0)
    assert fresh.prefill_tokens_per_s is None and fresh.decode_tokens_per_s is None


def test_a_slow_draft_prefill_counts_as_prefill_and_a_slow_round_as_decode():
    """The draft's own prefill (``start`` / ``join``) is part of the join's time; its proposals are decoding."""
    from specadapt.engine import NgramDraft

    class SlowStart(NgramDraft):
        def start(self, histories):
            time.sleep(0.2)
            return super().start(histories)

        def join(self, histories, features=None):
            time.sleep(0.2)
            return super().join(histories, features)

    engine = _engine(loaded(tiny_llama(seed=0)), SlowStart())
    engine.generate([[3, 1, 4, 1, 5], [2, 7]], 4, batch_size=2)
    times = engine.phase_times
    assert times.prefill_seconds >= 0.2 and times.decode_seconds < 0.2

    # continuous batching: a request joining a running batch goes through the draft's join
    from specadapt.engine.loop import Request

    engine.reset_phase_times()
    engine.open_batch()
    engine.join([Request([3, 1, 4], 3)])
    engine.step()
    engine.join([Request([2, 7, 1, 8], 3)])
    while engine.num_active:
        engine.step()
    times = engine.phase_times
    assert times.prefills == 2 and times.prefill_tokens == 7
    assert times.prefill_seconds >= 0.4 and times.decode_seconds < 0.2

    class SlowPropose(NgramDraft):
        def propose(self, *args, **kwargs):
            time.sleep(0.05)
            return super().propose(*args, **kwargs)

    draft = SlowPropose()
    calls = []
    draft.propose = lambda *a, _p=draft.propose, **k: calls.append(1) or _p(*a, **k)
    engine = _engine(loaded(tiny_llama(seed=0)), draft)
    engine.generate([[3, 1, 4, 1, 5]], 4)
    times = engine.phase_times
    assert calls and times.decode_seconds >= 0.05 * len(calls) and times.prefill_seconds < 0.05
