"""Settings of the online acceptance estimator (the ``--av-*`` estimator flags): defaults and ranges, once."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import require, setting

__all__ = ["EstimatorConfig"]


@dataclass(frozen=True)
class EstimatorConfig:
    """Settings of :class:`~specadapt.estimator.AcceptanceEstimator`.

    Attributes:
        refit_interval: N, rounds (decode steps) between IRLS refits.
        damping: D of the evidence damping ``n / (n + D)``.
        init_slope, init_intercept: starting omega and beta_k (0.5 and -0.2: medians reported across pairs).
        ridge: lambda of the Newton system.
        max_step: trust region of one refit in logit units (see :func:`specadapt.estimator.irls.irls_solve`).

    Raises:
        SettingError (a ValueError): a value out of range, naming the field.
    """

    refit_interval: int = setting(50, flag="--av-refit-interval", help="rounds (decode steps) between IRLS refits")
    damping: float = setting(50.0, flag="--av-damping", help="D in the evidence damping n/(n+D)")
    init_slope: float = setting(0.5, flag="--av-init-slope", help="initial shared slope omega")
    init_intercept: float = setting(-0.2, flag="--av-init-intercept", help="initial per-position intercept beta_k")
    ridge: float = setting(1e-3)
    max_step: float = setting(4.0)

    def __post_init__(self) -> None:
        require(self.refit_interval >= 1, "refit_interval", f"must be >= 1, got {self.refit_interval}")
        require(self.damping >= 0, "damping", f"must be >= 0, got {self.damping}")
        require(self.ridge >= 0, "ridge", f"must be >= 0, got {self.ridge}")
        require(self.max_step > 0, "max_step", f"must be > 0, got {self.max_step}")
