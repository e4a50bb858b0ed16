"""Choosing how many draft tokens each request verifies (specs/adaptive_verification.md section 5).

Survival ``S[r, k] = prod_{j <= k} p_j(r)`` is the estimated probability that draft ``k`` of request ``r`` is
accepted. With ``B`` draft slots verified across the batch, expected tokens are ``E(B) = N_req + (sum of the B
largest survivals)`` and the cost is ``C(B) = draft_ms(N_req) + verify_ms(T + B)``; the budget is
``B* = argmax E(B) / C(B)`` (smallest on ties) and the global top-B* slots are verified — a contiguous prefix
of each request, because survival never increases along a request.

Exactness: whether draft ``k`` is verified must not depend on the token drawn at ``k``. Survival at ``k`` depends
only on ``X_<k``; the request's later slots rank below slot ``k``; so the top-B* split is independent of ``X_k``
as long as ``B*`` itself is not computed from the live survivals of this step. The engine therefore chooses
``B*`` from the previous step's survivals (the spec's "one-step-stale" option).
"""

from __future__ import annotations

import torch

from .costs import CostTable

__all__ = ["survival", "choose_budget", "allocate_prefixes"]


def survival(accept_probs: torch.Tensor, num_drafts: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, K]`` per-position acceptance probabilities -> ``[R, K]`` cumulative products (0 past ``num_drafts``)."""
    s = accept_probs.to(torch.float64).clamp(0.0, 1.0).cumprod(dim=1)
    if num_drafts is not None:
        k = torch.arange(s.shape[1], device=s.device)[None, :]
        s = torch.where(k < num_drafts.to(s.device)[:, None], s, torch.zeros_like(s))
    return s


def choose_budget(survivals: torch.Tensor, costs: CostTable, non_draft_tokens: int | None = None) -> int:
    """``B* = argmax_B E(B) / C(B)`` over ``B = 0..R*K`` (smallest B on ties).

    Args:
        survivals: ``[R, K]`` survival products.
        costs: the cost table.
        non_draft_tokens: T, tokens the target processes besides drafts (default R: one per request).
    """
    num_requests = survivals.shape[0]
    t = num_requests if non_draft_tokens is None else non_draft_tokens
    ranked = survivals.flatten().sort(descending=True).values
    best_b, best_rate = 0, None
    expected = float(num_requests)
    draft = costs.draft_cost(num_requests)
    for b in range(0, ranked.numel() + 1):
        if b > 0:
            expected += float(ranked[b - 1])
        rate = expected / (draft + costs.verify_cost(t + b))
        if best_rate is None or rate > best_rate:
            best_b, best_rate = b, rate
    return best_b


def allocate_prefixes(survivals: torch.Tensor, budget: int) -> torch.Tensor:
    """Per-request draft counts ``[R] int64`` from the global top-``budget`` slots.

    Slots are ranked by survival (descending), ties by position then request, so each request gets a
    contiguous prefix.
    """
    num_requests, k = survivals.shape
    if budget <= 0:
        return torch.zeros(num_requests, dtype=torch.int64)
    flat = survivals.flatten().to(torch.float64)
    position = torch.arange(k).repeat(num_requests).to(torch.float64)
    request = torch.arange(num_requests).repeat_interleave(k).to(torch.float64)
    # lexicographic (−survival, position, request) via stable sorts, least significant key first
    order = torch.argsort(request, stable=True)
    order = order[torch.argsort(position[order], stable=True)]
    order = order[torch.argsort(-flat[order], stable=True)]
    chosen = order[: min(budget, flat.numel())]
    counts = torch.bincount((chosen // k), minlength=num_requests)
    return counts.to(torch.int64)
