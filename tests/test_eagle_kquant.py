"""The EAGLE head on a target that runs only on its own K-quant blocks (a GGUF skeleton: the qwen2.5-coder
presets): the shared embedding / norm / LM-head rows come from the native model, a narrow head layer round-trips
through its file, and the speculative output keeps the K-quant target's exact law (greedy equality, chi-square)."""

from __future__ import annotations

import pytest
import torch

from tests.test_kquant import _NativeAsModel, kquant_model, native_of, needs_kernels
from specadapt.engine.eagle import (EAGLE_HEADS, EagleHead, default_feature_layers, eagle_default_path,
                                    load_eagle_head, save_eagle_head)
from specadapt.sampling import SamplingParams


def skeleton_of(model):
    """The transformers model of ``model``'s config on the meta device (no weights), as a GGUF skeleton loads."""
    import transformers

    with torch.device("meta"):
        return transformers.Qwen2ForCausalLM(model.config).eval()


def random_head(config, vocab=None, width=64, seed=3, std=0.3):
    torch.manual_seed(seed)
    head = EagleHead(config, default_feature_layers(config.num_hidden_layers), vocab, intermediate_size=width)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
    return head.requires_grad_(False).eval()


def test_a_skeleton_target_shares_the_native_models_rows():
    model, read = kquant_model()
    native = native_of(model, read)
    skeleton = skeleton_of(model)
    vocab = torch.tensor([0, 3, 7, 20, 47])
    head = random_head(model.config, vocab)
    assert head.config.intermediate_size == 64 and head.config.model_type == "llama"
    assert not any(n.endswith("bias") for n, _ in head.named_parameters())  # the head layer is new: no Qwen2 biases
    with pytest.raises(ValueError, match="native="):
        head.attach(skeleton)
    head.attach(skeleton, native)
    embed, norm, rows = head.shared
    ids = torch.tensor([[1, 5, 47]])
    with torch.no_grad():
        torch.testing.assert_close(embed(ids), model.model.embed_tokens(ids), rtol=0, atol=0)
        torch.testing.assert_close(rows, model.lm_head.weight[vocab], rtol=0, atol=0)
        x = torch.randn(2, 256)
        torch.testing.assert_close(norm(x), model.model.norm(x), rtol=1e-5, atol=1e-5)
        feats = torch.randn(1, 3, 3 * 256)
        on_skeleton = head(ids, feats).logits
        on_weights = head.attach(model)(ids, feats).logits  # the same head on the de-quantised transformers model
    torch.testing.assert_close(on_skeleton, on_weights, rtol=1e-4, atol=1e-4)


def test_a_narrow_head_round_trips_through_its_file(tmp_path):
    model, read = kquant_model()
    native = native_of(model, read)
    skeleton = skeleton_of(model)
    head = random_head(model.config, torch.arange(0, 48, 3), width=96).attach(skeleton, native)
    path = tmp_path / "head.safetensors"
    save_eagle_head(head, path)
    with pytest.raises(ValueError, match="native="):
        load_eagle_head(path, skeleton)
    again = load_eagle_head(path, skeleton, native=native)
    assert again.config.intermediate_size == 96 and again.layer.mlp.up_proj.weight.shape == (96, 256)
    assert next(again.parameters()).device.type == "cpu" and next(again.parameters()).dtype == torch.float32
    ids, feats = torch.tensor([[2, 9]]), torch.randn(1, 2, 3 * 256)
    with torch.no_grad():
        torch.testing.assert_close(again(ids, feats).logits, head(ids, feats).logits)


def test_shipped_heads_are_named_for_a_target_without_one(tmp_path, monkeypatch):
    from specadapt.engine import eagle as eagle_module

    assert set(EAGLE_HEADS) >= {"smollm2-135m", "qwen2.5-coder-1.5b"}
    assert "smollm2-135m" in eagle_module.shipped_heads()
    with pytest.raises(ValueError, match="shipped heads: .*smollm2-135m"):
        eagle_default_path("qwen2.5-coder-0.5b")
    assert eagle_default_path("smollm2-135m").name == EAGLE_HEADS["smollm2-135m"]
    # a planned head whose file is not in this installation is named as such, not as a broken install
    (tmp_path / EAGLE_HEADS["smollm2-135m"]).write_bytes(b"x")
    monkeypatch.setattr(eagle_module, "_data_dir", lambda: tmp_path)
    assert eagle_module.shipped_heads() == ["smollm2-135m"]
    with pytest.raises(ValueError, match=r"not shipped in this installation yet\); shipped heads: smollm2-135m"):
        eagle_default_path("qwen2.5-coder-1.5b")


def test_a_preset_named_by_its_gguf_path_gets_its_shipped_head(tmp_path, monkeypatch):
    """``--model <cache>/<preset file>.gguf`` (how bench_llamacpp.py passes the target) is that preset
    (``LoadedModel.preset``), so ``--draft eagle`` finds its head; another preset's file names that preset, and an
    unknown file none."""
    from specadapt.engine import eagle as eagle_module
    from specadapt.engine.models import LoadedModel, preset_of
    from specadapt.engine.presets import PRESETS

    (tmp_path / EAGLE_HEADS["qwen2.5-coder-1.5b"]).write_bytes(b"x")
    monkeypatch.setattr(eagle_module, "_data_dir", lambda: tmp_path)
    gguf = str(tmp_path / "models" / PRESETS["qwen2.5-coder-1.5b"].file_name)
    loaded = LoadedModel(name=gguf, model=None, tokenizer=None, gguf_path=gguf)
    assert loaded.preset == "qwen2.5-coder-1.5b"
    assert eagle_default_path(loaded.preset) == tmp_path / EAGLE_HEADS["qwen2.5-coder-1.5b"]
    other = str(tmp_path / "models" / PRESETS["qwen2.5-coder-0.5b"].file_name)
    assert preset_of(other, other) == "qwen2.5-coder-0.5b"
    with pytest.raises(ValueError, match="no EAGLE head is shipped for 'qwen2.5-coder-0.5b'"):
        eagle_default_path(preset_of(other, other))
    assert preset_of("smollm2-135m") == "smollm2-135m"
    assert preset_of(str(tmp_path / "mine.gguf"), str(tmp_path / "mine.gguf")) is None


def _eagle_on_kquant(vocab_size: int, seed: int, scale: float, draft_vocab=None, kv="float16"):
    """``(target, draft factory)``: the tiny K-quant target as a loaded model on its native forward, and an
    EAGLE draft whose head is attached through the skeleton path and runs natively in the file's formats."""
    from tests.helpers.models import loaded
    from specadapt.engine.eagle_draft import EagleDraft
    from specadapt.engine.native.eagle import NativeEagleHead

    model, read = kquant_model(vocab=vocab_size, seed=seed, scale=scale)
    target = loaded(model)
    target.native = native_of(model, read, kv)
    head = random_head(model.config, draft_vocab, std=0.05).attach(skeleton_of(model), target.native)

    def draft(params):
        return EagleDraft(head, params, seed=1, native=NativeEagleHead(head, target.native))

    return model, target, draft


@needs_kernels
@pytest.mark.parametrize("rule", ["chain", "block"])
def test_greedy_eagle_on_a_kquant_target_equals_target_only(rule):
    from specadapt.engine import NoDraft, SpeculativeEngine

    _, target, draft = _eagle_on_kquant(48, seed=1, scale=1.0)
    params = SamplingParams(0.0)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
    base = SpeculativeEngine(target, NoDraft(), params, 0).generate(prompts, 16, batch_size=3)
    spec = SpeculativeEngine(target, draft(params), params, 3, rule).generate(prompts, 16, batch_size=3)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]


@needs_kernels
@pytest.mark.parametrize("rule", ["chain", "block"])
def test_sampled_eagle_output_follows_the_kquant_targets_law(rule):
    """Chi-square of the first two emitted tokens over 3000 requests against the exact joint law of the K-quant
    target's native forward, at T = 1 with top-p, the head proposing from a reduced vocabulary."""
    from tests.helpers.engine import _exact_joint, assert_first_tokens_follow
    from specadapt.engine import SpeculativeEngine

    model, target, draft = _eagle_on_kquant(8, seed=4, scale=0.05, draft_vocab=torch.tensor([1, 3, 5, 6]))
    params = SamplingParams(1.0, top_p=0.95)
    prompt = [3, 5, 3, 3, 5]
    n_req = 3000
    engine = SpeculativeEngine(target, draft(params), params, 2, rule, seed=3)
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results), "the draft never helped: the test would be vacuous"
    joint = _exact_joint(_NativeAsModel(target.native, model.config), prompt, params, 2)
    assert_first_tokens_follow(results, joint, n_req)
