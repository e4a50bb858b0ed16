"""The Test-Time Speculation loss (docs/design/specs/tts.md, step 3).

``L_t(q) = sum_k w_k KL(p_k || q_k) + lambda * sum_k w_k KL(q_t,k || q_k)``, with ``w_k = gamma^(k-1)`` over the
supervised canvas positions ``k = 1..C`` of one round, averaged over the rounds/requests in an update.
"""

from __future__ import annotations

import torch

__all__ = ["position_weights", "supervised_counts", "tts_loss"]

SUPERVISE_MODES = ("accepted", "canvas")


def supervised_counts(num_drafted: torch.Tensor, accept_len: torch.Tensor, mode: str) -> torch.Tensor:
    """How many canvas positions each round supervises.

    Args:
        num_drafted: ``[N] int64`` drafts verified per round (``L_r``).
        accept_len: ``[N] int64`` accepted drafts (``tau``).
        mode: ``accepted`` (positions up to the first rejection plus one: ``min(tau + 1, L_r)``) or ``canvas``
            (every verified position: the target's ``p`` is valid at all of them).

    Returns:
        ``[N] int64``.

    Raises:
        ValueError: unknown mode, or ``accept_len`` outside ``[0, num_drafted]``.
    """
    if mode not in SUPERVISE_MODES:
        raise ValueError(f"supervise mode must be one of {SUPERVISE_MODES}, got {mode!r}")
    if bool(((accept_len < 0) | (accept_len > num_drafted)).any()):
        raise ValueError("accept_len must lie in [0, num_drafted]")
    if mode == "canvas":
        return num_drafted.clone()
    return torch.minimum(accept_len + 1, num_drafted)


def position_weights(counts: torch.Tensor, width: int, gamma: float) -> torch.Tensor:
    """``[N, width] float32``: ``gamma^(k-1)`` for ``k <= counts[n]``, else 0.

    Raises:
        ValueError: ``gamma`` outside ``(0, 1]``.
    """
    if not 0 < gamma <= 1:
        raise ValueError(f"position decay gamma must lie in (0, 1], got {gamma}")
    k = torch.arange(width, dtype=torch.float32)
    weights = torch.pow(torch.tensor(gamma, dtype=torch.float32), k)[None, :].expand(counts.shape[0], width)
    return torch.where(k[None, :] < counts[:, None], weights, torch.zeros(()))


def _kl(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``sum_v p log(p / q)`` over the last axis, with ``0 log 0 = 0``."""
    return (torch.special.xlogy(p, p) - p * log_q).sum(dim=-1)


def tts_loss(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    weights: torch.Tensor,
    temperature: float = 1.0,
    proximal_probs: torch.Tensor | None = None,
    proximal_weight: float = 0.0,
) -> torch.Tensor:
    """The TTS objective of one update.

    Args:
        student_logits: ``[N, C, V] float`` the draft's logits at the canvas positions (differentiable).
        teacher_probs: ``[N, C, V]`` the target's ``p`` rows used by verification (rows sum to 1; rows of
            unsupervised positions may be anything finite).
        weights: ``[N, C]`` position weights (0 = not supervised).
        temperature: the run's temperature (``q = softmax(logits / T)``; ``T = 0`` uses ``T = 1``, since greedy
            drafting only needs the argmax).
        proximal_probs: ``[N, C, V]`` the rows ``q_t`` the round was drafted from, or ``None``.
        proximal_weight: ``lambda`` (>= 0).

    Returns:
        A scalar: ``sum_k w_k [KL(p_k||q_k) + lambda KL(q_t,k||q_k)]`` averaged over the N rounds.

    Raises:
        ValueError: mismatched shapes, a negative ``proximal_weight``, or ``proximal_weight > 0`` without
            ``proximal_probs``.
    """
    if student_logits.shape != teacher_probs.shape or weights.shape != student_logits.shape[:2]:
        raise ValueError(
            f"shapes differ: student {tuple(student_logits.shape)}, teacher {tuple(teacher_probs.shape)}, "
            f"weights {tuple(weights.shape)}"
        )
    if proximal_weight < 0:
        raise ValueError(f"proximal_weight must be >= 0, got {proximal_weight}")
    scale = temperature if temperature > 0 else 1.0
    log_q = torch.log_softmax(student_logits.float() / scale, dim=-1)
    per_position = _kl(teacher_probs.float(), log_q)
    if proximal_weight > 0:
        if proximal_probs is None or proximal_probs.shape != student_logits.shape:
            raise ValueError("proximal_weight > 0 needs proximal_probs of the student's shape")
        per_position = per_position + proximal_weight * _kl(proximal_probs.float(), log_q)
    per_position = torch.where(weights > 0, per_position, torch.zeros((), dtype=per_position.dtype))
    return (weights.to(per_position.dtype) * per_position).sum(dim=1).mean()
