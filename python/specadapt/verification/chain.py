"""Token-level rejection sampling ("chain"), float64 PyTorch reference.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding" (ICML 2023), Algorithm 1;
Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling" (2023). docs/design/specs/verification.md
section 1.

Draft ``i`` is accepted iff ``u_i * q(X_i) < p(X_i)`` (accept with probability ``min(1, p/q)``); on the first
rejection at ``i`` the extra token is drawn from ``norm(max(p - q, 0))`` of that position; if every draft is
accepted, the bonus token is drawn from ``p(. | X^L)``. The strict comparison makes ``q(X_i) = 0`` accept iff
``p(X_i) > 0`` (spec section 5) and never accepts a token the target gives zero mass.
"""

from __future__ import annotations

import torch

from .common import (
    VerifyInputs,
    VerifyOutput,
    check_inputs,
    draft_token_ratio,
    gather_tokens,
    normalized_extra_laws,
    pack_output,
    sample_from_unnormalized,
    single_path_inputs,
)

__all__ = ["chain_verify", "chain_round_law"]


def chain_acceptance(inputs: VerifyInputs) -> torch.Tensor:
    """Per-position acceptance probabilities ``min(1, p(X_i) / q(X_i))`` as ``[B, L] float64``.

    Positions past ``num_draft_tokens`` get 0. ``q(X_i) = 0`` gives 1 when ``p(X_i) > 0``, else 0.
    """
    num_slots = inputs.num_slots
    if num_slots == 0:
        return inputs.uniforms.new_zeros(inputs.batch_size, 0)
    p_tok = gather_tokens(inputs.target_probs[:, :num_slots], inputs.drafts)
    q_tok = gather_tokens(inputs.draft_probs, inputs.drafts)
    ratio = draft_token_ratio(p_tok, q_tok)
    live = torch.arange(num_slots, device=ratio.device)[None, :] < inputs.num_draft_tokens[:, None]
    return torch.where(live, ratio.clamp(max=1.0), torch.zeros_like(ratio))


def chain_verify(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    debug: bool = False,
) -> VerifyOutput:
    """Token-level rejection sampling on a batch, driven by the given coins (float64 reference).

    Args:
        candidates: ``[B, L+1] int64``; slot 0 the last committed token, slots 1..L the drafts.
        target_probs: ``[B, L+1, V]`` float; row ``i`` = ``p(. | X^i)``.
        draft_probs: ``[B, L, V]`` float; row ``i`` = ``q(. | X^i)``.
        uniforms: ``[B, L]`` coins in ``[0, 1)``, one per draft position.
        uniforms_final: ``[B]`` coins in ``[0, 1)`` for the extra token (inverse CDF).
        num_draft_tokens: optional ``[B]`` int, drafts actually proposed per request (``<= L``).
        debug: raise on NaN/inf/negative target probabilities instead of zeroing them.

    Returns:
        :class:`VerifyOutput` with ``accept_len [B] int32`` and ``output_tokens [B, L+1] int32``.

    Raises:
        ValueError / TypeError: see :func:`specadapt.verification.common.check_inputs`.
    """
    inputs = check_inputs(
        candidates, target_probs, draft_probs, uniforms, uniforms_final, num_draft_tokens, debug
    )
    batch, num_slots = inputs.batch_size, inputs.num_slots
    device = inputs.target_probs.device
    if num_slots > 0:
        p_tok = gather_tokens(inputs.target_probs[:, :num_slots], inputs.drafts)
        q_tok = gather_tokens(inputs.draft_probs, inputs.drafts)
        live = torch.arange(num_slots, device=device)[None, :] < inputs.num_draft_tokens[:, None]
        accepted = (inputs.uniforms * q_tok < p_tok) & live
        accept_len = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        accept_len = torch.zeros(batch, dtype=torch.int64, device=device)

    residual, target_row = chain_residual_rows(inputs, accept_len)
    extra = sample_from_unnormalized(residual, target_row, inputs.uniforms_final)
    return pack_output(inputs, accept_len, extra)


def chain_residual_rows(inputs: VerifyInputs, accept_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised law of the extra token given ``tau`` and the target row it falls back to.

    Returns:
        ``(residual [B, V], target_row [B, V])`` float64: ``max(p - q, 0)`` at row ``tau`` after a rejection,
        ``p(. | X^L)`` (bonus) when every live draft was accepted.
    """
    rows = torch.arange(inputs.batch_size, device=accept_len.device)
    target_row = inputs.target_probs[rows, accept_len]
    if inputs.num_slots == 0:
        return target_row, target_row
    rejected = accept_len < inputs.num_draft_tokens
    draft_row = inputs.draft_probs[rows, accept_len.clamp(max=inputs.num_slots - 1)]
    residual = torch.where(rejected[:, None], (target_row - draft_row).clamp_min(0.0), target_row)
    return residual, target_row


def chain_round_law(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact law of one chain round for ONE fixed draft path, with the coins integrated out.

    Args:
        target_probs: ``[L+1, V]`` float64 rows ``p(. | X^i)``.
        draft_probs: ``[L, V]`` float64 rows ``q(. | X^i)``.
        drafts: ``[L] int64`` the drafted path.

    Returns:
        ``(tau_probs [L+1], extra_dists [L+1, V])``: ``P(tau = i)`` and the normalised law of the extra
        token given ``tau = i`` (the same residual / fallback rule :func:`chain_verify` samples from).
    """
    num_slots = drafts.shape[0]
    inputs = single_path_inputs(target_probs, draft_probs, drafts)
    acc = chain_acceptance(inputs)[0]
    tau_probs = torch.zeros(num_slots + 1, dtype=torch.float64)
    reach = 1.0
    for i in range(num_slots):
        tau_probs[i] = reach * (1 - acc[i])
        reach = reach * acc[i]
    tau_probs[num_slots] = reach
    return tau_probs, normalized_extra_laws(inputs, chain_residual_rows)

