"""The hybrid draft (``--draft eagle+suffix``): suffix drafts where the text repeats, the EAGLE head elsewhere.

Exactness (greedy equality, chi-square against the exact joint law), the head's context bookkeeping across rounds
it did not draft, the per-row choice, and the CLI's flags and refusals."""

from __future__ import annotations

import json

import pytest
import torch

from specadapt.engine import NoDraft, SpeculativeEngine
from specadapt.engine.eagle_draft import EagleDraft
from specadapt.engine.hybrid import HybridConfig, HybridDraft
from specadapt.engine.suffix import SuffixConfig, SuffixDraft
from specadapt.sampling import SamplingParams
from tests.helpers.engine import GREEDY, PROMPTS, _exact_joint, assert_first_tokens_follow, make_head, naive_greedy
from tests.helpers.models import loaded, tiny_llama


class AuditedHybrid(HybridDraft):
    """Checks before every round that each row's committed history is exactly the head's context: pairs fed to
    its cache plus pairs queued for its catch-up = ``len(history) - 1`` (a pair = a position's target feature
    with the next token)."""

    audits = 0

    def propose(self, histories, max_tokens, vocab_size, draft_filter=None):
        eagle = self.model
        if eagle._pending is not None:
            fed = eagle.kv.lengths.cpu().tolist()
            queued = eagle._pending.counts.tolist()
            for r, h in enumerate(histories):
                assert fed[r] + queued[r] == len(h) - 1, (r, fed[r], queued[r], len(h))
            self.audits += 1
        return super().propose(histories, max_tokens, vocab_size, draft_filter)


def _hybrid(target, params, min_match=2, model_tokens=2, cls=HybridDraft):
    head = make_head(target.model, std=0.3)
    suffix = SuffixDraft(SuffixConfig(max_depth=4, factor=2.0, min_prob=0.0))
    return cls(EagleDraft(head, params, seed=1), suffix, HybridConfig(min_match=min_match, min_tokens=1,
                                                                         model_tokens=model_tokens))


def test_config_errors_name_the_field():
    for field in ("min_match", "min_tokens", "model_tokens"):
        with pytest.raises(ValueError, match=field):
            HybridConfig(**{field: 0})


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_output_equals_target_only_and_both_drafters_draft(tiny_target, rule, batch_size):
    n = 32
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    draft = _hybrid(tiny_target, GREEDY, cls=AuditedHybrid)
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, 6, rule)
    results = engine.generate(PROMPTS, n, batch_size=batch_size)
    assert [r.output_ids for r in results] == expected
    assert draft.suffix_rounds > 0 and draft.model_rounds > 0, (draft.suffix_rounds, draft.model_rounds)
    assert draft.audits > 10
    base = SpeculativeEngine(tiny_target, NoDraft(), GREEDY, 0, rule).generate(PROMPTS, n, batch_size=batch_size)
    assert [r.output_ids for r in base] == expected


def test_rows_choose_their_drafter_by_the_suffix_match(tiny_target):
    """A row whose history ends in a repeat takes the suffix draft (one-hot q, up to max_tokens); the other row
    gets the head's sampled drafts, at most model_tokens of them, with their q rows."""
    params = SamplingParams(1.0)
    draft = _hybrid(tiny_target, params, min_match=3, model_tokens=2)
    repeat = [5, 6, 7, 8, 9, 5, 6, 7]  # ends with 5 6 7, seen before followed by 8 9
    fresh = [3, 1, 4, 1, 5, 9, 2, 6]
    draft.start([repeat, fresh])
    prefill = tiny_target.model(torch.tensor([repeat, fresh]), output_hidden_states=True)
    draft.observe_target(draft.target_features(tuple(h[:, :-1] for h in prefill.hidden_states)))
    proposal = draft.propose([repeat, fresh], torch.tensor([4, 4]), tiny_target.vocab_size)
    assert draft.last_choice.tolist() == [True, False]
    assert proposal.tokens[0, :2].tolist() == [8, 9] and int(proposal.num_tokens[0]) >= 2
    assert int(proposal.num_tokens[1]) == 2
    assert torch.allclose(proposal.probs[0, 0].max(), torch.tensor(1.0))  # one-hot on the suffix row
    assert float(proposal.probs[1, 0].max()) < 1.0 and abs(float(proposal.probs[1, 0].sum()) - 1.0) < 1e-5
    assert proposal.confidence is None


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_sampled_output_follows_the_target_law(rule):
    """Chi-square of the first two emitted tokens over 4000 requests against the exact joint law of the target, at
    T = 1 with top-k: the prompt's repeat makes the suffix draft the first round's drafter, the head drafts after."""
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(1.0, top_k=5)
    head = make_head(model, std=0.3)
    draft = HybridDraft(EagleDraft(head, params, seed=1),
                        SuffixDraft(SuffixConfig(max_depth=2, factor=2.0, min_prob=0.0, global_tokens=0)),
                        HybridConfig(min_match=2, min_tokens=1, model_tokens=2))
    n_req = 4000
    engine = SpeculativeEngine(target, draft, params, 2, rule, seed=3)
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert draft.suffix_rounds > 0 and draft.model_rounds > 0
    assert any(r.rounds[0].accepted > 0 for r in results), "the draft never helped: the test would be vacuous"
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


def test_generate_with_the_hybrid(capsys, tiny_model_dir, tmp_path):
    from tests.helpers.cli import run_generate

    head = tmp_path / "head.safetensors"
    _save_head(tiny_model_dir, head)
    out = tmp_path / "hybrid.json"
    code, _, err = run_generate(capsys, "--model", str(tiny_model_dir), "--draft", f"eagle:{head}+suffix",
                                "--temperature", "0", "--limit", "2", "--max-new-tokens", "24",
                                "--hybrid-min-match", "2", "--baseline", "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["config"]["draft"] == f"eagle:{head}+suffix" and report["config"]["num_draft_tokens"] == 4
    assert report["summary"]["output_tokens"] == report["summary"]["baseline_output_tokens"]


def _save_head(model_dir, path):
    from specadapt.engine.eagle import EagleHead, default_feature_layers, save_eagle_head
    from specadapt.engine.models import load_model

    target = load_model(str(model_dir))
    torch.manual_seed(0)
    head = EagleHead(target.model.config, default_feature_layers(target.model.config.num_hidden_layers))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    save_eagle_head(head.attach(target.model), path)


@pytest.mark.parametrize("argv, flag", [(["--hybrid-min-match", "0"], "--hybrid-min-match"),
                                        (["--hybrid-model-tokens", "0"], "--hybrid-model-tokens"),
                                        (["--verify", "gbv"], "--verify"),
                                        (["--adaptive-verification"], "--adaptive-verification")])
def test_hybrid_flag_errors_name_the_flag(capsys, tiny_model_dir, argv, flag):
    from tests.helpers.cli import run_generate

    code, _, err = run_generate(capsys, "--model", str(tiny_model_dir), "--draft", "eagle+suffix", *argv)
    assert code == 2 and flag in err


def test_the_hybrid_spec_needs_an_eagle_model_part():
    from specadapt.engine.factory import parse_draft_spec

    assert parse_draft_spec("eagle+suffix") == ("hybrid", "eagle")
    assert parse_draft_spec("eagle:/x/h.safetensors+suffix") == ("hybrid", "eagle:/x/h.safetensors")
    with pytest.raises(ValueError, match="eagle or eagle:PATH"):
        parse_draft_spec("self:2+suffix")
