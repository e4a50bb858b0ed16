"""TTS students of the SGLang plugin without sglang: the STANDALONE dense-LM student against transformers'
own forward (weights fused into SGLang's layout), LoRA adapters merged into the serving tensors at publishes,
and TTS rounds of a STANDALONE draft (no target features) through the plugin's hooks.

The same students on SGLang's real model classes (weights loaded by SGLang's own ``load_weights``) are tested
in tests_sglang/test_sglang_students.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specadapt.sglang.config import PluginConfig, PluginConfigError, validate_for_server
from specadapt.sglang import state as plugin_state
from specadapt.sglang.hooks import eagle_sample_around, forward_batch_generation_around
from specadapt.sglang.state import PluginState, VerifyRuntime
from specadapt.sglang.students import DenseLMStudent, Eagle3LlamaStudent, build_student
from specadapt.sglang.tts import SGLangTTS
from tests.helpers.sglang import _hf, _sglang_layout, distil_rounds


def _layer(draft, i):
    return getattr(draft.model.layers, str(i))


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", False), ("qwen3", False), ("qwen3", True)])
def test_dense_student_equals_transformers_forward(family, tied):
    hf = _hf(family, tied)
    draft = _sglang_layout(hf, family)
    student = build_student(draft, draft.config)
    assert isinstance(student, DenseLMStudent) and not student.uses_features and student.tied == tied
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(50, (3, 9), generator=g)
    lengths = torch.tensor([9, 6, 3])
    mask = torch.arange(9)[None] < lengths[:, None]
    with torch.no_grad():
        ours = student.logits(student.module, None, tokens, mask)
        for b in range(3):
            n = int(lengths[b])
            ref = hf(tokens[b:b + 1, :n]).logits[0]
            assert torch.allclose(ours[b, :n], ref, atol=2e-5), (family, b, (ours[b, :n] - ref).abs().max())
    assert ours.shape == (3, 9, 50) and torch.isfinite(ours).all()
    # every tensor aliases the serving module's storage
    for name, p in draft.named_parameters():
        assert student.weights.get(student.module, name).data_ptr() == p.data_ptr()
    # full-parameter training: the decoder layers, never the embedding / final norm / LM head
    trainable = {n for n, p in student.module.named_parameters() if student.trainable(n, p)}
    assert trainable and all(n.startswith("model__layers__") for n in trainable)
    assert "model__layers__0__self_attn__qkv_proj__weight" in trainable


def test_dense_student_rejects_what_it_cannot_train():
    hf = _hf("llama")
    draft = _sglang_layout(hf, "llama")
    _layer(draft, 0).mlp.add_module("experts", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="does not know the draft parameter.*experts"):
        build_student(draft, draft.config)
    draft = _sglang_layout(hf, "llama")
    with pytest.raises(ValueError, match="hidden_act"):
        DenseLMStudent(draft, SimpleNamespace(**{**draft.config.to_dict(), "hidden_act": "gelu"}))
    sharded = _sglang_layout(hf, "llama")
    w = _layer(sharded, 0).self_attn.qkv_proj.weight
    _layer(sharded, 0).self_attn.qkv_proj.weight = nn.Parameter(w[: w.shape[0] // 2].clone())
    with pytest.raises(ValueError, match="expected .* on each of 1 tensor-parallel"):
        build_student(sharded, sharded.config)
    other = type("GemmaForCausalLM", (nn.Module,), {})()
    with pytest.raises(ValueError, match="no training forward for the draft architecture GemmaForCausalLM"):
        build_student(other, None)


@pytest.mark.parametrize("kind", ["standalone", "eagle3"])
def test_lora_publish_merges_adapters_into_the_serving_weights(kind):
    if kind == "standalone":
        draft = _sglang_layout(_hf("qwen2"), "qwen2")
        student = build_student(draft, draft.config, "lora", 4)
        args = (None, torch.randint(50, (2, 7)), torch.ones(2, 7, dtype=torch.bool))
    else:
        from tests.helpers.sglang import _Eagle3StandIn

        draft = _Eagle3StandIn()
        student = build_student(draft, draft.config, "lora", 4)
        assert isinstance(student, Eagle3LlamaStudent)
        args = (torch.randn(2, 7, 48), torch.randint(40, (2, 7)), torch.ones(2, 7, dtype=torch.bool))
    weights = student.weights
    serving = dict(draft.named_parameters())
    before = {n: p.detach().clone() for n, p in serving.items()}
    trainable = [n for n, p in student.module.named_parameters() if student.trainable(n, p)]
    assert trainable and all(n.startswith(("lora_a__", "lora_b__")) for n in trainable)
    assert len(trainable) == 2 * len(weights.adapted)
    with torch.no_grad():
        start = student.logits(student.module, *args)
        student.refresh()  # B = 0: merging changes nothing
    assert all(torch.equal(serving[n], before[n]) for n in serving)
    # a trained adapter: the LoRA forward moves, and refresh writes W0 + B A into exactly the adapted tensors
    with torch.no_grad():
        for name, p in student.module.named_parameters():
            if name.startswith("lora_b__"):
                p.normal_(0, 0.05)
        adapted_out = student.logits(student.module, *args)
    assert not torch.allclose(adapted_out, start, atol=1e-4)
    ptrs = {n: p.data_ptr() for n, p in serving.items()}
    student.refresh()
    assert {n: p.data_ptr() for n, p in serving.items()} == ptrs  # in place: captured graphs see the merge
    for name in serving:
        if name in weights.adapted:
            key = name.replace(".", "__")
            a = getattr(student.module, "lora_a__" + key)
            b = getattr(student.module, "lora_b__" + key)
            assert torch.allclose(serving[name], before[name] + b @ a, atol=1e-6)
        else:
            assert torch.equal(serving[name], before[name])
    # the serving draft now computes what the adapted student computed: a full-parameter student over the
    # merged tensors gives the same logits
    merged = build_student(draft, draft.config, "full")
    with torch.no_grad():
        assert torch.allclose(merged.logits(merged.module, *args), adapted_out, atol=1e-4)
    # zero adapters (what a rollback restores) merge back to the original weights
    with torch.no_grad():
        for name, p in student.module.named_parameters():
            if name.startswith("lora_b__"):
                p.zero_()
    student.refresh()
    assert all(torch.equal(serving[n], before[n]) for n in serving)
    assert weights.nbytes_added() > 0


class _Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_idle(self):
        return False

    def is_extend(self):
        return self.kind == "extend"


@pytest.mark.parametrize("params", ["full", "lora"])
def test_standalone_tts_rounds_publish_in_place_without_target_features(params):
    """STANDALONE: the target verify has no hidden states; the hooks still snapshot, train and publish (LoRA:
    merged into the serving weights), every `stride` rounds, in place."""
    draft = _sglang_layout(_hf("llama"), "llama")
    student = build_student(draft, draft.config, params, 4)
    stride = 2
    cfg = PluginConfig(tts=True, tts_stride=stride, tts_lr=1e-2, tts_rollback_margin=1.0, tts_params=params,
                       tts_lora_rank=4)
    tts = SGLangTTS(student, cfg, asynchronous=False)
    plugin_state.install(PluginState(config=cfg, runtime=VerifyRuntime(), tts=tts, algorithm="STANDALONE"))
    layer_w = _layer(draft, 1).mlp.down_proj.weight
    embed_before = draft.model.embed_tokens.weight.clone()
    ptr = layer_w.data_ptr()
    seen = [layer_w.detach().clone()]
    g = torch.Generator().manual_seed(4)
    batch, slots, vocab = 2, 4, 50
    try:
        for _ in range(3 * stride + 1):
            forward_batch_generation_around(lambda w, b: None, None, SimpleNamespace(
                forward_mode=_Mode("decode"), is_extend_in_batch=False))
            seen.append(layer_w.detach().clone())
            verify_input = SimpleNamespace(draft_token=torch.randint(vocab, (batch * slots,), generator=g),
                                           draft_probs=None)
            logits_output = SimpleNamespace(next_token_logits=torch.randn(batch * slots, vocab, generator=g) * 3,
                                            hidden_states=None)
            b = SimpleNamespace(forward_mode=_Mode("decode"), reqs=[SimpleNamespace(rid=f"r{i}") for i in range(batch)],
                                sampling_info=SimpleNamespace(temperatures=torch.ones(batch, 1)))
            eagle_sample_around(lambda vi, bb, lo: (None, torch.tensor([3, 1]), None), verify_input, b, logits_output)
            ex = tts._pending[-1]
            assert ex.features.shape[-1] == 0 and ex.teacher.shape == (slots - 1, vocab) and ex.proximal is None
        assert tts.updater.stats.publishes >= 2 and tts.updater.stats.updates >= 2
        assert layer_w.data_ptr() == ptr
        changes = [not torch.equal(seen[i], seen[i + 1]) for i in range(len(seen) - 1)]
        assert any(changes) and not all(changes)  # weights move only at publishes
        assert torch.equal(draft.model.embed_tokens.weight, embed_before)
    finally:
        plugin_state.reset()


@pytest.mark.parametrize("params", ["full", "lora"])
def test_standalone_tts_distils_toward_the_target(params):
    """The target is the draft with perturbed layers (a draft falling out of step): updates through the plugin's
    snapshot / record / round hooks bring the KL to it down by an order of magnitude."""
    torch.manual_seed(0)
    hf = _hf("qwen3")
    draft = _sglang_layout(hf, "qwen3")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layers" in name:
                p.add_(torch.randn_like(p) * 0.05)
    tokens = torch.randint(50, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        target_logits = hf(tokens).logits.reshape(10, 50)
    student = build_student(draft, draft.config, params, 8)
    tts = SGLangTTS(student, PluginConfig(tts=True, tts_stride=1, tts_lr=1e-2, tts_rollback_margin=1.0,
                                          tts_params=params, tts_lora_rank=8), asynchronous=False)
    losses = distil_rounds(tts, lambda: tts.snapshot(["a", "b"], tokens, None, target_logits, torch.ones(2)),
                           [4, 4], rounds=20)
    assert tts.updater.stats.updates >= 19
    assert losses[-1] < 0.1 * losses[0], losses
    # what the serving draft computes moved toward the target too (the publishes reached its tensors)
    mask = torch.ones(2, 5, dtype=torch.bool)
    served = build_student(draft, draft.config, "full")
    fresh = _sglang_layout(_hf("qwen3"), "qwen3")  # the draft before adaptation (same seed)
    original = build_student(fresh, fresh.config)
    with torch.no_grad():
        now = torch.log_softmax(served.logits(served.module, None, tokens, mask), -1)
        start = torch.log_softmax(original.logits(original.module, None, tokens, mask), -1)
    target = torch.softmax(target_logits.reshape(2, 5, 50), -1)
    kl = lambda log_q: float((target * (target.clamp_min(1e-30).log() - log_q)).sum(-1)[:, 1:4].mean())  # noqa: E731
    assert kl(now) < 0.3 * kl(start)


def test_snapshot_trims_a_padded_target_vocabulary():
    draft = _sglang_layout(_hf("llama"), "llama")
    student = build_student(draft, draft.config)
    tts = SGLangTTS(student, PluginConfig(tts=True), asynchronous=False)
    logits = torch.randn(2 * 3, 64)  # target logits wider than the draft's 50 ids
    snap = tts.snapshot(["a", "b"], torch.randint(50, (6,)), None, logits, torch.ones(2))
    assert snap["teacher"].shape == (2, 3, 50)
    assert torch.allclose(snap["teacher"].sum(-1), torch.ones(2, 3))
    assert torch.allclose(snap["teacher"], torch.softmax(logits.reshape(2, 3, 64)[..., :50], -1), atol=1e-6)
    with pytest.raises(ValueError, match="fewer than the draft's vocabulary"):
        tts.snapshot(["a", "b"], torch.randint(50, (6,)), None, torch.randn(6, 40), torch.ones(2))


def test_tts_flags_allow_standalone_dflash_and_lora_and_refuse_ngram():
    server = SimpleNamespace(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d",
                             speculative_eagle_topk=1, device="cuda")
    validate_for_server(PluginConfig(tts=True, tts_params="lora"), server)
    server.speculative_algorithm = "DFLASH"
    validate_for_server(PluginConfig(tts=True), server)
    server.speculative_algorithm = "NGRAM"
    with pytest.raises(PluginConfigError, match="--tts trains a draft model.*NGRAM"):
        validate_for_server(PluginConfig(tts=True), server)


# ---- tensor parallelism -----------------------------------------------------------------------------------------
from specadapt.sglang.students import Layout, TensorParallel  # noqa: E402
from specadapt.sglang.students.sharding import shard, unshard  # noqa: E402


@pytest.mark.parametrize("heads, kv_heads, size", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (4, 4, 2), (8, 8, 4)])
def test_qkv_shards_follow_sglangs_head_split_and_round_trip(heads, kv_heads, size):
    d = 3
    full = torch.arange((heads + 2 * kv_heads) * d * 2, dtype=torch.float32).reshape(-1, 2)
    layout = Layout("qkv", heads=heads, kv_heads=kv_heads, head_dim=d)
    shards = [shard(layout, full, r, size) for r in range(size)]
    q_per, kv_per = heads // size, max(kv_heads // size, 1)
    for r, s in enumerate(shards):
        assert s.shape[0] == layout.shard_rows(size) == (q_per + 2 * kv_per) * d
        assert torch.equal(s[: q_per * d], full[r * q_per * d:(r + 1) * q_per * d])  # its query heads
        owner = r // max(size // kv_heads, 1)  # replicated key/value heads when size > kv_heads
        k0 = heads * d + owner * kv_per * d
        assert torch.equal(s[q_per * d: q_per * d + kv_per * d], full[k0: k0 + kv_per * d])
    assert torch.equal(unshard(layout, shards, size), full)


@pytest.mark.parametrize("kind", ["rows", "cols", "merged", "replicated"])
def test_other_layouts_round_trip(kind):
    full = torch.randn(8, 6)
    layout = Layout(kind)
    shards = [shard(layout, full, r, 2) for r in range(2)]
    if kind == "merged":  # [gate_r; up_r]
        assert torch.equal(shards[1], torch.cat([full[2:4], full[6:8]]))
    assert torch.equal(unshard(layout, shards, 2), full)
    with pytest.raises(ValueError, match="do not split"):
        Layout("qkv", heads=3, kv_heads=1, head_dim=2).shard_rows(2)


def _tp_drafts(family="qwen2", size=2):
    """``size`` rank-local drafts holding SGLang-layout shards of one model, and gathers across them."""
    hf = _hf(family)
    full = _sglang_layout(hf, family)
    cfg = full.config
    d = cfg.hidden_size // cfg.num_attention_heads if family != "qwen3" else cfg.head_dim
    qkv = Layout("qkv", heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=d)
    layouts = {"model.embed_tokens.weight": Layout("rows"), "lm_head.weight": Layout("rows")}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        layouts.update({pre + "self_attn.qkv_proj.weight": qkv, pre + "self_attn.qkv_proj.bias": qkv,
                        pre + "self_attn.o_proj.weight": Layout("cols"), pre + "mlp.gate_up_proj.weight": Layout("merged"),
                        pre + "mlp.down_proj.weight": Layout("cols")})
    drafts = []
    for r in range(size):
        draft = _sglang_layout(hf, family)
        for name, p in draft.named_parameters():
            p.data = shard(layouts.get(name, Layout()), p.data, r, size).clone()
        drafts.append(draft)
    by_name = [dict(d.named_parameters()) for d in drafts]
    return hf, drafts, by_name, layouts


def test_tensor_parallel_students_gather_train_and_publish_their_own_shards():
    size = 2
    hf, drafts, by_name, layouts = _tp_drafts("qwen2", size)
    students = []

    def broadcast_from_rank0(tensor):  # what the TP group's broadcast does to a module tensor of any rank
        for name, p in students[1].module.named_parameters():
            if p.data_ptr() == tensor.data_ptr():
                tensor.copy_(dict(students[0].module.named_parameters())[name].data)

    for r in range(size):
        names = {p.data_ptr(): n for n, p in by_name[r].items()}
        tp = TensorParallel(rank=r, size=size, gather=lambda t, names=names: [by_name[q][names[t.data_ptr()]].data
                                                                               for q in range(size)],
                            broadcast=broadcast_from_rank0)
        students.append(build_student(drafts[r], drafts[r].config, "lora", 4, tp=tp))
    tokens = torch.randint(50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        ref = hf(tokens).logits
        for st in students:
            assert torch.allclose(st.logits(st.module, None, tokens, mask), ref, atol=2e-5)
    # the ranks' replicas differ slightly (floating point); a publish serves rank 0's everywhere
    with torch.no_grad():
        for st in students:
            for name, p in st.module.named_parameters():
                if name.startswith("lora_b__"):
                    p.normal_(0, 0.05)
        adapted = students[0].logits(students[0].module, None, tokens, mask)
    ptrs = [{n: p.data_ptr() for n, p in b.items()} for b in by_name]
    for st in students:
        st.refresh()
    assert [{n: p.data_ptr() for n, p in b.items()} for b in by_name] == ptrs  # in place
    # each rank's served shards now hold its slice of the merged weights: a fresh student over them computes
    # the adapted logits
    names0 = {p.data_ptr(): n for n, p in by_name[0].items()}
    fresh = build_student(drafts[0], drafts[0].config, "full", tp=TensorParallel(
        0, size, lambda t: [by_name[q][names0[t.data_ptr()]].data for q in range(size)]))
    with torch.no_grad():
        assert torch.allclose(fresh.logits(fresh.module, None, tokens, mask), adapted, atol=1e-4)
    # full-parameter training at TP 2: trained full replicas, shards written back at refresh
    full_student = fresh
    w = full_student.weights.get(full_student.module, "model.layers.0.mlp.down_proj.weight")
    with torch.no_grad():
        w.add_(1.0)
    full_student.refresh()
    assert torch.equal(by_name[0]["model.layers.0.mlp.down_proj.weight"].data, shard(Layout("cols"), w, 0, size))
    assert "model.layers.0.mlp.down_proj.weight" in full_student.weights.trained
    assert "model.embed_tokens.weight" not in full_student.weights.trained
