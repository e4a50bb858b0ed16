"""Estimator evaluation: metric definitions against hand / scipy values, the --log-drafts file, eval-estimator."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from tests.helpers.models import WORDS
from specadapt.cli import main
from specadapt.estimator.evaluation import auc, ece, ece_null, evaluate_records, log_loss, read_draft_log


def test_auc_matches_mann_whitney_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 200).astype(float)  # many ties
    labels = rng.random(200) < 0.3 + 0.1 * scores
    u = stats.mannwhitneyu(scores[labels], scores[~labels]).statistic
    assert auc(scores, labels) == pytest.approx(u / (labels.sum() * (~labels).sum()))
    assert auc([0.1, 0.9], [0, 1]) == 1.0 and auc([0.9, 0.1], [0, 1]) == 0.0
    assert auc([0.2, 0.3], [1, 1]) is None


def test_log_loss_and_ece_by_hand():
    assert log_loss([0.5, 0.5], [0, 1]) == pytest.approx(np.log(2))
    # two bins used: [0.1] with label 0 -> |0 - 0.1|, [0.85, 0.95] with labels 1, 1 -> |1 - 0.9|
    assert ece([0.1, 0.85, 0.95], [0, 1, 1]) == pytest.approx((1 / 3) * 0.1 + (2 / 3) * 0.1)
    rng = np.random.default_rng(1)
    p = rng.random(200_000)
    assert ece(p, rng.random(200_000) < p) < 0.01  # calibrated by construction
    assert ece(p, rng.random(200_000) < p**2) > 0.1


def test_ece_null_is_the_ece_of_calibrated_labels_and_shrinks_with_more_labels():
    rng = np.random.default_rng(1)
    p = rng.random(30)
    null = ece_null(p, draws=4000, seed=3)
    # by hand: the same draws through ece()
    draws = np.random.default_rng(3).random((4000, 30)) < p[None, :]
    by_hand = np.array([ece(p, d.astype(float)) for d in draws])
    assert null["median"] == pytest.approx(float(np.median(by_hand)), abs=1e-12)
    assert null["p95"] == pytest.approx(float(np.quantile(by_hand, 0.95)), abs=1e-12)
    assert 0.05 < null["median"] < 0.2  # 30 labels: a calibrated estimator still scores ~0.1
    big = ece_null(rng.random(10_000), draws=200)
    assert big["p95"] < 0.02
    # labels of a miscalibrated estimator (the truth is p / 2) lie above the null; calibrated ones mostly within
    q = rng.random(2000)
    assert ece(q, (rng.random(2000) < q / 2).astype(float)) > ece_null(q, draws=300)["p95"]
    inside = sum(ece(q, (rng.random(2000) < q).astype(float)) <= ece_null(q, draws=300)["p95"] for _ in range(40))
    assert inside >= 34  # ~95% of calibrated samples
    assert ece_null(np.array([]))["median"] is None


def test_evaluate_records_uses_only_out_of_sample_predictions():
    recs = [{"position": 1 + i % 2, "feature": 0.0, "prediction": 0.9, "label": i % 3 != 0, "refits": i // 50}
            for i in range(200)]
    out = evaluate_records(recs, min_refits=1)
    assert out["records"] == 150 and out["records_total"] == 200
    assert [p["position"] for p in out["per_position"]] == [1, 2]
    assert out["qmax_unfitted"]["log_loss"] == pytest.approx(np.log(2))
    with pytest.raises(ValueError, match="refits"):
        evaluate_records(recs, min_refits=10)


def test_log_drafts_and_eval_estimator_end_to_end(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is the sum of {w}"}) + "\n" for w in WORDS[:2]))
    log, out = tmp_path / "drafts.jsonl", tmp_path / "eval.json"
    code = main(["generate", "--no-progress", "--model", str(tiny_model_dir), "--draft", "self:1", "--dataset",
                 str(data), "--max-new-tokens", "60", "--log-drafts", str(log), "--av-refit-interval", "3"])
    assert code == 0
    records = read_draft_log(log)
    assert records and all(r["label"] in (0, 1) and 1 <= r["position"] <= 5 for r in records)
    # without --adaptive-verification nothing is pruned: the labels are up to the first rejection of each round
    code = main(["eval-estimator", str(log), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["fitted"]) >= {"auc", "log_loss", "ece"} and set(result["qmax_unfitted"]) >= {"auc", "log_loss", "ece"}
    assert result["per_position"]
    # replaying the log with the run's settings reproduces the logged predictions (same features, labels, schedule)
    from specadapt.estimator import AcceptanceEstimator
    from specadapt.estimator.evaluation import replay_records

    replayed = replay_records(records, AcceptanceEstimator(5, refit_interval=3))
    assert max(r["refits"] for r in replayed) >= 2
    order = sorted(range(len(records)), key=lambda i: records[i]["round"])  # replay returns records by round
    for i, rep in zip(order, replayed):
        assert rep["refits"] == records[i]["refits"]
        assert rep["prediction"] == pytest.approx(records[i]["prediction"], abs=1e-9)
    # ... and other settings give other predictions, through the CLI
    code = main(["eval-estimator", str(log), "--replay", "--refit-interval", "1", "--damping", "0",
                 "--json", str(out)])
    assert code == 0 and json.loads(out.read_text())["fitted"] != result["fitted"]
    assert main(["eval-estimator", str(log), "--replay", "--refit-interval", "0"]) == 2
    assert "--refit-interval" in capsys.readouterr().err
    with pytest.raises(ValueError, match="round"):
        replay_records([{"position": 1, "feature": 0.0, "prediction": 0.5, "label": 1, "refits": 0}],
                       AcceptanceEstimator(1))
    capsys.readouterr()
    assert main(["eval-estimator", str(tmp_path / "none.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"position": 1}\n')
    assert main(["eval-estimator", str(bad)]) == 2
    assert "missing field" in capsys.readouterr().err
