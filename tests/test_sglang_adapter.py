"""The SGLang plugin's sglang-free parts: settings and flags, the sampler in SGLang's layout, adaptive caps,
and TTS snapshots / publishes on CPU stand-ins of the worker objects. The tests that import the real sglang
live in tests_sglang/ (``make test-sglang``)."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specadapt.sglang.adaptive import SGLangAdaptiveVerification
from specadapt.sglang.config import ENV_CONFIG, PluginConfig, PluginConfigError, config_from_env, validate_for_server
from specadapt.sglang.flags import add_arguments, config_from_namespace
from specadapt.sglang import state as plugin_state
from specadapt.sglang.hooks import eagle_sample_around, forward_batch_generation_around
from specadapt.sglang.students import Eagle3LlamaStudent, build_student
from specadapt.sglang.tts import SGLangTTS
from specadapt.sglang.state import PluginState, VerifyRuntime
from specadapt.sglang.targets import plan_targets
from specadapt.sglang.verify import chain_speculative_sampling, target_probs_for_requests
from specadapt.verification import block_verify, chain_verify
from tests.helpers.sglang import _Eagle3StandIn, _sglang_chain_inputs, distil_rounds


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_namespace(parser.parse_args(argv))


def _server(**kw):
    base = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/d", speculative_eagle_topk=None,
                device="cuda")
    base.update(kw)
    return SimpleNamespace(**base)


# ---- settings ------------------------------------------------------------------------------------------------
def test_flags_defaults_and_values():
    assert _parse([]) == PluginConfig()
    cfg = _parse(["--tts", "--tts-stride", "7", "--specadapt-verify", "block", "--adaptive-verification",
                  "--av-refit-interval", "9"])
    assert (cfg.tts, cfg.tts_stride, cfg.verify, cfg.adaptive_verification, cfg.av_refit_interval) == (
        True, 7, "block", True, 9)
    assert _parse(["--specadapt-verify", "gbv"]).num_paths == 3  # GBV default K


def test_config_file_and_explicit_flags_win(tmp_path):
    path = tmp_path / "sa.json"
    path.write_text(json.dumps({"tts": True, "tts_stride": 3, "tts_lr": 1e-4}))
    cfg = _parse(["--specadapt-config", str(path), "--tts-stride", "11"])
    assert (cfg.tts, cfg.tts_stride, cfg.tts_lr) == (True, 11, 1e-4)


@pytest.mark.parametrize("argv, flag", [
    (["--tts-stride", "0"], "--tts-stride"),
    (["--tts-lr", "-1"], "--tts-lr"),
    (["--tts-position-decay", "1.5"], "--tts-position-decay"),
    (["--specadapt-num-paths", "3"], "--specadapt-num-paths"),  # K without gbv
    (["--av-cost-table", "/nonexistent.json"], "--av-cost-table"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(PluginConfigError, match=flag):
        _parse(argv)


def test_env_config_inline_file_and_errors(tmp_path):
    assert config_from_env({}) is None
    assert config_from_env({ENV_CONFIG: '{"tts": true}'}).tts
    path = tmp_path / "c.json"
    path.write_text('{"verify": "block"}')
    assert config_from_env({ENV_CONFIG: str(path)}).verify == "block"
    with pytest.raises(PluginConfigError, match="unknown specadapt setting"):
        config_from_env({ENV_CONFIG: '{"tts_strde": 3}'})
    with pytest.raises(PluginConfigError, match="neither a JSON object nor a file"):
        config_from_env({ENV_CONFIG: "/no/such/file.json"})
    with pytest.raises(PluginConfigError, match="invalid JSON"):
        config_from_env({ENV_CONFIG: "{tts: true"})


@pytest.mark.parametrize("config, server, match", [
    (PluginConfig(tts=True), _server(speculative_algorithm=None), "need speculative decoding"),
    (PluginConfig(tts=True), _server(speculative_draft_model_path=None), "--speculative-draft-model-path"),
    (PluginConfig(tts=True), _server(speculative_algorithm="NGRAM"), "has none"),
    (PluginConfig(tts=True), _server(speculative_algorithm="NGRAM"), "has none"),
    (PluginConfig(verify="block"), _server(speculative_algorithm="NGRAM"), "cannot replace"),
    (PluginConfig(verify="block"), _server(device="cpu"), "CUDA only"),
    (PluginConfig(adaptive_verification=True), _server(speculative_algorithm="DFLASH"), "q rows"),
    (PluginConfig(verify="gbv", num_paths=3), _server(speculative_eagle_topk=2), "--speculative-eagle-topk 3"),
    (PluginConfig(verify="gbv", num_paths=3), _server(speculative_num_steps=4, speculative_num_draft_tokens=5),
     "--speculative-num-draft-tokens 13"),
    (PluginConfig(verify="gbv", num_paths=3), _server(speculative_algorithm="DFLASH"), "cannot replace"),
])
def test_invalid_combinations(config, server, match):
    with pytest.raises(PluginConfigError, match=match):
        validate_for_server(config, server)


def test_valid_combinations_pass():
    validate_for_server(PluginConfig(), _server(speculative_algorithm=None))  # plugin off: nothing to check
    validate_for_server(PluginConfig(tts=True, verify="block", adaptive_verification=True), _server())
    validate_for_server(PluginConfig(verify="block"), _server(speculative_algorithm="DFLASH"))
    validate_for_server(PluginConfig(verify="block", tts=True), _server(speculative_algorithm="DFLASH"))
    validate_for_server(PluginConfig(verify="chain"), _server(speculative_algorithm="STANDALONE"))
    validate_for_server(PluginConfig(verify="gbv", num_paths=3), _server(speculative_eagle_topk=3))


def test_plan_targets_per_algorithm():
    names = lambda cfg, algo: [t.rsplit(".", 1)[-1] for t, _, _ in plan_targets(cfg, algo)]  # noqa: E731
    assert names(PluginConfig(verify="block"), "EAGLE3") == [
        "chain_speculative_sampling_triton", "eagle_sample", "alloc_memory_pool", "sample_draft_proposal",
        "_draft_extend_for_prefill", "_add_request_to_queue"]
    assert names(PluginConfig(verify="block"), "DFLASH") == ["_accept_block", "_add_request_to_queue"]
    assert names(PluginConfig(tts=True), "EAGLE3") == ["eagle_sample", "forward_batch_generation",
                                                      "note_request_finished"]
    assert names(PluginConfig(), "EAGLE3") == []


# ---- the sampler in SGLang's layout ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule, reference", [("chain", chain_verify), ("block", block_verify)])
def test_replaced_sampler_matches_reference(rule, reference):
    plugin_state.install(PluginState(runtime=VerifyRuntime(rule=rule, impl="reference")))
    try:
        for seed in range(20):
            cand, ridx, coins, final, target, draft = _sglang_chain_inputs(seed=seed)
            batch, slots = cand.shape
            predicts = torch.full((batch * slots,), -7, dtype=torch.int32)
            accept_index = torch.full((batch, slots), -1, dtype=torch.int32)
            accept_num = torch.zeros(batch, dtype=torch.int32)
            chain_speculative_sampling(
                predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=cand,
                retrive_index=ridx, retrive_next_token=None, retrive_next_sibling=None, uniform_samples=coins,
                uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=draft,
                threshold_single=1.0, threshold_acc=1.0, deterministic=True)
            ref = reference(cand, target, draft, coins[:, :-1], final)
            assert torch.equal(accept_num, ref.accept_len)
            for b in range(batch):
                tau = int(ref.accept_len[b])
                assert accept_index[b, : tau + 1].tolist() == ridx[b, : tau + 1].tolist()
                assert (accept_index[b, tau + 1:] == -1).all()
                # the token following each accepted node: the next draft, then the extra token at the last one
                got = [int(predicts[int(ridx[b, j])]) for j in range(tau + 1)]
                assert got == ref.output_tokens[b, : tau + 1].tolist()
                untouched = [int(predicts[int(ridx[b, j])]) for j in range(tau + 1, slots)]
                assert untouched == [-7] * (slots - tau - 1)
    finally:
        plugin_state.reset()


def test_sampler_respects_caps_and_rejects_missing_q():
    runtime = VerifyRuntime(rule="chain", impl="reference")
    plugin_state.install(PluginState(runtime=runtime))
    try:
        cand, ridx, coins, final, target, _ = _sglang_chain_inputs(vocab=5)
        batch, slots = cand.shape
        # q = p: every draft with positive mass is accepted unless capped
        draft = target[:, :-1].clone()
        caps = torch.tensor([0, 1, 2, 3])
        runtime.pending_caps = caps
        out = dict(predicts=torch.zeros(batch * slots, dtype=torch.int32),
                   accept_index=torch.full((batch, slots), -1, dtype=torch.int32),
                   accept_token_num=torch.zeros(batch, dtype=torch.int32))
        args = dict(candidates=cand, retrive_index=ridx, retrive_next_token=None, retrive_next_sibling=None,
                    uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=target,
                    threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        chain_speculative_sampling(**out, **args, draft_probs=draft)
        assert torch.equal(out["accept_token_num"].long(), caps)
        assert runtime.pending_caps is None  # consumed by exactly one call
        with pytest.raises(ValueError, match="rejection sampling is off"):
            chain_speculative_sampling(**out, **args, draft_probs=torch.zeros_like(target))
    finally:
        plugin_state.reset()


def test_target_probs_for_requests_per_request_settings():
    logits = torch.randn(3, 2, 11)
    probs = target_probs_for_requests(logits, torch.tensor([[0.0], [1.0], [0.7]]), torch.tensor([1.0, 1.0, 0.5]),
                                      torch.tensor([0, 3, 0]))
    assert torch.allclose(probs.sum(-1), torch.ones(3, 2))
    assert torch.equal(probs[0].argmax(-1), logits[0].argmax(-1)) and ((probs[0] == 1) | (probs[0] == 0)).all()
    assert ((probs[1] > 0).sum(-1) == 3).all()
    assert torch.allclose(probs[2].max(-1).values, probs[2].max(-1).values)  # finite
    with pytest.raises(ValueError, match="one entry per request"):
        target_probs_for_requests(logits, torch.ones(2), torch.ones(3), torch.zeros(3))


# ---- adaptive verification ------------------------------------------------------------------------------------
def test_adaptive_caps_flat_cost_keep_everything_and_learn(tmp_path):
    av = SGLangAdaptiveVerification(PluginConfig(adaptive_verification=True, av_refit_interval=5), num_drafts=4)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        q = torch.softmax(torch.randn(3, 4, 9, generator=g) * 3, -1)
        caps, features, predictions = av.plan(q)
        assert caps.tolist() == [4, 4, 4]  # fixed-width verify costs the same: verify all
        av.observe(features, predictions, torch.tensor([0, 0, 0]), caps)  # always rejected at position 1
    assert av.estimator.refits == 4 and av.estimator.intercepts[0] < -0.2  # learned that position 1 fails
    # a cost table where each verified token is expensive prunes
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"target_ms": [1.0 + 10 * n for n in range(32)], "draft_ms": [0.1]}))
    av2 = SGLangAdaptiveVerification(PluginConfig(adaptive_verification=True, av_cost_table=str(table)), 4)
    q = torch.full((3, 4, 9), 1 / 9)
    av2.plan(q)
    caps, _, _ = av2.plan(q)
    assert (caps < 4).all()
    with pytest.raises(ValueError, match="draft_probs must be"):
        av2.plan(torch.zeros(3, 5, 9))


# ---- TTS on stand-ins -----------------------------------------------------------------------------------------
def _student(**kw):
    draft = _Eagle3StandIn(**kw)
    return draft, build_student(draft, draft.config)


def test_student_aliases_serving_storage_is_causal_and_padding_invariant():
    draft, student = _student()
    assert isinstance(student, Eagle3LlamaStudent)
    serving = dict(draft.named_parameters())
    assert set(student.weights.serving) == set(serving)
    for name in serving:
        assert student.weights.get(student.module, name).data_ptr() == serving[name].data_ptr()
    feats = torch.randn(2, 6, 48)
    tokens = torch.randint(40, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    out = student.logits(student.module, feats, tokens, mask)
    assert out.shape == (2, 6, 12)
    tokens2, feats2 = tokens.clone(), feats.clone()
    tokens2[:, 4:] = (tokens2[:, 4:] + 1) % 40
    feats2[:, 4:] += 1
    out2 = student.logits(student.module, feats2, tokens2, mask)
    assert torch.allclose(out[:, :4], out2[:, :4], atol=1e-5) and not torch.allclose(out[:, 4:], out2[:, 4:])
    short = student.logits(student.module, feats[:, :4], tokens[:, :4], mask[:, :4])
    padded_mask = mask.clone()
    padded_mask[:, 4:] = False
    padded = student.logits(student.module, feats, tokens, padded_mask)
    assert torch.allclose(short, padded[:, :4], atol=1e-5)
    assert student.trainable("model__fc__weight", None) and not student.trainable("model__embed_tokens__weight", None)


def test_build_student_rejects_unknown_architectures_and_bad_params():
    with pytest.raises(ValueError, match="no training forward.*LlamaForCausalLMEagle3.*Qwen3ForCausalLM"):
        build_student(nn.Linear(2, 2), None)
    draft = _Eagle3StandIn()
    with pytest.raises(ValueError, match="--tts-params"):
        build_student(draft, draft.config, "everything")


class _Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_idle(self):
        return self.kind == "idle"

    def is_extend(self):
        return self.kind == "extend"


def _round(g, batch, slots, vocab=40, hidden=16):
    rids = [f"r{i}" for i in range(batch)]
    verify_input = SimpleNamespace(draft_token=torch.randint(vocab, (batch * slots,), generator=g),
                                   draft_probs=torch.softmax(torch.randn(batch, slots - 1, vocab, generator=g), -1))
    logits_output = SimpleNamespace(next_token_logits=torch.randn(batch * slots, vocab, generator=g) * 3,
                                    hidden_states=torch.randn(batch * slots, 3 * hidden, generator=g))
    b = SimpleNamespace(forward_mode=_Mode("decode"), reqs=[SimpleNamespace(rid=r) for r in rids],
                        sampling_info=SimpleNamespace(temperatures=torch.ones(batch, 1)), is_extend_in_batch=False)
    return verify_input, b, logits_output


def test_tts_hooks_snapshot_publish_in_place_on_stride():
    draft, student = _student()
    stride = 3
    cfg = PluginConfig(tts=True, tts_stride=stride, tts_lr=1e-2, tts_rollback_margin=1.0)
    tts = SGLangTTS(student, cfg, asynchronous=False)
    state = PluginState(config=cfg, runtime=VerifyRuntime(), tts=tts, algorithm="EAGLE3")
    plugin_state.install(state)
    trained = {n: p for n, p in draft.named_parameters() if "embed_tokens" not in n}
    ptrs = {n: p.data_ptr() for n, p in draft.named_parameters()}
    embed_before = draft.model.embed_tokens.weight.clone()
    history = []
    try:
        g = torch.Generator().manual_seed(1)
        worker = object()
        for round_index in range(1, 3 * stride + 2):
            forward_batch_generation_around(lambda w, batch: None, worker, SimpleNamespace(
                forward_mode=_Mode("decode"), is_extend_in_batch=False))
            history.append({n: p.clone() for n, p in trained.items()})
            verify_input, batch, logits_output = _round(g, batch=2, slots=4)
            raw_logits = logits_output.next_token_logits.clone()

            def original(vi, b, lo):
                lo.next_token_logits.mul_(0)  # SGLang applies penalties / masks in place
                lo.hidden_states.zero_()
                return None, torch.tensor([2, 4]), None  # accept_lens include the bonus

            eagle_sample_around(original, verify_input, batch, logits_output)
            # the snapshot was cloned before the in-place edits
            ex = tts._pending[-1]
            assert ex.teacher.shape == (3, 12) and torch.isfinite(ex.teacher).all()
            expected = torch.softmax(raw_logits.reshape(2, 4, 40)[1, :3], -1)[:, torch.arange(12) * 3]
            assert torch.allclose(ex.teacher, expected / expected.sum(-1, keepdim=True), atol=1e-6)
        # round r's examples reach the updater at the start of round r + 1; an update launched at the boundary
        # after round m (m % stride == 0) is published at the next boundary, m + stride
        changed = [any(not torch.equal(history[i][n], history[i + 1][n]) for n in trained)
                   for i in range(len(history) - 1)]
        assert tts.updater.stats.publishes >= 2
        assert changed == [(i + 1) % stride == 0 and i + 1 >= 2 * stride for i in range(len(changed))], changed
        assert {n: p.data_ptr() for n, p in draft.named_parameters()} == ptrs  # in place
        assert torch.equal(draft.model.embed_tokens.weight, embed_before)  # shared with the target: frozen
        assert len(tts.history["r0"]) == min(2 * (len(history)), cfg.tts_context_window + 1)
    finally:
        plugin_state.reset()


def test_tts_history_inputs_line_up():
    draft, student = _student()
    tts = SGLangTTS(student, PluginConfig(tts=True), asynchronous=False)
    slots = 4
    toks = torch.arange(slots)[None]
    feats = torch.arange(slots, dtype=torch.float32)[None, :, None].expand(1, slots, 48)
    logits = torch.zeros(slots, 40)
    snap = tts.snapshot(["a"], toks, feats.reshape(slots, 48), logits, torch.ones(1))
    tts.record(snap, [1])
    first = tts._pending[-1]
    assert first.first_valid == 1 and first.tokens.tolist() == [0, 1, 2]
    assert first.features[:, 0].tolist() == [0, 0, 1]  # zero predecessor, then slot features
    snap = tts.snapshot(["a"], toks + 10, feats.reshape(slots, 48) + 10, logits, torch.ones(1))
    tts.record(snap, [0])
    second = tts._pending[-1]
    # history holds slots 0..1 of round 1 (tokens 0, 1; features 0, 1); inputs: token 1 (feature 0), then
    # round 2's tokens 10, 11, 12 with predecessors' features 1, 10, 11
    assert second.first_valid == 0 and second.tokens.tolist() == [1, 10, 11, 12]
    assert second.features[:, 0].tolist() == [0, 1, 10, 11]
    with pytest.raises(ValueError, match="outside"):
        tts.record(snap, [4])


def test_tts_topk_snapshots_densify_to_the_truncated_teacher():
    """--tts-topk k in the plugin: examples hold k values + ids; the loss sees the renormalised top-k rows; k >= V
    keeps the dense rows (the exact full-vocabulary loss)."""
    from specadapt.tts import top_k_rows

    g = torch.Generator().manual_seed(5)
    vi, b, lo = _round(g, batch=2, slots=4)
    examples, losses = {}, {}
    for k in (0, 3, 10_000):
        draft, student = _student()
        tts = SGLangTTS(student, PluginConfig(tts=True, tts_topk=k), asynchronous=False)
        snap = tts.snapshot([r.rid for r in b.reqs], vi.draft_token, lo.hidden_states, lo.next_token_logits,
                            b.sampling_info.temperatures, vi.draft_probs)
        tts.record(snap, [2, 1])
        examples[k] = tts._pending[:]
        with torch.no_grad():
            losses[k] = float(tts._loss(tts.updater.shadow, examples[k]))
    full, cut = examples[0], examples[3]
    assert all(ex.teacher_index is None for ex in full + examples[10_000])
    for a, c in zip(full, cut):
        values, index = top_k_rows(a.teacher, 3)
        assert c.teacher.shape == (a.teacher.shape[0], 3) and torch.equal(c.teacher_index, index)
        assert torch.equal(c.teacher, values) and c.nbytes < a.nbytes
        if a.proximal is not None:
            assert c.proximal_index is not None and c.proximal.shape[-1] == 3
    assert losses[10_000] == losses[0] and math.isfinite(losses[3]) and losses[3] != losses[0]
    with pytest.raises(PluginConfigError, match="--tts-topk"):
        PluginConfig(tts=True, tts_topk=-1)


def test_tts_updates_lower_the_loss():
    torch.manual_seed(0)
    draft, student = _student()
    tts = SGLangTTS(student, PluginConfig(tts=True, tts_stride=1, tts_lr=3e-2, tts_rollback_margin=1.0),
                    asynchronous=False)
    g = torch.Generator().manual_seed(3)
    vi, b, lo = _round(g, batch=2, slots=4)
    losses = distil_rounds(tts, lambda: tts.snapshot([r.rid for r in b.reqs], vi.draft_token, lo.hidden_states,
                                                     lo.next_token_logits, b.sampling_info.temperatures,
                                                     vi.draft_probs), [3, 3], rounds=25)
    assert tts.updater.stats.updates >= 20
    assert losses[-1] < 0.7 * losses[0], losses


def test_hooks_pass_through_without_state_and_for_idle():
    plugin_state.reset()
    calls = []
    out = eagle_sample_around(lambda *a: calls.append(a) or "r", 1, SimpleNamespace(forward_mode=_Mode("decode")), 3)
    assert out == "r" and calls
    forward_batch_generation_around(lambda w, b: calls.append("fwd"), None, SimpleNamespace(forward_mode=_Mode("extend")))
    assert calls[-1] == "fwd"
