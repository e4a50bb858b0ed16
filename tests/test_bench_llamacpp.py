"""scripts/bench_llamacpp.py without llama.cpp: the parsers of llama.cpp's outputs (lines as the vendored build
prints them, captured from real runs on 2026-12-07), the forward-cost ratios, the rows and ratios of the table,
and the command lines."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_llamacpp.py"
_spec = importlib.util.spec_from_file_location("bench_llamacpp", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_llamacpp"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

COMPLETION = """\
0.06.177.714 I common_perf_print: prompt eval time =    3445.62 ms /   350 tokens (    9.84 ms per token,   101.58 tokens per second)
0.06.177.751 I common_perf_print:        eval time =    1625.25 ms /    51 runs   (   31.87 ms per token,    31.38 tokens per second)
"""

SPECULATIVE = """\
0.09.484.544 I encoded  350 tokens in    4.644 seconds, speed:   75.369 t/s
0.09.484.624 I decoded   52 tokens in    3.115 seconds, speed:   16.691 t/s
0.09.484.690 I n_draft   = 4
0.09.484.752 I n_drafted = 48
0.09.484.778 I n_accept  = 40
0.09.484.816 I accept    = 83.333%
"""

NGRAM_NOTHING_ACCEPTED = """\
0.06.843.080 I decoded   66 tokens in    2.153 seconds, speed:   30.656 t/s
0.06.843.261 I n_accept  = 0
0.06.843.296 I accept    = -nan%
"""

BENCH = """[
  {"n_prompt": 512, "n_gen": 0, "n_threads": 2, "avg_ts": 103.531865, "stddev_ts": 1.2, "samples_ts": [1, 2, 3]},
  {"n_prompt": 4, "n_gen": 0, "n_threads": 2, "avg_ts": 52.3115, "stddev_ts": 0.5, "samples_ts": [1, 2, 3]},
  {"n_prompt": 0, "n_gen": 64, "n_threads": 2, "avg_ts": 34.936478, "stddev_ts": 0.145462, "samples_ts": [1, 2, 3]}
]"""


def test_completion_perf_lines_parse():
    out = bench.parse_completion(COMPLETION)
    assert out["prompt_tokens"] == 350 and out["prompt_tokens_per_s"] == pytest.approx(101.58)
    assert out["eval_runs"] == 51 and out["eval_ms"] == pytest.approx(1625.25)
    assert out["decode_tokens_per_s"] == pytest.approx(31.38)
    with pytest.raises(ValueError, match="eval time"):
        bench.parse_completion("no perf lines here")


def test_speculative_summary_parses_with_acceptance_length():
    out = bench.parse_speculative(SPECULATIVE)
    assert out["decoded_tokens"] == 52 and out["decode_tokens_per_s"] == pytest.approx(16.691)
    assert out["prompt_tokens"] == 350 and out["prompt_tokens_per_s"] == pytest.approx(75.369)
    assert (out["n_draft"], out["n_predict"], out["n_drafted"], out["n_accept"]) == (4, 52, 48, 40)
    assert out["accept_rate"] == pytest.approx(0.83333)
    assert out["rounds"] == 12 and out["acceptance_length"] == pytest.approx(52 / 12)
    none = bench.parse_speculative(NGRAM_NOTHING_ACCEPTED)
    assert none["accept_rate"] is None and none["acceptance_length"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="decoded"):
        bench.parse_speculative(COMPLETION)


def test_bench_json_and_forward_cost():
    tests = bench.parse_bench("log line before\n" + BENCH + "\ntrailing")
    assert [t["test"] for t in tests] == ["pp512", "pp4", "tg64"]
    cost = bench.forward_cost(tests)
    assert cost == {"4": pytest.approx(4 * 34.936478 / 52.3115)}  # pp512 is past the < 64 cut
    with pytest.raises(ValueError, match="JSON"):
        bench.parse_bench("nothing")


def test_rows_take_ratios_against_llamacpp_target_only():
    rows = [bench.completion_row("llama.cpp target-only", [bench.parse_completion(COMPLETION)]),
            bench.speculative_row("llama.cpp + 0.5B draft", "speculative", [bench.parse_speculative(SPECULATIVE)])]
    summary = {"decode_tokens_per_s": 40.0, "baseline_decode_tokens_per_s": 30.0, "prefill_tokens_per_s": 180.0,
               "acceptance_length": 2.5}
    extra, keys = bench.specadapt_rows("specadapt ngram", summary)
    rows, ref, setting = bench.with_ratios(rows + extra)
    assert setting == "llama.cpp target-only" and ref == pytest.approx(51 / 1.62525)
    by = {r.setting: r for r in rows}
    assert by["specadapt ngram"].ratio == pytest.approx(40.0 / ref)
    assert by["specadapt ngram: target-only (paired)"].decode_tokens_per_s == 30.0
    assert by["llama.cpp + 0.5B draft"].acceptance_length == pytest.approx(52 / 12)
    assert keys["decode"] == "decode_tokens_per_s"
    assert "llama.cpp target-only" in bench.format_table(rows, setting, {})


def test_a_draft_model_run_names_the_draft_type():
    binaries = {"llama-speculative-simple": "/bin/spec"}
    cmd = bench.speculative_command(binaries, "t.gguf", "p.txt", 64, 2, 1024, draft="d.gguf")
    assert cmd[0] == "/bin/spec" and cmd[cmd.index("-md") + 1] == "d.gguf"
    assert cmd[cmd.index("--spec-type") + 1] == "draft-simple"
    ngram = bench.speculative_command(binaries, "t.gguf", "p.txt", 64, 2, 1024, spec_type="ngram-simple")
    assert "-md" not in ngram and ngram[ngram.index("--spec-type") + 1] == "ngram-simple"
