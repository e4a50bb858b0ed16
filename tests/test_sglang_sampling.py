"""The SGLang plugin's target law and coins (issue 19, items 8 and 9), without sglang: min-p applied to SGLang's
target rows, the request options the plugin refuses, and per-request coins from SGLang's ``sampling_seed``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from specadapt import kernels
from specadapt.sampling import apply_min_p
from specadapt.sglang import state as plugin_state
from specadapt.sglang.config import PluginConfig
from specadapt.sglang.hooks import add_request_around, eagle_sample_around
from specadapt.sglang.state import PluginState, VerifyRuntime
from specadapt.sglang.targets import plan_targets
from specadapt.sglang.verify import (chain_speculative_sampling, dflash_verify, request_verify_coins, sampling_refusal,
                                     target_probs_for_requests)
from tests.helpers.sglang import _sglang_chain_inputs


def _outputs(batch, slots):
    return dict(predicts=torch.full((batch * slots,), -7, dtype=torch.int32),
                accept_index=torch.full((batch, slots), -1, dtype=torch.int32),
                accept_token_num=torch.zeros(batch, dtype=torch.int32))


def _call(cand, ridx, coins, final, target, draft, out):
    chain_speculative_sampling(**out, candidates=cand, retrive_index=ridx, retrive_next_token=None,
                               retrive_next_sibling=None, uniform_samples=coins,
                               uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=draft,
                               threshold_single=1.0, threshold_acc=1.0, deterministic=True)


# ---- min-p ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["chain", "block"])
def test_sampler_applies_each_requests_min_p(rule):
    """With the batch's min-p pending, the replaced sampler verifies against SGLang's rows after min-p: the same
    tokens as the reference rule on ``apply_min_p(target_probs)``; without it min-p would be dropped (differs)."""
    runtime = VerifyRuntime(rule=rule, impl="reference")
    plugin_state.install(PluginState(runtime=runtime))
    try:
        differs = 0
        for seed in range(30):
            cand, ridx, coins, final, target, draft = _sglang_chain_inputs(seed=seed, vocab=9)
            batch, slots = cand.shape
            min_ps = torch.tensor([0.0, 0.3, 0.6, 0.15])
            runtime.pending_min_ps = min_ps
            out = _outputs(batch, slots)
            _call(cand, ridx, coins, final, target, draft, out)
            assert runtime.pending_min_ps is None  # consumed by exactly one call
            ref = kernels.verify(rule, cand, apply_min_p(target, min_ps[:, None, None]), draft, coins[:, :-1], final,
                                 impl="reference")
            assert torch.equal(out["accept_token_num"], ref.accept_len)
            plain = kernels.verify(rule, cand, target, draft, coins[:, :-1], final, impl="reference")
            differs += int(not torch.equal(plain.output_tokens, ref.output_tokens))
            for b in range(batch):
                tau = int(ref.accept_len[b])
                assert [int(out["predicts"][int(ridx[b, j])]) for j in range(tau + 1)] == \
                    ref.output_tokens[b, : tau + 1].tolist()
        assert differs > 0
    finally:
        plugin_state.reset()


def test_first_token_follows_the_min_p_law():
    """Chi-square: the first token the replaced sampler emits (block rule, 20,000 rounds, fresh coins) follows the
    target row after min-p, not SGLang's row without it."""
    runtime = VerifyRuntime(rule="block", impl="auto")
    plugin_state.install(PluginState(runtime=runtime))
    try:
        g = torch.Generator().manual_seed(3)
        vocab, rounds = 6, 20000
        p = torch.softmax(torch.randn(vocab, generator=g) * 1.2, -1)
        q = torch.softmax(torch.randn(vocab, generator=g) * 1.2, -1)
        target = p.expand(rounds, 3, vocab).contiguous()
        draft = q.expand(rounds, 2, vocab).contiguous()
        drafts = torch.multinomial(q, rounds * 2, replacement=True, generator=g).reshape(rounds, 2)
        cand = torch.cat([torch.zeros(rounds, 1, dtype=torch.int64), drafts], 1)
        ridx = torch.arange(rounds * 3).reshape(rounds, 3)
        runtime.pending_min_ps = torch.full((rounds,), 0.35)
        out = _outputs(rounds, 3)
        _call(cand, ridx, torch.rand(rounds, 3, generator=g), torch.rand(rounds, generator=g), target, draft, out)
        first = out["predicts"][ridx[:, 0]].long()
        law = apply_min_p(p.double(), 0.35)
        counts = torch.bincount(first, minlength=vocab).double()
        assert counts[law == 0].sum() == 0, "a token below min-p was emitted"
        keep = law > 0
        _, pvalue = stats.chisquare(counts[keep].numpy(), (law[keep] * rounds).numpy())
        assert pvalue > 1e-4, pvalue
    finally:
        plugin_state.reset()


def test_eagle_sample_hook_hands_the_batch_min_p_to_the_sampler():
    runtime = VerifyRuntime(rule="chain", impl="reference")
    state = PluginState(config=PluginConfig(verify="chain"), runtime=runtime, algorithm="EAGLE3")
    plugin_state.install(state)
    try:
        seen = []
        info = SimpleNamespace(need_min_p_sampling=True, min_ps=torch.tensor([0.1, 0.0]))
        batch = SimpleNamespace(forward_mode=None, sampling_info=info, reqs=[])
        eagle_sample_around(lambda vi, b, lo: seen.append(runtime.pending_min_ps) or (None, torch.ones(2), None),
                            SimpleNamespace(draft_probs=None), batch, SimpleNamespace(hidden_states=None))
        assert torch.equal(seen[0], info.min_ps) and runtime.pending_min_ps is None  # cleared after the call
        info.need_min_p_sampling = False
        eagle_sample_around(lambda vi, b, lo: seen.append(runtime.pending_min_ps) or (None, torch.ones(2), None),
                            SimpleNamespace(draft_probs=None), batch, SimpleNamespace(hidden_states=None))
        assert seen[1] is None
    finally:
        plugin_state.reset()


def test_target_probs_for_requests_applies_min_p():
    logits = torch.randn(3, 2, 11) * 2
    temps, tops, ks = torch.ones(3, 1), torch.ones(3), torch.zeros(3, dtype=torch.int64)
    plain = target_probs_for_requests(logits, temps, tops, ks)
    got = target_probs_for_requests(logits, temps, tops, ks, torch.tensor([0.0, 0.4, 1.0]))
    torch.testing.assert_close(got[0], plain[0])
    torch.testing.assert_close(got[1], apply_min_p(plain[1], 0.4))
    assert ((got[2] > 0).sum(-1) == 1).all()  # min_p 1: the most likely token only
    with pytest.raises(ValueError, match="min_ps"):
        target_probs_for_requests(logits, temps, tops, ks, torch.zeros(2))


# ---- options the plugin refuses -------------------------------------------------------------------------------
def _params(**kw):
    base = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0, min_p=0.0,
                logit_bias=None, temperature=0.7, top_p=0.9, top_k=20)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,option", [({"frequency_penalty": 0.5}, "frequency_penalty"),
                                       ({"presence_penalty": -0.3}, "presence_penalty"),
                                       ({"repetition_penalty": 1.1}, "repetition_penalty"),
                                       ({"min_new_tokens": 4}, "min_new_tokens")])
def test_sampling_refusal_names_the_option(kw, option):
    message = sampling_refusal(_params(**kw))
    assert message is not None and option in message and "\n" not in message


def test_sampling_refusal_accepts_what_the_plugin_honours():
    assert sampling_refusal(_params()) is None
    assert sampling_refusal(_params(min_p=0.1, logit_bias={"3": 2.0}, top_k=1)) is None
    assert "custom_logit_processor" in sampling_refusal(_params(), custom_logit_processor="{...}")


class _Req:
    def __init__(self, **kw):
        self.sampling_params = _params(**kw)
        self.custom_logit_processor = None
        self.to_finish = None
        self.aborted = None

    def set_finish_with_abort(self, message):
        self.aborted = message
        self.to_finish = "abort"


@pytest.mark.parametrize("config,refused", [(PluginConfig(verify="block"), True),
                                            (PluginConfig(adaptive_verification=True), True),
                                            (PluginConfig(tts=True), False)])
def test_add_request_hook_refuses_unhonourable_requests(config, refused):
    plugin_state.install(PluginState(config=config, runtime=VerifyRuntime(), algorithm="EAGLE3"))
    try:
        queued = []
        original = lambda scheduler, req, *a, **k: queued.append(req)  # noqa: E731
        bad, good = _Req(frequency_penalty=0.5), _Req(min_p=0.2)
        add_request_around(original, None, bad)
        add_request_around(original, None, good)
        assert queued == [bad, good]  # both queued: SGLang finishes the refused one with its error
        assert (bad.aborted is not None) == refused and good.aborted is None
        retracted = _Req(repetition_penalty=1.2)
        add_request_around(original, None, retracted, True)
        add_request_around(original, None, retracted, is_retracted=True)
        assert retracted.aborted is None
    finally:
        plugin_state.reset()


def test_plan_targets_install_the_request_check_and_min_p_hook():
    names = lambda cfg, algo: [t.rsplit(".", 1)[-1] for t, _, _ in plan_targets(cfg, algo)]  # noqa: E731
    for algo in ("EAGLE3", "STANDALONE", "DFLASH"):
        assert "_add_request_to_queue" in names(PluginConfig(verify="block"), algo)
        assert "_add_request_to_queue" not in names(PluginConfig(tts=True), algo)
    assert "eagle_sample" in names(PluginConfig(verify="chain"), "EAGLE3")
    assert "eagle_sample" in names(PluginConfig(verify="gbv", num_paths=2), "EAGLE")


# ---- per-request seeds ----------------------------------------------------------------------------------------
def _dflash_case(seed, batch=4, block=4, vocab=9):
    g = torch.Generator().manual_seed(seed)
    candidates = torch.randint(vocab, (batch, block), generator=g)
    logits = torch.randn(batch * block, vocab, generator=g) * 1.5
    info = SimpleNamespace(is_all_greedy=False, temperatures=torch.full((batch, 1), 0.9),
                           top_ps=torch.full((batch,), 0.95), top_ks=torch.zeros(batch, dtype=torch.int64),
                           min_ps=torch.zeros(batch), need_min_p_sampling=False,
                           sampling_seed=torch.arange(batch, dtype=torch.int64) * 1000 + 7)
    prefix = torch.randint(5, 50, (batch,), generator=g)
    return candidates, logits, info, prefix


def _subset(candidates, logits, info, prefix, rows):
    block = candidates.shape[1]
    rows_t = torch.tensor(rows)
    flat = (rows_t[:, None] * block + torch.arange(block)).reshape(-1)
    sub = SimpleNamespace(**{k: (v[rows_t] if isinstance(v, torch.Tensor) else v) for k, v in vars(info).items()})
    return candidates[rows_t], logits[flat], sub, prefix[rows_t]


def test_dflash_coins_come_from_each_requests_sampling_seed():
    """A request's DFLASH acceptance depends on its own seed and inputs only: alone, in the full batch and in
    another batch order it accepts the same drafts and emits the same bonus token; another seed or another round
    (committed length) changes its coins."""
    runtime = VerifyRuntime(rule="block", impl="reference", seed=3)
    for seed in range(8):
        case = _dflash_case(seed)
        full_len, full_bonus = dflash_verify(runtime, *case)
        for rows in ([2], [3, 1], [1, 0, 3, 2]):
            accept_len, bonus = dflash_verify(runtime, *_subset(*case, rows))
            assert accept_len.tolist() == full_len[rows].tolist() and bonus.tolist() == full_bonus[rows].tolist()
    u, f = request_verify_coins(torch.tensor([7, 7, 8]), torch.tensor([10, 11, 10]), 3, seed=3)
    assert u.shape == (3, 3) and f.shape == (3,) and ((u >= 0) & (u < 1)).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again, _ = request_verify_coins(torch.tensor([8, 7]), torch.tensor([10, 10]), 3, seed=3)
    assert torch.equal(again[1], u[0]) and torch.equal(again[0], u[2])
    other, _ = request_verify_coins(torch.tensor([7]), torch.tensor([10]), 3, seed=4)
    assert not torch.equal(other[0], u[0])  # --specadapt-seed is mixed in


def test_dflash_without_sglang_seeds_uses_the_runtime_generator():
    runtime = VerifyRuntime(rule="chain", impl="reference", seed=5)
    candidates, logits, info, prefix = _dflash_case(0)
    info.sampling_seed = None
    state = runtime.generator(torch.device("cpu")).get_state()
    accept_len, bonus = dflash_verify(runtime, candidates, logits, info, prefix)
    gen = torch.Generator().set_state(state)
    coins, final = torch.rand(4, 3, generator=gen), torch.rand(4, generator=gen)
    probs = target_probs_for_requests(logits.reshape(4, 4, -1), info.temperatures, info.top_ps, info.top_ks)
    q = torch.nn.functional.one_hot(candidates[:, 1:], probs.shape[-1]).float()
    ref = kernels.verify("chain", candidates, probs, q, coins, final, impl="reference")
    assert torch.equal(accept_len, ref.accept_len.to(torch.int32))


def test_dflash_applies_min_p_and_the_seeded_law_is_the_target_law():
    """DFLASH blocks are point masses, so the first emitted token's law is p after min-p: chi-square over 20,000
    requests with distinct SGLang seeds (one round each)."""
    runtime = VerifyRuntime(rule="block", impl="auto")
    g = torch.Generator().manual_seed(1)
    n, block, vocab = 20000, 3, 6
    row = torch.randn(block, vocab, generator=g) * 1.3
    logits = row.repeat(n, 1)
    candidates = torch.cat([torch.zeros(n, 1, dtype=torch.int64), torch.tensor([[2, 4]]).expand(n, 2)], 1)
    info = SimpleNamespace(temperatures=torch.ones(n, 1), top_ps=torch.ones(n), top_ks=torch.zeros(n, dtype=torch.int64),
                           min_ps=torch.full((n,), 0.3), need_min_p_sampling=True,
                           sampling_seed=torch.arange(n, dtype=torch.int64))
    accept_len, bonus = dflash_verify(runtime, candidates, logits, info, torch.full((n,), 17))
    first = torch.where(accept_len > 0, torch.full_like(bonus, 2), bonus)
    law = apply_min_p(torch.softmax(row[0].double(), -1), 0.3)
    counts = torch.bincount(first, minlength=vocab).double()
    assert counts[law == 0].sum() == 0
    keep = law > 0
    _, pvalue = stats.chisquare(counts[keep].numpy(), (law[keep] * n).numpy())
    assert pvalue > 1e-4, pvalue
    assert np.isclose(float(counts[2]) / n, float(law[2]), atol=0.02)
