"""Access to the compiled ops of ``specadapt._C`` with a logged fall-back to the float64 references.

The extension registers its ops with ``TORCH_LIBRARY`` under the ``specadapt::`` namespace; this module loads
it, registers the fake (meta) implementations used by ``torch.compile`` and ``torch.library.opcheck``, and
exposes Python functions that dispatch to the compiled op when it exists for the tensors' device, and to the
reference otherwise, saying so once in the log (never silently).
"""

from __future__ import annotations

import logging

import torch

from .verification.block import residual_mass_reference

logger = logging.getLogger(__name__)

__all__ = ["extension_available", "extension_error", "block_residual_mass", "has_op_for"]

try:
    from . import _C  # noqa: F401  (import registers the ops)

    _EXTENSION_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _EXTENSION_ERROR = str(exc)

_warned: set[str] = set()


def extension_available() -> bool:
    """True when ``specadapt._C`` was built and imported."""
    return _EXTENSION_ERROR is None


def extension_error() -> str | None:
    """Why the extension could not be imported (``None`` when it was)."""
    return _EXTENSION_ERROR


if extension_available():

    @torch.library.register_fake("specadapt::block_residual_mass")
    def _block_residual_mass_fake(target_probs, draft_probs, weights):
        torch._check(target_probs.dim() == 2)
        return target_probs.new_empty((target_probs.shape[0],), dtype=torch.float32)


def has_op_for(op_name: str, device: torch.device) -> bool:
    """Whether ``specadapt::<op_name>`` has a compiled kernel for ``device``'s dispatch key."""
    if not extension_available():
        return False
    key = "CUDA" if device.type == "cuda" else "CPU" if device.type == "cpu" else None
    if key is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"specadapt::{op_name}", key)


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(message)


def block_residual_mass(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Block-verification residual reduction ``Z[n] = sum_v max(w[n] p[n, v] - q[n, v], 0)``.

    Sun et al., arXiv 2403.10444, Algorithm 2 (the ``Z_i`` of specs/verification.md section 2).

    Args:
        target_probs: ``[N, V]`` float32 or bfloat16.
        draft_probs: ``[N, V]`` same dtype as ``target_probs``.
        weights: ``[N]`` float32.

    Returns:
        ``[N] float32``, accumulated in float32.

    Raises:
        RuntimeError: from the compiled op for wrong shapes / dtypes / devices (the message names the argument).
    """
    if has_op_for("block_residual_mass", target_probs.device):
        return torch.ops.specadapt.block_residual_mass(target_probs, draft_probs, weights)
    _warn_once(
        f"block_residual_mass:{target_probs.device.type}",
        f"specadapt::block_residual_mass has no compiled kernel for {target_probs.device.type} "
        f"({extension_error() or 'not built for this device'}); using the PyTorch reference",
    )
    return residual_mass_reference(target_probs.float(), draft_probs.float(), weights.float())
