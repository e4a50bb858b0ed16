"""Test-Time Speculation: the loss, the updater's publish / skip / rollback protocol, LoRA, and the engine
(losslessness, frozen target and shared weights, the draft actually moving towards the target)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers.models import loaded, tiny_llama
from tests.helpers.engine import GREEDY, PROMPTS, make_head, naive_greedy
from specadapt.engine import ModelDraft, SpeculativeEngine
from specadapt.engine.drafts import self_draft
from specadapt.engine.eagle_draft import EagleDraft
from specadapt.engine.tts_bridge import EngineTTS
from specadapt.sampling import SamplingParams
from specadapt.tts import TTSConfig, TTSUpdater, add_lora, position_weights, supervised_counts, tts_loss


# ---- loss ----------------------------------------------------------------------------------------------------
def test_supervised_counts_and_weights():
    drafted = torch.tensor([5, 5, 3, 0])
    tau = torch.tensor([0, 5, 2, 0])
    assert supervised_counts(drafted, tau, "accepted").tolist() == [1, 5, 3, 0]
    assert supervised_counts(drafted, tau, "canvas").tolist() == [5, 5, 3, 0]
    w = position_weights(torch.tensor([2, 0]), 3, 0.5)
    assert w.tolist() == [[1.0, 0.5, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="supervise mode"):
        supervised_counts(drafted, tau, "all")
    with pytest.raises(ValueError, match="accept_len"):
        supervised_counts(drafted, torch.tensor([6, 0, 0, 0]), "canvas")
    with pytest.raises(ValueError, match="gamma"):
        position_weights(torch.tensor([1]), 2, 0.0)


def test_loss_equals_weighted_kl_by_hand():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4)
    p = torch.softmax(torch.randn(2, 3, 4), -1)
    p[0, 0] = torch.tensor([0.0, 0.5, 0.5, 0.0])  # zeros in the teacher are fine (0 log 0 = 0)
    old = torch.softmax(torch.randn(2, 3, 4), -1)
    w = torch.tensor([[1.0, 0.8, 0.0], [1.0, 0.0, 0.0]])
    T, lam = 0.7, 0.3
    q = torch.softmax(logits / T, -1)
    expected = 0.0
    for n in range(2):
        for k in range(3):
            if w[n, k] == 0:
                continue
            kl = sum(float(p[n, k, v] * math.log(p[n, k, v] / q[n, k, v])) for v in range(4) if p[n, k, v] > 0)
            prox = sum(float(old[n, k, v] * math.log(old[n, k, v] / q[n, k, v])) for v in range(4))
            expected += float(w[n, k]) * (kl + lam * prox)
    got = tts_loss(logits, p, w, T, old, lam)
    assert got.item() == pytest.approx(expected / 2, rel=1e-5)


def test_proximal_gradient_vanishes_at_the_drafting_weights():
    """The spec's note: with one step at q_t's own weights the proximal term has zero gradient."""
    logits = torch.randn(1, 2, 5, requires_grad=True)
    q_t = torch.softmax(logits.detach(), -1)
    loss = tts_loss(logits, torch.softmax(torch.randn(1, 2, 5), -1), torch.ones(1, 2), 1.0, q_t, 1.0)
    loss_no_prox = tts_loss(logits, torch.softmax(torch.randn(1, 2, 5), -1), torch.ones(1, 2), 1.0)
    (g_prox,) = torch.autograd.grad(
        tts_loss(logits, q_t, torch.ones(1, 2), 1.0, q_t, 1.0), logits
    )
    assert torch.allclose(g_prox, torch.zeros_like(g_prox), atol=1e-6)
    assert loss.item() > 0 and loss_no_prox.item() > 0


def test_loss_bad_input():
    with pytest.raises(ValueError, match="shapes differ"):
        tts_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.ones(1, 2))
    with pytest.raises(ValueError, match="proximal_weight"):
        tts_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.ones(1, 2), proximal_weight=-1)
    with pytest.raises(ValueError, match="proximal_probs"):
        tts_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.ones(1, 2), proximal_weight=0.5)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"stride": 0}, "stride"), ({"lr": 0}, "lr"), ({"params": "all"}, "params"), ({"lora_rank": 0}, "rank"),
     ({"supervise": "x"}, "supervise"), ({"position_decay": 1.5}, "decay"), ({"rollback_margin": 0}, "margin"),
     ({"scope": "global"}, "scope"), ({"scope": "request"}, "lora"), ({"topk": -1}, "^topk ")],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TTSConfig(**kwargs)


# ---- updater protocol ----------------------------------------------------------------------------------------
class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(3, 3)
        self.own = nn.Linear(3, 3)


def _toy_updater(config, loss=None, asynchronous=True):
    torch.manual_seed(0)
    model = Toy().requires_grad_(False)
    x = torch.randn(4, 3)

    def loss_fn(module, examples):
        if loss is not None:
            return loss(module)
        return ((module.own(module.frozen(x)) - 1.0) ** 2).mean() * len(examples)

    up = TTSUpdater(model, lambda n, p: n.startswith("own."), loss_fn, config, asynchronous=asynchronous)
    return model, up


@pytest.mark.parametrize("asynchronous", [True, False])
def test_publish_happens_in_place_at_stride_boundaries_only(asynchronous):
    model, up = _toy_updater(TTSConfig(stride=3, lr=0.1), asynchronous=asynchronous)
    addresses = [p.data_ptr() for p in model.parameters()]
    frozen_before = model.frozen.weight.clone()
    own_before = model.own.weight.clone()
    for _ in range(5):  # boundary at round 3 submits the first update; nothing is published before round 6
        up.end_round(["ex"], 2.0)
    assert torch.equal(model.own.weight, own_before)
    assert up.stats.publishes == 0
    up.end_round(["ex"], 2.0)  # round 6: wait for the update, publish it, submit the next
    assert up.stats.publishes == 1 and up.stats.updates >= 1
    assert not torch.equal(model.own.weight, own_before)
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert torch.equal(model.frozen.weight, frozen_before)
    assert up.shadow.frozen.weight is model.frozen.weight  # frozen tensors are shared, not copied
    up.close()
    assert torch.equal(model.own.weight, up.shadow.own.weight.detach())
    mem = up.memory_bytes()
    assert mem["shadow"] == mem["trainable"] and mem["optimizer"] == 2 * mem["trainable"]


def test_non_finite_loss_or_gradient_is_skipped():
    model, up = _toy_updater(TTSConfig(stride=1), loss=lambda m: m.own.weight.sum() * float("nan"))
    before = model.own.weight.clone()
    for _ in range(4):
        up.end_round(["ex"], 1.0)
    up.close()
    assert up.stats.skipped == 4 and up.stats.updates == 0
    assert torch.equal(model.own.weight, before)

    model, up = _toy_updater(TTSConfig(stride=1), loss=lambda m: (m.own.weight * torch.tensor(float("inf"))).sum() * 0)
    for _ in range(2):
        up.end_round(["ex"], 1.0)
    up.close()
    assert up.stats.updates == 0 and up.stats.skipped == 2


def test_rollback_restores_pre_adaptation_weights_when_acceptance_collapses():
    config = TTSConfig(stride=1, lr=0.5, rollback_window=2, rollback_margin=0.5)
    model, up = _toy_updater(config, asynchronous=False)
    initial = model.own.weight.clone()
    for acc in [3.0, 3.0, 3.0, 1.0]:  # baseline 3.0 (the round before the first publish), then 3 / 1: mean 2 >= 1.5
        up.end_round(["ex"], acc)
    assert up.stats.rollbacks == 0 and not torch.equal(model.own.weight, initial)
    up.end_round(["ex"], 1.0)  # rolling mean 1.0 < (1 - 0.5) * 3.0: back to the pre-adaptation weights
    assert up.stats.rollbacks == 1
    assert torch.equal(model.own.weight, initial)
    # the optimizer restarted: only the step submitted after the rollback is in its state
    assert all(int(state["step"]) == 1 for state in up.optimizer.state.values())
    up.close()
    mem = up.memory_bytes()
    assert mem["rollback_copy"] == mem["trainable"] and mem["total"] == mem["total_without_rollback"] + mem["trainable"]


def test_lora_starts_equal_and_trains_only_adapters():
    torch.manual_seed(0)
    model = Toy().requires_grad_(False)
    x = torch.randn(2, 3)
    before = model.own(x)
    names = add_lora(model, 2, ["own"])
    assert names == ["own"]
    torch.testing.assert_close(model.own(x), before)
    with pytest.raises(ValueError, match="no submodule"):
        add_lora(model, 2, ["missing"])
    with pytest.raises(ValueError, match="rank"):
        add_lora(Toy(), 0, ["own"])


# ---- engine --------------------------------------------------------------------------------------------------
def _tts_draft(target, kind, params):
    gen = 5  # the draft's seed
    if kind == "eagle":
        return EagleDraft(make_head(target.model), params, gen)
    return ModelDraft(self_draft(target, 1), params, gen, "self:1")


@pytest.mark.parametrize("kind", ["self:1", "eagle"])
@pytest.mark.parametrize("params", ["full", "lora", "request"])
def test_tts_keeps_greedy_output_and_target_weights_bit_identical(tiny_target, kind, params):
    n = 24
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    target_before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    draft = _tts_draft(tiny_target, kind, GREEDY)
    shared_before = {}
    if kind == "self:1":
        shared_before = {k: v.clone() for k, v in draft.model.state_dict().items() if "layers" not in k}
    own_before = {n_: p.clone() for n_, p in draft.model.named_parameters()}
    scope = "request" if params == "request" else "shared"
    config = TTSConfig(stride=1, lr=1e-2, params="full" if params == "full" else "lora", scope=scope, supervise="canvas")
    tts = EngineTTS(draft, config, GREEDY, max_requests=3)
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "block", tts=tts)
    results = engine.generate(PROMPTS, n, batch_size=3)
    tts.close()
    assert [r.output_ids for r in results] == expected
    for k, v in tiny_target.model.state_dict().items():
        assert torch.equal(v, target_before[k]), f"target weight {k} changed"
    for k, v in shared_before.items():
        assert torch.equal(draft.model.state_dict()[k], v), f"shared draft weight {k} changed"
    assert tts.stats.updates > 0
    changed = [n_ for n_, p in draft.model.named_parameters() if n_ in own_before and not torch.equal(p, own_before[n_])]
    if params == "full":
        assert changed, "TTS never changed the draft's own weights"
    else:
        assert not changed, "LoRA mode must not touch the base weights"
        assert any(".lora_b" in n_ and p.abs().sum() > 0 for n_, p in draft.model.named_parameters())


@pytest.mark.parametrize("kind", ["self:1", "eagle"])
@pytest.mark.parametrize("verify", ["block", "gbv"])
@pytest.mark.parametrize("scope", ["shared", "request"])
def test_student_forward_reproduces_the_rows_the_round_was_drafted_from(tiny_target, kind, verify, scope):
    """The differentiable re-run of the draft (before any publish) gives exactly the q rows of the round:
    the snapshot's context, drafts and teacher rows line up."""
    params = SamplingParams(0.9)
    draft = _tts_draft(tiny_target, kind, params)
    params_kind = "lora" if scope == "request" else "full"
    tts = EngineTTS(draft, TTSConfig(stride=10_000, supervise="canvas", scope=scope, params=params_kind), params,
                    max_requests=3)
    if scope == "request":  # make the adapters non-trivial and different per slot
        with torch.no_grad():
            for name, p in draft.model.named_parameters():
                if ".lora_b" in name:
                    p.normal_(0, 0.05)
                    tts.updater.shadow.get_parameter(name).copy_(p)
        tts.start_batch = lambda batch: setattr(tts.slots, "rows", torch.arange(batch))
    checked = []
    student = tts.student
    original = tts.updater.end_round

    def checking(examples, acceptance):
        for ex in examples:
            if scope == "request":
                from specadapt.tts import find_lora_slots

                find_lora_slots(draft.model).rows = torch.tensor([ex.slot])
            with torch.no_grad():
                logits = student.logits_one(draft.model, ex.context, ex.drafts)
            q = torch.softmax(logits.float() / params.temperature, -1)
            torch.testing.assert_close(q, ex.proximal, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(ex.teacher.sum(-1), torch.ones(ex.teacher.shape[0]))
            checked.append(ex)
        if scope == "request":
            find_lora_slots(draft.model).rows = saved_rows[0]
        original(examples, acceptance)

    saved_rows = [None]
    if scope == "request":
        from specadapt.tts import find_lora_slots

        original_end_round = tts.end_round

        def end_round_saving_rows(*args):
            saved_rows[0] = tts.slots.rows.clone()
            original_end_round(*args)

        tts.end_round = end_round_saving_rows

    tts.updater.end_round = checking
    num_paths = 2 if verify == "gbv" else 1
    SpeculativeEngine(tiny_target, draft, params, 3, verify, seed=2, tts=tts, num_paths=num_paths).generate(
        [p for p in PROMPTS if len(p) > 1], 30, batch_size=3
    )
    tts.close()
    assert len(checked) > 10
    batched = getattr(student, "logits_batch", None)
    if batched is not None:  # the padded one-pass version equals the per-example forwards
        batch = checked[:12]
        drafts = [ex.drafts[: 1 + i % ex.drafts.shape[0]] for i, ex in enumerate(batch)]  # ragged C
        assert len({ex.context[1].shape[0] for ex in batch}) > 1 and len({d.shape[0] for d in drafts}) > 1
        slots = [ex.slot for ex in batch] if scope == "request" else None
        if kind == "eagle":  # the rounds of one request share a pass over their windows' union
            from specadapt.engine.tts_windows import group_windows

            assert len(group_windows([ex.context for ex in batch], slots)) < len(batch)
        with torch.no_grad():
            together = batched(draft.model, [ex.context for ex in batch], drafts, slots)
        for i, ex in enumerate(batch):
            if scope == "request":
                find_lora_slots(draft.model).rows = torch.tensor([ex.slot])
            with torch.no_grad():
                alone = student.logits_one(draft.model, ex.context, drafts[i])
            torch.testing.assert_close(together[i, : drafts[i].shape[0]], alone, atol=1e-4, rtol=1e-4)


def test_top_k_rows_keep_the_largest_entries_renormalised():
    from specadapt.tts import top_k_rows

    rows = torch.tensor([[0.1, 0.5, 0.0, 0.4], [0.0, 0.0, 0.0, 0.0]])
    values, index = top_k_rows(rows, 2)
    assert index.dtype == torch.int32 and index[0].tolist() == [1, 3]
    torch.testing.assert_close(values[0], torch.tensor([5 / 9, 4 / 9]))
    assert values[1].abs().sum() == 0  # a row without mass stays without mass
    with pytest.raises(ValueError, match=r"^k \(TTSConfig.topk\) must lie in"):
        top_k_rows(rows, 5)


@pytest.mark.parametrize("topk", [0, 5, 10_000])
def test_tts_topk_snapshots(tiny_target, topk):
    """--tts-topk k: snapshots hold k values + ids per position; densified, they are the renormalised top-k of the
    full rows; k >= V keeps the dense rows, so the loss is the spec's exact full-vocabulary KL."""
    from specadapt.tts import top_k_rows

    params = SamplingParams(0.9)
    seen = {}
    for k in (0, topk):
        draft = _tts_draft(tiny_target, "self:1", params)
        tts = EngineTTS(draft, TTSConfig(stride=10_000, supervise="canvas", topk=k), params, max_requests=3)
        captured = []
        original = tts.updater.end_round
        tts.updater.end_round = lambda examples, acc: (captured.extend(examples), original(examples, acc))
        SpeculativeEngine(tiny_target, draft, params, 3, "block", seed=4, tts=tts).generate(PROMPTS, 12, batch_size=3)
        loss = tts._loss(tts.updater.shadow, captured[:6]).item()
        tts.close()
        seen[k] = (captured, loss)
    full, full_loss = seen[0]
    got, got_loss = seen[topk]
    vocab = full[0].teacher.shape[1]
    assert len(got) == len(full) > 5 and vocab > 5
    for a, b in zip(full, got):
        if topk == 0 or topk >= vocab:
            assert b.teacher_index is None and torch.equal(a.teacher, b.teacher)
            continue
        assert b.teacher.shape == (a.drafts.shape[0], topk) and b.teacher_index.shape == b.teacher.shape
        want_values, want_index = top_k_rows(a.teacher, topk)
        assert torch.equal(b.teacher_index, want_index) and torch.equal(b.teacher, want_values)
        dense = b.teacher_rows()
        assert dense.shape == a.teacher.shape and torch.allclose(dense.sum(-1), torch.ones(dense.shape[0]))
        assert torch.equal(b.proximal_rows().gt(0).sum(-1), torch.full((dense.shape[0],), topk))
        assert b.nbytes < a.nbytes
    if topk == 0 or topk >= vocab:
        assert got_loss == full_loss
    else:
        assert math.isfinite(got_loss) and got_loss != full_loss


def test_tts_moves_the_draft_towards_the_target():
    """A draft that is a perturbed copy of the target (same architecture, noisy decoder layer): sampled
    decoding with TTS pulls its agreement sum min(p, q) with the target up on held-out text."""
    import copy

    model = tiny_llama(vocab=16, layers=1, seed=2, init_std=0.3)
    target = loaded(model)
    params = SamplingParams(1.0)
    noisy = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in noisy.model.layers.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    draft = ModelDraft(noisy, params, 1, "noisy")
    probe = torch.randint(0, 16, (1, 60), generator=torch.Generator().manual_seed(3))

    def agreement():
        with torch.no_grad():
            p = torch.softmax(model(input_ids=probe).logits[0], -1)
            q = torch.softmax(noisy(input_ids=probe).logits[0], -1)
        return float(torch.minimum(p, q).sum(-1).mean())

    before = agreement()
    tts = EngineTTS(draft, TTSConfig(stride=1, lr=3e-3, supervise="canvas"), params)
    SpeculativeEngine(target, draft, params, 4, "block", seed=1, tts=tts).generate([[1, 2, 3]] * 4, 120, batch_size=4)
    tts.close()
    after = agreement()
    assert tts.stats.updates > 20
    assert after > before + 0.05, (before, after)


def test_tts_needs_a_model_draft(tiny_target):
    from specadapt.engine import NgramDraft

    with pytest.raises(ValueError, match="model draft"):
        EngineTTS(NgramDraft(), TTSConfig(), GREEDY)


@pytest.mark.parametrize("cores, threads, trainer, device, pays", [
    (2, 2, 1, "cpu", False),  # the decoder's threads use every core: a trainer thread would contend
    (4, 2, 1, "cpu", True),
    (3, 2, 2, "cpu", False),  # one spare core for a 2-thread trainer
    (4, 2, 2, "cpu", True),
    (2, 2, 1, "cuda", True),  # a side stream
    (1, 1, 1, "cuda:0", True),
])
def test_background_trainer_runs_only_where_it_has_compute_of_its_own(tiny_target, monkeypatch, cores, threads,
                                                                      trainer, device, pays):
    import os

    from specadapt.tts import background_trainer_pays

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert background_trainer_pays(device, trainer_threads=trainer) is pays
    if trainer == 1 and device == "cpu":  # the engine's default decides the same way; an explicit choice wins
        for asynchronous, want in ((None, pays), (True, True), (False, False)):
            tts = EngineTTS(_tts_draft(tiny_target, "eagle", GREEDY), TTSConfig(stride=2), GREEDY,
                            asynchronous=asynchronous)
            assert tts.updater.asynchronous is want
            tts.updater.close()
