"""Adaptive verification in the embedded engine: the state (:class:`specadapt.budget.adaptive.
AdaptiveVerification`, re-exported here) and the cost profiling of the engine's models.

Pruned drafts are never sent to the target (they are holes of the ragged verify forward).
"""

from __future__ import annotations

import inspect
import logging

import torch

from ..budget import CostTable
from ..budget.adaptive import AdaptiveVerification
from ..budget.costs import profile_costs

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveVerification", "profile_engine_costs"]


def profile_engine_costs(target_model, draft_model, max_tokens: int, max_requests: int, num_drafts: int,
                         repeats: int = 5) -> CostTable:
    """Cost table by timing dummy forwards: the target over n tokens (one row, empty cache), and ``num_drafts``
    single-token steps of the draft model over r rows (0 for drafts without a model, e.g. ngram)."""
    device = next(target_model.parameters()).device

    @torch.no_grad()
    def target_forward(n):
        target_model(input_ids=torch.ones(1, n, dtype=torch.int64, device=device))

    @torch.no_grad()
    def draft_round(r):
        if draft_model is None:
            return
        extra = {}
        if "features" in inspect.signature(draft_model.forward).parameters:  # an EAGLE head reads features
            extra["features"] = torch.zeros(r, 1, draft_model.hidden_size, device=device)
        for _ in range(num_drafts):
            draft_model(input_ids=torch.ones(r, 1, dtype=torch.int64, device=device), **extra)

    logger.info("profiling costs: target up to %d tokens, draft up to %d requests", max_tokens, max_requests)
    return profile_costs(target_forward, draft_round, max_tokens, max_requests, repeats)
