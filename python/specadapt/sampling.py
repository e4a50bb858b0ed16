"""Logits -> sampling distribution: the temperature / top-k / top-p transform shared by target and draft.

Lossless speculative sampling needs the draft to sample from exactly the distribution ``q`` that verification
sees, and the target's ``p`` to be the distribution plain decoding would sample from. Both go through
:func:`logits_to_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams", "logits_to_probs"]

#: Temperatures below this are greedy (SGLang's ``_SAMPLING_EPS`` rule, so the plugin and the engine agree). Far
#: above the float32 overflow of ``logits / T`` (T <= ~1e-38 made every probability NaN), and far below any
#: temperature that samples differently from greedy except between logits closer than float32 resolves.
GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of a run.

    Attributes:
        temperature: >= 0; 0 means greedy (a one-hot distribution on the argmax, lowest id on ties). A
            temperature below :data:`GREEDY_TEMPERATURE` (1e-6) is greedy too and is stored as 0.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.

    Raises:
        ValueError: a negative, NaN or infinite temperature, ``top_p`` outside (0, 1], ``top_k < 0``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy: logits / T would overflow for tiny T
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the distribution tokens are sampled from.

    Args:
        logits: ``[..., V]`` float (any float dtype; computed in float32).
        params: the run's :class:`SamplingParams`.

    Returns:
        ``[..., V] float32`` probabilities summing to 1 over the last axis. Greedy (temperature below
        :data:`GREEDY_TEMPERATURE`) gives one-hot rows.
        Top-k keeps ties at the k-th value; top-p keeps the smallest prefix of the sorted distribution whose
        mass reaches ``top_p`` (at least one token).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
