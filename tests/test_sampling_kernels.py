"""The fused sampling transform and coin-driven sampling (csrc/cpu/sampling_cpu.cpp) against the PyTorch
reference of python/specadapt/sampling.py, on every instruction set the CPU has."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specadapt import kernels
from specadapt.sampling import SamplingParams, logits_to_probs, logits_to_probs_reference, sample_from_probs

pytestmark = pytest.mark.skipif(not kernels.has_op_for("sampling_probs", torch.device("cpu")),
                                reason="specadapt._C built without the sampling op")


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def isa(request):
    ops = torch.ops.specadapt
    best = ops.native_set_isa("")
    order = ["scalar", "avx2", "avx512"]
    if order.index(request.param) > order.index(best):
        pytest.skip(f"this CPU has no {request.param}")
    ops.native_set_isa(request.param)
    yield request.param
    ops.native_set_isa(best)


def _boundary_only(got: torch.Tensor, want: torch.Tensor, probs: torch.Tensor, top_p: float) -> None:
    """Supports may differ only at tokens whose ranked mass before them is within rounding of top_p."""
    for r in range(got.shape[0]):
        diff = ((got[r] > 0) != (want[r] > 0)).nonzero().flatten()
        if diff.numel() == 0:
            continue
        ordered, order = probs[r].double().sort(descending=True, stable=True)
        before = (ordered.cumsum(0) - ordered)[torch.argsort(order)]
        assert diff.numel() <= 2 and bool(((before[diff] - top_p).abs() < 1e-5).all()), (r, diff, before[diff])


@pytest.mark.parametrize("params", [SamplingParams(1.0, 0.95, 0), SamplingParams(0.6, 0.9, 50),
                                    SamplingParams(1.3, 0.5, 0), SamplingParams(1.0, 1.0, 0),
                                    SamplingParams(0.8, 1.0, 7), SamplingParams(0.0)])
def test_fused_transform_matches_the_reference(params, isa):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 3000, generator=g) * 3
    logits[0, :5] = 30.0  # ties at the top (greedy: lowest id; top-k keeps ties)
    got = logits_to_probs(logits, params)
    want = logits_to_probs_reference(logits, params)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.sum(-1), torch.ones(12), atol=1e-5, rtol=0)
    if params.greedy:
        assert torch.equal(got, want) and int(got[0].argmax()) == 0
        return
    _boundary_only(got, want, torch.softmax(logits / params.temperature, -1), params.top_p)
    same = ((got > 0) == (want > 0)).all(-1)
    torch.testing.assert_close(got[same], want[same], atol=2e-6, rtol=1e-4)


def test_top_k_keeps_ties_and_masked_tokens_get_zero():
    logits = torch.tensor([[1.0, 4.0, 3.0, 3.0, 0.0, -float("inf")]])
    probs = logits_to_probs(logits, SamplingParams(1.0, 1.0, 2))
    assert (probs[0] > 0).tolist() == [False, True, True, True, False, False]


def test_sample_from_probs_is_the_inverse_cdf_and_skips_zero_mass():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 50, generator=g)
    probs[:, ::3] = 0.0
    coins = torch.rand(64, generator=g, dtype=torch.float64)
    got = sample_from_probs(probs, coins)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (coins * cdf[:, -1])[:, None], right=True).squeeze(1)
    assert torch.equal(got, want)
    assert bool((probs[torch.arange(64), got] > 0).all())


def test_sampling_law_chi_square():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.25, 0.05]])
    n = 20000
    coins = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    draws = sample_from_probs(probs.expand(n, -1).contiguous(), coins)
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[1] == 0
    keep = probs[0] > 0
    p = stats.chisquare(counts[keep].numpy(), (probs[0][keep] * n).double().numpy()).pvalue
    assert p > 1e-3, p


def test_bad_sampling_inputs_raise():
    with pytest.raises((ValueError, RuntimeError), match="no positive"):
        sample_from_probs(torch.zeros(1, 4), torch.zeros(1, dtype=torch.float64))
    with pytest.raises((ValueError, RuntimeError), match=r"\[0, 1\)"):
        sample_from_probs(torch.ones(1, 4), torch.ones(1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="top_p"):
        torch.ops.specadapt.sampling_probs(torch.zeros(1, 4), 1.0, 0, 0.0)


@pytest.mark.parametrize("vocab,first_tie,ties", [(64, 0, 30), (64, 3, 30), (64, 8, 30), (64, 13, 30), (75, 62, 12)])
def test_top_p_cut_through_ties_keeps_the_lowest_ids(vocab, first_tie, ties, isa):
    """Tokens tie at the cut probability, starting at several lane offsets: the kept ones are exactly the lowest
    ids among them (the vector cut compares ids lane by lane in the block that holds the cut; with 75 tokens the
    cut and the most likely token lie in the 3-token tail after the last full vector)."""
    top = 6.0
    logits = torch.full((1, vocab), -4.0)
    logits[0, vocab - 1] = top  # the most likely token, ranked first
    tie_ids = torch.arange(first_tie, first_tie + ties)
    logits[0, tie_ids] = 1.0
    p = torch.softmax(logits[0].double(), -1)
    # keep the top token and 11 of the tied ones: top_p halfway between 10 and 11 tied tokens' cumulative mass
    top_p = float(p[vocab - 1] + 10.5 * p[first_tie])
    got = logits_to_probs(logits, SamplingParams(1.0, top_p, 0))
    want = logits_to_probs_reference(logits, SamplingParams(1.0, top_p, 0))
    kept = (got[0] > 0).nonzero().flatten().tolist()
    assert kept == tie_ids[:11].tolist() + [vocab - 1]
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)
