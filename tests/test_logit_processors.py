"""Logit processors (repetition / frequency / presence penalties, logit bias, min-p; issue 19.9): their semantics
against a naive implementation, the fused path against the reference, and losslessness -- exact enumeration of
the speculative output law on small vocabularies, chi-square tests through the engine, and the histories the
engine gives each verify slot and each draft step (committed tokens + drafts[:i])."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from tests.helpers.models import loaded, tiny_llama
from tests.helpers.exact_law import gbv_outcomes, multi_round_law, single_path_outcomes
from tests.helpers.engine import assert_first_tokens_follow
from specadapt.engine import ModelDraft, NgramDraft, NoDraft, SpeculativeEngine
from specadapt.engine import loop as loop_mod
from specadapt.engine.drafts import self_draft
from specadapt.sampling import (SamplingParams, TokenCounts, apply_min_p, logits_to_probs, logits_to_probs_reference)
from specadapt.verification import block_round_law, chain_round_law

REP = SamplingParams(1.0, repetition_penalty=1.8)
FREQ = SamplingParams(1.0, frequency_penalty=2.0)
PRES = SamplingParams(0.9, presence_penalty=2.0)
BIAS = SamplingParams(1.0, logit_bias={0: 1.5, 5: -2.0, 3: 0.7})
MINP = SamplingParams(1.0, min_p=0.2)
COMBO = SamplingParams(0.8, top_p=0.95, top_k=6, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.7,
                       presence_penalty=0.5, logit_bias={3: 1.0})
PROCESSORS = {"repetition": REP, "frequency": FREQ, "presence": PRES, "bias": BIAS, "min_p": MINP, "combo": COMBO}


# ---- semantics -------------------------------------------------------------------------------------------------
def naive_probs(logits, context, prompt_len, params: SamplingParams) -> np.ndarray:
    """The documented order of operations written out on one row in float64 (the oracle)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    generated = Counter(context[prompt_len:])
    for tok, count in generated.items():
        x[tok] -= params.frequency_penalty * count + params.presence_penalty
    for tok in set(context):
        if params.repetition_penalty != 1.0:
            x[tok] = x[tok] * params.repetition_penalty if x[tok] < 0 else x[tok] / params.repetition_penalty
    for tok, bias in params.logit_bias:
        x[tok] += bias
    if params.greedy:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / params.temperature
    if 0 < params.top_k < x.size:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1:
        order = sorted(range(p.size), key=lambda i: (-p[i], i))
        before, keep = 0.0, np.zeros(p.size, dtype=bool)
        for i in order:
            if before < params.top_p:
                keep[i] = True
            before += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if params.min_p > 0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def _counts(context, prompt_len, vocab):
    return TokenCounts.from_sequences([context], [prompt_len], vocab)


def test_each_processor_on_a_hand_checked_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    context, prompt_len = [0, 4, 1, 1, 2], 2  # prompt (0, 4); generated 1, 1, 2
    h = _counts(context, prompt_len, 5)
    assert h.generated.tolist() == [[0.0, 2.0, 1.0, 0.0, 0.0]] and h.prompt.tolist() == [[1, 0, 0, 0, 1]]
    greedy = dict(temperature=0.0)

    def processed(**kw):
        from specadapt.sampling import apply_logit_processors

        return apply_logit_processors(logits, SamplingParams(**greedy, **kw), h)[0].tolist()

    # repetition: prompt and generated tokens; positive / penalty, negative * penalty
    assert processed(repetition_penalty=2.0) == [1.0, -2.0, 0.25, 3.0, 0.0]
    # frequency: generated occurrences only (token 0 of the prompt is untouched)
    assert processed(frequency_penalty=0.5) == [2.0, -2.0, 0.0, 3.0, 0.0]
    assert processed(presence_penalty=0.5) == [2.0, -1.5, 0.0, 3.0, 0.0]
    assert processed(logit_bias={4: 10.0, 1: -1.0}) == [2.0, -2.0, 0.5, 3.0, 10.0]
    # additive penalties before the repetition penalty (SGLang's order)
    assert processed(presence_penalty=1.0, repetition_penalty=2.0) == [1.0, -4.0, -1.0, 3.0, 0.0]
    # greedy takes the argmax of the processed logits
    probs = logits_to_probs(logits, SamplingParams(0.0, logit_bias={4: 10.0}))
    assert probs.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    # min-p keeps p >= min_p * p_max, after top-p
    row = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    torch.testing.assert_close(logits_to_probs(row, SamplingParams(1.0, min_p=0.5)), torch.tensor([[0.625, 0.375, 0, 0]]))
    torch.testing.assert_close(logits_to_probs(row, SamplingParams(1.0, min_p=0.2)),
                               torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    torch.testing.assert_close(logits_to_probs(row, SamplingParams(1.0, top_p=0.7, min_p=0.5)),
                               torch.tensor([[0.625, 0.375, 0, 0]]))
    torch.testing.assert_close(apply_min_p(torch.tensor([[0.2, 0.2, 0.6]]), 0.0), torch.tensor([[0.2, 0.2, 0.6]]))


@pytest.mark.parametrize("name", list(PROCESSORS))
@pytest.mark.parametrize("fused", [True, False])
def test_transform_matches_the_naive_oracle(name, fused):
    params = PROCESSORS[name]
    g = torch.Generator().manual_seed(7)
    vocab = 12
    logits = torch.randn(20, vocab, generator=g) * 2
    contexts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 15, (20,), generator=g)]
    prompt_lens = [int(torch.randint(0, len(c) + 1, (1,), generator=g)) for c in contexts]
    history = TokenCounts.from_sequences(contexts, prompt_lens, vocab)
    transform = logits_to_probs if fused else logits_to_probs_reference
    got = transform(logits, params, history)
    want = np.stack([naive_probs(logits[r], contexts[r], prompt_lens[r], params) for r in range(20)])
    np.testing.assert_allclose(got.double().numpy(), want, atol=2e-6)


def test_defaults_take_the_fused_path_unchanged():
    """No processors: the same tensors as before (history is not needed and not read)."""
    params = SamplingParams(0.7, top_p=0.9, top_k=5)
    assert not params.has_logit_processors and not params.history_dependent
    logits = torch.randn(4, 50)
    assert torch.equal(logits_to_probs(logits, params), logits_to_probs(logits, params, history=None))
    assert torch.equal(logits_to_probs(logits, SamplingParams(0.7, 0.9, 5, 0.0, 1.0, 0.0, 0.0, {})),
                       logits_to_probs(logits, params))


@pytest.mark.parametrize(
    "kwargs,needle",
    [({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": float("nan")}, "min_p"),
     ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
     ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
     ({"presence_penalty": -3.0}, "presence_penalty"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
     ({"logit_bias": {1: float("inf")}}, "logit_bias"), ({"logit_bias": {"a": 1.0}}, "logit_bias"),
     ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"), ({"logit_bias": [3]}, "logit_bias")],
)
def test_bad_processor_values_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_history_and_bias_errors():
    logits = torch.randn(2, 6)
    with pytest.raises(ValueError, match="history"):
        logits_to_probs(logits, FREQ)
    with pytest.raises(ValueError, match="history"):
        logits_to_probs(logits, FREQ, TokenCounts.from_sequences([[1]], [0], 6))  # 1 row for 2
    with pytest.raises(ValueError, match="logit_bias"):
        logits_to_probs(logits, SamplingParams(1.0, logit_bias={6: 1.0}))
    with pytest.raises(ValueError, match="sequences"):
        TokenCounts.from_sequences([[7]], [0], 6)
    with pytest.raises(ValueError, match="prompt_lengths"):
        TokenCounts.from_sequences([[1]], [2], 6)


def test_token_counts_chain_and_tree_histories():
    base = TokenCounts.from_sequences([[1, 2, 2], [0]], [1, 1], 4)  # generated: row 0 two 2s, row 1 nothing
    drafts = torch.tensor([[3, 3, 1], [2, 0, 0]])
    chain = base.chain(drafts, torch.tensor([3, 1]))  # row 1 drafted one token only
    assert chain.generated.shape == (2, 4, 4)
    assert chain.generated[0].tolist() == [[0, 0, 2, 0], [0, 0, 2, 1], [0, 0, 2, 2], [0, 1, 2, 2]]
    assert chain.generated[1].tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 0]]
    assert chain.prompt[0, 3].tolist() == [False, True, False, False]
    # a tree: node k's history is the path from the root to it (itself included)
    from specadapt.engine.loop import build_token_tree

    tree = build_token_tree(torch.tensor([[[3, 1], [2, 1]]]))  # nodes: root, 3, 2, (3,1), (2,1)
    counts = TokenCounts.from_sequences([[0, 1]], [1], 4).extend(tree.node_tokens[:, 1:], tree.ancestor_mask[:, :, 1:])
    assert counts.generated[0].tolist() == [[0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0], [0, 2, 0, 1], [0, 2, 1, 0]]
    step = base.clone().add_(torch.tensor([3, -1]))
    assert step.generated.tolist() == [[0, 0, 2, 1], [0, 0, 0, 0]] and base.generated[0, 3] == 0


def test_reduced_draft_vocabulary_uses_target_ids():
    """EAGLE heads' logits are over ``draft_vocab``: penalties and biases are looked up by target id."""
    vocab_ids = torch.tensor([0, 2, 3, 5, 6])
    logits = torch.zeros(1, 5)
    history = TokenCounts.from_sequences([[9, 2, 2, 6]], [1], 10)  # generated 2, 2, 6
    params = SamplingParams(0.0, frequency_penalty=1.0, logit_bias={3: 4.0, 4: 9.0, 9: 1.0})
    from specadapt.sampling import apply_logit_processors

    got = apply_logit_processors(logits, params, history, vocab_ids)
    assert got.tolist() == [[0.0, -2.0, 4.0, 0.0, -1.0]]  # ids 4 and 9 are not in the draft vocabulary


# ---- exact enumeration ----------------------------------------------------------------------------------------
class ProcessedTables:
    """Context-dependent random target / draft logits over a small vocabulary, turned into ``p`` / ``q`` rows by the
    library's transform. ``p(u)`` (the target-only law) uses the true history ``prompt + u``; the round's rows
    (``path_rows``) are built the way the engine builds them -- verify slot i from the committed counts extended by
    :meth:`TokenCounts.chain`, draft step i from counts extended with :meth:`TokenCounts.add_` -- or, with
    ``drafts_in_history=False``, with the committed history only (the bug the tests must catch)."""

    def __init__(self, vocab, params, seed, prompt=(0, 1), drafts_in_history=True):
        self.vocab, self.params, self.seed, self.prompt = vocab, params, seed, tuple(prompt)
        self.drafts_in_history = drafts_in_history
        self._rows = {}

    def _logits(self, u, which):
        key = (u, which)
        if key not in self._rows:
            rng = np.random.default_rng([self.seed, which, len(u), *u])
            self._rows[key] = torch.tensor(rng.normal(0, 1.5, self.vocab), dtype=torch.float32)
        return self._rows[key]

    def _history(self, u):
        return TokenCounts.from_sequences([list(self.prompt + u)], [len(self.prompt)], self.vocab)

    @staticmethod
    def _f64(rows):
        rows = rows.double()
        return rows / rows.sum(-1, keepdim=True)

    def p(self, u):
        return self._f64(logits_to_probs(self._logits(u, 0)[None], self.params, self._history(u)))[0].numpy()

    def path_rows(self, u, path):
        base = self._history(u)
        L = len(path)
        drafts = torch.tensor([path], dtype=torch.int64).reshape(1, L)
        p_logits = torch.stack([self._logits(u + path[:i], 0) for i in range(L + 1)])[None]
        if self.drafts_in_history:
            p_hist = base.chain(drafts)
        else:
            p_hist = TokenCounts(base.generated[:, None].expand(1, L + 1, -1), base.prompt[:, None].expand(1, L + 1, -1))
        P = self._f64(logits_to_probs(p_logits, self.params, p_hist))[0]
        step, Q = base.clone(), []
        for i in range(L):
            Q.append(self._f64(logits_to_probs(self._logits(u + path[:i], 1)[None], self.params, step))[0])
            if self.drafts_in_history:
                step.add_(drafts[:, i])
        Q = torch.stack(Q) if Q else torch.zeros(0, self.vocab, dtype=torch.float64)
        return P, Q

    def path_prob(self, u, path):
        _, Q = self.path_rows(u, path)
        return float(np.prod([float(Q[i, x]) for i, x in enumerate(path)]))


def _target_joint(tables, n):
    out = np.zeros((tables.vocab,) * n)
    for seq in itertools.product(range(tables.vocab), repeat=n):
        out[seq] = np.prod([tables.p(seq[:i])[seq[i]] for i in range(n)])
    return out


def _naive_joint(tables, n):
    """The target-only law from the naive oracle of the documented semantics (independent of the library)."""
    out = np.zeros((tables.vocab,) * n)
    prompt = list(tables.prompt)
    for seq in itertools.product(range(tables.vocab), repeat=n):
        prob = 1.0
        for i in range(n):
            prob *= naive_probs(tables._logits(seq[:i], 0), prompt + list(seq[:i]), len(prompt), tables.params)[seq[i]]
        out[seq] = prob
    return out


@pytest.mark.parametrize("name", list(PROCESSORS))
@pytest.mark.parametrize("rule", ["chain", "block"])
def test_exact_speculative_law_with_processors(name, rule):
    """The exact law of the first 3 tokens (L = 2, V = 4) with each processor equals target-only decoding's law
    with that processor (1e-12), and that law equals the naive oracle's (float32 rows: 1e-5). For the history-
    dependent processors, leaving the drafts out of the verify / draft histories breaks it (the test can fail)."""
    params = {"combo": SamplingParams(0.8, top_p=0.95, top_k=3, min_p=0.05, repetition_penalty=1.3,
                                      frequency_penalty=0.7, presence_penalty=0.5, logit_bias={3: 1.0}),
              "bias": SamplingParams(1.0, logit_bias={0: 1.5, 3: -2.0, 2: 0.7})}.get(name, PROCESSORS[name])
    round_law = chain_round_law if rule == "chain" else block_round_law
    tables = ProcessedTables(4, params, seed=11)
    joint = _target_joint(tables, 3)
    np.testing.assert_allclose(joint, _naive_joint(tables, 3), atol=1e-5)
    law = multi_round_law(4, lambda u: single_path_outcomes(tables, round_law, 2, u), 3)
    np.testing.assert_allclose(law, joint, atol=1e-12)
    if params.history_dependent:
        wrong = ProcessedTables(4, params, seed=11, drafts_in_history=False)
        bad = multi_round_law(4, lambda u: single_path_outcomes(wrong, round_law, 2, u), 3)
        assert np.abs(bad - joint).max() > 1e-3


@pytest.mark.parametrize("name", ["frequency", "combo"])
def test_exact_gbv_law_with_processors(name):
    """GBV (K = 2 i.i.d. paths, L = 2, V = 3): exact law of the first 3 tokens with a history-dependent
    processor equals the target-only law; without the drafts in the histories it does not."""
    params = PROCESSORS[name] if name != "combo" else SamplingParams(0.8, repetition_penalty=1.5,
                                                                     frequency_penalty=0.8, presence_penalty=0.4)
    tables = ProcessedTables(3, params, seed=5)
    joint = _target_joint(tables, 3)
    law = multi_round_law(3, lambda u: gbv_outcomes(tables, 2, 2, u), 3)
    np.testing.assert_allclose(law, joint, atol=1e-12)
    wrong = ProcessedTables(3, params, seed=5, drafts_in_history=False)
    assert np.abs(multi_round_law(3, lambda u: gbv_outcomes(wrong, 2, 2, u), 3) - joint).max() > 1e-3


# ---- through the engine -----------------------------------------------------------------------------------------
def exact_joint_processed(model, prompt, params, n):
    """Target-only law of the first ``n`` tokens, the processor applied at each position to the true history."""
    V = model.config.vocab_size
    joint = np.zeros((V,) * n)
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n - 1):
            context = prompt + list(seq)
            logits = model(input_ids=torch.tensor([context])).logits[0, len(prompt) - 1:]
            history = TokenCounts.from_sequences([context[: len(prompt) + i] for i in range(n)], [len(prompt)] * n, V)
            probs = logits_to_probs(logits, params, history).double().numpy()
            joint[seq] = np.prod([probs[i, t] for i, t in enumerate(seq)]) * probs[n - 1]
    return joint


@pytest.mark.parametrize(
    "name,rule,kind",
    [("repetition", "chain", "self:1"), ("frequency", "block", "self:1"), ("presence", "chain", "ngram"),
     ("bias", "block", "self:1"), ("min_p", "chain", "self:1"), ("combo", "block", "self:1"),
     ("frequency", "gbv", "self:1"), ("combo", "gbv", "self:1")],
)
def test_engine_output_with_processors_follows_the_target_law(name, rule, kind):
    """Chi-square of the first two tokens over 4000 independent requests (seeds 0..3999) against the exact
    target-only law with the processor."""
    params = PROCESSORS[name]
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    draft = ModelDraft(self_draft(target, 1), params, 2, kind) if kind == "self:1" else NgramDraft(max_ngram=2)
    engine = SpeculativeEngine(target, draft, params, 2, rule, seed=3, num_paths=2 if rule == "gbv" else 1)
    n_req = 4000
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results), "the draft never helped: the test would be vacuous"
    assert_first_tokens_follow(results, exact_joint_processed(model, prompt, params, 2), n_req)


@pytest.mark.parametrize("name", ["repetition", "combo"])
def test_plain_rounds_with_processors_follow_the_target_law(name):
    """The engine's plain round (target-only decoding; also every round with speculation off): chi-square of the
    first two tokens over 4000 requests against the exact target-only law with history-dependent processors."""
    params = PROCESSORS[name]
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    engine = SpeculativeEngine(loaded(model), NoDraft(), params, 0, "chain", seed=3)
    prompt = [1, 2, 3, 1, 2]
    n_req = 4000
    results = engine.generate([prompt] * n_req, 2, batch_size=n_req, seeds=list(range(n_req)))
    assert all(r.num_drafted == 0 for res in results for r in res.rounds)
    assert_first_tokens_follow(results, exact_joint_processed(model, prompt, params, 2), n_req)


def test_eagle_with_processors_follows_the_target_law():
    """Reduced draft vocabulary: the head's penalties / biases are applied by target id."""
    from tests.helpers.engine import assert_reduced_vocab_eagle_follows

    params = SamplingParams(1.0, frequency_penalty=1.5, repetition_penalty=1.4, logit_bias={2: 1.0, 4: 2.0})
    assert_reduced_vocab_eagle_follows(params, exact_joint_processed)


def _fresh_logits(model, contexts):
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([c])).logits[0, -1] for c in contexts])


def _fresh_rows(model, contexts, prompt_len, params, vocab):
    """The transform of fresh forwards over ``contexts``, each with its own history."""
    history = TokenCounts.from_sequences(contexts, [prompt_len] * len(contexts), vocab)
    return logits_to_probs(_fresh_logits(model, contexts), params, history)


def test_verify_slot_i_and_draft_step_i_see_the_drafts_before_them(monkeypatch):
    """Every target row the engine verifies, and every q row its draft proposed, equals the transform of a fresh
    forward over committed + drafts[:i] with that history; with the drafts left out of the history rows differ
    (so this test fails if the engine drops them)."""
    model = tiny_llama(vocab=16, layers=2, seed=1, init_std=0.4)
    target = loaded(model)
    params = SamplingParams(1.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5)
    draft = ModelDraft(self_draft(target, 1), params, 2, "self:1")
    engine = SpeculativeEngine(target, draft, params, 3, "chain", seed=0)
    records, rounds = [], []
    original_round = engine._single_path_round
    original_verify = loop_mod.kernels.verify

    def round_spy(kv, histories, remaining):
        rounds.append([list(h) for h in histories])
        return original_round(kv, histories, remaining)

    def verify_spy(rule, candidates, target_probs, draft_probs, *args, num_draft_tokens=None, **kwargs):
        records.append((candidates.clone(), target_probs.clone(), draft_probs.clone(), num_draft_tokens.clone()))
        return original_verify(rule, candidates, target_probs, draft_probs, *args, num_draft_tokens=num_draft_tokens,
                               **kwargs)

    monkeypatch.setattr(engine, "_single_path_round", round_spy)
    monkeypatch.setattr(loop_mod.kernels, "verify", verify_spy)
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    engine.generate(prompts, 10, batch_size=2, seeds=[5, 6])
    assert len(records) == len(rounds) > 3
    checked = differs = 0
    for histories, (candidates, target_probs, draft_probs, n_draft) in zip(rounds, records):
        for b, committed in enumerate(histories):
            prompt_len = next(len(p) for p in prompts if committed[: len(p)] == p)
            drafts = candidates[b, 1:].tolist()
            n = int(n_draft[b])
            contexts = [committed + drafts[:i] for i in range(n + 1)]
            want_p = _fresh_rows(model, contexts, prompt_len, params, 16)
            torch.testing.assert_close(target_probs[b, : n + 1], want_p, atol=1e-5, rtol=1e-4)
            want_q = _fresh_rows(draft.model, contexts[:n], prompt_len, params, 16)
            torch.testing.assert_close(draft_probs[b, :n], want_q, atol=1e-5, rtol=1e-4)
            # the same logits with the committed history only (drafts left out)
            stale = logits_to_probs(_fresh_logits(model, contexts), params,
                                    TokenCounts.from_sequences([committed] * (n + 1), [prompt_len] * (n + 1), 16))
            differs += int((stale[1:] - want_p[1:]).abs().max() > 1e-3) if n else 0
            checked += n + 1
    assert checked > 20 and differs > 0


def test_gbv_tree_nodes_see_their_paths(monkeypatch):
    """GBV: each path's target rows (tree nodes) and q rows equal fresh transforms over committed + path[:i]."""
    model = tiny_llama(vocab=16, layers=2, seed=2, init_std=0.4)
    target = loaded(model)
    params = SamplingParams(1.0, frequency_penalty=1.5, repetition_penalty=1.5)
    draft = ModelDraft(self_draft(target, 1), params, 2, "self:1")
    engine = SpeculativeEngine(target, draft, params, 2, "gbv", seed=0, num_paths=3)
    records, rounds = [], []
    original_round = engine._gbv_round
    original = loop_mod.kernels.verify_paths

    def round_spy(kv, histories, remaining):
        rounds.append([list(h) for h in histories])
        return original_round(kv, histories, remaining)

    def spy(rule, candidates, target_probs, draft_probs, *args, **kwargs):
        records.append((candidates.clone(), target_probs.clone(), draft_probs.clone()))
        return original(rule, candidates, target_probs, draft_probs, *args, **kwargs)

    monkeypatch.setattr(engine, "_gbv_round", round_spy)
    monkeypatch.setattr(loop_mod.kernels, "verify_paths", spy)
    prompt = [3, 1, 4, 1, 5]
    engine.generate([prompt], 8, seeds=[1])
    assert len(records) >= 2
    for (committed,), (candidates, target_probs, draft_probs) in zip(rounds, records):
        depth = candidates.shape[2] - 1  # 2, or 1 in a round with 2 tokens left (the tree fits the room)
        for k in range(3):
            path = candidates[0, k, 1:].tolist()
            contexts = [committed + path[:i] for i in range(depth + 1)]
            torch.testing.assert_close(target_probs[0, k], _fresh_rows(model, contexts, len(prompt), params, 16),
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(draft_probs[0, k], _fresh_rows(draft.model, contexts[:depth], len(prompt), params,
                                                                      16), atol=1e-5, rtol=1e-4)


def test_engine_refuses_a_bias_outside_the_vocabulary(tiny_target):
    with pytest.raises(ValueError, match="logit_bias"):
        SpeculativeEngine(tiny_target, NgramDraft(), SamplingParams(1.0, logit_bias={32: 1.0}), 2)


@pytest.mark.parametrize("params", [SamplingParams(1.0, logit_bias={4: 3.0, 6: -2.0, 5: 1.0}),
                                    SamplingParams(0.9, frequency_penalty=1.5, repetition_penalty=1.4,
                                                   logit_bias={2: 1.0})])
def test_eagle_draft_rows_apply_processors_by_target_id(tiny_target, params):
    """Each round's first q row of the EAGLE draft (a reduced vocabulary) equals the transform of a fresh head
    forward with the committed history, penalties and biases looked up by target id."""
    from tests.helpers.engine import eagle, record_first_q_rows

    subset = torch.tensor([0, 2, 3, 5, 6, 9, 12, 20])
    draft = eagle(tiny_target, params, subset=subset)
    seen = record_first_q_rows(draft)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    SpeculativeEngine(tiny_target, draft, params, 3, "block", seed=1).generate(prompts, 10, batch_size=2)
    assert len(seen) > 5
    head = draft.head
    for history, q in seen:
        prompt_len = next(len(p) for p in prompts if history[: len(p)] == p)
        with torch.no_grad():
            out = tiny_target.model(input_ids=torch.tensor([history[:-1]]), output_hidden_states=True)
            logits = head(torch.tensor([history[1:]]), head.target_features(out.hidden_states)).logits[0, -1]
        x = logits.double().clone()
        counts = Counter(history[prompt_len:])
        for j, tok in enumerate(subset.tolist()):  # the naive rule, column by column
            x[j] -= params.frequency_penalty * counts.get(tok, 0)
            if tok in history and params.repetition_penalty != 1.0:
                x[j] = x[j] * params.repetition_penalty if x[j] < 0 else x[j] / params.repetition_penalty
            x[j] += dict(params.logit_bias).get(tok, 0.0)
        want = torch.zeros(32, dtype=torch.float64)
        want[subset] = torch.softmax(x / params.temperature, -1)
        torch.testing.assert_close(q.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rule,kind", [("chain", "ngram"), ("block", "self:1"), ("gbv", "self:1")])
def test_greedy_with_penalties_equals_target_only_greedy(tiny_target, rule, kind):
    """Temperature 0 with penalties and a bias: speculative output equals the naive greedy loop (argmax of the
    processed logits of a fresh forward at every step) token for token."""
    params = SamplingParams(0.0, repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.4,
                            logit_bias={5: 0.5})
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    n = 16
    expected = []
    for prompt in prompts:
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                logits = tiny_target.model(input_ids=torch.tensor([seq])).logits[0, -1]
                seq.append(int(np.argmax(naive_probs(logits, seq, len(prompt), params))))
        expected.append(seq[len(prompt):])
    draft = ModelDraft(self_draft(tiny_target, 1), params, 0, "self:1") if kind == "self:1" else NgramDraft()
    engine = SpeculativeEngine(tiny_target, draft, params, 3, rule, num_paths=2 if rule == "gbv" else 1)
    results = engine.generate(prompts, n, batch_size=2)
    assert [r.output_ids for r in results] == expected
    assert any(r.accepted for res in results for r in res.rounds)
