"""The online acceptance estimator: predict at draft time, observe after verification, refit every N steps."""

from __future__ import annotations

import torch

from .config import EstimatorConfig
from .irls import irls_accumulate, irls_solve

_D = EstimatorConfig()  # the defaults below are EstimatorConfig's

__all__ = ["AcceptanceEstimator"]


class AcceptanceEstimator:
    """``p_k = sigmoid(omega * f + beta_k)``, fitted online by IRLS (docs/design/specs/adaptive_verification.md).

    Args:
        num_positions: K, the largest draft length.
        init_slope, init_intercept, refit_interval, damping, ridge, max_step: the settings of
            :class:`~specadapt.estimator.config.EstimatorConfig` (its defaults; :meth:`from_config` takes one).
        accumulate: the accumulate function; default :func:`specadapt.estimator.irls.irls_accumulate` (the fused op,
            or the float64 reference where it is not built).

    Memory is O(K): only the ``[K, 6]`` statistics of the current window are kept, never raw labels.

    Raises:
        ValueError: ``num_positions < 1``; a setting out of range (a
            :class:`~specadapt.settings.SettingError` naming the field: ``refit_interval < 1``, negative damping
            or ridge).
    """

    def __init__(self, num_positions: int, init_slope: float = _D.init_slope, init_intercept: float = _D.init_intercept,
                 refit_interval: int = _D.refit_interval, damping: float = _D.damping, ridge: float = _D.ridge,
                 max_step: float = _D.max_step, accumulate=None) -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        EstimatorConfig(refit_interval, damping, init_slope, init_intercept, ridge, max_step)  # validates
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
        self._window_empty = True  # no statistics accumulated since the last refit (its solve is the identity)

    @classmethod
    def from_config(cls, num_positions: int, config: EstimatorConfig, accumulate=None) -> "AcceptanceEstimator":
        """An estimator of ``num_positions`` positions with the settings of ``config``."""
        return cls(num_positions, init_slope=config.init_slope, init_intercept=config.init_intercept,
                   refit_interval=config.refit_interval, damping=config.damping, ridge=config.ridge,
                   max_step=config.max_step, accumulate=accumulate)

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
            self._window_empty = False
        self.observe_nothing()

    def observe_nothing(self) -> None:
        """A step that verified no draft: it counts toward the refit schedule (refit every ``refit_interval``
        steps) and adds no statistics."""
        self.steps += 1
        if self.steps % self.refit_interval == 0:
            self.refit()

    def refit(self) -> None:
        """One damped Newton step on the current window's statistics, then start a new window.

        A window that accumulated nothing (every step since the last refit verified no draft, e.g. adaptive
        verification with speculation off) leaves the fit as it is without solving: with all-zero statistics the
        Newton step is 0 (``d_slope`` and every ``d_beta`` carry a factor ``n / (n + D) = 0``), so the solve's
        dozen small tensor operations would only cost time, every ``refit_interval`` rounds off. It still counts
        as a refit (:attr:`refits`), so the schedule is the same either way."""
        if not self._window_empty:
            self.slope, self.intercepts = irls_solve(
                self.stats, self.slope, self.intercepts, self.ridge, self.damping, self.max_step
            )
            self.stats.zero_()
            self._window_empty = True
        self.refits += 1
