"""The asynchronous Test-Time Speculation updater: shadow copy, strided steps beside decoding, publish at a
fixed round boundary by in-place copy, rollback (docs/design/specs/tts.md, "System design").

Protocol, per boundary (every ``S`` rounds, counted by the caller's round number, never by polling):

1. wait for the update submitted at the previous boundary (the only time the decoding loop waits);
2. publish: ``torch._foreach_copy_`` of the shadow's trainable tensors into the serving tensors (on the main
   stream after waiting on the trainer's CUDA event), so parameter addresses never change and captured CUDA
   graphs replay with the new weights; then refresh derived buffers (``on_publish``);
3. rollback check: if the mean acceptance length of the last ``rollback_window`` rounds is below
   ``(1 - margin) * baseline`` (baseline: the rounds before the first publish, i.e. the draft before any
   adaptation), restore the pre-adaptation weights - the only weights whose acceptance was measured good - into
   serving and shadow and restart the optimizer;
4. submit the next update on the rounds gathered since the previous boundary. It runs on a background thread
   (PyTorch ops release the GIL), on a side CUDA stream when the shadow lives on a GPU (the side stream first
   waits on an event recorded on the main stream after the publish, so it never overwrites the shadow while the
   publish copy still reads it), while the next ``S`` rounds decode with the published weights.

The shadow is a deep copy of the serving module that shares every frozen tensor (read-only on both sides) and
owns copies of the trainable ones, so training never writes a tensor serving reads.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .config import TTSConfig

logger = logging.getLogger(__name__)

__all__ = ["TTSStats", "TTSUpdater"]


@dataclass
class TTSStats:
    """Counters of one updater (seconds are wall clock).

    Attributes:
        updates: optimizer steps taken; skipped: steps skipped for a non-finite loss or gradient;
        rollbacks: restores of the last good weights; publishes: in-place copies into serving;
        publish_wait_seconds: time the decoding loop waited at boundaries (for the trainer, plus the copy);
        train_seconds: time spent in update jobs (beside decoding); losses: loss of each step taken.
    """

    updates: int = 0
    skipped: int = 0
    rollbacks: int = 0
    publishes: int = 0
    publish_wait_seconds: float = 0.0
    train_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


def _adam(params: list[torch.Tensor], lr: float) -> torch.optim.Adam:
    """Adam over ``params``: PyTorch's fused kernel on the CPU (one pass over each tensor; the per-tensor loop
    took 0.2 s of a 0.7 s update on the coder's 30M-parameter head, 2 cores), its default (``foreach``)
    elsewhere. Same update rule either way."""
    if params and all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                      for p in params):
        try:
            return torch.optim.Adam(params, lr=lr, fused=True)
        except (RuntimeError, TypeError, ValueError):  # a torch without the fused CPU kernel
            pass
    return torch.optim.Adam(params, lr=lr)


class TTSUpdater:
    """Online distillation of a draft module (see the module docstring).

    Args:
        serving: the module decoding uses; its trainable tensors are overwritten in place at publishes.
        trainable: ``(name, parameter) -> bool`` selects the parameters to train (the draft's own layers or
            LoRA adapters; never embeddings / LM head shared with the target).
        loss_fn: ``(module, examples) -> scalar tensor``, differentiable in ``module``'s trainable parameters.
        config: :class:`TTSConfig`.
        share: objects the shadow must share instead of copying (e.g. modules borrowed from the target).
        on_publish: called after every publish / rollback (refresh derived weight buffers).
        asynchronous: ``True`` runs updates on a background thread (side stream on CUDA); ``False`` runs each
            update inline at its boundary (same results, for debugging).
        example_bytes: ``example -> int`` bytes held by one buffered example (memory accounting).
        trainer_threads: intra-op CPU threads of the background trainer (torch's thread count is per thread):
            1 leaves the other cores to decoding instead of oversubscribing them.

    Raises:
        ValueError: no parameter selected by ``trainable``.
    """

    def __init__(
        self,
        serving: nn.Module,
        trainable: Callable[[str, nn.Parameter], bool],
        loss_fn: Callable[[nn.Module, list[Any]], torch.Tensor],
        config: TTSConfig,
        share: Iterable[Any] = (),
        on_publish: Callable[[], None] | None = None,
        asynchronous: bool = True,
        example_bytes: Callable[[Any], int] | None = None,
        trainer_threads: int = 1,
    ) -> None:
        names = [n for n, p in serving.named_parameters() if trainable(n, p)]
        if not names:
            raise ValueError("TTS: no trainable draft parameter selected")
        self.config = config
        self.serving = serving
        self.loss_fn = loss_fn
        self.on_publish = on_publish
        self.example_bytes = example_bytes or (lambda ex: 0)
        self.trainer_threads = trainer_threads
        self.names = names
        serving_by_name = dict(serving.named_parameters())
        self.serving_params = [serving_by_name[n] for n in names]
        memo: dict[int, Any] = {id(obj): obj for obj in share}
        for n, p in serving.named_parameters():
            if n not in names:
                memo[id(p)] = p  # frozen: shared, never copied
        self.shadow = copy.deepcopy(serving, memo)
        shadow_by_name = dict(self.shadow.named_parameters())
        self.shadow_params = [shadow_by_name[n] for n in names]
        for p in self.shadow.parameters():
            p.requires_grad_(False)
        for p in self.shadow_params:
            p.requires_grad_(True)
        self.shadow.train(False)  # no dropout: the draft samples from the module as-is
        self.optimizer = _adam(self.shadow_params, config.lr)
        self.initial = [p.detach().clone() for p in self.serving_params]  # rollback target, parameter dtype
        self.stats = TTSStats()
        self.device = self.serving_params[0].device
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._event = None
        self.asynchronous = asynchronous
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tts") if asynchronous else None
        self._future: Future | None = None
        self._buffer: list[Any] = []
        self._round = 0
        self._published_once = False
        self._baseline: list[float] = []
        self._rolling: collections.deque[float] = collections.deque(maxlen=config.rollback_window)
        self._peak_snapshot_bytes = 0
        self._in_flight_bytes = 0

    @property
    def on_cuda(self) -> bool:
        """Whether the trained tensors live on a CUDA device (updates then run on :attr:`stream`)."""
        return self._cuda

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side CUDA stream the trainer runs on, or ``None`` on CPU. A tensor allocated on another stream and
        read by an update (e.g. a snapshot the serving loop cloned) must be ``record_stream``-ed on it, so the
        caching allocator does not reuse its memory while the update still reads it."""
        return self._stream

    # ---- the decoding loop's side -------------------------------------------------------------------------
    def end_round(self, examples: list[Any], acceptance_length: float | None) -> None:
        """Call once per decoding round, after verification and before the next draft.

        Args:
            examples: the round's supervision (opaque to the updater; passed to ``loss_fn``).
            acceptance_length: the round's mean tokens per request (``tau + 1``), or ``None`` if no request
                drafted.
        """
        self._round += 1
        if acceptance_length is not None:
            (self._rolling if self._published_once else self._baseline).append(float(acceptance_length))
        if self.config.rounds == "latest":
            self._buffer = list(examples) if examples else self._buffer
        else:
            self._buffer.extend(examples)
        size = sum(self.example_bytes(ex) for ex in self._buffer) + self._in_flight_bytes
        self._peak_snapshot_bytes = max(self._peak_snapshot_bytes, size)
        if self._round % self.config.stride == 0:
            self._boundary()

    def close(self) -> None:
        """Wait for an update in flight and publish it; stop the background thread."""
        if self._future is not None:
            self._wait_and_publish()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def reinitialize(self, fn: Callable[[nn.Module], None]) -> None:
        """Drain (wait for and publish an update in flight), drop buffered supervision, apply ``fn`` to the
        serving module and to the shadow (e.g. fresh per-request adapters), restart the optimizer and take the
        result as the new pre-adaptation (rollback) weights."""
        if self._future is not None:
            self._wait_and_publish()
        self._buffer = []
        with torch.no_grad():
            fn(self.serving)
            fn(self.shadow)
        self.optimizer.state.clear()
        for good, p in zip(self.initial, self.serving_params):
            good.copy_(p.detach())

    def _boundary(self) -> None:
        if self._future is not None:
            self._wait_and_publish()
            self._maybe_roll_back()
        self._in_flight_bytes = 0
        if self._buffer:
            examples, self._buffer = self._buffer, []
            self._in_flight_bytes = sum(self.example_bytes(ex) for ex in examples)
            after_publish = None
            if self._cuda:  # the trainer must not touch the shadow before the publish copy has read it
                after_publish = torch.cuda.Event()
                after_publish.record(torch.cuda.current_stream(self.device))
            if self._executor is None:
                self._train(examples, after_publish)
                self._future = _done_future()
            else:
                self._future = self._executor.submit(self._train, examples, after_publish)

    def _wait_and_publish(self) -> None:
        start = time.perf_counter()
        self._future.result()  # re-raises an exception of the trainer
        self._future = None
        with torch.no_grad():
            if self._cuda and self._event is not None:
                torch.cuda.current_stream(self.device).wait_event(self._event)
            torch._foreach_copy_(self.serving_params, [p.detach() for p in self.shadow_params])
        if self.on_publish is not None:
            self.on_publish()
        self.stats.publishes += 1
        self._published_once = True
        self.stats.publish_wait_seconds += time.perf_counter() - start

    def _maybe_roll_back(self) -> None:
        if not self._baseline or len(self._rolling) < self._rolling.maxlen:
            return
        baseline = sum(self._baseline) / len(self._baseline)
        rolling = sum(self._rolling) / len(self._rolling)
        if rolling < (1 - self.config.rollback_margin) * baseline:
            logger.warning("TTS rollback: rolling acceptance length %.2f < (1 - %.2f) x baseline %.2f",
                           rolling, self.config.rollback_margin, baseline)
            with torch.no_grad():
                torch._foreach_copy_(self.serving_params, self.initial)
                torch._foreach_copy_([p.data for p in self.shadow_params], self.initial)
            self.optimizer.state.clear()
            if self.on_publish is not None:
                self.on_publish()
            self.stats.rollbacks += 1
            self._rolling.clear()

    # ---- the trainer's side (background thread) ------------------------------------------------------------
    def _train(self, examples: list[Any], after_publish=None) -> None:
        start = time.perf_counter()
        if self._executor is not None and not self._cuda:
            torch.set_num_threads(self.trainer_threads)  # this (trainer) thread only
        ctx = torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()
        with ctx:
            if after_publish is not None:
                self._stream.wait_event(after_publish)
            with torch.enable_grad():
                loss = self.loss_fn(self.shadow, examples)
                if not bool(torch.isfinite(loss)):
                    self.stats.skipped += 1
                else:
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    grads = [p for p in self.shadow_params if p.grad is not None]
                    # the clip's total norm doubles as the finiteness check (one fused pass): a NaN or inf entry
                    # makes it NaN / inf; so does a finite gradient whose squares overflow float32 (|g| > 1e19),
                    # which is skipped too rather than clipped
                    norm = torch.nn.utils.clip_grad_norm_(grads, self.config.grad_clip) if grads else None
                    if norm is None or not bool(torch.isfinite(norm)):
                        self.stats.skipped += 1
                        self.optimizer.zero_grad(set_to_none=True)
                    else:
                        self.optimizer.step()
                        self.stats.updates += 1
                        self.stats.losses.append(float(loss.detach()))
            if self._cuda:
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        self.stats.train_seconds += time.perf_counter() - start

    # ---- accounting ----------------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes TTS adds: ``trainable`` (the draft's trainable tensors, for reference), ``shadow``,
        ``optimizer`` (Adam moments), ``rollback_copy`` (the pre-adaptation weights), ``snapshots`` (peak
        supervision held: buffered plus in flight), ``total`` (all added, i.e. everything but ``trainable``) and
        ``total_without_rollback`` (shadow + optimizer + snapshots)."""
        trainable = sum(p.numel() * p.element_size() for p in self.serving_params)
        shadow = sum(p.numel() * p.element_size() for p in self.shadow_params)
        optimizer = sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for key, t in state.items()
            if torch.is_tensor(t) and key != "step"
        )
        rollback = sum(t.numel() * t.element_size() for t in self.initial)
        out = {"trainable": trainable, "shadow": shadow, "optimizer": optimizer, "rollback_copy": rollback,
               "snapshots": self._peak_snapshot_bytes}
        out["total_without_rollback"] = shadow + optimizer + self._peak_snapshot_bytes
        out["total"] = out["total_without_rollback"] + rollback
        return out


def background_trainer_pays(device: str | torch.device, trainer_threads: int = 1) -> bool:
    """Whether asynchronous TTS updates have compute of their own beside decoding.

    On CUDA they run on a side stream: always. On a CPU the background trainer is a thread with
    ``trainer_threads`` intra-op threads: it pays only when the cores this process may run on exceed the
    decoder's intra-op threads (``torch.get_num_threads()``) by that many. Otherwise it takes a core from the
    decoder's OpenMP team, whose every barrier then waits on a descheduled thread: on a 2-core AMX Xeon (int4
    SmolLM2, ``eagle``, L = 1, stride 5) background updates gave 33-34 tok/s and inline ones 49 tok/s, the
    target's decoder stack going from 4.8 to 26 ms per round while the trainer ran.

    Args:
        device: where the draft (and its trainer) runs, e.g. ``"cpu"``, ``"cuda:0"``.
        trainer_threads: intra-op threads of the background trainer (>= 1).

    Returns:
        ``True`` when a background trainer does not slow decoding down by contention.
    """
    if torch.device(device).type == "cuda":
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return cores - torch.get_num_threads() >= max(1, trainer_threads)


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f
