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


# llama-speculative-simple's tail as the vendored build prints it (0.5B draft, 32 new tokens, 2026-12-07): the
# target's own perf lines follow and must not be taken for the speculative figures
SPECULATIVE_FULL = """\
0.09.825.440 I encoded  350 tokens in    4.940 seconds, speed:   70.857 t/s
0.09.825.460 I decoded   37 tokens in    2.121 seconds, speed:   17.441 t/s
0.09.825.472 I 
0.09.825.499 I n_draft   = 4
0.09.825.527 I n_predict = 37
0.09.825.548 I n_drafted = 30
0.09.825.575 I n_accept  = 29
0.09.825.599 I accept    = 96.667%
0.09.825.623 I 
0.09.825.650 I draft:

0.09.825.738 I target:

0.09.825.775 I common_perf_print:    sampling time =       9.55 ms
0.09.825.856 I common_perf_print: prompt eval time =    6333.49 ms /   389 tokens (   16.28 ms per token,    61.42 tokens per second)
0.09.825.878 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""


def test_full_speculative_tail_takes_the_speculative_lines():
    out = bench.parse_speculative(SPECULATIVE_FULL)
    assert (out["prompt_tokens"], out["decoded_tokens"], out["n_predict"], out["n_accept"]) == (350, 37, 37, 29)
    assert out["decode_tokens_per_s"] == pytest.approx(17.441) and out["prompt_tokens_per_s"] == pytest.approx(70.857)
    assert out["rounds"] == 8 and out["acceptance_length"] == pytest.approx(37 / 8)
    # the target's "inf tokens per second" of a 1-run eval is no number
    assert bench.parse_completion(SPECULATIVE_FULL)["decode_tokens_per_s"] is None


def test_prompt_file_survives_llamacpp_dropping_one_trailing_newline():
    templated = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    written = bench.prompt_file_text(templated)
    read_back = written[:-1] if written.endswith("\n") else written  # what llama.cpp's -f keeps
    assert read_back == templated


def test_prompt_token_mismatch_is_reported():
    info = [{"id": "p0", "tokens": 351}]
    job = bench.Job("completion", "llama.cpp target-only", [], prompt_id="p0")
    assert bench.prompt_token_mismatch(job, {"prompt_tokens": 351}, info) is None
    assert "350" in bench.prompt_token_mismatch(job, {"prompt_tokens": 350}, info)
    assert bench.prompt_token_mismatch(bench.Job("bench", "llama-bench", []), [], info) is None


def test_completion_and_bench_commands():
    binaries = {"llama-completion": "/b/llama-completion", "llama-bench": "/b/llama-bench"}
    cmd = bench.completion_command(binaries, "t.gguf", "p.txt", 32, 2, 512, extra=["--mlock"])
    assert cmd[0] == "/b/llama-completion" and "-no-cnv" in cmd and cmd[-1] == "--mlock"
    for flag, value in (("-m", "t.gguf"), ("-f", "p.txt"), ("-n", "32"), ("-t", "2"), ("-c", "512"), ("--temp", "0")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--ignore-eos" not in cmd
    assert "--ignore-eos" in bench.completion_command(binaries, "t.gguf", "p.txt", 32, 2, 512, ignore_eos=True)
    b = bench.bench_command(binaries, "t.gguf", 2, 3)
    assert b[b.index("-p") + 1] == "2,4,8,512" and b[b.index("-n") + 1] == "64" and b[b.index("-o") + 1] == "json"


def test_specadapt_command_is_greedy_batch_one_with_baseline_and_extras_last():
    cmd = bench.specadapt_command("t.gguf", "d.gguf", "/data/lcb.jsonl", "prompt", 2, 64, "/tmp/o.json",
                                  num_draft=4, extra=["--draft", "ngram"])
    assert cmd[cmd.index("generate") + 1:cmd.index("generate") + 5] == ["--model", "t.gguf", "--draft", "d.gguf"]
    for flag, value in (("--temperature", "0"), ("--batch-size", "1"), ("--json", "/tmp/o.json"),
                        ("--num-draft-tokens", "4"), ("--prompt-field", "prompt"), ("--limit", "2"),
                        ("--max-new-tokens", "64"), ("--dataset", "/data/lcb.jsonl")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--baseline" in cmd and cmd[-2:] == ["--draft", "ngram"]
    assert "--num-draft-tokens" not in bench.specadapt_command("t", "ngram", "x", None, 1, 8, "o")


def _args(**kw):
    defaults = dict(skip=[], llama_args="", max_new_tokens=32, threads=2, ignore_eos=False, target="t.gguf",
                    repetitions=2, draft_model="d.gguf", num_draft=4, specadapt_args="--seed 1",
                    specadapt_drafts=["ngram", "model"], limit=1, temperature=0.0)
    defaults.update(kw)
    import argparse

    return argparse.Namespace(**defaults)


BINARIES = {n: f"/b/{n}" for n in ("llama-bench", "llama-completion", "llama-speculative-simple")}


def test_plan_runs_every_part_per_prompt_and_skips_by_name(tmp_path):
    files = [("p0", "a.txt"), ("p1", "b.txt")]
    jobs = bench.plan_jobs(_args(), BINARIES, files, ["ngram-simple", "ngram-mod"], 512, "lcb", None, str(tmp_path))
    parts = [j.part for j in jobs]
    assert parts == ["bench"] + ["completion"] * 2 + ["speculative"] * 2 + ["ngram"] * 4 + ["specadapt"] * 2
    sa = [j for j in jobs if j.part == "specadapt"]
    assert sa[0].argv[sa[0].argv.index("--draft") + 1] == "ngram" and "--num-draft-tokens" not in sa[0].argv
    assert sa[1].argv[sa[1].argv.index("--draft") + 1] == "d.gguf" and sa[1].setting == "specadapt d.gguf n=4"
    assert all(j.env["OMP_NUM_THREADS"] == "2" and j.argv[-2:] == ["--seed", "1"] for j in sa)
    assert sa[0].json_out != sa[1].json_out
    kept = bench.plan_jobs(_args(skip=["bench", "ngram", "specadapt"], draft_model=None, specadapt_drafts=[]),
                           BINARIES, files, ["ngram-simple"], 512, "lcb", None, str(tmp_path))
    assert [j.part for j in kept] == ["completion", "completion"]  # no draft model: no speculative job
    with pytest.raises(bench.UsageError, match="--draft-model"):
        bench.plan_jobs(_args(draft_model=None), BINARIES, files, [], 512, "lcb", None, str(tmp_path))


def test_context_size_and_ngram_types_from_source(tmp_path):
    assert bench.context_size([351, 200], 32) == 512
    assert bench.context_size([351], 256) == 768 and bench.context_size([351], 32, requested=4096) == 4096
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "speculative.cpp").write_text(
        '{"none", COMMON_SPECULATIVE_TYPE_NONE},\n{"ngram-simple",  COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE},\n'
        '{"ngram-cache", COMMON_SPECULATIVE_TYPE_NGRAM_CACHE}\n')
    assert bench.ngram_types_in(tmp_path) == ["ngram-simple", "ngram-cache"]
    assert bench.ngram_types_in(tmp_path / "missing") == []


def test_specadapt_rows_fall_back_to_end_to_end_keys():
    rows, keys = bench.specadapt_rows("specadapt ngram", {"tokens_per_s": 10.0, "baseline_tokens_per_s": 9.0,
                                                           "acceptance_length": 1.2})
    assert [r.decode_tokens_per_s for r in rows] == [10.0, 9.0]
    assert keys["decode"] == "tokens_per_s" and keys["prefill"] is None
    assert all("incl. prefill" in r.note for r in rows)
    rows, _ = bench.specadapt_rows("specadapt ngram", {"tokens_per_s": 10.0, "acceptance_length": 1.2})
    assert len(rows) == 1  # no baseline ran


def test_collect_rows_marks_failed_settings_and_document_is_json(tmp_path):
    import json

    jobs = [bench.Job("completion", "llama.cpp target-only", ["x"], prompt_id="p0"),
            bench.Job("completion", "llama.cpp target-only", ["x"], prompt_id="p1"),
            bench.Job("ngram", "llama.cpp ngram-mod", ["x"], prompt_id="p0")]
    parsed = [bench.parse_completion(COMPLETION), bench.parse_completion(COMPLETION), None]
    rows, _ = bench.collect_rows(jobs, parsed)
    assert [r.setting for r in rows] == ["llama.cpp target-only", "llama.cpp ngram-mod"]
    assert rows[0].decode_tokens_per_s == pytest.approx(102 / 3.2505)  # token-weighted over both prompts
    assert rows[1].note == "failed" and rows[1].decode_tokens_per_s is None
    rows, ref, setting = bench.with_ratios(rows)
    table = bench.format_table(rows, setting, {"2": 1.5})
    assert "q=2 1.50x" in table and "failed" in table
    doc = bench.build_document({"threads": 2}, {"cpu_model": "x"}, {"commit": "abc"}, [], [], {}, rows, ref,
                               setting, {"2": 1.5}, [], [{"warning": "w"}])
    assert json.loads(json.dumps(doc))["rows"][0]["ratio"] == pytest.approx(1.0)


def test_weight_floor_line_sets_target_only_rows_against_the_runs_read_rate():
    rows = [bench.Row("llama.cpp target-only", "completion", decode_tokens_per_s=25.0, acceptance_length=1.0),
            bench.Row("specadapt ngram", "specadapt", decode_tokens_per_s=40.0, acceptance_length=1.2),
            bench.Row("specadapt ngram: target-only (paired)", "specadapt", decode_tokens_per_s=30.0,
                      acceptance_length=1.0)]
    limits = {"start": {"read_gbps": 30.0, "copy_gbps": 25.0}, "end": {"read_gbps": 20.0, "copy_gbps": 24.0},
              "target_bytes": 1_000_000_000}
    line = bench.weight_floor_line(rows, limits)
    assert "at 20.0 GB/s = 50.0 ms a token" in line  # the lower of the two read rates
    assert "llama.cpp target-only 40.0 ms (0.80x)" in line
    assert "specadapt ngram: target-only (paired) 33.3 ms (0.67x)" in line
    assert "specadapt ngram 25.0" not in line  # speculative rows are not set against the floor


def test_lockstep_order_pairs_each_prompt_and_flips_the_first_engine():
    order = bench.lockstep_order(2, 3)
    assert len(order) == 12
    pairs = [order[k:k + 2] for k in range(0, 12, 2)]
    for k, pair in enumerate(pairs):
        (r0, i0, e0), (r1, i1, e1) = pair
        assert (r0, i0) == (r1, i1) == (k // 3, k % 3)  # both engines on one prompt back to back
        assert {e0, e1} == {"llama.cpp", "specadapt"}
        assert e0 == ("llama.cpp" if k % 2 == 0 else "specadapt")  # ABBA


def test_lockstep_pairs_and_summary():
    results = [(0, 0, "llama.cpp", 30.0), (0, 0, "specadapt", 33.0), (0, 1, "specadapt", 20.0),
               (0, 1, "llama.cpp", 25.0), (1, 0, "llama.cpp", None), (1, 0, "specadapt", 31.0)]
    pairs = bench.lockstep_pairs(results)
    assert [p["ratio"] for p in pairs] == [pytest.approx(1.1), pytest.approx(0.8), None]
    s = bench.lockstep_summary(pairs)
    assert s["pairs"] == 2 and s["median"] == pytest.approx(0.95)
    assert s["geomean"] == pytest.approx((1.1 * 0.8) ** 0.5) and (s["min"], s["max"]) == (pytest.approx(0.8),
                                                                                        pytest.approx(1.1))
    assert bench.lockstep_summary([])["median"] is None


def test_one_prompt_dataset_is_loadable(tmp_path):
    from specadapt.datasets import load_prompts

    path = bench.one_prompt_dataset(tmp_path / "p.jsonl", "lcb-7", 'def f(x):\n    return "x"')
    (prompt,) = load_prompts(path, "prompt", 1)
    assert prompt.text == 'def f(x):\n    return "x"'


def test_lockstep_flag_is_checked():
    with pytest.raises(SystemExit):
        bench.parse_args(["--lockstep", "-1"])
    assert bench.parse_args(["--lockstep", "2"]).lockstep == 2


def test_temperature_reaches_both_engines_as_a_plain_softmax():
    binaries = {"llama-completion": "lc", "llama-speculative-simple": "ls"}
    greedy = bench.completion_command(binaries, "t.gguf", "p.txt", 32, 2, 512)
    assert greedy[greedy.index("--temp") + 1] == "0" and "--top-k" not in greedy
    hot = bench.speculative_command(binaries, "t.gguf", "p.txt", 32, 2, 512, draft="d.gguf", temperature=1.0)
    for flag, value in (("--temp", "1"), ("--top-k", "0"), ("--top-p", "1"), ("--min-p", "0"), ("--seed", "0")):
        assert hot[hot.index(flag) + 1] == value
    sa = bench.specadapt_command("t", "ngram", "x", None, 1, 8, "o", temperature=0.7)
    assert sa[sa.index("--temperature") + 1] == "0.7" and sa[sa.index("--top-p") + 1] == "1"
    assert bench.parse_args(["--temperature", "1.0"]).temperature == 1.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--temperature", "-1"])
