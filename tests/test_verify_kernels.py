"""Fused C++ verification kernels (chain, block, GBV) against the float64 references.

Same coins -> same tokens on random inputs (float32 and bfloat16, ragged rows, zeros from top-k);
Monte Carlo chi-square (1e6 rounds, fixed seeds) of the fused kernels against the exact one-round law;
bad input raises ValueError naming the argument; opcheck of the registered ops.
"""


import numpy as np
import pytest
import torch
from scipy import stats

from tests.helpers.batches import random_batch as _random_batch, tree_batch as _tree_batch
from tests.helpers.exact_law import Float32Tables, chi_square_pvalue, gbv_outcomes, sample_path_batch, single_path_outcomes
from specadapt import kernels
from specadapt.verification import ROUND_LAWS, VERIFY_RULES
from specadapt.verification.gbv import gbv_verify as gbv_reference

pytestmark = pytest.mark.skipif(not kernels.has_op_for("chain_verify", torch.device("cpu")),
                                reason="specadapt._C not built")


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,L,V", [(1, 1, 2), (7, 3, 5), (64, 4, 33), (16, 8, 1000), (4, 0, 10)])
def test_single_path_kernels_equal_reference(rule, dtype, B, L, V):
    for seed in range(3):
        cand, p, q, u, uf = _random_batch(B, L, V, seed, dtype)
        n = torch.randint(0, L + 1, (B,), generator=torch.Generator().manual_seed(seed))
        for num in (None, n):
            ref = VERIFY_RULES[rule](cand, p, q, u, uf, num)
            got = kernels.verify(rule, cand, p, q, u, uf, num, impl="compiled")
            assert torch.equal(got.accept_len, ref.accept_len)
            assert torch.equal(got.output_tokens, ref.output_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,K,L,V", [(5, 1, 2, 6), (8, 2, 3, 9), (6, 3, 2, 50), (3, 4, 4, 300)])
def test_gbv_kernel_equals_reference(dtype, B, K, L, V):
    for seed in range(3):
        cand, p, q, u, uf = _tree_batch(B, K, L, V, 100 + seed, dtype)
        ref = gbv_reference(cand, p, q, u, uf)
        got = kernels.gbv_verify(cand, p, q, u, uf, impl="compiled")
        assert torch.equal(got.accept_len, ref.accept_len)
        assert torch.equal(got.output_tokens, ref.output_tokens)
        assert torch.equal(got.chosen_path, ref.chosen_path)


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_single_path_kernel_chi_square_1e6(rule):
    rounds, L = 1_000_000, 2
    tables = Float32Tables(4, seed=31)
    cand, P, Q = sample_path_batch(tables, L, 1, rounds, seed=7)
    g = torch.Generator().manual_seed(8)
    out = kernels.verify(rule, cand[:, 0], P[:, 0], Q[:, 0], torch.rand(rounds, L, generator=g, dtype=torch.float64),
                         torch.rand(rounds, generator=g, dtype=torch.float64), impl="compiled")
    exact = single_path_outcomes(tables, ROUND_LAWS[rule], L)
    assert chi_square_pvalue(out.output_tokens, out.accept_len, exact, rounds) > 1e-4


@pytest.mark.parametrize("K", [2, 3])
def test_gbv_kernel_chi_square_1e6(K):
    rounds, L = 1_000_000, 2
    tables = Float32Tables(3, seed=41)
    cand, P, Q = sample_path_batch(tables, L, K, rounds, seed=9)
    g = torch.Generator().manual_seed(10)
    out = kernels.gbv_verify(cand, P, Q, torch.rand(rounds, L, generator=g, dtype=torch.float64),
                             torch.rand(rounds, generator=g, dtype=torch.float64), impl="compiled")
    exact = gbv_outcomes(tables, K, L)
    assert chi_square_pvalue(out.output_tokens, out.accept_len, exact, rounds) > 1e-4


def test_chi_square_pvalue_matches_scipy():
    """The scipy-free p-value of exact_law (used on the GPU machine) equals scipy's Pearson test."""
    exact = {(0,): 0.5, (1,): 0.3, (2, 0): 0.15, (2, 1): 0.05}
    rows = [[0, -1], [1, -1], [2, 0], [2, 1]]
    counts = [5100, 2900, 1480, 520]
    outputs = torch.tensor([r for r, c in zip(rows, counts) for _ in range(c)])
    accept = torch.tensor([0 if r[1] < 0 else 1 for r, c in zip(rows, counts) for _ in range(c)])
    expected = np.array([exact[k] for k in sorted(exact)]) * sum(counts)
    observed = np.array([counts[rows.index(list(k) + [-1] * (2 - len(k)))] for k in sorted(exact)], dtype=float)
    want = stats.chisquare(observed, expected).pvalue
    assert chi_square_pvalue(outputs, accept, exact, sum(counts)) == pytest.approx(want, rel=1e-9)


def test_chi_square_detects_a_biased_sampler():
    """The statistical test can fail: block decisions fed chain's law are rejected."""
    rounds, L = 200_000, 2
    tables = Float32Tables(4, seed=31)
    cand, P, Q = sample_path_batch(tables, L, 1, rounds, seed=7)
    g = torch.Generator().manual_seed(8)
    out = kernels.verify("block", cand[:, 0], P[:, 0], Q[:, 0], torch.rand(rounds, L, generator=g, dtype=torch.float64),
                         torch.rand(rounds, generator=g, dtype=torch.float64), impl="compiled")
    exact = single_path_outcomes(tables, ROUND_LAWS["chain"], L)
    assert chi_square_pvalue(out.output_tokens, out.accept_len, exact, rounds) < 1e-6


def test_gbv_kernel_keeps_q_g_in_double():
    """The GBV kernel block-verifies with q_G in float64, as the reference: a coin between the float32- and
    float64-rounded acceptance probability must give the same decision (the toy of spec section 3, K = 2)."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float32).expand(1, 2, 2, 2).contiguous()
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float32).expand(1, 2, 1, 2).contiguous()
    cand = torch.zeros(1, 2, 2, dtype=torch.int64)  # both paths draft token 0
    u = torch.tensor([[0.74999997206]], dtype=torch.float64)  # h = 0.74999997765 in float64, 0.74999996647 via fp32
    uf = torch.tensor([0.5], dtype=torch.float64)
    ref = gbv_reference(cand, p, q, u, uf)
    got = kernels.gbv_verify(cand, p, q, u, uf, impl="compiled")
    assert int(ref.accept_len) == 1
    assert torch.equal(got.accept_len, ref.accept_len) and torch.equal(got.output_tokens, ref.output_tokens)


@pytest.mark.parametrize("impl", ["reference", "compiled"])
@pytest.mark.parametrize("which_path", [0, 1])
def test_gbv_drafted_token_without_draft_mass_is_an_error(impl, which_path):
    """A GBV path must be sampled from q: a drafted child with q = 0 at a walked node raises in both
    implementations, whichever path drafted it (q = 0 ranks highest, ratio +inf, so it would be walked)."""
    cand, p, q, u, uf = _tree_batch(1, 2, 2, 12, 3, torch.float32)
    x = int(cand[0, 0, 1])
    cand[0, 1, 1] = (x + 1) % 12  # two different children of the root (whose rows both paths share)
    bad = int(cand[0, which_path, 1])
    q[0, :, 0, bad] = 0.0
    q[0, :, 0] /= q[0, :, 0].sum(-1, keepdim=True)
    with pytest.raises(ValueError, match="sampled from q"):
        kernels.gbv_verify(cand, p, q, u, uf, impl=impl)


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_kernel_bad_inputs(rule):
    cand, p, q, u, uf = _random_batch(3, 2, 6, 0)
    cases = [
        ((cand[:, :2], p, q, u, uf), "candidates"),
        ((cand, p[:, :, :5], q, u, uf), "draft_probs"),
        ((cand, p.double(), q.double(), u, uf), "target_probs"),
        ((cand, p, q.bfloat16(), u, uf), "draft_probs"),
        ((cand, p, q, u[:, :1], uf), "uniforms"),
        ((cand, p, q, u, uf[:2]), "uniforms_final"),
        ((cand.float(), p, q, u, uf), "candidates"),
    ]
    bad_id = cand.clone()
    bad_id[1, 2] = 6
    cases.append(((bad_id, p, q, u, uf), "outside"))
    bad_u = u.clone()
    bad_u[0, 0] = 1.0
    cases.append(((cand, p, q, bad_u, uf), "uniforms"))
    for args, needle in cases:
        with pytest.raises(ValueError, match=needle):
            kernels.verify(rule, *args, impl="compiled")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        kernels.verify(rule, cand, p, q, u, uf, torch.tensor([0, 3, 1]), impl="compiled")
    nan_p = p.clone()
    nan_p[0, 0, 0] = 0.0
    nan_p[0, 0] /= nan_p[0, 0].sum()  # rows must still sum to 1 once NaN counts as 0
    nan_p[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="target_probs"):
        kernels.verify(rule, cand, nan_p, q, u, uf, impl="compiled", debug=True)
    # outside debug mode NaN counts as zero, exactly as in the reference
    ref = VERIFY_RULES[rule](cand, nan_p, q, u, uf)
    got = kernels.verify(rule, cand, nan_p, q, u, uf, impl="compiled")
    assert torch.equal(ref.output_tokens, got.output_tokens)


def test_dispatch_choices(caplog):
    cand, p, q, u, uf = _random_batch(2, 2, 5, 0)
    with pytest.raises(ValueError, match="impl"):
        kernels.verify("chain", cand, p, q, u, uf, impl="fast")
    with pytest.raises(ValueError, match="unknown verification rule"):
        kernels.verify("tree", cand, p, q, u, uf)
    kernels._warned.clear()
    with caplog.at_level("WARNING"):
        out = kernels.verify("block", cand, p.double(), q.double(), u, uf)  # float64 has no kernel
    assert "reference" in caplog.text and out.output_tokens.shape == (2, 3)
    with pytest.raises(ValueError, match="compiled"):
        kernels.verify("block", cand, p.double(), q.double(), u, uf, impl="compiled")


def test_opcheck_verify_ops():
    cand, p, q, u, uf = _random_batch(3, 2, 7, 0)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    for op in (torch.ops.specadapt.chain_verify.default, torch.ops.specadapt.block_verify.default):
        torch.library.opcheck(op, (cand, p, q, u, uf), test_utils=utils)
        torch.library.opcheck(op, (cand, p, q, u, uf, torch.tensor([2, 0, 1])), test_utils=utils)
    cand, p, q, u, uf = _tree_batch(3, 2, 2, 7, 0, torch.float32)
    torch.library.opcheck(torch.ops.specadapt.gbv_verify.default, (cand, p, q, u, uf), test_utils=utils)
