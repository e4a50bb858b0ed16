"""The batched speculative loop on tiny random Llama models: greedy exactness, EOS / length handling, drafts,
and an end-to-end statistical losslessness test against the target's exact joint law."""

import pytest
import torch

from tests.helpers.engine import GREEDY, PROMPTS, _exact_joint, assert_first_tokens_follow, naive_greedy
from tests.helpers.models import loaded, stub_tokenizer, tiny_llama
from specadapt.engine import ModelDraft, NgramDraft, NoDraft, SpeculativeEngine, VocabularyMismatchError
from specadapt.engine.drafts import check_same_vocabulary, self_draft
from specadapt.engine.models import LoadedModel
from specadapt.sampling import SamplingParams

def _drafts(target, kind):
    gen = 5  # the draft's seed
    if kind == "ngram":
        return NgramDraft()
    if kind == "self:1":
        return ModelDraft(self_draft(target, 1), GREEDY, gen, "self:1")
    other = tiny_llama(vocab=target.vocab_size, layers=1, seed=11)
    return ModelDraft(other, GREEDY, gen, "standalone")


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("kind", ["ngram", "self:1", "standalone"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_output_equals_target_only_greedy(tiny_target, rule, kind, batch_size):
    n = 24
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    engine = SpeculativeEngine(tiny_target, _drafts(tiny_target, kind), GREEDY, 4, rule)
    results = engine.generate(PROMPTS, n, batch_size=batch_size)
    assert [r.output_ids for r in results] == expected
    base = SpeculativeEngine(tiny_target, NoDraft(), GREEDY, 0, rule).generate(PROMPTS, n, batch_size=batch_size)
    assert [r.output_ids for r in base] == expected
    assert all(len(r.rounds) == n for r in base)
    for res in results:
        assert sum(r.emitted for r in res.rounds) == n
        assert all(r.accepted <= r.num_drafted <= 4 for r in res.rounds)


def test_self_draft_of_all_layers_accepts_everything_in_greedy(tiny_target):
    draft = ModelDraft(self_draft(tiny_target, 2), GREEDY, 0, "self:2")
    res = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "chain").generate(PROMPTS[:1], 17)[0]
    assert all(r.accepted == r.num_drafted for r in res.rounds)
    assert len(res.rounds) == 5  # 4 rounds of 3+1 tokens, then 1 token (max_new_tokens cap leaves no draft)


def test_eos_ends_a_request_while_others_continue():
    model = tiny_llama(seed=0)
    free = [naive_greedy(model, p, 20) for p in PROMPTS]
    eos = free[0][6]
    target = loaded(model, eos=eos)
    expected = []
    for out in free:
        expected.append(out[: out.index(eos) + 1] if eos in out else out)
    results = SpeculativeEngine(target, NgramDraft(), GREEDY, 4, "block").generate(PROMPTS, 20, batch_size=4)
    assert [r.output_ids for r in results] == expected
    assert results[0].finished_by_eos and len(results[0].output_ids) == 7
    ignoring = SpeculativeEngine(target, NgramDraft(), GREEDY, 4, "block", ignore_eos=True).generate(PROMPTS, 20, batch_size=4)
    assert [r.output_ids for r in ignoring] == free
    assert not any(r.finished_by_eos for r in ignoring)


def test_max_new_tokens_per_request(tiny_target):
    limits = [5, 0, 13, 1]
    results = SpeculativeEngine(tiny_target, NgramDraft(), GREEDY, 4, "chain").generate(PROMPTS, limits, batch_size=4)
    assert [len(r.output_ids) for r in results] == limits


def test_engine_argument_errors(tiny_target):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeEngine(tiny_target, NgramDraft(), GREEDY, -1)
    with pytest.raises(ValueError, match="unknown verification rule"):
        SpeculativeEngine(tiny_target, NgramDraft(), GREEDY, 2, "tree")
    engine = SpeculativeEngine(tiny_target, NgramDraft(), GREEDY, 2)
    with pytest.raises(ValueError, match="batch_size"):
        engine.generate(PROMPTS, 3, batch_size=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 3)


def test_self_draft_owns_its_parameters(tiny_target):
    draft = self_draft(tiny_target, 1)
    assert len(draft.model.layers) == 1 and len(tiny_target.model.model.layers) == 2
    target_ptrs = {p.data_ptr() for p in tiny_target.model.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in draft.parameters()}
    with pytest.raises(ValueError, match="self:N"):
        self_draft(tiny_target, 3)
    with pytest.raises(ValueError, match="self:N"):
        self_draft(tiny_target, 0)


def test_vocabulary_mismatch_is_refused(tiny_target):
    other = loaded(tiny_llama(vocab=33, layers=1))
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 33"):
        check_same_vocabulary(tiny_target, other)
    same_size = LoadedModel("remapped", tiny_llama(vocab=32, layers=1), stub_tokenizer(32))
    same_size.tokenizer.get_vocab = lambda: {f"x{i}": i for i in range(32)}
    with pytest.raises(VocabularyMismatchError, match="maps tokens"):
        check_same_vocabulary(tiny_target, same_size)


@pytest.mark.parametrize(
    "rule,params,kind",
    [
        ("chain", SamplingParams(1.0), "self:1"),
        ("block", SamplingParams(0.8, top_p=0.9), "self:1"),
        ("block", SamplingParams(1.0, top_k=5), "ngram"),
    ],
)
def test_sampled_output_follows_the_target_law(rule, params, kind):
    """Chi-square of the first two emitted tokens over 4000 requests against the exact target joint law."""
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    if kind == "self:1":
        draft = ModelDraft(self_draft(target, 1), params, 2, kind)
    else:
        draft = NgramDraft(max_ngram=2)
    engine = SpeculativeEngine(target, draft, params, 2, rule, seed=3)
    n_req = 4000
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results), "the draft never helped: the test would be vacuous"
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_compiled_and_reference_verification_give_identical_runs(tiny_target, rule):
    """Same seed, same coins: the fused kernel and the float64 reference produce the same sampled text."""
    params = SamplingParams(1.0, top_p=0.95)
    runs = []
    for impl in ("compiled", "reference"):
        draft = ModelDraft(self_draft(tiny_target, 1), params, 9, "self:1")
        engine = SpeculativeEngine(tiny_target, draft, params, 3, rule, seed=4, verify_impl=impl)
        runs.append([r.output_ids for r in engine.generate(PROMPTS, 30, batch_size=2)])
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="verify_impl"):
        SpeculativeEngine(tiny_target, NoDraft(), params, 0, rule, verify_impl="gpu")


def test_build_token_tree_merges_shared_prefixes():
    from specadapt.engine.loop import build_token_tree

    tokens = torch.tensor([[[5, 6, 7], [5, 6, 8], [9, 6, 7]]])  # K = 3, L = 3
    tree = build_token_tree(tokens)
    # root, depth 1: 5, 9; depth 2: (5,6), (9,6); depth 3: (5,6,7), (5,6,8), (9,6,7)
    assert int(tree.num_nodes[0]) == 8
    assert tree.node_tokens[0, 1:8].tolist() == [5, 9, 6, 6, 7, 8, 7]
    assert tree.depth[0].tolist() == [0, 1, 1, 2, 2, 3, 3, 3]
    assert tree.path_slots[0].tolist() == [[0, 1, 3, 5], [0, 1, 3, 6], [0, 2, 4, 7]]
    # slot 6 = (5,6,8) attends to root, 5, (5,6) and itself only
    assert tree.ancestor_mask[0, 6].nonzero().flatten().tolist() == [0, 1, 3, 6]


def test_tree_attention_logits_equal_path_forwards():
    from specadapt.engine.kv import RaggedKVCache
    from specadapt.engine.loop import build_token_tree

    model = tiny_llama(vocab=32, layers=2, seed=6)
    prompt = [3, 4, 5, 6]
    tokens = torch.tensor([[[1, 2, 3], [1, 7, 3], [8, 2, 2]]])
    tree = build_token_tree(tokens)
    cache = RaggedKVCache(model, 1)
    cache.forward(torch.tensor([prompt[:-1]]), torch.tensor([3]))
    ids = tree.node_tokens.clone()
    ids[:, 0] = prompt[-1]
    logits = cache.forward(ids, tree.num_nodes, chunk_mask=tree.ancestor_mask, chunk_positions=tree.depth)
    for k in range(3):
        with torch.no_grad():
            fresh = model(input_ids=torch.tensor([prompt + tokens[0, k].tolist()])).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(logits[0, tree.path_slots[0, k]], fresh, atol=1e-4, rtol=1e-4)
    # keep path 1 up to depth 2: the next token's logits equal a fresh forward over that path
    keep = torch.zeros(1, int(tree.num_nodes[0]), dtype=torch.bool)
    keep[0, tree.path_slots[0, 1, :3]] = True
    cache.keep_last_chunk(keep)
    nxt = cache.forward(torch.tensor([[9]]), torch.tensor([1]))[0, 0]
    with torch.no_grad():
        fresh = model(input_ids=torch.tensor([prompt + [1, 7, 9]])).logits[0, -1]
    torch.testing.assert_close(nxt, fresh, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_paths", [1, 2, 3])
def test_gbv_greedy_equals_target_only(tiny_target, num_paths):
    n = 20
    expected = [naive_greedy(tiny_target.model, p, n) for p in PROMPTS]
    draft = ModelDraft(self_draft(tiny_target, 1), GREEDY, 1, "self:1")
    engine = SpeculativeEngine(tiny_target, draft, GREEDY, 3, "gbv", num_paths=num_paths)
    results = engine.generate(PROMPTS, n, batch_size=3)
    assert [r.output_ids for r in results] == expected


def test_gbv_argument_errors(tiny_target):
    with pytest.raises(ValueError, match="samples its paths"):
        SpeculativeEngine(tiny_target, NgramDraft(), GREEDY, 3, "gbv", num_paths=2)
    with pytest.raises(ValueError, match="num_paths"):
        SpeculativeEngine(tiny_target, NgramDraft(), GREEDY, 3, "block", num_paths=2)


@pytest.mark.parametrize("num_paths,params", [(3, SamplingParams(1.0)), (2, SamplingParams(0.7, top_p=0.9))])
def test_gbv_sampled_output_follows_the_target_law(num_paths, params):
    """Chi-square of the first two tokens of 4000 GBV requests against the exact target joint law."""
    model = tiny_llama(vocab=8, layers=2, seed=4, init_std=0.3)
    target = loaded(model)
    prompt = [1, 2, 3, 1, 2]
    draft = ModelDraft(self_draft(target, 1), params, 2, "self:1")
    engine = SpeculativeEngine(target, draft, params, 2, "gbv", seed=3, num_paths=num_paths)
    n_req = 4000
    results = engine.generate([prompt] * n_req, 3, batch_size=n_req, seeds=list(range(n_req)))
    assert any(r.rounds[0].accepted > 0 for r in results)
    assert_first_tokens_follow(results, _exact_joint(model, prompt, params, 2), n_req)


def test_a_round_pruned_to_no_drafts_still_counts_for_tts():
    """A round whose proposal adaptive verification prunes to nothing verifies a one-token chunk (the proposal is
    trimmed to the widest real draft), and still reaches Test-Time Speculation's round counter (its stride)."""
    from types import SimpleNamespace as NS

    from specadapt.engine.native.cache import SlotKVCache
    from specadapt.sampling import SamplingParams

    vocab, batch, width = 8, 2, 3

    class Stack:  # a model that only has the shapes: the loop's bookkeeping is under test
        num_layers, device = 1, torch.device("cpu")

        def new_kv(self, slots, capacity):
            capacity = -(-capacity // 16) * 16
            return torch.zeros(1, slots, 1, capacity // 16, 1, 16), torch.zeros(1, slots, 1, capacity, 1)

        def forward(self, tokens, k, v, logit_rows, capture, **extra):
            n = tokens.ids.shape[0]
            self.widths.append(n)
            return NS(logits=torch.zeros(n if logit_rows is None else logit_rows.shape[0], vocab),
                      hidden=torch.zeros(n, 4), captured={})

    stack = Stack()
    stack.widths = []
    calls = []
    proposal = NS(tokens=torch.ones(batch, width, dtype=torch.int64), probs=torch.full((batch, width, vocab), 1 / vocab),
                  num_tokens=torch.tensor([3, 2]))
    engine = NS(num_draft_tokens=width, _speculate=None, _round_limit=None, vocab_size=vocab, _draft_filter=None,
                _hidden_kwargs={}, _counts=None, _target_params=SamplingParams(temperature=0), verify_impl="auto",
                rule=NS(plain_rule="chain"), _row_seeds=torch.tensor([1, 2]), _needs_target_history=lambda: False,
                draft=NS(history_counts=None, needs_target_hidden=False, propose=lambda *a, **k: proposal,
                         commit=lambda accept: calls.append("commit")),
                adaptive=NS(plan=lambda probs, n: (torch.zeros(batch, dtype=torch.int64), None, None),
                            observe=lambda *a: calls.append("observe")),
                tts=NS(end_round=lambda h, tokens, *rest: calls.append(("tts", tuple(tokens.shape)))))
    engine._coins = lambda histories, w: SpeculativeEngine._coins(engine, histories, w)
    engine._probe_window = lambda: None  # not a probe round
    kv = SlotKVCache(stack, batch, 16)
    kv.forward(torch.ones(batch, 2, dtype=torch.int64), torch.tensor([2, 2]))
    accept, _, n_draft = SpeculativeEngine._single_path_round(engine, kv, [[1, 2, 3], [4, 5, 6]], torch.tensor([9, 9]))
    assert accept.tolist() == [0, 0] and n_draft.tolist() == [0, 0]
    assert stack.widths[-1] == batch  # one token a row: the pruned columns were not run
    assert kv.lengths.tolist() == [3, 3]
    assert calls == ["commit", "observe", ("tts", (batch, 0))]
