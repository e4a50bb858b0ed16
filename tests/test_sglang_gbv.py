"""GBV inside SGLang without sglang: K-path sampling hooks, the chains read off SGLang's tree arrays, the
mapping onto SGLang's in-place outputs, and exactness of the whole pipeline (statistical, small vocabulary).

The same hooks against SGLang's real tree functions (select_top_k_tokens, organize_draft_results, the Triton
tree builder) are tested in tests_sglang/test_sglang_gbv.py."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from types import SimpleNamespace

from specadapt.sglang import draft_hooks, gbv, hot_vocab, layout
from specadapt.sglang import state as plugin_state
from specadapt.sglang.config import PluginConfig, PluginConfigError, validate_for_server
from specadapt.sglang.state import PluginState
from specadapt.sglang.targets import plan_targets, pre_worker_targets
from specadapt.verification.gbv import gbv_verify


def _sampler(probs, num_samples=1, *, sampling_seed=None, positions=None, draft_step=0):
    """fast_sample's contract (one sample per row) with torch's RNG."""
    assert num_samples == 1
    index = torch.multinomial(probs, 1)
    return probs.gather(1, index), index


def _original(calls):
    """sample_draft_proposal's contract: q = softmax(logits / T), one sample per row."""

    def original(logits, temperatures, top_ks=None, *, sampling_seed=None, positions=None, draft_step=0):
        calls.append(dict(rows=logits.shape[0], temps=temperatures.clone(), top_ks=top_ks, seeds=sampling_seed,
                          positions=positions, draft_step=draft_step))
        probs = torch.softmax(logits / temperatures.reshape(-1, 1), dim=-1)
        p, index = _sampler(probs)
        return probs, p, index

    return original


def _tree(batch, k, depth):
    """SGLang's verify-tree arrays for K chains of depth L (local node ids depth-major, branch-minor)."""
    n = k * depth + 1
    nxt = torch.full((batch, n), -1, dtype=torch.int64)
    sib = torch.full((batch, n), -1, dtype=torch.int64)
    node = lambda d, j: 1 + (d - 1) * k + j  # noqa: E731
    nxt[:, 0] = node(1, 0)
    for j in range(k - 1):
        sib[:, node(1, j)] = node(1, j + 1)
    for d in range(1, depth):
        for j in range(k):
            nxt[:, node(d, j)] = node(d + 1, j)
    index = torch.arange(batch * n, dtype=torch.int64).reshape(batch, n)
    return index, nxt, sib


def test_branch_scores_are_positive_and_strictly_decreasing():
    s = gbv.branch_scores(4, 3)
    assert s.shape == (3, 4) and (s > 0).all() and (s[:, 1:] < s[:, :-1]).all()


def test_chain_nodes_reads_k_chains_and_rejects_other_trees():
    index, nxt, sib = _tree(2, 3, 4)
    nodes = layout.chain_nodes(nxt, sib, 3, 4)
    assert nodes.shape == (2, 3, 4)
    assert nodes[0, 1].tolist() == [2, 5, 8, 11]  # branch 1: depth d at 1 + (d-1)*3 + 1
    broken = nxt.clone()
    broken[:, 5] = -1  # branch 1 stops at depth 2
    with pytest.raises(ValueError, match="not K chains"):
        layout.chain_nodes(broken, sib, 3, 4)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens 13"):
        layout.chain_nodes(nxt[:, :-1], sib[:, :-1], 3, 4)


def test_sample_draft_proposal_around_samples_one_token_per_branch_and_keeps_q():
    drafting = gbv.GBVDrafting.allocate(num_paths=3, num_steps=4, vocab=7, max_requests=2, device="cpu")
    plugin_state.install(PluginState(drafting=drafting))
    calls = []
    try:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2 * 3, 7, generator=g)
        temps = torch.tensor([[0.7], [1.3]])
        seeds = torch.tensor([11, 12])
        positions = torch.arange(6)
        probs0, topk_p, topk_index = draft_hooks.sample_draft_proposal_around(
            _original(calls), logits, temps, torch.tensor([0, 5]), sampling_seed=seeds, positions=positions,
            draft_step=2)
        call = calls[-1]
        assert call["rows"] == 6 and call["draft_step"] == 2
        assert call["temps"].reshape(-1).tolist() == pytest.approx([0.7] * 3 + [1.3] * 3)
        assert call["top_ks"].tolist() == [0, 0, 0, 5, 5, 5]
        assert len(set(call["seeds"].tolist())) == 6  # independent streams per branch
        expected = torch.softmax(logits / temps.repeat_interleave(3, 0), -1)
        assert torch.allclose(drafting.rows_for(2)[1], expected)  # draft step 2 -> buffer row 1
        assert torch.allclose(probs0, expected.reshape(2, 3, 7)[:, 0])
        assert topk_p[:, 0].eq(1).all() and topk_p[:, 1:].eq(0).all()
        assert (topk_index == topk_index[:, :1]).all() and topk_index.shape == (6, 3)
        # the depth-1 call (draft_step 0) and calls without the GBV state go to SGLang unchanged
        out = draft_hooks.sample_draft_proposal_around(_original(calls), logits[:2], temps, None, draft_step=0)
        assert out[1].shape == (2, 1)
        plugin_state.current().drafting = None
        out = draft_hooks.sample_draft_proposal_around(_original(calls), logits, torch.ones(6, 1), None, draft_step=1)
        assert out[1].shape == (6, 1)
    finally:
        plugin_state.reset()


def test_q_buffer_overflow_for_large_eager_batches():
    drafting = gbv.GBVDrafting.allocate(num_paths=2, num_steps=3, vocab=5, max_requests=2, device="cpu")
    rows = torch.softmax(torch.randn(8, 5), -1)
    drafting.record(1, rows)  # 4 requests x 2 paths > the 2 requests the buffer holds
    assert torch.equal(drafting.rows_for(4)[0], rows)
    with pytest.raises(ValueError, match="draft_step"):
        drafting.record(3, rows)


@pytest.mark.parametrize("sampler", [None, _sampler])
def test_first_draft_samples_are_independent_draws_and_greedy_rows_take_the_argmax(sampler):
    """Unseeded (torch.multinomial with replacement) and through a fast_sample-style sampler on K copies."""
    torch.manual_seed(0)
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40_000
    scores, index = gbv.first_draft_samples(q.expand(n, 4).contiguous(), 2, sampler=sampler)
    assert scores.shape == (n, 2) and index.shape == (n, 2)
    joint = torch.zeros(4, 4)
    joint.index_put_((index[:, 0], index[:, 1]), torch.ones(n), accumulate=True)
    expected = (q[:, None] * q[None, :]) * n  # i.i.d. with replacement: the product law
    chi2 = float(((joint - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(chi2, 15) > 1e-3, chi2
    greedy = gbv.first_draft_samples(q.expand(2, 4).contiguous(), 3, top_ks=torch.tensor([1, 0]), sampler=sampler)[1]
    assert greedy[0].tolist() == [0, 0, 0]


def _with_root(tokens):
    """Contexts start with the last committed token (0 here)."""
    return torch.cat([torch.zeros(tokens.shape[0], 1, dtype=torch.int64), tokens], dim=1)


def _gbv_round(batch, k, depth, vocab, q_law, p_law, g, caps=None):
    """One verify round through the plugin's hooks: K chains sampled by first_draft_samples and
    sample_draft_proposal_around, verified by gbv_speculative_sampling. Returns SGLang's outputs and the chains."""
    drafting = gbv.GBVDrafting.allocate(k, depth, vocab, batch, "cpu")
    plugin_state.install(PluginState(drafting=drafting))
    try:
        none = torch.zeros(batch, 0, dtype=torch.int64)
        _, first = gbv.first_draft_samples(q_law(_with_root(none)), k, sampler=_sampler)  # [B, K]
        steps = [first.reshape(-1, 1)]  # rows b*K + j
        for step in range(1, depth):
            logits = q_law(_with_root(torch.cat(steps, dim=1))).log()
            _, _, index = draft_hooks.sample_draft_proposal_around(_original([]), logits, torch.ones(batch, 1),
                                                                   draft_step=step)
            steps.append(index[:, :1])
        chains = torch.cat(steps, dim=1).reshape(batch, k, depth)
        n = k * depth + 1
        candidates = torch.zeros(batch, n, dtype=torch.int64)
        target = torch.zeros(batch, n, vocab)
        target[:, 0] = p_law(_with_root(none))
        draft_probs = torch.zeros(batch, depth, vocab)
        draft_probs[:, 0] = q_law(_with_root(none))
        for d in range(1, depth + 1):
            for j in range(k):
                local = 1 + (d - 1) * k + j
                candidates[:, local] = chains[:, j, d - 1]
                target[:, local] = p_law(_with_root(chains[:, j, :d]))
        for d in range(2, depth + 1):  # SGLang's stacked draft_probs: q_1, then branch 0's rows
            draft_probs[:, d - 1] = q_law(_with_root(chains[:, 0, : d - 1]))
        index, nxt, sib = _tree(batch, k, depth)
        predicts = torch.zeros(batch * n, dtype=torch.int32)
        accept_index = torch.full((batch, depth + 1), -1, dtype=torch.int32)
        accept_num = torch.zeros(batch, dtype=torch.int32)
        coins = torch.rand(batch, n, generator=g)
        final = torch.rand(batch, generator=g)
        rnd = gbv.gbv_speculative_sampling(drafting, predicts, accept_index, accept_num, candidates, index, nxt,
                                           sib, coins, final, target, draft_probs, impl="reference", caps=caps)
        return dict(predicts=predicts, accept_index=accept_index, accept_num=accept_num, out=rnd.out, chains=chains,
                    candidates=candidates, target=target, coins=coins, final=final, round=rnd)
    finally:
        plugin_state.reset()


def _laws(vocab, hot=None):
    """Context-dependent draft and target laws (of the last two tokens), so a q row of the wrong branch or
    depth is the wrong law; ``hot``: the draft proposes only these ids (a hot-vocabulary head)."""
    g = torch.Generator().manual_seed(7)
    table_q = torch.softmax(torch.randn(vocab + 1, vocab, vocab, generator=g) * 1.5, -1)
    if hot is not None:
        mask = torch.zeros(vocab)
        mask[hot] = 1.0
        table_q = table_q * mask
        table_q = table_q / table_q.sum(-1, keepdim=True)
    table_p = torch.softmax(torch.randn(vocab + 1, vocab, vocab, generator=g) * 1.5, -1)

    def law(table):
        def f(context):  # [B, T >= 1] -> [B, V]
            prev = context[:, -2] + 1 if context.shape[1] >= 2 else torch.zeros(context.shape[0], dtype=torch.int64)
            return table[prev, context[:, -1]]

        return f

    return law(table_q), law(table_p)


def test_gbv_outputs_follow_the_chosen_path_in_sglangs_layout():
    q_law, p_law = _laws(5)
    batch, k, depth = 64, 3, 3
    n = k * depth + 1
    r = _gbv_round(batch, k, depth, 5, q_law, p_law, torch.Generator().manual_seed(1))
    chosen = r["out"].chosen_path.long()
    tau = r["accept_num"].long()
    assert torch.equal(tau, r["out"].accept_len.long())
    for b in range(batch):
        c = int(chosen[b])
        path = [0] + [1 + d * k + c for d in range(depth)]
        t = int(tau[b])
        assert r["accept_index"][b].tolist() == [b * n + x for x in path[: t + 1]] + [-1] * (depth - t)
        emitted = [int(r["predicts"][b * n + x]) for x in path[: t + 1]]
        assert emitted == r["out"].output_tokens[b, : t + 1].tolist()
        assert emitted[:t] == r["chains"][b, c, :t].tolist()  # the accepted drafts are the chosen chain's
    # the same result as the reference GBV on the chains assembled independently of the plugin
    nodes = lambda j: [0] + [1 + d * k + j for d in range(depth)]  # noqa: E731
    paths = torch.stack([r["candidates"][:, nodes(j)] for j in range(k)], dim=1)
    target = torch.stack([r["target"][:, nodes(j)] for j in range(k)], dim=1)
    q = torch.stack([torch.stack([q_law(_with_root(r["chains"][:, j, :d])) for d in range(depth)], dim=1)
                     for j in range(k)], dim=1)
    ref = gbv_verify(paths, target, q, r["coins"][:, :depth], r["final"])
    assert torch.equal(ref.chosen_path, r["out"].chosen_path) and torch.equal(ref.accept_len, r["out"].accept_len)
    assert torch.equal(ref.output_tokens, r["out"].output_tokens)


@pytest.mark.parametrize("k, hot, capped", [(2, None, False), (3, None, False), (3, [0, 2, 3], False),
                                            (3, None, True)])
def test_gbv_pipeline_is_lossless_on_two_tokens(k, hot, capped):
    """Chi-square of the first two emitted tokens against the target law p(y1) p(y2 | y1) over 30,000 rounds
    (a round that accepts no draft gets y2 from p(. | y1): the next round's first token). A q row of the wrong
    branch or depth breaks exactness and fails this test."""
    torch.manual_seed(3)
    vocab, depth, batch = 4, 2, 30_000
    q_law, p_law = _laws(vocab, hot)
    caps = torch.randint(0, depth + 1, (batch,), generator=torch.Generator().manual_seed(5)) if capped else None
    r = _gbv_round(batch, k, depth, vocab, q_law, p_law, torch.Generator().manual_seed(2), caps)
    if capped:  # adaptive verification: at most caps[b] drafts of each path verified
        assert (r["accept_num"].long() <= caps).all() and (r["accept_num"][caps == 0] == 0).all()
    n = k * depth + 1
    y1 = r["predicts"][torch.arange(batch) * n].long()
    second = r["predicts"][r["accept_index"][:, 1].clamp_min(0).long()].long()
    fresh = torch.multinomial(p_law(_with_root(y1[:, None])), 1).squeeze(1)
    y2 = torch.where(r["accept_num"] >= 1, second, fresh)
    observed = torch.zeros(vocab, vocab)
    observed.index_put_((y1, y2), torch.ones(batch), accumulate=True)
    p1 = p_law(_with_root(torch.zeros(1, 0, dtype=torch.int64)))[0]
    p2 = p_law(_with_root(torch.arange(vocab)[:, None]))  # [V, V]: row a = p(. | a)
    expected = p1[:, None] * p2 * batch
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(chi2, vocab * vocab - 1) > 1e-3, (chi2, observed, expected)
    assert float((r["accept_num"] >= 1).float().mean()) > (0.15 if capped else 0.2)  # drafts do get accepted


def test_gbv_settings_and_targets():
    server = lambda **kw: type("S", (), dict(dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/d",  # noqa: E731
                                                  speculative_eagle_topk=None, speculative_num_steps=None,
                                                  speculative_num_draft_tokens=None, device="cuda"), **kw))()
    cfg = PluginConfig(verify="gbv", num_paths=3)
    validate_for_server(cfg, server())
    validate_for_server(cfg, server(speculative_eagle_topk=3, speculative_num_steps=4, speculative_num_draft_tokens=13))
    with pytest.raises(PluginConfigError, match="--speculative-num-draft-tokens 13"):
        validate_for_server(cfg, server(speculative_num_steps=4, speculative_num_draft_tokens=5))
    with pytest.raises(PluginConfigError, match="--speculative-eagle-topk 3"):
        validate_for_server(cfg, server(speculative_eagle_topk=1))
    # the headline combination
    validate_for_server(PluginConfig(verify="gbv", num_paths=3, adaptive_verification=True, tts=True), server())
    for extra, flag in ((dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle"),
                        (dict(speculative_adaptive=True), "--speculative-adaptive"),
                        (dict(disaggregation_mode="decode"), "--disaggregation-mode decode"),
                        (dict(pp_size=2), "--pp-size 2"),
                        (dict(speculative_accept_threshold_single=0.5), "--speculative-accept-threshold-single")):
        with pytest.raises(PluginConfigError, match=flag):
            validate_for_server(cfg, server(**extra))
    with pytest.raises(PluginConfigError, match="--speculative-accept-threshold-acc"):
        validate_for_server(PluginConfig(verify="block"), server(speculative_algorithm="STANDALONE",
                                                                 speculative_accept_threshold_acc=0.9))
    with pytest.raises(PluginConfigError, match="cannot replace"):
        validate_for_server(cfg, server(speculative_algorithm="DFLASH"))
    targets = [t for t, _, _ in plan_targets(cfg, "EAGLE3")]
    assert any(t.endswith("sample_draft_proposal") for t in targets)
    assert any(t.endswith("_draft_extend_for_prefill") for t in targets)
    assert any(t.endswith("_draft_extend_for_decode") for t in targets)
    assert [t for t, _, _ in pre_worker_targets(cfg)] == ["sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.__init__"]
    assert pre_worker_targets(PluginConfig(verify="block")) == []


def test_hot_vocabulary_rows_scatter_into_the_target_vocabulary():
    hot = hot_vocab.HotVocab(torch.tensor([4, 0, 7]), 9)
    q = torch.tensor([[0.5, 0.3, 0.2]])
    full = hot.to_target(q)
    assert full.shape == (1, 9) and full[0, [4, 0, 7]].tolist() == pytest.approx([0.5, 0.3, 0.2])
    assert float(full.sum()) == pytest.approx(1.0) and torch.equal(hot.to_draft(full), q)
    assert hot.to_target(full) is full  # other widths pass through
    with pytest.raises(ValueError, match="outside"):
        hot_vocab.HotVocab(torch.tensor([1, 9]), 9)
    with pytest.raises(ValueError, match="repeats"):
        hot_vocab.HotVocab(torch.tensor([1, 1]), 9)


def test_sampler_and_extend_hooks_hand_sglang_target_vocabulary_q_rows():
    """A hot-vocabulary head: SGLang sees q over the target vocabulary, sampled ids stay draft ids (SGLang maps
    them), and GBV's depth-1 samples are drawn in draft ids from the same law."""
    plugin_state.install(PluginState(hot_vocab=hot_vocab.HotVocab(torch.tensor([5, 1, 8, 2]), 10)))
    try:
        logits = torch.randn(3, 4)
        probs, _, index = draft_hooks.sample_draft_proposal_around(_original([]), logits, torch.ones(3, 1),
                                                                   draft_step=0)
        assert probs.shape == (3, 10) and (index < 4).all()
        assert torch.allclose(probs[:, [5, 1, 8, 2]], torch.softmax(logits, -1)) and probs[:, [0, 3, 4, 6, 7, 9]].eq(0).all()
        drafting = gbv.GBVDrafting.allocate(2, 3, 10, 3, "cpu")
        drafting.sampler = _sampler
        plugin_state.current().drafting = drafting
        probs0, _, index = draft_hooks.sample_draft_proposal_around(_original([]), torch.randn(6, 4),
                                                                    torch.ones(3, 1), draft_step=1)
        assert probs0.shape == (3, 10) and drafting.rows_for(3)[0].shape == (6, 10) and (index < 4).all()
        q1 = torch.softmax(torch.randn(3, 4), -1)
        extend = SimpleNamespace(draft_probs=q1, topk_p=None, topk_index=None)
        out = draft_hooks.draft_extend_for_prefill_around(
            lambda worker, batch: extend, None,
            SimpleNamespace(sampling_info=SimpleNamespace(top_ks=None, sampling_seed=None), seq_lens=torch.ones(3)))
        assert out.draft_probs.shape == (3, 10) and torch.allclose(out.draft_probs[:, [5, 1, 8, 2]], q1)
        assert out.topk_index.shape == (3, 2) and (out.topk_index < 4).all() and out.topk_p.shape == (3, 2)
        # an all-greedy batch is verified as SGLang's greedy beam tree: the usual top-K start, real scores
        extend = SimpleNamespace(draft_probs=q1, topk_p=None, topk_index=None)
        out = draft_hooks.draft_extend_for_prefill_around(
            lambda worker, batch: extend, None,
            SimpleNamespace(sampling_info=SimpleNamespace(is_all_greedy=True), seq_lens=torch.ones(3)))
        top = q1.topk(2, dim=-1)
        assert torch.equal(out.topk_index, top.indices) and torch.allclose(out.topk_p, top.values)
    finally:
        plugin_state.reset()


def test_tts_learns_from_the_chosen_gbv_path():
    """GBV + TTS: the snapshot covers every tree node; the example the updater gets is the chosen path's tokens,
    teacher rows and q rows, and the committed history follows the accepted nodes."""
    from specadapt.sglang.hooks import eagle_sample_around
    from specadapt.sglang.state import VerifyRuntime
    from specadapt.sglang.tts import SGLangTTS
    from specadapt.sglang.verify import chain_speculative_sampling
    from tests.helpers.sglang import _hf, _sglang_layout
    from specadapt.sglang.students import build_student

    torch.manual_seed(0)
    batch, k, depth, vocab = 4, 2, 3, 50
    n = k * depth + 1
    q_law, p_law = _laws(vocab)
    base = _gbv_round(batch, k, depth, vocab, q_law, p_law, torch.Generator().manual_seed(1))
    draft = _sglang_layout(_hf("llama"), "llama")
    tts = SGLangTTS(build_student(draft, draft.config), PluginConfig(tts=True), asynchronous=False)
    drafting = gbv.GBVDrafting.allocate(k, depth, vocab, batch, "cpu")
    for step in range(1, depth):  # the q rows the chains were drafted from, as the sampler hook records them
        drafting.record(step, torch.stack([q_law(_with_root(base["chains"][b // k, b % k, :step][None]))[0]
                                           for b in range(batch * k)]))
    runtime = VerifyRuntime(rule="gbv", impl="reference")
    state = PluginState(config=PluginConfig(verify="gbv", num_paths=k, tts=True), runtime=runtime, tts=tts,
                        algorithm="EAGLE3", drafting=drafting)
    plugin_state.install(state)
    index, nxt, sib = _tree(batch, k, depth)
    logits = base["target"].clamp_min(1e-9).log()  # raw logits whose softmax is the target law
    draft_probs = torch.stack([q_law(_with_root(torch.zeros(batch, 0, dtype=torch.int64)))] +
                              [q_law(_with_root(base["chains"][:, 0, :d])) for d in range(1, depth)], dim=1)

    def original(vi, b, lo):  # eagle_sample: the sampler over the tree, then (predict, accept_lens, accept_index)
        predicts = torch.zeros(batch * n, dtype=torch.int32)
        accept_index = torch.full((batch, depth + 1), -1, dtype=torch.int32)
        accept_num = torch.zeros(batch, dtype=torch.int32)
        chain_speculative_sampling(predicts, accept_index, accept_num, base["candidates"], index, nxt, sib,
                                   base["coins"], base["final"], base["target"], vi.draft_probs, 1.0, 1.0, True)
        return predicts, accept_num + 1, accept_index

    verify_input = SimpleNamespace(draft_token=base["candidates"].reshape(-1), draft_probs=draft_probs)
    logits_output = SimpleNamespace(next_token_logits=logits.reshape(batch * n, vocab), hidden_states=None)
    reqs = [SimpleNamespace(rid=f"r{i}") for i in range(batch)]
    b = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False), reqs=reqs,
                        sampling_info=SimpleNamespace(temperatures=torch.ones(batch, 1)))
    try:
        _, accept_lens, accept_index = eagle_sample_around(original, verify_input, b, logits_output)
        chosen = runtime.last_gbv.out.chosen_path.long()
        assert len(tts._pending) == batch
        for i, ex in enumerate(tts._pending):
            c = int(chosen[i])
            path = [0] + [1 + d * k + c for d in range(depth)]
            assert ex.tokens.tolist() == base["candidates"][i, path[:depth]].tolist()
            assert torch.allclose(ex.teacher, base["target"][i, path[:depth]], atol=1e-5)
            assert torch.allclose(ex.proximal[1], q_law(_with_root(base["chains"][i, c, :1][None]))[0], atol=1e-6)
            assert ex.accepted == int(accept_lens[i]) - 1
            committed = [int(t) for _, t in tts.history[f"r{i}"]]
            assert committed == base["candidates"][i, path[: ex.accepted + 1]].tolist()
    finally:
        plugin_state.reset()


def test_greedy_rows_with_underflowed_q_verify_to_the_greedy_token():
    """A greedy request may propose tokens with q = 0 (top-K start, float32 underflow); its target law is
    one-hot, so GBV must return the greedy token instead of rejecting the round."""
    drafting = gbv.GBVDrafting.allocate(2, 1, 4, 1, "cpu")
    index, nxt, sib = _tree(1, 2, 1)
    candidates = torch.tensor([[3, 0, 1]])
    target = torch.zeros(1, 3, 4)
    target[0, 0, 1] = 1.0  # greedy: token 1
    target[0, 1:, 2] = 1.0
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])  # q(1) = 0
    predicts = torch.zeros(3, dtype=torch.int32)
    accept_index = torch.full((1, 2), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    rnd = gbv.gbv_speculative_sampling(drafting, predicts, accept_index, accept_num, candidates, index, nxt, sib,
                                       torch.rand(1, 3), torch.rand(1), target, draft_probs, impl="reference")
    assert int(rnd.out.output_tokens[0, 0]) == 1
    assert int(accept_num[0]) == 1 and int(predicts[accept_index[0, 1]]) == 2  # path 1 accepted, then token 2
