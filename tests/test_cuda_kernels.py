"""CUDA verification kernels against the float64 reference (GPU machines only; skipped elsewhere).

Run by scripts/device_check.sh. Needs only torch and the built extension (no transformers, no scipy).
"""

import pytest
import torch

from specadapt import kernels
from specadapt.verification import VERIFY_RULES

CUDA_OPS = torch.cuda.is_available() and kernels.has_op_for("block_verify", torch.device("cuda"))
pytestmark = pytest.mark.skipif(not CUDA_OPS, reason="needs a CUDA device and specadapt._C built with CUDA")


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


@pytest.mark.parametrize("B,K", [(1, 1), (37, 5), (1000, 7)])
def test_cuda_irls_accumulate_equals_reference(B, K):
    from specadapt.estimator.irls import irls_accumulate_reference

    gen = torch.Generator().manual_seed(B + K)
    features = torch.randn(B, K, generator=gen, dtype=torch.float64) * 3
    features[0, 0] = float("nan")  # skipped by both
    predictions = torch.rand(B, K, generator=gen, dtype=torch.float64)
    verified = torch.randint(0, K + 1, (B,), generator=gen)
    accepted = torch.minimum(torch.randint(0, K + 1, (B,), generator=gen), verified)
    expected = irls_accumulate_reference(features, predictions, accepted, verified)
    got = kernels.irls_accumulate(features.cuda(), predictions.cuda(), accepted.cuda(), verified.cuda())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-12, atol=1e-9)
