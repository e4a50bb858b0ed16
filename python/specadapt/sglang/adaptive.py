"""Adaptive verification inside SGLang: estimator features from the draft's q rows, per-request caps before
the sampler runs, outcomes fed back after it (the technique: :mod:`specadapt.estimator`, :mod:`specadapt.budget`).

Exactness is the embedded engine's argument (``specadapt.budget.budget``): the budget B* applied in a round
is chosen from the previous round's survivals, and each request verifies a prefix of its drafts decided before
any of them is verified; verifying fewer drafts with an exact rule stays exact.

TP: every rank computes the same caps from the same (all-gathered) draft rows; :meth:`plan` broadcasts them
from rank 0 when a process group is given, so a last-bit difference in q cannot split the ranks.
"""

from __future__ import annotations

import logging

import torch

from ..budget import CostTable, allocate_prefixes, choose_budget, survival
from ..estimator import AcceptanceEstimator
from ..estimator.features import feature_from_probs
from .config import PluginConfig

logger = logging.getLogger("specadapt.sglang")

__all__ = ["SGLangAdaptiveVerification"]


class SGLangAdaptiveVerification:
    """Online estimator + budget for one scheduler process.

    Args:
        config: plugin settings (``av_*``).
        num_drafts: L, drafts per request per round (``speculative_num_steps`` for top-k 1 chains).
        max_requests: largest running batch (sizes the default flat cost table).
        broadcast: ``tensor -> None`` broadcasting in place from TP rank 0, or ``None`` (TP = 1).
    """

    def __init__(self, config: PluginConfig, num_drafts: int, max_requests: int = 256, broadcast=None) -> None:
        if num_drafts < 1:
            raise ValueError(f"adaptive verification needs >= 1 draft per round, got {num_drafts}")
        self.num_drafts = num_drafts
        self.estimator = AcceptanceEstimator(
            num_drafts, init_slope=config.av_init_slope, init_intercept=config.av_init_intercept,
            refit_interval=config.av_refit_interval, damping=config.av_damping,
        )
        if config.av_cost_table:
            self.costs = CostTable.load(config.av_cost_table)
        else:  # fixed-width verify: the target costs the same whatever is verified
            self.costs = CostTable(target_ms=[1.0] * (max_requests * (num_drafts + 1)), draft_ms=[0.0])
        self.broadcast = broadcast
        self.stale_budget: int | None = None
        self.verified = 0
        self.pruned = 0
        self.rounds = 0

    def plan(self, draft_probs: torch.Tensor):
        """Caps for this round.

        Args:
            draft_probs: ``[B, L, V]`` float q rows (SGLang's ``EagleVerifyInput.draft_probs``).

        Returns:
            ``(caps [B] int64 on draft_probs.device, features [B, L] float32 (CPU), predictions [B, L] float64 (CPU))``.

        Raises:
            ValueError: ``draft_probs`` not ``[B, L, V]`` with ``L <= num_drafts``.
        """
        if draft_probs.dim() != 3 or draft_probs.shape[1] > self.num_drafts:
            raise ValueError(f"draft_probs must be [B, L<={self.num_drafts}, V], got {tuple(draft_probs.shape)}")
        batch, width = draft_probs.shape[:2]
        features = feature_from_probs(draft_probs).cpu()
        predictions = self.estimator.predict(features)
        num = torch.full((batch,), width, dtype=torch.int64)
        surv = survival(predictions, num)
        caps = num.clone() if self.stale_budget is None else torch.minimum(allocate_prefixes(surv, self.stale_budget), num)
        self.stale_budget = choose_budget(surv, self.costs)
        caps = caps.to(draft_probs.device)
        if self.broadcast is not None:
            self.broadcast(caps)
        return caps, features, predictions

    def observe(self, features, predictions, accepted, verified) -> None:
        """Outcomes of the round: ``accepted [B]`` drafts accepted (bonus excluded), ``verified [B]`` drafts
        verified (the caps); the estimator refits every ``av_refit_interval`` rounds."""
        accepted = accepted.to("cpu", torch.int64)
        verified = verified.to("cpu", torch.int64)
        self.rounds += 1
        self.verified += int(verified.sum())
        self.pruned += int((self.num_drafts - verified).clamp_min(0).sum())
        self.estimator.observe(features, predictions, accepted, verified)

    def summary(self) -> dict:
        """Counters and the current coefficients, for logs."""
        return {"rounds": self.rounds, "verified": self.verified, "pruned": self.pruned,
                "refits": self.estimator.refits, "slope": self.estimator.slope,
                "intercepts": [round(float(x), 4) for x in self.estimator.intercepts]}
