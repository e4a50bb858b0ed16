"""Packed (variable-length) forwards over a ragged chunk: only the real tokens go through the model.

A ragged chunk is ``[B, n]`` token ids where row ``r`` holds ``num_valid[r]`` real tokens and ``n - num_valid[r]``
holes (pruned drafts, shorter prompts, smaller token trees). Run padded, every hole costs a full token of compute
in every projection, MLP and the LM head. Packed, the model sees one row of the ``N = sum(num_valid)`` real tokens
(``[1, N]`` ids, each with its own logical position), so all per-token work is done N times instead of ``B * n``.
Only attention needs the per-request layout (each request attends to its own KV cache row), so in every layer:

- the KV cache layer scatters the packed keys / values ``[1, H, N, D]`` into the chunk's ``[B, H, n, D]`` slots
  before appending them (holes hold zeros; the attention mask hides them);
- the attention function (registered with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME` and
  selected only for the duration of a packed forward) scatters the packed queries to ``[B, H, n, D]``, runs the
  model's own attention implementation (SDPA or eager) with the ``[B, 1, n, T + n]`` mask, and gathers the real
  tokens' outputs back to ``[1, N, H, D]``.

This module is part of the adapter layer (it registers into transformers); techniques never import it.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

__all__ = ["ATTENTION_NAME", "Packing", "packed_attention", "active_packing"]

ATTENTION_NAME = "specadapt_packed"

_ACTIVE: contextvars.ContextVar["Packing | None"] = contextvars.ContextVar("specadapt_packing", default=None)


@dataclass(frozen=True)
class Packing:
    """Where each packed token lives in the ``[B, n]`` chunk.

    Attributes:
        batch: B. width: n.
        flat: ``[N] int64`` indices into the row-major flattened chunk (``row * n + column``), ascending, so
            packed tokens are ordered by request, then by column.
        base_attention: name of the model's own attention implementation (``"sdpa"``, ``"eager"``, ...).
    """

    batch: int
    width: int
    flat: torch.Tensor
    base_attention: str

    @classmethod
    def from_valid(cls, valid: torch.Tensor, base_attention: str) -> "Packing":
        """Build from the chunk's ``[B, n] bool`` mask of real tokens."""
        batch, width = valid.shape
        return cls(batch, width, valid.reshape(-1).nonzero().squeeze(1), base_attention)

    def pack(self, chunk: torch.Tensor) -> torch.Tensor:
        """``[B, n, ...]`` -> ``[1, N, ...]`` (the real tokens, in order)."""
        return chunk.reshape(self.batch * self.width, *chunk.shape[2:]).index_select(0, self.flat)[None]

    def unpack(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[1, N, ...]`` -> ``[B, n, ...]`` with ``fill`` in the holes."""
        out = packed.new_full((self.batch * self.width, *packed.shape[2:]), fill)
        out.index_copy_(0, self.flat, packed[0])
        return out.view(self.batch, self.width, *packed.shape[2:])

    def unpack_heads(self, packed: torch.Tensor) -> torch.Tensor:
        """``[1, H, N, D]`` (attention layout) -> ``[B, H, n, D]`` with zeros in the holes."""
        return self.unpack(packed.transpose(1, 2)).transpose(1, 2)

    def activate(self) -> contextvars.Token:
        return _ACTIVE.set(self)

    @staticmethod
    def deactivate(token: contextvars.Token) -> None:
        _ACTIVE.reset(token)


def active_packing() -> Packing | None:
    """The packing of the forward now running in this context, or None (an ordinary padded forward)."""
    return _ACTIVE.get()


def packed_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function for packed forwards.

    Args:
        query: ``[1, H_q, N, D]`` packed queries. key, value: ``[B, H_kv, T + n, D]`` (the cache layer unpacked
            the new keys). attention_mask: ``[B, 1, n, T + n]`` additive mask of the ragged chunk.

    Returns:
        ``([1, N, H_q, D], None)`` like every transformers attention function.

    Raises:
        RuntimeError: called outside a packed forward (the implementation is only selected inside one).
    """
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    packing = _ACTIVE.get()
    if packing is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} used outside a packed forward")
    # "eager" is not in the registry: each modeling file defines its own (softcapping, sinks, ...); use the
    # attention module's, as the model itself would
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    base = ALL_ATTENTION_FUNCTIONS.get_interface(packing.base_attention, eager)
    if base is None:
        raise RuntimeError(f"no attention function {packing.base_attention!r} for {type(module).__name__}")
    output, weights = base(module, packing.unpack_heads(query), key, value, attention_mask, **kwargs)
    return packing.pack(output), weights  # output [B, n, H, D] -> [1, N, H, D]


def register() -> None:
    """Register :func:`packed_attention` with transformers (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
