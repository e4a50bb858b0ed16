"""Low-rank adapters (Hu et al., LoRA, ICLR 2022) on a draft's own linear layers, for ``--tts-params lora``.

``y = W x + (alpha / r) * B (A x)`` with ``A [r, in]`` (small random init) and ``B [out, r]`` (zeros), so an
adapted draft starts out exactly equal to the original. Only ``A`` and ``B`` train; ``W`` stays frozen.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LoRALinear", "LoRASlots", "PerRequestLoRALinear", "add_lora", "add_per_request_lora", "find_lora_slots"]


class _AdaptedLinear(nn.Module):
    """What an adapted layer forwards from its frozen base ``nn.Linear`` (callers probe ``.weight`` etc.)."""

    base: nn.Linear

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features


class LoRALinear(_AdaptedLinear):
    """A frozen ``nn.Linear`` plus a trainable rank-``rank`` update.

    Args:
        base: the layer to adapt (its parameters are frozen, not copied).
        rank: adapter rank ``r`` (>= 1).
        alpha: scale numerator (the update is multiplied by ``alpha / rank``).

    Raises:
        ValueError: ``rank < 1``.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        base.requires_grad_(False)
        self.rank = rank
        self.scale = (alpha if alpha is not None else rank) / rank
        weight = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=weight.dtype, device=weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)


def add_lora(module: nn.Module, rank: int, prefixes: list[str]) -> list[str]:
    """Replace every ``nn.Linear`` under the named submodules of ``module`` by a :class:`LoRALinear`.

    Args:
        module: the draft module (changed in place).
        rank: adapter rank.
        prefixes: dotted names of the submodules whose linear layers get adapters (e.g. ``["layer"]``); ``""``
            means the whole module.

    Returns:
        The dotted names of the adapted layers.

    Raises:
        ValueError: a prefix that names no submodule, or no linear layer found.
    """
    names = dict(module.named_modules())
    adapted = []
    for prefix in prefixes:
        if prefix not in names:
            raise ValueError(f"no submodule {prefix!r} to adapt")
        root = names[prefix]
        targets = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Linear)]
        if isinstance(root, nn.Linear):
            targets = [("", root)]
        for name, linear in targets:
            full = ".".join(x for x in (prefix, name) if x)
            parent_name, _, attr = full.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, LoRALinear(linear, rank))
            adapted.append(full)
    if not adapted:
        raise ValueError(f"no nn.Linear under {prefixes}")
    return adapted


class LoRASlots:
    """Which adapter slot each batch row uses, shared by every :class:`PerRequestLoRALinear` of one module.

    ``rows`` is ``[B] int64``; a forward over ``m * B`` rows (e.g. ``m`` sampled paths per request, laid out
    request-major) uses each request's slot for its ``m`` consecutive rows.
    """

    def __init__(self) -> None:
        self.rows = torch.zeros(1, dtype=torch.int64)

    def for_batch(self, batch: int, device) -> torch.Tensor:
        rows = self.rows.to(device)
        if batch == rows.shape[0]:
            return rows
        if rows.shape[0] and batch % rows.shape[0] == 0:
            return rows.repeat_interleave(batch // rows.shape[0])
        raise ValueError(f"LoRA slots: a batch of {batch} rows does not fit {rows.shape[0]} request slots")


class PerRequestLoRALinear(_AdaptedLinear):
    """A frozen ``nn.Linear`` plus one rank-``rank`` adapter per request slot (``--tts-scope request``).

    ``y[b] = W x[b] + (alpha / r) * B[s_b] (A[s_b] x[b])`` with ``s_b = slots.rows[b]``.

    Args:
        base: the layer to adapt (frozen, not copied).
        rank: adapter rank; num_slots: adapters kept (the most concurrent requests);
        slots: the module's shared :class:`LoRASlots`.
    """

    def __init__(self, base: nn.Linear, rank: int, num_slots: int, slots: LoRASlots, alpha: float | None = None):
        super().__init__()
        if rank < 1 or num_slots < 1:
            raise ValueError(f"LoRA rank and slots must be >= 1, got {rank}, {num_slots}")
        self.base = base
        base.requires_grad_(False)
        self.rank = rank
        self.scale = (alpha if alpha is not None else rank) / rank
        self.slots = slots
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(num_slots, rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(num_slots, base.out_features, rank, dtype=w.dtype, device=w.device))
        self.reset_slots()

    @torch.no_grad()
    def reset_slots(self, slots: list[int] | None = None) -> None:
        """Slots back to a fresh adapter (``B = 0``: the layer equals its base): ``slots`` (indices) or all."""
        for s in range(self.lora_a.shape[0]) if slots is None else slots:
            nn.init.kaiming_uniform_(self.lora_a[s], a=math.sqrt(5))
            self.lora_b[s].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"per-request LoRA expects [B, n, in] inputs, got {tuple(x.shape)}")
        rows = self.slots.for_batch(x.shape[0], x.device)
        a, b = self.lora_a[rows], self.lora_b[rows]
        update = torch.einsum("bnr,bor->bno", torch.einsum("bni,bri->bnr", x, a), b)
        return self.base(x) + self.scale * update


def add_per_request_lora(module: nn.Module, rank: int, num_slots: int, prefixes: list[str]) -> LoRASlots:
    """Like :func:`add_lora` with :class:`PerRequestLoRALinear` layers sharing one :class:`LoRASlots`, which is
    returned (set its ``rows`` before each forward) and also stored as ``module.lora_slots``."""
    slots = LoRASlots()
    names = dict(module.named_modules())
    found = False
    for prefix in prefixes:
        if prefix not in names:
            raise ValueError(f"no submodule {prefix!r} to adapt")
        root = names[prefix]
        targets = [("", root)] if isinstance(root, nn.Linear) else [
            (n, m) for n, m in root.named_modules() if isinstance(m, nn.Linear)
        ]
        for name, linear in targets:
            full = ".".join(x for x in (prefix, name) if x)
            parent_name, _, attr = full.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, PerRequestLoRALinear(linear, rank, num_slots, slots))
            found = True
    if not found:
        raise ValueError(f"no nn.Linear under {prefixes}")
    module.__dict__["lora_slots"] = slots  # not a submodule; deep copies keep their own copy
    return slots


def find_lora_slots(module: nn.Module) -> LoRASlots | None:
    """The :class:`LoRASlots` of a module adapted by :func:`add_per_request_lora` (or of its deep copy)."""
    for m in module.modules():
        if isinstance(m, PerRequestLoRALinear):
            return m.slots
    return None
