"""CUDA-graph safety of Test-Time Speculation (GPU only): a captured draft forward replays with the weights
published by the updater, without re-capture, because publishes copy in place (addresses never change)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.models import tiny_llama
from specadapt.engine.eagle import EagleHead, default_feature_layers
from specadapt.tts import TTSConfig, TTSUpdater

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph capture of the draft forward)"
)


def _capture(fn):
    """Warm up on a side stream, then capture ``fn`` once; returns (graph, static output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_graph_replay_after_publish_equals_eager_with_new_weights():
    target = tiny_llama(vocab=64, layers=3, hidden=64, seed=1).cuda()
    head = EagleHead(target.config, default_feature_layers(3), torch.arange(0, 64, 2)).cuda().attach(target)
    head.requires_grad_(False).eval()
    n = 8
    ids = torch.randint(0, 64, (2, n), device="cuda")
    feats = torch.randn(2, n, 3 * 64, device="cuda")
    mask = torch.where(torch.ones(n, n, dtype=torch.bool, device="cuda").tril(), 0.0, torch.finfo(torch.float32).min)
    mask = mask[None, None].expand(2, 1, n, n).contiguous()
    pos = torch.arange(n, device="cuda")[None].expand(2, n).contiguous()

    def forward(module=head):
        return module(ids, feats, attention_mask=mask, position_ids=pos).logits

    graph, static_logits = _capture(forward)
    first = static_logits.clone()
    teacher = torch.softmax(torch.randn(2, n, 32, device="cuda"), -1)

    def loss_fn(module, examples):
        logq = torch.log_softmax(forward(module), -1)
        return -(teacher * logq).sum(-1).mean()

    addresses = [p.data_ptr() for p in head.parameters()]
    updater = TTSUpdater(head, lambda name, p: True, loss_fn, TTSConfig(stride=1, lr=1e-2), share=[head._shared])
    for _ in range(6):
        updater.end_round(["example"], 2.0)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            eager = forward()
        torch.testing.assert_close(static_logits, eager, atol=1e-4, rtol=1e-4)
    updater.close()
    assert updater.stats.publishes >= 4 and updater.stats.updates >= 5
    assert [p.data_ptr() for p in head.parameters()] == addresses
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.allclose(static_logits, first), "the replayed graph never saw new weights"


def test_publish_on_side_stream_never_touches_target_weights():
    torch.manual_seed(0)
    shared = nn.Embedding(16, 8).cuda().requires_grad_(False)
    own = nn.Linear(8, 16).cuda().requires_grad_(False)
    model = nn.ModuleDict({"shared": shared, "own": own})
    before = shared.weight.clone()
    x = torch.randint(0, 16, (4,), device="cuda")
    updater = TTSUpdater(model, lambda name, p: name.startswith("own."),
                         lambda m, ex: m["own"](m["shared"](x)).logsumexp(-1).mean(), TTSConfig(stride=2))
    for _ in range(6):
        updater.end_round(["example"], 1.0)
    updater.close()
    assert torch.equal(shared.weight, before) and updater.stats.updates > 0
