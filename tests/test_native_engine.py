"""The speculative engine on the native forward: greedy output equals target-only greedy output (chain, block,
GBV, adaptive verification, Test-Time Speculation; every weight format against its own target-only run), the
sampled output follows the target's exact law (chi-square), a request's output depends on its seed and prompt
only (per-request streams, bitwise with the native forward), and TTS publishes reach the native weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import (
    GREEDY, PROMPTS, _exact_joint, assert_first_tokens_follow, naive_greedy, native_draft, native_target,
)
from tests.helpers.models import loaded, tiny_llama
from specadapt import kernels
from specadapt.budget import CostTable
from specadapt.budget.adaptive import AdaptiveVerification
from specadapt.engine import NoDraft, SpeculativeEngine
from specadapt.engine.drafts import path_step_counts
from specadapt.engine.loop import Request
from specadapt.engine.models import attach_forward
from specadapt.engine.native import NativeLlama, SlotKVCache
from specadapt.estimator import AcceptanceEstimator
from specadapt.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.has_op_for("native_llama_forward", torch.device("cpu")),
                                reason="specadapt._C built without the native kernels")


@pytest.mark.parametrize("rule", ["chain", "block", "gbv"])
@pytest.mark.parametrize("kind", ["ngram", "self:1", "eagle"])
def test_greedy_speculative_output_equals_greedy_decoding(rule, kind):
    if rule == "gbv" and kind == "ngram":
        pytest.skip("GBV needs a draft that samples its paths")
    target = native_target()
    n = 20
    prompts = [p for p in PROMPTS if len(p) > 1]
    expected = [naive_greedy(target.model, p, n) for p in prompts]  # transformers, no cache
    paths = 2 if rule == "gbv" else 1
    engine = SpeculativeEngine(target, native_draft(target, kind), GREEDY, 3, rule, num_paths=paths)
    assert [r.output_ids for r in engine.generate(prompts, n, batch_size=3)] == expected
    base = SpeculativeEngine(target, NoDraft(), GREEDY, 0).generate(prompts, n, batch_size=2)
    assert [r.output_ids for r in base] == expected


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_quantised_formats_keep_their_own_target_only_greedy_output(fmt):
    target = native_target(fmt)
    n = 20
    base = [r.output_ids for r in SpeculativeEngine(target, NoDraft(), GREEDY, 0).generate(PROMPTS, n, batch_size=1)]
    for kind in ("ngram", "self:1", "eagle"):
        engine = SpeculativeEngine(target, native_draft(target, kind), GREEDY, 3, "block")
        assert [r.output_ids for r in engine.generate(PROMPTS, n, batch_size=3)] == base, kind


def test_adaptive_verification_on_the_native_path_keeps_greedy_output():
    target = native_target()
    n = 24
    expected = [naive_greedy(target.model, p, n) for p in PROMPTS]
    av = AdaptiveVerification(AcceptanceEstimator(4, refit_interval=5), CostTable(target_ms=[1.0] * 32, draft_ms=[0.5]))
    engine = SpeculativeEngine(target, native_draft(target, "self:1"), GREEDY, 4, "chain", adaptive=av)
    assert [r.output_ids for r in engine.generate(PROMPTS, n, batch_size=4)] == expected
    assert av.verified > 0


@pytest.mark.parametrize("rule,kind", [("chain", "self:1"), ("block", "eagle")])
def test_sampled_output_follows_the_target_law_on_the_native_path(rule, kind):
    """Chi-square of the first two emitted tokens over 3000 requests against the exact target joint law."""
    target = loaded(tiny_llama(vocab=8, layers=3, seed=4, init_std=0.3))
    attach_forward(target, "native", "float32")
    params = SamplingParams(1.0, top_p=0.95)
    prompt = [1, 2, 3, 1, 2]
    draft = native_draft(target, kind, params, seed=2, subset=torch.tensor([0, 2, 3, 5, 6]))
    engine = SpeculativeEngine(target, draft, params, 2, rule, seed=3)
    n_req = 3000
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results), "the draft never helped: the test would be vacuous"
    assert_first_tokens_follow(results, _exact_joint(target.model, prompt, params, 2), n_req)


@pytest.mark.parametrize("kind,rule", [("none", "chain"), ("ngram", "block"), ("self:1", "chain"),
                                       ("eagle", "block"), ("self:1", "gbv")])
def test_a_requests_output_depends_on_its_seed_and_prompt_only(kind, rule):
    target = native_target("int4", vocab=48)
    params = SamplingParams(1.0, top_p=0.9)
    prompt, n = [5, 9, 2, 7, 1, 3], 30
    others = [[1, 2, 3], [4] * 9, [6, 6, 8, 1, 2]]

    def run(prompts, seeds, batch):
        draft = NoDraft() if kind == "none" else native_draft(target, kind, params)
        L = 0 if kind == "none" else 3
        engine = SpeculativeEngine(target, draft, params, L, rule, num_paths=2 if rule == "gbv" else 1)
        return engine.generate(prompts, n, batch_size=batch, seeds=seeds)

    alone = run([prompt], [42], 1)[0].output_ids
    first = run([prompt] + others, [42, 1, 2, 3], 4)[0].output_ids
    last = run(others + [prompt], [7, 8, 9, 42], 4)[3].output_ids
    assert alone == first == last
    assert run([prompt], [43], 1)[0].output_ids != alone  # another seed, another sample


def test_tts_publishes_reach_the_native_weights_in_place():
    """A publish re-packs the trained module into the same native storage: the native draft's logits become the
    new weights' logits with no new tensors (what captured graphs / compiled kernels rely on)."""
    target = native_target()
    draft = native_draft(target, "self:1")
    storage = [t.data_ptr() for t in draft.native._op_tensors if t is not None]
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    counts = torch.tensor([5])
    before = SlotKVCache(draft.native, 1, 16).forward(ids, counts)
    with torch.no_grad():
        for p in draft.model.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    draft.tts_student().refresh()
    after = SlotKVCache(draft.native, 1, 16).forward(ids, counts)
    fresh = SlotKVCache(NativeLlama.from_hf(draft.model, "float32"), 1, 16).forward(ids, counts)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, fresh, atol=1e-5, rtol=0)
    assert storage == [t.data_ptr() for t in draft.native._op_tensors if t is not None]


def test_tts_on_the_native_path_keeps_greedy_output():
    from specadapt.engine.tts_bridge import EngineTTS
    from specadapt.tts import TTSConfig

    target = native_target()
    n = 24
    expected = [naive_greedy(target.model, p, n) for p in PROMPTS]
    for kind in ("self:1", "eagle"):
        draft = native_draft(target, kind)
        tts = EngineTTS(draft, TTSConfig(stride=2, lr=1e-3), GREEDY, asynchronous=False)
        engine = SpeculativeEngine(target, draft, GREEDY, 3, "block", tts=tts)
        assert [r.output_ids for r in engine.generate(PROMPTS, n, batch_size=2)] == expected
        assert tts.stats.publishes > 0
        tts.close()


def test_forward_flags_refuse_what_cannot_run():
    target = loaded(tiny_llama())
    with pytest.raises(ValueError, match="--dtype int4 needs the native forward"):
        attach_forward(target, "hf", "int4")
    with pytest.raises(ValueError, match="--forward"):
        attach_forward(target, "fast", "float32")
    assert attach_forward(target, "hf", "auto") == "float32" and target.native is None


def test_a_row_at_the_context_end_takes_no_draft_step_past_it():
    """A request that fills the context window exactly (prompt + max_new_tokens = the RoPE table) beside one that
    keeps drafting: the full row drafts nothing in its last rounds, and its head must not step past the window
    (the batch's longer drafts used to step every row: "position 32 outside the RoPE table (32)")."""
    target = _window_target()
    full = [(3 * i + 1) % 32 for i in range(24)]  # 24 + 8 = 32 positions: the window exactly
    short = [7]  # 1 + 31: keeps drafting 6 while the full row ends
    draft = native_draft(target, "eagle")
    engine = SpeculativeEngine(target, draft, GREEDY, 6, "chain")
    requests = _run_together(engine, [Request(full, 8, 0), Request(short, 31, 1)])
    assert requests[0].result.output_ids == naive_greedy(target.model, full, 8)
    assert requests[1].result.output_ids == naive_greedy(target.model, short, 31)


@pytest.mark.parametrize("kind", ["self:1", "eagle"])
def test_a_gbv_request_at_the_context_end_verifies_no_tree_past_it(kind):
    """GBV beside a request that fills the context window exactly: a round's tree is no deeper than the deepest
    request's remaining room, a request with less room verifies (and drafts) only its own remaining drafts, so
    neither the target's tree forward nor the draft steps past the RoPE table (a GBV round used to draft and score
    the full depth L whatever the room: "position 32 outside the RoPE table (32)"). Greedy output equals
    target-only output for both rows."""
    target = _window_target()
    full = [(3 * i + 1) % 32 for i in range(24)]  # 24 + 8 = 32 positions: the window exactly
    short = [7, 11]  # 2 + 30: keeps drafting 6 while the full row ends
    engine = SpeculativeEngine(target, native_draft(target, kind), GREEDY, 6, "gbv", num_paths=2)
    requests = _run_together(engine, [Request(full, 8, 0), Request(short, 30, 1)])
    assert requests[0].result.output_ids == naive_greedy(target.model, full, 8)
    assert requests[1].result.output_ids == naive_greedy(target.model, short, 30)
    # the full row's last rounds drafted no more than its room: never more drafts than tokens left minus one
    for request in requests:
        done = 0
        for record in request.result.rounds:
            assert record.num_drafted <= max(request.max_new_tokens - done - 1, 0)
            done += record.emitted


def test_path_step_counts_lays_out_request_major_rows_and_refuses_bad_depths():
    assert path_step_counts(torch.tensor([1, 3]), 2, 2).tolist() == [1, 1, 3, 3]  # request-major path rows
    assert path_step_counts(None, 2, 2) is None
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([1, -1])):
        with pytest.raises(ValueError, match="depths"):
            path_step_counts(bad, 2, 2)


def test_gbv_rounds_capped_by_the_room_follow_the_target_law():
    """Sampled GBV where requests have different room (max_new_tokens 2 beside 3, L = 3): every first round is
    capped per request (depths, hole rows in the draft, clamped tree positions); the first two tokens of every
    request follow the exact target joint law (chi-square)."""
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    attach_forward(target, "native", "float32")
    params = SamplingParams(1.0)
    prompt = [1, 2, 3, 1, 2]
    engine = SpeculativeEngine(target, native_draft(target, "self:1", params), params, 3, "gbv", seed=3,
                               num_paths=2)
    n_req = 4000
    requests = _run_together(engine, [Request(prompt, 2 + i % 2, i) for i in range(n_req)])
    short = [r for r in requests if r.max_new_tokens == 2]
    assert all(r.result.rounds[0].num_drafted <= 1 for r in short)
    assert any(r.result.rounds[0].num_drafted == 2 for r in requests if r.max_new_tokens == 3)
    assert any(r.result.rounds[0].accepted > 0 for r in short), "no draft accepted: the test would be vacuous"
    assert_first_tokens_follow([r.result for r in requests], _exact_joint(model, prompt, params, 2), n_req)


def _window_target():
    """A native target whose RoPE table (context window) is 32 positions."""
    target = loaded(tiny_llama(vocab=32, layers=2, seed=3, max_positions=32))
    attach_forward(target, "native", "float32")
    return target


def _run_together(engine, requests):
    """Run ``requests`` as one batch until every one finishes; returns them (results filled in)."""
    engine.open_batch()
    engine.join(requests)
    while engine.num_active:
        engine.step()
    engine.close_batch()
    return requests
