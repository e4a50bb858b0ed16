"""Low-rank adapters (Hu et al., LoRA, ICLR 2022) on a draft's own linear layers, for ``--tts-params lora``.

``y = W x + (alpha / r) * B (A x)`` with ``A [r, in]`` (small random init) and ``B [out, r]`` (zeros), so an
adapted draft starts out exactly equal to the original. Only ``A`` and ``B`` train; ``W`` stays frozen.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LoRALinear", "add_lora"]


class LoRALinear(nn.Module):
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

    @property
    def weight(self) -> torch.Tensor:  # some callers read .weight (dtype / device probes)
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

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
