"""The native forward's weight formats and CPU kernels (csrc/cpu/native_*.cpp) against PyTorch references:
storage round trips, exact de-quantisation, every instruction-set path of the linear kernels, and row
invariance (a row's output does not depend on the other rows of the call)."""

from __future__ import annotations

import pytest
import torch

from specadapt import kernels
from specadapt.engine.native.formats import (
    PackedWeight,
    WeightFormat,
    linear_reference,
    pack_weight,
    quantize_activations_reference,
)

pytestmark = pytest.mark.skipif(not kernels.has_op_for("native_linear", torch.device("cpu")),
                                reason="specadapt._C built without the native kernels")
ops = torch.ops.specadapt if kernels.extension_available() else None
FORMATS = [f for f in WeightFormat if not f.is_k]  # the formats pack_weight makes (K-quants: tests/test_kquant.py)


def _supported_isas() -> list[str]:
    best = ops.native_set_isa("")
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(best) + 1]


@pytest.fixture
def each_isa():
    """Runs the test body once per instruction set this CPU supports, restoring the best one after."""
    best = ops.native_set_isa("")
    yield _supported_isas()
    ops.native_set_isa(best)


@pytest.mark.parametrize("fmt", [WeightFormat.Q8_0, WeightFormat.Q4_1])
@pytest.mark.parametrize("rows", [16, 37, 64])
def test_block_layout_round_trip(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    cols = 96
    high = 16 if fmt == WeightFormat.Q4_1 else 127
    low = 0 if fmt == WeightFormat.Q4_1 else -127
    codes = torch.randint(low, high, (rows, cols), generator=g)
    d = torch.rand(rows, cols // 32, generator=g).half()
    m = torch.randn(rows, cols // 32, generator=g).half() if fmt == WeightFormat.Q4_1 else None
    packed = PackedWeight.from_blocks(fmt, codes, d, m)
    assert packed.rows == rows and packed.cols == cols
    assert packed.data.shape[0] == -(-rows // 16)
    back, d2, m2 = packed.block_codes()
    assert torch.equal(back, codes.to(torch.int32)) and torch.equal(d2, d)
    assert (m2 is None and m is None) or torch.equal(m2, m)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_op_is_exact_and_pack_error_is_bounded(fmt):
    g = torch.Generator().manual_seed(int(fmt))
    w = torch.randn(40, 64, generator=g) * 0.1
    w[3, :32] = 0  # an all-zero block
    packed = pack_weight(w, fmt)
    assert torch.equal(ops.native_dequantize(*packed.tensors(), int(fmt), packed.rows), packed.dequantize())
    err = (packed.dequantize() - w).abs().max()
    bound = {WeightFormat.F32: 0.0, WeightFormat.BF16: 2e-3, WeightFormat.Q8_0: 2e-3, WeightFormat.Q4_1: 2.5e-2}[fmt]
    assert err <= bound, err
    assert torch.equal(packed.dequantize()[3, :32], torch.zeros(32))
    ids = torch.tensor([5, 0, 39, 5])
    assert torch.equal(ops.native_embedding(ids, *packed.tensors(), int(fmt), packed.rows), packed.dequantize()[ids])


def test_activation_quantisation_reference():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0] + [0.5] * 30])
    codes, e = quantize_activations_reference(x)
    assert e[0, 0] == 0 and torch.equal(codes[0, :32], torch.zeros(32, dtype=torch.int8))
    assert e[0, 1] == pytest.approx(2.0 / 127)
    assert codes[0, 33] == -127 and codes[0, 32] == round(127 / 2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(48, 64), (37, 96), (16, 576)])
def test_linear_kernels_match_the_reference_on_every_isa(fmt, shape, each_isa):
    rows, cols = shape
    g = torch.Generator().manual_seed(rows * cols + int(fmt))
    packed = pack_weight(torch.randn(rows, cols, generator=g) * 0.05, fmt)
    x = torch.randn(7, cols, generator=g)
    x[2] = 0.0
    want = linear_reference(x, packed)
    outs = {}
    for isa in each_isa:
        ops.native_set_isa(isa)
        got = ops.native_linear(x, *packed.tensors(), int(fmt), packed.rows)
        assert got.shape == (7, rows)
        torch.testing.assert_close(got, want, atol=2e-5 * float(want.abs().max()), rtol=1e-5)
        # row invariance: each row alone gives the same bits as inside the batch of 7
        for r in (0, 2, 6):
            assert torch.equal(ops.native_linear(x[r : r + 1], *packed.tensors(), int(fmt), packed.rows)[0], got[r])
        assert torch.equal(ops.native_linear(x[:5], *packed.tensors(), int(fmt), packed.rows), got[:5])
        outs[isa] = got
    for isa, got in outs.items():  # instruction sets agree up to float rounding
        torch.testing.assert_close(got, outs["scalar"], atol=1e-5 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_q4_1_integer_sums_at_their_extreme_do_not_saturate(sign, each_isa):
    """Codes of 15 against activation codes of +-127 everywhere: the largest block sums the AVX2 path adds in
    int16 (8 x 2 x 15 x 127 = 30480) must come out exact, on every instruction set."""
    w = torch.ones(32, 64)
    w[:, ::32] = 0.0  # each block's minimum 0 (code 0) and maximum 1 (code 15) -> 31 codes of 15 per block
    packed = pack_weight(w, WeightFormat.Q4_1)
    x = torch.full((5, 64), sign)
    want = linear_reference(x, packed)
    for isa in each_isa:
        ops.native_set_isa(isa)
        got = ops.native_linear(x, *packed.tensors(), int(WeightFormat.Q4_1), packed.rows)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got, torch.full_like(got, sign * 62.0), atol=1e-2, rtol=1e-3)


def test_block_formats_quantise_activations_like_the_reference():
    """The kernels' 8-bit activation rounding is the reference's: a float-activation product differs more."""
    g = torch.Generator().manual_seed(5)
    packed = pack_weight(torch.randn(32, 64, generator=g), WeightFormat.Q8_0)
    x = torch.randn(3, 64, generator=g)
    got = ops.native_linear(x, *packed.tensors(), int(WeightFormat.Q8_0), packed.rows)
    exact_float = x.double() @ packed.dequantize().double().T
    torch.testing.assert_close(got, linear_reference(x, packed), atol=1e-5, rtol=1e-5)
    assert (got.double() - exact_float).abs().max() > 1e-4


def test_bad_weight_arguments_name_the_problem():
    packed = pack_weight(torch.randn(16, 64), WeightFormat.Q4_1)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="mins"):
        ops.native_linear(x, packed.data, packed.scales, None, int(WeightFormat.Q4_1), 16)
    with pytest.raises(RuntimeError, match="K = 64"):
        ops.native_linear(torch.randn(2, 32), *packed.tensors(), int(WeightFormat.Q4_1), 16)
    with pytest.raises(RuntimeError, match="format"):
        ops.native_linear(x, *packed.tensors(), 7, 16)
    with pytest.raises(RuntimeError, match="rows"):
        ops.native_linear(x, *packed.tensors(), int(WeightFormat.Q4_1), 40)
    with pytest.raises(RuntimeError, match="isa"):
        ops.native_set_isa("neon")
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_weight(torch.randn(4, 40), WeightFormat.Q8_0)


@pytest.mark.parametrize("fmt", [WeightFormat.Q8_0, WeightFormat.Q4_1])
@pytest.mark.parametrize("rows", [5, 16, 50])
def test_cpp_packing_equals_the_reference_rule_bit_for_bit(fmt, rows):
    from specadapt.engine.native.formats import _pack_blocks_reference

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, 96, generator=g)
    w[1, 32:64] = 0.0
    got = pack_weight(w, fmt)
    want = _pack_blocks_reference(w, fmt)
    for a, b in zip(got.tensors(), want.tensors()):
        assert (a is None and b is None) or torch.equal(a, b)
    assert got.rows == want.rows == rows
