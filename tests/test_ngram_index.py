"""The n-gram draft's incremental index proposes what the scan of the whole history proposes, at every round."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specadapt.engine.drafts import NgramDraft, NgramIndex, ngram_lookup


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=30),
       max_ngram=st.integers(1, 5), min_ngram=st.integers(1, 5), max_tokens=st.integers(0, 6))
def test_the_index_equals_the_scan_as_the_history_grows(tokens, chunks, max_ngram, min_ngram, max_tokens):
    min_ngram = min(min_ngram, max_ngram)
    history = tokens[:1]
    index = NgramIndex(history, max_ngram, min_ngram)
    rest, i = tokens[1:], 0
    for chunk in chunks:  # rounds append 1-4 tokens, as accepted drafts do
        expected = ngram_lookup(np.asarray(history, dtype=np.int64), max_tokens, max_ngram, min_ngram).tolist()
        assert index.lookup(max_tokens) == expected
        history.extend(rest[i : i + chunk])
        i += chunk


def test_the_draft_reindexes_a_new_or_shortened_history_and_drops_finished_requests():
    draft = NgramDraft(max_ngram=3)
    a, b = [1, 2, 3, 1, 2], [5, 6, 5]
    limits = torch.tensor([2, 2])
    first = draft.propose([a, b], limits, 10)
    assert first.tokens.tolist() == [[3, 1], [6, 5]] and first.num_tokens.tolist() == [2, 2]
    assert first.probs[0, 0, 3] == 1.0 and first.probs[1, 1, 5] == 1.0
    a.extend([3, 1])  # 1 2 3 1 2 3 1: the suffix 2 3 1 last occurred at index 1, followed by 2 3
    again = draft.propose([a], limits[:1], 10)  # b left the batch
    assert len(draft._indexes) == 1
    assert again.tokens.tolist() == [[2, 3]]
    del a[4:]  # 1 2 3 1, rolled back in place: indexed afresh, not read through a stale table
    assert draft.propose([a], limits[:1], 10).tokens.tolist() == [[2, 3]]
    assert ngram_lookup(np.asarray(a), 2, 3, 1).tolist() == [2, 3]


def test_a_miss_proposes_nothing():
    proposal = NgramDraft().propose([[1, 2, 3]], torch.tensor([3]), 5)
    assert proposal.num_tokens.tolist() == [0] and proposal.tokens.shape == (1, 3)
    assert not bool(proposal.probs.any())


@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_the_continuation_may_run_into_the_suffix(max_tokens):
    history = [7, 7, 7, 7]
    assert NgramIndex(history, 4, 1).lookup(max_tokens) == ngram_lookup(np.asarray(history), max_tokens, 4, 1).tolist()
