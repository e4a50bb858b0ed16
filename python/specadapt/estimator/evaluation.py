"""Calibration and ranking metrics of an acceptance estimator over logged verified drafts.

Records come from ``specadapt generate --log-drafts PATH`` (one JSON object per verified draft:
``round``, ``row``, ``position`` (1-based), ``feature`` (logit q_max), ``prediction``, ``label`` (1 accepted,
0 the first rejection), ``refits`` (estimator refits done when the prediction was made)). A prediction made
after ``r >= 1`` refits used coefficients fitted only on earlier windows, so it is out of sample.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

__all__ = ["auc", "log_loss", "ece", "ece_null", "evaluate_records", "read_draft_log", "replay_records"]


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); ``None`` if one class is absent."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    start = 0
    while start < len(scores):  # average rank over each run of ties
        end = start
        while end + 1 < len(scores) and sorted_scores[end + 1] == sorted_scores[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def log_loss(probs: np.ndarray, labels: np.ndarray, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood (natural log) of binary labels; probabilities clipped to [eps, 1-eps]."""
    p = np.clip(np.asarray(probs, dtype=np.float64), eps, 1 - eps)
    y = np.asarray(labels, dtype=np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error with ``bins`` equal-width bins on [0, 1]:
    ``sum_b (n_b / n) |mean(label in b) - mean(prob in b)|``."""
    p = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += mask.sum() / len(p) * abs(y[mask].mean() - p[mask].mean())
    return float(total)


def ece_null(probs: np.ndarray, bins: int = 10, draws: int = 2000, seed: int = 0) -> dict:
    """The ECE a perfectly calibrated estimator would score on these predictions: labels drawn
    ``y_i ~ Bernoulli(p_i)`` ``draws`` times, :func:`ece` of each draw.

    ECE is biased upwards on few labels (each bin's ``|mean(y) - mean(p)|`` is at least its sampling noise), so a
    measured ECE only says "miscalibrated" where it lies above this null distribution: at 30 labels a calibrated
    estimator scores about 0.1, at 10,000 about 0.01.

    Returns:
        ``{"median", "p95", "draws"}`` (``None`` values for no predictions).
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.size == 0:
        return {"median": None, "p95": None, "draws": 0}
    rng = np.random.default_rng(seed)
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    mean_p = np.bincount(which, weights=p, minlength=bins)
    y = (rng.random((draws, p.size)) < p[None, :]).astype(np.float64)  # [draws, n]
    sums = np.zeros((draws, bins))
    np.add.at(sums.T, which, y.T)  # per draw and bin: the number of 1-labels
    values = np.abs(sums - mean_p[None, :]).sum(axis=1) / p.size  # sum_b n_b/n |mean y_b - mean p_b|
    return {"median": float(np.median(values)), "p95": float(np.quantile(values, 0.95)), "draws": int(draws)}


def _metrics(probs, labels) -> dict:
    return {"auc": auc(probs, labels), "log_loss": log_loss(probs, labels), "ece": ece(probs, labels), "count": int(len(labels))}


def read_draft_log(path: str | Path) -> list[dict]:
    """Read a ``--log-drafts`` JSON-lines file.

    Raises:
        FileNotFoundError: no such file. ValueError: a malformed line or a missing field (named).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no draft log at {path}")
    records = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
        for key in ("position", "feature", "prediction", "label", "refits"):
            if key not in rec:
                raise ValueError(f"{path}:{i}: missing field {key!r}")
        records.append(rec)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def replay_records(records: list[dict], estimator) -> list[dict]:
    """Re-run an estimator over logged drafts: the same features and labels, fresh predictions.

    Rounds are replayed in order; in each, the estimator predicts every logged draft with its current coefficients
    (before seeing the round's labels, as at draft time), then observes the round's outcomes (accepted = the
    logged 1-labels of a row, verified = its logged drafts) and refits on its own schedule. This answers "what
    would other settings (refit interval, damping, start values) have predicted on these drafts" without decoding
    again. Only exact for logs of runs without pruning (no ``--adaptive-verification``): with pruning, which
    drafts were verified depended on the logged run's own predictions.

    Args:
        records: from :func:`read_draft_log`; each needs ``round`` and ``row`` besides the usual fields.
        estimator: a fresh :class:`specadapt.estimator.AcceptanceEstimator` with at least as many positions as
            the largest logged ``position``.

    Returns:
        Copies of the records (in round order) with ``prediction`` and ``refits`` replaced by the replay's.

    Raises:
        ValueError: a record without ``round`` / ``row``, or positions beyond the estimator's.
    """
    import torch

    by_round: dict[int, list[dict]] = {}
    for i, rec in enumerate(records):
        if "round" not in rec or "row" not in rec:
            raise ValueError(f"record {i} has no 'round' / 'row' field: cannot replay it")
        by_round.setdefault(int(rec["round"]), []).append(rec)
    num_positions = max(int(r["position"]) for r in records)
    if num_positions > estimator.num_positions:
        raise ValueError(f"the log has draft position {num_positions}, the estimator only "
                         f"{estimator.num_positions} positions")
    out = []
    for rnd in sorted(by_round):
        recs = by_round[rnd]
        rows = max(int(r["row"]) for r in recs) + 1
        features = torch.zeros(rows, num_positions, dtype=torch.float64)
        accepted = torch.zeros(rows, dtype=torch.int64)
        verified = torch.zeros(rows, dtype=torch.int64)
        for r in recs:
            features[int(r["row"]), int(r["position"]) - 1] = float(r["feature"])
            accepted[int(r["row"])] += int(r["label"])
            verified[int(r["row"])] += 1
        predictions = estimator.predict(features)
        for r in recs:
            out.append({**r, "prediction": float(predictions[int(r["row"]), int(r["position"]) - 1]),
                        "refits": estimator.refits})
        estimator.observe(features, predictions, accepted, verified)
    return out


def evaluate_records(records: list[dict], min_refits: int = 1) -> dict:
    """Metrics of the fitted estimator (its stored predictions) and of unfitted ``q_max`` (``sigmoid`` of the
    feature), on records whose prediction was made after at least ``min_refits`` refits (out of sample).

    Returns:
        ``{"fitted": {...}, "qmax_unfitted": {...}, "per_position": [{"position", "fitted", "qmax_unfitted"}],
        "records": n_used, "records_total": n}``, each metrics dict ``{"auc", "log_loss", "ece", "count"}``.

    Raises:
        ValueError: no record satisfies ``min_refits``.
    """
    used = [r for r in records if r["refits"] >= min_refits]
    if not used:
        raise ValueError(f"no logged draft was predicted after >= {min_refits} refits (run longer or lower "
                         "the estimator's refit_interval)")
    pos = np.array([r["position"] for r in used])
    y = np.array([r["label"] for r in used], dtype=np.float64)
    fitted = np.array([r["prediction"] for r in used], dtype=np.float64)
    qmax = 1 / (1 + np.exp(-np.array([r["feature"] for r in used], dtype=np.float64)))
    out = {"fitted": _metrics(fitted, y), "qmax_unfitted": _metrics(qmax, y), "per_position": [],
           "records": len(used), "records_total": len(records)}
    out["fitted"]["ece_calibrated_null"] = ece_null(fitted)
    for k in sorted(set(pos.tolist())):
        m = pos == k
        out["per_position"].append({"position": int(k), "fitted": _metrics(fitted[m], y[m]),
                                    "qmax_unfitted": _metrics(qmax[m], y[m])})
    return out


def format_report(result: dict) -> str:
    """A plain-text table of :func:`evaluate_records`' result."""

    def f(v):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"

    lines = [f"records used: {result['records']} of {result['records_total']} (predictions made after a refit)",
             f"{'':>16} {'AUC':>8} {'log-loss':>9} {'ECE':>8} {'n':>7}"]
    for name in ("fitted", "qmax_unfitted"):
        m = result[name]
        lines.append(f"{name:>16} {f(m['auc']):>8} {f(m['log_loss']):>9} {f(m['ece']):>8} {m['count']:>7}")
    null = result["fitted"].get("ece_calibrated_null")
    if null and null["median"] is not None:
        verdict = ("above it: miscalibrated" if result["fitted"]["ece"] > null["p95"]
                   else "within it: consistent with calibration")
        lines.append(f"ECE a calibrated estimator scores on these {result['fitted']['count']} predictions: median "
                     f"{null['median']:.4f}, 95% below {null['p95']:.4f} (fitted ECE {verdict})")
    lines.append("per position (fitted | q_max unfitted):")
    for p in result["per_position"]:
        a, b = p["fitted"], p["qmax_unfitted"]
        lines.append(f"  k={p['position']}: AUC {f(a['auc'])} | {f(b['auc'])}   log-loss {f(a['log_loss'])} | "
                     f"{f(b['log_loss'])}   ECE {f(a['ece'])} | {f(b['ece'])}   n={a['count']}")
    return "\n".join(lines)
