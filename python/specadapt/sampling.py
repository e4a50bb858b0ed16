"""Logits -> sampling distribution: the transform shared by target and draft.

Lossless speculative sampling needs the draft to sample from exactly the distribution ``q`` that verification
sees, and the target's ``p`` to be the distribution plain decoding would sample from. Both go through
:func:`logits_to_probs`. Without logit processors (no penalties, no bias, ``min_p`` 0) that is the fused CPU op
``specadapt::sampling_probs`` (csrc/cpu/sampling_cpu.cpp; no full sort of the vocabulary for top-p) where it is
built, else :func:`logits_to_probs_reference`, the same rule in PyTorch. Tokens are drawn from those rows by
inverse CDF with explicit coins (:func:`sample_from_probs`), so a request's draws can come from its own random
stream.

Order of operations (SGLang 0.5.23's, so the engine and the SGLang plugin agree):

1. frequency and presence penalties (subtracted; over the row's *generated* tokens),
2. repetition penalty (positive logits divided by it, negative ones multiplied; over the row's prompt and
   generated tokens, as Hugging Face and vLLM count them),
3. logit bias (added),
4. temperature (below :data:`GREEDY_TEMPERATURE`: greedy, the argmax of the processed logits), top-k, top-p,
5. min-p: keep the tokens whose probability is at least ``min_p`` times the largest one, renormalise.

The penalties depend on the history a row conditions on. In speculative decoding that history is the committed
tokens *and the drafts before the row*: the target's row at verify slot ``i`` conditions on
``prefix + drafts[:i]``, and the draft samples draft ``i + 1`` from the same history. :class:`TokenCounts`
carries those histories; :meth:`TokenCounts.chain` (a verify chunk), :meth:`TokenCounts.extend` (a token tree)
and :meth:`TokenCounts.add_` (step-by-step drafting) build the per-row counts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams", "TokenCounts", "apply_logit_processors", "apply_min_p",
           "logits_to_probs", "logits_to_probs_reference", "logits_to_probs_rows", "sample_from_probs"]

#: Temperatures below this are greedy (SGLang's ``_SAMPLING_EPS`` rule, so the plugin and the engine agree). Far
#: above the float32 overflow of ``logits / T`` (T <= ~1e-38 made every probability NaN), and far below any
#: temperature that samples differently from greedy except between logits closer than float32 resolves.
GREEDY_TEMPERATURE = 1e-6

#: The range OpenAI's API and SGLang accept for the frequency and presence penalties.
PENALTY_RANGE = (-2.0, 2.0)


def _finite(value) -> bool:
    """A real number (Python or NumPy; not a bool) that is neither NaN nor infinite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _normalise_bias(bias) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (or ``(id, bias)`` pairs) -> sorted ``((id, bias), ...)``; ``ValueError`` naming
    ``logit_bias`` for a negative / non-integer id, a repeated id or a non-finite bias."""
    if bias is None:
        return ()
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    out: dict[int, float] = {}
    for item in items:
        try:
            key, value = item
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to biases, got the entry {item!r}") from None
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
            raise ValueError(f"logit_bias: token ids must be integers >= 0, got {key!r}")
        if not _finite(value):
            raise ValueError(f"logit_bias: the bias of token {key} must be a finite number, got {value!r}")
        if key in out:
            raise ValueError(f"logit_bias: token {key} appears twice")
        out[int(key)] = float(value)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of a run (the order in which they apply is in the module docstring).

    Attributes:
        temperature: >= 0; 0 means greedy (a one-hot distribution on the argmax of the processed logits, lowest
            id on ties). A temperature below :data:`GREEDY_TEMPERATURE` (1e-6) is greedy too and is stored as 0.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: in [0, 1]; keep the tokens whose probability (after temperature, top-k and top-p) is at least
            ``min_p`` times the most likely token's; 0 disables it. As in SGLang, top-p is cut before min-p.
        repetition_penalty: > 0 (1 disables it). For every token seen in the row's context -- the prompt and the
            tokens generated so far (drafts before the row included) -- a positive logit is divided by it and a
            negative one multiplied (Hugging Face's and vLLM's rule; SGLang 0.5.23 counts generated tokens only).
        frequency_penalty: in [-2, 2] (OpenAI's and SGLang's range; 0 disables it); subtracted from each logit
            once per occurrence of the token among the row's *generated* tokens (the prompt does not count,
            as in OpenAI's API and SGLang).
        presence_penalty: in [-2, 2] (0 disables it); subtracted once from the logit of every token that occurs
            among the row's generated tokens (the prompt does not count).
        logit_bias: ``{token id: bias}`` (a mapping or ``(id, bias)`` pairs; stored as sorted pairs), added to
            the logits of those ids; ids must lie in the vocabulary (checked when applied), biases be finite.

    Raises:
        ValueError: naming the field: a negative, NaN or infinite temperature, ``top_p`` outside (0, 1],
            ``top_k < 0``, ``min_p`` outside [0, 1], ``repetition_penalty <= 0``, a penalty outside [-2, 2],
            non-finite values, or a bad ``logit_bias`` entry.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy: logits / T would overflow for tiny T
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (_finite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must lie in [0, 1] (0 disables it), got {self.min_p}")
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got "
                             f"{self.repetition_penalty}")
        low, high = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (_finite(value) and low <= value <= high):
                raise ValueError(f"{name} must lie in [{low:g}, {high:g}] (0 disables it), got {value}")
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def history_dependent(self) -> bool:
        """True when a row's law depends on the tokens before it (a penalty is set): the transform then needs
        the rows' :class:`TokenCounts`."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def has_logit_processors(self) -> bool:
        """True when anything beyond temperature / top-k / top-p is set (penalties, logit bias, min-p)."""
        return self.history_dependent or bool(self.logit_bias) or self.min_p > 0


@dataclass
class TokenCounts:
    """The token history each sampled row conditions on, as the penalties read it.

    Attributes:
        generated: ``[..., V] float32``: occurrences of each token id among the row's generated tokens (the
            committed output, then the drafts before the row).
        prompt: ``[..., V] bool``: ids occurring in the row's prompt (only the repetition penalty reads it).

    The leading dimensions equal the logits' the transform is applied to (``[R]`` for ``[R, V]`` logits,
    ``[B, S]`` for ``[B, S, V]``). ``V`` is the target's vocabulary (a draft over a reduced vocabulary passes its
    ids as ``vocab_ids`` to :func:`logits_to_probs`).
    """

    generated: torch.Tensor
    prompt: torch.Tensor

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                       vocab_size: int) -> "TokenCounts":
        """Counts of ``R`` rows: ``sequences[r]`` is prompt + generated tokens, the first ``prompt_lengths[r]``
        of them the prompt. Returns ``[R, V]`` CPU tensors.

        Raises:
            ValueError: mismatched lengths, ``prompt_lengths`` outside ``[0, len(sequence)]``, ids outside
                ``[0, vocab_size)``.
        """
        if len(sequences) != len(prompt_lengths):
            raise ValueError(f"sequences ({len(sequences)}) and prompt_lengths ({len(prompt_lengths)}) differ in length")
        rows = len(sequences)
        generated = torch.zeros(rows, vocab_size, dtype=torch.float32)
        prompt = torch.zeros(rows, vocab_size, dtype=torch.bool)
        for r, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
            ids = torch.as_tensor(list(seq), dtype=torch.int64)
            if not 0 <= int(n) <= ids.numel():
                raise ValueError(f"prompt_lengths[{r}] = {n} is outside [0, {ids.numel()}]")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(f"sequences[{r}] holds token ids outside [0, {vocab_size})")
            prompt[r, ids[: int(n)]] = True
            generated[r] = torch.bincount(ids[int(n):], minlength=vocab_size).float()
        return cls(generated, prompt)

    @property
    def vocab_size(self) -> int:
        return int(self.generated.shape[-1])

    def clone(self) -> "TokenCounts":
        return TokenCounts(self.generated.clone(), self.prompt.clone())

    def to(self, device) -> "TokenCounts":
        return TokenCounts(self.generated.to(device), self.prompt.to(device))

    def __getitem__(self, index) -> "TokenCounts":
        """Rows ``index`` (any tensor index over the leading dimensions)."""
        return TokenCounts(self.generated[index], self.prompt[index])

    def index_select(self, rows: torch.Tensor) -> "TokenCounts":
        """Rows ``rows [R'] int64`` of ``[R, V]`` counts."""
        rows = rows.to(self.generated.device)
        return TokenCounts(self.generated.index_select(0, rows), self.prompt.index_select(0, rows))

    def repeat_interleave(self, repeats: int) -> "TokenCounts":
        """``[R, V]`` -> ``[R * repeats, V]``, each row ``repeats`` times in a row (K paths per request)."""
        return TokenCounts(self.generated.repeat_interleave(repeats, dim=0),
                           self.prompt.repeat_interleave(repeats, dim=0))

    def add_(self, tokens: torch.Tensor) -> "TokenCounts":
        """Count one more generated token per row, in place: ``tokens [R] int64`` (a negative id adds nothing).
        Returns ``self``."""
        tokens = tokens.reshape(-1).to(torch.int64).to(self.generated.device)
        if tokens.shape[0] != self.generated.shape[0] or self.generated.dim() != 2:
            raise ValueError(f"tokens must be [R] for [R, V] counts, got {tuple(tokens.shape)} for "
                             f"{tuple(self.generated.shape)}")
        live = tokens >= 0
        self.generated.index_put_((torch.arange(tokens.shape[0], device=tokens.device)[live], tokens[live]),
                                  torch.ones((), dtype=self.generated.dtype, device=tokens.device), accumulate=True)
        return self

    def append_(self, new_tokens: Sequence[Sequence[int]]) -> "TokenCounts":
        """Count ragged generated tokens in place: ``new_tokens[r]`` for row ``r`` of ``[R, V]`` counts."""
        if len(new_tokens) != self.generated.shape[0]:
            raise ValueError(f"new_tokens needs one list per row ({self.generated.shape[0]}), got {len(new_tokens)}")
        for r, toks in enumerate(new_tokens):
            if len(toks):
                ids = torch.as_tensor(list(toks), dtype=torch.int64, device=self.generated.device)
                self.generated[r].index_put_((ids,), torch.ones((), device=ids.device), accumulate=True)
        return self

    def extend(self, tokens: torch.Tensor, mask: torch.Tensor) -> "TokenCounts":
        """Histories that add some of ``tokens`` to each row: ``[R, V]`` counts, ``tokens [R, n] int64`` and
        ``mask [R, m, n] bool`` give ``[R, m, V]`` counts whose row ``(r, k)`` also counts every ``tokens[r, j]``
        with ``mask[r, k, j]`` (a token tree: ``mask`` = the nodes on the path from the root to node k).

        Raises:
            ValueError: shapes that do not match.
        """
        if self.generated.dim() != 2:
            raise ValueError(f"extend needs [R, V] counts, got {tuple(self.generated.shape)}")
        rows = self.generated.shape[0]
        if tokens.dim() != 2 or tokens.shape[0] != rows or mask.dim() != 3 or mask.shape[0] != rows \
                or mask.shape[2] != tokens.shape[1]:
            raise ValueError(f"tokens must be [R, n] and mask [R, m, n] with R = {rows}, got "
                             f"{tuple(tokens.shape)} and {tuple(mask.shape)}")
        device = self.generated.device
        width = mask.shape[1]
        generated = self.generated[:, None, :].repeat(1, width, 1)
        if tokens.shape[1]:
            index = tokens.to(device=device, dtype=torch.int64).clamp(0, self.vocab_size - 1)
            generated.scatter_add_(2, index[:, None, :].expand(rows, width, -1).contiguous(),
                                   mask.to(device=device, dtype=generated.dtype))
        return TokenCounts(generated, self.prompt[:, None, :].expand(rows, width, -1))

    def chain(self, tokens: torch.Tensor, num_tokens: torch.Tensor | None = None) -> "TokenCounts":
        """The histories of a verify chunk: ``[R, V]`` counts and drafts ``tokens [R, n]`` give
        ``[R, n+1, V]`` counts whose row ``i`` also counts ``tokens[r, :i]`` (only the first ``num_tokens[r]``
        drafts are real; later ones are never counted)."""
        rows, n = tokens.shape
        slot = torch.arange(n + 1)[:, None]
        col = torch.arange(n)[None, :]
        mask = (col < slot)[None].expand(rows, n + 1, n)
        if num_tokens is not None:
            mask = mask & (col[None] < num_tokens.cpu().reshape(rows, 1, 1))
        return self.extend(tokens, mask)


def _fused(name: str, device: torch.device) -> bool:
    from . import kernels

    return device.type == "cpu" and kernels.has_op_for(name, device)


def _bias_columns(params: SamplingParams, width: int, vocab_ids: torch.Tensor | None, device):
    """``(columns [n] int64, biases [n] float32)`` of ``params.logit_bias`` in a ``width``-wide logit row."""
    ids = torch.tensor([k for k, _ in params.logit_bias], dtype=torch.int64)
    values = torch.tensor([v for _, v in params.logit_bias], dtype=torch.float32)
    if vocab_ids is None:
        if int(ids.max()) >= width:
            raise ValueError(f"logit_bias: token id {int(ids.max())} is outside the vocabulary of {width} tokens")
        return ids.to(device), values.to(device)
    match = vocab_ids.cpu().to(torch.int64)[:, None] == ids[None, :]  # [width, n]: ids outside the subset drop
    columns, which = match.nonzero(as_tuple=True)
    return columns.to(device), values[which].to(device)


def apply_logit_processors(logits: torch.Tensor, params: SamplingParams, history: TokenCounts | None = None,
                           vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-3 of the module docstring: penalties and logit bias on the raw logits.

    Args:
        logits: ``[..., V']`` float (computed in float32).
        params: the run's :class:`SamplingParams`.
        history: the rows' :class:`TokenCounts` (leading dimensions equal to ``logits``'), needed when
            ``params.history_dependent``; ignored otherwise.
        vocab_ids: ``[V'] int64`` the target-vocabulary id of each logit column, for logits over a reduced draft
            vocabulary (an EAGLE head); ``None`` when the columns are the ids ``0..V'-1``. Penalties and biases
            are always keyed by target ids.

    Returns:
        ``[..., V'] float32`` processed logits (a new tensor).

    Raises:
        ValueError: a history-dependent ``params`` without ``history``, a ``history`` of another shape, a
            ``logit_bias`` id outside the vocabulary.
    """
    x = logits.float().clone()
    if params.history_dependent:
        if history is None:
            raise ValueError("history: repetition / frequency / presence penalties need the rows' TokenCounts")
        generated, prompt = history.generated, history.prompt
        if vocab_ids is not None:
            ids = vocab_ids.to(generated.device)
            generated, prompt = generated.index_select(-1, ids), prompt.index_select(-1, ids)
        if generated.shape != x.shape or prompt.shape != x.shape:
            raise ValueError(f"history: counts of shape {tuple(generated.shape)} for logits of shape {tuple(x.shape)}")
        generated = generated.to(x.device)
        seen_generated = generated > 0
        if params.frequency_penalty != 0.0:
            x = x - params.frequency_penalty * generated
        if params.presence_penalty != 0.0:
            x = x - params.presence_penalty * seen_generated.float()
        if params.repetition_penalty != 1.0:
            seen = seen_generated | prompt.to(x.device)
            scaled = torch.where(x < 0, x * params.repetition_penalty, x / params.repetition_penalty)
            x = torch.where(seen, scaled, x)
    if params.logit_bias:
        columns, values = _bias_columns(params, x.shape[-1], vocab_ids, x.device)
        x[..., columns] += values
    return x


def apply_min_p(probs: torch.Tensor, min_p) -> torch.Tensor:
    """Step 5: keep the entries of each row that are at least ``min_p`` times the row's largest, renormalise.

    Args:
        probs: ``[..., V]`` float probabilities (rows need not be normalised).
        min_p: a float in [0, 1], or a tensor broadcastable to ``probs[..., :1]`` (per-request values, e.g.
            ``[B, 1, 1]`` for ``[B, S, V]``); 0 keeps a row as it is.

    Returns:
        ``[..., V]`` rows of the input's dtype summing to 1 (the largest entry is always kept).
    """
    threshold = probs.amax(dim=-1, keepdim=True) * torch.as_tensor(min_p, dtype=probs.dtype, device=probs.device)
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, history: TokenCounts | None = None,
                    vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Turn logits into the distribution tokens are sampled from.

    Args:
        logits: ``[..., V']`` float (any float dtype; computed in float32).
        params: the run's :class:`SamplingParams`.
        history: ``TokenCounts`` with leading dimensions equal to ``logits``' (``generated`` / ``prompt``
            ``[..., V]``): row ``(..)`` conditions on that history. Required when ``params.history_dependent``.
        vocab_ids: ``[V'] int64`` target ids of the columns of logits over a reduced vocabulary, or ``None``.

    Returns:
        ``[..., V'] float32`` probabilities summing to 1 over the last axis. Greedy (temperature below
        :data:`GREEDY_TEMPERATURE`) gives one-hot rows (lowest id on ties) on the processed logits.
        Top-k keeps ties at the k-th value; top-p keeps the smallest prefix of the distribution ranked by
        probability (lower id first on ties) whose mass reaches ``top_p`` (at least one token); min-p then keeps
        the tokens at least ``min_p`` times the most likely one. Without logit processors this is the fused op.

    Raises:
        ValueError: see :func:`apply_logit_processors`.
    """
    if params.has_logit_processors:
        logits = apply_logit_processors(logits, params, history, vocab_ids)
    if logits.numel() and _fused("sampling_probs", logits.device):
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1]).float()
        out = torch.ops.specadapt.sampling_probs(flat, float(params.temperature), int(params.top_k),
                                                 float(params.top_p)).reshape(shape)
    else:
        out = _transform_reference(logits, params)
    if params.min_p > 0 and not params.greedy:
        out = apply_min_p(out, params.min_p)
    return out


def logits_to_probs_rows(logits: torch.Tensor, params, history: TokenCounts | None = None,
                         vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`logits_to_probs` with per-row settings (continuous batching with per-request parameters).

    Args:
        logits: ``[R, ..., V']`` float.
        params: one :class:`SamplingParams` for every row, or a sequence of ``R`` of them (row ``r`` of the
            leading axis is transformed with ``params[r]``; rows with equal settings share one call).
        history, vocab_ids: as for :func:`logits_to_probs` (``history`` leading dimensions equal ``logits``').

    Returns:
        ``[R, ..., V'] float32`` probabilities; each row equals :func:`logits_to_probs` of that row alone.

    Raises:
        ValueError: ``len(params) != R``.
    """
    if isinstance(params, SamplingParams):
        return logits_to_probs(logits, params, history, vocab_ids)
    params = list(params)
    if len(params) != logits.shape[0]:
        raise ValueError(f"params holds {len(params)} settings for {logits.shape[0]} rows of logits")
    groups: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(p, []).append(row)
    if len(groups) == 1:
        return logits_to_probs(logits, params[0], history, vocab_ids)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for p, rows in groups.items():
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        part = None if history is None else history[index.to(history.generated.device)]
        out[index] = logits_to_probs(logits.index_select(0, index), p, part, vocab_ids)
    return out


def logits_to_probs_reference(logits: torch.Tensor, params: SamplingParams, history: TokenCounts | None = None,
                              vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`logits_to_probs` in PyTorch operations (any device; the fused op's reference). Equal to the op's
    rows up to float rounding; the top-p cut can differ only where the ranked mass lands within rounding of
    ``top_p``."""
    if params.has_logit_processors:
        logits = apply_logit_processors(logits, params, history, vocab_ids)
    out = _transform_reference(logits, params)
    if params.min_p > 0 and not params.greedy:
        out = apply_min_p(out, params.min_p)
    return out


def _transform_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature / top-k / top-p in PyTorch (step 4)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with given coins.

    Args:
        probs: ``[R, V]`` float32 non-negative rows (need not be normalised).
        uniforms: ``[R]`` coins in ``[0, 1)`` (float64).

    Returns:
        ``[R] int64``: per row the smallest id whose cumulative mass exceeds ``u * total`` (zero-probability ids
        are never chosen).

    Raises:
        ValueError / RuntimeError: a row without positive mass, coins outside ``[0, 1)``, mismatched shapes.
    """
    if probs.dim() != 2 or uniforms.shape != (probs.shape[0],):
        raise ValueError(f"probs must be [R, V] and uniforms [R], got {tuple(probs.shape)} and {tuple(uniforms.shape)}")
    if probs.shape[0] and _fused("sample_tokens", probs.device):
        return torch.ops.specadapt.sample_tokens(probs.float().contiguous(), uniforms.double())
    from .verification.common import sample_from_unnormalized

    p = probs.double()
    return sample_from_unnormalized(p, p, uniforms.double().to(p.device))
