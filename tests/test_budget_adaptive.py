"""Budget selection and adaptive verification in the engine (exactness with pruning)."""

import functools

import numpy as np
import pytest
import torch

from tests.helpers.models import loaded, tiny_llama
from tests.helpers.engine import GREEDY, PROMPTS, _exact_joint, assert_first_tokens_follow, naive_greedy
from specadapt.budget import CostTable, allocate_prefixes, choose_budget, survival
from specadapt.budget.config import AVConfig
from specadapt.engine import ModelDraft, NgramDraft, SpeculativeEngine
from specadapt.engine.adaptive import AdaptiveVerification, profile_engine_costs
from specadapt.engine.drafts import self_draft
from specadapt.estimator import AcceptanceEstimator
from specadapt.estimator.features import feature_from_probs
from specadapt.sampling import SamplingParams


def test_survival_and_prefix_allocation():
    probs = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.9, 0.9], [0.2, 1.0, 1.0]])
    s = survival(probs, torch.tensor([3, 3, 1]))
    torch.testing.assert_close(s, torch.tensor([[0.9, 0.81, 0.081], [0.5, 0.45, 0.405], [0.2, 0.0, 0.0]],
                                               dtype=torch.float64))
    assert allocate_prefixes(s, 4).tolist() == [2, 2, 0]  # 0.9, 0.81, 0.5, 0.45
    assert allocate_prefixes(s, 0).tolist() == [0, 0, 0]
    # equal survivals along a request stay a contiguous prefix
    flat = survival(torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    assert allocate_prefixes(flat, 3).tolist() == [2, 1]


def test_choose_budget_trades_expected_tokens_for_cost():
    s = torch.tensor([[0.9, 0.5, 0.1]], dtype=torch.float64)
    flat_cost = CostTable(target_ms=[10.0] * 8, draft_ms=[1.0])
    assert choose_budget(s, flat_cost) == 3  # extra tokens are free: verify all
    steep = CostTable(target_ms=[10.0 * n for n in range(1, 9)], draft_ms=[0.0])
    # E/C: B=0 1/10, B=1 1.9/20, ...: verifying costs more than it returns
    assert choose_budget(s, steep) == 0
    mid = CostTable(target_ms=[10.0, 11.0, 14.0, 20.0], draft_ms=[0.0])
    # B=0 .100, B=1 1.9/11=.173, B=2 2.4/14=.171, B=3 2.5/20=.125
    assert choose_budget(s, mid) == 1


def test_choose_budget_costs_the_draft_depth_with_early_stop():
    s = torch.tensor([[0.5, 0.1, 0.05]], dtype=torch.float64)
    costs = CostTable(target_ms=[1.0] * 8, draft_ms=[3.0])  # verify is flat; drafting 3 steps costs 3 ms
    # the spec's fixed draft cost: E / 4 ms grows with B -> verify all
    assert choose_budget(s, costs) == 3
    # early stop: B slots cost max(depth, 1) steps; B=0 1/2, B=1 1.5/2, B=2 1.6/3, B=3 1.65/4 -> B = 1
    assert choose_budget(s, costs, draft_steps=3) == 1
    # two requests: the depth is the deepest of the top-B slots, whichever request holds it
    s2 = torch.tensor([[0.9, 0.2], [0.8, 0.1]], dtype=torch.float64)
    c2 = CostTable(target_ms=[1.0] * 8, draft_ms=[2.0, 2.0])
    # B=0 2/(1+1)=1.0, B=1 2.9/2, B=2 3.7/2=1.85 (both first slots: depth 1), B=3 3.9/3=1.3, B=4 4.0/3
    assert choose_budget(s2, c2, draft_steps=2) == 2
    assert choose_budget(s2, c2) == 4  # the spec's fixed draft cost: every B costs 2 + 1
    with pytest.raises(ValueError, match="draft_steps"):
        choose_budget(s2, c2, draft_steps=0)


def test_cost_table_monotone_extrapolation_and_io(tmp_path):
    t = CostTable(target_ms=[5.0, 4.0, 7.0], draft_ms=[1.0, 3.0])
    assert t.target_ms == [4.5, 4.5, 7.0]  # pooled, not a running maximum
    assert CostTable(target_ms=[1.0, 9.0, 2.0, 3.0, 10.0], draft_ms=[1.0]).target_ms == [1.0, 14 / 3, 14 / 3, 14 / 3, 10.0]
    assert t.verify_cost(5) == pytest.approx(7.0 + 1.25 * 2)  # slope of the pooled table
    path = tmp_path / "costs.json"
    t.save(path)
    assert CostTable.load(path).target_ms == t.target_ms
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        CostTable.load(tmp_path / "bad.json")


def test_feature_from_probs():
    q = torch.tensor([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0]])
    f = feature_from_probs(q)
    assert float(f[0]) == pytest.approx(np.log(0.7 / 0.3), rel=1e-6)
    from specadapt.estimator.features import FEATURE_CLAMP

    assert float(f[1]) == FEATURE_CLAMP


def _adaptive(L, costs):
    return AdaptiveVerification(AcceptanceEstimator(L, refit_interval=5), costs)


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_adaptive_greedy_equals_target_only(tiny_target, rule):
    n = 24
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    costs = CostTable(target_ms=[10.0, 11.0, 13.0, 16.0, 20.0, 25.0] + [30.0 + 6 * i for i in range(20)],
                      draft_ms=[1.0] * 4)
    av = _adaptive(4, costs)
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    results = SpeculativeEngine(tiny_target, draft, GREEDY, 4, rule, adaptive=av).generate(PROMPTS, n, batch_size=4)
    assert [r.output_ids for r in results] == expected
    assert av.verified > 0


def test_adaptive_sampled_output_follows_the_target_law():
    """With pruning active, 4000 requests' first two tokens follow the exact target law (chi-square)."""
    params = SamplingParams(1.0)
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    # a cost that rises steeply with tokens: B* prunes a real share of the drafts
    costs = CostTable(target_ms=[1.0 + 0.0005 * n * n for n in range(1, 20001)], draft_ms=[0.0])
    # speculation="on": B = 0 keeps drafting (with "auto" this cost turns speculation off after round 1;
    # tests/test_speculation_off.py tests that mode's law)
    av = AdaptiveVerification(AcceptanceEstimator(2, refit_interval=1), costs, speculation="on")
    draft = ModelDraft(self_draft(target, 1), params, 2, "self:1")
    n_req = 4000
    results = SpeculativeEngine(target, draft, params, 2, "chain", seed=3, adaptive=av, speculation="on").generate(
        [prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert av.pruned > 0 and av.verified > 0, "pruning must be active or the test proves nothing"
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


@pytest.mark.parametrize("which", ["self:1", "eagle"])
def test_profile_engine_costs_times_the_path_in_use(tiny_target, which):
    """The cost table times the engine's own forward path and draft object (issue 16: the native path's costs
    are not transformers'), at interpolated sizes, monotone; ngram costs no draft time."""
    from tests.helpers.engine import eagle

    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1") if which == "self:1" else eagle(tiny_target)
    costs = profile_engine_costs(tiny_target, draft, 12, 3, 2, repeats=2, context=16)
    assert len(costs.target_ms) == 12 and len(costs.draft_ms) == 3
    assert all(b >= a for a, b in zip(costs.target_ms, costs.target_ms[1:]))
    assert costs.draft_ms[0] > 0
    # the draft is usable afterwards (the engine starts it again)
    out = SpeculativeEngine(tiny_target, draft, GREEDY, 2, "chain").generate(PROMPTS[:2], 6)
    assert [r.output_ids for r in out] == [naive_greedy(tiny_target.model, p, 6) for p in PROMPTS[:2]]
    ngram_costs = profile_engine_costs(tiny_target, NgramDraft(), 3, 2, 2, repeats=1, context=8)
    assert ngram_costs.draft_ms == [0.0, 0.0]
    with pytest.raises(ValueError, match="max_tokens"):
        profile_engine_costs(tiny_target, None, 0, 2, 2)


def test_profile_sizes():
    from specadapt.engine.adaptive import profile_sizes

    assert profile_sizes(5) == [1, 2, 3, 4, 5]
    sizes = profile_sizes(256)
    assert sizes[:8] == list(range(1, 9)) and sizes[-1] == 256 and len(sizes) < 30
    assert all(b > a for a, b in zip(sizes, sizes[1:]))


def test_adaptive_with_ngram(tiny_target):
    av = _adaptive(2, CostTable([1.0], [1.0]))
    # ngram drafts work with it (q one-hot: feature 40)
    SpeculativeEngine(tiny_target, NgramDraft(), GREEDY, 2, "block", adaptive=av).generate(PROMPTS[:1], 5)


@pytest.mark.parametrize("budget", [0, 1, 3, 6, 40])
def test_early_stop_gives_the_caps_of_full_drafting(tiny_target, budget):
    """Same generator state, same estimator, same stale B*: drafting with the early-stop filter (and with the
    look-ahead caps) yields exactly the caps (and the capped tokens) of drafting every position then pruning;
    only the width and the number of draft forwards shrink."""
    params = SamplingParams(1.0)
    histories = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 3, 3, 3, 3]]
    L = 5
    estimator = AcceptanceEstimator(L, init_slope=0.4, init_intercept=0.3)
    estimator.intercepts = torch.tensor([0.5, 0.0, -0.5, -1.0, -1.5], dtype=torch.float64)
    costs = CostTable(target_ms=[1.0] * 64, draft_ms=[0.0])
    results = {}
    for mode in ("full", "filter", "caps"):
        av = AdaptiveVerification(estimator, costs, AVConfig(early_stop=mode != "full"))
        av.stale_budget = budget
        draft = ModelDraft(self_draft(tiny_target, 1), params, 11, "self:1")
        filter_only = functools.partial(av.draft_caps, lookahead=False)
        draft_filter = {"full": None, "filter": filter_only, "caps": av.draft_caps}[mode]
        draft.start(histories)
        forwards = []
        inner = draft.kv.forward
        draft.kv.forward = lambda *a, **k: forwards.append(1) or inner(*a, **k)
        proposal = draft.propose(histories, torch.full((4,), L), 32, draft_filter=draft_filter)
        av.stale_budget = budget
        caps, _, _ = av.plan(proposal.probs, proposal.num_tokens)
        results[mode] = (caps, proposal, av.pruned, len(forwards))
    caps_full, full, pruned_full, forwards_full = results["full"]
    for mode in ("filter", "caps"):
        caps_early, early_p, pruned_early, _ = results[mode]
        assert torch.equal(caps_full, caps_early), mode
        assert pruned_full == pruned_early, mode  # drafts never drafted count as pruned
        for r in range(4):
            c = int(caps_full[r])
            assert torch.equal(full.tokens[r, :c], early_p.tokens[r, :c])
        assert early_p.tokens.shape[1] <= full.tokens.shape[1]
        if budget <= 3:
            assert early_p.tokens.shape[1] < L, "a small budget must cut drafting short"
        if budget == 0:
            assert int(early_p.num_tokens.max()) == 0
    forwards_filter, forwards_caps = results["filter"][3], results["caps"][3]
    assert forwards_caps <= forwards_filter <= forwards_full
    if budget == 1:  # the look-ahead skips the forward that only shows the next slot is out of the budget
        assert forwards_caps < forwards_filter


def test_lookahead_bound_uses_the_largest_possible_next_acceptance():
    costs = CostTable(target_ms=[1.0] * 8, draft_ms=[0.0])
    est = AcceptanceEstimator(3, init_slope=0.0, init_intercept=0.0)  # every prediction 0.5
    av = AdaptiveVerification(est, costs)
    av.stale_budget = 2
    probs = torch.full((2, 1, 4), 0.25)
    # survivals at position 0: 0.5 and 0.5; threshold (2nd largest) 0.5; next slot at most 0.5 * 0.5 < 0.5: stop
    assert av.draft_caps(0, probs, torch.tensor([3, 3])).tolist() == [1, 1]
    assert av.draft_caps(0, probs, torch.tensor([3, 3]), lookahead=False).tolist() == [3, 3]
    av.stale_budget = 3  # only 2 slots known: nothing can be ruled out yet
    assert av.draft_caps(0, probs, torch.tensor([3, 3])).tolist() == [3, 3]
    # a negative slope is bounded with |omega| * c (c = FEATURE_CLAMP = 8): row 0 (confident, f = 3.5) predicts
    # 0.03, row 1 (flat q, f = -4.6) 0.99; threshold 0.03; row 0's next slot reaches at most
    # 0.03 * sigmoid(8) < 0.03: ruled out; row 1's may reach 0.99 * sigmoid(8) (with omega instead of |omega| it
    # would be 0.99 * sigmoid(-8) < 0.03 and row 1 would stop too)
    est.slope = -1.0
    av.stale_budget = 2
    peaked = torch.full((100,), 0.03 / 99)
    peaked[0] = 0.97
    probs = torch.stack([peaked, torch.full((100,), 0.01)])[:, None, :]
    assert av.draft_caps(0, probs, torch.tensor([3, 3])).tolist() == [1, 3]


def test_draft_filter_is_off_without_a_budget_or_pruning():
    costs = CostTable(target_ms=[1.0] * 8, draft_ms=[0.0])
    av = AdaptiveVerification(AcceptanceEstimator(3), costs)
    probs = torch.full((2, 1, 5), 0.2)
    assert (av.draft_caps(0, probs, torch.tensor([3, 0])) > 0).tolist() == [True, False]  # no stale budget yet
    unpruned = AdaptiveVerification(AcceptanceEstimator(3), costs, prune=False)
    unpruned.stale_budget = 0
    assert (unpruned.draft_caps(0, probs, torch.tensor([3, 3])) > 0).tolist() == [True, True]


def test_draft_caps_reuses_the_features_of_earlier_positions():
    """Features are computed once per drafted position; the result equals a full recomputation each step."""
    costs = CostTable(target_ms=[1.0] * 16, draft_ms=[0.0])
    g = torch.Generator().manual_seed(7)
    probs = torch.softmax(3 * torch.randn(3, 4, 20, generator=g), dim=-1)
    num = torch.full((3,), 4)
    cached = AdaptiveVerification(AcceptanceEstimator(4, init_slope=0.6), costs)
    fresh = AdaptiveVerification(AcceptanceEstimator(4, init_slope=0.6), costs)
    for av in (cached, fresh):
        av.stale_budget = 5
    for step in range(4):
        fresh._round_features = None  # forces a full recomputation
        a = cached.draft_caps(step, probs[:, : step + 1], num)
        b = fresh.draft_caps(step, probs[:, : step + 1], num)
        assert torch.equal(a, b)
        torch.testing.assert_close(cached._round_features, fresh._round_features)
    assert cached._round_features.shape == (3, 4)


def _one_round(tiny_target, mode, budget, estimator, costs, histories, L, seed=11):
    av = AdaptiveVerification(estimator, costs, AVConfig(early_stop=mode != "full"))
    av.stale_budget = budget
    draft = ModelDraft(self_draft(tiny_target, 1), SamplingParams(1.0), seed, "self:1")
    draft_filter = None if mode == "full" else av.draft_caps
    draft.start(histories)
    proposal = draft.propose(histories, torch.full((len(histories),), L), 32, draft_filter=draft_filter)
    caps, _, _ = av.plan(proposal.probs, proposal.num_tokens)
    return caps, av.stale_budget


@pytest.mark.parametrize("budget", [0, 1, 3, 6, 40])
@pytest.mark.parametrize("seed", [11, 12])
def test_early_stop_and_full_drafting_choose_the_same_next_budget(tiny_target, budget, seed):
    """Issue 19.2: the next round's B* comes from the same information with and without early stop (sampled q
    rows, coupled draft generators), and a round with B* = 0 still chooses a next B* (here > 0: a flat cost)."""
    histories = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 3, 3, 3, 3]]
    L = 5
    estimator = AcceptanceEstimator(L, init_slope=0.4, init_intercept=0.3)
    estimator.intercepts = torch.tensor([0.5, 0.0, -0.5, -1.0, -1.5], dtype=torch.float64)
    for costs in (CostTable(target_ms=[1.0] * 64, draft_ms=[0.0]),
                  CostTable(target_ms=[1.0 + 0.05 * n * n for n in range(64)], draft_ms=[0.0])):
        caps_full, next_full = _one_round(tiny_target, "full", budget, estimator, costs, histories, L, seed)
        caps_early, next_early = _one_round(tiny_target, "early", budget, estimator, costs, histories, L, seed)
        assert torch.equal(caps_full, caps_early)
        assert next_full == next_early
        if budget == 0:
            assert int(caps_early.sum()) == 0
            if costs.target_ms[-1] == 1.0:
                assert next_early > 0, "a flat cost makes drafting pay: the budget must return from 0"


def _av_run(target, params, mode, n=24, L=3, seed=0):
    """Issue 19's setting: speculation="on" (a round with B* = 0 still drafts position 1, so the budget can
    return from 0 without probes; "auto", where B* = 0 turns drafting off, is tests/test_speculation_off.py's)."""
    costs = CostTable(target_ms=[1.0] * 64, draft_ms=[0.0])  # verifying is free: every draft pays
    av = AdaptiveVerification(AcceptanceEstimator(L, refit_interval=5), costs, AVConfig(early_stop=mode == "early"),
                              speculation="on")
    av.stale_budget = 0  # the budget starts at 0
    draft = ModelDraft(self_draft(target, 2), params, seed, "self:2")  # a copy
    engine = SpeculativeEngine(target, draft, params, L, "chain", seed=seed, adaptive=av, speculation="on")
    return engine, av, engine.generate(PROMPTS, n, batch_size=4)


def test_budget_returns_from_zero_with_early_stop_greedy(tiny_target):
    """Issue 19.2: a draft that is a copy of the target (every verified draft accepted) and a budget that
    starts at 0: with early stop (the default) drafting resumes after the first round, rounds verify the same
    drafts as full drafting, and a second generate() on the same engine verifies drafts too."""
    n = 24
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    runs = {mode: _av_run(tiny_target, GREEDY, mode, n) for mode in ("early", "full")}
    drafted = {}
    for mode, (engine, av, results) in runs.items():
        assert [r.output_ids for r in results] == expected
        drafted[mode] = [[r.num_drafted for r in res.rounds] for res in results]
        for res in results:
            assert res.rounds[0].num_drafted == 0  # B* = 0: nothing verified in round 1
            assert all(r.num_drafted > 0 for r in res.rounds[1:-1]), mode
            assert all(r.accepted == r.num_drafted for r in res.rounds)
        verified = av.verified
        again = engine.generate(PROMPTS, n, batch_size=4)
        assert [r.output_ids for r in again] == expected
        assert av.verified > verified and all(r.rounds[0].num_drafted > 0 for r in again), mode
    assert drafted["early"] == drafted["full"]


def test_budget_returns_from_zero_with_early_stop_sampled():
    params = SamplingParams(1.0)
    target = loaded(tiny_llama(vocab=16, seed=3, init_std=0.3))
    _, av, results = _av_run(target, params, "early", n=20)
    per_round = [r.num_drafted for res in results for r in res.rounds[1:]]
    assert sum(per_round) > 0.5 * 3 * len(per_round), "drafting must resume after the B* = 0 round"
    accepted = sum(r.accepted for res in results for r in res.rounds)
    assert accepted > 0.9 * av.verified  # a copy of the target: (nearly) every verified draft accepted
