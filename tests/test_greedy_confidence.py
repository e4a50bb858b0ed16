"""A greedy EAGLE head's estimator feature (specadapt.engine.eagle_draft.greedy_confidence): its q rows are
one-hot, so adaptive verification reads logit(q_max) of the head's temperature-1 distribution instead, in the draft
filter (early stop) and in the plan alike; output unchanged (greedy equality)."""

from __future__ import annotations

import torch

from specadapt.engine import SpeculativeEngine
from specadapt.engine.eagle_draft import greedy_confidence
from specadapt.estimator.features import FEATURE_CLAMP, draft_confidence_feature, feature_from_probs
from specadapt.sampling import SamplingParams, logits_to_probs_rows
from tests.helpers.engine import GREEDY, PROMPTS, eagle, logged_av_features


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
    features = logged_av_features(tiny_target, eagle(tiny_target), draft_ms=0.5)
    assert len(set(features)) > 3 and max(features) <= FEATURE_CLAMP  # not the one clamp value of one-hot rows
    assert sum(f < FEATURE_CLAMP for f in features) > len(features) // 2


def test_a_greedy_head_fills_no_confidence_without_adaptive_verification(tiny_target):
    draft = eagle(tiny_target)
    SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain").generate(PROMPTS[:2], 6, batch_size=2)
    assert draft.wants_confidence is False
    seen = []
    original = draft.propose

    def recording(*args, **kwargs):
        proposal = original(*args, **kwargs)
        seen.append(proposal.confidence)
        return proposal

    draft.propose = recording
    SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain").generate(PROMPTS[:2], 6, batch_size=2)
    assert seen and all(c is None for c in seen)  # no feature work on the hot path when nothing reads it
