"""Top-k truncation of the snapshot rows of Test-Time Speculation (``--tts-topk``; docs/design/specs/tts.md step 3: "or over
the target's top-k (flag) to save memory"). Snapshots keep ``k`` values and ids per supervised position instead of
a full vocabulary row; the trainer densifies them just before the loss."""

from __future__ import annotations

import torch

__all__ = ["top_k_rows", "dense_rows"]


def top_k_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``rows [C, V]``, renormalised to sum 1 (rows without mass stay 0).

    Returns:
        ``(values [C, k] float32, indices [C, k] int32)`` on ``rows``' device.

    Raises:
        ValueError: ``k`` outside ``[1, V]``.
    """
    if not 1 <= k <= rows.shape[-1]:
        raise ValueError(f"k (TTSConfig.topk) must lie in [1, V] = [1, {rows.shape[-1]}] to truncate, got {k}")
    values, indices = rows.float().topk(k, dim=-1)
    mass = values.sum(dim=-1, keepdim=True)
    values = torch.where(mass > 0, values / mass.clamp_min(1e-30), torch.zeros((), device=values.device))
    return values.contiguous(), indices.to(torch.int32).contiguous()


def dense_rows(values: torch.Tensor, indices: torch.Tensor | None, vocab: int | None) -> torch.Tensor:
    """``[C, vocab]`` rows with ``values`` at ``indices`` and zeros elsewhere; ``values`` itself when ``indices``
    is ``None`` (rows stored dense)."""
    if indices is None:
        return values
    out = torch.zeros(values.shape[0], vocab, dtype=values.dtype, device=values.device)
    return out.scatter_(1, indices.long(), values)
