"""Choosing how many draft tokens each request verifies (docs/design/specs/adaptive_verification.md section 5).

Survival ``S[r, k] = prod_{j <= k} p_j(r)`` is the estimated probability that draft ``k`` of request ``r`` is
accepted. With ``B`` draft slots verified across the batch, expected tokens are ``E(B) = N_req + (sum of the B
largest survivals)`` and the cost is ``C(B) = draft_ms(N_req) + verify_ms(T + B)`` (with early stop of
drafting, the draft term scales with the depth the budget reaches: see :func:`choose_budget`); the budget is
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


def choose_budget(survivals: torch.Tensor, costs: CostTable, non_draft_tokens: int | None = None,
                  draft_steps: int | None = None, zero_is_off: bool = False, overhead_ms: float = 0.0,
                  overhead_off_ms: float | None = None) -> int:
    """``B* = argmax_B E(B) / C(B)`` over ``B = 0..R*K`` (smallest B on ties).

    Args:
        survivals: ``[R, K]`` survival products.
        costs: the cost table.
        non_draft_tokens: T, tokens the target processes besides drafts (default R: one per request).
        draft_steps: ``None`` for the spec's cost ``C(B) = draft_ms(R) + verify_ms(T + B)`` (the draft always
            runs all its steps). With early stop of drafting (ours, :meth:`specadapt.budget.adaptive.
            AdaptiveVerification.draft_caps`) the draft runs only as deep as the budget reaches, so pass the
            number of steps ``draft_ms(R)`` was profiled for (L): drafting then costs
            ``draft_ms(R) * max(d(B), 1) / L``, where ``d(B)`` is the deepest position (1-based, 0 when
            ``B = 0``) among the top-B slots: a draft forward per drafted position, and at least the one that
            yields position 1's q rows (the draft's catch-up on the accepted tokens runs every round). The
            forward that would only show that slot ``d + 1`` is out of the budget is skipped by the look-ahead of
            :meth:`~specadapt.budget.adaptive.AdaptiveVerification.draft_caps` when its bound rules it out.
        zero_is_off: ``B = 0`` means speculation off for the next round (issue 16): it is costed as a plain
            target decode step, ``C(0) = verify_ms(T)``, with no draft work (the draft's catch-up is deferred to
            the round drafting resumes, where it is one chunked forward). ``False``: ``B = 0`` still pays the
            draft's round as above (the draft runs whatever the budget, e.g. in SGLang's draft graph).
        overhead_ms: ms a round costs beyond the table's forwards (sampling, verification, bookkeeping; the
            engine learns it online from measured rounds), added to every ``C(B)``; ``overhead_off_ms`` replaces
            it for ``B = 0`` when ``zero_is_off`` (a plain target step has less of it; ``None``: the same).

    Returns:
        ``B*`` (int, ``0 <= B* <= R*K``).

    Raises:
        ValueError: ``draft_steps < 1``.
    """
    num_requests, width = survivals.shape
    if draft_steps is not None and draft_steps < 1:
        raise ValueError(f"draft_steps must be >= 1, got {draft_steps}")
    t = num_requests if non_draft_tokens is None else non_draft_tokens
    flat = survivals.flatten()
    order = flat.sort(descending=True, stable=True)
    ranked = order.values.tolist()
    depth_of = ((order.indices % max(width, 1)) + 1).tolist()  # 1-based position of each ranked slot
    best_b, best_rate = 0, None
    expected = float(num_requests)
    draft = costs.draft_cost(num_requests)
    deepest = 0
    for b in range(0, len(ranked) + 1):
        if b > 0:
            expected += ranked[b - 1]
            deepest = max(deepest, depth_of[b - 1])
        draft_b = draft if draft_steps is None else costs.draft_depth_cost(num_requests, max(deepest, 1), draft_steps)
        extra = overhead_ms
        if b == 0 and zero_is_off:
            draft_b = 0.0
            extra = overhead_ms if overhead_off_ms is None else overhead_off_ms
        rate = expected / max(draft_b + costs.verify_cost(t + b) + extra, 1e-9)
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
