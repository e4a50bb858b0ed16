"""Prometheus metrics of ``specadapt serve`` (``GET /metrics``), on a registry of their own (prometheus_client).

Names (all prefixed ``specadapt_``):

- ``requests_total{finish_reason}``: finished requests by how they ended (stop, length, cancelled, error);
  ``requests_rejected_total{reason}``: refused before running (queue_full, shutting_down, invalid);
- ``request_latency_seconds``, ``time_to_first_token_seconds``: histograms from submission;
- ``prompt_tokens_total``, ``generation_tokens_total``; ``generation_throughput_tokens_per_second``: output
  tokens/s over the last 10 s;
- ``acceptance_length{position}``: histogram of tokens emitted per round, labelled by the output-position bucket
  of the round's first token (``0-512``, ``512-1024``, ..., ``8192+``): the acceptance-vs-position curve is
  ``sum / count`` per label;
- ``draft_tokens_verified_total``, ``draft_tokens_accepted_total``, ``draft_tokens_pruned_total`` (adaptive
  verification), ``rounds_total``;
- ``tts_updates_total``, ``tts_rollbacks_total``, ``tts_publish_wait_seconds_total`` (Test-Time Speculation);
- ``num_running_requests``, ``num_waiting_requests`` (queue length), ``kv_cache_rows`` (rows the target's cache
  holds: equal to the running requests, 0 when idle) and ``kv_cache_free_slots`` / ``kv_cache_slots`` (native slot
  cache): together they show slot leaks.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

__all__ = ["ServerMetrics", "POSITION_EDGES", "position_bucket"]

#: Output-position bucket edges of the acceptance-length histogram (the engine's report buckets).
POSITION_EDGES = (0, 512, 1024, 2048, 4096, 8192)


def position_bucket(position: int, edges=POSITION_EDGES) -> str:
    """The label of the bucket holding output position ``position`` (``"512-1024"``, or ``"8192+"``)."""
    for lo, hi in zip(edges, edges[1:]):
        if lo <= position < hi:
            return f"{lo}-{hi}"
    return f"{edges[-1]}+"


def _tts_families(tts):
    """The TTS updater's counters, read at scrape time."""
    stats = tts.stats
    for name, value, doc in (("updates", stats.updates, "TTS optimizer steps taken"),
                             ("rollbacks", stats.rollbacks, "TTS rollbacks to the last good weights"),
                             ("publish_wait_seconds", stats.publish_wait_seconds,
                              "seconds the decoding loop waited at TTS publish boundaries")):
        yield CounterMetricFamily(f"specadapt_tts_{name}", doc, value=float(value))


class ServerMetrics:
    """The server's metrics (thread-safe: updated by the engine thread and the HTTP handlers).

    Args:
        engine: the served :class:`~specadapt.engine.SpeculativeEngine` (its adaptive verification and TTS
            counters are exported when present).
    """

    def __init__(self, engine=None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specadapt_requests", "finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("specadapt_requests_rejected", "requests refused before running", ["reason"],
                                registry=r)
        latency_buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
        self.latency = Histogram("specadapt_request_latency_seconds", "seconds from submission to the last token",
                                 buckets=latency_buckets, registry=r)
        self.ttft = Histogram("specadapt_time_to_first_token_seconds", "seconds from submission to the first token",
                              buckets=latency_buckets, registry=r)
        self.prompt_tokens = Counter("specadapt_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specadapt_generation_tokens", "output tokens emitted", registry=r)
        self.acceptance = Histogram("specadapt_acceptance_length", "tokens emitted per round, by output position",
                                    ["position"], buckets=tuple(range(1, 17)), registry=r)
        self.rounds = Counter("specadapt_rounds", "request rounds (one verification each)", registry=r)
        self.verified = Counter("specadapt_draft_tokens_verified", "draft tokens verified", registry=r)
        self.accepted = Counter("specadapt_draft_tokens_accepted", "draft tokens accepted", registry=r)
        self.running = Gauge("specadapt_num_running_requests", "requests in the running batch", registry=r)
        self.waiting = Gauge("specadapt_num_waiting_requests", "requests waiting for a place", registry=r)
        self.cache_rows = Gauge("specadapt_kv_cache_rows", "rows held by the target's KV cache", registry=r)
        self.free_slots = Gauge("specadapt_kv_cache_free_slots", "free slots of the target's slot KV cache",
                                registry=r)
        self.slots = Gauge("specadapt_kv_cache_slots", "slots of the target's slot KV cache", registry=r)
        self.throughput = Gauge("specadapt_generation_throughput_tokens_per_second",
                                "output tokens per second over the last 10 seconds", registry=r)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        adaptive = getattr(engine, "adaptive", None)
        if adaptive is not None:
            self.registry.register(_Callback(lambda: [CounterMetricFamily(
                "specadapt_draft_tokens_pruned", "draft tokens pruned by adaptive verification",
                value=float(adaptive.pruned))]))
        tts = getattr(engine, "tts", None)
        if tts is not None:
            self.registry.register(_Callback(lambda: _tts_families(tts)))

    # ---- updates -------------------------------------------------------------------------------------------
    def observe_round(self, record) -> None:
        """One round of one request (a :class:`~specadapt.engine.RoundRecord`; ``position`` in its output)."""
        self.rounds.inc()
        self.acceptance.labels(position_bucket(record.position)).observe(record.emitted)
        self.verified.inc(record.num_drafted)
        self.accepted.inc(min(record.accepted, record.num_drafted))

    def tokens(self, count: int) -> None:
        """``count`` output tokens were emitted."""
        self.generation_tokens.inc(count)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, count))
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()

    def finished(self, job) -> None:
        """A request ended (a :class:`~specadapt.serve.scheduler.Job`)."""
        self.requests.labels(job.finish_reason).inc()
        if job.finished_time is not None:
            self.latency.observe(job.finished_time - job.submitted)
        if job.first_token_time is not None:
            self.ttft.observe(job.first_token_time - job.submitted)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def batch_state(self, running: int, waiting: int, engine) -> None:
        """Gauges of the batch: running / waiting requests and the target cache's rows and slots."""
        self.running.set(running)
        self.waiting.set(waiting)
        kv = engine.cache
        self.cache_rows.set(0 if kv is None else int(kv.batch_size))
        if kv is not None and hasattr(kv, "free"):
            self.slots.set(kv.num_slots)
            self.free_slots.set(len(kv.free))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()
            self.throughput.set(sum(c for _, c in self._recent) / 10.0)
        return generate_latest(self.registry)


class _Callback:
    """A collector whose metric families ``make()`` returns at scrape time."""

    def __init__(self, make) -> None:
        self.make = make

    def describe(self):
        return []

    def collect(self):
        yield from self.make()
