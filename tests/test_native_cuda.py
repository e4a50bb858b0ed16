"""The native forward on a GPU (its PyTorch path, no host synchronisation): greedy speculative output equals
target-only greedy output and transformers' greedy decoding, and a TTS publish reaches the native weights.
Skipped without CUDA (run by scripts/device_check.sh on a lent GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import loaded, tiny_llama
from tests.helpers.engine import GREEDY, PROMPTS, naive_greedy, native_draft
from specadapt.engine import NoDraft, SpeculativeEngine
from specadapt.engine.models import attach_forward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_target(fmt="float32"):
    model = tiny_llama(vocab=32, layers=2, seed=0).cuda()
    target = loaded(model)
    attach_forward(target, "native", fmt)
    assert target.native.device.type == "cuda"
    return target


@pytest.mark.parametrize("rule,kind", [("chain", "self:1"), ("block", "eagle"), ("gbv", "eagle"), ("chain", "ngram")])
def test_cuda_native_greedy_equals_greedy_decoding(rule, kind):
    target = cuda_target()
    n = 16
    prompts = [p for p in PROMPTS if len(p) > 1]
    expected = [naive_greedy(target.model, p, n) for p in prompts]
    base = SpeculativeEngine(target, NoDraft(), GREEDY, 0).generate(prompts, n, batch_size=2)
    assert [r.output_ids for r in base] == expected
    engine = SpeculativeEngine(target, native_draft(target, kind), GREEDY, 3, rule, num_paths=2 if rule == "gbv" else 1)
    assert [r.output_ids for r in engine.generate(prompts, n, batch_size=3)] == expected


def test_cuda_tts_publish_reaches_native_weights():
    target = cuda_target()
    draft = native_draft(target, "self:1")
    before = [t.clone() for t in draft.native._op_tensors if t is not None]
    with torch.no_grad():
        for p in draft.model.model.layers.parameters():
            p.add_(0.05)
    draft.tts_student().refresh()
    after = [t for t in draft.native._op_tensors if t is not None]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
