"""The batched speculative decoding loop of the embedded engine.

One round, for every active request at once (docs/design/specs/verification.md):

1. the draft proposes ``L_r <= L`` tokens per request, keeping the ``q`` rows they were sampled from;
2. the target scores ``[last committed token, drafts...]`` in ONE forward (a ragged chunk: row ``r`` holds
   ``1 + L_r`` real tokens), giving ``p(. | X^i)`` for ``i = 0..L_r``;
3. a verification rule (``chain`` or ``block``; a multi-path rule such as ``gbv`` verifies a token tree of K
   paths instead) decides ``tau`` from fresh coins and emits ``tau + 1`` tokens;
4. both KV caches roll back to the accepted length; the extra token becomes the next round's slot 0.

With history-dependent logit processors (repetition / frequency / presence penalties) every row is transformed
with the history it conditions on: the target's row at verify slot ``i`` with the committed tokens plus
``drafts[:i]``, a tree node's row with the path from the root to it, and the draft's row for draft ``i + 1``
with the same history (the engine keeps the committed counts, :class:`~specadapt.sampling.TokenCounts`, and
hands them to the draft as ``Draft.history_counts`` before each proposal).

A request ends at an EOS token or after ``max_new_tokens``; the others continue. With :class:`NoDraft` a
round is exactly one step of plain target decoding, which is how the target-only baseline runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..estimator.features import feature_from_probs
from ..sampling import SamplingParams, TokenCounts, logits_to_probs_rows
from .. import kernels
from . import coins
from .coins import request_coins
from ..verification.rules import DEFAULT_RULE, get_rule, rule_names
from .drafts import Draft, NoDraft, pad_token_lists
from .models import LoadedModel

logger = logging.getLogger(__name__)

#: values of ``SpeculativeEngine(speculation=...)`` and of the front ends' ``--speculation``
SPECULATION_MODES = ("auto", "on", "off")

__all__ = ["PhaseTimes", "Request", "RoundRecord", "RequestResult", "SpeculativeEngine"]


@dataclass
class RoundRecord:
    """One speculation round of one request.

    Attributes:
        position: index (in the request's output) of the first token the round emitted.
        num_drafted: drafts verified this round (``L_r``).
        accepted: accepted drafts (``tau``); the round emitted ``emitted`` tokens (``tau + 1`` unless cut by EOS).
    """

    position: int
    num_drafted: int
    accepted: int
    emitted: int


@dataclass
class RequestResult:
    """Outcome of one request: its output token ids, rounds and timing (seconds, wall clock, from joining the
    batch to finishing). ``finish_reason``: ``stop`` (EOS or a stop token, which is emitted), ``length``
    (``max_new_tokens``), ``cancelled`` (:meth:`SpeculativeEngine.cancel`), ``None`` while decoding."""

    index: int
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    seconds: float = 0.0
    finished_by_eos: bool = False
    finish_reason: str | None = None


@dataclass
class PhaseTimes:
    """Wall time an engine spent prefilling and decoding, summed over every batch since it was built or since
    :meth:`SpeculativeEngine.reset_phase_times` (``SpeculativeEngine.phase_times``).

    A *prefill* is one :meth:`SpeculativeEngine.join` that admitted requests: the new prompts' ragged target
    forward (every prompt token but the last, which slot 0 of the request's first round feeds) plus what the draft
    and Test-Time Speculation do for the new rows (the draft's own prefill, EAGLE's features); on CUDA the join
    waits for its work on the current stream, so none of it spills into the next round. *Decoding* is every
    :meth:`SpeculativeEngine.step` (one round each: draft, verify forward, verification, bookkeeping). Time between
    these calls (the caller's own work) is in neither.

    Attributes:
        prefill_seconds: wall time of the joins that admitted at least one request.
        prefill_tokens: prompt tokens of the requests those joins admitted (whole prompts; requests with
            ``max_new_tokens = 0`` are not prefilled and not counted).
        prefills: joins that admitted at least one request.
        decode_seconds: wall time of the rounds.
        decode_tokens: tokens the rounds emitted.
        decode_rounds: rounds (batched steps, not per-request rounds).
    """

    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    prefills: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    decode_rounds: int = 0

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens prefilled per second of prefill (``None`` before any prefill)."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens emitted per second of decoding rounds (``None`` before any round)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else None


@dataclass(eq=False)
class Request:
    """One request of a running batch (:meth:`SpeculativeEngine.join`, continuous batching).

    Attributes:
        prompt: token ids (already chat-templated), at least one.
        max_new_tokens: output tokens at most (>= 0).
        seed: the request's seed: its coins come from its own stream, so its output depends on its prompt,
            seed and settings only.
        sampling: its :class:`SamplingParams` for the target (and the draft), or ``None`` for the engine's.
            Penalties and logit bias must equal the engine's (they need per-request histories).
        stop_token_ids: ids that end the request like EOS (the stop token is emitted).
        ignore_eos: decode past EOS (``None``: the engine's ``ignore_eos``).
        speculate: ``False``: no drafts are verified for this request, every round is a plain target step for
            it (chain / block only).
        forced: target-only engines: emit these tokens instead of the sampled ones (paired timing).
        result: filled while it decodes (created by :meth:`SpeculativeEngine.join` when ``None``).
    """

    prompt: list[int]
    max_new_tokens: int
    seed: int = 0
    sampling: SamplingParams | None = None
    stop_token_ids: frozenset = frozenset()
    ignore_eos: bool | None = None
    speculate: bool = True
    forced: list[int] | None = None
    result: RequestResult | None = None


@dataclass(eq=False)
class _Row:
    """A request in the running batch: its committed tokens (prompt + output) and when it joined."""

    request: Request
    history: list[int]
    start: float
    # adaptive verification (catch_up "budget"): the budget ranked this request in for the next round, so it
    # feeds its whole deferred catch-up then (a request that just joined catches up its prompt)
    catch_up: bool = True


class SpeculativeEngine:
    """Batched speculative decoding of a target with a draft and a lossless verification rule.

    Args:
        target: the target model and tokenizer.
        draft: a :class:`Draft` (``NoDraft`` gives target-only decoding).
        sampling: temperature / top-k / top-p, shared by target and draft.
        num_draft_tokens: ``L``, the most drafts verified per request per round (>= 0).
        verify: a rule of :data:`specadapt.verification.rules.RULES`: ``chain``, ``block`` or ``gbv`` (greedy
            multi-path block verification over ``num_paths`` sampled paths; a multi-path rule needs a draft that
            samples, i.e. a model draft).
        num_paths: K, paths drafted per request for a multi-path rule (``gbv``; 1 for the other rules).
        adaptive: an :class:`~specadapt.engine.adaptive.AdaptiveVerification` to prune each round's drafts to
            a budget, or ``None``. With ``gbv`` every path of a request verifies the same prefix, its cap chosen
            from the committed context only (the q row of position 1, extrapolated with the estimator).
        speculation: ``auto`` (default) or ``on``: speculate; with ``adaptive`` its own ``speculation`` decides
            whether a budget of 0 turns drafting off, and must agree. ``off``: no request drafts, every round is
            a plain target step (the draft is kept but never runs).
        tts: an :class:`~specadapt.engine.tts_bridge.EngineTTS` (Test-Time Speculation of the draft), or
            ``None``. It sees every verified round; weights change only at its publish boundaries.
        ignore_eos: keep decoding past EOS tokens until ``max_new_tokens`` (long-generation measurements).
        seed: the default per-request seed (:meth:`generate` takes one per prompt): every coin of a request comes
            from its own counter-based stream (:mod:`specadapt.engine.coins`), so its output does not depend on
            the other requests of the batch.
        verify_impl: ``auto`` (fused C++/CUDA kernel when available, else on CUDA the CuPy JIT of the same kernels,
            else the float64 reference, with a logged warning), ``compiled``, ``cupy`` or ``reference``
            (:func:`specadapt.kernels.choose_implementation`); all give the same tokens for the same coins.
        packed_forward: run the target's ragged forwards (prefill of prompts of different lengths, verify chunks
            with pruned or fewer drafts, token trees of different sizes) packed, so holes cost no compute
            (:mod:`specadapt.engine.packing`); ``False`` pads every row to the widest.

    Raises:
        ValueError: ``num_draft_tokens < 0``, an unknown verification rule or implementation, a ``speculation``
            value outside auto / on / off or disagreeing with ``adaptive.speculation``, ``adaptive`` with a rule it
            does not apply to.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: Draft,
        sampling: SamplingParams,
        num_draft_tokens: int,
        verify: str = DEFAULT_RULE,
        seed: int = 0,
        verify_impl: str = "auto",
        num_paths: int = 1,
        adaptive=None,
        tts=None,
        ignore_eos: bool = False,
        packed_forward: bool = True,
        speculation: str = "auto",
    ) -> None:
        if speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {speculation!r}")
        if adaptive is not None and speculation != "off" and adaptive.speculation != speculation:
            raise ValueError(f"speculation={speculation!r} disagrees with the adaptive verification's "
                             f"speculation={adaptive.speculation!r}")
        self.speculation = speculation
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        self.target = target
        self.draft = draft
        self.sampling = sampling
        self.num_draft_tokens = num_draft_tokens
        self.verify_name = verify
        self.rule = get_rule(verify, "verify")  # the registry entry (verification/rules.py)
        if not self.rule.multi_path:
            if num_paths != 1:
                multi = " or ".join(f"verify={name!r}" for name in rule_names(multi_path=True))
                raise ValueError(f"num_paths > 1 needs {multi}, got verify={verify!r}")
        else:
            if num_paths < 1:
                raise ValueError(f"num_paths must be >= 1, got {num_paths}")
            if num_draft_tokens < 1:
                raise ValueError(f"verify={verify!r} needs num_draft_tokens >= 1")
            if not draft.supports_paths:
                raise ValueError(
                    f"verify={verify!r} needs a draft that samples its paths (self:N or a model), not {draft.name!r}"
                )
        if adaptive is not None and not self.rule.adaptive:
            raise ValueError(f"adaptive: adaptive verification does not apply to verify={verify!r}")
        self.num_paths = num_paths
        self.adaptive = adaptive
        self.draft.wants_confidence = adaptive is not None  # a greedy model draft then gives its own features
        # early stop of drafting (exact: the same caps as drafting everything) for model drafts
        self._draft_filter = adaptive.draft_caps if adaptive is not None and adaptive.early_stop else None
        self.tts = tts  # an engine.tts_bridge.EngineTTS or None
        if verify_impl not in kernels.IMPLEMENTATIONS:
            raise ValueError(f"verify_impl must be one of {kernels.IMPLEMENTATIONS}, got {verify_impl!r}")
        self.verify_impl = verify_impl
        self.seed = int(seed)
        self._model_eos_ids = target.eos_token_ids()
        self.eos_ids = set() if ignore_eos else self._model_eos_ids
        self._hidden_kwargs = {"output_hidden_states": True} if draft.needs_target_hidden else {}
        self.vocab_size = target.vocab_size
        self.packed_forward = packed_forward
        for params in (sampling, getattr(draft, "sampling", None)):
            if params is not None and params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:
                raise ValueError(f"logit_bias: token id {params.logit_bias[-1][0]} is outside the target's "
                                 f"vocabulary of {self.vocab_size} tokens")
        draft_sampling = getattr(draft, "sampling", None)
        #: keep per-request token counts (the penalties' histories) when the target's or the draft's transform
        #: depends on them
        self._track_history = sampling.history_dependent or bool(draft_sampling and draft_sampling.history_dependent)
        self._counts: TokenCounts | None = None
        self._speculate: torch.Tensor | None = None  # [B] bool of the round, None when every row speculates
        self._round_limit: int | None = None  # adaptive verification's draft limit of the round (0: off, probe)
        self._target_params = sampling  # the round's target settings: one SamplingParams or one per row
        self._cuda_device = _cuda_device_of(target)  # where join waits for its prefill (None: the CPU)
        #: prefill / decode wall time and tokens of every batch so far (:class:`PhaseTimes`)
        self.phase_times = PhaseTimes()
        self.close_batch()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        batch_size: int = 1,
        on_tokens: Callable[[int], None] | None = None,
        seeds: list[int] | None = None,
        forced: list[list[int]] | None = None,
    ) -> list[RequestResult]:
        """Decode every prompt, ``batch_size`` requests at a time.

        Args:
            prompts: token id lists (already chat-templated), each at least one token long.
            max_new_tokens: a limit for all requests or one per request.
            batch_size: requests decoded together (a batch runs until its last request finishes).
            on_tokens: called with the number of tokens emitted after every round (progress bars).
            forced: target-only runs (:class:`NoDraft`) only: emit these tokens (one list per prompt) instead of the
                sampled ones, each request ending after its list. Every round still runs and pays the target
                step, the sampling transform and verification, so this times target-only decoding of exactly the
                text another run produced (paired baselines, scripts/speedup_study.py).
            seeds: one seed per prompt (default: the engine's ``seed`` for all); a request's output depends on
                its seed and prompt only.

        Returns:
            One :class:`RequestResult` per prompt, in order.

        Raises:
            ValueError: empty prompt, batch size < 1, negative max_new_tokens.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ValueError("max_new_tokens must be an int or one value per prompt")
        if forced is not None:
            if not isinstance(self.draft, NoDraft) or len(forced) != len(prompts):
                raise ValueError("forced needs a target-only engine (NoDraft) and one token list per prompt")
            limits = [len(f) for f in forced]
        seeds = [self.seed] * len(prompts) if seeds is None else [int(s) for s in seeds]
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds must hold one seed per prompt ({len(prompts)}), got {len(seeds)}")
        for i, (p, m) in enumerate(zip(prompts, limits)):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if m < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {m}")
        results = [RequestResult(index=i, prompt_tokens=len(p)) for i, p in enumerate(prompts)]
        for start in range(0, len(prompts), batch_size):
            idx = list(range(start, min(start + batch_size, len(prompts))))
            self.open_batch()
            self.join([Request(prompts[i], limits[i], seeds[i], forced=None if forced is None else forced[i],
                               result=results[i]) for i in idx])
            while self._rows:
                events = self.step()
                if on_tokens is not None:
                    on_tokens(sum(len(tokens) for _, tokens, _ in events))
            self.close_batch()
        return results

    # ---- continuous batching: a running batch that requests join and leave between rounds ----------------------
    def open_batch(self) -> None:
        """Begin an empty running batch: requests enter with :meth:`join`, each :meth:`step` runs one round for
        all of them, finished ones leave at once (their cache slots are reused), :meth:`cancel` drops others."""
        self.close_batch()

    def close_batch(self) -> None:
        """Drop the running batch and its caches (the requests still in it are left unfinished)."""
        self._kv = None
        self._rows = []
        self._row_seeds = torch.zeros(0, dtype=torch.int64)
        self._counts = None

    def reset_phase_times(self) -> PhaseTimes:
        """Start :attr:`phase_times` afresh; returns the figures accumulated until now."""
        previous, self.phase_times = self.phase_times, PhaseTimes()
        return previous

    @property
    def num_active(self) -> int:
        """Requests in the running batch."""
        return len(self._rows)

    @property
    def cache(self):
        """The target's KV cache of the running batch (``None`` before the first :meth:`join`)."""
        return self._kv

    @property
    def history_dependent(self) -> bool:
        """The target's or the draft's sampling transform reads per-request token histories (penalties)."""
        return self._track_history

    def _check_request(self, req: "Request") -> None:
        if len(req.prompt) == 0:
            raise ValueError("prompt is empty")
        if req.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {req.max_new_tokens}")
        context = self.target.context_length
        if context and len(req.prompt) + req.max_new_tokens > context:
            raise ValueError(f"max_new_tokens: a prompt of {len(req.prompt)} tokens and {req.max_new_tokens} new "
                             f"tokens exceed the model's context of {context} positions")
        if req.forced is not None and not isinstance(self.draft, NoDraft):
            raise ValueError("forced needs a target-only engine (NoDraft)")
        if req.sampling is not None:
            mine = self.sampling
            if (req.sampling.history_dependent or mine.history_dependent or req.sampling.logit_bias
                    or mine.logit_bias) and (
                    req.sampling.repetition_penalty, req.sampling.frequency_penalty, req.sampling.presence_penalty,
                    req.sampling.logit_bias) != (mine.repetition_penalty, mine.frequency_penalty,
                                                 mine.presence_penalty, mine.logit_bias):
                raise ValueError("sampling: per-request penalties / logit bias must equal the engine's")
            if req.sampling.logit_bias and req.sampling.logit_bias[-1][0] >= self.vocab_size:
                raise ValueError(f"logit_bias: token id {req.sampling.logit_bias[-1][0]} is outside the "
                                 f"vocabulary of {self.vocab_size} tokens")

    def join(self, requests: list["Request"]) -> None:
        """Add requests to the running batch (between rounds; :meth:`open_batch` first).

        The new requests' prompts are prefilled in one ragged forward (the running rows take no tokens in it);
        each request's output depends only on its prompt, seed and settings, not on when it joined or what else
        runs (coins of :mod:`specadapt.engine.coins`). Requests with ``max_new_tokens = 0`` finish at once.

        Raises:
            ValueError: an empty prompt, a negative ``max_new_tokens``, per-request penalties that differ from the
                engine's, ``forced`` on an engine with a draft.
        """
        for req in requests:
            self._check_request(req)
        now = time.perf_counter()
        new = []
        for req in requests:
            if req.result is None:
                req.result = RequestResult(index=0, prompt_tokens=len(req.prompt))
            req.result.prompt_tokens = len(req.prompt)
            if req.max_new_tokens == 0:
                req.result.seconds = 0.0
                req.result.finish_reason = "length"
                continue
            new.append(_Row(req, list(req.prompt), now))
        if not new:
            return
        histories = [row.history for row in new]
        capacity = self.context_capacity([len(h) for h in histories], [row.request.max_new_tokens for row in new])
        first = self._kv is None
        old = len(self._rows)
        if first:
            self._kv = self.target.new_cache(len(new), capacity=capacity, packed=self.packed_forward,
                                             capture=getattr(self.draft, "feature_layers", None))
            self.draft.context_capacity = capacity
        else:
            self._kv.add_rows(len(new))
        prefix = [[] for _ in range(old)] + [h[:-1] for h in histories]
        features = None
        if max(len(p) for p in prefix) > 0:
            ids, counts = pad_token_lists(prefix)
            # the new rows' hidden states only (the running rows take no tokens): at batch 32 unpacking every
            # row's [width, h] per captured layer was most of a join's cost over target-only
            out = self._kv.forward(ids, counts, logits_to_keep=1, return_outputs=True, hidden_from_row=old,
                                   **self._hidden_kwargs)
            if self.draft.needs_target_hidden:
                features = self.draft.target_features(out.hidden_states)
        seeds = torch.tensor([row.request.seed for row in new], dtype=torch.int64)
        self._row_seeds = torch.cat([self._row_seeds, seeds])
        if self._track_history:
            counts_new = TokenCounts.from_sequences(histories, [len(h) for h in histories], self.vocab_size)
            self._counts = counts_new if self._counts is None else TokenCounts(
                torch.cat([self._counts.generated, counts_new.generated]),
                torch.cat([self._counts.prompt, counts_new.prompt]))
        self._rows += new
        if first:
            if self.tts is not None:
                self.tts.start_batch(len(new))  # fresh per-request adapters before the draft's prefill
            self.draft.row_seeds = self._row_seeds.clone()
            self.draft.start(histories)
            if self.draft.needs_target_hidden:
                if features is None:
                    features = self.draft.target_features(self._empty_hidden(len(new)))
                self.draft.observe_target(features)
        else:
            if self.tts is not None:
                self.tts.join(len(new))
            self.draft.row_seeds = self._row_seeds.clone()
            self.draft.join(histories, features)
        if self._cuda_device is not None:  # the prefill's kernels are queued: count them here, not in the round
            torch.cuda.current_stream(self._cuda_device).synchronize()
        times = self.phase_times
        times.prefill_seconds += time.perf_counter() - now
        times.prefill_tokens += sum(len(h) for h in histories)
        times.prefills += 1

    def cancel(self, requests: list["Request"]) -> None:
        """Drop these requests from the running batch (their result keeps the tokens emitted so far,
        ``finish_reason = "cancelled"``); requests not in the batch are ignored."""
        gone = {id(r) for r in requests}
        keep = [i for i, row in enumerate(self._rows) if id(row.request) not in gone]
        for row in self._rows:
            if id(row.request) in gone:
                row.request.result.finish_reason = "cancelled"
                row.request.result.seconds = time.perf_counter() - row.start
        self._keep_rows(keep)

    def _keep_rows(self, keep: list[int]) -> None:
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        rows = torch.tensor(keep, dtype=torch.int64)
        self._kv.select(rows)
        self.draft.select(rows)
        self._row_seeds = self._row_seeds.index_select(0, rows)
        if self._counts is not None:
            self._counts = self._counts.index_select(rows)
        if self.tts is not None:
            self.tts.select(rows)

    def _row_params(self, default: SamplingParams):
        """``default`` when no running request has its own settings, else one SamplingParams per row."""
        if all(row.request.sampling is None for row in self._rows):
            return default
        return [row.request.sampling or default for row in self._rows]

    def step(self) -> list[tuple["Request", list[int], bool]]:
        """Run one speculation round for every request of the running batch.

        Returns:
            ``(request, emitted token ids, finished)`` per request of the batch, in batch order; finished requests
            (EOS, a stop token, ``max_new_tokens``) have left the batch when this returns.
        """
        if not self._rows:
            return []
        step_start = time.perf_counter()
        kv = self._kv
        histories = [row.history for row in self._rows]
        remaining = torch.tensor([row.request.max_new_tokens - len(row.request.result.output_ids)
                                  for row in self._rows], dtype=torch.int64)
        round_start = time.perf_counter()
        self._speculate = None
        wants = [row.request.speculate for row in self._rows]
        if self.speculation == "off":
            wants = [False] * len(wants)
        self._round_limit = self.adaptive.round_draft_limit() if self.adaptive is not None else None
        self._target_params = self._row_params(self.sampling)
        draft_default = getattr(self.draft, "sampling", None)
        self.draft.row_sampling = (None if draft_default is None or isinstance(self._target_params, SamplingParams)
                                   else self._row_params(draft_default))
        plain = self._round_limit == 0 or not any(wants)
        if plain and (self.adaptive is None or self._round_limit == 0):
            # speculation off for the whole batch: straight to the plain step (what the general round would reach
            # with every row's draft limit 0), without building limits to find that out -- it runs every round
            # speculation is off, where each tensor operation is overhead over target-only decoding
            accept_len, output_tokens, n_draft = self._plain_round(kv, histories)
        else:
            if not all(wants):
                self._speculate = torch.tensor(wants, dtype=torch.bool)
            if self.rule.multi_path and not plain and int(remaining.max()) > 1:
                accept_len, output_tokens, n_draft = self._gbv_round(kv, histories, remaining)
            else:
                accept_len, output_tokens, n_draft = self._single_path_round(kv, histories, remaining)
        # the host reads this round's tokens just below (a sync on CUDA anyway): read the verification kernels'
        # device error flags with it (nothing to read on CPU, whose kernels raise directly)
        kernels.check_device_errors()
        keep, events, emitted_rows = [], [], []
        now = time.perf_counter()
        for row_index, row in enumerate(self._rows):
            req, res = row.request, row.request.result
            tau = int(accept_len[row_index])
            # keep at most the remaining tokens (a round drafts at most remaining - 1, so this only guards; a prefix
            # of an exactly distributed sequence is exactly distributed).
            emitted = output_tokens[row_index, : tau + 1].tolist()[: int(remaining[row_index])]
            if req.forced is not None:  # teacher forcing of another run's text (paired timing)
                done_so_far = len(res.output_ids)
                emitted = req.forced[done_so_far : done_so_far + len(emitted)]
            done = False
            eos = self.eos_ids if req.ignore_eos is None else (set() if req.ignore_eos else self._model_eos_ids)
            for j, tok in enumerate(emitted):
                if tok in eos or tok in req.stop_token_ids:
                    emitted = emitted[: j + 1]
                    res.finished_by_eos = tok in eos
                    res.finish_reason = "stop"
                    done = True
                    break
            res.rounds.append(RoundRecord(len(res.output_ids), int(n_draft[row_index]), tau, len(emitted)))
            res.output_ids.extend(emitted)
            row.history.extend(emitted)
            emitted_rows.append(emitted)
            if len(res.output_ids) >= req.max_new_tokens and not done:
                done = True
                res.finish_reason = "length"
            if done:
                res.seconds = now - row.start
            else:
                keep.append(row_index)
            events.append((req, emitted, done))
        if self._counts is not None:
            self._counts.append_(emitted_rows)
        if self.adaptive is not None:
            self.adaptive.record_round_time((time.perf_counter() - round_start) * 1e3)
            ranked = self.adaptive.budget_rows  # None after a round off (no ranking: the flags stay)
            if ranked is not None and ranked.shape[0] == len(self._rows):
                for row, flag in zip(self._rows, ranked.tolist()):
                    row.catch_up = flag
        self._keep_rows(keep)
        if not self._rows and self._kv is not None and not self._kv.add_rows_reuses_slots:
            self.close_batch()  # a transformers cache of 0 rows cannot take new rows' chunks: start afresh
        times = self.phase_times
        times.decode_seconds += time.perf_counter() - step_start
        times.decode_tokens += sum(len(e) for e in emitted_rows)
        times.decode_rounds += 1
        return events

    def _coins(self, histories: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification coins of a round from each request's own stream: ``uniforms [B, width]`` (slot i's coin
        does not depend on ``width``, the batch's widest proposal) and ``uniforms_final [B]``, float64."""
        counters = torch.tensor([len(h) for h in histories], dtype=torch.int64)
        uniforms = request_coins(self._row_seeds, counters, coins.ACCEPT, width)
        return uniforms, request_coins(self._row_seeds, counters, coins.FINAL, 1)[:, 0]

    def _needs_target_history(self) -> bool:
        return self._counts is not None and self.sampling.history_dependent

    def context_capacity(self, prompt_lengths: list[int], limits: list[int]) -> int:
        """Cache positions a request of this batch can need: prompt, output and one round's speculative entries
        (a GBV tree holds up to K * L + 1 nodes)."""
        spare = self.num_paths * self.num_draft_tokens + 2
        return max(p + m for p, m in zip(prompt_lengths, limits)) + spare

    def _empty_hidden(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Zero-length ``hidden_states`` (prompts of one token have no prefill)."""
        config = self.target.model.config
        param = next(self.target.model.parameters())
        empty = torch.zeros(batch, 0, int(config.hidden_size), dtype=param.dtype, device=param.device)
        return tuple(empty for _ in range(int(config.num_hidden_layers) + 1))

    def _single_path_round(self, kv, histories: list[list[int]], remaining: torch.Tensor):
        """One chain / block round. Returns ``(accept_len [B] int64, output_tokens [B, L+1], n_draft [B])``."""
        max_drafts = torch.clamp(remaining - 1, min=0, max=self.num_draft_tokens)
        if self._speculate is not None:  # requests with speculation off verify no drafts (plain decode rows)
            max_drafts = torch.where(self._speculate, max_drafts, torch.zeros_like(max_drafts))
        if self._round_limit is not None:  # adaptive verification: speculation off (0) or a probe round
            max_drafts = torch.clamp(max_drafts, max=self._round_limit)
        if (self.adaptive is None or self._round_limit == 0) and not bool(max_drafts.any()):
            return self._plain_round(kv, histories)
        self.draft.history_counts = self._counts
        self.draft.probe_window = self._probe_window()
        proposal = self.draft.propose(histories, max_drafts, self.vocab_size, draft_filter=self._draft_filter)
        n_draft = proposal.num_tokens
        if self.adaptive is not None:
            confidence = getattr(proposal, "confidence", None)  # a deterministic draft's own feature
            n_draft, features, predictions = (
                self.adaptive.plan(proposal.probs, n_draft) if confidence is None
                else self.adaptive.plan_features(confidence[:, :proposal.tokens.shape[1]], n_draft))
        batch, width = proposal.tokens.shape
        proposed, drafted = width, max(n_draft.tolist(), default=0)
        if drafted < width:  # trailing columns no row verifies (an n-gram miss, a pruned budget): a narrower
            # verify chunk, dense when no row drafts; each slot's coin does not depend on the width
            proposal.tokens, proposal.probs, width = proposal.tokens[:, :drafted], proposal.probs[:, :drafted], drafted
            if getattr(proposal, "confidence", None) is not None:
                proposal.confidence = proposal.confidence[:, :drafted]
        last = torch.tensor([h[-1] for h in histories], dtype=torch.int64)
        candidates = torch.cat([last[:, None], proposal.tokens], dim=1)  # [B, width+1]
        out = kv.forward(candidates, n_draft + 1, return_outputs=True, **self._hidden_kwargs)
        logits = out.logits
        if self.draft.needs_target_hidden:
            self.draft.observe_target(self.draft.target_features(out.hidden_states))
        # slot i conditions on the committed tokens and drafts[:i]
        history = self._counts.chain(proposal.tokens, n_draft) if self._needs_target_history() else None
        target_probs = _real_row_probs(logits, n_draft + 1, self._target_params, history)
        uniforms, uniforms_final = self._coins(histories, width)
        out = kernels.verify(
            self.rule.plain_rule,  # a multi-path rule's round without a tree runs its single-path plain rule
            candidates,
            target_probs,
            proposal.probs,
            uniforms,
            uniforms_final,
            num_draft_tokens=n_draft,
            impl=self.verify_impl,
        )
        accept_len = out.accept_len.to(torch.int64)
        if width:  # a plain round (no drafts) wrote only committed entries: nothing to roll back
            kv.truncate(kv.lengths.cpu() - (n_draft - accept_len))
        self.draft.commit(accept_len)
        if self.adaptive is not None:
            self.adaptive.observe(features, predictions, accept_len, n_draft)
        if self.tts is not None and proposed > 0:  # (the round counts for TTS's stride even if all was pruned)
            self.tts.end_round(histories, proposal.tokens, n_draft, accept_len, target_probs, proposal.probs)
        return accept_len, out.output_tokens, n_draft

    def _probe_window(self) -> int | None:
        """:attr:`Draft.probe_window` of this round, also setting :attr:`Draft.catch_up_rows`: adaptive
        verification's scratch window for this batch (:meth:`AdaptiveVerification.scratch_window`) on a probe
        round (a draft limit above 0 while speculation is off, or the opening probe; no row catches up beyond it)
        and, with ``catch_up = "budget"``, on a speculative round,
        where the requests the previous round's budget ranked in feed their whole deferred queue and the window is
        at least ``L + 1`` (one round's pairs: only a backlog from rounds off is windowed); else ``None`` (also with
        Test-Time Speculation, which trains on the fed context, and without pruning, e.g. ``--log-drafts`` at fixed
        L, where no budget ranks requests in)."""
        self.draft.catch_up_rows = None
        if self.adaptive is None or self._round_limit == 0:
            return None
        config, adaptive = self.adaptive.config, self.adaptive
        window = adaptive.scratch_window(len(self._rows))
        if self._round_limit is None:
            if (config.catch_up != "budget" or adaptive.speculation != "auto" or not adaptive.prune
                    or self.tts is not None or window is None):
                return None
            self.draft.catch_up_rows = torch.tensor([row.catch_up for row in self._rows], dtype=torch.bool)
            # a row that drafted last round holds at most L + 1 pending pairs: it stays caught up whatever its rank
            window = max(window, self.num_draft_tokens + 1)
        return window

    def _plain_round(self, kv, histories: list[list[int]]):
        """A round in which no request drafts (target-only decoding, speculation off for the whole batch): one
        target step, sampled with the same coins as a round of zero drafts, and only the bookkeeping such a round
        needs (the draft keeps the features its catch-up will read, adaptive verification counts the round).
        It runs every round that speculation is off, so it does as little as it can: at batch 1 on 2 cores the
        general path's empty proposal and commit made a `--speculation off` round 0.22-0.25 ms (about 6%) slower
        than a target-only one, this path 0.08-0.10 ms (timed in lock-step). Returns like
        :meth:`_single_path_round`."""
        batch = len(histories)
        if self.adaptive is not None:
            self.adaptive.plain_round(batch)
        zeros = torch.zeros(batch, dtype=torch.int64)
        last = torch.tensor([h[-1] for h in histories], dtype=torch.int64)[:, None]  # [B, 1]
        out = kv.forward(last, zeros + 1, return_outputs=True, **self._hidden_kwargs)
        features = self.draft.target_features(out.hidden_states) if self.draft.needs_target_hidden else None
        history = self._counts.chain(last[:, :0], zeros) if self._needs_target_history() else None
        target_probs = _real_row_probs(out.logits, zeros + 1, self._target_params, history)
        uniforms, uniforms_final = self._coins(histories, 0)
        verified = kernels.verify(self.rule.plain_rule, last, target_probs,
                                  torch.zeros(batch, 0, self.vocab_size, dtype=torch.float32), uniforms,
                                  uniforms_final, num_draft_tokens=zeros, impl=self.verify_impl)
        self.draft.history_counts = self._counts
        self.draft.plain_round(histories, self.vocab_size, features)
        return verified.accept_len.to(torch.int64), verified.output_tokens, zeros

    def _gbv_round(self, kv, histories: list[list[int]], remaining: torch.Tensor):
        """One round of a multi-path rule (GBV): K sampled paths, merged into a token tree scored by ONE target
        forward with a tree attention mask; the rule picks a path and verifies it; both caches keep only that path.

        ``remaining [B] int64``: tokens each request may still emit (at least 2 for one row). A request drafts
        and verifies at most ``remaining - 1`` drafts (its room), the tree is no deeper than the deepest room, and
        the positions of a request's nodes past its room are clamped to its room (the target computes them but
        verification never reads them), so no forward runs past a context window that ``prompt +
        max_new_tokens`` fills exactly. The room depends on committed tokens only: GBV on the capped prefixes
        stays exact."""
        K, L = self.num_paths, self.num_draft_tokens
        if self._round_limit is not None:  # an adaptive verification probe round
            L = min(L, self._round_limit)
        room = torch.clamp(remaining.to(torch.int64) - 1, min=0, max=L)  # [B]
        L = int(room.max())
        self.draft.history_counts = self._counts
        self.draft.probe_window = self._probe_window()
        short = bool((room < L).any())
        tokens, q = self.draft.propose_paths(histories, L, self.vocab_size, K,
                                             depths=room if short else None)  # [B,K,L], [B,K,L,V]
        batch = len(histories)
        caps, plan = self._gbv_caps(q, L)
        if short:
            caps = room if caps is None else torch.minimum(caps, room)
        if caps is not None and int(caps.max()) < L:  # no request verifies deeper: score a shallower tree
            L = max(int(caps.max()), 1)
            tokens, q = tokens[:, :, :L].contiguous(), q[:, :, :L].contiguous()
        tree = build_token_tree(tokens)
        last = torch.tensor([h[-1] for h in histories], dtype=torch.int64)
        ids = tree.node_tokens.clone()
        ids[:, 0] = last
        positions = torch.minimum(tree.depth, room[:, None]) if short else tree.depth
        target_out = kv.forward(
            ids,
            tree.num_nodes,
            chunk_mask=tree.ancestor_mask,
            chunk_positions=positions,
            return_outputs=True,
            **self._hidden_kwargs,
        )
        # a node conditions on the committed tokens and the path from the root to it (itself included)
        history = (self._counts.extend(tree.node_tokens[:, 1:], tree.ancestor_mask[:, :, 1:])
                   if self._needs_target_history() else None)
        node_probs = logits_to_probs_rows(target_out.logits, self._target_params, history).cpu()  # [B, n, V]
        rows = torch.arange(batch)[:, None, None]
        target_probs = node_probs[rows, tree.path_slots]  # [B, K, L+1, V]
        candidates = torch.cat([last[:, None, None].expand(batch, K, 1), tokens], dim=2)
        uniforms, uniforms_final = self._coins(histories, L)
        if caps is None:
            out = kernels.verify_paths(self.verify_name, candidates, target_probs, q, uniforms, uniforms_final,
                                       impl=self.verify_impl)
        else:
            out = kernels.verify_paths_capped(self.verify_name, candidates, target_probs, q, uniforms, uniforms_final,
                                              caps, impl=self.verify_impl)
        accept_len = out.accept_len.to(torch.int64)
        n_draft = torch.full((batch,), L, dtype=torch.int64) if caps is None else caps.clamp(max=L)
        if plan is not None:
            self.adaptive.observe(plan[0], plan[1], accept_len, n_draft)
        chosen = out.chosen_path.to(torch.int64)
        keep = torch.zeros_like(tree.ancestor_mask[:, 0])
        path = tree.path_slots[torch.arange(batch), chosen]  # [B, L+1]
        depth_ok = torch.arange(L + 1)[None, :] <= accept_len[:, None]
        keep[torch.arange(batch)[:, None].expand(-1, L + 1)[depth_ok], path[depth_ok]] = True
        kv.keep_last_chunk(keep)
        if self.draft.needs_target_hidden:
            node_features = self.draft.target_features(target_out.hidden_states)  # [B, n, F]
            self.draft.observe_target(node_features[torch.arange(batch)[:, None], path.to(node_features.device)])
        self.draft.select_path(chosen)
        self.draft.commit(accept_len)
        if self.tts is not None:
            b = torch.arange(batch)
            self.tts.end_round(histories, tokens[b, chosen], n_draft, accept_len, target_probs[b, chosen], q[b, chosen])
        return accept_len, out.output_tokens, n_draft

    def _gbv_caps(self, q: torch.Tensor, depth: int):
        """Per-request caps of a GBV round: ``(caps [B] int64 or None, (features, predictions) or None)``.

        With adaptive verification every path of request ``b`` verifies its first ``caps[b]`` drafts, chosen by
        the budget from survivals whose feature is position 1's q row (identical on every path: it depends on
        the committed context only) carried to every depth, so the caps never depend on a drafted token and GBV
        on the capped prefixes stays exact. Requests with speculation off get cap 0 (a plain target step)."""
        batch = q.shape[0]
        caps = plan = None
        if self.adaptive is not None:
            first = feature_from_probs(q[:, 0, :1])  # [B, 1]
            features = first.expand(batch, depth).contiguous()
            caps, features, predictions = self.adaptive.plan_features(
                features, torch.full((batch,), depth, dtype=torch.int64))
            plan = (features, predictions)
        if self._speculate is not None:
            full = caps if caps is not None else torch.full((batch,), depth, dtype=torch.int64)
            caps = torch.where(self._speculate, full, torch.zeros_like(full))
        return caps, plan


@dataclass
class TokenTree:
    """K draft paths per request merged into a token tree (shared prefixes become one node).

    Attributes:
        node_tokens: ``[B, n] int64``; slot 0 is the root (the last committed token, filled by the caller),
            then the nodes in depth order; padding slots hold 0.
        num_nodes: ``[B] int64`` valid slots (root included).
        depth: ``[B, n] int64`` depth of each slot (root 0), the position offset of its token.
        ancestor_mask: ``[B, n, n] bool``, slot i may attend to slot j iff j is i or one of its ancestors.
        path_slots: ``[B, K, L+1] int64``, slot of path k's prefix of length d (d = 0 is the root).
    """

    node_tokens: torch.Tensor
    num_nodes: torch.Tensor
    depth: torch.Tensor
    ancestor_mask: torch.Tensor
    path_slots: torch.Tensor


def _cuda_device_of(target: LoadedModel) -> torch.device | None:
    """The CUDA device the target's forward runs on, or ``None`` (CPU, or no parameters to tell)."""
    device = getattr(getattr(target, "native", None), "device", None)
    if device is None:
        try:
            device = next(target.model.parameters()).device
        except (AttributeError, StopIteration, TypeError):
            return None
    device = torch.device(device)
    return device if device.type == "cuda" else None


def _real_row_probs(logits: torch.Tensor, num_real: torch.Tensor, sampling: SamplingParams,
                    history: TokenCounts | None = None) -> torch.Tensor:
    """Target probabilities ``[B, n, V] float32`` (CPU) of a ragged verify chunk: the sampling transform (top-p
    sorts every row) runs on the ``num_real[r]`` real rows of each request only; hole rows, which verification
    never reads, are uniform. ``history``: the rows' ``TokenCounts`` (``[B, n, V]``, slot i = committed tokens
    + drafts[:i]) for history-dependent processors, else ``None``."""
    batch, width, vocab = logits.shape
    if all(n == width for n in num_real.tolist()):  # (a Python test: this runs every round)
        return logits_to_probs_rows(logits, sampling, history).cpu()
    real = torch.arange(width, device=logits.device)[None, :] < num_real.to(logits.device)[:, None]
    probs = torch.full((batch, width, vocab), 1.0 / vocab, dtype=torch.float32)
    real_cpu = real.cpu()
    if not isinstance(sampling, SamplingParams):  # per-row settings: one per real entry
        sampling = [sampling[b] for b in real_cpu.nonzero()[:, 0].tolist()]
    probs[real_cpu] = logits_to_probs_rows(logits[real], sampling,
                                           None if history is None else history[real_cpu]).cpu()
    return probs


def build_token_tree(tokens: torch.Tensor) -> TokenTree:
    """Merge ``tokens [B, K, L]`` (K paths per request) into a :class:`TokenTree`."""
    batch, num_paths, num_drafts = tokens.shape
    per_request = []
    for b in range(batch):
        slot_of: dict[tuple, int] = {(): 0}
        keys: list[tuple] = [()]
        paths = tokens[b].tolist()
        for d in range(num_drafts):
            for k in range(num_paths):
                key = tuple(paths[k][: d + 1])
                if key not in slot_of:
                    slot_of[key] = len(keys)
                    keys.append(key)
        slots = [[slot_of[tuple(paths[k][:d])] for d in range(num_drafts + 1)] for k in range(num_paths)]
        per_request.append((keys, slot_of, slots))
    width = max(len(keys) for keys, _, _ in per_request)
    node_tokens = torch.zeros(batch, width, dtype=torch.int64)
    depth = torch.zeros(batch, width, dtype=torch.int64)
    mask = torch.zeros(batch, width, width, dtype=torch.bool)
    num_nodes = torch.zeros(batch, dtype=torch.int64)
    path_slots = torch.zeros(batch, num_paths, num_drafts + 1, dtype=torch.int64)
    for b, (keys, slot_of, slots) in enumerate(per_request):
        num_nodes[b] = len(keys)
        for i, key in enumerate(keys):
            node_tokens[b, i] = key[-1] if key else 0
            depth[b, i] = len(key)
            for j in range(len(key) + 1):
                mask[b, i, slot_of[key[:j]]] = True
        path_slots[b] = torch.tensor(slots)
    return TokenTree(node_tokens, num_nodes, depth, mask, path_slots)
