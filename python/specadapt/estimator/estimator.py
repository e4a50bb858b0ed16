"""The online acceptance estimator: predict at draft time, observe after verification, refit every N steps."""

from __future__ import annotations

import torch

from .irls import irls_accumulate, irls_solve

__all__ = ["AcceptanceEstimator"]


class AcceptanceEstimator:
    """``p_k = sigmoid(omega * f + beta_k)``, fitted online by IRLS (specs/adaptive_verification.md).

    Args:
        num_positions: K, the largest draft length.
        init_slope, init_intercept: starting omega and beta_k (0.5 and -0.2: medians reported across pairs).
        refit_interval: N, decode steps between refits.
        damping: D of the evidence damping ``n / (n + D)``.
        ridge: lambda of the Newton system.
        max_step: trust region of one refit in logit units (see :func:`specadapt.estimator.irls.irls_solve`).
        accumulate: the accumulate function; default :func:`specadapt.estimator.irls.irls_accumulate` (fused op,
            or the float64 reference where it is not built).

    Memory is O(K): only the ``[K, 6]`` statistics of the current window are kept, never raw labels.

    Raises:
        ValueError: ``num_positions < 1``, ``refit_interval < 1``, negative damping or ridge.
    """

    def __init__(self, num_positions: int, init_slope: float = 0.5, init_intercept: float = -0.2,
                 refit_interval: int = 100, damping: float = 50.0, ridge: float = 1e-3,
                 max_step: float = 4.0, accumulate=None) -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        if refit_interval < 1:
            raise ValueError(f"refit_interval must be >= 1, got {refit_interval}")
        if damping < 0 or ridge < 0:
            raise ValueError("damping and ridge must be >= 0")
        self.slope = float(init_slope)
        self.intercepts = torch.full((num_positions,), float(init_intercept), dtype=torch.float64)
        self.refit_interval = refit_interval
        self.damping = damping
        self.ridge = ridge
        self.max_step = max_step
        self._accumulate = irls_accumulate if accumulate is None else accumulate
        self.stats = torch.zeros(num_positions, 6, dtype=torch.float64)
        self.steps = 0
        self.refits = 0

    @property
    def num_positions(self) -> int:
        return self.intercepts.shape[0]

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, K]`` features -> ``[B, K] float64`` acceptance probabilities (conditional on reaching k)."""
        k = features.shape[-1]
        if k > self.num_positions:
            raise ValueError(f"features have {k} positions, the estimator {self.num_positions}")
        return torch.sigmoid(self.slope * features.to(torch.float64) + self.intercepts[:k].to(features.device))

    def observe(self, features: torch.Tensor, predictions: torch.Tensor, accepted: torch.Tensor,
                verified: torch.Tensor) -> None:
        """Accumulate one step's verified drafts (``[B, K]``, ``[B, K]``, ``[B]``, ``[B]``); refit every N steps.

        ``K = 0`` (nothing drafted this step) still counts as a step of the refit schedule."""
        k = features.shape[-1]
        if k > 0:
            self.stats[:k] += self._accumulate(features, predictions, accepted, verified).to(self.stats)
        self.steps += 1
        if self.steps % self.refit_interval == 0:
            self.refit()

    def refit(self) -> None:
        """One damped Newton step on the current window's statistics, then start a new window."""
        self.slope, self.intercepts = irls_solve(
            self.stats, self.slope, self.intercepts, self.ridge, self.damping, self.max_step
        )
        self.stats.zero_()
        self.refits += 1
