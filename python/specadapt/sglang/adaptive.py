"""Adaptive verification inside SGLang: estimator features from the draft's q rows, per-request caps before
the sampler runs, outcomes fed back after it. The state is the technique's
:class:`specadapt.budget.adaptive.AdaptiveVerification` (the embedded engine uses the same class); this
module only adapts it to SGLang: features are computed where SGLang's q rows live (GPU) and only the ``[B, L]``
features come to the host, and the caps are broadcast from TP rank 0.

Exactness is the engine's argument (``specadapt.budget.budget``): the budget B* applied in a round is chosen
from the previous round's survivals, and each request verifies a prefix of its drafts decided before any of
them is verified; verifying fewer drafts with an exact rule stays exact.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..budget import CostTable
from ..budget.adaptive import AdaptiveVerification
from ..estimator import AcceptanceEstimator
from ..estimator.features import feature_from_probs
from .config import PluginConfig

__all__ = ["SGLangAdaptiveVerification"]


class SGLangAdaptiveVerification:
    """Adaptive verification for one scheduler process.

    Args:
        config: plugin settings (``av_*``).
        num_drafts: L, drafts per request per round (``speculative_num_steps`` for top-k 1 chains).
        max_requests: largest running batch (sizes the default flat cost table).
        broadcast: ``tensor -> None`` broadcasting in place from TP rank 0, or ``None`` (TP = 1).

    Raises:
        ValueError: ``num_drafts < 1``; a cost table file that is not one.
    """

    def __init__(self, config: PluginConfig, num_drafts: int, max_requests: int = 256, broadcast=None) -> None:
        if num_drafts < 1:
            raise ValueError(f"adaptive verification needs >= 1 draft per round, got {num_drafts}")
        self.num_drafts = num_drafts
        settings = config.av_config()
        if settings.cost_table:
            costs = CostTable.load(settings.cost_table)
        else:  # fixed-width verify: the target costs the same whatever is verified
            costs = CostTable(target_ms=[1.0] * (max_requests * (num_drafts + 1)), draft_ms=[0.0])
        # SGLang's draft graph always runs every step: no early stop, the spec's fixed draft cost, and the next
        # B* ranks every drafted slot's survival (nothing to extrapolate)
        self.state = AdaptiveVerification.from_config(num_drafts, costs, replace(settings, early_stop=False),
                                                      budget_from_verified=False, speculation="on")
        self.broadcast = broadcast

    @property
    def estimator(self) -> AcceptanceEstimator:
        return self.state.estimator

    def plan(self, draft_probs: torch.Tensor):
        """Caps for this round.

        Args:
            draft_probs: ``[B, L, V]`` float q rows (SGLang's ``EagleVerifyInput.draft_probs``), any device.

        Returns:
            ``(caps [B] int64 on draft_probs.device, features [B, L] float32 (CPU), predictions [B, L] float64 (CPU))``.

        Raises:
            ValueError: ``draft_probs`` not ``[B, L, V]`` with ``L <= num_drafts``.
        """
        if draft_probs.dim() != 3 or draft_probs.shape[1] > self.num_drafts:
            raise ValueError(f"draft_probs must be [B, L<={self.num_drafts}, V], got {tuple(draft_probs.shape)}")
        batch, width = draft_probs.shape[:2]
        features = feature_from_probs(draft_probs).cpu()
        num = torch.full((batch,), width, dtype=torch.int64)
        caps, features, predictions = self.state.plan_features(features, num)
        caps = caps.to(draft_probs.device)
        if self.broadcast is not None:
            self.broadcast(caps)
        return caps, features, predictions

    def observe(self, features, predictions, accepted, verified) -> None:
        """Outcomes of the round: ``accepted [B]`` drafts accepted (bonus excluded), ``verified [B]`` drafts
        verified (the caps); the estimator refits every ``av_refit_interval`` rounds."""
        self.state.observe(features, predictions, accepted.to("cpu", torch.int64), verified.to("cpu", torch.int64))

    def summary(self) -> dict:
        """Counters and the current coefficients, for logs."""
        est = self.state.estimator
        return {"rounds": self.state.rounds, "verified": self.state.verified, "pruned": self.state.pruned,
                "refits": est.refits, "slope": est.slope, "intercepts": [round(float(x), 4) for x in est.intercepts]}
