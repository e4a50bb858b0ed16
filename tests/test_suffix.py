"""Suffix drafting (specadapt.engine.suffix): continuation counts, the adaptive length, the global index across
requests (bounded, oldest evicted), and exactness: greedy output equal to target-only, and the sampled law of
the first tokens equal to the target's exact joint (chi-square) under chain and block verification."""

from __future__ import annotations

import math

import pytest
import torch

from specadapt.engine import NoDraft, SpeculativeEngine
from specadapt.engine.suffix import ContinuationIndex, SuffixConfig, SuffixDraft, speculate
from specadapt.sampling import SamplingParams
from tests.helpers.engine import (GREEDY, PROMPTS, _exact_joint, assert_first_tokens_follow, logged_av_features,
                                  naive_greedy)
from tests.helpers.models import loaded, tiny_llama


def test_index_counts_every_context_and_removes_exactly():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    index = ContinuationIndex(3)
    index.add(seq)
    assert index.counts((1, 2)) == {3: 2, 4: 1}
    assert index.counts((2,)) == {3: 2, 4: 1} and index.counts((3,)) == {1: 1}
    assert index.counts((4, 1, 2)) == {3: 1} and index.counts((2, 3)) == {1: 1}
    assert index.counts((9,)) is None
    grown = ContinuationIndex(3)
    grown.extend(seq[:4], 0)
    grown.extend(seq, 4)  # extending in steps indexes what one add does
    assert grown._table == index._table
    index.remove(seq)
    assert len(index) == 0 and index.tokens == 0


def test_speculate_follows_the_most_frequent_continuation_and_sizes_by_the_match():
    index = ContinuationIndex(4)
    index.add([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 3])
    cfg = SuffixConfig(max_depth=4, factor=1.0, min_prob=0.0)
    # the history ends with "5 6": a 2-token match drafts ceil(1.0 * 2) = 2 tokens
    out, match, _ = speculate([index], [1, 5, 6], 10, cfg)
    assert match == 2 and out == [7, 8]  # after "5 6 7", 8 followed twice and 3 once
    # a 3-token match at factor 2 drafts 6, each step from the longest context of the text so far
    out, match, _ = speculate([index], [4, 5, 6, 7], 10, SuffixConfig(max_depth=4, factor=2.0, min_prob=0.0))
    assert match == 3 and out == [8, 9, 5, 6, 7, 3]  # the last from "9 5 6 7": 8 and 3 once each, tie -> 3
    # the deepest context wins over a more frequent shallower one: "9 5 6 7" was followed by 8 once and 3 once
    assert speculate([index], [9, 5, 6, 7], 1, cfg)[:2] == ([3], 4)  # a tie goes to the smaller id
    assert speculate([index], [1, 5, 6], 1, cfg)[0] == [7]  # max_tokens caps the budget
    assert speculate([index], [42], 10, cfg) == ([], 0, [])  # no match, no draft
    # min_prob stops a path at its first uncertain step: "7" continues to 8 (2/3) or 3 (1/3)
    assert speculate([index], [5, 6, 7], 10, SuffixConfig(max_depth=4, factor=4.0, min_prob=0.7))[0] == []
    assert speculate([index], [5, 6, 7], 10, SuffixConfig(max_depth=4, factor=4.0, min_prob=0.6))[0][:1] == [8]


def test_confidences_are_the_smoothed_logit_of_the_continuation_share():
    from specadapt.engine.suffix import step_confidence

    index = ContinuationIndex(2)
    index.add([1, 2, 1, 2, 1, 2, 1, 3])
    out, match, conf = speculate([index], [1], 2, SuffixConfig(max_depth=2, factor=2.0, min_prob=0.0))
    # after "1": 2 three times, 3 once -> logit(3 / 5); after "1 2": 1 three times -> logit(3 / 4)
    assert out == [2, 1] and match == 1
    assert conf == [pytest.approx(math.log(3 / 2)), pytest.approx(math.log(3 / 1))]
    assert step_confidence(1, 1) == 0.0


def test_config_errors_name_the_field():
    for field, value in (("max_depth", 0), ("factor", 0.0), ("min_prob", 1.0), ("global_tokens", -1)):
        with pytest.raises(ValueError, match=field):
            SuffixConfig(**{field: value})


def test_outputs_of_finished_requests_feed_the_global_index_bounded():
    draft = SuffixDraft(SuffixConfig(max_depth=3, global_tokens=10, min_prob=0.0))
    first = [1, 2, 3, 4, 5, 6, 7]  # prompt [1, 2], output [3 .. 7]
    draft.start([first[:2]])
    draft.propose([first], torch.tensor([3]), 16)
    draft.select(torch.tensor([], dtype=torch.int64))  # the request finished
    assert draft.global_index.counts((3, 4)) == {5: 1} and draft.global_index.counts((1,)) is None  # output only
    # a new request whose history ends like the earlier output is drafted from the global index
    draft.start([[9, 3, 4]])
    proposal = draft.propose([[9, 3, 4]], torch.tensor([2]), 16)
    assert proposal.num_tokens.tolist() == [2] and proposal.tokens[0, :2].tolist() == [5, 6]
    assert torch.equal(proposal.probs[0, :2].argmax(-1), torch.tensor([5, 6]))
    assert draft.last_match.tolist() == [2]
    assert proposal.confidence.shape == (1, 2) and proposal.confidence[0, 0] == 0.0  # seen once: logit(1 / 2)
    # more outputs than global_tokens: the oldest request's tokens are evicted first
    for start in (20, 30):
        h = [0, start, start + 1, start + 2, start + 3, start + 4, start + 5]
        draft.start([h[:1]])
        draft.propose([h], torch.tensor([0]), 64)
        draft.select(torch.tensor([], dtype=torch.int64))
    assert draft.global_index.counts((3, 4)) is None and draft.global_index.counts((30, 31)) == {32: 1}
    assert draft.global_index.tokens <= 10


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_output_equals_target_only_greedy(tiny_target, rule, batch_size):
    n = 24
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    draft = SuffixDraft(SuffixConfig(max_depth=4, factor=2.0, min_prob=0.0))
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, 6, rule)
    results = engine.generate(PROMPTS, n, batch_size=batch_size)
    assert [r.output_ids for r in results] == expected
    assert sum(r.num_drafted for res in results for r in res.rounds) > 0, "nothing drafted: the test is vacuous"
    again = engine.generate(PROMPTS, n, batch_size=batch_size)  # now with the global index of the first run
    assert [r.output_ids for r in again] == expected
    base = SpeculativeEngine(tiny_target, NoDraft(), GREEDY, 0, rule).generate(PROMPTS, n, batch_size=batch_size)
    assert [r.output_ids for r in base] == expected


@pytest.mark.parametrize("rule,params", [("chain", SamplingParams(1.0)), ("block", SamplingParams(1.0, top_k=5))])
def test_sampled_output_follows_the_target_law(rule, params):
    """Chi-square of the first two emitted tokens over 4000 requests against the exact joint law of the target."""
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    draft = SuffixDraft(SuffixConfig(max_depth=2, factor=2.0, min_prob=0.0, global_tokens=0))
    engine = SpeculativeEngine(target, draft, params, 2, rule, seed=3)
    n_req = 4000
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results), "the draft never helped: the test would be vacuous"
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


def test_generate_with_the_suffix_draft(capsys, tiny_model_dir, tmp_path):
    import json

    from tests.helpers.cli import run_generate

    out = tmp_path / "suffix.json"
    code, _, err = run_generate(capsys, "--model", str(tiny_model_dir), "--draft", "suffix", "--temperature", "0",
                                "--limit", "2", "--max-new-tokens", "24", "--suffix-max-depth", "4", "--baseline",
                                "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["config"]["draft"] == "suffix" and report["config"]["num_draft_tokens"] == 4
    assert report["summary"]["output_tokens"] == report["summary"]["baseline_output_tokens"]


@pytest.mark.parametrize("argv, flag", [(["--suffix-max-depth", "0"], "--suffix-max-depth"),
                                        (["--suffix-min-prob", "1.5"], "--suffix-min-prob"),
                                        (["--suffix-global-tokens", "-1"], "--suffix-global-tokens"),
                                        (["--verify", "gbv"], "--verify"),
                                        (["--tts"], "--tts")])
def test_suffix_flag_errors_name_the_flag(capsys, tiny_model_dir, argv, flag):
    from tests.helpers.cli import run_generate

    code, _, err = run_generate(capsys, "--model", str(tiny_model_dir), "--draft", "suffix", *argv)
    assert code == 2 and flag in err


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_adaptive_verification_fits_deterministic_drafts_on_their_own_feature(tiny_target, kind):
    """Under adaptive verification a deterministic draft's feature is its confidence (match size for ngram, the
    smoothed continuation share for suffix), not the clamped logit(q_max) of its one-hot q; greedy output unchanged."""
    from specadapt.engine import NgramDraft

    draft = NgramDraft() if kind == "ngram" else SuffixDraft(SuffixConfig(max_depth=4, factor=2.0, min_prob=0.0))
    features = logged_av_features(tiny_target, draft)
    assert max(features) < 40.0 and len(set(features)) > 1
