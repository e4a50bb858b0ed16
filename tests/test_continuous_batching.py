"""Continuous batching in the engine (``open_batch`` / ``join`` / ``step`` / ``cancel``): requests that join a
running batch between rounds, leave when they finish and are cancelled mid-way decode exactly what they decode
alone (per-request coin streams), on the native forward and on transformers' forward, for every draft kind;
per-request sampling settings, speculation off per request, stop tokens and slot reuse."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import loaded, tiny_llama
from tests.helpers.engine import GREEDY, make_head, native_draft, native_target
from specadapt import kernels
from specadapt.engine import ModelDraft, NgramDraft, NoDraft, SpeculativeEngine
from specadapt.engine.drafts import self_draft
from specadapt.engine.eagle_draft import EagleDraft
from specadapt.engine.loop import Request
from specadapt.sampling import SamplingParams

NATIVE = kernels.has_op_for("native_llama_forward", torch.device("cpu"))
SAMPLED = SamplingParams(1.0, top_p=0.9)
PROMPTS = [[5, 9, 2, 7, 1, 3], [1, 2, 3], [4] * 9, [6, 6, 8, 1, 2], [7], [3, 1, 4, 1, 5, 9, 2, 6]]
LIMITS = [30, 12, 25, 8, 20, 16]
SEEDS = [42, 1, 2, 3, 4, 5]


def _target(forward):
    if forward == "native":
        if not NATIVE:
            pytest.skip("specadapt._C built without the native kernels")
        return native_target("int4", vocab=48)
    return loaded(tiny_llama(vocab=48))


def _draft(target, kind, params):
    if kind == "none":
        return NoDraft()
    if target.native is not None:
        return native_draft(target, kind, params)
    if kind == "ngram":
        return NgramDraft()
    if kind == "eagle":
        return EagleDraft(make_head(target.model, torch.arange(0, target.vocab_size, 2)), params, 5)
    return ModelDraft(self_draft(target, 1), params, 5, "self:1")


def _engine(target, kind, rule, params=SAMPLED, **kw):
    L = 0 if kind == "none" else 3
    return SpeculativeEngine(target, _draft(target, kind, params), params, L, rule,
                             num_paths=2 if rule == "gbv" else 1, **kw)


def target_only_greedy(target, prompt, n):
    """Greedy target-only decoding of ``prompt`` in the target's own weight format (an int4 target's greedy text
    differs from its float32 transformers model's)."""
    return SpeculativeEngine(target, NoDraft(), GREEDY, 0).generate([prompt], n)[0].output_ids


def _run_schedule(engine, requests, joins):
    """Join ``requests`` per ``joins`` ({round: [indices]}) and step until the batch is empty."""
    engine.open_batch()
    rounds = 0
    pending = dict(joins)
    while pending or engine.num_active:
        if rounds in pending:
            engine.join([requests[i] for i in pending.pop(rounds)])
        engine.step()
        rounds += 1
        assert rounds < 500
    return [r.result for r in requests]


CASES = [("native", "none", "chain"), ("native", "ngram", "block"), ("native", "self:1", "chain"),
         ("native", "eagle", "block"), ("native", "self:1", "gbv"), ("native", "eagle", "gbv"),
         ("hf", "self:1", "block"), ("hf", "eagle", "chain"), ("hf", "ngram", "chain")]


@pytest.mark.parametrize("forward,kind,rule", CASES)
def test_a_request_that_joins_a_running_batch_decodes_what_it_decodes_alone(forward, kind, rule):
    target = _target(forward)
    # GBV with the EAGLE head needs two prompt tokens (its first draft reads a target feature)
    prompts = [p + [2] if len(p) == 1 and (kind, rule) == ("eagle", "gbv") else p for p in PROMPTS]
    alone = [_engine(target, kind, rule).generate([p], m, seeds=[s])[0].output_ids
             for p, m, s in zip(prompts, LIMITS, SEEDS)]
    engine = _engine(target, kind, rule)
    requests = [Request(p, m, s) for p, m, s in zip(prompts, LIMITS, SEEDS)]
    results = _run_schedule(engine, requests, {0: [0], 2: [1, 2], 3: [3], 7: [4, 5]})
    assert [r.output_ids for r in results] == alone
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert len(set(map(tuple, alone))) == len(alone)


def test_finished_requests_free_their_slot_for_the_next():
    target = _target("native")
    engine = _engine(target, "eagle", "block")
    requests = [Request(p, m, s) for p, m, s in zip(PROMPTS, LIMITS, SEEDS)]
    engine.open_batch()
    engine.join(requests[:2])
    slots = engine._kv.num_slots
    while engine.num_active == 2:
        engine.step()
    engine.join(requests[2:3])  # one left, one joins: the freed slot is reused
    assert engine._kv.num_slots == slots and engine.num_active == 2
    while engine.num_active:
        engine.step()
    engine.join(requests[3:4])  # an empty batch refills
    while engine.num_active:
        engine.step()
    assert engine._kv.num_slots == slots
    assert requests[3].result.output_ids == _engine(target, "eagle", "block").generate(
        [PROMPTS[3]], LIMITS[3], seeds=[SEEDS[3]])[0].output_ids


@pytest.mark.parametrize("forward", ["native", "hf"])
def test_cancelled_requests_leave_the_others_unchanged(forward):
    target = _target(forward)
    alone = _engine(target, "self:1", "block").generate(PROMPTS[:3], LIMITS[:3], seeds=SEEDS[:3])
    engine = _engine(target, "self:1", "block")
    requests = [Request(p, m, s) for p, m, s in zip(PROMPTS[:3], LIMITS[:3], SEEDS[:3])]
    engine.open_batch()
    engine.join(requests)
    engine.step()
    engine.step()
    engine.cancel([requests[1]])
    assert engine.num_active == 2 and requests[1].result.finish_reason == "cancelled"
    partial = requests[1].result.output_ids
    assert partial == alone[1].output_ids[: len(partial)]
    while engine.num_active:
        engine.step()
    assert [requests[0].result.output_ids, requests[2].result.output_ids] == [alone[0].output_ids,
                                                                              alone[2].output_ids]


@pytest.mark.parametrize("kind,rule", [("eagle", "block"), ("self:1", "chain"), ("ngram", "block")])
def test_per_request_sampling_settings(kind, rule):
    """A greedy request inside a sampled batch gives greedy decoding's output; a sampled request beside it
    gives its own output alone (the target's transform is applied per row; the draft's too)."""
    target = _target("native")
    n = 16
    engine = _engine(target, kind, rule)
    greedy = Request(PROMPTS[0], n, 7, sampling=GREEDY)
    sampled = Request(PROMPTS[2], n, SEEDS[2])
    hot = Request(PROMPTS[3], n, 9, sampling=SamplingParams(1.3, top_k=5))
    _run_schedule(engine, [greedy, sampled, hot], {0: [0, 1], 1: [2]})
    assert greedy.result.output_ids == target_only_greedy(target, PROMPTS[0], n)
    assert sampled.result.output_ids == _engine(target, kind, rule).generate(
        [PROMPTS[2]], n, seeds=[SEEDS[2]])[0].output_ids
    hot_alone = _engine(target, kind, rule, params=SamplingParams(1.3, top_k=5)).generate(
        [PROMPTS[3]], n, seeds=[9])[0].output_ids
    assert hot.result.output_ids == hot_alone


def test_speculation_off_for_one_request_is_target_only_decoding():
    """A request with ``speculate=False`` verifies no drafts and decodes exactly what target-only decoding with
    its seed decodes (the same final coins), while the others in the batch speculate."""
    target = _target("native")
    base = _engine(target, "none", "chain").generate([PROMPTS[0]], 24, seeds=[11])[0]
    # GBV too: the opted-out request gets cap 0 (its next token straight from the target, with the final coin)
    for kind, rule in [("eagle", "block"), ("self:1", "gbv")]:
        engine = _engine(target, kind, rule)
        off = Request(PROMPTS[0], 24, 11, speculate=False)
        on = Request(PROMPTS[2], 24, 12)
        _run_schedule(engine, [off, on], {0: [0, 1]})
        assert all(r.num_drafted == 0 for r in off.result.rounds), rule
        assert any(r.num_drafted > 0 for r in on.result.rounds), rule
        assert off.result.output_ids == base.output_ids, rule


def test_stop_tokens_end_a_request_inside_an_accepted_block():
    target = _target("native")
    full = _engine(target, "ngram", "block").generate([PROMPTS[2]], 30, seeds=[2])[0].output_ids
    stop = full[5]
    cut = full[: full.index(stop) + 1]
    engine = _engine(target, "ngram", "block")
    req = Request(PROMPTS[2], 30, 2, stop_token_ids=frozenset({stop}))
    _run_schedule(engine, [req], {0: [0]})
    assert req.result.output_ids == cut and req.result.finish_reason == "stop"
    assert not req.result.finished_by_eos


def test_bad_requests_are_refused_by_name():
    target = _target("native")
    engine = _engine(target, "ngram", "block")
    engine.open_batch()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.join([Request([], 4)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.join([Request([1, 2], -1)])
    with pytest.raises(ValueError, match="penalties"):
        engine.join([Request([1, 2], 4, sampling=SamplingParams(1.0, frequency_penalty=0.5))])
    with pytest.raises(ValueError, match="max_new_tokens: a prompt of 2 tokens and 600 new tokens exceed"):
        engine.join([Request([1, 2], 600)])  # the tiny model has 512 positions
    zero = Request([1, 2], 0)
    engine.join([zero])
    assert engine.num_active == 0 and zero.result.output_ids == [] and zero.result.finish_reason == "length"


def test_per_request_tts_slots_follow_joins_and_keep_greedy_output():
    from specadapt.engine.tts_bridge import EngineTTS
    from specadapt.tts import TTSConfig

    target = _target("native")
    n = 20
    draft = native_draft(target, "eagle")
    tts = EngineTTS(draft, TTSConfig(stride=2, lr=1e-3, params="lora", scope="request"), GREEDY,
                    asynchronous=False, max_requests=3)
    engine = SpeculativeEngine(target, draft, GREEDY, 3, "block", tts=tts)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[5]]
    requests = [Request(p, n, i) for i, p in enumerate(prompts)]
    engine.open_batch()
    engine.join(requests[:2])
    engine.step()
    engine.join(requests[2:3])
    assert sorted(tts.slots.rows.tolist()) == [0, 1, 2]
    with pytest.raises(ValueError, match="adapter slots"):
        tts.join(1)
    while engine.num_active == 3:
        engine.step()
    engine.join(requests[3:])
    while engine.num_active:
        engine.step()
    assert [r.result.output_ids for r in requests] == [target_only_greedy(target, p, n) for p in prompts]
    assert tts.stats.updates > 0
    tts.close()


def test_draft_settings_that_do_not_lay_out_the_rows_are_refused():
    draft = NgramDraft()
    draft.sampling = SAMPLED
    draft.row_sampling = [SAMPLED, GREEDY]
    assert draft.sampling_for_rows(4) == [SAMPLED, SAMPLED, GREEDY, GREEDY]  # 2 requests x 2 paths
    with pytest.raises(ValueError, match="3 rows of logits"):
        draft.sampling_for_rows(3)
