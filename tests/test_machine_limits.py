"""The machine limits every benchmark measures first (specadapt.bench.forward.measure_machine)."""

import torch

from specadapt.bench import forward as bf


def test_gemm_size_shrinks_where_one_product_would_be_slow(monkeypatch):
    """A dtype the CPU computes slowly (bfloat16 without native support: 0.3 GFLOP/s on an AVX2 EPYC) is timed on
    a smaller product instead of 8 x 2048^3 (8 minutes there): the size follows from a 256^3 probe's rate and
    the time budget, and the rate is still FLOPs / seconds of the product actually timed."""
    sizes = []

    def fake_timed(seconds_per_flop):
        def timed(g):
            g()
            n = sizes[-1]
            return 2 * n**3 * seconds_per_flop
        return timed

    real_matmul = torch.Tensor.__matmul__

    def spying_matmul(a, b):
        sizes.append(a.shape[0])
        return real_matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", spying_matmul)
    slow = bf._gemm_gflops(torch.float32, "cpu", fake_timed(1 / 0.3e9), budget_s=0.25)
    slow_sizes = list(sizes)
    sizes.clear()
    fast = bf._gemm_gflops(torch.float32, "cpu", fake_timed(1 / 200e9), budget_s=0.25)
    fast_sizes = list(sizes)
    monkeypatch.undo()
    # 0.25 s at 0.3 GFLOP/s: n^3 <= 3.75e7 -> n = 320 (a multiple of 64); 2048^3 at 200 GFLOP/s takes 0.09 s
    assert slow_sizes == [256, 320] and abs(slow - 0.3) < 1e-9
    assert fast_sizes == [256, 2048] and abs(fast - 200) < 1e-6


def test_measure_machine_reports_positive_rates():
    limits = bf.measure_machine("cpu")
    for key in ("copy_gbps", "read_gbps", "gemm_fp32_gflops", "gemm_bf16_gflops"):
        assert limits[key] > 0, key
    assert limits["threads"] == torch.get_num_threads()
