"""Draft proposers for the embedded engine.

- :class:`NoDraft`: proposes nothing; the speculative loop then is plain target-only decoding (the baseline).
- :class:`NgramDraft`: prompt-lookup decoding (Saxena 2023; ``prompt_lookup_num_tokens`` in transformers,
  ``ngram`` in vLLM and SGLang): find the latest earlier occurrence of the last ``n`` tokens of prompt + output
  (``n`` from ``max_ngram`` down to ``min_ngram``) and propose what followed it. ``q`` is one-hot.
- :class:`ModelDraft`: an autoregressive draft LM with its own :class:`RaggedKVCache`: a layer-truncated copy of
  the target (``self:N``) or a standalone Hugging Face model sharing the target's tokenizer.

Every draft samples its tokens from exactly the ``q`` rows it returns (the same sampling transform as the target,
logit processors included: draft ``i + 1`` is sampled with the penalties of the committed tokens plus
``drafts[:i]``), which is what makes verification lossless.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..sampling import SamplingParams, logits_to_probs_rows, sample_from_probs
from . import coins as coins_mod
from .coins import request_coins
from .kv import RaggedKVCache
from .models import LoadedModel

logger = logging.getLogger(__name__)

__all__ = [
    "DraftProposal",
    "Draft",
    "NoDraft",
    "NgramDraft",
    "NgramIndex",
    "ModelDraft",
    "self_draft",
    "check_same_vocabulary",
    "VocabularyMismatchError",
    "empty_proposal",
    "pad_token_lists",
]


class VocabularyMismatchError(ValueError):
    """The draft's vocabulary differs from the target's: its q rows cannot be compared with p."""


@dataclass
class DraftProposal:
    """Draft tokens of one round.

    Attributes:
        tokens: ``[B, L] int64`` drafted ids (entries past ``num_tokens`` are padding, 0).
        probs: ``[B, L, V] float32`` the rows ``q(. | X^i)`` each token was sampled from.
        num_tokens: ``[B] int64`` how many drafts each request proposes (``<= L``).
        confidence: ``[B, L] float32`` or ``None``: the acceptance estimator's feature of each draft where the
            draft knows more than its q rows say: deterministic drafts (``ngram``, ``suffix``), whose one-hot q
            gives every draft the same ``logit(q_max)`` and so tells the estimator nothing. ``None``: the
            estimator uses ``logit(q_max)`` of ``probs``. It depends on the history only, never on the target's
            coins, so pruning on it keeps verification lossless.
    """

    tokens: torch.Tensor
    probs: torch.Tensor
    num_tokens: torch.Tensor
    confidence: torch.Tensor | None = None


class Draft:
    """Interface of a draft proposer over a batch of requests (one row per request)."""

    name = "draft"

    def start(self, histories: list[list[int]]) -> None:
        """Begin a batch; ``histories[r]`` is request ``r``'s prompt."""

    def propose(self, histories: list[list[int]], max_tokens: torch.Tensor, vocab_size: int,
                draft_filter=None) -> DraftProposal:
        """Propose up to ``max_tokens[r]`` tokens after ``histories[r]`` (the committed tokens).

        ``draft_filter``: optional early stop of drafting, ``(step, probs [B, step+1, V], num [B]) -> caps [B]
        int64`` (the engine passes ``AdaptiveVerification.draft_caps``); model drafts consult it after each
        position (:func:`apply_draft_filter`) and drafting ends when no row goes on; drafts without a model
        ignore it."""
        raise NotImplementedError

    def commit(self, accept_len: torch.Tensor) -> None:
        """Tell the draft how many of its proposals were accepted (``[B] int64``) so it can roll back."""

    needs_target_hidden = False

    #: Cache positions a request can need, set by the engine before :meth:`start` (native caches preallocate it).
    context_capacity = 256

    #: ``[B] int64`` per-request seeds of the rows, set by the engine at :meth:`start` and kept in step with
    #: :meth:`select`; a model draft samples with coins of :mod:`specadapt.engine.coins` keyed by them.
    row_seeds: torch.Tensor | None = None

    #: ``TokenCounts`` ``[B, V]`` of the committed tokens of each row (prompt and output), set by the engine before
    #: every :meth:`propose` / :meth:`propose_paths` when a sampling transform depends on the history (penalties),
    #: else ``None``. A model draft extends it with its own drafts, so draft ``i + 1`` is sampled with the history
    #: committed + ``drafts[:i]``, the history the target's verify row ``i`` sees.
    history_counts = None

    #: Set by the engine before every :meth:`propose` / :meth:`propose_paths`: on an adaptive verification probe
    #: round (speculation off, one round testing whether it pays again) the most deferred context a row's draft
    #: may catch up for this round, else ``None``. A draft whose catch-up was deferred (the EAGLE head) then
    #: drafts from a scratch context of the row's newest ``probe_window`` pairs at their true positions, rolled
    #: back at :meth:`commit`: the deferred pairs stay queued and are fed exactly when drafting resumes, so a
    #: probe no longer pays a catch-up that grows with the rounds it waited. Drafts that defer nothing ignore it.
    #: With adaptive verification's ``catch_up = "budget"`` it is also set on speculative rounds, with
    #: :attr:`catch_up_rows` naming the rows that feed their whole queue.
    probe_window: int | None = None

    #: Set by the engine: adaptive verification reads each draft's estimator feature. A model draft whose q rows
    #: carry none (greedy rows are one-hot) then fills :attr:`DraftProposal.confidence`; without it it does not
    #: spend the work.
    wants_confidence: bool = False

    #: ``[B] bool`` or ``None``, set by the engine with :attr:`probe_window`: rows that feed their whole deferred
    #: queue this round although a window is set (the requests the budget ranked in; ``None``: no row). The
    #: other rows with more than ``probe_window`` deferred pairs draft from a scratch window.
    catch_up_rows = None

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Features this draft takes from the target's ``hidden_states`` (only when ``needs_target_hidden``)."""
        raise NotImplementedError

    def observe_target(self, features: torch.Tensor) -> None:
        """Receive the target features of the prefill (after :meth:`start`) or of a round's verified slots
        (before :meth:`commit`); only called when ``needs_target_hidden``."""

    def plain_round(self, histories: list[list[int]], vocab_size: int, features: torch.Tensor | None = None) -> None:
        """A round in which no request drafted: the target decoded one token per request (speculation off for
        the whole batch, or target-only decoding). Called after the target's forward, in place of
        :meth:`propose` / :meth:`observe_target` / :meth:`commit`.

        Args:
            histories: the committed tokens before this round's token (as :meth:`propose` gets them).
            vocab_size: the target's vocabulary.
            features: ``[B, 1, F]`` the round's target features when ``needs_target_hidden``, else ``None``.

        The default does what a round with a proposal of zero drafts does (propose nothing, observe, commit 0
        accepted); a draft overrides it where it can do less, as this runs every round speculation is off.
        """
        zeros = torch.zeros(len(histories), dtype=torch.int64)
        self.propose(histories, zeros, vocab_size)
        if features is not None:
            self.observe_target(features)
        self.commit(zeros)

    supports_paths = False

    def propose_paths(self, histories: list[list[int]], num_drafts: int, vocab_size: int, num_paths: int,
                      depths: torch.Tensor | None = None):
        """Propose ``num_paths`` i.i.d. paths of ``num_drafts`` tokens per request (for GBV).

        Args:
            depths: ``[B] int64`` or ``None``: request ``r`` needs only its first ``depths[r]`` drafts (its room
                before the end of its output / context window); a model draft takes no step past them, so its
                cache never writes a position past the window. Its positions past ``depths[r]`` hold token 0 and
                zero probabilities, which the caller must not verify. ``None``: every request needs ``num_drafts``.

        Returns:
            ``(tokens [B, K, L] int64, probs [B, K, L, V] float32)``.
        """
        raise NotImplementedError(f"draft {self.name!r} cannot propose multiple sampled paths")

    def select_path(self, chosen: torch.Tensor) -> None:
        """After :meth:`propose_paths`, keep the state of path ``chosen[r]`` for each request."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (requests that finished are dropped)."""

    def join(self, histories: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Continuous batching: append rows for new requests after :meth:`start` (between rounds).

        Args:
            histories: the new requests' prompts (token ids, each at least one token).
            features: with ``needs_target_hidden``, ``[n, P, F]`` target features of the new rows' prefill
                (positions ``0 .. len(prompt) - 2``, padded to the longest), else ``None``.

        A draft without per-row state needs nothing here (``row_seeds`` is extended by the engine).
        """

    def tts_student(self):
        """The :class:`~specadapt.engine.tts_students.EngineStudent` Test-Time Speculation trains for this draft,
        or ``None`` (the default: a draft without trainable layers, e.g. ``ngram`` or target-only)."""
        return None

    #: Per-request sampling settings of the rows (continuous batching with per-request parameters), set by the
    #: engine before every proposal, or ``None`` when every row uses :attr:`sampling`.
    row_sampling = None

    def sampling_for_rows(self, rows: int):
        """The sampling settings of ``rows`` rows of this draft's logits: ``self.sampling``, or one
        :class:`SamplingParams` per row (``rows`` = requests, or requests x paths laid out request-major)."""
        per_request = self.row_sampling
        if per_request is None:
            return self.sampling
        if rows == len(per_request):
            return per_request
        if not per_request or rows % len(per_request):
            raise ValueError(f"{rows} rows of logits do not lay out {len(per_request)} requests' settings")
        repeats = rows // len(per_request)
        return [p for p in per_request for _ in range(repeats)]


def path_step_counts(depths: torch.Tensor | None, batch: int, num_paths: int) -> torch.Tensor | None:
    """Drafts each path row needs, ``[B * K] int64`` laid out request-major (row ``b * K + k``), from
    :meth:`Draft.propose_paths`' ``depths [B]`` (``None`` stays ``None``).

    Raises:
        ValueError: ``depths`` is not ``[B]`` or holds a negative count.
    """
    if depths is None:
        return None
    depths = torch.as_tensor(depths, dtype=torch.int64).cpu()
    if depths.shape != (batch,) or bool((depths < 0).any()):
        raise ValueError(f"depths must be [{batch}] non-negative counts, got {tuple(depths.shape)}")
    return depths.repeat_interleave(num_paths)


def zero_hole_rows(tokens: torch.Tensor, probs: torch.Tensor, live: torch.Tensor | None):
    """A path step's draws with the rows that did not draft it (``live [R] bool`` False: past their depth, their
    logits came from a hole) set to token 0 and zero probabilities; ``live=None`` returns them unchanged.

    Args:
        tokens: ``[R] or [R, 1] int64`` drawn ids; probs: ``[R, V'] float32`` their rows' probabilities.
    Returns:
        ``(tokens, probs)`` of the same shapes.
    """
    if live is None:
        return tokens, probs
    mask = live.reshape(-1, *([1] * (tokens.dim() - 1)))
    return torch.where(mask, tokens, torch.zeros_like(tokens)), probs * live[:, None]


def apply_draft_filter(draft_filter, proposal: DraftProposal, step: int) -> bool:
    """Apply ``draft_filter`` after position ``step`` was drafted: ``num_tokens = min(num_tokens, caps)`` with
    ``caps [B] int64 = draft_filter(step, probs [B, step+1, V], num_tokens [B])``, with ``features=`` ``[B, step+1]``
    the proposal's ``confidence`` where the draft gives one (e.g.
    :meth:`specadapt.budget.adaptive.AdaptiveVerification.draft_caps`).

    Returns:
        ``True`` when some row still drafts position ``step + 1`` (always ``True`` without a filter).
    """
    if draft_filter is None:
        return True
    num = proposal.num_tokens
    if proposal.confidence is not None:  # the draft's own features (e.g. a greedy head's confidence)
        caps = draft_filter(step, proposal.probs[:, : step + 1], num, features=proposal.confidence[:, : step + 1])
    else:
        caps = draft_filter(step, proposal.probs[:, : step + 1], num)
    proposal.num_tokens = torch.minimum(num, caps.to(num.dtype))
    return bool((proposal.num_tokens > step + 1).any())


def trim_proposal(proposal: DraftProposal) -> None:
    """Drop trailing columns no row drafts (so the target's verify forward is no wider than needed)."""
    width = int(proposal.num_tokens.max()) if proposal.num_tokens.numel() else 0
    if width < proposal.tokens.shape[1]:
        proposal.tokens = proposal.tokens[:, :width]
        proposal.probs = proposal.probs[:, :width]
        if proposal.confidence is not None:
            proposal.confidence = proposal.confidence[:, :width]


def fill_deterministic_row(proposal: DraftProposal, row: int, tokens: list[int],
                           confidence: torch.Tensor | None = None) -> None:
    """Write a deterministic draft's ``tokens`` (at most ``L`` ids) into row ``row`` of ``proposal``: the ids, q
    one-hot on each, and (when ``proposal.confidence`` is a ``[B, L]`` tensor) the estimator's feature of each
    draft from ``confidence [len(tokens)] float32``. ``num_tokens`` is the caller's."""
    k = len(tokens)
    if not k:
        return
    ids = torch.tensor(tokens, dtype=torch.int64)
    proposal.tokens[row, :k] = ids
    proposal.probs[row, torch.arange(k), ids] = 1.0
    if confidence is not None and proposal.confidence is not None:
        proposal.confidence[row, :k] = confidence


def empty_proposal(batch: int, length: int, vocab: int) -> DraftProposal:
    """A proposal of no drafts to fill: ``tokens [batch, length] int64`` and ``probs [batch, length, vocab] float32``
    zeros, ``num_tokens [batch] int64`` zeros."""
    return DraftProposal(
        tokens=torch.zeros(batch, length, dtype=torch.int64),
        probs=torch.zeros(batch, length, vocab, dtype=torch.float32),
        num_tokens=torch.zeros(batch, dtype=torch.int64),
    )


class NoDraft(Draft):
    """Proposes no tokens: every round is one plain target decoding step."""

    name = "none"

    def propose(self, histories, max_tokens, vocab_size, draft_filter=None):
        return empty_proposal(len(histories), 0, vocab_size)


def ngram_lookup(history: np.ndarray, max_tokens: int, max_ngram: int = 4, min_ngram: int = 1) -> np.ndarray:
    """Prompt-lookup proposal for one sequence.

    Args:
        history: ``[T] int64`` prompt + output so far.
        max_tokens: at most this many tokens are proposed.
        max_ngram, min_ngram: n-gram sizes tried, longest first.

    Returns:
        ``[k] int64`` (``0 <= k <= max_tokens``): the tokens that followed the latest earlier occurrence of the
        longest matching suffix n-gram; empty when nothing matches.
    """
    size = history.shape[0]
    if max_tokens <= 0:
        return history[:0]
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = history[size - n :]
        # windows[i] = history[i : i + n] for start positions i in [0, size - n - 1] (exclude the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(history[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return history[start : start + max_tokens]
    return history[:0]


class NgramIndex:
    """:func:`ngram_lookup` of one growing history in O(max_ngram) a call instead of O(len(history)).

    For each n-gram size it maps every n-gram of the history to its latest continuation index ``c`` (the
    n-gram is ``history[c - n : c]``, ``c <= len(history) - 1``), updated with the tokens appended since the last
    call; a lookup is one dictionary probe per size, longest first. At 8,000 tokens of context the scan of
    :func:`ngram_lookup` took 0.78-0.83 ms a request and round on a 2-core AMX Xeon, the index 3 us.

    Args:
        history: the request's token list (prompt + output), which grows by appends only; it is held by
            reference and read at every :meth:`lookup`.
        max_ngram, min_ngram: as for :func:`ngram_lookup`.
    """

    def __init__(self, history: list[int], max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.history = history
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tables: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 1  # continuation indices below this are in the tables

    def indexes(self, history: list[int]) -> bool:
        """Whether this index can serve ``history``: the same list, not shorter than when last indexed."""
        return self.history is history and len(history) >= self._indexed

    def lookup(self, max_tokens: int) -> list[int]:
        """The tokens :func:`ngram_lookup` proposes for the history as it is now (a list of at most
        ``max_tokens`` ids)."""
        return self.lookup_with_match(max_tokens)[0]

    def lookup_with_match(self, max_tokens: int) -> tuple[list[int], int]:
        """:meth:`lookup` and the size n of the n-gram it matched (0: no match)."""
        h = self.history
        size = len(h)
        for c in range(self._indexed, size):
            for n, table in self._tables.items():
                if c >= n:
                    table[tuple(h[c - n : c])] = c
        self._indexed = size  # (indexes() refuses a history shorter than this)
        if max_tokens <= 0:
            return [], 0
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            c = self._tables[n].get(tuple(h[size - n :]))
            if c is not None:
                return h[c : c + max_tokens], n
        return [], 0


def ngram_confidence(match: int, k: int) -> torch.Tensor:
    """The estimator's feature of ``k`` n-gram drafts proposed after an n-gram match of size ``match``: the match
    size, the same for every draft of the chain (the estimator's per-position intercepts model the decay along
    it). A longer matched context is likelier to continue as before."""
    return torch.full((k,), float(match), dtype=torch.float32)


class NgramDraft(Draft):
    """Prompt-lookup drafting over prompt + output; ``q`` is one-hot on the proposed token.

    Each request's history keeps an :class:`NgramIndex` between rounds (found by the identity of its token list,
    which the engine extends in place; a list seen for the first time, or one shorter than when indexed, is
    indexed afresh), so a round's lookup does not grow with the context. Histories given as tensors or arrays
    are copied into a new list each call (correct, but indexed afresh every round).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._indexes: dict[int, NgramIndex] = {}

    def _index(self, history: list[int]) -> NgramIndex:
        index = self._indexes.get(id(history))  # the index holds its list: an id here is never another live list's
        return index if index is not None and index.indexes(history) else NgramIndex(history, self.max_ngram,
                                                                                      self.min_ngram)

    def propose(self, histories, max_tokens, vocab_size, draft_filter=None):
        batch = len(histories)
        limits = max_tokens.tolist()
        length = max(limits, default=0)
        proposal = empty_proposal(batch, length, vocab_size)
        proposal.confidence = torch.zeros(batch, length, dtype=torch.float32)
        indexes = {}
        found_counts = []
        for r, history in enumerate(histories):
            if not isinstance(history, list):  # a tensor or array: a list of ints (new each call, indexed afresh)
                history = [int(t) for t in history]
            index = self._index(history)
            indexes[id(history)] = index
            found, n = index.lookup_with_match(int(limits[r]))
            fill_deterministic_row(proposal, r, found, ngram_confidence(n, len(found)))
            found_counts.append(len(found))
        self._indexes = indexes  # requests that left the batch drop their index
        proposal.num_tokens = torch.tensor(found_counts, dtype=torch.int64)
        return proposal


class ModelDraft(Draft):
    """An autoregressive draft LM run with its own ragged KV cache.

    Args:
        model: transformers causal LM whose logits are over the target's vocabulary.
        sampling: the run's sampling transform (applied to the draft logits to get ``q``).
        seed: the draft's own seed, mixed with each request's seed into the coins it samples with
            (:func:`draft_coins`).
        name: label used in reports (``self:4``, a path, ...).
        native: the same model on the native forward (:class:`~specadapt.engine.native.NativeLlama`), or
            ``None`` for transformers' forward.
    """

    def __init__(self, model: torch.nn.Module, sampling: SamplingParams, seed: int, name: str,
                 native=None) -> None:
        self.model = model
        self.native = native
        self.sampling = sampling
        self.seed = int(seed)
        self.name = name
        self.kv: RaggedKVCache | None = None
        self._committed_before: torch.Tensor | None = None
        self._drafts_fed = 0

    def start(self, histories):
        if self.native is not None:
            from .native import SlotKVCache

            self.kv = SlotKVCache(self.native, len(histories), capacity=self.context_capacity)
        else:
            self.kv = RaggedKVCache(self.model, len(histories))
        prefix = [h[:-1] for h in histories]
        if max(len(p) for p in prefix) > 0:
            ids, counts = pad_token_lists(prefix)
            self.kv.forward(ids, counts, logits_to_keep=1)

    def propose(self, histories, max_tokens, vocab_size, draft_filter=None):
        assert self.kv is not None, "start() must be called first"
        batch = len(histories)
        length = int(max_tokens.max()) if batch else 0
        proposal = empty_proposal(batch, length, vocab_size)
        proposal.num_tokens = max_tokens.clone().to(torch.int64)
        self._committed_before = torch.tensor([len(h) for h in histories], dtype=torch.int64)
        self._drafts_fed = 0
        if length == 0:
            return proposal
        last = self._feed_uncached(histories)
        history = _step_history(self.history_counts, self.sampling)  # committed + drafts[:i]
        for i in range(length):
            q = logits_to_probs_rows(last, self.sampling_for_rows(batch), history)
            token = draw_tokens(q.cpu(), draft_coins(self, histories, torch.full((batch, 1), i))).squeeze(1)
            proposal.tokens[:, i] = token
            proposal.probs[:, i] = q.cpu()
            if history is not None:
                history.add_(token)
            if not apply_draft_filter(draft_filter, proposal, i):
                break
            if i + 1 < length:
                last = self.kv.forward(token[:, None], torch.ones(batch, dtype=torch.int64))[:, -1]
                self._drafts_fed += 1
        trim_proposal(proposal)
        length = proposal.tokens.shape[1]
        live = torch.arange(length)[None, :] < proposal.num_tokens[:, None]
        proposal.tokens = torch.where(live, proposal.tokens, torch.zeros_like(proposal.tokens))
        return proposal

    supports_paths = True

    def _feed_uncached(self, histories: list[list[int]]) -> torch.Tensor:
        """Feed each request's committed tokens not yet in the draft cache (a ragged chunk, usually 1-2
        tokens) and return the logits after its last one, ``[B, V]``."""
        cached = self.kv.lengths.cpu().tolist()
        ids, counts = pad_token_lists([h[c:] for h, c in zip(histories, cached)])
        logits = self.kv.forward(ids, counts)
        return logits[torch.arange(len(histories)), (counts - 1).clamp_min(0).to(logits.device)]

    def propose_paths(self, histories, num_drafts, vocab_size, num_paths, depths=None):
        assert self.kv is not None, "start() must be called first"
        if num_drafts < 1 or num_paths < 1:
            raise ValueError("propose_paths needs num_drafts >= 1 and num_paths >= 1")
        batch = len(histories)
        steps = path_step_counts(depths, batch, num_paths)
        self._committed_before = torch.tensor([len(h) for h in histories], dtype=torch.int64)
        self._drafts_fed = 0
        history = _step_history(self.history_counts, self.sampling)
        q = logits_to_probs_rows(self._feed_uncached(histories), self.sampling_for_rows(batch), history).cpu()  # [B, V]
        tokens = torch.zeros(batch, num_paths, num_drafts, dtype=torch.int64)
        probs = torch.zeros(batch, num_paths, num_drafts, vocab_size, dtype=torch.float32)
        tokens[:, :, 0] = draw_tokens(q, draft_coins(self, histories, torch.arange(num_paths).expand(batch, -1)))
        probs[:, :, 0] = q[:, None]
        self._paths = 1
        if num_drafts > 1:
            self.kv.repeat_interleave(num_paths)
            self._paths = num_paths
            if history is not None:
                history = history.repeat_interleave(num_paths)  # row b * K + k: path k of request b
        for i in range(1, num_drafts):
            live = None if steps is None else i < steps  # [B*K]: rows drafting position i
            counts = torch.ones(batch * num_paths, dtype=torch.int64) if live is None else live.to(torch.int64)
            step = self.kv.forward(tokens[:, :, i - 1].reshape(-1, 1), counts)
            if history is not None:
                history.add_(tokens[:, :, i - 1].reshape(-1))  # committed + path k's drafts[:i]
            q = logits_to_probs_rows(step[:, -1], self.sampling_for_rows(batch * num_paths), history).cpu()  # [B*K, V]
            index = (i * num_paths + torch.arange(num_paths)).expand(batch, -1)
            coins = draft_coins(self, histories, index)  # [B, K]: one coin per path
            drawn, q = zero_hole_rows(draw_tokens(q, coins.reshape(-1, 1)), q, live)
            tokens[:, :, i] = drawn.reshape(batch, num_paths)
            probs[:, :, i] = q.reshape(batch, num_paths, -1)
            self._drafts_fed += 1
        return tokens, probs

    def select_path(self, chosen):
        paths = getattr(self, "_paths", 1)
        if self.kv is not None and paths > 1:
            rows = torch.arange(chosen.shape[0]) * paths + chosen.to(torch.int64)
            self.kv.select(rows)
        self._paths = 1

    def commit(self, accept_len):
        if self.kv is None or self._committed_before is None:
            return
        # The cache holds the committed tokens and the first `_drafts_fed` drafts; keep the accepted ones.
        keep = self._committed_before + torch.clamp(accept_len.to(torch.int64), max=self._drafts_fed)
        self.kv.truncate(torch.minimum(keep, self.kv.lengths.cpu()))
        self._committed_before = None

    def select(self, rows):
        if self.kv is not None:
            self.kv.select(rows)
        if self.row_seeds is not None:
            self.row_seeds = self.row_seeds.index_select(0, rows.cpu())

    def join(self, histories, features=None):
        # the new rows start empty: the next proposal feeds their whole history (exact: the same cache content as
        # a prefill at start)
        self.kv.add_rows(len(histories))

    def tts_student(self):
        """Test-Time Speculation trains this draft's decoder layers (:class:`~.tts_students.ModelDraftStudent`)."""
        from .tts_students import ModelDraftStudent

        return ModelDraftStudent(self)


def _step_history(counts, sampling: SamplingParams):
    """A private copy of the committed ``TokenCounts`` that drafting extends step by step, or ``None`` when the
    draft's transform does not read the history.

    Raises:
        ValueError: a history-dependent transform without the engine's counts.
    """
    if not sampling.history_dependent:
        return None
    if counts is None:
        raise ValueError("history_counts: the draft's penalties need the committed tokens' TokenCounts "
                         "(the engine sets Draft.history_counts before each proposal)")
    return counts.clone()


def draft_coins(draft: Draft, histories: list[list[int]], index: torch.Tensor) -> torch.Tensor:
    """The draft's coins for requests ``histories`` (one row each): ``[B, n] float64`` keyed by the request's seed
    (``draft.row_seeds``, 0 when unset), the draft's own ``seed``, the request's committed length and ``index``
    ``[B, n] int64`` (the draft slot, or ``slot * K + path`` when sampling K paths)."""
    batch = len(histories)
    seeds = draft.row_seeds if draft.row_seeds is not None else torch.zeros(batch, dtype=torch.int64)
    seeds = seeds ^ (int(getattr(draft, "seed", 0)) * 0x5851F42D4C957F2D & ((1 << 63) - 1))
    counters = torch.tensor([len(h) for h in histories], dtype=torch.int64)
    return request_coins(seeds, counters, coins_mod.DRAFT, index)


def draw_tokens(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Samples of rows ``probs [R, V]`` with coins ``[R, n]`` (n independent draws per row): ``[R, n] int64``."""
    rows, count = coins.shape
    source = probs.repeat_interleave(count, dim=0) if count > 1 else probs
    return sample_from_probs(source, coins.reshape(-1)).view(rows, count)


def pad_token_lists(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ``([B, n] int64, counts [B] int64)`` (pad id 0, masked as holes; ``n >= 1``)."""
    counts = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    width = max(int(counts.max()), 1) if len(sequences) else 1
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    for r, s in enumerate(sequences):
        if s:
            ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
    return ids, counts


def self_draft(target: LoadedModel, num_layers: int) -> torch.nn.Module:
    """A layer-truncated copy of the target: its first ``num_layers`` decoder layers, final norm and LM head.

    The copy owns its parameters (a deep copy), so a later stage can train it without touching the target.

    Raises:
        ValueError: ``num_layers`` outside ``[1, number of target layers]`` or a model without
            ``model.layers``.
    """
    decoder = getattr(target.model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"self:N needs a decoder with `model.layers`; {type(target.model).__name__} has none")
    total = len(layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"--draft self:N needs 1 <= N <= {total} (the target's layers), got {num_layers}")
    draft = copy.deepcopy(target.model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None) is not None:
        draft.config.layer_types = list(draft.config.layer_types)[:num_layers]
    draft.eval()
    return draft


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary differs from the target's.

    Raises:
        VocabularyMismatchError: different logit width or a different token -> id mapping.
    """
    if draft.vocab_size != target.vocab_size:
        raise VocabularyMismatchError(
            f"draft {draft.name!r} has a vocabulary of {draft.vocab_size} tokens but the target "
            f"{target.name!r} has {target.vocab_size}: speculative decoding needs the same tokenizer"
        )
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise VocabularyMismatchError(
            f"draft {draft.name!r} maps tokens to ids differently from the target {target.name!r}: "
            "speculative decoding needs the same tokenizer"
        )
