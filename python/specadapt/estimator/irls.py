"""IRLS for the acceptance estimator: the accumulate step (the fused op and its float64 reference) and the
arrowhead Newton solve.

Statistics per draft position ``k`` (columns of the ``[K, 6]`` tensor), from each labelled observation with
feature ``f``, stored prediction ``p`` and label ``y`` (``r = y - p``, ``w = p (1 - p)``)::

    a_k += w f^2,  b_k += w f,  c_k += w,  g0_k += r f,  g1_k += r,  n_k += 1

Labels (docs/design/specs/adaptive_verification.md section 3): positions up to and including the first rejection;
accepted = 1, the first rejected = 0; later positions and pruned drafts get no label.
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = ["STAT_COLUMNS", "irls_labels", "irls_accumulate", "irls_accumulate_reference", "irls_solve"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()

STAT_COLUMNS = ("a", "b", "c", "g0", "g1", "n")


def irls_labels(accepted: torch.Tensor, verified: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and their mask from per-request outcomes.

    Args:
        accepted: ``[B]`` int, accepted drafts (tau).
        verified: ``[B]`` int, drafts that were verified (after pruning).
        num_positions: K.

    Returns:
        ``(labels [B, K] float64, labelled [B, K] bool)``.
    """
    k = torch.arange(num_positions, device=accepted.device)[None, :]
    accepted = accepted.to(torch.int64)[:, None]
    verified = verified.to(torch.int64)[:, None]
    labelled = (k < verified) & (k <= accepted)
    return (k < accepted).to(torch.float64), labelled


def irls_accumulate_reference(
    features: torch.Tensor, predictions: torch.Tensor, accepted: torch.Tensor, verified: torch.Tensor
) -> torch.Tensor:
    """IRLS statistics of one batch of verified drafts (float64 reference of ``specadapt::irls_accumulate``).

    Args:
        features: ``[B, K]`` float, ``logit(q_max)`` at each draft position.
        predictions: ``[B, K]`` float, the estimator's predictions stored at draft time.
        accepted: ``[B]`` int, tau per request.
        verified: ``[B]`` int, number of verified drafts per request (``<= K``).

    Returns:
        ``[K, 6] float64`` with columns ``a, b, c, g0, g1, n``. Observations whose feature or prediction is not
        finite are skipped (NaN never reaches the coefficients).

    Raises:
        ValueError: mismatched shapes.
    """
    if features.dim() != 2 or predictions.shape != features.shape:
        raise ValueError(f"features and predictions must both be [B, K], got {tuple(features.shape)} and "
                         f"{tuple(predictions.shape)}")
    batch, num_positions = features.shape
    if accepted.shape != (batch,) or verified.shape != (batch,):
        raise ValueError(f"accepted and verified must be [B] = [{batch}]")
    f = features.to(torch.float64)
    p = predictions.to(torch.float64)
    y, labelled = irls_labels(accepted, verified, num_positions)
    labelled = labelled & torch.isfinite(f) & torch.isfinite(p)
    f = torch.where(labelled, f, torch.zeros_like(f))
    p = torch.where(labelled, p, torch.zeros_like(p))
    m = labelled.to(torch.float64)
    r = (y - p) * m
    w = p * (1 - p) * m
    return torch.stack(
        [(w * f * f).sum(0), (w * f).sum(0), w.sum(0), (r * f).sum(0), r.sum(0), m.sum(0)], dim=1
    )


def irls_accumulate(
    features: torch.Tensor, predictions: torch.Tensor, accepted: torch.Tensor, verified: torch.Tensor
) -> torch.Tensor:
    """IRLS statistics ``[K, 6] float64`` (a, b, c, g0, g1, n) of one batch of verified drafts.

    Contract of :func:`irls_accumulate_reference` (``features [B, K]``, ``predictions [B, K]``, ``accepted [B]``,
    ``verified [B]``); the fused op ``specadapt::irls_accumulate`` when built for the device, else the reference
    with a logged warning (once per device type).

    Raises:
        ValueError: mismatched shapes or dtypes (the message names the argument).
    """
    from .. import kernels  # the estimator depends on the kernels, never the reverse

    if kernels.has_op_for("irls_accumulate", features.device):
        try:
            return torch.ops.specadapt.irls_accumulate(features, predictions, accepted, verified)
        except RuntimeError as exc:  # TORCH_CHECK failures: the reference's exception type
            raise ValueError(str(exc).split("\n")[0]) from None
    if features.device.type not in _warned:
        _warned.add(features.device.type)
        logger.warning("specadapt::irls_accumulate has no compiled kernel for %s; using the reference",
                       features.device.type)
    return irls_accumulate_reference(features, predictions, accepted, verified)


def irls_solve(
    stats: torch.Tensor, slope: float, intercepts: torch.Tensor, ridge: float = 1e-3, damping: float = 50.0,
    max_step: float = 4.0,
) -> tuple[float, torch.Tensor]:
    """One damped Newton step from accumulated statistics (arrowhead solve of (X'WX + ridge I) d = X'(y - p)).

    Args:
        stats: ``[K, 6]`` statistics (columns ``a, b, c, g0, g1, n``).
        slope: current shared slope omega.
        intercepts: ``[K]`` current per-position intercepts beta.
        ridge: lambda added to the diagonal.
        damping: D in the step damping ``n / (n + D)`` (evidence-scaled steps).
        max_step: largest weighted-RMS change of the logit ``omega f + beta_k`` over the window's observations
            that one refit may cause (slope and intercept steps scaled together). Ours, beyond the spec: when
            predictions saturate (p near 0 or 1, e.g. a one-hot ngram draft whose feature is always 40) the
            curvature ``w = p (1 - p)`` vanishes, the ridge alone cannot bound the Newton step, and unclipped
            steps of 1e5 were measured (and separately clipped steps cancel each other when f is constant);
            a trust region on the logit keeps the Newton direction and the fit stable.

    Returns:
        ``(new_slope, new_intercepts [K] float64)``. A NaN or negative-making slope step is dropped (slope kept)
        *before* the intercept steps are computed, so ``d_beta_k = (g1_k - b_k d_slope) / c~_k * n_k / (n_k + D)``
        uses the slope step actually taken (spec section 4's order; computing them with the dropped step
        shifts every intercept by ``-b_k d_slope / c~_k`` for a slope that never changed). NaN intercept steps are
        dropped; positions without labels keep their intercepts.
    """
    s = stats.to(torch.float64)
    a, b, c, g0, g1, n = (s[:, i] for i in range(6))
    c_t = c + ridge
    a_t = float(a.sum()) + ridge
    denom = a_t - float((b * b / c_t).sum())
    d_slope = (float(g0.sum()) - float((b * g1 / c_t).sum())) / denom if denom != 0 else float("nan")
    total = float(n.sum())
    d_slope *= total / (total + damping)
    if not math.isfinite(d_slope) or slope + d_slope < 0:
        d_slope = 0.0  # the spec's guard, applied before the intercepts: their step uses the final slope step
    d_beta = (g1 - b * d_slope) / c_t * (n / (n + damping))
    d_beta = torch.where(torch.isfinite(d_beta), d_beta, torch.zeros_like(d_beta))
    # Trust region: the weighted RMS change of the logit omega * f + beta_k over the window's observations
    # may not exceed max_step; slope and intercept steps are scaled together, keeping the Newton direction.
    total_w = float(c.sum())
    if total_w > 0:
        change = (d_slope**2 * a + 2 * d_slope * d_beta * b + d_beta**2 * c).sum() / total_w
        rms = math.sqrt(max(float(change), 0.0))
        if rms > max_step:
            d_slope *= max_step / rms
            d_beta = d_beta * (max_step / rms)  # shrinking a step that keeps slope >= 0 keeps it >= 0
    return slope + d_slope, intercepts.to(torch.float64) + d_beta
