"""CUDA verification kernels against the float64 reference (GPU machines only; skipped elsewhere).

Run by scripts/device_check.sh. Needs only torch and the built extension (no transformers, no scipy).
"""

import pytest
import torch
from tests.helpers.batches import tree_batch
from tests.helpers.exact_law import Float32Tables, chi_square_pvalue, gbv_outcomes, sample_path_batch

from specadapt import cuda_jit, kernels
from specadapt.verification import VERIFY_RULES

CUDA_OPS = torch.cuda.is_available() and kernels.has_op_for("block_verify", torch.device("cuda"))
needs_compiled = pytest.mark.skipif(not CUDA_OPS, reason="needs a CUDA device and specadapt._C built with CUDA")
JIT = torch.cuda.is_available() and cuda_jit.available()
needs_jit = pytest.mark.skipif(not JIT, reason=f"needs a CUDA device and CuPy ({cuda_jit.unavailable_reason()})")


def _batch(B, L, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(B, L + 1, V, generator=g) * 2
    lq = lp[:, :L] + torch.randn(B, L, V, generator=g)
    lp = lp.masked_fill(torch.rand(lp.shape, generator=g) < 0.3, float("-inf"))
    lp[..., 0] = 0.0
    p, q = torch.softmax(lp, -1).to(dtype), torch.softmax(lq, -1).to(dtype)
    drafts = torch.multinomial(q.float().reshape(-1, V), 1, generator=g).reshape(B, L)
    cand = torch.cat([torch.zeros(B, 1, dtype=torch.int64), drafts], 1)
    return cand, p, q, torch.rand(B, L, generator=g, dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64)


@needs_compiled
@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,L,V", [(1, 1, 2), (33, 4, 1000), (64, 8, 49152), (8, 16, 151936), (5, 3, 1001)])
def test_cuda_equals_reference(rule, dtype, B, L, V):
    cand, p, q, u, uf = _batch(B, L, V, 0, dtype)
    n = torch.randint(0, L + 1, (B,), generator=torch.Generator().manual_seed(1))
    for num in (None, n):
        ref = VERIFY_RULES[rule](cand, p, q, u, uf, num)
        dev = [t.cuda() for t in (cand, p, q, u, uf)]
        got = kernels.verify(rule, *dev, num.cuda() if num is not None else None, impl="compiled")
        assert torch.equal(got.accept_len.cpu(), ref.accept_len)
        assert torch.equal(got.output_tokens.cpu(), ref.output_tokens)


@needs_compiled
@pytest.mark.parametrize("rule", ["chain", "block"])
def test_cuda_chi_square_1e6(rule):
    """Output law of one round (V = 4, L = 2, context-free p and q) against its exact value."""
    V, L, rounds = 4, 2, 1_000_000
    g = torch.Generator().manual_seed(3)
    p_row = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q_row = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p = p_row.expand(rounds, L + 1, V).contiguous()
    q = q_row.expand(rounds, L, V).contiguous()
    drafts = torch.multinomial(q_row, rounds * L, replacement=True, generator=g).reshape(rounds, L)
    cand = torch.cat([torch.zeros(rounds, 1, dtype=torch.int64), drafts], 1)
    u = torch.rand(rounds, L, generator=g, dtype=torch.float64)
    uf = torch.rand(rounds, generator=g, dtype=torch.float64)
    out = kernels.verify(rule, cand.cuda(), p.cuda(), q.cuda(), u.cuda(), uf.cuda(), impl="compiled")
    # Context-free tables: every emitted token is distributed as p, independently (losslessness).
    first = out.output_tokens[:, 0].cpu()
    counts = torch.bincount(first, minlength=V).double()
    expected = p_row.double() * rounds
    stat = float(((counts - expected) ** 2 / expected).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor((V - 1) / 2.0), torch.tensor(stat / 2.0)))
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e}"
    ref = VERIFY_RULES[rule](cand[:20000], p[:20000], q[:20000], u[:20000], uf[:20000])
    assert torch.equal(out.output_tokens[:20000].cpu(), ref.output_tokens)


GBV_CUDA = torch.cuda.is_available() and kernels.has_op_for("gbv_verify", torch.device("cuda"))


@pytest.mark.skipif(not GBV_CUDA, reason="needs specadapt._C built with the CUDA GBV kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,K,L,V", [(5, 1, 2, 6), (8, 2, 3, 9), (6, 3, 2, 1000), (3, 4, 4, 1001), (4, 3, 0, 50),
                                     (16, 4, 6, 49152), (4, 3, 4, 151936)])
def test_cuda_gbv_equals_cpu_and_reference(dtype, B, K, L, V):
    """Same coins, same tokens: CUDA == fused CPU (== float64 reference on the small shapes)."""
    for seed in range(2):
        cand, p, q, u, uf = tree_batch(B, K, L, V, 200 + seed, dtype)
        cpu = kernels.gbv_verify(cand, p, q, u, uf, impl="compiled")
        got = kernels.gbv_verify(*(t.cuda() for t in (cand, p, q, u, uf)), impl="compiled")
        assert torch.equal(got.chosen_path.cpu(), cpu.chosen_path)
        assert torch.equal(got.accept_len.cpu(), cpu.accept_len)
        assert torch.equal(got.output_tokens.cpu(), cpu.output_tokens)
        if V <= 1001:
            ref = kernels.gbv_verify(cand, p, q, u, uf, impl="reference")
            assert torch.equal(got.output_tokens.cpu(), ref.output_tokens)


@pytest.mark.skipif(not GBV_CUDA, reason="needs specadapt._C built with the CUDA GBV kernel")
def test_cuda_gbv_one_path_is_block_verification():
    cand, p, q, u, uf = tree_batch(32, 1, 5, 3000, 7, torch.float32)
    dev = [t.cuda() for t in (cand, p, q, u, uf)]
    gbv = kernels.gbv_verify(*dev, impl="compiled")
    block = kernels.verify("block", dev[0][:, 0], dev[1][:, 0], dev[2][:, 0], dev[3], dev[4], impl="compiled")
    assert torch.equal(gbv.accept_len, block.accept_len)
    assert torch.equal(gbv.output_tokens, block.output_tokens)


@pytest.mark.skipif(not GBV_CUDA, reason="needs specadapt._C built with the CUDA GBV kernel")
@pytest.mark.parametrize("K", [2, 3])
def test_cuda_gbv_chi_square_1e6(K):
    rounds, L = 1_000_000, 2
    tables = Float32Tables(3, seed=41)
    cand, P, Q = sample_path_batch(tables, L, K, rounds, seed=9)
    g = torch.Generator().manual_seed(10)
    u = torch.rand(rounds, L, generator=g, dtype=torch.float64)
    uf = torch.rand(rounds, generator=g, dtype=torch.float64)
    out = kernels.gbv_verify(cand.cuda(), P.cuda(), Q.cuda(), u.cuda(), uf.cuda(), impl="compiled")
    exact = gbv_outcomes(tables, K, L)
    assert chi_square_pvalue(out.output_tokens.cpu(), out.accept_len.cpu(), exact, rounds) > 1e-4


@needs_jit
@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,L,V", [(1, 1, 2), (33, 4, 1000), (8, 16, 151936)])
def test_cupy_jit_equals_reference(rule, dtype, B, L, V):
    """The NVRTC build of the same headers returns the reference's tokens for the same coins."""
    cand, p, q, u, uf = _batch(B, L, V, 0, dtype)
    n = torch.randint(0, L + 1, (B,), generator=torch.Generator().manual_seed(1))
    for num in (None, n):
        ref = VERIFY_RULES[rule](cand, p, q, u, uf, num)
        dev = [t.cuda() for t in (cand, p, q, u, uf)]
        got = kernels.verify(rule, *dev, num.cuda() if num is not None else None, impl="cupy")
        assert torch.equal(got.accept_len.cpu(), ref.accept_len)
        assert torch.equal(got.output_tokens.cpu(), ref.output_tokens)


@needs_jit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,K,L,V", [(8, 2, 3, 9), (3, 4, 4, 1001), (4, 3, 0, 50), (4, 3, 4, 151936)])
def test_cupy_jit_gbv_equals_cpu(dtype, B, K, L, V):
    cand, p, q, u, uf = tree_batch(B, K, L, V, 300, dtype)
    cpu = kernels.gbv_verify(cand, p, q, u, uf, impl="compiled")
    got = kernels.gbv_verify(*(t.cuda() for t in (cand, p, q, u, uf)), impl="cupy")
    assert torch.equal(got.chosen_path.cpu(), cpu.chosen_path)
    assert torch.equal(got.output_tokens.cpu(), cpu.output_tokens)


@needs_compiled
@pytest.mark.parametrize("B,K", [(1, 1), (37, 5), (1000, 7)])
def test_cuda_irls_accumulate_equals_reference(B, K):
    from specadapt.estimator.irls import irls_accumulate, irls_accumulate_reference

    gen = torch.Generator().manual_seed(B + K)
    features = torch.randn(B, K, generator=gen, dtype=torch.float64) * 3
    features[0, 0] = float("nan")  # skipped by both
    predictions = torch.rand(B, K, generator=gen, dtype=torch.float64)
    verified = torch.randint(0, K + 1, (B,), generator=gen)
    accepted = torch.minimum(torch.randint(0, K + 1, (B,), generator=gen), verified)
    expected = irls_accumulate_reference(features, predictions, accepted, verified)
    got = irls_accumulate(features.cuda(), predictions.cuda(), accepted.cuda(), verified.cuda())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-12, atol=1e-9)


def _device_impls():
    return [impl for impl, ok in (("compiled", CUDA_OPS), ("cupy", JIT)) if ok]


@pytest.mark.skipif(not (CUDA_OPS or JIT), reason="needs a CUDA device with specadapt._C built with CUDA or CuPy")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_that_do_not_sum_to_one_give_minus_one(dtype):
    """Issue 19.5 on the device path (no host sync, so no raise): a request whose live row of p or q is off 1 by
    more than the tolerance (1e-3 float32, 1e-2 bfloat16) gets -1 as its extra token; other requests, padding rows
    past num_draft_tokens and rows within the tolerance are unaffected."""
    B, L, V = 4, 3, 1000
    cand, p, q, u, uf = _batch(B, L, V, 7, dtype)
    n = torch.tensor([3, 3, 1, 3])
    p[0, 2] *= 1.05  # request 0: a live p row off by 5%
    q[1, 0] *= 0.9  # request 1: a live q row off by 10%
    p[2, 3] *= 3.0  # request 2: the row is past num_draft_tokens = 1 (padding): not read
    for impl in _device_impls():
        for rule in ("chain", "block"):
            ref_rows = [VERIFY_RULES[rule](cand[b:b + 1], p[b:b + 1], q[b:b + 1], u[b:b + 1], uf[b:b + 1],
                                           n[b:b + 1]) for b in (2, 3)]
            got = kernels.verify(rule, cand.cuda(), p.cuda(), q.cuda(), u.cuda(), uf.cuda(), n.cuda(), impl=impl)
            tau = got.accept_len.cpu().long()
            toks = got.output_tokens.cpu()
            assert int(toks[0, tau[0]]) == -1 and int(toks[1, tau[1]]) == -1, (impl, rule)
            for b, ref in zip((2, 3), ref_rows):
                assert torch.equal(toks[b], ref.output_tokens[0]), (impl, rule, b)
    cand, p, q, u, uf = tree_batch(2, 2, 2, 500, 3, dtype)
    p[1, :, 0] *= 1.5  # request 1: the chosen path's p row 0 (shared by both paths) is off
    for impl in _device_impls():
        ref0 = kernels.gbv_verify(cand[:1], p[:1], q[:1], u[:1], uf[:1], impl="reference")
        got = kernels.gbv_verify(*(t.cuda() for t in (cand, p, q, u, uf)), impl=impl)
        assert torch.equal(got.output_tokens[0].cpu(), ref0.output_tokens[0]), impl
        assert int(got.output_tokens[1, int(got.accept_len[1])]) == -1, impl


@pytest.mark.skipif(not (CUDA_OPS or JIT), reason="needs a CUDA device with specadapt._C built with CUDA or CuPy")
def test_cuda_device_errors_are_read_on_demand_and_in_debug_mode():
    """Issue 17: the flag the kernels set for an off row reaches kernels.check_device_errors (naming the kernel and
    the bit), is reset by the read, and raises right after the launch in debug mode; clean launches set nothing."""
    from specadapt import kernel_errors

    B, L, V = 4, 3, 1000
    cand, p, q, u, uf = _batch(B, L, V, 7, torch.float32)
    bad = p.clone()
    bad[0, 2] *= 1.05
    try:
        for impl in _device_impls():
            for rule in ("chain", "block"):
                kernels.check_device_errors()  # start clean
                kernels.verify(rule, *(t.cuda() for t in (cand, p, q, u, uf)), impl=impl)
                kernels.check_device_errors()
                kernels.verify(rule, *(t.cuda() for t in (cand, bad, q, u, uf)), impl=impl)
                with pytest.raises(RuntimeError, match=rf"specadapt::{rule}_verify on cuda.*kErrorRowSum"):
                    kernels.check_device_errors()
                kernels.check_device_errors()  # reset by the read
                kernels.set_debug(True)
                with pytest.raises(kernel_errors.DeviceKernelError, match=f"{rule}_verify_kernel"):
                    kernels.verify(rule, *(t.cuda() for t in (cand, bad, q, u, uf)), impl=impl)
                kernels.set_debug(None)
            tcand, tp, tq, tu, tuf = tree_batch(2, 2, 2, 500, 3, torch.float32)
            tp[1, :, 0] *= 1.5
            kernels.gbv_verify(*(t.cuda() for t in (tcand, tp, tq, tu, tuf)), impl=impl)
            with pytest.raises(RuntimeError, match=r"gbv_verify on cuda.*kErrorRowSum.*gbv_sample_kernel"):
                kernels.check_device_errors()
    finally:
        kernels.set_debug(None)
