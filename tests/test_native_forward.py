"""The native forward (engine/native) against transformers: fused CPU kernels and the PyTorch reference path give
transformers' logits (float32, max abs diff <= 1e-4) through prefill, ragged chunks, rollbacks, row selection,
logits_to_keep, token trees and path compaction; quantised formats agree with their PyTorch reference; a
request's logits do not depend on the batch it runs in."""

from __future__ import annotations

import pytest
import torch

from specadapt import kernels
from specadapt.engine.kv import RaggedKVCache
from specadapt.engine.loop import build_token_tree
from specadapt.engine.native import NativeLlama, NativeUnsupported, SlotKVCache
from specadapt.engine.native import model as native_model

HAS_KERNELS = kernels.has_op_for("native_llama_forward", torch.device("cpu"))


def tiny(family: str = "llama", vocab: int = 96, layers: int = 2, seed: int = 0, tied: bool = True,
         positions: int = 256, hidden: int = 64, intermediate: int = 128):
    """A small random model with head_dim 16 (the kernels' vector paths) and GQA (4 heads over 2)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                        tie_word_embeddings=tied, rope_theta=10000.0, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.requires_grad_(False)
    return model


def _pad(seqs):
    width = max(max(len(s) for s in seqs), 1)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
    return ids, torch.tensor([len(s) for s in seqs])


@pytest.fixture(params=["kernels", "reference"])
def path(request, monkeypatch):
    """Run a test through the fused CPU kernels and through the PyTorch reference (the CUDA path)."""
    if request.param == "kernels" and not HAS_KERNELS:
        pytest.skip("specadapt._C built without the native kernels")
    if request.param == "reference":
        monkeypatch.setattr(native_model, "_use_kernels", lambda device: False)
    return request.param


def _close(got, want, real):
    for r, n in enumerate(real.tolist()):
        if n:
            torch.testing.assert_close(got[r, :n], want[r, :n], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_float32_logits_equal_transformers_through_chunks_rollbacks_and_selection(family, path):
    model = tiny(family, tied=family != "qwen2")
    native = NativeLlama.from_hf(model, "float32")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 1, 17)]
    hf, ours = RaggedKVCache(model, 3, packed=True), SlotKVCache(native, 3, capacity=20)  # grows on demand
    ids, counts = _pad(seqs)
    _close(ours.forward(ids, counts), hf.forward(ids, counts), counts)
    for step in range(5):
        chunk = [torch.randint(0, 96, (k,), generator=g).tolist() for k in ((4, 0, 3), (1, 6, 2), (5, 5, 5),
                                                                                  (0, 2, 1), (3, 1, 4))[step]]
        ids, counts = _pad(chunk)
        _close(ours.forward(ids, counts), hf.forward(ids, counts), counts)
        keep = torch.tensor([len(s) + (step + r) % (len(c) + 1) for r, (s, c) in enumerate(zip(seqs, chunk))])
        for r in range(3):
            seqs[r] = seqs[r] + chunk[r][: int(keep[r]) - len(seqs[r])]
        hf.truncate(keep)
        ours.truncate(keep)
        assert ours.lengths.tolist() == [len(s) for s in seqs]
    # logits of the last column only, then drop a finished row
    ids, counts = _pad([[1, 2], [3], [4, 5]])
    torch.testing.assert_close(ours.forward(ids, counts, logits_to_keep=1)[[0, 2]],
                               hf.forward(ids, counts, logits_to_keep=1)[[0, 2]], atol=1e-4, rtol=0)
    rows = torch.tensor([2, 0])
    hf.select(rows)
    ours.select(rows)
    ids, counts = _pad([[7, 8, 9], [10]])
    _close(ours.forward(ids, counts), hf.forward(ids, counts), counts)


def test_logit_columns_give_each_rows_chosen_column_only(path):
    """``logit_columns`` (an EAGLE catch-up's last real token per row) equals the full forward's logits and hidden
    states at those columns, zeros for a row with no column (-1) or a hole, and leaves every layer's cache as the
    full forward does (the last layer runs past its cache writes for the chosen tokens only)."""
    model = tiny()
    native = NativeLlama.from_hf(model, "float32")
    full, picked = SlotKVCache(native, 3, capacity=32), SlotKVCache(native, 3, capacity=32)
    ids, counts = _pad([[5, 6, 7, 8], [9], [10, 11]])
    for cache in (full, picked):
        cache.forward(ids, counts)
    ids, counts = _pad([[1, 2, 3], [], [4, 5]])
    want = full.forward(ids, counts, return_outputs=True)
    columns = torch.tensor([2, -1, 1])
    got = picked.forward(ids, counts, logit_columns=columns, return_outputs=True)
    assert got.logits.shape == (3, 1, want.logits.shape[-1]) and got.hidden.shape == (3, 1, 64)
    # the last layer ran for the chosen tokens only: same logits and hidden state there
    torch.testing.assert_close(got.logits[[0, 2], 0], want.logits[[0, 2], columns[[0, 2]]], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.hidden[[0, 2], 0], want.hidden[[0, 2], columns[[0, 2]]], atol=1e-5, rtol=0)
    assert not got.logits[1].any() and not got.hidden[1].any()
    # transformers' cache keeps the same columns of its full forward (the EAGLE catch-up reads either cache alike)
    hf = RaggedKVCache(model, 3, packed=True)
    hf.forward(*_pad([[5, 6, 7, 8], [9], [10, 11]]))
    hf_got = hf.forward(ids, counts, logit_columns=columns)
    assert hf_got.shape == got.logits.shape and not hf_got[1].any()
    torch.testing.assert_close(hf_got[[0, 2]], got.logits[[0, 2]], atol=1e-4, rtol=0)
    assert picked.lengths.tolist() == full.lengths.tolist() == [7, 1, 4]
    ids, counts = _pad([[3], [4], [5]])  # the caches hold the same entries afterwards
    torch.testing.assert_close(picked.forward(ids, counts), full.forward(ids, counts), atol=0, rtol=0)
    with pytest.raises(ValueError, match="logit_columns"):
        picked.forward(ids, counts, logit_columns=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="logit_columns"):
        hf.forward(ids, counts, logit_columns=torch.tensor([0, 0]))


def test_hidden_states_capture_matches_transformers(path):
    model = tiny("llama", layers=3)
    native = NativeLlama.from_hf(model, "float32")
    ids, counts = _pad([[5, 6, 7, 8], [9, 10]])
    hf = RaggedKVCache(model, 2, packed=True).forward(ids, counts, return_outputs=True, output_hidden_states=True)
    ours = SlotKVCache(native, 2, 16).forward(ids, counts, return_outputs=True, output_hidden_states=True)
    assert len(ours.hidden_states) == len(hf.hidden_states) == 4
    for i in range(4):
        _close(ours.hidden_states[i], hf.hidden_states[i], counts)


def test_a_join_unpacks_the_new_rows_hidden_states_only(path):
    """hidden_from_row (a join: the running rows take no tokens) gives rows k.. of the full hidden states, on
    both caches, and the caches hold the same entries afterwards; rows before it with tokens are refused."""
    model = tiny("llama", layers=3)
    native = NativeLlama.from_hf(model, "float32")
    ids, counts = _pad([[5, 6, 7], [9, 10], [11], [12, 13]])
    caches = {}
    for name, make in (("native", lambda: SlotKVCache(native, 4, 32)), ("hf", lambda: RaggedKVCache(model, 4, packed=True))):
        full, sliced = make(), make()
        for kv in (full, sliced):
            kv.forward(ids, counts)
        join_ids, join_counts = _pad([[], [], [20, 21, 22, 23], [24]])
        want = full.forward(join_ids, join_counts, logits_to_keep=1, return_outputs=True, output_hidden_states=True)
        got = sliced.forward(join_ids, join_counts, logits_to_keep=1, return_outputs=True, output_hidden_states=True,
                             hidden_from_row=2)
        assert len(got.hidden_states) == 4
        for h_got, h_want in zip(got.hidden_states, want.hidden_states):
            assert h_got.shape[0] == 2
            torch.testing.assert_close(h_got, h_want[2:], atol=0, rtol=0)
        if name == "native":
            torch.testing.assert_close(got.hidden, want.hidden[2:], atol=0, rtol=0)
        torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
        assert sliced.lengths.tolist() == full.lengths.tolist() == [3, 2, 5, 3]
        with pytest.raises(ValueError, match="hidden_from_row"):
            sliced.forward(join_ids, join_counts, hidden_from_row=3)
        with pytest.raises(ValueError, match="hidden_from_row"):
            sliced.forward(join_ids, join_counts, hidden_from_row=5)
        caches[name] = got
    for a, b in zip(caches["native"].hidden_states, caches["hf"].hidden_states):
        _close(a, b, torch.tensor([4, 1]))


def test_token_trees_and_path_compaction_match_transformers(path):
    model = tiny("llama")
    native = NativeLlama.from_hf(model, "float32")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (6, 11)]
    hf, ours = RaggedKVCache(model, 2, packed=True), SlotKVCache(native, 2, 64)
    ids, counts = _pad(prompts)
    hf.forward(ids, counts)
    ours.forward(ids, counts)
    paths = torch.randint(0, 96, (2, 3, 3), generator=g)
    paths[:, 1, 0] = paths[:, 0, 0]  # a shared prefix
    tree = build_token_tree(paths)
    kw = dict(chunk_mask=tree.ancestor_mask, chunk_positions=tree.depth)
    _close(ours.forward(tree.node_tokens, tree.num_nodes, **kw), hf.forward(tree.node_tokens, tree.num_nodes, **kw),
           tree.num_nodes)
    chosen = torch.tensor([1, 2])
    keep = torch.zeros_like(tree.ancestor_mask[:, 0])
    for b in range(2):
        keep[b, tree.path_slots[b, chosen[b], :3]] = True  # root + 2 accepted nodes
    hf.keep_last_chunk(keep)
    ours.keep_last_chunk(keep)
    assert ours.lengths.tolist() == hf.lengths.tolist()
    ids, counts = _pad([[3, 4], [5]])
    _close(ours.forward(ids, counts), hf.forward(ids, counts), counts)


def test_repeat_interleave_gives_independent_copies(path):
    model = tiny("llama")
    native = NativeLlama.from_hf(model, "float32")
    hf, ours = RaggedKVCache(model, 2, packed=True), SlotKVCache(native, 2, 32)
    ids, counts = _pad([[1, 2, 3], [4, 5]])
    hf.forward(ids, counts)
    ours.forward(ids, counts)
    hf.repeat_interleave(2)
    ours.repeat_interleave(2)
    step = torch.tensor([[6], [7], [8], [9]])
    one = torch.ones(4, dtype=torch.int64)
    _close(ours.forward(step, one), hf.forward(step, one), one)
    pick = torch.tensor([1, 2])
    hf.select(pick)
    ours.select(pick)
    step, one = torch.tensor([[10], [11]]), torch.ones(2, dtype=torch.int64)
    _close(ours.forward(step, one), hf.forward(step, one), one)


@pytest.mark.skipif(not HAS_KERNELS, reason="specadapt._C built without the native kernels")
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_quantised_kernels_match_their_reference(fmt, kv, monkeypatch):
    model = tiny("qwen2", tied=False)
    native = NativeLlama.from_hf(model, fmt, kv_dtype=kv)
    ids, counts = _pad([[5, 6, 7, 8, 9], [10, 11]])
    step, ones = torch.tensor([[12], [13]]), torch.ones(2, dtype=torch.int64)
    kern = SlotKVCache(native, 2, 16)
    got = [kern.forward(ids, counts), kern.forward(step, ones)]
    monkeypatch.setattr(native_model, "_use_kernels", lambda device: False)
    ref = SlotKVCache(native, 2, 16)
    want = [ref.forward(ids, counts), ref.forward(step, ones)]
    for g, w, c in zip(got, want, (counts, ones)):
        _close(g, w, c)


@pytest.mark.skipif(not HAS_KERNELS, reason="specadapt._C built without the native kernels")
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_requests_logits_do_not_depend_on_its_batch(fmt):
    """Bit for bit: the same prompt and chunk alone, or beside other requests of other lengths."""
    native = NativeLlama.from_hf(tiny("llama", layers=2, seed=3), fmt)
    prompt, chunk = [5, 9, 2, 7, 1, 1, 8], [3, 4, 6]
    alone = SlotKVCache(native, 1, 32)
    alone.forward(torch.tensor([prompt]), torch.tensor([7]))
    want = alone.forward(torch.tensor([chunk]), torch.tensor([3]))[0]
    for position in (0, 2):
        others = [[1, 2, 3], [4] * 12, [6, 6]]
        seqs = others[:position] + [prompt] + others[position:]
        batch = SlotKVCache(native, 4, 32)
        ids, counts = _pad(seqs)
        batch.forward(ids, counts)
        ids, counts = _pad([[1]] * position + [chunk] + [[2, 3, 4, 5, 6]] * (3 - position))
        got = batch.forward(ids, counts)[position, :3]
        assert torch.equal(got, want)


def _isas() -> list[str]:
    if not HAS_KERNELS:
        return []
    ops = torch.ops.specadapt
    best = ops.native_set_isa("")
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(best) + 1]


def _on_every_isa(run) -> dict:
    """``{isa: run()}`` for each instruction-set path of the kernels this CPU has; the best one restored after."""
    ops = torch.ops.specadapt
    best = ops.native_set_isa("")
    try:
        results = {}
        for isa in _isas():
            ops.native_set_isa(isa)
            results[isa] = run()
    finally:
        ops.native_set_isa(best)
    return results


@pytest.mark.skipif(not HAS_KERNELS, reason="specadapt._C built without the native kernels")
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_attention_on_every_instruction_set_equals_the_reference(kv, monkeypatch):
    """Each attention path this CPU has (portable C++, AVX2, AVX-512) against the PyTorch reference, over more
    than one key split (256 keys) and partial key tiles, ragged chunks and a token tree; and a request's logits
    stay bit-identical alone or beside other requests on every path."""
    model = tiny("llama", positions=512)
    native = NativeLlama.from_hf(model, "float32", kv_dtype=kv)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (300, 37)]
    chunk = [torch.randint(0, 96, (k,), generator=g).tolist() for k in (5, 2)]
    paths = torch.randint(0, 96, (2, 3, 3), generator=g)
    tree = build_token_tree(paths)
    kw = dict(chunk_mask=tree.ancestor_mask, chunk_positions=tree.depth)

    def run():
        cache = SlotKVCache(native, 2, 320)
        outs = [cache.forward(*_pad(prompts)), cache.forward(*_pad(chunk)),
                cache.forward(tree.node_tokens, tree.num_nodes, **kw)]
        alone = SlotKVCache(native, 1, 320)
        alone.forward(*_pad(prompts[1:]))
        outs.append(alone.forward(*_pad(chunk[1:]))[0])
        return outs

    results = _on_every_isa(run)
    monkeypatch.setattr(native_model, "_use_kernels", lambda device: False)
    want = run()
    counts = [torch.tensor([300, 37]), torch.tensor([5, 2]), tree.num_nodes]
    for isa, got in results.items():
        for g_, w, c in zip(got[:3], want[:3], counts):
            _close(g_, w, c)
        assert torch.equal(got[3][:2], got[1][1, :2]), isa  # the second request alone: same bits


def test_unsupported_architectures_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(NativeUnsupported, match="gpt2"):
        NativeLlama.from_hf(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)), "float32")
    model = tiny("llama")
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic"}
    with pytest.raises(NativeUnsupported, match="dynamic"):
        NativeLlama.from_hf(model, "float32")
    with pytest.raises(ValueError, match="dtype"):
        NativeLlama.from_hf(tiny("llama"), "int3")


@pytest.mark.skipif(not HAS_KERNELS, reason="specadapt._C built without the native kernels")
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_row_operations_on_every_instruction_set_equal_the_reference(family, monkeypatch):
    """The per-token row operations (RMS norms, q/k norms, q/k/v biases, RoPE, the SiLU product, residual adds;
    csrc/cpu/native_rowops.cpp) on each vector path this CPU has, with widths that leave tails on both vector
    widths (Qwen3 hidden 76; intermediate 604: two 256-float exp chunks plus 92; 76 and 92 are 12 mod 16 and 4 mod
    8), against the PyTorch reference."""
    hidden = 76 if family == "qwen3" else 64  # Qwen2's head_dim is hidden / heads (16 on the vector paths)
    model = tiny(family, seed=5, positions=64, hidden=hidden, intermediate=604)
    native = NativeLlama.from_hf(model, "float32")
    prompts, chunk = [[5, 9, 2, 7, 1, 8, 8, 3], [4, 4, 6]], [[3, 1, 2], [7]]

    def run():
        cache = SlotKVCache(native, 2, 32)
        return [cache.forward(*_pad(prompts)), cache.forward(*_pad(chunk))]

    results = _on_every_isa(run)
    monkeypatch.setattr(native_model, "_use_kernels", lambda device: False)
    want = run()
    counts = [torch.tensor([8, 3]), torch.tensor([3, 1])]
    for isa, got in results.items():
        for g_, w, c in zip(got, want, counts):
            _close(g_, w, c)


@pytest.mark.skipif(not HAS_KERNELS, reason="specadapt._C built without the native kernels")
def test_logits_do_not_depend_on_the_thread_count():
    """Attention units are spread over the threads by cost (csrc/cpu/native_attention.cpp, balance_units); with
    a context over three key splits (the last one nearly empty) and two requests, one thread and two give the same
    bits, for a decode step, a verify chunk and a token tree."""
    native = NativeLlama.from_hf(tiny("llama", positions=1024), "int4", kv_dtype="float16")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (515, 260)]
    chunk = [torch.randint(0, 96, (k,), generator=g).tolist() for k in (6, 1)]
    tree = build_token_tree(torch.randint(0, 96, (2, 3, 2), generator=g))

    def run():
        cache = SlotKVCache(native, 2, 544)
        outs = [cache.forward(*_pad(prompts)), cache.forward(*_pad(chunk))]
        outs.append(cache.forward(tree.node_tokens, tree.num_nodes, chunk_mask=tree.ancestor_mask,
                                  chunk_positions=tree.depth))
        return outs

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
