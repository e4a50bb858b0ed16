"""Shared pieces of the verification rules: input checks, sanitising, coin-driven sampling.

The tensor contract (docs/design/specs/verification.md section 4), for a batch of ``B`` requests, draft length ``L`` and
vocabulary ``V``:

- ``candidates [B, L+1] int64``: slot 0 is the last committed token, slots 1..L the drafted tokens.
- ``target_probs [B, L+1, V]`` float: row ``i`` is ``p(. | X^i)``.
- ``draft_probs [B, L, V]`` float: row ``i`` is ``q(. | X^i)``, the law drafted token ``i+1`` was sampled from.
- ``uniforms [B, L]`` and ``uniforms_final [B]``: the coins, in ``[0, 1)``.
- ``num_draft_tokens [B] int`` (optional, this package's extension for ragged batches): request ``b`` only
  drafted ``num_draft_tokens[b] <= L`` tokens; slots past it are ignored: their ids may be anything (padding
  such as -1), their p / q rows and coins are never read.

Outputs: ``accept_len [B] int32`` (tau) and ``output_tokens [B, L+1] int32`` (accepted drafts, then the extra
token, padded with -1).

Rows of ``p`` and ``q`` are probability distributions: every row a request's output can depend on (``p`` rows
``0..n``, ``q`` rows ``0..n-1`` with ``n = num_draft_tokens[b]``) must sum to 1 within :func:`row_sum_tolerance`
(1e-3 for 32 / 64-bit rows, 1e-2 for bfloat16 / float16), after NaN / inf / negative entries count as 0; other
rows raise ``ValueError`` naming the argument and the row. The rules divide ``p`` by ``q`` entry by entry, so a
row scaled by ``c != 1`` would change the output law silently (issue 19: ``p = 2 x (0.5, 0.5)``, ``q = (0.9,
0.1)`` emitted token 0 with probability 0.9, not 0.5). The same rule holds in the C++ and CUDA kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "VerifyInputs",
    "VerifyOutput",
    "check_inputs",
    "sanitize_probs",
    "sample_from_unnormalized",
    "draft_token_ratio",
    "single_path_inputs",
    "row_sum_tolerance",
    "check_row_sums",
    "gather_tokens",
    "pack_output",
    "normalized_extra_laws",
]


@dataclass
class VerifyOutput:
    """Result of one verification call.

    Attributes:
        accept_len: ``[B] int32``, tau = number of accepted draft tokens per request.
        output_tokens: ``[B, L+1] int32``, the ``tau`` accepted drafts then the extra token, padded with -1.
    """

    accept_len: torch.Tensor
    output_tokens: torch.Tensor


@dataclass
class VerifyInputs:
    """Validated inputs converted to float64 on the inputs' device (the reference's working precision)."""

    drafts: torch.Tensor  # [B, L] int64
    target_probs: torch.Tensor  # [B, L+1, V] float64
    draft_probs: torch.Tensor  # [B, L, V] float64
    uniforms: torch.Tensor  # [B, L] float64
    uniforms_final: torch.Tensor  # [B] float64
    num_draft_tokens: torch.Tensor  # [B] int64

    @property
    def batch_size(self) -> int:
        return self.drafts.shape[0]

    @property
    def num_slots(self) -> int:
        return self.drafts.shape[1]


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def sanitize_probs(probs: torch.Tensor, name: str, strict: bool) -> torch.Tensor:
    """Return ``probs`` in float64 with NaN / inf / negative entries handled as the spec says (section 5).

    Args:
        probs: float tensor of any shape.
        name: argument name used in error messages.
        strict: if True (target probabilities in debug mode) such entries raise ``ValueError``;
            otherwise they are replaced by 0.
    """
    probs = probs.to(torch.float64)
    bad = ~torch.isfinite(probs) | (probs < 0)
    if bool(bad.any()):
        if strict:
            raise ValueError(f"{name} contains NaN, inf or negative entries")
        probs = torch.where(bad, torch.zeros_like(probs), probs)
    return probs


def row_sum_tolerance(dtype: torch.dtype) -> float:
    """How far from 1 a row of ``p`` or ``q`` stored as ``dtype`` may sum: 1e-2 for 16-bit floats (bfloat16 rounds
    each entry by up to 2^-9 relative, float16 by 2^-12), 1e-3 otherwise (float32 rows are off by ~1e-6 at most,
    rounding plus the softmax's own float32 sum over the vocabulary). The same constants as the kernels
    (``csrc/cpu/verify_common.h``, ``csrc/cuda/verify.cuh``)."""
    return 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3


def check_row_sums(probs: torch.Tensor, live: torch.Tensor, name: str, tolerance: float, index: str = "") -> None:
    """Raise when a live row of ``probs`` does not sum to 1 within ``tolerance``.

    Args:
        probs: ``[..., R, V]`` float64, already sanitised (NaN / inf / negative entries are 0).
        live: ``[..., R]`` bool, the rows that are checked.
        name: argument name for the message (``target_probs`` / ``draft_probs``).
        tolerance: allowed ``|sum - 1|`` (see :func:`row_sum_tolerance`).
        index: prefix of the reported row index (e.g. ``"3, 1, "`` for a request and path).

    Raises:
        ValueError: ``"<name> row (<index>) sums to S, not 1 (tolerance T) ..."`` for the first such row.
    """
    if probs.shape[-1] == 0 or probs.numel() == 0:
        return
    sums = probs.sum(dim=-1)
    bad = live & ~((sums - 1.0).abs() <= tolerance)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        total = float(sums[tuple(where)])
        raise ValueError(
            f"{name} row ({index}{', '.join(map(str, where))}) sums to {total:.6g}, not 1 (tolerance {tolerance:g}): "
            "rows of p and q must be probability distributions (normalise them; a scaled row changes the output law)"
        )


def check_inputs(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    debug: bool = False,
    check_sums: bool = True,
) -> VerifyInputs:
    """Validate the verification contract and convert to float64.

    ``check_sums=False`` skips the row-sum check (GBV checks the rows of its walked path itself).

    Raises:
        ValueError: wrong ranks/shapes, ``V = 0``, non-float probabilities, ``draft_probs`` of another dtype than
            ``target_probs``, token ids outside ``[0, V)`` (slot 0 and the live drafts; padding past
            ``num_draft_tokens`` is never read), coins outside ``[0, 1)``, ``num_draft_tokens`` outside ``[0, L]``,
            NaN/inf/negative target probabilities when ``debug`` is set, live rows of ``target_probs`` /
            ``draft_probs`` whose sum is off 1 by more than :func:`row_sum_tolerance`. Every message names the
            offending argument.
        TypeError: tensors that are not ``torch.Tensor``.
    """
    named = {
        "candidates": candidates,
        "target_probs": target_probs,
        "draft_probs": draft_probs,
        "uniforms": uniforms,
        "uniforms_final": uniforms_final,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = target_probs.device
    for name, t in named.items():
        _require(t.device == device, f"{name} is on {t.device} but target_probs is on {device}")
    _require(candidates.dim() == 2, f"candidates must be [B, L+1], got shape {tuple(candidates.shape)}")
    _require(
        candidates.dtype in (torch.int64, torch.int32),
        f"candidates must be int64 or int32, got {candidates.dtype}",
    )
    batch, slots = candidates.shape
    num_drafts = slots - 1
    _require(slots >= 1, "candidates must have at least one slot (the last committed token)")
    _require(
        target_probs.dim() == 3 and target_probs.shape[:2] == (batch, slots),
        f"target_probs must be [B, L+1, V] = [{batch}, {slots}, V] (B, L+1 from candidates), "
        f"got {tuple(target_probs.shape)}",
    )
    vocab = target_probs.shape[2]
    _require(vocab >= 1, f"target_probs must have a vocabulary of V >= 1 entries, got {tuple(target_probs.shape)}")
    _require(
        draft_probs.dim() == 3 and tuple(draft_probs.shape) == (batch, num_drafts, vocab),
        f"draft_probs must be [B, L, V] = [{batch}, {num_drafts}, {vocab}], got {tuple(draft_probs.shape)}",
    )
    for name in ("target_probs", "draft_probs", "uniforms", "uniforms_final"):
        _require(named[name].is_floating_point(), f"{name} must be a floating tensor, got {named[name].dtype}")
    _require(
        draft_probs.dtype == target_probs.dtype,
        f"draft_probs dtype must match target_probs ({target_probs.dtype}), got {draft_probs.dtype}",
    )
    _require(
        tuple(uniforms.shape) == (batch, num_drafts),
        f"uniforms must be [B, L] = [{batch}, {num_drafts}], got {tuple(uniforms.shape)}",
    )
    _require(
        tuple(uniforms_final.shape) == (batch,),
        f"uniforms_final must be [B] = [{batch}], got {tuple(uniforms_final.shape)}",
    )
    drafts = candidates[:, 1:].to(torch.int64)
    last = candidates[:, 0]
    _require(
        bool(((last >= 0) & (last < vocab)).all()),
        f"candidates holds token ids outside [0, V) = [0, {vocab}) in slot 0 (the last committed token)",
    )
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((batch,), num_drafts, dtype=torch.int64, device=device)
    else:
        _require(
            isinstance(num_draft_tokens, torch.Tensor) and tuple(num_draft_tokens.shape) == (batch,),
            f"num_draft_tokens must be a [B] = [{batch}] integer tensor",
        )
        _require(not num_draft_tokens.is_floating_point(), "num_draft_tokens must be an integer tensor")
        num_draft_tokens = num_draft_tokens.to(device=device, dtype=torch.int64)
        _require(
            bool(((num_draft_tokens >= 0) & (num_draft_tokens <= num_drafts)).all()),
            f"num_draft_tokens must lie in [0, L] = [0, {num_drafts}]",
        )
    if num_drafts > 0:
        live = torch.arange(num_drafts, device=device)[None, :] < num_draft_tokens[:, None]
        bad_ids = live & ((drafts < 0) | (drafts >= vocab))
        _require(not bool(bad_ids.any()), f"candidates holds token ids outside [0, V) = [0, {vocab}) among the drafts")
        # padding past num_draft_tokens is never read: stand it in by id 0 so gathers stay in range
        drafts = torch.where(live, drafts, torch.zeros_like(drafts))
    uniforms64 = uniforms.to(torch.float64)
    final64 = uniforms_final.to(torch.float64)
    for name, u in (("uniforms", uniforms64), ("uniforms_final", final64)):
        _require(bool(((u >= 0) & (u < 1)).all()), f"{name} must lie in [0, 1)")
    target64 = sanitize_probs(target_probs, "target_probs", strict=debug)
    draft64 = sanitize_probs(draft_probs, "draft_probs", strict=False)
    if check_sums:
        tolerance = row_sum_tolerance(target_probs.dtype)
        rows = torch.arange(slots, device=device)[None, :]
        check_row_sums(target64, rows <= num_draft_tokens[:, None], "target_probs", tolerance)
        check_row_sums(draft64, rows[:, :num_drafts] < num_draft_tokens[:, None], "draft_probs", tolerance)
    return VerifyInputs(
        drafts=drafts,
        target_probs=target64,
        draft_probs=draft64,
        uniforms=uniforms64,
        uniforms_final=final64,
        num_draft_tokens=num_draft_tokens,
    )


def sample_from_unnormalized(
    weights: torch.Tensor, fallback: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sampling from unnormalised non-negative weights, driven by the given coins.

    Picks, per row, the smallest index ``j`` with ``cumsum(weights)[j] > u * sum(weights)``: a token of zero
    weight is never chosen. Rows whose total mass is zero (or not finite) sample from ``fallback`` instead
    (the spec's rule: a zero-mass residual falls back to p, never to a fixed token id).

    Args:
        weights: ``[N, V]`` float64, non-negative.
        fallback: ``[N, V]`` float64, non-negative, positive mass (the target row).
        uniforms: ``[N]`` float64 coins in ``[0, 1)``.

    Returns:
        ``[N] int64`` token ids.

    Raises:
        ValueError: if a row of ``fallback`` also has zero mass.
    """
    mass = weights.sum(dim=-1)
    use_fallback = ~(mass > 0) | ~torch.isfinite(mass)
    if bool(use_fallback.any()):
        weights = torch.where(use_fallback[:, None], fallback, weights)
        mass = weights.sum(dim=-1)
        if not bool((mass > 0).all()):
            raise ValueError("target_probs has a row with zero total mass: nothing can be sampled")
    cdf = weights.cumsum(dim=-1)
    threshold = (uniforms * mass)[:, None]
    idx = (cdf <= threshold).sum(dim=-1)
    # Rounding can push the threshold to (or past) the last cumulative value: take the last token with mass.
    last_positive = (weights > 0).to(torch.int64).cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(idx, last_positive)


def draft_token_ratio(p_tok: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """``p(X) / q(X)`` per drafted token (float64, uncapped) with the spec's ``q = 0`` rule (section 5):
    ratio 1 if ``p(X) > 0``, else 0. Chain caps it at 1; block caps the running product instead."""
    return torch.where(q_tok > 0, p_tok / q_tok.clamp_min(1e-300), (p_tok > 0).to(torch.float64))


def single_path_inputs(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor) -> VerifyInputs:
    """A one-request :class:`VerifyInputs` (no coins) for the round-law functions.

    Args:
        target_probs: ``[L+1, V]``; draft_probs: ``[L, V]``; drafts: ``[L] int64``.
    """
    num_slots = drafts.shape[0]
    return VerifyInputs(
        drafts=drafts[None].to(torch.int64),
        target_probs=target_probs[None].to(torch.float64),
        draft_probs=draft_probs[None].to(torch.float64),
        uniforms=torch.zeros(1, num_slots, dtype=torch.float64),
        uniforms_final=torch.zeros(1, dtype=torch.float64),
        num_draft_tokens=torch.tensor([num_slots]),
    )


def gather_tokens(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``probs[..., i, tokens[..., i]]``: the probability of each drafted token under its own row.

    Args:
        probs: ``[B, L, V]`` float; tokens: ``[B, L]`` int64 ids in ``[0, V)``.

    Returns:
        ``[B, L]`` of ``probs``'s dtype.
    """
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def pack_output(inputs: VerifyInputs, accept_len: torch.Tensor, extra: torch.Tensor) -> VerifyOutput:
    """The single-path :class:`VerifyOutput` of a round: the ``tau`` accepted drafts, then the extra token.

    Args:
        inputs: the validated batch (its ``drafts [B, L] int64``).
        accept_len: ``[B] int64`` tau per request.
        extra: ``[B] int64`` the extra (correction or bonus) token per request.

    Returns:
        ``accept_len [B] int32`` and ``output_tokens [B, L+1] int32`` padded with -1 after slot tau.
    """
    batch, num_slots = inputs.batch_size, inputs.num_slots
    device = accept_len.device
    cols = torch.arange(num_slots + 1, device=device)[None, :]
    padded = torch.cat([inputs.drafts, inputs.drafts.new_zeros(batch, 1)], dim=1)
    out = torch.where(cols < accept_len[:, None], padded, torch.full_like(padded, -1))
    out = torch.where(cols == accept_len[:, None], extra[:, None], out)
    return VerifyOutput(accept_len=accept_len.to(torch.int32), output_tokens=out.to(torch.int32))


def normalized_extra_laws(inputs: VerifyInputs, residual_rows) -> torch.Tensor:
    """For each ``tau`` in ``0..L``, the normalised law the extra token is sampled from (zero mass -> ``p``).

    Args:
        inputs: a one-request batch (:func:`single_path_inputs`).
        residual_rows: ``(inputs, accept_len [1] int64) -> (residual [1, V], target_row [1, V])`` float64, the
            rule's unnormalised extra-token law and the target row it falls back to.

    Returns:
        ``[L+1, V] float64``, rows summing to 1.
    """
    dists = []
    for i in range(inputs.num_slots + 1):
        residual, target_row = residual_rows(inputs, torch.tensor([i]))
        res = residual[0] if residual[0].sum() > 0 else target_row[0]
        dists.append(res / res.sum())
    return torch.stack(dists)
