"""The EAGLE-style draft head: bookkeeping against a cache-free oracle, losslessness, save/load, bad input."""

from __future__ import annotations

import pytest
import torch

from conftest import loaded, tiny_llama
from test_engine_tiny import GREEDY, PROMPTS, _exact_joint, assert_first_tokens_follow, naive_greedy
from specadapt.engine import NoDraft, SpeculativeEngine
from specadapt.engine.eagle import EagleHead, default_feature_layers, load_eagle_head, save_eagle_head
from specadapt.engine.eagle_draft import EagleDraft
from specadapt.sampling import SamplingParams, logits_to_probs


def make_head(target_model, vocab_subset=None, seed=3, std=0.3):
    torch.manual_seed(seed)
    layers = default_feature_layers(target_model.config.num_hidden_layers)
    head = EagleHead(target_model.config, layers, vocab_subset)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
    head.requires_grad_(False)
    return head.attach(target_model).eval()


def eagle(target, params=GREEDY, subset=None, seed=5):
    return EagleDraft(make_head(target.model, subset), params, seed)


def oracle_first_q(target_model, head, history, params):
    """Cache-free: target features of positions 0..n-2, head over (f_i, x_{i+1}), q at the last pair."""
    with torch.no_grad():
        out = target_model(input_ids=torch.tensor([history[:-1]]), output_hidden_states=True)
        feats = head.target_features(out.hidden_states)
        logits = head(torch.tensor([history[1:]]), feats).logits[0, -1]
    q = torch.zeros(target_model.config.vocab_size)
    q[head.draft_vocab] = logits_to_probs(logits, params)
    return q


@pytest.mark.parametrize("verify", ["chain", "block", "gbv"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_eagle_greedy_equals_target_only(tiny_target, verify, batch_size):
    n = 20
    prompts = [p for p in PROMPTS if len(p) > 1] if verify == "gbv" else PROMPTS
    expected = [naive_greedy(tiny_target.model, p, n) for p in prompts]
    num_paths = 2 if verify == "gbv" else 1
    draft = eagle(tiny_target, subset=torch.arange(0, 32, 2))
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, 3, verify, num_paths=num_paths)
    results = engine.generate(prompts, n, batch_size=batch_size)
    assert [r.output_ids for r in results] == expected


def record_first_q_rows(draft) -> list:
    """Wrap ``draft.propose`` so every round appends ``(history, q row of draft 1)`` of each drafting request to
    the returned list."""
    seen = []
    original = draft.propose

    def recording(histories, max_tokens, vocab_size, draft_filter=None):
        proposal = original(histories, max_tokens, vocab_size, draft_filter=draft_filter)
        for r, h in enumerate(histories):
            if int(proposal.num_tokens[r]) > 0:
                seen.append((list(h), proposal.probs[r, 0].clone()))
        return proposal

    draft.propose = recording
    return seen


def test_eagle_first_draft_matches_cache_free_oracle(tiny_target):
    """Every round's first q row equals a fresh head forward over all real (feature, next token) pairs."""
    params = SamplingParams(1.0)
    draft = eagle(tiny_target, params)
    seen = record_first_q_rows(draft)
    engine = SpeculativeEngine(tiny_target, draft, params, 3, "block", seed=1)
    engine.generate(PROMPTS, 12, batch_size=3)
    assert len(seen) > 10
    accepted_some = False
    for history, q in seen:
        torch.testing.assert_close(q, oracle_first_q(tiny_target.model, draft.head, history, params), atol=1e-5, rtol=1e-4)
        accepted_some = True
    assert accepted_some


def assert_reduced_vocab_eagle_follows(params, exact_joint) -> None:
    """3,000 block-verified requests (L = 2) of an EAGLE draft over a reduced vocabulary on a tiny 8-token target:
    the first two output tokens follow ``exact_joint(model, prompt, params, 2)`` (chi-square), and the draft was
    accepted at least once (else the check would be vacuous)."""
    model = tiny_llama(vocab=8, layers=3, seed=4, init_std=0.3)
    target = loaded(model)
    draft = eagle(target, params, subset=torch.tensor([0, 2, 3, 5, 6]), seed=2)
    engine = SpeculativeEngine(target, draft, params, 2, "block", seed=3)
    n_req = 3000
    prompt = [1, 2, 3, 1, 2]
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results)
    assert_first_tokens_follow(results, exact_joint(model, prompt, params, 2), n_req)


def test_eagle_sampled_output_follows_target_law():
    """Reduced draft vocabulary (q = 0 outside it): the output still follows the target's exact joint law."""
    assert_reduced_vocab_eagle_follows(SamplingParams(1.0), _exact_joint)


def test_head_state_excludes_shared_target_modules(tiny_target, tmp_path):
    head = make_head(tiny_target.model, torch.tensor([1, 4, 9]))
    names = set(head.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fuse.weight", "input_proj.weight", "draft_vocab"} <= names
    shared_ids = {id(p) for p in tiny_target.model.parameters()}
    assert not any(id(p) in shared_ids for p in head.parameters())
    path = tmp_path / "head.safetensors"
    save_eagle_head(head, path, {"note": "test"})
    again = load_eagle_head(path, tiny_target.model)
    for (k, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)
    x = torch.tensor([[1, 2, 3]])
    feats = torch.randn(1, 3, 3 * head.hidden_size)
    torch.testing.assert_close(head(x, feats).logits, again(x, feats).logits)


def test_head_bad_input(tiny_target, tmp_path):
    config = tiny_target.model.config
    with pytest.raises(ValueError, match="feature_layers"):
        EagleHead(config, (0, 1, 99))
    with pytest.raises(ValueError, match="draft_vocab ids"):
        EagleHead(config, (1, 1, 2), torch.tensor([0, 40]))
    with pytest.raises(ValueError, match="sorted and unique"):
        EagleHead(config, (1, 1, 2), torch.tensor([3, 1]))
    head = make_head(tiny_target.model)
    with pytest.raises(ValueError, match="features must have width"):
        head(torch.tensor([[1]]), torch.zeros(1, 1, 5))
    with pytest.raises(RuntimeError, match="attach"):
        EagleHead(config, (1, 1, 2))(torch.tensor([[1]]), torch.zeros(1, 1, 3 * config.hidden_size))
    with pytest.raises(FileNotFoundError):
        load_eagle_head(tmp_path / "missing.safetensors", tiny_target.model)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a specadapt EAGLE head"):
        load_eagle_head(tmp_path / "other.safetensors", tiny_target.model)
    wide = tiny_llama(hidden=64, seed=1)
    save_eagle_head(head, tmp_path / "h.safetensors")
    with pytest.raises(ValueError, match="does not fit"):
        load_eagle_head(tmp_path / "h.safetensors", wide)


def test_target_only_baseline_unaffected(tiny_target):
    base = SpeculativeEngine(tiny_target, NoDraft(), GREEDY, 0).generate(PROMPTS[:2], 5)
    assert [r.output_ids for r in base] == [naive_greedy(tiny_target.model, p, 5) for p in PROMPTS[:2]]
