"""A greedy EAGLE head's estimator feature (specadapt.engine.eagle_draft.greedy_confidence): its q rows are
one-hot, so adaptive verification reads logit(q_max) of the head's temperature-1 distribution instead, in the draft
filter (early stop) and in the plan alike; output unchanged (greedy equality)."""

from __future__ import annotations

import io
import json

import torch

from specadapt.budget.adaptive import AdaptiveVerification, CostTable
from specadapt.engine import SpeculativeEngine
from specadapt.engine.eagle_draft import greedy_confidence
from specadapt.estimator import AcceptanceEstimator
from specadapt.estimator.features import FEATURE_CLAMP, draft_confidence_feature, feature_from_probs
from specadapt.sampling import SamplingParams, logits_to_probs_rows
from tests.helpers.engine import GREEDY, PROMPTS, eagle, naive_greedy


def test_greedy_rows_take_the_temperature_one_confidence_others_their_q():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0)) * 2
    q = logits_to_probs_rows(logits, SamplingParams(0.8))
    greedy = torch.tensor([True, False, True])
    f = greedy_confidence(logits, q, greedy)
    torch.testing.assert_close(f[greedy], draft_confidence_feature(logits, 1.0)[greedy])
    torch.testing.assert_close(f[~greedy], feature_from_probs(q)[~greedy])
    one_hot = logits_to_probs_rows(logits, GREEDY)
    assert feature_from_probs(one_hot).eq(FEATURE_CLAMP).all()  # what the estimator saw before: one value


def test_adaptive_verification_of_a_greedy_head_fits_its_confidence(tiny_target):
    n = 24
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    costs = CostTable(target_ms=[10.0, 10.5, 11.0, 11.5, 12.0, 12.5] + [13.0 + i for i in range(20)],
                      draft_ms=[0.5] * 4)
    log = io.StringIO()
    av = AdaptiveVerification(AcceptanceEstimator(4, refit_interval=5), costs, draft_log=log)
    results = SpeculativeEngine(tiny_target, eagle(tiny_target), GREEDY, 4, "chain", adaptive=av).generate(
        PROMPTS, n, batch_size=4)
    assert [r.output_ids for r in results] == expected
    features = [json.loads(line)["feature"] for line in log.getvalue().splitlines()]
    assert features, "nothing verified: the test would be vacuous"
    assert len(set(features)) > 3 and max(features) <= FEATURE_CLAMP  # not the one clamp value of one-hot rows
    assert sum(f < FEATURE_CLAMP for f in features) > len(features) // 2
