"""Engine test helpers: greedy settings and prompts, the cache-free greedy oracle, the exact joint law of the
first tokens and its chi-square check, random EAGLE heads, targets / drafts on the native forward, and a greedy run
under adaptive verification with its draft log."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

from specadapt.engine import ModelDraft, NgramDraft, SpeculativeEngine
from specadapt.engine.drafts import self_draft
from specadapt.engine.eagle import EagleHead, default_feature_layers
from specadapt.engine.eagle_draft import EagleDraft
from specadapt.engine.models import attach_forward
from specadapt.engine.native import NativeLlama
from specadapt.engine.native.eagle import NativeEagleHead
from specadapt.sampling import SamplingParams, logits_to_probs
from tests.helpers.models import loaded, tiny_llama


GREEDY = SamplingParams(temperature=0.0)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5], [1, 2]]


def naive_greedy(model, prompt, n):
    """Oracle: full forward without any cache, argmax each step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _exact_joint(model, prompt, params, n):
    V = model.config.vocab_size
    joint = np.zeros((V,) * n)
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n - 1):
            logits = model(input_ids=torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 :]
            probs = logits_to_probs(logits, params).double().numpy()
            prefix_prob = np.prod([probs[i, t] for i, t in enumerate(seq)])
            joint[seq] = prefix_prob * probs[n - 1]
    return joint


def assert_first_tokens_follow(results, joint, n_req):
    """Chi-square of the first two emitted tokens of ``n_req`` requests against the exact joint law."""
    counts = np.zeros_like(joint)
    for r in results:
        counts[tuple(r.output_ids[:2])] += 1
    assert counts[joint == 0].sum() == 0, "a token of zero target probability was emitted"
    expected = joint[joint > 0] * n_req
    observed = counts[joint > 0]
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    _, pvalue = stats.chisquare(obs, exp * obs.sum() / exp.sum())
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e}"


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


def native_target(fmt="float32", seed=0, vocab=32, layers=2):
    target = loaded(tiny_llama(vocab=vocab, layers=layers, seed=seed))
    assert attach_forward(target, "native", fmt) == fmt
    assert isinstance(target.native, NativeLlama) and target.forward_name == "native"
    return target


def native_draft(target, kind, params=GREEDY, seed=5, subset=None):
    if kind == "ngram":
        return NgramDraft()
    if kind == "eagle":
        head = make_head(target.model, torch.arange(0, target.vocab_size, 2) if subset is None else subset)
        return EagleDraft(head, params, seed, native=NativeEagleHead(head, target.native))
    module = self_draft(target, 1)
    return ModelDraft(module, params, seed, "self:1", native=NativeLlama.from_hf(module, target.native.dtype_name))


def logged_av_features(target, draft, draft_ms: float = 0.0, n: int = 24) -> list[float]:
    """Greedy generation of :data:`PROMPTS` with ``draft`` under adaptive verification (a fixed cost table, refit
    every 5 rounds, drafts logged); asserts the output equals the cache-free greedy oracle and that some draft
    was verified. Returns the estimator feature of every logged draft."""
    import io
    import json

    from specadapt.budget.adaptive import AdaptiveVerification, CostTable
    from specadapt.estimator import AcceptanceEstimator

    expected = [naive_greedy(target.model, p, n) for p in PROMPTS]
    costs = CostTable(target_ms=[10.0, 10.5, 11.0, 11.5, 12.0, 12.5] + [13.0 + i for i in range(20)],
                      draft_ms=[draft_ms] * 4)
    log = io.StringIO()
    av = AdaptiveVerification(AcceptanceEstimator(4, refit_interval=5), costs, draft_log=log)
    results = SpeculativeEngine(target, draft, GREEDY, 4, "chain", adaptive=av).generate(PROMPTS, n, batch_size=4)
    assert [r.output_ids for r in results] == expected
    features = [json.loads(line)["feature"] for line in log.getvalue().splitlines()]
    assert features, "nothing verified: the test would be vacuous"
    return features
