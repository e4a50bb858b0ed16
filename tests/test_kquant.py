"""A GGUF file's own blocks on the native forward (Q4_K, Q6_K, Q5_0 read as Q8_0, Q8_0, Q4_1), on synthetic blocks
written by the tests: de-quantisation equal bit for bit to the ``gguf`` package's reference (PyTorch and C++), the
integer kernels on every instruction set against the float64 law with 8-bit activations (and bit-equal to each
other), the extreme codes without overflow, a model whose fused q/k/v and gate/up mix formats against the
PyTorch reference path and transformers on its de-quantised weights, a GGUF file round trip through the derived
cache, and the sampled law of a K-quant target (chi-square against its exact joint)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from specadapt import kernels
from specadapt.engine.native import SlotKVCache
from specadapt.engine.native import model as native_model
from specadapt.engine.native.formats import PackedWeight, WeightFormat, linear_reference
from specadapt.engine.native.gguf_blocks import (
    BLOCK_TYPES, GGUFModel, UnsupportedBlockType, decode_tensor, load_gguf_model_cached, read_gguf_model,
)
from specadapt.engine.native.model import NativeLlama, NativeUnsupported
from tests.test_native_forward import _on_every_isa

HAS_KERNELS = kernels.has_op_for("native_llama_forward", torch.device("cpu"))
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="specadapt._C built without the native kernels")
TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"]


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Valid random GGUF blocks ``[rows * blocks * block_bytes] uint8`` of ``kind``: random codes and
    sub-block scales, float16 super-block scales of about ``scale * 1e-3`` (so weights stay small)."""
    _, block_bytes, per = BLOCK_TYPES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per, block_bytes), dtype=np.uint8)

    def put_f16(offset: int, magnitude: float, signed: bool = False):
        v = (rng.uniform(0.5, 1.5, size=raw.shape[:2]) * magnitude).astype(np.float16)
        if signed:
            v = np.where(rng.random(raw.shape[:2]) < 0.5, -v, v).astype(np.float16)
        raw[:, :, offset:offset + 2] = v.view(np.uint8).reshape(*raw.shape[:2], 2)

    if kind == "Q4_K":
        put_f16(0, 2e-4 * scale)
        put_f16(2, 2e-4 * scale)
    elif kind == "Q6_K":
        put_f16(208, 5e-4 * scale)
    elif kind == "Q4_1":
        put_f16(0, 1e-2 * scale)
        put_f16(2, 5e-2 * scale, signed=True)
    else:  # Q5_0, Q8_0: d first
        put_f16(0, (1e-2 if kind == "Q5_0" else 2e-3) * scale, signed=True)
    return raw.reshape(-1)


def reference(kind: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return gguf_dequantize(raw, getattr(QT, kind)).reshape(rows, cols).astype(np.float32)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [16, 37])
def test_dequantisation_equals_the_gguf_reference_bit_for_bit(kind, rows):
    cols = 512
    raw = random_blocks(kind, rows, cols, seed=rows)
    weight = decode_tensor(kind, raw, rows, cols)
    assert weight.format == BLOCK_TYPES[kind][0] and weight.rows == rows and weight.cols == cols
    want = reference(kind, raw, rows, cols)
    assert np.array_equal(weight.dequantize().numpy().view(np.uint32), want.view(np.uint32))
    if HAS_KERNELS:
        got = torch.ops.specadapt.native_dequantize(*weight.tensors(), int(weight.format), weight.rows).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        ids = torch.tensor([0, rows - 1, 3], dtype=torch.int64)
        rows_got = torch.ops.specadapt.native_embedding(ids, *weight.tensors(), int(weight.format), weight.rows)
        assert torch.equal(rows_got, torch.from_numpy(want)[ids])


@pytest.mark.parametrize("fmt", [WeightFormat.Q4_K, WeightFormat.Q6_K])
def test_kquant_parts_round_trip_and_select_rows(fmt):
    kind = fmt.name
    raw = random_blocks(kind, 40, 256, seed=5)
    weight = decode_tensor(kind, raw, 40, 256)
    again = PackedWeight.from_kquant(fmt, **weight.kquant_parts())
    for a, b in zip(weight.tensors(), again.tensors()):
        assert torch.equal(a, b)
    pick = torch.tensor([3, 39, 0, 17])
    assert torch.equal(weight.select_rows(pick).dequantize(), weight.dequantize()[pick])


@pytest.mark.parametrize("fmt", [WeightFormat.Q4_K, WeightFormat.Q6_K, WeightFormat.Q8_0, WeightFormat.Q4_1])
@pytest.mark.parametrize("chunk_groups", [1, 2, 256])
def test_select_rows_across_group_chunks(fmt, chunk_groups):
    """Rows in any order, with repeats, from several 16-row groups (a padded last one included), unpacked a few
    groups at a time: the same matrix rows as de-quantising everything and indexing it."""
    rows, cols = 77, 256
    if fmt.is_k:
        weight = decode_tensor(fmt.name, random_blocks(fmt.name, rows, cols, seed=11), rows, cols)
    else:
        from specadapt.engine.native.formats import pack_weight

        weight = pack_weight(torch.randn(rows, cols, generator=torch.Generator().manual_seed(11)), fmt)
    pick = torch.tensor([76, 3, 40, 3, 0, 15, 16, 64, 75, 31, 76])
    got = weight.select_rows(pick, chunk_groups=chunk_groups)
    assert got.format == fmt and got.rows == pick.numel()
    assert torch.equal(got.dequantize(), weight.dequantize()[pick])
    assert weight.select_rows(torch.tensor([], dtype=torch.int64)).rows == 0
    with pytest.raises(IndexError, match="rows must lie in"):
        weight.select_rows(torch.tensor([rows]))


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 9])
def test_kquant_kernels_on_every_instruction_set_match_the_law(kind, M):
    """Each ISA path against the float64 law (8-bit activations, exact weights), and all paths bit-equal (the
    integer sums are exact and each path does the same float operations in the same order)."""
    rows, cols = 45, 768  # a padded last group, three super-blocks
    weight = decode_tensor(kind, random_blocks(kind, rows, cols, seed=M), rows, cols)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M))
    want = linear_reference(x, weight)
    got = _on_every_isa(lambda: torch.ops.specadapt.native_linear(x, *weight.tensors(), int(weight.format), rows))
    assert len(got) >= 1
    for isa, y in got.items():
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=isa)
        assert torch.equal(y, got["scalar"]), f"{isa} differs from the portable path"


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_extreme_codes_and_activations_do_not_overflow(kind):
    """Every code at its maximum against activations that quantise to +-127: the integer sums stay exact
    (AVX2's vpmaddubsw pairs reach 2 * 63 * 127 for Q6_K)."""
    rows, cols = 16, 256
    raw = random_blocks(kind, rows, cols).reshape(rows, 1, -1)
    if kind == "Q4_K":
        raw[:, :, 4:16] = 0xFF  # every 6-bit sc and m at 63
        raw[:, :, 16:] = 0xFF  # every code 15
    else:
        raw[:, :, 0:192] = 0xFF  # every code 63
        raw[:, :, 192:208] = np.int8(127).view(np.uint8)
    weight = decode_tensor(kind, raw.reshape(-1), rows, cols)
    x = torch.full((3, cols), 2.0)
    x[1] = -2.0
    x[2, ::2] = -2.0
    want = linear_reference(x, weight)
    for isa, y in _on_every_isa(lambda: torch.ops.specadapt.native_linear(x, *weight.tensors(), int(weight.format),
                                                                           rows)).items():
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(), msg=isa)


def test_unknown_block_types_are_refused_by_name():
    with pytest.raises(UnsupportedBlockType, match="Q3_K"):
        decode_tensor("Q3_K", np.zeros(110, np.uint8), 1, 256)
    with pytest.raises(ValueError, match="divisible by 256"):
        decode_tensor("Q4_K", np.zeros(144, np.uint8), 1, 128)
    with pytest.raises(ValueError, match="bytes do not hold"):
        decode_tensor("Q6_K", np.zeros(100, np.uint8), 1, 256)


# ---- a whole model in K-quant blocks ----------------------------------------------------------------------------
#: per layer: (q, k, v, o, gate, up, down) GGUF types; layer 0 mixes formats inside q/k/v and gate/up
LAYER_TYPES = [("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"),
               ("Q4_K", "Q4_K", "Q4_K", "Q5_0", "Q8_0", "Q8_0", "Q4_K")]
_NAMES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj"]


def kquant_model(vocab: int = 48, seed: int = 0, scale: float = 1.0):
    """``(hf_model, GGUFModel)``: a tiny Qwen2 (hidden 256, 4 heads of 64 over 2 kv heads, 2 layers) whose every
    matrix is random GGUF blocks (:data:`LAYER_TYPES`, a Q4_K embedding, a Q6_K LM head) and whose transformers
    copy holds their exact de-quantisation."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=256,
                                      num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                                      rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).eval()
    read = GGUFModel(architecture="qwen2")
    params = dict(model.named_parameters())
    counter = [seed]

    def put(name: str, kind: str, rows: int, cols: int, mult: float = 1.0):
        counter[0] += 1
        weight = decode_tensor(kind, random_blocks(kind, rows, cols, seed=counter[0], scale=scale * mult), rows, cols)
        read.matrices[name] = weight
        read.types[name] = kind
        with torch.no_grad():
            params[name].copy_(weight.dequantize())

    put("model.embed_tokens.weight", "Q4_K", vocab, 256, 20.0)
    put("lm_head.weight", "Q6_K", vocab, 256, 4.0)
    for i, kinds in enumerate(LAYER_TYPES):
        for part, kind in zip(_NAMES, kinds):
            p = params[f"model.layers.{i}.{part}.weight"]
            put(f"model.layers.{i}.{part}.weight", kind, p.shape[0], p.shape[1])
    with torch.no_grad():
        for name, p in params.items():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            if p.dim() == 1:
                read.vectors[name] = p.detach().float().clone()
    model.requires_grad_(False)
    return model, read


def native_of(model, read, kv="float32") -> NativeLlama:
    return NativeLlama.from_gguf_model(read, model.config, model.model.rotary_emb, kv_dtype=kv)


def test_mixed_format_layers_are_kept_as_parts():
    model, read = kquant_model()
    native = native_of(model, read)
    assert isinstance(native.layers[0].qkv, list) and [w.format.name for w in native.layers[0].qkv] == \
        ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(native.layers[0].gate_up, list)
    assert native.layers[1].qkv.format == WeightFormat.Q4_K and native.layers[1].gate_up.format == WeightFormat.Q8_0
    assert native.layers[0].formats() == [4, 4, 5, 4, 4, 5, 5]
    assert native.layers[1].formats() == [4, -1, -1, 2, 2, -1, 4]
    assert native.lm_head.format == WeightFormat.Q6_K and native.dtype_name == "gguf"


@needs_kernels
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_kquant_model_kernels_match_the_reference_path(kv, monkeypatch):
    model, read = kquant_model()
    native = native_of(model, read, kv)
    prompts = torch.tensor([[5, 6, 7, 8, 9, 1, 2], [10, 11, 0, 0, 0, 0, 0]])
    counts = torch.tensor([7, 2])
    step, ones = torch.tensor([[12], [13]]), torch.ones(2, dtype=torch.int64)
    kern = SlotKVCache(native, 2, 16)
    got = [kern.forward(prompts, counts), kern.forward(step, ones)]
    monkeypatch.setattr(native_model, "_use_kernels", lambda device: False)
    ref = SlotKVCache(native, 2, 16)
    want = [ref.forward(prompts, counts), ref.forward(step, ones)]
    for g, w, c in zip(got, want, (counts, ones)):
        for r, n in enumerate(c.tolist()):
            # float32 sums in another order than the reference's: relative to the logits' size
            torch.testing.assert_close(g[r, :n], w[r, :n], atol=1e-5 * w.abs().max().item(), rtol=1e-4)


@needs_kernels
def test_kquant_model_is_close_to_transformers_on_its_dequantised_weights():
    """The only rounding against the float32 model of the same weights is the 8-bit activation rounding."""
    model, read = kquant_model(scale=0.05)  # logits of a few units, like a trained model's
    native = native_of(model, read)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 35, 1, 7, 22, 40]])
    ours = SlotKVCache(native, 1, 16).forward(ids, torch.tensor([12]))[0]
    with torch.no_grad():
        theirs = model(input_ids=ids).logits[0]
    float_native = NativeLlama.from_hf(model, "float32")  # the same weights, float32 activations
    exact = SlotKVCache(float_native, 1, 16).forward(ids, torch.tensor([12]))[0]
    torch.testing.assert_close(exact, theirs, atol=1e-4, rtol=0)
    p, q = torch.softmax(ours, -1), torch.softmax(theirs, -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert 0 < tv.max() < 0.03, tv  # the activations' 8-bit rounding, and nothing else
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


@needs_kernels
def test_a_requests_logits_do_not_depend_on_its_batch_in_kquant_blocks():
    model, read = kquant_model()
    native = native_of(model, read, "float16")
    prompt, chunk = [5, 9, 2, 7, 1, 1, 8], [3, 4, 6]
    alone = SlotKVCache(native, 1, 32)
    alone.forward(torch.tensor([prompt]), torch.tensor([7]))
    want = alone.forward(torch.tensor([chunk]), torch.tensor([3]))[0]
    batch = SlotKVCache(native, 3, 32)
    ids = torch.tensor([[1, 2, 3, 0, 0, 0, 0], prompt, [4] * 7])
    batch.forward(ids, torch.tensor([3, 7, 7]))
    got = batch.forward(torch.tensor([[1, 0, 0], chunk, [2, 3, 4]]), torch.tensor([1, 3, 3]))[1]
    assert torch.equal(got, want)


def test_an_unsupported_block_type_in_a_file_is_named():
    model, read = kquant_model()
    read.unsupported["model.layers.0.mlp.down_proj.weight"] = "Q3_K"
    with pytest.raises(NativeUnsupported, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*Q3_K"):
        native_of(model, read)


# ---- a GGUF file round trip ------------------------------------------------------------------------------------
def _raw_tensors(seed=0):
    """``{gguf name: (kind, raw bytes, rows, cols)}`` for a one-layer Qwen2-shaped file, plus float vectors."""
    shapes = {"token_embd.weight": ("Q4_K", 40, 256), "output.weight": ("Q6_K", 40, 256),
              "blk.0.attn_q.weight": ("Q4_K", 256, 256), "blk.0.attn_k.weight": ("Q4_K", 128, 256),
              "blk.0.attn_v.weight": ("Q6_K", 128, 256), "blk.0.attn_output.weight": ("Q5_0", 256, 256),
              "blk.0.ffn_gate.weight": ("Q4_K", 256, 256), "blk.0.ffn_up.weight": ("Q8_0", 256, 256),
              "blk.0.ffn_down.weight": ("Q6_K", 256, 256)}
    return {name: (kind, random_blocks(kind, rows, cols, seed=seed + i), rows, cols)
            for i, (name, (kind, rows, cols)) in enumerate(shapes.items())}


def test_a_gguf_file_reads_through_the_index_and_the_block_cache(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("SPECADAPT_CACHE", str(tmp_path / "cache"))
    tensors = _raw_tensors()
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    for name, (kind, raw, rows, cols) in tensors.items():
        _, block_bytes, per = BLOCK_TYPES[kind]
        writer.add_tensor(name, raw.reshape(rows, cols // per * block_bytes), raw_dtype=getattr(QT, kind))
    norm = np.linspace(0.5, 1.5, 256, dtype=np.float32)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    direct = read_gguf_model(path, 4, 2)
    assert direct.architecture == "qwen2" and not direct.unsupported
    assert torch.equal(direct.vectors["model.layers.0.input_layernorm.weight"], torch.from_numpy(norm))
    for name, (kind, raw, rows, cols) in tensors.items():
        hf = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}.get(name)
        if hf is None:
            part = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}[name.split(".")[2]]
            hf = f"model.layers.0.{part}.weight"
        got = direct.matrices[hf].dequantize().numpy()
        assert np.array_equal(got.view(np.uint32), reference(kind, raw, rows, cols).view(np.uint32)), name

    first = load_gguf_model_cached(path, 4, 2)  # decodes and writes the cache
    assert any((tmp_path / "cache" / "derived").glob("*/blocks/index.json"))
    second = load_gguf_model_cached(path, 4, 2)  # reads it back
    third = load_gguf_model_cached(path, 4, 2, layers=0)
    assert set(second.matrices) == set(direct.matrices) and second.types == direct.types
    for name, w in direct.matrices.items():
        for got in (first.matrices[name], second.matrices[name]):
            assert got.format == w.format and got.rows == w.rows
            for a, b in zip(got.tensors(), w.tensors()):
                assert (a is None and b is None) or torch.equal(a, b)
    assert not any(n.startswith("model.layers.") for n in third.matrices)


# ---- the sampled law of a K-quant target ------------------------------------------------------------------------
class _NativeAsModel:
    """``model(input_ids=...)`` -> ``.logits`` of a native model (a fresh cache per call), for the exact joint."""

    def __init__(self, native: NativeLlama, config) -> None:
        self.native, self.config = native, config

    def __call__(self, input_ids):
        n = input_ids.shape[1]
        return SimpleNamespace(logits=SlotKVCache(self.native, 1, n + 1).forward(input_ids, torch.tensor([n])))


@needs_kernels
@pytest.mark.parametrize("rule,kind", [("chain", "ngram"), ("block", "self:1")])
def test_sampled_output_follows_the_kquant_targets_law(rule, kind):
    """Chi-square of the first two emitted tokens over 3000 requests against the exact joint law of the K-quant
    target itself (its native forward, 8-bit activations included), at T = 1 with top-p."""
    from tests.helpers.engine import _exact_joint, assert_first_tokens_follow
    from tests.helpers.models import loaded
    from specadapt.engine import SpeculativeEngine
    from specadapt.engine.drafts import ModelDraft, NgramDraft
    from specadapt.sampling import SamplingParams

    model, read = kquant_model(vocab=8, seed=4, scale=0.05)
    target = loaded(model)
    target.native = native_of(model, read, "float16")
    params = SamplingParams(1.0, top_p=0.95)
    prompt = [3, 5, 3, 3, 5]  # the n-gram proposal (3) has target probability 0.21 here
    if kind == "ngram":
        draft = NgramDraft()
    else:
        module, sub = kquant_model(vocab=8, seed=4, scale=0.05)
        sub.matrices = {k: v for k, v in sub.matrices.items() if not k.startswith("model.layers.1.")}
        module.config.num_hidden_layers = 1
        draft = ModelDraft(module, params, 2, name="self:1",
                           native=NativeLlama.from_gguf_model(sub, module.config, module.model.rotary_emb, layers=1,
                                                              kv_dtype="float16"))
    engine = SpeculativeEngine(target, draft, params, 2, rule, seed=3)
    n_req = 3000
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results), "the draft never helped: the test would be vacuous"
    joint = _exact_joint(_NativeAsModel(target.native, model.config), prompt, params, 2)
    assert_first_tokens_follow(results, joint, n_req)
