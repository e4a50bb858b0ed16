"""Tensor-parallel layouts of SGLang's draft weights, for students that train on more than one TP rank.

With tensor parallelism T > 1 each rank serves a shard of every draft weight. The student on each rank gathers
the full tensors once (one all-gather per tensor, at installation, in the same order on every rank), trains a
full replica on the round's examples (identical on every rank: the target's logits and hidden states are
gathered before SGLang's verify), and at each publish copies *its own shard* of the trained tensors back into
the served storage in place. Layouts follow SGLang 0.5.23's parallel linear layers:

* ``rows`` -- ``ColumnParallelLinear`` / ``VocabParallelEmbedding`` / ``ParallelLMHead``: dim 0 split evenly;
* ``cols`` -- ``RowParallelLinear`` (``o_proj``, ``down_proj``): dim 1 split evenly;
* ``merged`` -- ``MergedColumnParallelLinear`` (``gate_up_proj``): each rank holds ``[gate_r; up_r]``;
* ``qkv`` -- ``QKVParallelLinear``: each rank holds ``[q_r; k_r; v_r]`` with ``H/T`` query heads and
  ``max(H_kv/T, 1)`` key/value heads (replicated over ``T/H_kv`` ranks when ``T > H_kv``);
* ``replicated`` -- norms, plain ``nn.Linear`` (EAGLE-3's ``fc``), row-parallel biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Layout", "TensorParallel", "shard", "unshard"]


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the draft's tensor-parallel group.

    Attributes:
        rank, size: rank in the group and group size.
        gather: ``tensor -> [tensor of rank 0, ..., of rank size-1]`` (an all-gather of same-shaped tensors).
        broadcast: in-place broadcast from rank 0 (publishes: every rank serves rank 0's trained replica, so
            floating-point differences between the ranks' replicas never mix in one served model), or ``None``.
    """

    rank: int
    size: int
    gather: Callable[[torch.Tensor], list]
    broadcast: Callable[[torch.Tensor], object] | None = None


@dataclass(frozen=True)
class Layout:
    """How one weight is split over TP ranks: ``kind`` in ``replicated | rows | cols | merged | qkv``; for
    ``merged`` the number of stacked parts; for ``qkv`` the total query / key-value heads and the head size."""

    kind: str = "replicated"
    parts: int = 2
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    def _qkv(self, size: int):
        if self.heads % size:
            raise ValueError(f"{self.heads} query heads do not split over {size} TP ranks")
        q = self.heads // size
        if size >= self.kv_heads:
            if size % self.kv_heads:
                raise ValueError(f"{self.kv_heads} key/value heads do not replicate over {size} TP ranks")
            kv, replicas = 1, size // self.kv_heads
        else:
            if self.kv_heads % size:
                raise ValueError(f"{self.kv_heads} key/value heads do not split over {size} TP ranks")
            kv, replicas = self.kv_heads // size, 1
        return q * self.head_dim, kv * self.head_dim, replicas

    def shard_rows(self, size: int) -> int | None:
        """Rows of one rank's ``qkv`` shard (``None`` for other kinds)."""
        if self.kind != "qkv":
            return None
        q, kv, _ = self._qkv(size)
        return q + 2 * kv


def unshard(layout: Layout, shards: list, size: int) -> torch.Tensor:
    """The full tensor from the ``size`` ranks' shards (rank order)."""
    if size == 1 or layout.kind == "replicated":
        return shards[0].clone() if size > 1 else shards[0]
    if layout.kind == "rows":
        return torch.cat(list(shards), dim=0)
    if layout.kind == "cols":
        return torch.cat(list(shards), dim=1)
    if layout.kind == "merged":
        chunks = [s.chunk(layout.parts, dim=0) for s in shards]
        return torch.cat([c[p] for p in range(layout.parts) for c in chunks], dim=0)
    if layout.kind == "qkv":
        q, kv, replicas = layout._qkv(size)
        owners = range(0, size, replicas)  # one rank per distinct key/value shard
        return torch.cat([s[:q] for s in shards] + [shards[r][q:q + kv] for r in owners]
                         + [shards[r][q + kv:q + 2 * kv] for r in owners], dim=0)
    raise ValueError(f"unknown layout {layout.kind!r}")


def shard(layout: Layout, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (the inverse of :func:`unshard`)."""
    if size == 1 or layout.kind == "replicated":
        return full
    if layout.kind == "rows":
        n = full.shape[0] // size
        return full[rank * n:(rank + 1) * n]
    if layout.kind == "cols":
        n = full.shape[1] // size
        return full[:, rank * n:(rank + 1) * n]
    if layout.kind == "merged":
        parts = full.chunk(layout.parts, dim=0)
        return torch.cat([p[rank * (p.shape[0] // size):(rank + 1) * (p.shape[0] // size)] for p in parts], dim=0)
    if layout.kind == "qkv":
        q, kv, replicas = layout._qkv(size)
        total_q = layout.heads * layout.head_dim
        total_kv = (full.shape[0] - total_q) // 2
        owner = rank // replicas
        return torch.cat([full[rank * q:(rank + 1) * q],
                          full[total_q + owner * kv:total_q + (owner + 1) * kv],
                          full[total_q + total_kv + owner * kv:total_q + total_kv + (owner + 1) * kv]], dim=0)
    raise ValueError(f"unknown layout {layout.kind!r}")
