"""The compiled op specadapt::block_residual_mass against the float64 reference; opcheck; CUDA compile check."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from specadapt import kernels
from specadapt.verification import residual_mass_reference

ROOT = Path(__file__).resolve().parents[1]
# What torch's extension build passes to nvcc: no implicit half / bfloat16 conversions.
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


def test_extension_is_built_and_registers_the_op():
    assert kernels.extension_available(), kernels.extension_error()
    assert kernels.has_op_for("block_residual_mass", torch.device("cpu"))
    assert hasattr(torch.ops.specadapt, "block_residual_mass")


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 17), (8, 49152), (33, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_matches_reference(rows, vocab, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    p = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, -1).to(dtype)
    q = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, -1).to(dtype)
    w = torch.rand(rows, generator=g)
    got = torch.ops.specadapt.block_residual_mass(p, q, w)
    want = residual_mass_reference(p.double(), q.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (rows,)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_op_detects_a_wrong_answer():
    """Sanity of the comparison itself: a different weight gives a different result."""
    p = torch.softmax(torch.randn(4, 100), -1)
    q = torch.softmax(torch.randn(4, 100), -1)
    w = torch.full((4,), 0.9)
    assert not torch.allclose(torch.ops.specadapt.block_residual_mass(p, q, w),
                              residual_mass_reference(p, q, w * 0.5))


def test_non_contiguous_inputs():
    p = torch.softmax(torch.randn(50, 8), -1).t().contiguous().t()
    q = torch.softmax(torch.randn(50, 8), -1)
    w = torch.rand(50)
    torch.testing.assert_close(torch.ops.specadapt.block_residual_mass(p, q, w),
                               residual_mass_reference(p, q, w))


@pytest.mark.parametrize(
    "args,needle",
    [
        ((torch.rand(3, 4), torch.rand(3, 5), torch.rand(3)), "draft_probs"),
        ((torch.rand(3, 4), torch.rand(3, 4), torch.rand(2)), "weights"),
        ((torch.rand(12), torch.rand(12), torch.rand(1)), "target_probs"),
        ((torch.rand(3, 4).double(), torch.rand(3, 4).double(), torch.rand(3)), "target_probs"),
        ((torch.rand(3, 4), torch.rand(3, 4).bfloat16(), torch.rand(3)), "draft_probs"),
        ((torch.rand(3, 4), torch.rand(3, 4), torch.rand(3).double()), "weights"),
    ],
)
def test_op_errors_name_the_argument(args, needle):
    with pytest.raises(RuntimeError, match=needle):
        torch.ops.specadapt.block_residual_mass(*args)


def test_opcheck():
    p = torch.softmax(torch.randn(5, 64), -1)
    q = torch.softmax(torch.randn(5, 64), -1)
    w = torch.rand(5)
    torch.library.opcheck(
        torch.ops.specadapt.block_residual_mass.default, (p, q, w),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_python_wrapper_dispatches_to_the_compiled_op(caplog):
    p = torch.softmax(torch.randn(2, 10), -1)
    w = torch.ones(2)
    with caplog.at_level("WARNING"):
        out = kernels.block_residual_mass(p, p, w)
    assert "reference" not in caplog.text
    torch.testing.assert_close(out, torch.zeros(2))


def test_python_wrapper_falls_back_with_a_warning(caplog):
    """On a device without a compiled kernel (meta here) the wrapper logs that it uses the reference."""
    p = torch.softmax(torch.randn(2, 10), -1).to("meta")
    kernels._warned.clear()
    with caplog.at_level("WARNING"):
        out = kernels.block_residual_mass(p, p, torch.ones(2, device="meta"))
    assert out.shape == (2,)
    assert "using the PyTorch reference" in caplog.text


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_headers_compile_for_sm90(tmp_path):
    """The torch-free CUDA header compiles with nvcc for Hopper (sm_90), as NVRTC / setup.py would see it."""
    src = ROOT / "csrc" / "cuda" / "compile_check.cu"
    out = tmp_path / "check.o"
    proc = subprocess.run(
        ["nvcc", "-arch=sm_90", "-std=c++17", *TORCH_NVCC_DEFINES, "-c", str(src), "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
