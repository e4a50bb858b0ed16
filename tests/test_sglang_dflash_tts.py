"""TTS of DFLASH drafts in the SGLang plugin without sglang: the block student, its refusals, the context and
block examples built from the worker's calls, and updates that distil toward the target through the hooks.

The student against SGLang's own DFlashDraftModel forward is tested in tests_sglang/test_sglang_students.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specadapt.sglang import state as plugin_state
from specadapt.sglang.config import PluginConfig
from specadapt.sglang.hooks import dflash_accept_around, dflash_append_around, forward_batch_generation_around
from specadapt.sglang.state import PluginState, VerifyRuntime
from specadapt.sglang.students.dflash import DFlashStudent
from specadapt.sglang.targets import plan_targets
from specadapt.sglang.tts_dflash import SGLangDFlashTTS
from tests.helpers.sglang import with_parameters

HIDDEN, HEADS, KV, D, INTER, VOCAB, MASK = 16, 4, 2, 4, 24, 30, 3


def _draft(layers=2, seed=0):
    """Parameters named and shaped as SGLang's DFlashDraftModel (two target features), random values."""
    torch.manual_seed(seed)
    draft = type("DFlashDraftModel", (nn.Module,), {})()
    shapes = {"fc.weight": (HIDDEN, 2 * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,)}
    for i in range(layers):
        pre = f"layers.{i}."
        shapes.update({pre + "input_layernorm.weight": (HIDDEN,), pre + "post_attention_layernorm.weight": (HIDDEN,),
                       pre + "self_attn.qkv_proj.weight": ((HEADS + 2 * KV) * D, HIDDEN),
                       pre + "self_attn.o_proj.weight": (HIDDEN, HEADS * D),
                       pre + "self_attn.q_norm.weight": (D,), pre + "self_attn.k_norm.weight": (D,),
                       pre + "mlp.gate_up_proj.weight": (2 * INTER, HIDDEN),
                       pre + "mlp.down_proj.weight": (HIDDEN, INTER)})
    with_parameters(draft, {name: 1 + 0.1 * torch.randn(shape) if "norm" in name else 0.3 * torch.randn(shape)
                            for name, shape in shapes.items()})
    draft.config = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D, hidden_size=HIDDEN,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB, hidden_act="silu")
    return draft


def _student(params="full", seed=0, on_refresh=None):
    draft = _draft(seed=seed)
    g = torch.Generator().manual_seed(100)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(VOCAB + 2, HIDDEN, generator=g) * 0.5
    return draft, DFlashStudent(draft, draft.config, embed, head, params, 4, on_refresh=on_refresh)


def test_block_student_reads_context_bidirectionally_and_ignores_padding():
    draft, student = _student()
    feats = torch.randn(2, 5, 2 * HIDDEN)
    mask = torch.ones(2, 5, dtype=torch.bool)
    block = torch.tensor([[7, MASK, MASK, MASK], [9, MASK, MASK, MASK]])
    with torch.no_grad():
        out = student.block_logits(student.module, feats, mask, block)
        assert out.shape == (2, 4, VOCAB)  # the head's padding rows dropped
        # a block position sees the whole block: changing the last slot changes the first output
        changed = block.clone()
        changed[:, 3] = 11
        assert not torch.allclose(student.block_logits(student.module, feats, mask, changed)[:, 0], out[:, 0])
        # context entries past a row's length change nothing; fewer valid entries = a shorter context
        short = student.block_logits(student.module, feats[:, :3], mask[:, :3], block)
        padded_mask = mask.clone()
        padded_mask[:, 3:] = False
        garbage = feats.clone()
        garbage[:, 3:] = 100.0
        assert torch.allclose(student.block_logits(student.module, garbage, padded_mask, block), short, atol=1e-5)
    trainable = {n for n, p in student.module.named_parameters() if student.trainable(n, p)}
    assert "fc__weight" in trainable and not any(n.startswith(("embed__", "lm_head__")) for n in trainable)


@pytest.mark.parametrize("change, match", [
    (dict(dflash_config={"conv_kernel_size": 3}), "conv_kernel_size"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(use_gemma_norm=True), "use_gemma_norm"),
    (dict(dflash_config={"projector_type": "domino"}), "projector_type=domino"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_block_student_refuses_other_dflash_variants(change, match):
    draft = _draft()
    config = SimpleNamespace(**{**vars(draft.config), **change})
    with pytest.raises(ValueError, match=match):
        DFlashStudent(draft, config, torch.zeros(VOCAB, HIDDEN), torch.zeros(VOCAB, HIDDEN))
    other = type("DFlash2DraftModel", (nn.Module,), {})()
    with pytest.raises(ValueError, match="DFlash2DraftModel"):
        DFlashStudent(other, draft.config, torch.zeros(1, 1), torch.zeros(1, 1))


def test_context_and_block_examples_follow_the_worker_calls():
    _, student = _student()
    tts = SGLangDFlashTTS(student, PluginConfig(tts=True, tts_context_window=6), MASK, asynchronous=False)
    prompt = torch.arange(5 * 2 * HIDDEN, dtype=torch.float32).reshape(5, 2 * HIDDEN)
    tts.append_context(["a", "b"], prompt, extend_lens=torch.tensor([3, 2]))  # prefill: the prompts' rows
    assert len(tts.history["a"]) == 3 and torch.equal(tts.history["b"][1], prompt[4])
    candidates = torch.tensor([[7, 8, 9, 10], [5, 6, 2, 1]])
    logits = torch.randn(8, VOCAB)
    tts.record_block(["a", "b"], candidates, logits, torch.tensor([[1.0], [0.5]]), torch.tensor([2, 0]))
    ex_a, ex_b = tts._pending
    assert ex_a.tokens.tolist() == [7, MASK, MASK, MASK] and ex_b.tokens.tolist() == [5, MASK, MASK, MASK]
    assert torch.equal(ex_a.features, prompt[:3]) and ex_a.accepted == 2 and ex_b.accepted == 0
    # output j predicts the block's token j: teacher = the target's verify row j - 1 (temperature applied),
    # kept up to the first rejection plus one (tau + 1 rows)
    assert torch.allclose(ex_b.teacher, torch.softmax(logits.reshape(2, 4, VOCAB)[1, :1] / 0.5, -1), atol=1e-6)
    assert torch.allclose(ex_a.teacher, torch.softmax(logits.reshape(2, 4, VOCAB)[0, :3], -1), atol=1e-6)
    block_rows = torch.randn(8, 2 * HIDDEN)
    tts.append_context(["a", "b"], block_rows, commit_lens=torch.tensor([3, 1]))  # decode: committed rows
    assert len(tts.history["a"]) == 6 and torch.equal(tts.history["a"][-1], block_rows[2])
    assert len(tts.history["b"]) == 3 and torch.equal(tts.history["b"][-1], block_rows[4])
    tts.record_block(["c"], candidates[:1], logits[:4], torch.ones(1), torch.tensor([1]))
    assert len(tts._pending) == 2  # no context yet for "c": no example
    with pytest.raises(ValueError, match="exactly one"):
        tts.append_context(["a"], block_rows[:4])


def test_dflash_tts_through_the_hooks_distils_toward_the_target():
    """Rounds through the worker hooks (forward_batch_generation, _accept_block, _append_target_hidden...): the
    updates publish into the served draft's tensors in place every stride rounds and move its block predictions
    toward a target that is a perturbed copy of the draft; the fused-KV rebuild runs at each publish."""
    rebuilt = []
    draft, student = _student(on_refresh=lambda: rebuilt.append(1))
    _, target = _student(seed=7)  # the "target": another draft's block predictions
    cfg = PluginConfig(tts=True, tts_stride=1, tts_lr=1e-2, tts_rollback_margin=1.0)
    tts = SGLangDFlashTTS(student, cfg, MASK, asynchronous=False)
    plugin_state.install(PluginState(config=cfg, runtime=VerifyRuntime(), tts=tts, algorithm="DFLASH"))
    g = torch.Generator().manual_seed(1)
    context = torch.randn(2, 6, 2 * HIDDEN, generator=g)
    bonus = torch.tensor([4, 9])
    block = torch.stack([torch.tensor([int(b), MASK, MASK, MASK]) for b in bonus])
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        target_rows = target.block_logits(target.module, context, mask, block)[:, 1:]  # what to predict
    verify_logits = torch.cat([target_rows, torch.zeros(2, 1, VOCAB)], 1).reshape(8, VOCAB)  # row j-1 <-> out j

    def kl():
        with torch.no_grad():
            served = DFlashStudent(draft, draft.config, student.weights.get(student.module, "embed.weight"),
                                   student.weights.get(student.module, "lm_head.weight"))
            q = torch.log_softmax(served.block_logits(served.module, context, mask, block)[:, 1:], -1)
            p = torch.softmax(target_rows, -1)
            return float((p * (p.log() - q)).sum(-1).mean())

    ptr = getattr(draft.layers, "0").mlp.down_proj.weight.data_ptr()
    try:
        batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True, is_idle=lambda: False),
                                reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")], is_extend_in_batch=True)
        forward_batch_generation_around(lambda w, b: None, None, batch)
        dflash_append_around(lambda w, **kw: None, None, target_hidden=context.reshape(12, -1),
                             cache_loc=torch.arange(12), positions=torch.arange(12), extend_lens=torch.tensor([6, 6]))
        start = kl()
        decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False),
                                 reqs=batch.reqs, is_extend_in_batch=False)
        info = SimpleNamespace(temperatures=torch.ones(2, 1), is_all_greedy=True)
        for _ in range(25):
            forward_batch_generation_around(lambda w, b: None, None, decode)
            accept = lambda w, **kw: (torch.tensor([3, 3], dtype=torch.int32), None, None, None, None)  # noqa: E731
            dflash_accept_around(accept, None, candidates=torch.cat([bonus[:, None], block[:, 1:]], 1),
                                 next_token_logits=verify_logits.clone(), sampling_info=info, draft_input=None,
                                 prefix_lens=None, bs=2)
            tts.history["a"].clear(), tts.history["b"].clear()  # keep the same context every round
            dflash_append_around(lambda w, **kw: None, None, target_hidden=context.reshape(12, -1),
                                 cache_loc=torch.arange(12), positions=torch.arange(12),
                                 extend_lens=torch.tensor([6, 6]))
        forward_batch_generation_around(lambda w, b: None, None, decode)
        assert tts.updater.stats.publishes >= 20 and len(rebuilt) == tts.updater.stats.publishes
        assert getattr(draft.layers, "0").mlp.down_proj.weight.data_ptr() == ptr
        assert kl() < 0.5 * start, (kl(), start)
    finally:
        plugin_state.reset()


def test_dflash_targets():
    names = lambda cfg: [t.rsplit(".", 1)[-1] for t, _, _ in plan_targets(cfg, "DFLASH")]  # noqa: E731
    assert names(PluginConfig(verify="block")) == ["_accept_block", "_add_request_to_queue"]
    assert names(PluginConfig(tts=True)) == ["_accept_block", "forward_batch_generation",
                                             "_append_target_hidden_to_draft_kv_by_loc", "note_request_finished"]


def test_publish_refreshes_sglangs_fused_context_kv_copies_in_place():
    """SGLang's FusedKVMaterializeHelper keeps copies: flat_kv_weight_t = stack of every layer's K/V rows of
    qkv_proj, reshaped [layers * 2kv, in] and transposed; k_norm_weights = stack of the K norms."""
    from specadapt.sglang.install import refresh_fused_kv

    draft = _draft()
    q_size, kv_size = HEADS * D, KV * D
    layers = [getattr(draft.layers, str(i)) for i in range(2)]
    for layer in layers:
        layer.self_attn.q_size, layer.self_attn.kv_size = q_size, kv_size

    def build():
        kv = [layer.self_attn.qkv_proj.weight[q_size:q_size + 2 * kv_size] for layer in layers]
        return (torch.stack(kv).reshape(2 * 2 * kv_size, -1).transpose(0, 1).contiguous(),
                torch.stack([layer.self_attn.k_norm.weight for layer in layers]).contiguous())

    flat, norms = build()
    helper = SimpleNamespace(flat_kv_weight_t=flat, k_norm_weights=norms)
    worker = SimpleNamespace(_fused_kv_helper=helper, draft_model=SimpleNamespace(layers=layers))
    ptrs = (flat.data_ptr(), norms.data_ptr())
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.qkv_proj.weight.add_(1.0)
            layer.self_attn.k_norm.weight.mul_(2.0)
    refresh_fused_kv(worker)
    want_flat, want_norms = build()
    assert torch.equal(helper.flat_kv_weight_t, want_flat) and torch.equal(helper.k_norm_weights, want_norms)
    assert (helper.flat_kv_weight_t.data_ptr(), helper.k_norm_weights.data_ptr()) == ptrs
    refresh_fused_kv(SimpleNamespace(_fused_kv_helper=None))  # no helper (CPU / non-fused path): nothing to do


def test_histories_are_bounded_and_tts_refuses_dp_attention():
    from specadapt.sglang.config import PluginConfigError, validate_for_server

    _, student = _student()
    tts = SGLangDFlashTTS(student, PluginConfig(tts=True), MASK, asynchronous=False, max_histories=2)
    for rid in ("a", "b", "c"):  # "a" finished at prefill and never reached note_request_finished
        tts.append_context([rid], torch.randn(2, 2 * HIDDEN), extend_lens=[2])
    assert list(tts.history) == ["b", "c"]
    server = SimpleNamespace(speculative_algorithm="DFLASH", speculative_draft_model_path="/d",
                             speculative_eagle_topk=None, device="cuda", enable_dp_attention=True)
    with pytest.raises(PluginConfigError, match="--enable-dp-attention"):
        validate_for_server(PluginConfig(tts=True), server)


def test_dflash_tts_is_built_from_the_worker():
    """The installation path: the student over the worker's draft, the target's embedding and LM head (shared,
    never trained), the worker's mask token."""
    from specadapt.sglang.install import _dflash_tts

    draft = _draft()
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    target = SimpleNamespace(get_input_embeddings=lambda: embed, lm_head=head)
    worker = SimpleNamespace(draft_model=draft, _mask_token_id=MASK, _fused_kv_helper=None,
                             target_worker=SimpleNamespace(model_runner=SimpleNamespace(model=target)))
    tts = _dflash_tts(worker, PluginConfig(tts=True, tts_params="lora"), asynchronous=False)
    assert isinstance(tts, SGLangDFlashTTS) and tts.mask_token_id == MASK
    weights = tts.student.weights
    assert weights.get(tts.student.module, "embed.weight").data_ptr() == embed.weight.data_ptr()
    assert weights.get(tts.student.module, "lm_head.weight").data_ptr() == head.weight.data_ptr()
    trained = {n for n, p in tts.student.module.named_parameters() if tts.student.trainable(n, p)}
    assert trained and all(n.startswith(("lora_a__", "lora_b__")) for n in trained)
    tts.student.refresh()  # merges (B = 0: unchanged) and the fused-KV refresh finds no helper
