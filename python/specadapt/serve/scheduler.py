"""Continuous batching for ``specadapt serve``: one engine thread runs speculation rounds for a running batch that
requests join and leave between rounds.

The engine (:class:`~specadapt.engine.SpeculativeEngine`) is driven through its running-batch API: ``join`` at a
round boundary (the new prompts are prefilled in one ragged forward), ``step`` (one round for every running
request), ``cancel``. A request that finishes (EOS, a stop token or string, ``max_tokens``) leaves at once and its
cache slot is reused by the next. Each request draws its coins from its own stream, so its output depends on its
prompt, seed and settings only, not on when it joined or what else runs.

Threads: HTTP handlers call :meth:`Scheduler.submit` / :meth:`Scheduler.cancel` from the event loop; the engine
thread is the only one that touches the engine, and hands each request's events to its ``sink`` (a callable run on
the engine thread, which the web layer forwards to its event loop). Run the engine loop on the thread that loaded
and warmed up the model (:meth:`Scheduler.run`, as ``specadapt serve`` does on its main thread): on these CPUs,
target-only SmolLM2-135M at batch 1 on 2 cores decoded 74 tokens/s from a second thread against 227 on the thread
that ran torch first (62 against 161 in another run), while all torch work on one non-main thread ran at 192.
:meth:`Scheduler.start` (a thread of its own) is for tests and embedding.

Failures: a request the engine refuses at ``join`` fails alone. If a round raises, the batch is rebuilt: every
running request is resumed alone from what it has emitted (its prompt plus output so far, the same seed: the coins
are keyed by the committed length, so the law of its continuation is unchanged) and stepped once; the ones that
raise again fail with the error, the others rejoin one batch and go on. With history-dependent logit processors
(penalties) a resumed request would count its earlier output as prompt, so there every running request fails
instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..engine.loop import Request
from .text import IncrementalText

logger = logging.getLogger(__name__)

__all__ = ["Job", "JobEvent", "QueueFullError", "Scheduler", "ShuttingDownError"]


class QueueFullError(RuntimeError):
    """The waiting queue is full (HTTP 503)."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class JobEvent:
    """What one round did for one request.

    Attributes:
        tokens: token ids emitted this round that belong to the output (none after a stop string).
        text: text released this round (see :class:`~specadapt.serve.text.IncrementalText`).
        finished: the request ended; ``finish_reason`` is ``stop``, ``length``, ``cancelled`` or ``error``.
        error: the message when ``finish_reason == "error"``.
    """

    tokens: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Job:
    """One request of the server.

    Args:
        prompt: token ids (chat template applied), at least one.
        max_tokens: output tokens at most (>= 1).
        seed: the request's seed (its coin stream).
        sampling: its ``SamplingParams``, or ``None`` for the engine's.
        stop_token_ids: ids that end the output (emitted, like EOS).
        stop: stop strings (the output ends before the first; needs ``tokenizer``).
        ignore_eos: decode past EOS.
        speculate: ``False`` verifies no drafts for this request.
        sink: called on the engine thread with the request's :class:`JobEvent` s: one per round with ``stream``,
            else only the last (the caller reads the output from the job).
        tokenizer: decodes the output (``None``: events carry no text and ``stop`` must be empty).
        stream: hand events to ``sink`` while the request runs (streaming responses), not only when it ends.
        stream_interval: with ``stream``, an event once at least this many tokens arrived since the last one (the
            last event always comes at the end).
    """

    prompt: list[int]
    max_tokens: int
    sink: Callable[[JobEvent], None]
    seed: int = 0
    sampling: object = None
    stop_token_ids: frozenset = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool | None = None
    speculate: bool = True
    tokenizer: object = None
    stream: bool = True
    stream_interval: int = 1
    # filled while it runs
    output_ids: list[int] = field(default_factory=list)
    rounds: list = field(default_factory=list)  # RoundRecord of each round
    finish_reason: str | None = None
    error: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None
    cancel_requested: bool = False
    _unsent: list = field(default_factory=list)  # tokens not handed out yet (stream_interval)

    def __post_init__(self) -> None:
        if self.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.detok = IncrementalText(self.tokenizer, self.stop) if self.tokenizer is not None else None
        self.engine_request: Request | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> str:
        """The output text so far (empty without a tokenizer)."""
        return self.detok.text if self.detok is not None else ""

    def _resume_request(self) -> Request:
        """An engine request that continues this job from what it has emitted."""
        self.engine_request = Request(
            prompt=list(self.prompt) + list(self.output_ids), max_new_tokens=self.max_tokens - len(self.output_ids),
            seed=self.seed, sampling=self.sampling, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            speculate=self.speculate)
        return self.engine_request


class Scheduler:
    """The engine thread: continuous batching over a :class:`~specadapt.engine.SpeculativeEngine`.

    Args:
        engine: the engine (used by this scheduler's thread only, once started).
        max_batch_size: requests decoded together at most (>= 1).
        max_queue: requests waiting for a place in the batch at most (>= 0); :meth:`submit` raises
            :class:`QueueFullError` beyond.
        metrics: a :class:`~specadapt.serve.metrics.ServerMetrics` or ``None``.

    Raises:
        ValueError: ``max_batch_size < 1`` or ``max_queue < 0``.
    """

    def __init__(self, engine, max_batch_size: int, max_queue: int, metrics=None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_batch_size = int(max_batch_size)
        self.max_queue = int(max_queue)
        self.metrics = metrics
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}  # id(engine request) -> job
        self._cancels: list[Job] = []
        self._accepting = True
        self._stop = False
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    # ---- called from other threads -------------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop on a thread of its own (once); see the module docstring for :meth:`run`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="specadapt-engine", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Run the engine loop on the calling thread until :meth:`stop`, or until a :meth:`drain` ends (every
        request finished, or the deadline passed and the rest ended with an error)."""
        self.engine.open_batch()
        self._loop()

    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins the batch at the next round boundary with a free place.

        Raises:
            ShuttingDownError: after :meth:`drain` or :meth:`stop`.
            QueueFullError: ``max_queue`` requests are already waiting.
        """
        with self._cv:
            if not self._accepting:
                raise ShuttingDownError("the server is shutting down")
            if len(self._running) + len(self._waiting) >= self.max_batch_size + self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests waiting, "
                                     f"{len(self._running)} running; --max-queue {self.max_queue})")
            self._waiting.append(job)
            self._update_gauges()
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Cancel ``job`` (a client went away): it leaves the batch at the next round boundary."""
        with self._cv:
            if job.finished or job.cancel_requested:
                return
            job.cancel_requested = True
            self._cancels.append(job)
            self._cv.notify()

    def drain(self, timeout: float) -> None:
        """Take no new requests; the running and waiting ones may go on for ``timeout`` seconds, then end with
        an error (graceful shutdown). The loop returns once no request is left."""
        with self._cv:
            self._accepting = False
            if self._deadline is None:
                self._deadline = time.perf_counter() + max(float(timeout), 0.0)
            self._cv.notify()

    @property
    def accepting(self) -> bool:
        """New requests are taken (not draining or stopped)."""
        return self._accepting

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def stop(self, timeout: float = 10.0) -> None:
        """End every request still open with an error and stop the engine thread."""
        with self._cv:
            self._accepting = False
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def idle(self) -> bool:
        """No request is running or waiting."""
        with self._cv:
            return not self._waiting and not self._running

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._cancels or self._running or self._waiting):
                    if self._deadline is not None:
                        return  # drained: nothing left to run
                    self._cv.wait()
                cancels, self._cancels = self._cancels, []
                stop = self._stop or (self._deadline is not None and time.perf_counter() >= self._deadline)
                admit = []
                if not stop:
                    while self._waiting and len(self._running) + len(admit) < self.max_batch_size:
                        job = self._waiting.popleft()
                        if not job.cancel_requested:
                            admit.append(job)
                        else:
                            self._finish(job, "cancelled")
                    for job in admit:
                        self._running[id(job._resume_request())] = job
                self._update_gauges()
            try:
                self._cancel(cancels)
                if stop:
                    self._abort_all("the server shut down before the request finished")
                    return
                if admit:
                    self._join(admit)
                if self._running:
                    self._step()
            except Exception:  # never let the engine thread die silently
                logger.exception("engine thread: unexpected error; failing the running requests")
                self._abort_all("internal error of the engine thread")
            finally:
                self._update_gauges()

    def _cancel(self, jobs: list[Job]) -> None:
        running = [job for job in jobs if job.engine_request is not None and id(job.engine_request) in self._running]
        if running:
            self.engine.cancel([job.engine_request for job in running])
        for job in jobs:
            with self._cv:
                if job in self._waiting:
                    self._waiting.remove(job)
                self._running.pop(id(job.engine_request), None)
            if not job.finished:
                self._finish(job, "cancelled")

    def _join(self, jobs: list[Job]) -> None:
        try:
            self.engine.join([job.engine_request for job in jobs])
            return
        except Exception as exc:  # find the request(s) at fault: rebuild the batch one request at a time
            logger.warning("join of %d requests failed (%s): rebuilding the batch", len(jobs), exc)
        self._recover()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:
            logger.warning("a round failed (%s): resuming the running requests one by one", exc, exc_info=True)
            self._recover()
            return
        self._deliver(events)

    def _deliver(self, events) -> None:
        for request, tokens, done in events:
            job = self._running.get(id(request))
            if job is None:
                continue
            if request.result.rounds:
                record = request.result.rounds[-1]
                record.position = len(job.output_ids)
                job.rounds.append(record)
                if self.metrics is not None:
                    self.metrics.observe_round(record)
            self._emit(job, tokens, request.result.finish_reason if done else None)

    def _emit(self, job: Job, tokens: list[int], finish_reason: str | None) -> None:
        """Hand ``tokens`` to the job (cut at a stop string) and finish it when the engine or a stop string ends it."""
        if job.detok is not None:
            job.detok.add(tokens)
            tokens = tokens[: job.detok.num_tokens - len(job.output_ids)]
            if job.detok.stopped and finish_reason is None:
                finish_reason = "stop"
                self.engine.cancel([job.engine_request])  # the stop string ends it: its slot is free now
        if tokens and job.first_token_time is None:
            job.first_token_time = time.perf_counter()
        job.output_ids.extend(tokens)
        if self.metrics is not None and tokens:
            self.metrics.tokens(len(tokens))
        job._unsent += tokens
        if finish_reason is None:
            if job.stream and len(job._unsent) >= job.stream_interval:
                job.sink(JobEvent(job._unsent, job.detok.take_delta() if job.detok is not None else ""))
                job._unsent = []
            return
        with self._cv:
            self._running.pop(id(job.engine_request), None)
        tokens, job._unsent = job._unsent, []
        self._finish(job, finish_reason, tokens)

    def _finish(self, job: Job, reason: str, tokens: list[int] | None = None, error: str | None = None) -> None:
        if job.finished:
            return
        job.finish_reason, job.error, job.finished_time = reason, error, time.perf_counter()
        text = ""
        if job.detok is not None:
            job.detok.finish()
            text = job.detok.take_delta()
        if self.metrics is not None:
            self.metrics.finished(job)
        job.sink(JobEvent(tokens or [], text, True, reason, error))

    def _abort_all(self, message: str) -> None:
        with self._cv:
            jobs = list(self._running.values()) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
        try:
            self.engine.close_batch()
            self.engine.open_batch()
        except Exception:  # pragma: no cover - close_batch only drops references
            logger.exception("engine: could not reset the batch")
        for job in jobs:
            self._finish(job, "error", error=message)

    def _recover(self) -> None:
        """Rebuild the running batch after a failed join or round (see the module docstring)."""
        jobs = list(self._running.values())
        self._running.clear()
        self.engine.close_batch()
        if self.engine.history_dependent:
            for job in jobs:
                self._finish(job, "error", error="the engine failed on this batch (with penalties the requests "
                                                 "cannot be resumed)")
            self.engine.open_batch()
            return
        survivors = []
        for job in jobs:
            self.engine.open_batch()
            request = job._resume_request()
            self._running[id(request)] = job
            try:
                self.engine.join([request])
                events = self.engine.step()
            except Exception as exc:
                logger.error("request failed alone: %s", exc, exc_info=True)
                self._running.pop(id(request), None)
                self._finish(job, "error", error=f"the engine failed on this request: {type(exc).__name__}: {exc}")
                continue
            finally:
                self.engine.close_batch()
            self._deliver(events)
            if not job.finished:
                survivors.append(job)
            self._running.pop(id(request), None)
        self.engine.open_batch()
        if not survivors:
            return
        for job in survivors:
            self._running[id(job._resume_request())] = job
        try:
            self.engine.join([job.engine_request for job in survivors])
        except Exception as exc:
            logger.error("rejoining %d requests failed: %s", len(survivors), exc, exc_info=True)
            self._running.clear()
            self.engine.close_batch()
            self.engine.open_batch()
            for job in survivors:
                self._finish(job, "error", error=f"the engine failed: {type(exc).__name__}: {exc}")

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.batch_state(len(self._running), len(self._waiting), self.engine)
