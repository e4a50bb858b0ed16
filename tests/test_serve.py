"""``specadapt serve`` against a real server on loopback (uvicorn in a thread, a tiny model directory with a
word-level tokenizer): greedy outputs equal target-only decoding with 1 and 8 concurrent requests that join and
leave mid-batch, streaming, disconnects, bad requests, a failing request, a bounded load test, stop strings,
speculation off per request, per-request seeds, the openai client, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.serving import RunningServer, free_port, target_only_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["what is the sum of two and three", "find the number", "it is the answer", "two three four five six",
           "the sum of a number", "what", "and the answer is in it", "on the number of five"]
LENGTHS = [40, 12, 25, 8, 30, 5, 18, 35]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = RunningServer(["--model", str(tiny_model_dir), "--draft", "self:1", "--verify", "block",
                         "--num-draft-tokens", "3", "--max-batch-size", "4", "--max-queue", "4",
                         "--temperature", "0"])
    yield srv
    srv.close()


def _ids(server, text: str) -> list[int]:
    return [int(i) for i in server.state.tokenizer(text)["input_ids"]]


def _complete(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def test_greedy_output_equals_target_only_decoding_alone_and_with_8_concurrent_requests(server):
    target = server.built.target
    prompts = [_ids(server, p) for p in PROMPTS]
    expected = [target_only_greedy(target, p, n) for p, n in zip(prompts, LENGTHS)]  # before serving: idle engine
    assert len({tuple(e) for e in expected}) > 1
    one = _complete(server.url, {"prompt": prompts[0], "max_tokens": LENGTHS[0], "return_token_ids": True,
                                 "return_meta_info": True}).json()
    assert one["choices"][0]["token_ids"] == expected[0]
    assert one["usage"]["completion_tokens"] == len(expected[0])
    meta = one["choices"][0]["meta_info"]
    assert meta["spec_draft_tokens"] > 0 and sum(meta["spec_round_emitted"]) == len(expected[0])
    # 8 requests of different lengths, at most 4 decode together: requests join and leave mid-batch
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _complete(server.url, {"prompt": prompts[i], "max_tokens": LENGTHS[i],
                                                                 "return_token_ids": True}).json(), range(8)))
    assert [r["choices"][0]["token_ids"] for r in replies] == expected
    for reply, ids in zip(replies, expected):
        choice = reply["choices"][0]
        assert choice["text"] == server.state.tokenizer.decode(ids, skip_special_tokens=True)
        assert choice["finish_reason"] == ("stop" if ids[-1] == 2 else "length")
    m = server.wait_idle()
    assert m["specadapt_kv_cache_rows"] == 0 and m["specadapt_kv_cache_free_slots"] == m["specadapt_kv_cache_slots"]


def test_chat_completion_streams_the_same_text_as_without_streaming(server):
    body = {"messages": [{"role": "user", "content": "what is the sum of two and three"}], "max_tokens": 30,
            "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    text = plain["choices"][0]["message"]["content"]
    assert plain["object"] == "chat.completion" and plain["usage"]["completion_tokens"] == 30
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json=dict(body, stream=True, stream_options={"include_usage": True}), timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == text
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 30 and events[-1]["choices"] == []


def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_the_others_go_on(server):
    target = server.built.target
    other = _ids(server, PROMPTS[4])
    expected = target_only_greedy(target, other, LENGTHS[4])
    before = server.wait_idle()
    cancelled_before = before.get('specadapt_requests_total{finish_reason="cancelled"}', 0.0)
    result = {}

    def run_other():
        time.sleep(0.2)
        result["ids"] = _complete(server.url, {"prompt": other, "max_tokens": LENGTHS[4],
                                               "return_token_ids": True}).json()["choices"][0]["token_ids"]

    worker = threading.Thread(target=run_other)
    worker.start()
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True},
                      timeout=60) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # leave mid-stream: closing the response closes the connection
    worker.join(60)
    assert result["ids"] == expected
    m = server.wait_idle()
    assert m['specadapt_requests_total{finish_reason="cancelled"}'] == cancelled_before + 1
    assert m["specadapt_kv_cache_rows"] == 0 and m["specadapt_kv_cache_free_slots"] == m["specadapt_kv_cache_slots"]


BAD = [
    ("not json", None, 400, None),
    ("[1, 2]", None, 400, None),
    (None, {"prompt": "the a", "max_tokens": -3}, 400, "max_tokens"),
    (None, {"prompt": "the a", "max_tokens": 10**9}, 400, "max_tokens"),
    (None, {"prompt": " ".join(["the"] * 600), "max_tokens": 4}, 400, "prompt"),
    (None, {"prompt": "the a", "temperature": "hot"}, 400, "temperature"),
    (None, {"prompt": "the a", "max_tokens": "5"}, 400, "max_tokens"),
    (None, {"prompt": "the a", "temperature": -0.5}, 400, "temperature"),
    (None, {"prompt": "the a", "top_p": 0.0}, 400, "top_p"),
    (None, {"prompt": "the a", "top_p": 1.5}, 400, "top_p"),
    (None, {"prompt": "the a", "frobnicate": True}, 400, "frobnicate"),
    (None, {"prompt": "the a", "n": 2}, 400, "n"),
    (None, {"prompt": "the a", "logprobs": 3}, 400, "logprobs"),
    (None, {"prompt": "the a", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    (None, {"prompt": [1, 2, 999]}, 400, "prompt"),
    (None, {"prompt": "the a", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (None, {"prompt": "the a", "model": "gpt-17"}, 404, "model"),
    (None, {"max_tokens": 4}, 400, "prompt"),
]


@pytest.mark.parametrize("raw,body,status,param", BAD)
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_goes_on(server, raw, body, status, param):
    if raw is not None:
        resp = httpx.post(server.url + "/v1/completions", content=raw, timeout=30,
                          headers={"content-type": "application/json"})
    else:
        resp = _complete(server.url, body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param and param in error["message"] or error["param"] == param
    ok = _complete(server.url, {"prompt": "the a", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_request_that_makes_the_engine_raise_fails_alone(server):
    """The draft raises whenever a request's history holds the poison token: that request gets a 500 with the
    message; the others, decoding in the same batch, end with their target-only output."""
    target = server.built.target
    prompts = [_ids(server, p) for p in PROMPTS[:3]]
    expected = [target_only_greedy(target, p, n) for p, n in zip(prompts, LENGTHS[:3])]
    seen = {t for seq in prompts + expected for t in seq}
    poison = min(set(range(target.vocab_size)) - seen)  # in no other request's history
    draft = server.built.draft
    original = draft.propose

    def propose(histories, *args, **kwargs):
        if any(poison in h for h in histories):
            raise RuntimeError("injected draft failure")
        return original(histories, *args, **kwargs)

    draft.propose = propose
    try:
        with ThreadPoolExecutor(4) as pool:
            bad = pool.submit(_complete, server.url, {"prompt": [3, poison, 4], "max_tokens": 20})
            good = list(pool.map(lambda i: _complete(server.url, {"prompt": prompts[i], "max_tokens": LENGTHS[i],
                                                                  "return_token_ids": True}), range(3)))
            bad = bad.result()
    finally:
        draft.propose = original
    assert bad.status_code == 500 and "injected draft failure" in bad.json()["error"]["message"]
    assert [g.json()["choices"][0]["token_ids"] for g in good] == expected
    server.wait_idle()


def test_bounded_load_every_request_completes_or_gets_a_clear_503_and_no_slot_leaks(server):
    def one(i):
        return _complete(server.url, {"prompt": PROMPTS[i % 8], "max_tokens": 6, "ignore_eos": True}, timeout=120)

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(one, range(64)))
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 8
    for r in replies:
        if r.status_code == 503:
            assert "queue is full" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 6
    m = server.wait_idle()
    assert m["specadapt_kv_cache_rows"] == 0 and m["specadapt_kv_cache_free_slots"] == m["specadapt_kv_cache_slots"]
    assert m['specadapt_requests_rejected_total{reason="queue_full"}'] == codes.count(503)


def test_stop_strings_and_stop_token_ids_end_the_output(server):
    full = _complete(server.url, {"prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True,
                                  "return_token_ids": True}).json()["choices"][0]
    words = full["text"].split()
    stop = " " + words[4]
    cut = full["text"][: full["text"].index(stop)]  # the text before the first occurrence, the stop left out
    got = _complete(server.url, {"prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True,
                                 "stop": ["never there", stop]}).json()["choices"][0]
    assert got["text"] == cut and got["finish_reason"] == "stop"
    stop_id = full["token_ids"][6]
    ids = _complete(server.url, {"prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True, "stop_token_ids": [stop_id],
                                 "return_token_ids": True}).json()["choices"][0]
    assert ids["token_ids"] == full["token_ids"][: full["token_ids"].index(stop_id) + 1]
    assert ids["finish_reason"] == "stop"


def test_speculation_off_per_request_decodes_by_target_steps(server):
    prompt = _ids(server, PROMPTS[1])
    reply = _complete(server.url, {"prompt": prompt, "max_tokens": 20, "speculate": False, "return_meta_info": True,
                                   "return_token_ids": True}).json()["choices"][0]
    assert reply["meta_info"]["spec_draft_tokens"] == 0
    assert reply["meta_info"]["spec_verify_ct"] == len(reply["token_ids"])
    assert reply["token_ids"] == target_only_greedy(server.built.target, prompt, 20)


def test_a_seeded_sampled_request_gives_the_same_output_alone_and_among_others(server):
    body = {"prompt": PROMPTS[2], "max_tokens": 25, "temperature": 1.0, "top_p": 0.9, "seed": 1234,
            "ignore_eos": True, "return_token_ids": True}
    alone = _complete(server.url, body).json()["choices"][0]["token_ids"]
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(_complete, server.url, {"prompt": p, "max_tokens": 15, "temperature": 1.0, "seed": i})
                  for i, p in enumerate(PROMPTS[3:6])]
        mixed = pool.submit(_complete, server.url, body).result().json()["choices"][0]["token_ids"]
        assert all(o.result().status_code == 200 for o in others)
    assert mixed == alone
    reseeded = _complete(server.url, dict(body, seed=99)).json()["choices"][0]["token_ids"]
    assert reseeded != alone


def test_the_openai_client_talks_to_the_server(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [server.state.model_name]
    reply = client.chat.completions.create(model=server.state.model_name, max_tokens=12,
                                           messages=[{"role": "user", "content": "find the number"}])
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    stream = client.completions.create(model=server.state.model_name, prompt="the sum of", max_tokens=10,
                                       stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    plain = client.completions.create(model=server.state.model_name, prompt="the sum of", max_tokens=10,
                                      extra_body={"ignore_eos": True})
    assert text == plain.choices[0].text
    with pytest.raises(Exception) as info:
        client.chat.completions.create(model=server.state.model_name, max_tokens=4, temperature=-1,
                                       messages=[{"role": "user", "content": "a"}])
    assert getattr(info.value, "status_code", None) == 400


def test_sigterm_drains_in_flight_requests_and_exits(tiny_model_dir, tmp_path):
    """A server process that gets SIGTERM mid-request finishes it (or ends it with a clear error past
    --shutdown-timeout), then exits with code 0 after the HTTP server's shutdown (uvicorn's log line)."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "specadapt", "serve", "--model", str(tiny_model_dir),
                             "--draft", "ngram", "--port", str(port), "--no-progress", "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "the a of", "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length" or "error" in last
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read()
    assert "draining" in output and "Finished server process" in output


@pytest.mark.real_model
def test_the_embedded_default_with_the_eagle_head_serves_target_only_greedy_output():
    """SmolLM2-135M (int4, native forward) with the EAGLE head, block verification: 8 concurrent chat requests of
    different lengths (at most 4 decode together) give target-only greedy decoding's tokens."""
    from specadapt.cli.engine_args import _tokenize
    from specadapt.datasets import load_prompts

    srv = RunningServer(["--draft", "eagle", "--verify", "block", "--num-draft-tokens", "2", "--max-batch-size", "4",
                         "--temperature", "0"])
    try:
        target = srv.built.target
        texts = [p.text for p in load_prompts("math500", None, 8)]
        prompts = [_tokenize(target.tokenizer, t) for t in texts]
        lengths = [8, 40, 16, 24, 12, 32, 20, 28]
        expected = [target_only_greedy(target, p, n) for p, n in zip(prompts, lengths)]

        def one(i):
            body = {"messages": [{"role": "user", "content": texts[i]}], "max_tokens": lengths[i],
                    "return_token_ids": True, "return_meta_info": True}
            return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(one, range(8)))
        assert [r["token_ids"] for r in replies] == expected
        assert sum(r["meta_info"]["spec_accepted_tokens"] for r in replies) > 0
        m = srv.wait_idle()
        assert m["specadapt_kv_cache_rows"] == 0 and m["specadapt_kv_cache_free_slots"] == m["specadapt_kv_cache_slots"]
    finally:
        srv.close()


@pytest.mark.parametrize("extra,counter", [
    (["--tts", "--tts-stride", "1", "--tts-sync", "--tts-lr", "1e-3"], "specadapt_tts_updates_total"),
    (["--tts", "--tts-stride", "1", "--tts-sync", "--tts-params", "lora", "--tts-scope", "request"],
     "specadapt_tts_updates_total"),
    (["--adaptive-verification", "--num-draft-tokens", "4"], "specadapt_draft_tokens_pruned_total"),
])
def test_tts_and_adaptive_verification_through_the_server_keep_greedy_output(tiny_model_dir, extra, counter):
    """Test-Time Speculation (shared draft, or per-request LoRA adapter slots that requests take as they join) and
    adaptive verification under continuous batching: 6 concurrent greedy requests, at most 3 together, give
    target-only greedy decoding's tokens; the technique's counter is exported."""
    srv = RunningServer(["--model", str(tiny_model_dir), "--draft", "self:1", "--verify", "block",
                         "--max-batch-size", "3", "--temperature", "0"] + extra)
    try:
        target = srv.built.target
        prompts = [_ids(srv, p) for p in PROMPTS[:6]]
        expected = [target_only_greedy(target, p, n) for p, n in zip(prompts, LENGTHS[:6])]
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda i: _complete(srv.url, {"prompt": prompts[i], "max_tokens": LENGTHS[i],
                                                                  "return_token_ids": True}).json(), range(6)))
        assert [r["choices"][0]["token_ids"] for r in replies] == expected
        m = srv.wait_idle()
        assert counter in m
        if "--tts" in extra:
            assert m[counter] > 0
    finally:
        srv.close()


MORE_BAD = [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages.0.content",
     "text only"),
    ({"messages": [{"role": "user", "content": "a", "name": "bob"}]}, "messages.name", "names"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "max_completion_tokens": 8},
     "max_completion_tokens", "differ"),
    ({"messages": [{"role": "user", "content": "a"}], "stream_options": {"include_usage": True}}, "stream_options",
     "stream: true"),
]


@pytest.mark.parametrize("body,param,words", MORE_BAD)
def test_chat_fields_that_would_change_the_output_unseen_are_refused(server, body, param, words):
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_nested_prompt_list_is_refused_with_a_readable_message(server):
    resp = _complete(server.url, {"prompt": [[1, 2], [3]]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert "one prompt per request" in resp.json()["error"]["message"]
