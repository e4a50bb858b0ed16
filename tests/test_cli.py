"""`specadapt generate`: bad input gives one line naming the flag and exit code 2; a full run writes the JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_generate
from tests.helpers.models import WORDS, save_tiny_model_dir


_run = run_generate


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--num-draft-tokens", "0"], "--num-draft-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--batch-size", "0"], "--batch-size"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--top-k", "-2"], "--top-k"),
        (["--bucket-edges", "0,10,5"], "--bucket-edges"),
        (["--dataset", "aime1999"], "--dataset"),
        (["--dataset", "/nonexistent/prompts.jsonl"], "--dataset"),
        (["--model", "gpt-17"], "--model"),
        (["--model", "/nonexistent/model/dir"], "--model"),
        (["--verify", "magic"], "--verify"),
        (["--num-draft-tokens", "five"], "--num-draft-tokens"),
        (["--verify", "gbv"], "--verify gbv"),
        (["--draft", "self:0"], "--draft"),
        (["--num-paths", "2"], "--num-paths"),
        (["--tts"], "--tts"),  # the default draft (ngram) has no weights
        (["--tts", "--draft", "self:2", "--tts-stride", "0"], "--tts-stride"),
        (["--tts", "--draft", "self:2", "--tts-lr", "0"], "--tts-lr"),
        (["--tts", "--draft", "self:2", "--tts-lambda", "-1"], "--tts-lambda"),
        (["--tts", "--draft", "self:2", "--tts-position-decay", "2"], "--tts-position-decay"),
        (["--tts", "--draft", "self:2", "--tts-lora-rank", "0"], "--tts-lora-rank"),
        (["--tts", "--draft", "self:2", "--tts-params", "most"], "--tts-params"),
        (["--tts", "--draft", "self:2", "--tts-rollback-margin", "0"], "--tts-rollback-margin"),
        (["--draft", "eagle:"], "--draft"),
        (["--tts", "--draft", "self:2", "--tts-topk", "-1"], "--tts-topk"),
        (["--verify-impl", "cupy"], "--verify-impl cupy"),
        (["--min-p", "1.5"], "--min-p"),
        (["--min-p", "-0.1"], "--min-p"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--repetition-penalty", "inf"], "--repetition-penalty"),
        (["--frequency-penalty", "3"], "--frequency-penalty"),
        (["--presence-penalty", "nan"], "--presence-penalty"),
        (["--logit-bias", "a:b"], "--logit-bias"),
        (["--logit-bias", "5"], "--logit-bias"),
        (["--logit-bias", "1:inf"], "--logit-bias"),
        (["--logit-bias", "-1:2"], "--logit-bias"),
        (["--logit-bias", "1:1,1:2"], "--logit-bias"),
        (["--draft", "none", "--tts"], "--tts"),
        (["--draft", "none", "--num-draft-tokens", "3"], "--num-draft-tokens"),
        (["--draft", "none", "--verify", "gbv"], "--verify gbv"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, flag):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert flag in lines[0]
    assert "Traceback" not in err


def test_bad_draft_specs(capsys, tiny_model_dir, tmp_path):
    code, _, err = _run(capsys, "--model", str(tiny_model_dir), "--draft", "self:0", "--limit", "1")
    assert code == 2 and "--draft" in err and "self:N" in err
    code, _, err = _run(capsys, "--model", str(tiny_model_dir), "--draft", "self:9", "--limit", "1")
    assert code == 2 and "--draft" in err
    other = save_tiny_model_dir(tmp_path / "other", WORDS + ["extra", "words"], layers=1)
    code, _, err = _run(capsys, "--model", str(tiny_model_dir), "--draft", str(other), "--limit", "1")
    assert code == 2 and "--draft" in err and "vocabulary" in err


def test_prompt_longer_than_context(capsys, tmp_path):
    short = save_tiny_model_dir(tmp_path / "short_ctx", WORDS, max_positions=16)
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": " ".join(["the"] * 40)}) + "\n")
    code, _, err = _run(capsys, "--model", str(short), "--dataset", str(data))
    assert code == 2 and "--dataset" in err and "context" in err


@pytest.mark.parametrize("draft,verify", [("ngram", "chain"), ("self:1", "block")])
def test_generate_end_to_end_writes_json(capsys, tiny_model_dir, tmp_path, draft, verify):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"q": f"what is the sum of two and {w}"}) + "\n" for w in WORDS[:3]))
    out = tmp_path / "run.json"
    code, stdout, _ = _run(
        capsys, "--model", str(tiny_model_dir), "--draft", draft, "--verify", verify, "--dataset", str(data),
        "--prompt-field", "q", "--max-new-tokens", "40", "--batch-size", "2", "--baseline", "--json", str(out),
        "--bucket-edges", "0,16,32",
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report) == {"config", "requests", "summary"}
    assert len(report["requests"]) == 3
    req = report["requests"][0]
    for key in ("id", "prompt_tokens", "output_tokens", "rounds", "acceptance_length", "tokens_per_s",
                "acceptance_by_position", "accept_rate_by_draft_position", "text", "ngram_repeat_rate"):
        assert key in req
    assert [b["start"] for b in req["acceptance_by_position"]] == [0, 16, 32]
    # L by measurement: 1 for ngram, 5 for the unmeasured self:N
    assert len(req["accept_rate_by_draft_position"]) == (1 if draft == "ngram" else 5)
    assert report["config"]["num_draft_tokens"] == (1 if draft == "ngram" else 5)
    s = report["summary"]
    for key in ("acceptance_length", "tokens_per_s", "baseline_tokens_per_s", "speedup", "end_to_end_speedup",
                "decode_tokens_per_s", "baseline_decode_tokens_per_s", "ngram_repeat_rate"):
        assert s[key] is not None
    # speedup on decode tokens/s (tests/test_prefill_decode.py), the end-to-end ratio beside it
    assert s["speedup"] == pytest.approx(s["decode_tokens_per_s"] / s["baseline_decode_tokens_per_s"])
    assert s["end_to_end_speedup"] == pytest.approx(s["tokens_per_s"] / s["baseline_tokens_per_s"])
    assert s["acceptance_length"] >= 1.0
    assert report["config"]["draft"] == draft
    # the default paired baseline decodes exactly the speculative run's text, token for token
    assert report["config"]["baseline_mode"] == "paired"
    assert s["baseline_output_tokens"] == sum(r["output_tokens"] for r in report["requests"])
    assert "acceptance length" in stdout


def test_draft_none_decodes_target_only(capsys, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"q": "what is the sum of two and three"}) + "\n")
    out = tmp_path / "none.json"
    code, _, _ = _run(capsys, "--model", str(tiny_model_dir), "--draft", "none", "--dataset", str(data),
                      "--prompt-field", "q", "--max-new-tokens", "12", "--json", str(out))
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["num_draft_tokens"] == 0 and report["summary"]["acceptance_length"] == 1.0


def test_default_num_draft_tokens_by_draft():
    from specadapt.cli.engine_args import default_num_draft_tokens

    assert default_num_draft_tokens("ngram", "chain", False) == 1
    assert default_num_draft_tokens("eagle", "block", False) == 1
    assert default_num_draft_tokens("eagle:/tmp/head.safetensors", "gbv", False) == 2
    assert default_num_draft_tokens("self:2", "chain", False) == 5
    assert default_num_draft_tokens("eagle", "chain", True) == 5  # adaptive verification prunes from 5


def test_free_baseline_samples_its_own_text(capsys, tiny_model_dir, tmp_path):
    """--baseline-mode free: target-only decoding samples its own text (a different length at temperature 1)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"q": f"what is the sum of two and {w}"}) + "\n" for w in WORDS[:2]))
    out = tmp_path / "run.json"
    code, _, _ = _run(capsys, "--model", str(tiny_model_dir), "--dataset", str(data), "--prompt-field", "q",
                      "--max-new-tokens", "30", "--baseline", "--baseline-mode", "free", "--json", str(out))
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["baseline_mode"] == "free" and report["summary"]["baseline_tokens_per_s"] > 0


def test_python_dash_m_and_help():
    proc = subprocess.run([sys.executable, "-m", "specadapt", "generate", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("--model", "--draft", "--dataset", "--prompt-field", "--limit", "--max-new-tokens",
                 "--temperature", "--top-p", "--top-k", "--num-draft-tokens", "--verify", "--batch-size",
                 "--seed", "--baseline", "--json", "--bucket-edges", "--dtype", "--min-p", "--repetition-penalty",
                 "--frequency-penalty", "--presence-penalty", "--logit-bias"):
        assert flag in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "specadapt", "generate", "--top-p", "2"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--top-p" in proc.stderr


def test_generate_with_adaptive_verification(capsys, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "what is the sum of two and three"}) + "\n")
    out, costs = tmp_path / "av.json", tmp_path / "costs.json"
    args = ("--model", str(tiny_model_dir), "--draft", "self:1", "--dataset", str(data), "--max-new-tokens", "30",
            "--adaptive-verification", "--av-refit-interval", "5", "--av-cost-table", str(costs), "--json", str(out))
    code, _, _ = _run(capsys, *args)
    assert code == 0 and costs.exists()
    cfg = json.loads(out.read_text())["config"]
    assert cfg["av_verified_drafts"] + cfg["av_pruned_drafts"] > 0
    code, _, _ = _run(capsys, *args)  # second run loads the saved table
    assert code == 0
    code, _, _ = _run(capsys, *args, "--verify", "gbv", "--num-paths", "2")  # adaptive verification with GBV
    assert code == 0
    code, _, err = _run(capsys, "--av-probe-interval", "0")
    assert code == 2 and "--av-probe-interval" in err
    code, _, err = _run(capsys, "--av-probe-interval", "8", "--av-probe-interval-max", "4")
    assert code == 2 and "--av-probe-interval-max" in err
    code, _, _ = _run(capsys, *args, "--speculation", "off")
    assert code == 0
    assert json.loads(out.read_text())["config"]["av_verified_drafts"] == 0
    code, _, err = _run(capsys, "--av-refit-interval", "0")
    assert code == 2 and "--av-refit-interval" in err
    costs.write_text("not json")
    code, _, err = _run(capsys, *args)
    assert code == 2 and "--av-cost-table" in err


@pytest.mark.parametrize("params", ["full", "lora"])
def test_generate_with_tts(capsys, tiny_model_dir, tmp_path, params):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "what is the sum of two and three"}) + "\n")
    out = tmp_path / "tts.json"
    code, _, _ = _run(capsys, "--model", str(tiny_model_dir), "--draft", "self:1", "--dataset", str(data),
                      "--max-new-tokens", "40", "--tts", "--tts-stride", "2", "--tts-params", params, "--json", str(out))
    assert code == 0
    stats = json.loads(out.read_text())["config"]["tts_stats"]
    assert stats["updates"] + stats["skipped"] > 0
    assert stats["memory_bytes"]["total"] > 0


def test_eagle_needs_a_head_for_other_targets(capsys, tiny_model_dir):
    code, _, err = _run(capsys, "--model", str(tiny_model_dir), "--draft", "eagle", "--limit", "1")
    assert code == 2 and "--draft eagle" in err and "eagle:PATH" in err
    assert "shipped heads: qwen2.5-coder-1.5b, smollm2-135m" in err  # the targets that have a shipped head


def test_threads_flag_sets_torch_and_is_recorded(capsys, tiny_model_dir, tmp_path):
    import torch

    before = torch.get_num_threads()
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"q": "what is the sum of two and three"}) + "\n")
    out = tmp_path / "run.json"
    try:
        code, _, _ = _run(capsys, "--model", str(tiny_model_dir), "--dataset", str(data), "--prompt-field", "q",
                          "--max-new-tokens", "4", "--threads", "1", "--json", str(out))
        assert code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    config = json.loads(out.read_text())["config"]
    assert config["threads"] == 1 and config["torch_threads"] == 1


def test_tiny_temperature_is_greedy_and_bad_ones_are_one_line(capsys, tiny_model_dir, tmp_path):
    """Issue 19.6: --temperature 1e-39 overflowed logits / T (NaN, a traceback in torch.multinomial)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"q": "what is the sum of two and three"}) + "\n")
    outputs = {}
    for temperature in ("0", "1e-39", "1e-45"):
        out = tmp_path / f"t{temperature}.json"
        code, _, err = _run(capsys, "--model", str(tiny_model_dir), "--draft", "self:1", "--dataset", str(data),
                            "--prompt-field", "q", "--max-new-tokens", "12", "--temperature", temperature,
                            "--json", str(out))
        assert code == 0, err
        outputs[temperature] = json.loads(out.read_text())["requests"][0]["text"]
    assert outputs["1e-39"] == outputs["0"] == outputs["1e-45"]
    for bad in ("inf", "nan", "-1e-39"):
        code, _, err = _run(capsys, "--model", str(tiny_model_dir), "--temperature", bad, "--limit", "1")
        assert code == 2 and "--temperature" in err and len(err.strip().splitlines()) == 1, err


def test_logit_processor_flags_reach_the_engine(capsys, tiny_model_dir, tmp_path):
    """Issue 19.9: --logit-bias / penalties / --min-p run end to end; a greedy run with a +100 bias on one word
    writes only that word; a bias on an id outside the model's vocabulary is a one-line error."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"q": "what is the sum of two and three"}) + "\n")
    base = ("--model", str(tiny_model_dir), "--draft", "self:1", "--dataset", str(data), "--prompt-field", "q",
            "--max-new-tokens", "8")
    out = tmp_path / "biased.json"
    code, _, err = _run(capsys, *base, "--temperature", "0", "--logit-bias", "5:100", "--json", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["requests"][0]["text"].split() == ["of"] * 8  # id 5 = "of"
    out = tmp_path / "penalised.json"
    code, _, err = _run(capsys, *base, "--repetition-penalty", "1.3", "--frequency-penalty", "0.5",
                        "--presence-penalty", "0.2", "--min-p", "0.05", "--logit-bias", "3:1.5,7:-2",
                        "--verify", "block", "--json", str(out))
    assert code == 0, err
    config = json.loads(out.read_text())["config"]
    assert config["logit_bias"] == "3:1.5,7:-2" and config["repetition_penalty"] == 1.3
    code, _, err = _run(capsys, *base, "--logit-bias", "99999:1")
    assert code == 2 and "--logit-bias" in err and len(err.strip().splitlines()) == 1, err


def test_target_only_formats_script_names_a_bad_format_entry():
    script = Path(__file__).resolve().parents[1] / "scripts" / "target_only_formats.py"
    proc = subprocess.run([sys.executable, str(script), "--formats", "native:int4", "tpu:int4"], capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "--formats" in proc.stderr and "tpu:int4" in proc.stderr


def test_cache_residency_bench_refuses_a_negative_gap_by_name():
    """scripts/bench_cache_residency.py checks its arguments before loading a model."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_cache_residency.py"
    proc = subprocess.run([sys.executable, str(script), "--gaps-ms", "-1"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--gaps-ms" in proc.stderr
