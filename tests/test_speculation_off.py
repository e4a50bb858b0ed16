"""Issue 16: adaptive verification that can turn speculation off (B = 0 costed as a plain target step), probe
rounds that turn it back on, the deferred catch-up of the EAGLE head, adaptive verification with GBV, the
engine's ``speculation`` switch and the cost model's record of measured rounds."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import loaded, tiny_llama
from tests.helpers.engine import GREEDY, PROMPTS, _exact_joint, assert_first_tokens_follow, eagle, naive_greedy
from specadapt.budget import CostTable, choose_budget
from specadapt.budget.config import AVConfig
from specadapt.engine import ModelDraft, SpeculativeEngine
from specadapt.engine.loop import Request
from specadapt.engine.adaptive import AdaptiveVerification
from specadapt.engine.drafts import self_draft
from specadapt.estimator import AcceptanceEstimator
from specadapt.sampling import SamplingParams

FLAT = CostTable(target_ms=[1.0] * 256, draft_ms=[0.0])  # verifying is free: every draft pays
STEEP = CostTable(target_ms=[10.0 * n for n in range(1, 257)], draft_ms=[5.0])  # no draft ever pays


def _av(L, costs, speculation="auto", **settings):
    """Synthetic cost tables: the learnt overhead (measured - predicted) is off, or the tiny models' real round
    times would rewrite the costs these tests choose; likewise the probe share's measured probe cost.
    ``settings``: :class:`AVConfig` fields."""
    settings.setdefault("online_overhead", False)
    settings.setdefault("probe_share", 0.0)
    settings.setdefault("probe_rows", 0)  # a probe verifies every request unless a test says otherwise
    settings.setdefault("resume_probes", 1)  # one probe choosing B* > 0 resumes speculation unless a test says
    return AdaptiveVerification(AcceptanceEstimator(L, refit_interval=5), costs, AVConfig(**settings),
                                speculation=speculation)


def _count_forwards(draft) -> list:
    """Wrap the draft's cache forward (created by start()) so each call appends 1 to the returned list."""
    calls = []
    original_start = draft.start

    def start(histories):
        original_start(histories)
        inner = draft.kv.forward
        draft.kv.forward = lambda *a, **k: calls.append(1) or inner(*a, **k)

    draft.start = start
    return calls


def test_choose_budget_costs_zero_as_a_plain_target_step():
    s = torch.tensor([[0.5, 0.2]], dtype=torch.float64)
    costs = CostTable(target_ms=[10.0, 11.0, 12.0], draft_ms=[6.0])
    # draft always paid: B=0 1/16, B=1 1.5/17, B=2 1.7/18 -> B = 2
    assert choose_budget(s, costs) == 2
    # B = 0 costs a target step only: 1/10 beats 1.5/17 and 1.7/18 -> 0
    assert choose_budget(s, costs, zero_is_off=True) == 0
    assert choose_budget(torch.tensor([[0.9, 0.8]], dtype=torch.float64), costs, zero_is_off=True) == 2


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_zero_budget_turns_speculation_off_and_a_probe_turns_it_on(tiny_target, rule):
    """A copy of the target as draft, a flat cost, the budget starting at 0: rounds 1..probe_interval draft
    nothing (no draft forward at all), the next round probes one draft per request, and drafting resumes."""
    n, L = 24, 3
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    av = _av(L, FLAT, probe_interval=2)
    av.stale_budget = 0
    draft = ModelDraft(self_draft(tiny_target, 2), GREEDY, 0, "self:2")
    forwards = _count_forwards(draft)
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, L, rule, adaptive=av)
    results = engine.generate(PROMPTS, n, batch_size=4)
    assert [r.output_ids for r in results] == expected
    for res in results:
        drafted = [r.num_drafted for r in res.rounds]
        if res is results[1]:  # a one-token prompt: the draft has no context in round 1
            continue
        assert drafted[:3] == [0, 0, 1], drafted  # off, off, probe (1 draft)
        assert all(d > 0 for d in drafted[3:-1]), drafted  # drafting resumed
    assert av.rounds_off == 2 and av.probe_rounds == 1
    # round 1 and 2 ran no draft forward: the first forward is the probe's catch-up of all pending tokens
    assert len(forwards) > 0


def test_the_first_round_is_a_probe_and_its_survivals_choose_the_budget(tiny_target):
    """With no budget yet (a fresh engine), the first round drafts probe_depth = 1 per request, all verified;
    a draft that is a copy of the target under a flat cost then speculates at full depth from round 2, a draft
    that never pays (steep cost) switches speculation off from round 2. Greedy output equals target-only."""
    L, n = 3, 16
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    for costs, second in ((FLAT, L), (STEEP, 0)):
        av = _av(L, costs)
        assert av.stale_budget is None
        draft = ModelDraft(self_draft(tiny_target, 2), GREEDY, 0, "self:2")
        results = SpeculativeEngine(tiny_target, draft, GREEDY, L, "chain", adaptive=av).generate(
            PROMPTS, n, batch_size=4)
        assert [r.output_ids for r in results] == expected
        assert av.probe_rounds >= 1
        for res in results:
            if res is results[1]:  # a one-token prompt: the draft has no context in round 1
                continue
            assert res.rounds[0].num_drafted == 1, [r.num_drafted for r in res.rounds]
            assert res.rounds[1].num_drafted == second, [r.num_drafted for r in res.rounds]


def test_deferred_catch_up_runs_no_draft_forward_while_off(tiny_target):
    L = 3
    av = _av(L, STEEP, probe_interval=64, probe_interval_max=64)
    av.stale_budget = 0
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    forwards = _count_forwards(draft)
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, L, "chain", adaptive=av)
    results = engine.generate(PROMPTS, 20, batch_size=4)
    assert [r.output_ids for r in results] == [naive_greedy(tiny_target.model, p, 20) for p in PROMPTS]
    assert forwards == []  # after start()'s prompt prefill: no draft forward while off
    assert av.rounds_off == 20 and av.probe_rounds == 0 and av.verified == 0


def test_probes_back_off_while_speculation_does_not_pay(tiny_target):
    """A steep cost: every probe leaves B* = 0, so the wait before the next one doubles up to the cap."""
    L = 3
    av = _av(L, STEEP, probe_interval=2, probe_interval_max=8)
    draft = ModelDraft(self_draft(tiny_target, 2), GREEDY, 0, "self:2")
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, L, "chain", adaptive=av)
    res = engine.generate([PROMPTS[0]], 60)[0]
    drafted = [r.num_drafted for r in res.rounds]
    assert drafted[0] == 1  # no budget yet: the opening probe drafts probe_depth = 1, not L = 3
    probes = [i for i, d in enumerate(drafted) if i > 0 and d > 0]
    # the opening probe does not double the wait: off 2, probe, off 4, probe, off 8, probe, off 8, probe ...
    assert probes[:4] == [3, 8, 17, 26], drafted
    assert all(drafted[i] == 1 for i in probes)
    assert av.probe_rounds == len(probes) + 1


def test_the_probe_wait_grows_past_its_cap_until_probes_cost_their_share():
    """probe_share: a probe measured at 2 plain rounds' extra time (batch 32 on 2 cores) with a 1% share needs a
    wait of 200 rounds; the doubling goes past probe_interval_max = 8 to 128 = 16 x 8 at most. A cheap probe
    keeps the cap at probe_interval_max."""
    L = 3
    av = _av(L, STEEP, probe_interval=2, probe_interval_max=8, probe_share=0.01)
    assert av.probe_wait_cap() == 8  # nothing measured yet
    av._plain_round_ms, av._round_is_probe, av._predicted_ms = 10.0, True, 10.0
    av.record_round_time(30.0)  # a probe round: 20 ms over a plain one
    assert av._probe_excess_ms == 20.0 and not av._round_is_probe
    assert av.probe_wait_cap() == 128
    av = _av(L, STEEP, probe_interval=2, probe_interval_max=8, probe_share=0.01)
    av._plain_round_ms, av._probe_excess_ms = 10.0, 0.5  # needs 5 rounds: the cap stays 8
    assert av.probe_wait_cap() == 8
    av._probe_excess_ms = 1.2  # needs 12
    assert av.probe_wait_cap() == 12
    assert _av(L, STEEP, probe_interval_max=8, probe_share=0.0).probe_wait_cap() == 8


def test_a_measured_probe_cost_sets_the_wait_at_once():
    """Once a probe's extra time is known, a probe that keeps speculation off waits at least the share's rounds
    at once (it used to double towards them): from a wait of 2, a probe measured at 20 ms over a 10 ms plain
    round with a 1% share (200 rounds) waits 128 = 16 x probe_interval_max next; a cheap probe (5 rounds) leaves
    the doubling in charge; without a measurement, or without a share, the wait doubles up to the cap."""
    L = 3
    av = _av(L, STEEP, probe_interval=2, probe_interval_max=8, probe_share=0.01)
    assert av.share_wait() == 0 and av.next_probe_wait() == 4  # nothing measured: doubling
    av._plain_round_ms, av._probe_excess_ms = 10.0, 20.0
    assert av.share_wait() == 200 and av.next_probe_wait() == 128
    av._probe_excess_ms = 0.5  # 5 rounds: doubling from 2 gives 4, the share 5
    assert av.next_probe_wait() == 5
    av._probe_wait = 8
    assert av.next_probe_wait() == 8  # the doubling is capped at probe_interval_max, the share needs less
    av = _av(L, STEEP, probe_interval=2, probe_interval_max=8, probe_share=0.0)
    av._plain_round_ms, av._probe_excess_ms, av._probe_wait = 10.0, 20.0, 8
    assert av.next_probe_wait() == 8


def test_the_engine_jumps_to_the_share_wait_after_a_measured_probe(tiny_target):
    """In the engine: a steep cost keeps speculation off; with every probe measured as dear (the round timer
    reports a probe as 10 plain rounds more than a plain one) and a 10% share, the share's wait is 100 rounds
    (capped at 16 x probe_interval_max = 64): the second probe's plan, which knows the first probe's cost, sets
    it, where the doubling would give 8."""
    L = 3
    av = _av(L, STEEP, probe_interval=2, probe_interval_max=4, probe_share=0.1)
    record = av.record_round_time

    def fake_timer(measured_ms):  # probes cost 10 plain rounds more, plain rounds their table cost
        plain = av.costs.verify_cost(1)
        record(plain * 11 if av._round_is_probe else plain)

    av.record_round_time = fake_timer
    draft = ModelDraft(self_draft(tiny_target, 2), GREEDY, 0, "self:2")
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, L, "chain", adaptive=av)
    res = engine.generate([PROMPTS[0]], 120)[0]
    drafted = [r.num_drafted for r in res.rounds]
    probes = [i for i, d in enumerate(drafted) if i > 0 and d > 0]
    # opening probe (round 0), off 2, probe (its cost measured after its plan: the wait doubles to 4), off 4,
    # probe (the share now known: 64), off 64, probe
    assert probes[:3] == [3, 8, 73], drafted


def test_speculation_off_and_probes_follow_the_target_law():
    """4000 sampled requests whose first token comes from a round with speculation off and whose second comes
    from a probe round: the first two tokens follow the exact target law (chi-square)."""
    params = SamplingParams(1.0)
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    av = _av(2, FLAT, probe_interval=1)
    av.stale_budget = 0
    draft = ModelDraft(self_draft(target, 1), params, 2, "self:1")
    n_req = 4000
    results = SpeculativeEngine(target, draft, params, 2, "chain", seed=3, adaptive=av).generate(
        [prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert av.rounds_off == 1 and av.probe_rounds == 1
    assert all([r.num_drafted for r in res.rounds][:2] == [0, 1] for res in results)
    assert sum(res.rounds[1].accepted for res in results) > 0, "the probe must accept drafts or it proves little"
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


@pytest.mark.parametrize("probe_rows", [0, 1500])
def test_the_opening_probe_follows_the_target_law(probe_rows):
    """A fresh adaptive verification (no B* yet): 4000 sampled requests whose first round is the opening probe
    (one draft each, every request's verified or, with ``probe_rows``, 1500 of them) and whose next rounds
    speculate at full depth (a copy draft under a flat cost): the first two tokens follow the exact target law
    (chi-square)."""
    params = SamplingParams(1.0)
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    av = _av(2, FLAT, probe_rows=probe_rows)
    draft = ModelDraft(self_draft(target, 2), params, 2, "self:2")
    n_req = 4000
    results = SpeculativeEngine(target, draft, params, 2, "chain", seed=3, adaptive=av).generate(
        [prompt] * n_req, 5, batch_size=n_req, seeds=list(range(n_req)))
    verified = [res.rounds[0].num_drafted for res in results]
    assert av.probe_rounds == 1 and sorted(set(verified)) == ([1] if probe_rows == 0 else [0, 1])
    assert sum(verified) == (probe_rows or n_req)
    assert sum(res.rounds[0].accepted for res in results) > 0, "the probe must accept drafts or it proves little"
    assert any(len(res.rounds) > 1 and res.rounds[1].num_drafted == 2 for res in results)
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


def test_a_probe_above_probe_rows_verifies_a_rotating_subset_and_ranks_every_row(tiny_target):
    """Batch 4, ``probe_rows`` = 2, a draft that never pays (steep cost): each probe verifies the drafts of 2
    requests, the next 2 at the next probe (the opening probe included), the others decode plainly in the same
    round; greedy output equals target-only. The next ``B*`` ranks every request's position-1 survival, verified
    or not: under a flat cost the opening probe switches speculation on although only 2 rows were verified."""
    n, L = 24, 3
    prompts = [p for p in PROMPTS if len(p) > 1][:3] + [[4, 5, 6]]
    expected = [naive_greedy(tiny_target.model, p, n) for p in prompts]
    av = _av(L, STEEP, probe_interval=1, probe_interval_max=1, probe_rows=2)
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    results = SpeculativeEngine(tiny_target, draft, GREEDY, L, "chain", adaptive=av).generate(prompts, n,
                                                                                             batch_size=4)
    assert [r.output_ids for r in results] == expected
    probes = [[res.rounds[i].num_drafted for res in results] for i in range(len(results[0].rounds))
              if any(res.rounds[i].num_drafted for res in results)]
    assert len(probes) >= 3
    assert probes[:3] == [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0]], probes
    seen = []
    av = _av(L, FLAT, probe_rows=2)
    original = av.plan_features

    def plan(features, num_drafts):
        out = original(features, num_drafts)
        seen.append((out[0].tolist(), av.stale_budget))
        return out

    av.plan_features = plan
    results = SpeculativeEngine(tiny_target, ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1"), GREEDY, L,
                                "chain", adaptive=av).generate(prompts, n, batch_size=4)
    assert [r.output_ids for r in results] == expected
    assert seen[0][0] == [1, 1, 0, 0] and seen[0][1] == 4 * L, seen[0]  # every row's L slots in the budget


def test_speculation_resumes_only_after_resume_probes_in_a_row(tiny_target):
    """``resume_probes`` = 2 under a flat cost (drafting always pays): the opening probe chooses B* > 0 but
    speculation stays off, the confirming probe comes ``probe_interval`` rounds later and resumes it; greedy
    output equals target-only. A probe choosing B* = 0 in between restarts the count (unit level)."""
    n, L = 24, 3
    prompts = [p for p in PROMPTS if len(p) > 1]
    expected = [naive_greedy(tiny_target.model, p, n) for p in prompts]
    av = _av(L, FLAT, probe_interval=2, resume_probes=2)
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    results = SpeculativeEngine(tiny_target, draft, GREEDY, L, "chain", adaptive=av).generate(prompts, n,
                                                                                             batch_size=4)
    assert [r.output_ids for r in results] == expected
    drafted = [r.num_drafted for r in results[0].rounds]
    assert drafted[:5] == [1, 0, 0, 1, L], drafted  # probe (held), 2 rounds off, probe (confirmed), speculation
    assert av.probe_rounds == 2 and av.rounds_off == 2
    # unit level: positive, negative, positive probes never resume; two positives in a row do
    av = _av(L, FLAT, resume_probes=2)
    outcomes = []
    for positive in (True, False, True, True):
        av.stale_budget, av._probing, av._round_limit = (0 if av.stale_budget is not None else None), True, 1
        av.costs = FLAT if positive else STEEP
        av.plan_features(torch.full((2, 1), 3.0), torch.ones(2, dtype=torch.int64))
        outcomes.append(av.stale_budget > 0)
    assert outcomes == [False, False, False, True], outcomes


def test_round_kind_names_each_round_as_the_schedule_made_it(tiny_target):
    """``round_kind`` (what benchmarks split time by) follows the schedule of
    ``test_speculation_resumes_only_after_resume_probes_in_a_row``: probe, off, off, probe, then on."""
    av = _av(3, FLAT, probe_interval=2, resume_probes=2)
    kinds = []
    original = av.round_draft_limit

    def limit():
        out = original()
        kinds.append(av.round_kind)
        return out

    av.round_draft_limit = limit
    assert av.round_kind is None
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain", adaptive=av).generate(
        [p for p in PROMPTS if len(p) > 1], 24, batch_size=4)
    assert kinds[:5] == ["probe", "off", "off", "probe", "on"], kinds
    assert kinds.count("probe") == av.probe_rounds and kinds.count("off") == av.rounds_off


def _probe(av, positive, batch=2):
    """Plan one probe round by hand: B* > 0 under a flat cost, 0 under a steep one."""
    av.stale_budget = 0 if av.stale_budget is not None else None
    av._probing, av._round_limit = True, 1
    av.costs = FLAT if positive else STEEP
    av.plan_features(torch.full((batch, 1), 3.0), torch.ones(batch, dtype=torch.int64))


def test_a_held_probe_that_is_not_confirmed_keeps_the_earlier_backoff():
    """A probe choosing B* > 0 that is held (resume_probes = 2) shortens the wait to probe_interval for its
    confirming probe; when that one chooses B* = 0 the backoff goes on from the wait before the hold."""
    av = _av(2, FLAT, resume_probes=2, probe_interval=4, probe_interval_max=64)
    av.stale_budget = 0
    av._probe_wait = 32
    _probe(av, True)
    assert av.stale_budget == 0 and av._probe_wait == 4
    assert not av.budget_rows.any()  # held: speculation stays off, no request is ranked in
    _probe(av, False)
    assert av._probe_wait == 64  # doubled from 32, not from 4


def _drive_eagle(target, draft, histories, schedule, seed=0):
    """:func:`_drive_eagle_rows` with one schedule for every row; returns the q rows of the drafting rounds only."""
    per_row = [torch.tensor(schedule)] * len(histories)
    rows = _drive_eagle_rows(target, draft, histories, per_row, seed)
    return [q for q, limit in zip(rows, schedule) if limit]


def test_deferred_eagle_catch_up_gives_the_q_rows_of_per_round_catch_up(tiny_target):
    """The EAGLE head fed its pending (features, token) pairs in one chunk after rounds with speculation off gives
    the same q rows as feeding them every round (float tolerance: one chunked forward vs single steps)."""
    histories = [[3, 1, 4, 1, 5], [2, 7, 1], [9, 9, 9, 9, 9, 9, 9]]
    every_round = [1] * 9
    deferred = [1, 0, 0, 0, 1, 0, 0, 0, 1]
    a = _drive_eagle(tiny_target, eagle(tiny_target, SamplingParams(1.0)), histories, every_round)
    b = _drive_eagle(tiny_target, eagle(tiny_target, SamplingParams(1.0)), histories, deferred)
    for j, i in enumerate(i for i, limit in enumerate(deferred) if limit):
        torch.testing.assert_close(b[j], a[i], atol=1e-5, rtol=1e-5)
    # a mixed round: row 1 drafts, rows 0 and 2 keep deferring; then all resume
    mixed = eagle(tiny_target, SamplingParams(1.0))
    per_row = [torch.tensor(s) for s in ([1, 0, 0, 1], [1, 1, 1, 1], [1, 0, 0, 1])]
    c = _drive_eagle_rows(tiny_target, mixed, histories, per_row)
    a4 = _drive_eagle(tiny_target, eagle(tiny_target, SamplingParams(1.0)), histories, [1] * 4)
    torch.testing.assert_close(c[-1], a4[-1], atol=1e-5, rtol=1e-5)


def _drive_eagle_rows(target, draft, histories, per_row, seed=0, windows=None, catch_up=None):
    """Feed ``draft`` round by round as the engine does, with random target features; ``per_row[r][i]`` is the
    max drafts of row r in round i (0 defers its catch-up); ``windows[i]``: the round's ``probe_window`` (as the
    engine sets it on a probe round); ``catch_up[i]``: the round's ``catch_up_rows`` (``[B]`` bool or ``None``,
    as the engine sets it on a speculative round). Returns the q rows of position 1 of every round (``None`` for
    a round in which no row drafted)."""
    gen = torch.Generator().manual_seed(seed)
    hidden3 = 3 * target.model.config.hidden_size
    draft.context_capacity = 256
    draft.start(histories)
    draft.observe_target(torch.randn(len(histories), max(len(h) for h in histories) - 1, hidden3, generator=gen))
    histories = [list(h) for h in histories]
    rows = []
    for i in range(len(per_row[0])):
        limits = torch.tensor([int(s[i]) for s in per_row])
        draft.probe_window = None if windows is None else windows[i]
        draft.catch_up_rows = None if catch_up is None else catch_up[i]
        proposal = draft.propose(histories, limits, target.vocab_size)
        rows.append(proposal.probs[:, 0].clone() if proposal.probs.shape[1] else None)
        draft.observe_target(torch.randn(len(histories), 1, hidden3, generator=gen))  # slot 0's features
        draft.commit(torch.zeros(len(histories), dtype=torch.int64))  # tau = 0: one token emitted per row
        for r, h in enumerate(histories):  # the committed token (any fixed sequence)
            h.append((len(h) * 7 + r) % 32)
    return rows


def test_a_windowed_probe_is_rolled_back_and_the_resumed_catch_up_stays_exact(tiny_target):
    """A probe round (two drafts deep) with ``probe_window`` = 2: rows 0 and 2, off for 6 rounds, draft from their
    newest 2 pending pairs only (their q rows differ from a full catch-up's); row 1, which drafted every round,
    has 1 pending pair and is caught up for good. After rolling back the scratch entries (the window and the draft
    step), the rounds that draft again with the whole queue fed give the q rows of a run whose probe caught up
    everything. A window that holds the whole queue is the full catch-up."""
    histories = [[3, 1, 4, 1, 5], [2, 7, 1], [9, 9, 9, 9, 9, 9, 9]]
    off = [1, 0, 0, 0, 0, 0, 0, 2, 0, 0, 1, 1]
    every = [1, 1, 1, 1, 1, 1, 1, 2, 0, 0, 1, 1]
    per_row = [torch.tensor(off), torch.tensor(every), torch.tensor(off)]
    probe, later = 7, (10, 11)
    reference = eagle(tiny_target, SamplingParams(1.0))
    exact = _drive_eagle_rows(tiny_target, reference, histories, per_row)
    for window, same_probe in ((2, False), (64, True)):
        windows = [window if i == probe else None for i in range(len(off))]
        draft = eagle(tiny_target, SamplingParams(1.0))
        got = _drive_eagle_rows(tiny_target, draft, histories, per_row, windows=windows)
        assert draft._scratch is None and draft.kv.lengths.tolist() == reference.kv.lengths.tolist()
        close = [torch.allclose(got[probe][r], exact[probe][r], atol=1e-5, rtol=1e-5) for r in range(3)]
        assert close == [same_probe, True, same_probe], f"window {window}: {close}"  # row 1 was caught up
        for i in later:  # speculation resumed: the exact catch-up of every pair
            torch.testing.assert_close(got[i], exact[i], atol=1e-5, rtol=1e-5)


def test_speculative_rounds_catch_up_only_the_rows_the_budget_ranked_in(tiny_target):
    """``catch_up = "budget"``: after 6 rounds off, speculative rounds (two drafts deep) with a window of 2 feed
    the whole queue of the rows in ``catch_up_rows`` only (their q rows are those of a run that caught up every
    round); a row outside it with more pending pairs than the window drafts from a scratch window (other q rows)
    and keeps its queue, fed exactly in the first round that names it; a row whose queue fits the window (row 1,
    which drafted every round) is caught up whatever it is named. The head's cache ends where the exact run's
    does."""
    histories = [[3, 1, 4, 1, 5], [2, 7, 1], [9, 9, 9, 9, 9, 9, 9], [5, 6, 7, 8]]
    off = [1, 0, 0, 0, 0, 0, 0, 2, 2, 2, 1]
    every = [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 1]
    per_row = [torch.tensor(off), torch.tensor(every), torch.tensor(off), torch.tensor(off)]
    T, F = True, False
    named = {7: [T, F, F, F], 8: [T, F, T, F], 9: [T, F, T, T], 10: [F, F, F, F]}
    windows = [2 if i in named else None for i in range(len(off))]
    catch_up = [torch.tensor(named[i]) if i in named else None for i in range(len(off))]
    exact = _drive_eagle_rows(tiny_target, eagle(tiny_target, SamplingParams(1.0)), histories, per_row)
    draft = eagle(tiny_target, SamplingParams(1.0))
    got = _drive_eagle_rows(tiny_target, draft, histories, per_row, windows=windows, catch_up=catch_up)
    expected = {7: [T, T, F, F], 8: [T, T, T, F], 9: [T, T, T, T], 10: [T, T, T, T]}
    for i, want in expected.items():
        close = [torch.allclose(got[i][r], exact[i][r], atol=1e-5, rtol=1e-5) for r in range(4)]
        assert close == want, f"round {i}: {close}"
    assert draft._scratch is None and draft._pending.counts.tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="catch_up_rows"):
        _drive_eagle_rows(tiny_target, eagle(tiny_target, SamplingParams(1.0)), histories, per_row,
                          windows=windows, catch_up=[torch.ones(3, dtype=torch.bool)] * len(off))


def test_a_windowed_probe_drafts_at_the_true_positions(tiny_target, monkeypatch):
    """The opening probe with ``probe_window`` = W on a long prompt (nothing caught up yet), two drafts deep: the
    head sees only the newest W pairs, at their true positions; rotary attention depends on relative positions
    only, so its q rows are those of a fresh head given just those W pairs (positions 0..W-1). A window fed at
    the cache's positions would also match at draft 1 but not at draft 2 if the draft step were not shifted."""
    import specadapt.engine.eagle_draft as eagle_module

    monkeypatch.setattr(eagle_module, "draw_tokens", lambda q, coins: q.argmax(-1, keepdim=True).expand(-1, coins.shape[1]))
    gen = torch.Generator().manual_seed(1)
    hidden3 = 3 * tiny_target.model.config.hidden_size
    history = [int(t) for t in torch.randint(0, 32, (20,), generator=gen)]
    features = torch.randn(1, len(history) - 1, hidden3, generator=gen)
    window = 5
    probs = []
    for h, f, w in ((history, features, window), (history[-(window + 1):], features[:, -window:], None)):
        draft = eagle(tiny_target, SamplingParams(1.0))
        draft.context_capacity = 64
        draft.start([h])
        draft.observe_target(f)
        draft.probe_window = w
        proposal = draft.propose([h], torch.tensor([2]), tiny_target.vocab_size)
        assert proposal.probs.shape[1] == 2
        probs.append(proposal.probs[0])
    torch.testing.assert_close(probs[0], probs[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("partial", [False, True])
def test_a_windowed_probe_follows_the_target_law(partial):
    """4000 sampled requests on a tiny 8-token target with an EAGLE draft: the opening probe drafts from a scratch
    window of 1 pair (of 4 pending), then speculation resumes at full depth from the exact catch-up (flat cost):
    the first two tokens follow the exact target law (chi-square). ``partial``: a cost table under which only
    1,000 verified drafts a round pay, so the resumed rounds catch up only the requests the budget ranked in and
    the others draft from the scratch window again (``catch_up = "budget"``)."""
    params = SamplingParams(1.0)
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    n_req = 4000
    costs = CostTable(target_ms=[1.0] * (n_req + 1000) + [100.0], draft_ms=[0.0]) if partial else FLAT
    av = _av(2, costs, probe_window=1)
    draft = eagle(target, params, seed=2)
    scratch_rounds = []
    original = draft._feed_pending

    def feed(*args, **kwargs):
        out = original(*args, **kwargs)
        scratch_rounds.append(draft._scratch is not None)
        return out

    draft._feed_pending = feed
    results = SpeculativeEngine(target, draft, params, 2, "chain", seed=3, adaptive=av).generate(
        [prompt] * n_req, 5, batch_size=n_req, seeds=list(range(n_req)))
    assert scratch_rounds[0] and any(scratch_rounds[1:]) == partial, scratch_rounds
    assert av.probe_rounds == 1 and all(res.rounds[0].num_drafted == 1 for res in results)
    assert sum(res.rounds[0].accepted for res in results) > 0, "the probe must accept drafts or it proves little"
    second = [res.rounds[1].num_drafted for res in results if len(res.rounds) > 1]
    if partial:  # 1,000 slots: position 1 of 1,000 requests, the rest decode plainly in the same forward
        assert sum(second) == 1000 and max(second) == 1, (sum(second), max(second))
    else:
        assert max(second) == 2
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


@pytest.mark.parametrize("costs", [FLAT, CostTable(target_ms=[1.0 + 0.3 * n for n in range(64)], draft_ms=[0.5])])
@pytest.mark.parametrize("which", ["eagle", "self:1", "eagle-window-1"])
def test_adaptive_gbv_greedy_equals_target_only(tiny_target, costs, which):
    """``eagle-window-1``: every probe (the opening one on prompts of 2+ pending pairs) drafts GBV's paths from
    a scratch window of 1 pair, rolled back after the round."""
    n, L = 20, 3
    prompts = [p for p in PROMPTS if len(p) > 1]
    expected = [naive_greedy(tiny_target.model, p, n) for p in prompts]
    draft = (eagle(tiny_target, subset=torch.arange(0, 32, 2)) if which.startswith("eagle")
             else ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1"))
    window = which == "eagle-window-1"  # probes two drafts deep: GBV's paths step from the scratch window
    av = _av(L, costs, probe_window=1 if window else 32, probe_depth=2 if window else 1)
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, L, "gbv", num_paths=2, adaptive=av)
    results = engine.generate(prompts, n, batch_size=3)
    assert [r.output_ids for r in results] == expected
    assert av.rounds > 0


def test_adaptive_gbv_sampled_output_follows_the_target_law():
    """Caps that differ between requests (same feature, ties split by position then request) on GBV with K = 2
    paths: the first two tokens of 4000 requests follow the exact target law."""
    params = SamplingParams(1.0)
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    av = _av(2, FLAT)
    av.stale_budget = 5000  # of 8000 slots: 4000 position-1 slots, then 1000 requests' position 2
    draft = ModelDraft(self_draft(target, 1), params, 2, "self:1")
    n_req = 4000
    results = SpeculativeEngine(target, draft, params, 2, "gbv", seed=3, num_paths=2, adaptive=av).generate(
        [prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    first = [res.rounds[0].num_drafted for res in results]
    assert set(first) == {1, 2}, "the caps must differ between requests"
    assert any(res.rounds[0].accepted > 0 for res in results)
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


def test_rounds_off_go_straight_to_the_plain_step(tiny_target, monkeypatch):
    """A round whose batch speculates nowhere (--speculation off, AV's B* = 0, every request opted out) runs the
    plain step without entering the general round (its per-row limit tensors are pure overhead there), and gives
    target-only's tokens; a batch where some row speculates still takes the general round."""
    n = 10
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    general = []
    original = SpeculativeEngine._single_path_round

    def counted(self, *args, **kwargs):
        general.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "_single_path_round", counted)
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    off = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain", speculation="off").generate(PROMPTS, n)
    av = _av(3, STEEP, probe_interval=64, probe_interval_max=64)
    av.stale_budget = 0  # past the opening probe, speculation switched off
    by_av = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain", adaptive=av).generate(PROMPTS, n)
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain")
    opted_out = [Request(p, n, speculate=False) for p in PROMPTS]
    engine.open_batch()
    engine.join(opted_out)
    while engine.num_active:
        engine.step()
    assert [r.output_ids for r in off] == [r.output_ids for r in by_av] == expected
    assert [r.result.output_ids for r in opted_out] == expected
    assert general == [] and av.rounds_off > 0
    mixed = [Request(p, n, speculate=i != 0) for i, p in enumerate(PROMPTS)]
    engine.open_batch()
    engine.join(mixed)
    while engine.num_active:
        engine.step()
    assert [r.result.output_ids for r in mixed] == expected and general


def test_speculation_switch(tiny_target):
    n = 12
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    draft = ModelDraft(self_draft(tiny_target, 2), GREEDY, 0, "self:2")
    forwards = _count_forwards(draft)
    results = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain", speculation="off").generate(PROMPTS, n)
    assert [r.output_ids for r in results] == expected
    assert all(r.num_drafted == 0 for res in results for r in res.rounds)
    assert forwards == []  # after start()'s prefill the draft never runs
    with pytest.raises(ValueError, match="speculation must be one of"):
        SpeculativeEngine(tiny_target, draft, GREEDY, 3, speculation="sometimes")
    with pytest.raises(ValueError, match="disagrees"):
        SpeculativeEngine(tiny_target, draft, GREEDY, 3, adaptive=_av(3, FLAT), speculation="on")
    with pytest.raises(ValueError, match="speculation must be 'auto' or 'on'"):
        _av(3, FLAT, speculation="off")
    with pytest.raises(ValueError, match="probe_interval"):
        _av(3, FLAT, probe_interval=0)
    with pytest.raises(ValueError, match="probe_depth"):
        _av(3, FLAT, probe_depth=4)


def test_gbv_requests_can_opt_out(tiny_target):
    n = 12
    prompts = [p for p in PROMPTS if len(p) > 1]
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "gbv", num_paths=2)
    requests = [Request(p, n, speculate=i != 1) for i, p in enumerate(prompts)]
    engine.open_batch()
    engine.join(requests)
    while engine.num_active:
        engine.step()
    results = [r.result for r in requests]
    assert [r.output_ids for r in results] == [naive_greedy(tiny_target.model, p, n) for p in prompts]
    assert all(r.num_drafted == 0 for r in results[1].rounds)
    assert any(r.num_drafted > 0 for r in results[0].rounds)


def test_overhead_is_learnt_from_measured_rounds_and_changes_the_budget():
    costs = CostTable(target_ms=[10.0, 11.0, 12.0], draft_ms=[3.0])
    s = torch.tensor([[0.5, 0.2]], dtype=torch.float64)
    # B=0 1/10, B=1 1.5/14, B=2 1.7/15: speculation pays by the table alone
    assert choose_budget(s, costs, draft_steps=None, zero_is_off=True) == 2
    # 10 ms more per speculating round than the table says, 0 for plain steps: 1/10 beats 1.7/25
    assert choose_budget(s, costs, zero_is_off=True, overhead_ms=10.0, overhead_off_ms=0.0) == 0
    av = _av(2, costs, online_overhead=True, overhead_weight=0.5)
    av._predicted_ms, av._predicted_off = 12.0, False
    av.record_round_time(22.0)
    # an unmeasured off overhead is 0 (optimistic: the budget tries plain steps and then measures them)
    assert av.overhead_ms == {"on": 10.0, "off": None} and av._overhead("off") == 0.0
    av._predicted_ms, av._predicted_off = 10.0, True
    av.record_round_time(11.0)
    assert av.overhead_ms["off"] == 1.0
    av._predicted_ms, av._predicted_off = 12.0, False
    av.record_round_time(14.0)
    assert av.overhead_ms["on"] == pytest.approx(6.0)  # 10 + 0.5 * (2 - 10)
    report = av.cost_model_error()
    assert report["rounds"] == 3 and report["median_ratio"] == pytest.approx(14.0 / 12.0)  # median of 22/12, 11/10, 14/12
    assert av.cost_samples[2] == (12.0, 14.0, 22.0)  # table, measured, table + learnt overhead at the time
    assert not _av(2, costs)._overhead("on")


def test_cost_model_records_predicted_and_measured_rounds(tiny_target):
    av = _av(3, CostTable(target_ms=[1.0 + 0.1 * n for n in range(64)], draft_ms=[0.5]), online_overhead=True)
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 0, "self:1")
    SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain", adaptive=av).generate(PROMPTS, 10)
    assert len(av.cost_samples) == av.rounds > 0
    assert all(p > 0 and m > 0 for p, m, _ in av.cost_samples)
    report = av.cost_model_error()
    assert report["rounds"] == av.rounds and report["median_ratio"] > 0
    assert _av(3, FLAT).cost_model_error()["rounds"] == 0


@pytest.mark.parametrize("rule", ["chain", "gbv"])
def test_eagle_with_speculation_off_and_probes_equals_target_only(tiny_target, rule):
    """The EAGLE head's deferred catch-up through the engine: greedy output unchanged."""
    n, L = 24, 3
    prompts = [p for p in PROMPTS if len(p) > 1]
    av = _av(L, FLAT, probe_interval=2)
    av.stale_budget = 0
    engine = SpeculativeEngine(tiny_target, eagle(tiny_target), GREEDY, L, rule, num_paths=2 if rule == "gbv" else 1,
                               adaptive=av)
    results = engine.generate(prompts, n, batch_size=3)
    assert [r.output_ids for r in results] == [naive_greedy(tiny_target.model, p, n) for p in prompts]
    assert av.rounds_off >= 2 and av.probe_rounds >= 1


@pytest.mark.parametrize("rule", ["chain", "gbv"])
def test_the_engine_catches_up_only_the_requests_its_budget_ranked_in(tiny_target, rule):
    """``catch_up = "budget"`` through the engine: batch 6, a cost table under which at most 2 verified drafts a
    round pay, a window of 2 pairs. Each speculative round names in ``catch_up_rows`` exactly the requests the
    previous round's budget ranked in (:attr:`AdaptiveVerification.budget_rows`, followed across finished rows);
    some rounds draft rows from a scratch window, some name only part of the batch; greedy output is
    target-only's. ``probe_pairs`` = 6 shrinks the window to 1 pair while 4-6 requests run, but a speculative
    round's window is at least L + 1 (a row that drafted last round stays caught up). ``catch_up = "all"``, or
    an estimator that does not prune, names no row and sets no window on a speculative round."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (3, 5, 7, 9, 11, 12)]
    kink = CostTable(target_ms=[1.0] * 8 + [50.0] * 200, draft_ms=[0.0])
    n, L = 16, 3
    for mode in ("budget", "all", "unpruned"):
        av = _av(L, kink, probe_window=2, probe_pairs=6, catch_up="all" if mode == "all" else "budget")
        av.prune = mode != "unpruned"  # unpruned (--log-drafts at fixed L): no budget ranks rows in, none windowed
        draft = eagle(tiny_target)
        engine = SpeculativeEngine(tiny_target, draft, GREEDY, L, rule, num_paths=2 if rule == "gbv" else 1,
                                   adaptive=av)
        log, feed, step = [], draft._feed_pending, engine.step

        def logged_feed(*args, **kwargs):
            out = feed(*args, **kwargs)
            named = None if draft.catch_up_rows is None else draft.catch_up_rows.tolist()
            log.append(("feed", av.round_kind, [id(r.request) for r in engine._rows], named, draft.probe_window,
                        draft._scratch is not None))
            return out

        def logged_step():
            ids = [id(r.request) for r in engine._rows]
            events = step()
            log.append(("ranked", ids, None if av.budget_rows is None else av.budget_rows.tolist()))
            return events

        draft._feed_pending, engine.step = logged_feed, logged_step
        results = engine.generate(prompts, n, batch_size=6)
        assert [r.output_ids for r in results] == [naive_greedy(tiny_target.model, p, n) for p in prompts]
        feeds = [e for e in log if e[0] == "feed" and e[1] == "on"]
        assert feeds, "no speculative round"
        if mode != "budget":
            assert all(named is None and window is None for _, _, _, named, window, _ in feeds)
            continue
        ranked, checked, partial = None, 0, False
        for entry in log:
            if entry[0] == "ranked":
                ranked = dict(zip(entry[1], entry[2])) if entry[2] is not None else ranked
            elif entry[1] == "on":
                _, _, ids, named, window, _ = entry
                assert window == L + 1  # probe_pairs' 1-2 pairs, raised to one round's L + 1 pairs
                assert named == [ranked.get(i, True) for i in ids]
                checked += 1
                partial |= any(named) and not all(named)
        assert checked == len(feeds) and partial
        assert any(scratch for *_, scratch in feeds), "no speculative round drafted a row from a scratch window"


def test_the_scratch_window_shrinks_to_probe_pairs_over_the_batch():
    av = _av(2, FLAT, probe_window=32, probe_pairs=256)
    assert [av.scratch_window(b) for b in (1, 8, 16, 32, 100, 1000)] == [32, 32, 16, 8, 2, 1]
    assert _av(2, FLAT, probe_window=32, probe_pairs=0).scratch_window(32) == 32
    assert _av(2, FLAT, probe_window=0).scratch_window(1) is None
    with pytest.raises(ValueError, match="probe_pairs"):
        AVConfig(probe_pairs=-1)


def test_budget_rows_are_the_requests_holding_the_next_budget(tiny_target):
    """:attr:`AdaptiveVerification.budget_rows` after :meth:`plan`: the requests with a slot among the top-B*
    survivals (B* chosen in that plan), none when B* = 0; ``None`` again once the next round's limit is asked."""
    kink = CostTable(target_ms=[1.0] * 6 + [50.0] * 200, draft_ms=[0.05])  # batch 4: 2 verified drafts can pay
    av = _av(2, kink)
    av.stale_budget = 4
    assert av.round_draft_limit() is None and av.budget_rows is None
    features = torch.tensor([[9.0, 9.0], [-9.0, -9.0], [-1.0, -1.0], [-9.0, -9.0]])  # row 0 holds both slots
    av.plan_features(features, torch.full((4,), 2))
    assert av.stale_budget == 2 and av.budget_rows.tolist() == [True, False, False, False]
    features = torch.tensor([[9.0, 9.0], [-9.0, -9.0], [9.0, 9.0], [-9.0, -9.0]])  # position 1 of rows 0 and 2
    av.round_draft_limit()
    av.plan_features(features, torch.full((4,), 2))
    assert av.stale_budget == 2 and av.budget_rows.tolist() == [True, False, True, False]
    av.round_draft_limit()
    av.plan_features(torch.full((4, 2), -30.0), torch.full((4,), 2))  # nothing survives: B* = 0
    assert av.stale_budget == 0 and not av.budget_rows.any()
    assert av.round_draft_limit() == 0 and av.budget_rows is None
    unread = _av(2, kink, catch_up="all")  # nothing reads the ranking: it is not computed
    unread.stale_budget = 4
    unread.round_draft_limit()
    unread.plan_features(features, torch.full((4,), 2))
    assert unread.stale_budget == 2 and unread.budget_rows is None


def test_draft_cost_by_depth_with_a_measured_first_position(tmp_path):
    table = CostTable(target_ms=[1.0], draft_ms=[8.0, 10.0], draft_first_ms=[2.0, 3.0])
    assert table.draft_depth_cost(1, 1, 7) == 2.0  # the catch-up and the first q row
    assert table.draft_depth_cost(1, 4, 7) == pytest.approx(2.0 + 6.0 * 3 / 6)
    assert table.draft_depth_cost(2, 7, 7) == 10.0 and table.draft_depth_cost(2, 0, 7) == 0.0
    assert CostTable(target_ms=[1.0], draft_ms=[7.0]).draft_depth_cost(1, 2, 7) == 2.0  # no first: linear
    table.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json").draft_first_ms == [2.0, 3.0]
    with pytest.raises(ValueError, match="draft_first_ms"):
        CostTable(target_ms=[1.0], draft_ms=[7.0, 8.0], draft_first_ms=[1.0])


def test_off_round_fast_path_equals_the_general_plan():
    """A round with speculation off skips the estimator and budget work; the state it leaves (next B*, probe
    schedule, counters, the costed round) is the one the general plan computes from the empty proposal."""
    import copy

    av = _av(4, STEEP, online_overhead=True)
    av.stale_budget = 0
    av.record_round_time(1.0)
    for _ in range(3):
        assert av.round_draft_limit() == 0
        twin = copy.deepcopy(av)
        empty, drafts = torch.zeros(5, 0), torch.zeros(5, dtype=torch.int64)
        fast = av.plan_features(empty, drafts)
        slow = twin._plan_general(empty, drafts)
        assert torch.equal(fast[0], slow[0]) and fast[1].shape == slow[1].shape == (5, 0)
        for name in ("stale_budget", "_probe_wait", "_off_streak", "pruned", "verified", "_predicted_ms",
                     "_predicted_off", "_learn_round", "_round_limit", "_probing", "rounds_off"):
            assert getattr(av, name) == getattr(twin, name), name
        av.record_round_time(2.0)
        twin.record_round_time(2.0)
        assert av.overhead_ms == twin.overhead_ms and av.cost_samples == twin.cost_samples
