#!/usr/bin/env python
"""Long-generation benchmark client: AIME 2024 / MATH-500 / LiveCodeBench prompts against an OpenAI-compatible
server (SGLang's ``launch_server``) or the embedded engine; per-request lengths, latencies and acceptance lengths.

Examples (docs/bench_long_gen.md)::

    # an SGLang server started with speculative decoding, native /generate endpoint (carries spec_verify_ct)
    python scripts/bench_long_gen.py --backend openai --base-url http://127.0.0.1:30000 --api generate \\
        --tokenizer /models/Qwen3-8B --dataset aime24 --max-tokens 8192 --concurrency 16 --ignore-eos \\
        --scrape-metrics --json results/bench/sglang_aime.json --plot results/bench/sglang_aime.png

    # the embedded engine (SmolLM2-135M on CPU), EAGLE head with Test-Time Speculation
    python scripts/bench_long_gen.py --backend embedded --draft eagle --tts --dataset aime24 --limit 3 \\
        --max-tokens 1024 --ignore-eos --json results/bench/embedded.json --plot results/bench/embedded.png

HTTP backend (``--backend openai``), one request per prompt, ``--concurrency`` requests in flight (a thread pool):

- ``--api chat`` posts ``{"model", "messages", "max_tokens", "temperature", "top_p", "stream": false}`` (plus
  ``"ignore_eos": true`` with ``--ignore-eos``, ``"seed"`` with ``--seed`` and SGLang's ``"return_meta_info":
  true`` unless ``--no-meta-info``) to ``/v1/chat/completions`` and reads ``usage.completion_tokens``; speculative
  counters are read from ``choices[0].meta_info``, ``meta_info`` or ``usage`` when the server returns them;
- ``--api generate`` posts ``{"text", "sampling_params": {"max_new_tokens", "temperature", "top_p",
  "ignore_eos"}}`` to SGLang's native ``/generate`` and reads ``meta_info.completion_tokens``,
  ``meta_info.spec_verify_ct`` and (when present) ``meta_info.spec_accept_length`` / ``spec_accept_histogram``.
  The text is the prompt after the chat template of ``--tokenizer`` when given, else the raw prompt.

Acceptance length of a request = ``completion_tokens / spec_verify_ct`` (tokens per verification round, bonus
token included) when ``spec_verify_ct > 0``; else the server's ``spec_accept_length`` if it sent one; else null —
never guessed. Over the requests with a known acceptance length the summary gives ``acceptance_length`` = total
output tokens / total rounds and ``acceptance_length_token_weighted`` = the mean of the requests' acceptance
lengths weighted by their output tokens. ``--scrape-metrics`` reads the server's Prometheus
``/metrics`` before and after the run and keeps the ``sglang:spec_*`` samples (``sglang:spec_accept_length``
is the server's own recent-window gauge, not this run's exact figure).

Embedded backend (``--backend embedded``): the same building blocks as ``specadapt generate``
(``specadapt.cli.generate``: validation, model and draft loading, chat template, warm-up, TTS, the engine)
with ``--concurrency`` as the batch size; every round is recorded, so the summary also carries acceptance length
by output-position bucket (``--bucket-edges``) — the acceptance-vs-position curve of the TTS study.

JSON layout (``--json``)::

    {"config": {...},
     "requests": [{"id", "prompt_tokens", "output_tokens", "latency_s", "tokens_per_s", "acceptance_length",
                   "acceptance_source", "spec_verify_ct", "server_accept_length", "finish_reason", "text",
                   ... embedded only: "rounds", "acceptance_by_position"}],
     "summary": {"requests", "output_tokens", "wall_seconds", "throughput_tok_s", "latency_mean_s",
                 "latency_median_s", "latency_p90_s", "acceptance_length", "acceptance_length_token_weighted",
                 "requests_with_acceptance",
                 "acceptance_by_position" (embedded; null for HTTP), "max_in_flight"},
     "server_metrics": null | {"url", "before", "after", "error"}}

Bad arguments print one line naming the flag and exit with code 2; an unreachable server or an error response
prints one line with the URL (and the HTTP status and a body excerpt) and exits with code 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import queue
import shlex
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROG = "bench_long_gen"
DEFAULT_BUCKET_EDGES = "0,256,512,768,1024,1536,2048,3072,4096,6144,8192"
DEFAULT_CONCURRENCY = {"openai": 8, "embedded": 3}
BODY_EXCERPT = 300
# Where SGLang (and look-alikes) put per-request speculative counters in a response, searched in this order.
SPEC_KEYS = ("spec_verify_ct", "spec_accept_length", "spec_accept_histogram", "spec_accept_rate",
             "spec_accept_token_num", "spec_draft_token_num", "spec_round_emitted")


class BenchError(Exception):
    """A failure of the run that is not a bad argument (server unreachable, error response): exit code 1."""


class ArgumentError(Exception):
    """Bad user input; the message names the flag: exit code 2."""


# ---------------------------------------------------------------------------------------------------------------
# arguments


class _OneLineParser(argparse.ArgumentParser):
    """argparse errors as a single line ``bench_long_gen: error: ...`` and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=["openai", "embedded"], default="openai",
                   help="an OpenAI-compatible HTTP server (SGLang) or the embedded engine of this repository")
    p.add_argument("--dataset", default="aime24", help="aime24 | math500 | livecodebench | path to a .jsonl file")
    p.add_argument("--prompt-field", default=None, help="JSON field holding the prompt (None: the dataset's own)")
    p.add_argument("--limit", type=int, default=0, help="number of prompts (0 = all)")
    p.add_argument("--max-tokens", type=int, default=4096, help="new tokens per request (max_tokens)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--concurrency", "--batch-size", dest="concurrency", type=int, default=None,
                   help="requests in flight (HTTP thread pool; embedded: batch size). "
                        f"None: {DEFAULT_CONCURRENCY['openai']} for openai, {DEFAULT_CONCURRENCY['embedded']} embedded")
    p.add_argument("--ignore-eos", action="store_true", help="generate every request to --max-tokens")
    p.add_argument("--seed", type=int, default=None,
                   help="embedded: seeds the coins (None: 0); openai chat: sent as 'seed' when given")
    p.add_argument("--model", default=None,
                   help="openai: model name sent in the body (None: the first id of GET /v1/models for --api "
                        "chat); embedded: smollm2-135m (default), a HF model directory or a .gguf file")
    p.add_argument("--json", default=None, metavar="OUT", help="write config, per-request results and summary")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="acceptance length vs output position (embedded) or per request vs output length (HTTP)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p.add_argument("--bucket-edges", default=DEFAULT_BUCKET_EDGES,
                   help="output-position bucket edges of acceptance by position (embedded backend, and servers that "
                        "return per-round counts: spec_round_emitted, as specadapt serve does)")
    http = p.add_argument_group("HTTP backend (--backend openai)")
    http.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:30000 (a trailing /v1 "
                                                       "is dropped)")
    http.add_argument("--api", choices=["chat", "generate"], default="chat",
                      help="/v1/chat/completions or SGLang's native /generate")
    http.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for one response")
    http.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    http.add_argument("--tokenizer", default=None,
                      help="--api generate: apply this tokenizer's chat template to each prompt (a HF directory, "
                           "a .gguf file or smollm2-135m); None: send the raw prompt")
    http.add_argument("--no-meta-info", action="store_true",
                      help="--api chat: do not ask for SGLang's per-request meta_info (return_meta_info)")
    http.add_argument("--scrape-metrics", action="store_true",
                      help="read the server's Prometheus /metrics before and after the run (sglang:spec_* samples)")

    emb = p.add_argument_group("embedded backend (--backend embedded; the building blocks of specadapt generate)")
    emb.add_argument("--draft", default="ngram", help="ngram | eagle | eagle:PATH | self:N | a model path")
    emb.add_argument("--num-draft-tokens", type=int, default=5, help="L, drafts per round")
    emb.add_argument("--verify", default="chain", choices=["chain", "block", "gbv"], help="verification rule")
    emb.add_argument("--tts", action="store_true", help="Test-Time Speculation of the model draft")
    emb.add_argument("--device", default="cpu", help="cpu or cuda")
    emb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    emb.add_argument("--generate-args", default="", metavar="'FLAGS'",
                     help="more `specadapt generate` flags as one string, written with '=': "
                          "--generate-args='--tts-stride 1 --top-k 50'")
    return p


def validate(args) -> None:
    """Check the flags that do not need the backend; fills defaults that depend on ``--backend``.

    Raises:
        ArgumentError: the message names the offending flag.
    """
    if args.limit < 0:
        raise ArgumentError(f"--limit must be >= 0 (0 = all prompts), got {args.limit}")
    if args.max_tokens < 1:
        raise ArgumentError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise ArgumentError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ArgumentError(f"--top-p must lie in (0, 1], got {args.top_p}")
    try:
        edges = [int(x) for x in args.bucket_edges.split(",")]
    except ValueError:
        raise ArgumentError(f"--bucket-edges must be comma-separated integers, got {args.bucket_edges!r}") from None
    if edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ArgumentError(f"--bucket-edges must start at 0 and increase strictly, got {args.bucket_edges!r}")
    if args.concurrency is None:
        args.concurrency = DEFAULT_CONCURRENCY[args.backend]
    if args.concurrency < 1:
        raise ArgumentError(f"--concurrency must be >= 1, got {args.concurrency}")
    if not args.timeout > 0:
        raise ArgumentError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.backend == "openai":
        if not args.base_url:
            raise ArgumentError("--base-url is required with --backend openai (e.g. http://127.0.0.1:30000)")
        url = args.base_url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
            raise ArgumentError(f"--base-url must be an http:// or https:// URL, got {args.base_url!r}")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        args.base_url = url
        if args.tokenizer and args.api != "generate":
            raise ArgumentError("--tokenizer is for --api generate (the chat endpoint applies the server's template)")
    else:
        for flag, value in (("--base-url", args.base_url), ("--tokenizer", args.tokenizer),
                            ("--scrape-metrics", args.scrape_metrics), ("--api-key", args.api_key)):
            if value:
                raise ArgumentError(f"{flag} is for --backend openai, not embedded")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ArgumentError("--plot needs matplotlib (pip install 'specadapt[plot]')") from None


# ---------------------------------------------------------------------------------------------------------------
# HTTP backend


class HttpClient:
    """JSON over HTTP with the standard library; every failure becomes one :class:`BenchError` naming the URL.

    Args:
        base_url: server root without a trailing slash.
        timeout: seconds to wait for one response.
        api_key: sent as a bearer token when given.
    """

    def __init__(self, base_url: str, timeout: float, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self, method: str, path: str, body: dict | None) -> str:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(url, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            try:
                text = exc.read().decode("utf-8", errors="replace")
            except Exception:  # the body of an error response is best effort
                text = ""
            excerpt = " ".join(text.split())[:BODY_EXCERPT] or "(empty body)"
            raise BenchError(f"{method} {url} returned HTTP {exc.code} {exc.reason}: {excerpt}") from None
        except (TimeoutError, socket.timeout):
            raise BenchError(f"{method} {url}: no response within --timeout {self.timeout:g} s") from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise BenchError(f"{method} {url}: no response within --timeout {self.timeout:g} s") from None
            raise BenchError(f"cannot reach the server at {url} ({reason}); is it running? (--base-url)") from None
        except (ConnectionError, OSError) as exc:
            raise BenchError(f"cannot reach the server at {url} ({exc}); is it running? (--base-url)") from None

    def post(self, path: str, body: dict) -> dict:
        """POST ``body`` as JSON to ``path``; returns the decoded JSON object (a 1-element list is unwrapped)."""
        text = self._open("POST", path, body)
        return self._decode(text, "POST", path)

    def get_json(self, path: str):
        return self._decode(self._open("GET", path, None), "GET", path)

    def get_text(self, path: str) -> str:
        return self._open("GET", path, None)

    def _decode(self, text: str, method: str, path: str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            excerpt = " ".join(text.split())[:BODY_EXCERPT]
            raise BenchError(f"{method} {self.base_url + path} did not return JSON: {excerpt}") from None
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        return value


def spec_fields(*containers) -> dict:
    """The speculative counters found in the given dicts (first container holding a key wins)."""
    found = {}
    for box in containers:
        if not isinstance(box, dict):
            continue
        for key in SPEC_KEYS:
            if key not in found and box.get(key) is not None:
                found[key] = box[key]
    return found


def acceptance_from(completion_tokens: int | None, spec: dict) -> tuple[float | None, str | None]:
    """Acceptance length (tokens per round) and where it came from, or ``(None, None)`` without spec metrics.

    ``completion_tokens / spec_verify_ct`` when ``spec_verify_ct > 0``; else the server's
    ``spec_accept_length`` when it sent a positive one.
    """
    verify = spec.get("spec_verify_ct")
    try:
        verify = int(verify) if verify is not None else None
    except (TypeError, ValueError):
        verify = None
    if verify and verify > 0 and completion_tokens is not None:
        return completion_tokens / verify, "completion_tokens/spec_verify_ct"
    server = spec.get("spec_accept_length")
    try:
        server = float(server) if server is not None else None
    except (TypeError, ValueError):
        server = None
    if server is not None and server > 0:
        return server, "server spec_accept_length"
    return None, None


def _int_or_none(value):
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _finish_reason(value) -> str | None:
    if isinstance(value, dict):  # SGLang's meta_info: {"type": "length", "length": N} or {"type": "stop", ...}
        return str(value.get("type")) if value.get("type") is not None else None
    return None if value is None else str(value)


def chat_request(client: HttpClient, args, prompt) -> dict:
    """One ``/v1/chat/completions`` request; returns the per-request record (without latency)."""
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stream": False,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.seed is not None:
        body["seed"] = args.seed
    if not args.no_meta_info:
        body["return_meta_info"] = True
    resp = client.post("/v1/chat/completions", body)
    url = client.base_url + "/v1/chat/completions"
    if not isinstance(resp, dict) or not resp.get("choices"):
        raise BenchError(f"POST {url}: the response has no 'choices': {json.dumps(resp)[:BODY_EXCERPT]}")
    choice = resp["choices"][0] or {}
    usage = resp.get("usage") or {}
    completion = _int_or_none(usage.get("completion_tokens"))
    if completion is None:
        raise BenchError(f"POST {url}: the response has no usage.completion_tokens, so output lengths are unknown")
    spec = spec_fields(choice.get("meta_info"), resp.get("meta_info"), usage)
    message = choice.get("message") or {}
    return _record(usage.get("prompt_tokens"), completion, spec, choice.get("finish_reason"),
                   message.get("content") if isinstance(message, dict) else None)


def _record(prompt_tokens, completion: int, spec: dict, finish_reason, text) -> dict:
    """The per-request record shared by both APIs (latency is added by the caller)."""
    acceptance, source = acceptance_from(completion, spec)
    return {
        "prompt_tokens": _int_or_none(prompt_tokens),
        "output_tokens": completion,
        "acceptance_length": acceptance,
        "acceptance_source": source,
        "spec_verify_ct": _int_or_none(spec.get("spec_verify_ct")),
        "server_accept_length": spec.get("spec_accept_length"),
        "spec_accept_histogram": spec.get("spec_accept_histogram"),
        "round_emitted": spec.get("spec_round_emitted") if isinstance(spec.get("spec_round_emitted"), list) else None,
        "finish_reason": _finish_reason(finish_reason),
        "text": text,
    }


def generate_request(client: HttpClient, args, prompt, text: str) -> dict:
    """One SGLang native ``/generate`` request; returns the per-request record (without latency)."""
    body = {
        "text": text,
        "sampling_params": {
            "max_new_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "ignore_eos": bool(args.ignore_eos),
        },
    }
    resp = client.post("/generate", body)
    url = client.base_url + "/generate"
    meta = resp.get("meta_info") if isinstance(resp, dict) else None
    if not isinstance(meta, dict):
        raise BenchError(f"POST {url}: the response has no 'meta_info': {json.dumps(resp)[:BODY_EXCERPT]}")
    completion = _int_or_none(meta.get("completion_tokens"))
    if completion is None:
        raise BenchError(f"POST {url}: meta_info has no completion_tokens, so output lengths are unknown")
    return _record(meta.get("prompt_tokens"), completion, spec_fields(meta), meta.get("finish_reason"), resp.get("text"))


def parse_prometheus(text: str, prefix: str | tuple[str, ...] = ("sglang:spec_", "specadapt_")) -> dict:
    """Samples of the metrics whose name starts with ``prefix`` (one or a tuple) from Prometheus text exposition
    (SGLang's speculative metrics and ``specadapt serve``'s).

    Histogram buckets (``*_bucket``) are skipped. Returns ``{name: [{"labels": {...}, "value": float}]}``.
    """
    out: dict[str, list] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_text, _, tail = rest.rpartition("}")
        else:
            name, _, tail = line.partition(" ")
            labels_text = ""
        if name.endswith("_bucket"):
            continue
        fields = tail.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        labels = {}
        for part in _split_labels(labels_text):
            key, _, val = part.partition("=")
            labels[key.strip()] = val.strip().strip('"')
        out.setdefault(name.strip(), []).append({"labels": labels, "value": value})
    return out


def _split_labels(text: str) -> list[str]:
    parts, current, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return parts


def scrape_metrics(client: HttpClient) -> tuple[dict | None, str | None]:
    """Best effort ``GET /metrics``: ``(samples, None)`` or ``(None, reason)`` with a warning printed."""
    try:
        return parse_prometheus(client.get_text("/metrics")), None
    except BenchError as exc:
        print(f"{PROG}: warning: --scrape-metrics: {exc}; continuing without server metrics", file=sys.stderr)
        return None, str(exc)


def _chat_template_texts(args, prompts) -> list[str]:
    if not args.tokenizer:
        return [p.text for p in prompts]
    try:
        from specadapt.engine.models import ModelLoadError, resolve_model_spec
        from transformers import AutoTokenizer

        folder, gguf = resolve_model_spec(args.tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))
    except ImportError as exc:
        raise ArgumentError(f"--tokenizer needs transformers installed ({exc})") from None
    except ModelLoadError as exc:
        raise ArgumentError(f"--tokenizer: {exc}") from None
    except Exception as exc:  # transformers raises many types
        raise ArgumentError(f"--tokenizer: could not load {args.tokenizer!r}: {type(exc).__name__}: {exc}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ArgumentError(f"--tokenizer {args.tokenizer!r} has no chat template; omit it to send raw prompts")
    return [tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                          tokenize=False) for p in prompts]


def run_http(args, prompts) -> tuple[list[dict], float, dict, dict | None]:
    """Send every prompt to the server, ``--concurrency`` at a time.

    Returns:
        per-request records (in prompt order, with ``latency_s`` in seconds), the wall-clock seconds of the
        whole run, extra config entries, and the scraped server metrics (``None`` without ``--scrape-metrics``).

    Raises:
        BenchError: the first failed request (the requests not yet sent are cancelled).
    """
    from tqdm import tqdm

    client = HttpClient(args.base_url, args.timeout, args.api_key)
    extra = {"endpoint": client.base_url + ("/v1/chat/completions" if args.api == "chat" else "/generate")}
    if args.api == "chat":
        if args.model is None:
            models = client.get_json("/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            if not data or not isinstance(data[0], dict) or not data[0].get("id"):
                raise BenchError(f"GET {client.base_url}/v1/models lists no model; pass --model")
            args.model = str(data[0]["id"])
        texts = [p.text for p in prompts]
    else:
        texts = _chat_template_texts(args, prompts)
        extra["chat_template_applied"] = bool(args.tokenizer)

    metrics = None
    if args.scrape_metrics:
        before, error = scrape_metrics(client)
        metrics = {"url": client.base_url + "/metrics", "before": before, "after": None, "error": error}

    lock = threading.Lock()
    in_flight = [0, 0]  # current, maximum

    def one(i: int) -> dict:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
        start = time.perf_counter()
        try:
            if args.api == "chat":
                record = chat_request(client, args, prompts[i])
            else:
                record = generate_request(client, args, prompts[i], texts[i])
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise BenchError(f"unexpected response from {extra['endpoint']} ({type(exc).__name__}: {exc})") from None
        finally:
            with lock:
                in_flight[0] -= 1
        record["latency_s"] = time.perf_counter() - start
        return record

    # Daemon worker threads rather than a ThreadPoolExecutor: after a failure the run stops at once, without
    # waiting (at exit) for long generations still in flight.
    jobs: queue.Queue = queue.Queue()
    for i in range(len(prompts)):
        jobs.put(i)
    done: queue.Queue = queue.Queue()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((i, one(i), None))
            except BaseException as exc:  # handed to the main thread, which reports it
                done.put((i, None, exc))

    records: list[dict | None] = [None] * len(prompts)
    tokens = 0
    bar = tqdm(total=len(prompts), desc=f"{args.api} {args.base_url}", unit="req", disable=args.no_progress)
    start = time.perf_counter()
    try:
        for _ in range(min(args.concurrency, len(prompts))):
            threading.Thread(target=worker, name=f"{PROG}-worker", daemon=True).start()
        for _ in range(len(prompts)):
            i, record, error = done.get()
            if error is not None:
                raise error
            records[i] = record
            tokens += record["output_tokens"]
            bar.set_postfix_str(f"{tokens} tok", refresh=False)
            bar.update(1)
        wall = time.perf_counter() - start
    finally:
        stop.set()
        bar.close()
    extra["max_in_flight"] = in_flight[1]
    if metrics is not None:
        after, error = scrape_metrics(client)
        metrics["after"] = after
        metrics["error"] = metrics["error"] or error
    out = []
    for prompt, record in zip(prompts, records):
        out.append({"id": prompt.id, **record})
    return out, wall, extra, metrics


# ---------------------------------------------------------------------------------------------------------------
# embedded backend


def _generate_argv(args, edges: str) -> list[str]:
    argv = [
        "generate", "--model", args.model or "smollm2-135m", "--draft", args.draft, "--dataset", args.dataset,
        "--limit", str(args.limit), "--max-new-tokens", str(args.max_tokens), "--temperature", str(args.temperature),
        "--top-p", str(args.top_p), "--num-draft-tokens", str(args.num_draft_tokens), "--verify", args.verify,
        "--batch-size", str(args.concurrency), "--seed", str(0 if args.seed is None else args.seed),
        "--dtype", args.dtype, "--device", args.device, "--bucket-edges", edges,
    ]
    if args.prompt_field:
        argv += ["--prompt-field", args.prompt_field]
    if args.tts:
        argv.append("--tts")
    if args.ignore_eos:
        argv.append("--ignore-eos")
    if args.no_progress:
        argv.append("--no-progress")
    try:
        argv += shlex.split(args.generate_args)
    except ValueError as exc:
        raise ArgumentError(f"--generate-args: {exc}") from None
    return argv


def run_embedded(args, prompts) -> tuple[list[dict], float, dict, list[dict], float | None]:
    """Decode every prompt with the embedded engine, built exactly as ``specadapt generate`` builds it.

    Returns:
        per-request records (in prompt order; ``latency_s`` = seconds from the start of the request's batch to its
        last token), the wall-clock seconds of decoding, extra config entries, the summary acceptance length by
        output-position bucket (``[{"start", "end", "rounds", "acceptance_length"}]``) and the acceptance length
        over all rounds (mean tokens emitted per round: tau + 1 except where EOS or --max-tokens cut a round, as
        ``specadapt generate`` reports it).

    Raises:
        ArgumentError: any flag ``specadapt generate`` rejects (message names it).
    """
    import torch
    from tqdm import tqdm

    from specadapt.cli import build_parser as specadapt_parser
    from specadapt.cli import engine_args as eng
    from specadapt.cli import generate as gen
    from specadapt.cli.common import UsageError
    from specadapt.engine import NoDraft, SpeculativeEngine
    from specadapt.engine.metrics import acceptance_by_position, acceptance_length
    from specadapt.sampling import SamplingParams

    parser = specadapt_parser()
    parser.prog = f"{PROG} (--generate-args)"
    g = parser.parse_args(_generate_argv(args, args.bucket_edges))
    try:
        edges = gen._validate(g)
    except UsageError as exc:
        raise ArgumentError(str(exc)) from None
    if g.log_drafts or g.baseline:
        raise ArgumentError("--generate-args: --log-drafts and --baseline are for `specadapt generate`, not here")
    if g.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        eng._silence_gguf_progress()
    if g.device.startswith("cuda") and not torch.cuda.is_available():
        raise ArgumentError(f"--device {g.device}: CUDA is not available on this machine")
    sampling = SamplingParams(g.temperature, g.top_p, g.top_k)
    target, draft = eng.load_target_and_draft(g.model, g.draft, sampling, g.seed, g.dtype, g.device, error=ArgumentError)

    token_ids = [eng._tokenize(target.tokenizer, p.text) for p in prompts]
    context = target.context_length or 10**9
    limits = []
    for prompt, ids in zip(prompts, token_ids):
        if len(ids) >= context:
            raise ArgumentError(f"--dataset: prompt {prompt.id!r} has {len(ids)} tokens, longer than the model's "
                                f"context ({context})")
        if g.max_new_tokens > context - len(ids):
            print(f"{PROG}: warning: prompt {prompt.id}: --max-tokens cut to {context - len(ids)} to fit the context",
                  file=sys.stderr)
        limits.append(min(g.max_new_tokens, context - len(ids)))

    torch.manual_seed(g.seed)
    eng._warm_up(target, draft)
    adaptive = eng._adaptive(g, target, draft, g.batch_size) if g.adaptive_verification else None
    tts = None
    if g.tts:
        from specadapt.engine.tts_bridge import EngineTTS

        tts = EngineTTS(draft, eng.tts_config(g), sampling, asynchronous=not g.tts_sync, max_requests=g.batch_size)
    try:
        engine = SpeculativeEngine(
            target, draft, sampling, g.num_draft_tokens, g.verify, seed=g.seed, verify_impl=g.verify_impl,
            num_paths=eng.num_paths_of(g), adaptive=adaptive, tts=tts, ignore_eos=g.ignore_eos,
        )
    except ValueError as exc:
        raise ArgumentError(f"--verify: {exc}") from None

    results = []
    tokens = [0]
    bar = tqdm(total=len(prompts), desc=f"embedded {g.draft}{' + TTS' if tts else ''}", unit="req",
               disable=args.no_progress)

    def on_tokens(n: int) -> None:
        tokens[0] += n
        bar.set_postfix_str(f"{tokens[0]} tok", refresh=False)
        bar.update(0)

    start = time.perf_counter()
    try:
        # The engine decodes batch_size requests at a time; handing it one batch per call is the same schedule
        # and lets the bar count finished requests.
        for lo in range(0, len(prompts), g.batch_size):
            hi = min(lo + g.batch_size, len(prompts))
            results += engine.generate(token_ids[lo:hi], limits[lo:hi], batch_size=g.batch_size, on_tokens=on_tokens)
            bar.update(hi - lo)
        wall = time.perf_counter() - start
    finally:
        bar.close()
        if tts is not None:
            tts.close()

    records = []
    for prompt, res in zip(prompts, results):
        n = len(res.output_ids)
        records.append({
            "id": prompt.id,
            "prompt_tokens": res.prompt_tokens,
            "output_tokens": n,
            "latency_s": res.seconds,
            "acceptance_length": acceptance_length(res.rounds),
            "acceptance_source": "engine rounds" if res.rounds else None,
            "spec_verify_ct": len(res.rounds),
            "server_accept_length": None,
            "finish_reason": "stop" if res.finished_by_eos else "length",
            "rounds": len(res.rounds),
            "acceptance_by_position": acceptance_by_position(res.rounds, edges),
            "text": target.tokenizer.decode(res.output_ids, skip_special_tokens=True),
        })
    all_rounds = [r for res in results for r in res.rounds]
    extra = {"model": g.model, "seed": g.seed, "num_paths": g.num_paths, "verify_impl": g.verify_impl,
             "torch_version": torch.__version__, "torch_threads": torch.get_num_threads()}
    if tts is not None:
        extra["tts_stats"] = tts.summary()
        extra["tts_stride"] = g.tts_stride
    if adaptive is not None:
        extra.update(av_pruned_drafts=adaptive.pruned, av_verified_drafts=adaptive.verified)
    return records, wall, extra, acceptance_by_position(all_rounds, edges), acceptance_length(all_rounds)


# ---------------------------------------------------------------------------------------------------------------
# report


def http_acceptance_by_position(records: list[dict], bucket_edges: str) -> list[dict] | None:
    """Acceptance length by output-position bucket from servers that return the tokens emitted by each round
    (``spec_round_emitted``): fills each such record's ``acceptance_by_position`` and returns the summary over all
    of their rounds, or ``None`` when no record has per-round counts."""
    from specadapt.engine import RoundRecord
    from specadapt.engine.metrics import acceptance_by_position

    edges = [int(x) for x in bucket_edges.split(",")]
    every = []
    for r in records:
        emitted = r.get("round_emitted")
        if not emitted:
            continue
        rounds, position = [], 0
        for e in emitted:
            rounds.append(RoundRecord(position=position, num_drafted=0, accepted=int(e) - 1, emitted=int(e)))
            position += int(e)
        r["acceptance_by_position"] = acceptance_by_position(rounds, edges)
        every += rounds
    return acceptance_by_position(every, edges) if every else None


def summarize(records: list[dict], wall: float, by_position: list[dict] | None = None,
              overall_acceptance: float | None = None) -> dict:
    """Totals over requests; fills each record's ``tokens_per_s``.

    Acceptance lengths over the requests whose acceptance length is known (``n_i`` tokens, ``a_i`` tokens per
    round, so ``n_i / a_i`` rounds): ``acceptance_length`` = total tokens / total rounds (the aggregate SGLang and
    ``specadapt generate`` report; ``overall_acceptance`` replaces it when the caller has every round, as the
    embedded engine does) and ``acceptance_length_token_weighted`` = sum n_i a_i / sum n_i (each request weighted by
    its output tokens). Seconds are wall clock; ``throughput_tok_s`` = output tokens / ``wall``.
    """
    for r in records:
        r["tokens_per_s"] = r["output_tokens"] / r["latency_s"] if r.get("latency_s") else None
    out_tokens = sum(r["output_tokens"] for r in records)
    latencies = sorted(r["latency_s"] for r in records if r.get("latency_s") is not None)
    known = [r for r in records if r.get("acceptance_length") and r["output_tokens"] > 0]
    acc_tokens = sum(r["output_tokens"] for r in known)
    acc_rounds = sum(r["output_tokens"] / r["acceptance_length"] for r in known)
    if overall_acceptance is None and acc_rounds > 0:
        overall_acceptance = acc_tokens / acc_rounds
    return {
        "requests": len(records),
        "output_tokens": out_tokens,
        "wall_seconds": wall,
        "throughput_tok_s": out_tokens / wall if wall > 0 else None,
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "latency_median_s": statistics.median(latencies) if latencies else None,
        "latency_p90_s": latencies[min(len(latencies) - 1, math.ceil(0.9 * len(latencies)) - 1)] if latencies else None,
        "acceptance_length": overall_acceptance,
        "acceptance_length_token_weighted": (
            sum(r["output_tokens"] * r["acceptance_length"] for r in known) / acc_tokens if acc_tokens else None
        ),
        "requests_with_acceptance": len(known),
        "acceptance_by_position": by_position,
    }


def print_report(report: dict) -> None:
    """A table per request and the summary, to stdout."""
    from specadapt.cli.report import fmt_value as _fmt
    header = f"{'id':<16} {'output':>7} {'latency s':>10} {'tok/s':>8} {'acc.len':>8} {'finish':>8}"
    print()
    print(header)
    print("-" * len(header))
    for r in report["requests"]:
        rid = str(r["id"])
        rid = rid if len(rid) <= 16 else "…" + rid[-15:]
        print(f"{rid:<16} {r['output_tokens']:>7} {_fmt(r['latency_s']):>10} {_fmt(r['tokens_per_s'], '.1f'):>8} "
              f"{_fmt(r['acceptance_length']):>8} {str(r['finish_reason'] or '-'):>8}")
    s, c = report["summary"], report["config"]
    print()
    where = c.get("endpoint") or f"embedded {c.get('model')} draft {c.get('draft')}{' + TTS' if c.get('tts') else ''}"
    print(f"{where}  {c['dataset']}  max_tokens={c['max_tokens']}  T={c['temperature']}  top-p={c['top_p']}  "
          f"concurrency={c['concurrency']}")
    print(f"{s['requests']} requests  |  {s['output_tokens']} output tokens in {_fmt(s['wall_seconds'], '.1f')} s  |  "
          f"{_fmt(s['throughput_tok_s'], '.1f')} tok/s  |  latency mean {_fmt(s['latency_mean_s'])} s, "
          f"median {_fmt(s['latency_median_s'])} s")
    if c.get("chat_template_applied") is False:
        print("prompts sent as raw text to /generate (no chat template: pass --tokenizer to apply one)")
    if s["acceptance_length"] is None:
        print("acceptance length: - (no speculative metrics)")
    else:
        print(f"acceptance length {_fmt(s['acceptance_length'])} (tokens / rounds), "
              f"{_fmt(s['acceptance_length_token_weighted'])} (mean over requests weighted by tokens), "
              f"{s['requests_with_acceptance']} requests")
    if s.get("acceptance_by_position"):
        buckets = "  ".join(
            f"[{b['start']},{b['end'] if b['end'] is not None else ''}): {_fmt(b['acceptance_length'])}"
            for b in s["acceptance_by_position"] if b["rounds"]
        )
        print(f"acceptance length by output position: {buckets}")
    m = report.get("server_metrics")
    if m and m.get("after"):
        values = [x["value"] for x in m["after"].get("sglang:spec_accept_length", [])]
        if values:
            print(f"server gauge sglang:spec_accept_length after the run: {_fmt(statistics.fmean(values))}")


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plot(report: dict, path: str) -> str:
    """Write the figure; returns the title used.

    With per-position data (embedded backend, or a server returning ``spec_round_emitted``): acceptance length vs
    output position (bucket middles, the curve of
    ``scripts/plot_acceptance.py``). Otherwise per-request acceptance length vs output length, or — without any
    speculative metrics — latency vs output length; the title says which.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, s = report["config"], report["summary"]
    where = f"{c['dataset']}, T={c['temperature']}, {s['requests']} requests"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_pos = s.get("acceptance_by_position")
    if by_pos and any(b["rounds"] for b in by_pos):
        xs, ys = _sibling("plot_acceptance").curve(report)
        label = f"{c.get('draft')}{' + TTS' if c.get('tts') else ''}" if c.get("draft") else c.get("endpoint")
        ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("output position (tokens)")
        ax.set_ylabel("acceptance length (tokens / round)")
        ax.legend(fontsize=8)
        title = f"acceptance length vs output position ({where})"
    else:
        pairs = [(r["output_tokens"], r["acceptance_length"]) for r in report["requests"]
                 if r["acceptance_length"] is not None]
        if pairs:
            ax.scatter([p[0] for p in pairs], [p[1] for p in pairs])
            ax.set_ylabel("acceptance length (tokens / round)")
            title = ("per-request acceptance length vs output length\n"
                     f"(the server gives no per-position data; {where})")
        else:
            ax.scatter([r["output_tokens"] for r in report["requests"]], [r["latency_s"] for r in report["requests"]])
            ax.set_ylabel("latency (s)")
            title = f"latency vs output length\n(the server gives no speculative metrics; {where})"
        ax.set_xlabel("output length (tokens)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return title


def write_json(report: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------


_HTTP_ONLY = ("base_url", "api", "timeout", "tokenizer", "no_meta_info", "scrape_metrics")
_EMBEDDED_ONLY = ("draft", "num_draft_tokens", "verify", "tts", "device", "dtype", "generate_args")


def run(args) -> dict:
    """Validate, load the prompts, run the backend and assemble the report (see the module docstring).

    Raises:
        ArgumentError: bad flags; BenchError: server failures.
    """
    from specadapt.datasets import DatasetError, load_prompts

    validate(args)
    try:
        prompts = load_prompts(args.dataset, args.prompt_field, args.limit or None)
    except DatasetError as exc:
        raise ArgumentError(f"--dataset: {exc}") from None
    other = _EMBEDDED_ONLY if args.backend == "openai" else _HTTP_ONLY
    config = {k: v for k, v in vars(args).items() if k not in ("no_progress", "api_key", *other)}
    metrics = None
    if args.backend == "openai":
        records, wall, extra, metrics = run_http(args, prompts)
        config["model"] = args.model
        summary = summarize(records, wall, http_acceptance_by_position(records, args.bucket_edges))
    else:
        records, wall, extra, by_position, overall = run_embedded(args, prompts)
        summary = summarize(records, wall, by_position, overall)
    config.update(extra)
    config.update(python=platform.python_version(), machine=platform.machine())
    summary["max_in_flight"] = extra.get("max_in_flight", min(args.concurrency, len(prompts)))
    if metrics is not None and metrics.get("after"):
        values = [x["value"] for x in metrics["after"].get("sglang:spec_accept_length", [])]
        summary["server_spec_accept_length_after"] = statistics.fmean(values) if values else None
    return {"config": config, "requests": records, "summary": summary, "server_metrics": metrics}


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns 0, 1 (server failure) or 2 (bad argument); argparse errors exit with 2."""
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except ArgumentError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
