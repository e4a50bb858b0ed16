"""The EAGLE head's deferred catch-up queues (engine/pending.py) against a per-row list model: any sequence of
appends (equal and ragged counts, and plain rounds' queued one-pair appends), partial takes, finished rows and
joined rows returns every row's features in commit order, each exactly once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specadapt.engine.pending import PendingFeatures

F = 3


def _check(store: PendingFeatures, model: list[list[torch.Tensor]]) -> None:
    assert store.counts.tolist() == [len(q) for q in model]


op = st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(0, 4), min_size=1, max_size=1), st.booleans()),
    st.tuples(st.just("append_one"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("take"), st.integers(0, 2**16), st.booleans()),
    st.tuples(st.just("peek"), st.integers(0, 2**16), st.booleans()),
    st.tuples(st.just("select"), st.integers(0, 2**16), st.booleans()),
    st.tuples(st.just("join"), st.lists(st.integers(0, 5), min_size=1, max_size=3), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(initial=st.lists(st.integers(0, 6), min_size=1, max_size=4), ops=st.lists(op, max_size=25),
       reserve=st.sampled_from([0, 3, 64]))
def test_queues_match_a_per_row_list_model(initial, ops, reserve):
    counter = [0.0]

    def fresh(n_rows: int, width: int) -> torch.Tensor:  # distinct values, so any mix-up shows
        n = n_rows * max(width, 1) * F
        values = torch.arange(counter[0], counter[0] + n).reshape(n_rows, max(width, 1), F)
        counter[0] += n
        return values

    store = PendingFeatures(F, reserve=reserve)
    counts = torch.tensor(initial)
    feats = fresh(len(initial), max(initial))
    store.add_rows(feats, counts)
    model = [[feats[r, j] for j in range(c)] for r, c in enumerate(initial)]
    _check(store, model)
    for kind, arg, flag in ops:
        batch = len(model)
        if kind == "append" and batch:
            # equal counts (the fast path) or ragged ones
            c = torch.full((batch,), arg[0]) if flag else torch.randint(0, 4, (batch,), generator=torch.Generator().manual_seed(arg[0]))
            width = int(c.max())
            f = fresh(batch, width)
            store.append(f, c)
            for r in range(batch):
                model[r] += [f[r, j] for j in range(int(c[r]))]
        elif kind == "append_one" and batch:
            for _ in range(arg):  # plain rounds: queued, written by the next other call
                f = fresh(batch, 1)
                store.append_one(f if flag else f[:, 0])
                for r in range(batch):
                    model[r].append(f[r, 0])
            if flag:  # leave the queue to the next operation (reading counts would write it)
                continue
        elif kind == "take" and batch:
            rows = torch.tensor([(arg >> r) & 1 == 1 or flag for r in range(batch)])
            got, taken = store.take(rows)
            for r in range(batch):
                want = model[r] if rows[r] else []
                assert int(taken[r]) == len(want)
                for j, v in enumerate(want):
                    assert torch.equal(got[r, j], v)
                if rows[r]:
                    model[r] = []
        elif kind == "peek" and batch:
            # a probe's scratch read of the newest `window` pairs (left queued), then the rows that fit dropped
            # (bit 10: one window per row, as a speculative round's rows outside the budget and inside it read)
            rows = torch.tensor([(arg >> r) & 1 == 1 for r in range(batch)])
            per_row = (arg >> 10) & 1 == 1
            windows = ([1 + (arg >> (11 + 2 * r)) % 4 for r in range(batch)] if per_row
                       else [1 + (arg >> 8) % 4] * batch)
            got, counts = store.peek(rows, torch.tensor(windows) if per_row else windows[0])
            for r in range(batch):
                want = model[r][-windows[r]:] if rows[r] else []
                assert int(counts[r]) == len(want)
                for j, v in enumerate(want):
                    assert torch.equal(got[r, j], v)
            if flag:
                fits = rows & torch.tensor([len(q) <= w for q, w in zip(model, windows)])
                store.drop(fits)
                model = [[] if bool(fits[r]) else q for r, q in enumerate(model)]
        elif kind == "select" and batch:
            keep = [r for r in range(batch) if (arg >> r) & 1 == 1]
            if flag:
                keep = keep[::-1]
            store.select(torch.tensor(keep, dtype=torch.int64))
            model = [model[r] for r in keep]
        elif kind == "join":
            c = torch.tensor(arg)
            f = fresh(len(arg), max(arg))
            store.add_rows(f if max(arg) else None, c)
            model += [[f[r, j] for j in range(n)] for r, n in enumerate(arg)]
        _check(store, model)
    got, taken = store.take(torch.ones(len(model), dtype=torch.bool))
    for r, queue in enumerate(model):
        assert int(taken[r]) == len(queue)
        for j, v in enumerate(queue):
            assert torch.equal(got[r, j], v)
    assert not store.counts.any()


def test_finished_rows_free_their_slots_for_joined_rows():
    store = PendingFeatures(F)
    store.add_rows(torch.ones(4, 2, F), torch.full((4,), 2))
    slots = store._store.shape[0]
    store.select(torch.tensor([3, 1]))
    store.add_rows(torch.zeros(2, 1, F), torch.ones(2, dtype=torch.int64))
    assert store._store.shape[0] == slots  # the two freed slots were reused, nothing grew
    got, taken = store.take(torch.ones(4, dtype=torch.bool))
    assert taken.tolist() == [2, 2, 1, 1]
    assert got[:2, :2].eq(1).all() and got[2:, :1].eq(0).all()


def test_a_reserved_store_is_not_reallocated_while_the_queues_fit():
    store = PendingFeatures(F, reserve=40)
    store.add_rows(torch.ones(3, 2, F), torch.full((3,), 2))
    buffer = store._store.data_ptr()
    for _ in range(30):
        store.append_one(torch.ones(3, F))
    store.append(torch.ones(3, 8, F), torch.tensor([8, 0, 3]))
    assert store.counts.tolist() == [40, 32, 35] and store._store.data_ptr() == buffer
    store.append_one(torch.ones(3, F))  # row 0 past the reserve: the store grows, its queues intact
    assert store.counts.tolist() == [41, 33, 36] and store._store.data_ptr() != buffer
    got, taken = store.take(torch.ones(3, dtype=torch.bool))
    assert taken.tolist() == [41, 33, 36] and got[0].eq(1).all()


def test_the_reserve_stays_within_its_cap_as_rows_join_one_by_one(monkeypatch):
    """A store that gains slots one join at a time (a server's requests) keeps reserve x slots within the cap:
    the reserved width shrinks to what the cap allows per slot, never below the queued pairs' need."""
    import specadapt.engine.pending as pending

    monkeypatch.setattr(pending, "_RESERVE_BYTES", 100 * F * 4)  # 100 pairs over all slots
    store = PendingFeatures(F, reserve=80)
    for r in range(8):
        store.add_rows(torch.full((1, 2, F), float(r)), torch.tensor([2]))
        assert store._store.numel() * 4 <= 100 * F * 4
        assert store.counts.tolist() == [2] * (r + 1)
    for _ in range(30):  # queues past the cap's width: the store grows by the pairs' need (doubling)
        store.append_one(torch.ones(8, F))
    got, taken = store.take(torch.ones(8, dtype=torch.bool))
    assert taken.tolist() == [32] * 8 and store._store.shape[1] >= 32
    for r in range(8):
        assert got[r, :2].eq(r).all() and got[r, 2:32].eq(1).all()


def test_unwritten_entries_are_never_returned():
    """The store is uninitialised memory: whatever lies past a row's queue (here NaN) reads as zeros."""
    store = PendingFeatures(F, reserve=16)
    store.add_rows(torch.ones(3, 4, F), torch.tensor([4, 1, 0]))
    store._store[:, 4:] = float("nan")
    store._store[1, 1:4] = float("nan")
    store._store[2, :4] = float("nan")
    for got, counts in (store.peek(torch.ones(3, dtype=torch.bool), 3), store.take(torch.ones(3, dtype=torch.bool))):
        assert not got.isnan().any()
        for r, c in enumerate(counts.tolist()):
            assert got[r, :c].eq(1).all() and got[r, c:].eq(0).all()


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="reserve"):
        PendingFeatures(F, reserve=-1)
    store = PendingFeatures(F)
    with pytest.raises(ValueError, match="features"):
        store.add_rows(torch.zeros(2, 1, F), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="features"):
        store.add_rows(torch.zeros(1, 2, F + 1), torch.tensor([2]))
    store.add_rows(None, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="features"):
        store.append_one(torch.zeros(3, 1, F))  # 3 rows for a batch of 2
    with pytest.raises(ValueError, match="window"):
        store.peek(torch.ones(2, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="window"):
        store.peek(torch.ones(2, dtype=torch.bool), torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="window"):
        store.peek(torch.ones(2, dtype=torch.bool), torch.tensor([3, 2, 1]))
    with pytest.raises(ValueError, match="rows"):
        store.peek(torch.ones(3, dtype=torch.bool), 2)
