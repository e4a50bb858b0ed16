"""RaggedKVCache: ragged chunks, per-row rollback, compaction and row selection equal fresh forwards."""

import torch

from tests.helpers.models import tiny_llama
from specadapt.engine.kv import RaggedKVCache


def _fresh_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def _pad(seqs):
    width = max(max(len(s) for s in seqs), 1)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
    return ids, torch.tensor([len(s) for s in seqs])


def test_ragged_chunks_rollback_and_compaction_match_fresh_forwards():
    model = tiny_llama(vocab=40, layers=2, seed=1)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (5, 1, 9)]
    cache = RaggedKVCache(model, 3, compact_min_waste=4, compact_fraction=0.0)
    ids, counts = _pad(seqs)
    cache.forward(ids, counts)
    for step in range(6):
        chunk = [torch.randint(0, 40, (k,), generator=g).tolist() for k in (4, 2, 3)]
        ids, counts = _pad(chunk)
        logits = cache.forward(ids, counts)
        for r in range(3):
            want = _fresh_logits(model, seqs[r] + chunk[r])[-len(chunk[r]) :]
            torch.testing.assert_close(logits[r, : len(chunk[r])], want, atol=1e-4, rtol=1e-4)
        keep = [(step + r) % (len(chunk[r]) + 1) for r in range(3)]
        for r in range(3):
            seqs[r] = seqs[r] + chunk[r][: keep[r]]
        cache.truncate(torch.tensor([len(s) for s in seqs]))
        assert cache.lengths.tolist() == [len(s) for s in seqs]
    assert cache.num_compactions > 0
    # after everything, one more token per row still matches a fresh forward
    nxt = [[1], [2], [3]]
    logits = cache.forward(torch.tensor(nxt), torch.ones(3, dtype=torch.int64))
    for r in range(3):
        torch.testing.assert_close(logits[r, 0], _fresh_logits(model, seqs[r] + nxt[r])[-1], atol=1e-4, rtol=1e-4)


def test_select_rows_and_bad_truncate():
    model = tiny_llama(vocab=40, layers=1, seed=2)
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    cache = RaggedKVCache(model, 3)
    ids, counts = _pad(seqs)
    cache.forward(ids, counts)
    cache.select(torch.tensor([2, 0]))
    logits = cache.forward(torch.tensor([[10], [11]]), torch.ones(2, dtype=torch.int64))
    torch.testing.assert_close(logits[0, 0], _fresh_logits(model, seqs[2] + [10])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, 0], _fresh_logits(model, seqs[0] + [11])[-1], atol=1e-4, rtol=1e-4)
    import pytest

    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(torch.tensor([99, 1]))


def test_rollback_is_not_a_no_op():
    """Sanity: without the rollback the next logits differ (the test above can fail)."""
    model = tiny_llama(vocab=40, layers=2, seed=3)
    cache = RaggedKVCache(model, 1)
    cache.forward(torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([5]))
    stale = cache.forward(torch.tensor([[6]]), torch.tensor([1]))[0, 0]
    torch.testing.assert_close(stale, _fresh_logits(model, [1, 2, 3, 4, 5, 6])[-1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(stale, _fresh_logits(model, [1, 2, 3, 6])[-1], atol=1e-3)


def test_appends_write_into_spare_capacity_and_adopt_replaced_tensors():
    """Appending copies only the new tokens (the buffer stays put while capacity lasts); compaction / row
    selection replace the tensors and the next append adopts them into a fresh buffer with the same contents."""
    torch.manual_seed(0)
    model = tiny_llama(vocab=32, layers=2)
    kv = RaggedKVCache(model, 2, compact_min_waste=1, compact_fraction=0.0)
    kv.forward(torch.randint(32, (2, 5)), torch.tensor([5, 5]))
    layer = kv.cache.layers[0]
    start = layer.keys.data_ptr()
    for _ in range(10):
        kv.forward(torch.randint(32, (2, 1)), torch.tensor([1, 1]))
        assert layer.keys.data_ptr() == start and layer.values.data_ptr() == layer._vbuf.data_ptr()
    assert layer.keys.shape[2] == 15 and layer._kbuf.shape[2] >= 15
    kv.forward(torch.randint(32, (2, 3)), torch.tensor([3, 1]))
    kv.forward(torch.randint(32, (2, 1)), torch.tensor([1, 1]))  # row 1 now has two holes before its last token
    kv.compact()  # gathers into new tensors
    before = layer.keys.clone()
    kv.forward(torch.randint(32, (2, 1)), torch.tensor([1, 1]))
    assert torch.equal(layer.keys[:, :, : before.shape[2]], before)  # adopted with its contents
    assert layer.keys.data_ptr() == layer._kbuf.data_ptr()


def test_fast_append_matches_the_concatenating_cache():
    """Preallocated appends + grouped-query SDPA give the logits of transformers' own DynamicCache path."""
    torch.manual_seed(1)
    model = tiny_llama(vocab=32, layers=2)
    chunks = [(torch.randint(32, (2, 7)), torch.tensor([7, 5])), (torch.randint(32, (2, 3)), torch.tensor([3, 2])),
              (torch.randint(32, (2, 4)), torch.tensor([1, 4]))]
    outs = {}
    for fast in (False, True):
        kv = RaggedKVCache(model, 2, fast_append=fast)
        outs[fast] = []
        for i, (ids, n) in enumerate(chunks):
            outs[fast].append(kv.forward(ids, n))
            if i == 1:
                kv.truncate(kv.lengths - torch.tensor([2, 1]))
    for slow, fast in zip(outs[False], outs[True]):
        assert torch.allclose(slow, fast, atol=1e-5, rtol=1e-5)


def test_grouped_query_sdpa_is_an_argument_of_the_call_not_the_environment(monkeypatch):
    """kv.forward runs grouped-query SDPA (no repeat_kv copy) without writing os.environ (issue 17: the variable
    it used to set around each call leaked into the TTS trainer thread), restores the model's attention
    implementation, and the switch is invisible to other threads."""
    import os
    import threading

    from specadapt.engine import sdpa_gqa

    class RecordingEnviron(dict):
        writes: list = []

        def __setitem__(self, key, value):
            self.writes.append(("set", key))
            super().__setitem__(key, value)

        def __delitem__(self, key):
            self.writes.append(("del", key))
            super().__delitem__(key)

        def pop(self, key, *default):
            self.writes.append(("pop", key))
            return super().pop(key, *default)

    env = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", env)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False), kwargs.get("attn_mask") is None))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny_llama(vocab=32, layers=2)
    assert model.config._attn_implementation == "sdpa"
    kv = RaggedKVCache(model, 2)
    kv.forward(torch.randint(32, (2, 5)), torch.tensor([5, 3]))
    kv.forward(torch.randint(32, (2, 2)), torch.tensor([1, 2]))
    assert env.writes == []
    assert calls and all(c == (4, 2, True, False) for c in calls)  # 4 query heads on 2 key/value heads, masked
    assert model.config._attn_implementation == "sdpa"
    seen = []
    with sdpa_gqa.grouped_query():
        worker = threading.Thread(target=lambda: seen.append(sdpa_gqa._FORCE.get()))
        worker.start()
        worker.join()
        seen.append(sdpa_gqa._FORCE.get())
    assert seen == [False, True] and not sdpa_gqa._FORCE.get()
