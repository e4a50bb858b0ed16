"""Logits -> sampling distribution: the temperature / top-k / top-p transform shared by target and draft.

Lossless speculative sampling needs the draft to sample from exactly the distribution ``q`` that verification
sees, and the target's ``p`` to be the distribution plain decoding would sample from. Both go through
:func:`logits_to_probs`: the fused CPU op ``specadapt::sampling_probs`` (csrc/cpu/sampling_cpu.cpp; no full sort
of the vocabulary for top-p) where it is built, else :func:`logits_to_probs_reference`, the same rule in PyTorch.
Tokens are drawn from those rows by inverse CDF with explicit coins (:func:`sample_from_probs`), so a request's
draws can come from its own random stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams", "logits_to_probs", "logits_to_probs_reference",
           "sample_from_probs"]

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


def _fused(name: str, device: torch.device) -> bool:
    from . import kernels

    return device.type == "cpu" and kernels.has_op_for(name, device)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the distribution tokens are sampled from.

    Args:
        logits: ``[..., V]`` float (any float dtype; computed in float32).
        params: the run's :class:`SamplingParams`.

    Returns:
        ``[..., V] float32`` probabilities summing to 1 over the last axis. Greedy (temperature below
        :data:`GREEDY_TEMPERATURE`) gives one-hot rows (lowest id on ties).
        Top-k keeps ties at the k-th value; top-p keeps the smallest prefix of the distribution ranked by
        probability (lower id first on ties) whose mass reaches ``top_p`` (at least one token).
    """
    if logits.numel() and _fused("sampling_probs", logits.device):
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1]).float()
        out = torch.ops.specadapt.sampling_probs(flat, float(params.temperature), int(params.top_k),
                                                 float(params.top_p))
        return out.reshape(shape)
    return logits_to_probs_reference(logits, params)


def logits_to_probs_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`logits_to_probs` in PyTorch operations (any device; the fused op's reference). Equal to the op's
    rows up to float rounding; the top-p cut can differ only where the ranked mass lands within rounding of
    ``top_p``."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with given coins.

    Args:
        probs: ``[R, V]`` float32 non-negative rows (need not be normalised).
        uniforms: ``[R]`` coins in ``[0, 1)`` (float64).

    Returns:
        ``[R] int64``: per row the smallest id whose cumulative mass exceeds ``u * total`` (zero-probability ids
        are never chosen).

    Raises:
        ValueError / RuntimeError: a row without positive mass, coins outside ``[0, 1)``, mismatched shapes.
    """
    if probs.dim() != 2 or uniforms.shape != (probs.shape[0],):
        raise ValueError(f"probs must be [R, V] and uniforms [R], got {tuple(probs.shape)} and {tuple(uniforms.shape)}")
    if probs.shape[0] and _fused("sample_tokens", probs.device):
        return torch.ops.specadapt.sample_tokens(probs.float().contiguous(), uniforms.double())
    from .verification.common import sample_from_unnormalized

    p = probs.double()
    return sample_from_unnormalized(p, p, uniforms.double().to(p.device))
