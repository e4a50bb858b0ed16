"""Block verification, float64 PyTorch reference.

Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification Accelerates Speculative Decoding"
(arXiv 2403.10444), Algorithm 2; docs/design/specs/verification.md section 2.

With ``w_0 = 1`` and ``w_i = min(1, w_{i-1} p(X_i) / q(X_i))``, the rule tests every position (no early stop)
against ``h_i = Z_i / (Z_i + 1 - w_i)`` for ``i < L`` (``Z_i = sum_x max(w_i p(x|X^i) - q(x|X^i), 0)``) and
``h_L = w_L``; ``tau`` is the LAST index whose coin passes (``u_i < h_i``). The extra token is drawn from
``p(. | X^L)`` when ``tau = L`` and from ``norm(max(w_tau p(.|X^tau) - q(.|X^tau), 0))`` otherwise.
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

__all__ = ["block_verify", "block_round_law", "block_weights_and_thresholds", "residual_mass_reference"]


def residual_mass_reference(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``Z = sum_x max(w * p(x) - q(x), 0)`` per row: the block-verification residual reduction.

    Args:
        target_probs: ``[N, V]`` float, rows of ``p``.
        draft_probs: ``[N, V]`` float, rows of ``q``.
        weights: ``[N]`` float, the path weights ``w``.

    Returns:
        ``[N]`` in the promoted dtype of the inputs (float64 in the reference).
    """
    return (weights[:, None] * target_probs - draft_probs).clamp_min(0.0).sum(dim=-1)


def block_weights_and_thresholds(inputs: VerifyInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Path weights and pass thresholds of block verification.

    Returns:
        ``(weights [B, L+1], thresholds [B, L])`` in float64: ``weights[:, i] = w_i`` (``w_0 = 1``) and
        ``thresholds[:, i-1] = h_i``; ``h`` is 0 for positions past ``num_draft_tokens`` (they never pass)
        and ``h = w`` at the last live position.
    """
    batch, num_slots = inputs.batch_size, inputs.num_slots
    device = inputs.target_probs.device
    weights = torch.ones(batch, num_slots + 1, dtype=torch.float64, device=device)
    thresholds = torch.zeros(batch, num_slots, dtype=torch.float64, device=device)
    if num_slots == 0:
        return weights, thresholds
    p_tok = gather_tokens(inputs.target_probs[:, :num_slots], inputs.drafts)
    q_tok = gather_tokens(inputs.draft_probs, inputs.drafts)
    ratio = draft_token_ratio(p_tok, q_tok)
    n_live = inputs.num_draft_tokens
    for i in range(1, num_slots + 1):
        w = torch.minimum(weights[:, i - 1] * ratio[:, i - 1], torch.ones_like(ratio[:, 0]))
        weights[:, i] = w
        if i < num_slots:
            z = residual_mass_reference(inputs.target_probs[:, i], inputs.draft_probs[:, i], w)
            denom = z + 1.0 - w
            h_mid = torch.where(denom > 0, z / denom.clamp_min(1e-300), torch.ones_like(z))
        else:
            h_mid = w
        h = torch.where(i < n_live, h_mid, torch.where(i == n_live, w, torch.zeros_like(w)))
        thresholds[:, i - 1] = h.clamp(0.0, 1.0)
    return weights, thresholds


def _block_residual_rows(inputs: VerifyInputs, weights: torch.Tensor, accept_len: torch.Tensor):
    rows = torch.arange(inputs.batch_size, device=accept_len.device)
    target_row = inputs.target_probs[rows, accept_len]
    rejected = accept_len < inputs.num_draft_tokens
    if inputs.num_slots == 0:
        return target_row, target_row
    draft_row = inputs.draft_probs[rows, accept_len.clamp(max=inputs.num_slots - 1)]
    w_tau = weights[rows, accept_len]
    residual = torch.where(
        rejected[:, None], (w_tau[:, None] * target_row - draft_row).clamp_min(0.0), target_row
    )
    return residual, target_row


def block_verify(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    debug: bool = False,
) -> VerifyOutput:
    """Block verification on a batch, driven by the given coins (float64 reference).

    Args and shapes as :func:`specadapt.verification.chain.chain_verify`: ``candidates [B, L+1] int64``,
    ``target_probs [B, L+1, V]``, ``draft_probs [B, L, V]``, ``uniforms [B, L]``, ``uniforms_final [B]``,
    optional ``num_draft_tokens [B]``.

    Returns:
        :class:`VerifyOutput` with ``accept_len [B] int32`` and ``output_tokens [B, L+1] int32``.

    Raises:
        ValueError / TypeError: see :func:`specadapt.verification.common.check_inputs`.
    """
    inputs = check_inputs(
        candidates, target_probs, draft_probs, uniforms, uniforms_final, num_draft_tokens, debug
    )
    return block_verify_checked(inputs)


def block_verify_checked(inputs: VerifyInputs) -> VerifyOutput:
    """Block verification on already validated float64 inputs (shared with GBV, which passes ``q_G`` rows)."""
    weights, thresholds = block_weights_and_thresholds(inputs)
    num_slots = inputs.num_slots
    passes = inputs.uniforms < thresholds  # strict: h = 0 never passes
    index = torch.arange(1, num_slots + 1, device=passes.device)[None, :]
    accept_len = (passes.to(torch.int64) * index).amax(dim=1) if num_slots > 0 else passes.new_zeros(
        inputs.batch_size, dtype=torch.int64
    )
    residual, target_row = _block_residual_rows(inputs, weights, accept_len)
    extra = sample_from_unnormalized(residual, target_row, inputs.uniforms_final)
    return pack_output(inputs, accept_len, extra)


def block_round_law(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact law of one block-verification round for ONE fixed draft path, coins integrated out.

    ``P(tau = i) = h_i * prod_{j > i} (1 - h_j)`` (``h_0 = 1``): tau is the last passing coin.

    Args:
        target_probs: ``[L+1, V]`` float64; draft_probs: ``[L, V]`` float64; drafts: ``[L] int64``.

    Returns:
        ``(tau_probs [L+1], extra_dists [L+1, V])`` as :func:`specadapt.verification.chain.chain_round_law`.
    """
    num_slots = drafts.shape[0]
    inputs = single_path_inputs(target_probs, draft_probs, drafts)
    weights, thresholds = block_weights_and_thresholds(inputs)
    h = torch.cat([torch.ones(1, dtype=torch.float64), thresholds[0]])
    tau_probs = torch.zeros(num_slots + 1, dtype=torch.float64)
    for i in range(num_slots + 1):
        tail = torch.prod(1 - h[i + 1 :]) if i < num_slots else torch.tensor(1.0, dtype=torch.float64)
        tau_probs[i] = h[i] * tail
    return tau_probs, normalized_extra_laws(inputs, lambda inp, tau: _block_residual_rows(inp, weights, tau))
