"""Greedy multi-path block verification (GBV), float64 PyTorch reference.

Thomas & Pal, "Greedy Multi-Path Block Verification" (arXiv 2602.16961); docs/design/specs/verification.md section 3.

K draft paths of length L are sampled i.i.d. from q. At every node ``u`` of the walk the vocabulary is ranked by
the key ``(p(x|u) / q(x|u), token_id)`` ascending (one strict total order, used both for the cumulative mass
and for choosing the child), the walk follows the child with the LARGEST key, and the law of "the top-ranked
of K i.i.d. paths" is, with ``r`` the mass ranked strictly below the current prefix divided by the prefix's
draft probability (``r = 0`` at the root) and ``c_u(x)`` the inclusive cumulative q mass::

    q_G(x|u) = q(x|u) * S_K(r + c_u(x), r + c_u(x) - q(x|u)) / S_K(r + 1, r),
    S_K(a, b) = sum_{i=0}^{K-1} a^i b^(K-1-i),       r <- (r + c_u(t) - q(t|u)) / q(t|u).

Block verification (:mod:`.block`) then runs on the reached path with ``q_G`` in place of ``q`` everywhere.
K = 1 reduces exactly to block verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block import block_verify_checked
from .common import VerifyInputs, check_inputs, check_row_sums, row_sum_tolerance

__all__ = ["GBVOutput", "gbv_verify", "gbv_select", "power_sum"]


@dataclass
class GBVOutput:
    """Result of GBV: ``accept_len [B] int32``, ``output_tokens [B, L+1] int32``, ``chosen_path [B] int32``."""

    accept_len: torch.Tensor
    output_tokens: torch.Tensor
    chosen_path: torch.Tensor


def power_sum(a: torch.Tensor, b: torch.Tensor, num_paths: int) -> torch.Tensor:
    """``S_K(a, b) = sum_{i=0}^{K-1} a^i b^(K-1-i)`` (= ``(a^K - b^K) / (a - b)`` without the cancellation)."""
    total = torch.zeros_like(a)
    for i in range(num_paths):
        total = total + a**i * b ** (num_paths - 1 - i)
    return total


def ranking_keys(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """Order of the vocabulary by ``(p/q, token_id)`` ascending: ``[V] int64`` token ids, lowest key first.

    Ratios are computed in float64, which orders float32 / bfloat16 inputs exactly. Tokens with ``q = 0`` get
    ratio ``+inf`` (they carry no q mass, so their place does not change any cumulative sum).
    """
    ratio = torch.where(
        draft_row > 0, target_row / draft_row.clamp_min(1e-300), torch.full_like(target_row, float("inf"))
    )
    return torch.sort(ratio, stable=True).indices  # stable: equal ratios keep ascending token ids


def _choose_child(children: torch.Tensor, rank: torch.Tensor) -> int:
    """The child with the largest key: ``rank`` is each token's position in the ascending key order."""
    return int(children[rank[children].argmax()])


def gbv_select(
    drafts: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor, tolerance: float | None = None,
    request: int = 0,
) -> tuple[int, torch.Tensor]:
    """The GBV walk for ONE request: which path is chosen and the ``q_G`` rows along it.

    Args:
        drafts: ``[K, L] int64`` the K drafted paths (without slot 0).
        target_probs: ``[K, L+1, V]`` float64, ``p`` at every node of every path.
        draft_probs: ``[K, L, V]`` float64, ``q`` at every node of every path.
        tolerance: when given, the q row of every walked node must sum to 1 within it (``ValueError`` naming
            ``draft_probs`` otherwise; ``request`` is the batch index reported).

    Returns:
        ``(chosen, q_g [L, V] float64)``: the lowest path index equal to the reached path, and the laws
        ``q_G(. | X^i)`` for ``i = 0..L-1``.
    """
    num_paths, num_slots = drafts.shape
    consistent = torch.ones(num_paths, dtype=torch.bool)
    r = torch.zeros((), dtype=torch.float64)
    rows = []
    for depth in range(num_slots):
        k0 = int(consistent.nonzero()[0])
        p_row, q_row = target_probs[k0, depth], draft_probs[k0, depth]
        if tolerance is not None:
            check_row_sums(q_row[None], torch.ones(1, dtype=torch.bool), "draft_probs", tolerance,
                           f"{request}, {k0}, {depth}, ")
        order = ranking_keys(p_row, q_row)
        cum = torch.empty_like(q_row)
        cum[order] = q_row[order].cumsum(0)
        rows.append(q_row * power_sum(r + cum, r + cum - q_row, num_paths) / power_sum(r + 1, r, num_paths))
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.shape[0])
        children = drafts[consistent, depth]
        child = _choose_child(children, rank)
        if not q_row[child] > 0:
            raise ValueError(f"draft_probs gives zero probability to drafted token {child} at depth {depth}: "
                             "GBV paths must be sampled from q")
        r = (r + cum[child] - q_row[child]) / q_row[child]
        consistent &= drafts[:, depth] == child
    chosen = int(consistent.nonzero()[0])
    q_g = torch.stack(rows) if rows else draft_probs.new_zeros(0, target_probs.shape[-1])
    return chosen, q_g


def _check_gbv_shapes(candidates, target_probs, draft_probs, uniforms, uniforms_final) -> None:
    """The multi-path layout, checked before anything is reshaped (as the compiled op does): a wrong K, or
    ``[K, B, ...]`` tensors holding the same B x K rows, would otherwise reshape into wrong rows silently."""
    for name, t in (("candidates", candidates), ("target_probs", target_probs), ("draft_probs", draft_probs),
                    ("uniforms", uniforms), ("uniforms_final", uniforms_final)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if candidates.dim() != 3:
        raise ValueError(f"candidates must be [B, K, L+1] for GBV, got shape {tuple(candidates.shape)}")
    batch, num_paths, slots = candidates.shape
    if num_paths < 1 or slots < 1:
        raise ValueError(f"candidates must hold K >= 1 paths of L+1 >= 1 slots, got shape {tuple(candidates.shape)}")
    if target_probs.dim() != 4 or tuple(target_probs.shape[:3]) != (batch, num_paths, slots):
        raise ValueError(f"target_probs must be [B, K, L+1, V] = [{batch}, {num_paths}, {slots}, V] (B, K, L+1 from "
                         f"candidates), got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[3]
    if vocab < 1:
        raise ValueError(f"target_probs must have a vocabulary of V >= 1 entries, got {tuple(target_probs.shape)}")
    if tuple(draft_probs.shape) != (batch, num_paths, slots - 1, vocab):
        raise ValueError(f"draft_probs must be [B, K, L, V] = [{batch}, {num_paths}, {slots - 1}, {vocab}], got "
                         f"{tuple(draft_probs.shape)}")
    if tuple(uniforms.shape) != (batch, slots - 1):
        raise ValueError(f"uniforms must be [B, L] = [{batch}, {slots - 1}], got {tuple(uniforms.shape)}")
    if tuple(uniforms_final.shape) != (batch,):
        raise ValueError(f"uniforms_final must be [B] = [{batch}], got {tuple(uniforms_final.shape)}")


def gbv_verify(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    debug: bool = False,
) -> GBVOutput:
    """Greedy multi-path block verification on a batch, driven by the given coins (float64 reference).

    Args:
        candidates: ``[B, K, L+1] int64``; slot 0 the last committed token, slots 1..L path ``k``'s drafts.
        target_probs: ``[B, K, L+1, V]`` float; row ``i`` of path ``k`` = ``p(. | X_k^i)`` (rows of shared
            prefixes repeat).
        draft_probs: ``[B, K, L, V]`` float; ``q(. | X_k^i)``.
        uniforms: ``[B, L]`` coins of block verification on the chosen path.
        uniforms_final: ``[B]`` coin of the extra token.
        debug: raise on NaN/inf/negative target probabilities instead of zeroing them.

    Returns:
        :class:`GBVOutput` (``accept_len [B]``, ``output_tokens [B, L+1]``, ``chosen_path [B]``, int32).

    Raises:
        ValueError: wrong ranks / shapes (checked on the ``[B, K, ...]`` layout before any reshape, so ``[K, B,
            ...]`` tensors are refused), dtypes, devices, ids outside ``[0, V)``, coins outside ``[0, 1)``, a row
            the output depends on -- the chosen path's ``p`` rows ``0..L``, the ``q`` rows of the walked nodes --
            whose sum is off 1 by more than :func:`~specadapt.verification.common.row_sum_tolerance` (rows of
            other nodes are never read); the message names the argument.
        TypeError: an argument that is not a tensor.
    """
    _check_gbv_shapes(candidates, target_probs, draft_probs, uniforms, uniforms_final)
    batch, num_paths, slots = candidates.shape
    flat = check_inputs(
        candidates.reshape(batch * num_paths, slots),
        target_probs.reshape(batch * num_paths, *target_probs.shape[2:]),
        draft_probs.reshape(batch * num_paths, *draft_probs.shape[2:]),
        uniforms.repeat_interleave(num_paths, dim=0),
        uniforms_final.repeat_interleave(num_paths, dim=0),
        debug=debug,
        check_sums=False,  # only the walked path's rows can change the output: checked below
    )
    tolerance = row_sum_tolerance(target_probs.dtype)
    vocab = flat.target_probs.shape[-1]
    drafts = flat.drafts.reshape(batch, num_paths, slots - 1)
    p_all = flat.target_probs.reshape(batch, num_paths, slots, vocab)
    q_all = flat.draft_probs.reshape(batch, num_paths, slots - 1, vocab)
    chosen = torch.zeros(batch, dtype=torch.int64)
    q_g = torch.zeros(batch, slots - 1, vocab, dtype=torch.float64)
    for b in range(batch):
        k, rows = gbv_select(drafts[b].cpu(), p_all[b].cpu(), q_all[b].cpu(), tolerance, b)
        check_row_sums(p_all[b, k], torch.ones(slots, dtype=torch.bool, device=p_all.device), "target_probs",
                       tolerance, f"{b}, {k}, ")
        chosen[b] = k
        if slots > 1:
            q_g[b] = rows
    device = flat.target_probs.device
    chosen = chosen.to(device)
    rows_b = torch.arange(batch, device=device)
    inputs = VerifyInputs(
        drafts=drafts[rows_b, chosen],
        target_probs=p_all[rows_b, chosen],
        draft_probs=q_g.to(device),
        uniforms=flat.uniforms[::num_paths],
        uniforms_final=flat.uniforms_final[::num_paths],
        num_draft_tokens=torch.full((batch,), slots - 1, dtype=torch.int64, device=device),
    )
    out = block_verify_checked(inputs)
    return GBVOutput(out.accept_len, out.output_tokens, chosen.to(torch.int32))
