"""The native forward on the real embedded default (SmolLM2-135M-Instruct, the GGUF's own Q8_0 / Q4_1 blocks):
float32 logits equal transformers', the int4 model is the file's weights, and greedy speculative output equals
target-only greedy output in the default format for every draft and rule."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.models import _prompts
from specadapt import kernels
from specadapt.engine import ModelDraft, NgramDraft, NoDraft, SpeculativeEngine, build_draft
from specadapt.engine.kv import RaggedKVCache
from specadapt.engine.models import attach_forward
from specadapt.engine.native import NativeLlama, SlotKVCache
from specadapt.sampling import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow,
              pytest.mark.skipif(not kernels.has_op_for("native_llama_forward", torch.device("cpu")),
                                 reason="specadapt._C built without the native kernels")]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def int4_target(smollm2):
    target = copy.copy(smollm2)  # the same transformers model, its own forward attachment
    assert attach_forward(target, "auto", "auto") == "int4"  # --dtype auto on the Q4_1 file
    return target


def test_float32_native_logits_equal_transformers(smollm2):
    native = NativeLlama.from_hf(smollm2.model, "float32")
    prompt = _prompts(smollm2, 1)[0]
    ids, counts = torch.tensor([prompt]), torch.tensor([len(prompt)])
    hf, ours = RaggedKVCache(smollm2.model, 1), SlotKVCache(native, 1, len(prompt) + 16)
    torch.testing.assert_close(ours.forward(ids, counts), hf.forward(ids, counts), atol=1e-4, rtol=0)
    chunk, width = torch.tensor([[28, 3, 11, 9, 201, 7]]), torch.tensor([6])
    torch.testing.assert_close(ours.forward(chunk, width), hf.forward(chunk, width), atol=1e-4, rtol=0)


def test_int4_model_is_the_files_blocks(smollm2, int4_target):
    native = int4_target.native
    assert native.source.startswith("211 matrices from")  # 30 layers x 7 Q4_1 matrices + the Q8_0 embedding
    layer = smollm2.model.model.layers[7]
    qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    assert torch.equal(native.layers[7].qkv.dequantize(), qkv)
    assert torch.equal(native.embed.dequantize(), smollm2.model.model.embed_tokens.weight)
    # the only rounding that differs from the de-quantised float32 model is the 8-bit activations
    prompt = _prompts(smollm2, 1)[0]
    ids, counts = torch.tensor([prompt]), torch.tensor([len(prompt)])
    want = torch.softmax(RaggedKVCache(smollm2.model, 1).forward(ids, counts)[0], -1)
    got = torch.softmax(SlotKVCache(native, 1, len(prompt) + 4).forward(ids, counts)[0], -1)
    assert 0.5 * (got - want).abs().sum(-1).mean() < 0.1


@pytest.mark.parametrize("draft_spec,rule", [("ngram", "chain"), ("eagle", "block"), ("eagle", "gbv"),
                                             ("self:4", "chain")])
def test_int4_greedy_speculative_equals_int4_target_only(int4_target, draft_spec, rule):
    prompts = _prompts(int4_target, 2)
    base = SpeculativeEngine(int4_target, NoDraft(), GREEDY, 0).generate(prompts, 64, batch_size=1)
    draft = build_draft(draft_spec, int4_target, GREEDY, seed=0)
    assert draft_spec == "ngram" or draft.native is not None
    paths = 2 if rule == "gbv" else 1
    results = SpeculativeEngine(int4_target, draft, GREEDY, 5, rule, num_paths=paths).generate(prompts, 64, batch_size=2)
    assert [r.output_ids for r in results] == [r.output_ids for r in base]
    assert isinstance(draft, (NgramDraft, ModelDraft)) or draft.native is not None
