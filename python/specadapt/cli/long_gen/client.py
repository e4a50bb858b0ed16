"""The HTTP backend of the long-generation benchmark: one request per prompt to an OpenAI-compatible server
(``/v1/chat/completions``) or SGLang's native ``/generate``, ``--concurrency`` in flight; per-request speculative
counters and acceptance lengths, and the server's Prometheus ``/metrics`` samples."""

from __future__ import annotations

import json
import queue
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

from .options import BODY_EXCERPT, PROG, SPEC_KEYS, ArgumentError, BenchError


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
        """GET ``path``; returns the decoded JSON value (a 1-element list is unwrapped)."""
        return self._decode(self._open("GET", path, None), "GET", path)

    def get_text(self, path: str) -> str:
        """GET ``path``; returns the body as text."""
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

