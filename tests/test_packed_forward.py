"""Packed (variable-length) forwards of RaggedKVCache: only the real tokens go through the model, and the
results equal the padded forward's at every real token (logits, hidden states, later steps through the cache)."""

import pytest
import torch

from tests.helpers.models import tiny_llama
from specadapt.engine.kv import RaggedKVCache
from specadapt.engine.packing import Packing, active_packing, packed_attention


def _chunk(g, counts, vocab=40):
    width = max(counts)
    ids = torch.randint(0, vocab, (len(counts), width), generator=g)
    return ids, torch.tensor(counts, dtype=torch.int64)


def _run(model, steps, packed, batch=3, chunk_masks=None):
    kv = RaggedKVCache(model, batch, compact_min_waste=2, compact_fraction=0.0, packed=packed, pack_below=1.0)
    outs = []
    for i, (ids, counts, keep) in enumerate(steps):
        kwargs = {}
        if chunk_masks is not None and chunk_masks[i] is not None:
            kwargs = chunk_masks[i]
        out = kv.forward(ids, counts, return_outputs=True, output_hidden_states=True, **kwargs)
        outs.append((out.logits.clone(), [h.clone() for h in out.hidden_states], counts))
        if keep is not None:
            kv.truncate(kv.lengths - keep)
    return kv, outs


def _steps(seed=0):
    g = torch.Generator().manual_seed(seed)
    plan = [((5, 1, 9), None), ((4, 1, 3), torch.tensor([2, 0, 1])), ((8, 2, 1), torch.tensor([5, 1, 0])),
            ((1, 1, 1), None), ((3, 6, 2), torch.tensor([1, 2, 0]))]
    return [(*_chunk(g, counts), keep) for counts, keep in plan]


def test_packed_equals_padded_at_every_real_token():
    model = tiny_llama(vocab=40, layers=3, seed=4)
    steps = _steps()
    kv_pad, pad = _run(model, steps, packed=False)
    kv_pack, pack = _run(model, steps, packed=True)
    # every step with holes ran packed (the (1, 1, 1) step has none and runs as is)
    assert kv_pack.num_packed_forwards == 4 and kv_pad.num_packed_forwards == 0
    for (lp, hp, counts), (lq, hq, _) in zip(pad, pack):
        real = torch.arange(lp.shape[1])[None, :] < counts[:, None]
        torch.testing.assert_close(lq[real], lp[real], atol=1e-4, rtol=1e-4)
        for a, b in zip(hp, hq):
            torch.testing.assert_close(b[real], a[real], atol=1e-4, rtol=1e-4)
        assert torch.all(lq[~real] == 0)  # holes are zeros, never computed
    assert torch.equal(kv_pack.lengths, kv_pad.lengths) and torch.equal(kv_pack.valid, kv_pad.valid)


def test_packed_forward_feeds_only_the_real_tokens_to_the_model():
    model = tiny_llama(vocab=40, layers=1, seed=5)
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        ids, counts = _chunk(torch.Generator().manual_seed(1), (5, 2, 3))
        RaggedKVCache(model, 3, packed=True, pack_below=1.0).forward(ids, counts)
        RaggedKVCache(model, 3, packed=False).forward(ids, counts)
    finally:
        hook.remove()
    assert seen == [(1, 10), (3, 5)]


def test_packed_tree_chunks_and_logits_to_keep():
    """A token-tree chunk (ancestor mask, depth positions) and logits_to_keep give the padded results."""
    model = tiny_llama(vocab=40, layers=2, seed=6)
    g = torch.Generator().manual_seed(2)
    prefix_ids, prefix_counts = _chunk(g, (4, 6))
    tree_ids = torch.randint(0, 40, (2, 5), generator=g)
    counts = torch.tensor([5, 3])
    # row 0: root -> {1, 2}, 1 -> 3, 2 -> 4 ; row 1: root -> 1 -> 2
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 0, 0]]
    mask = torch.zeros(2, 5, 5, dtype=torch.bool)
    depth = torch.zeros(2, 5, dtype=torch.int64)
    for r, par in enumerate(parents):
        for i in range(5):
            j = i
            while j >= 0:
                mask[r, i, j] = True
                j = par[j] if j > 0 else -1
            depth[r, i] = int(mask[r, i].sum()) - 1
    results = {}
    for packed in (False, True):
        kv = RaggedKVCache(model, 2, packed=packed, pack_below=1.0)
        last = kv.forward(prefix_ids, prefix_counts, logits_to_keep=2)
        tree = kv.forward(tree_ids, counts, chunk_mask=mask, chunk_positions=depth)
        results[packed] = (last, tree)
    assert results[True][0].shape == results[False][0].shape == (2, 2, 40)
    # logits_to_keep=2 keeps the chunk's last 2 columns: row 1 (6 real tokens) has both, row 0 (4) none
    torch.testing.assert_close(results[True][0][1], results[False][0][1], atol=1e-4, rtol=1e-4)
    assert torch.all(results[True][0][0] == 0)
    real = torch.arange(5)[None, :] < counts[:, None]
    torch.testing.assert_close(results[True][1][real], results[False][1][real], atol=1e-4, rtol=1e-4)


def test_packing_round_trip_and_errors():
    valid = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    packing = Packing.from_valid(valid, "sdpa")
    chunk = torch.arange(9.0).view(3, 3, 1)
    packed = packing.pack(chunk)
    assert packed.squeeze(-1).tolist() == [[0.0, 1.0, 6.0]]
    back = packing.unpack(packed)
    assert torch.equal(back[valid], chunk[valid]) and torch.all(back[~valid] == 0)
    assert active_packing() is None
    with pytest.raises(RuntimeError, match="outside a packed forward"):
        packed_attention(None, torch.zeros(1, 1, 3, 2), None, None, None)
    with pytest.raises(ValueError, match="fast_append"):
        RaggedKVCache(tiny_llama(vocab=8, layers=1), 1, fast_append=False, packed=True)


def test_the_model_attention_implementation_is_restored():
    model = tiny_llama(vocab=40, layers=1, seed=7)
    before = model.config._attn_implementation
    ids, counts = _chunk(torch.Generator().manual_seed(3), (3, 1))
    RaggedKVCache(model, 2, packed=True).forward(ids, counts)
    assert model.config._attn_implementation == before and active_packing() is None


def test_pack_below_leaves_nearly_full_chunks_padded():
    model = tiny_llama(vocab=40, layers=1, seed=8)
    g = torch.Generator().manual_seed(4)
    kv = RaggedKVCache(model, 2, packed=True, pack_below=0.5)
    kv.forward(*_chunk(g, (4, 3)))  # 7 of 8 real: padded
    assert kv.num_packed_forwards == 0
    kv.forward(*_chunk(g, (4, 1)))  # 5 of 8: padded
    assert kv.num_packed_forwards == 0
    kv.forward(*_chunk(g, (4, 0)))  # 4 of 8: packed
    assert kv.num_packed_forwards == 1
    with pytest.raises(ValueError, match="pack_below"):
        RaggedKVCache(model, 1, packed=True, pack_below=1.5)


def test_target_probs_are_computed_on_real_rows_only():
    from specadapt.engine.loop import _real_row_probs
    from specadapt.sampling import SamplingParams, logits_to_probs

    params = SamplingParams(0.8, 0.9)
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(5))
    num_real = torch.tensor([4, 1, 2])
    probs = _real_row_probs(logits, num_real, params)
    full = logits_to_probs(logits, params)
    real = torch.arange(4)[None, :] < num_real[:, None]
    torch.testing.assert_close(probs[real], full[real])
    assert torch.all(probs[~real] == 1.0 / 50)
    torch.testing.assert_close(_real_row_probs(logits, torch.tensor([4, 4, 4]), params), full)


def test_packed_forward_with_eager_attention():
    """A model on transformers' eager attention packs through its own modeling file's eager function."""
    model = tiny_llama(vocab=40, layers=2, seed=9)
    model.config._attn_implementation_internal = "eager"
    steps = _steps(seed=3)
    _, pad = _run(model, steps, packed=False)
    kv, pack = _run(model, steps, packed=True)
    assert kv.num_packed_forwards > 0
    for (lp, _, counts), (lq, _, _) in zip(pad, pack):
        real = torch.arange(lp.shape[1])[None, :] < counts[:, None]
        torch.testing.assert_close(lq[real], lp[real], atol=1e-4, rtol=1e-4)
