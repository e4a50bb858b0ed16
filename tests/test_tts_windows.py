"""The EAGLE head's TTS update in shared passes (specadapt.engine.tts_windows): examples whose windows are
stretches of one stream share one pass over the union, and each example's logits and gradients are those of its
own forward (EagleDraftStudent.logits_one)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import make_head
from specadapt.engine.tts_students import EagleDraftStudent
from specadapt.engine.tts_windows import group_windows, shared_window_logits


def _stream(head, length, seed):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(length, head.fuse.in_features, generator=g)
    tokens = head.draft_vocab[torch.randint(0, head.draft_vocab.shape[0], (length,), generator=g)]
    return features, tokens


def _examples(head):
    """Windows of 6 pairs sliding over one stream (the first ones shorter, as at a request's start), windows of a
    second stream, a window that repeats an earlier one, and drafts of ragged lengths."""
    f, t = _stream(head, 20, 1)
    f2, t2 = _stream(head, 9, 2)
    windows = [(0, 3), (0, 5), (1, 7), (4, 10), (9, 15), (13, 19)]  # [start, end) in the first stream
    contexts = [(f[s:e], t[s:e]) for s, e in windows]
    contexts += [(f2[0:6], t2[0:6]), (f[4:10], t[4:10]), (f2[3:9], t2[3:9])]
    g = torch.Generator().manual_seed(7)
    drafts = [head.draft_vocab[torch.randint(0, head.draft_vocab.shape[0], (1 + i % 3,), generator=g)]
              for i in range(len(contexts))]
    return contexts, drafts


def test_windows_of_one_stream_form_one_group(tiny_target):
    head = make_head(tiny_target.model)
    contexts, _ = _examples(head)
    groups = group_windows(contexts)
    assert len(groups) == 2  # the first stream (with the repeated window) and the second
    first = groups[0]
    assert [m[0] for m in first.members] == [0, 1, 2, 3, 4, 5, 7] and first.tokens.shape[0] == 19
    for i, s, e in first.members:
        assert torch.equal(first.features[s:e], contexts[i][0]) and torch.equal(first.tokens[s:e], contexts[i][1])
    assert len(group_windows(contexts, slots=[0] * 4 + [1] * 5)) == 4  # other adapter slots never share a pass
    # the same tokens with other features (another request that wrote the same text) share nothing
    f, t = contexts[3]
    assert len(group_windows([contexts[2], (f + 1.0, t)])) == 2
    with pytest.raises(ValueError, match="empty context window"):
        group_windows([(f[:0], t[:0])])


def test_shared_passes_equal_each_examples_own_forward_values_and_gradients(tiny_target):
    head = make_head(tiny_target.model).requires_grad_(True)
    contexts, drafts = _examples(head)
    together = shared_window_logits(head, contexts, drafts)
    assert together.shape[:2] == (len(contexts), 3)
    for i, (ctx, d) in enumerate(zip(contexts, drafts)):
        alone = EagleDraftStudent.logits_one(head, ctx, d)
        torch.testing.assert_close(together[i, : d.shape[0]], alone, atol=1e-4, rtol=1e-4)
    # gradients of a loss over the supervised positions: the same as summing the per-example forwards
    weights = torch.randn(together.shape[:2])
    valid = torch.arange(3)[None] < torch.tensor([d.shape[0] for d in drafts])[:, None]
    head.zero_grad()
    (together.logsumexp(-1) * weights * valid).sum().backward()
    shared = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad()
    total = sum((EagleDraftStudent.logits_one(head, c, d).logsumexp(-1) * weights[i, : d.shape[0]]).sum()
                for i, (c, d) in enumerate(zip(contexts, drafts)))
    total.backward()
    assert shared and set(shared) == {n for n, p in head.named_parameters() if p.grad is not None}
    for name, p in head.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(shared[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_shared_window_logits_rejects_bad_input(tiny_target):
    head = make_head(tiny_target.model)
    contexts, drafts = _examples(head)
    with pytest.raises(ValueError, match="one drafts tensor per context"):
        shared_window_logits(head, contexts, drafts[:-1])
    with pytest.raises(ValueError, match="at least one draft"):
        shared_window_logits(head, contexts[:1], [drafts[0][:0]])
