"""The CuPy (NVRTC) JIT path of the CUDA kernels, checked without a GPU: the torch-free headers compile with
NVRTC, every launch of specadapt.cuda_jit passes exactly the arguments the kernel declares (count, pointer or
value, dtype), and the dispatch order compiled > CuPy JIT > reference. Running the kernels needs a GPU:
tests/test_cuda_kernels.py (scripts/device_check.sh)."""

import re

import numpy as np
import pytest
import torch
from tests.helpers.batches import random_batch, tree_batch

from specadapt import cuda_jit, kernels

_CTYPE_DTYPE = {"int64_t": torch.int64, "int32_t": torch.int32, "double": torch.float64}


def _kernel_params(short_name: str) -> list[tuple[str, bool]]:
    """(base type, is pointer) of each parameter of the kernel, parsed from the header source."""
    base = cuda_jit.kernel_names(torch.float32)[short_name].split("::")[-1].split("<")[0]
    text = "".join(p.read_text() for p in sorted(cuda_jit.headers_dir().glob("*.cuh")))
    m = re.search(rf"__global__ void {base}\((.*?)\)\s*{{", text, re.S)
    assert m, f"{base} not found in the headers"
    params = []
    for raw in m.group(1).split(","):
        words = raw.replace("*", " * ").split()
        pointer = "*" in words
        kind = [w for w in words if w not in ("const", "__restrict__", "*")][0]
        params.append((kind, pointer))
    return params


@pytest.fixture
def recorded(monkeypatch):
    """Replace the CuPy calls by a recorder: (kernel, grid, block, args) per launch, tensors kept as tensors."""
    launches = []
    monkeypatch.setattr(cuda_jit, "_kernel", lambda name, dtype, device: (name, dtype))
    monkeypatch.setattr(cuda_jit, "_ptr", lambda t: t)
    monkeypatch.setattr(cuda_jit, "_launch", lambda k, grid, block, args, device: launches.append((k, grid, block, args)))
    return launches


def _check_launch(kernel, grid, block, args):
    (name, prob_dtype) = kernel
    params = _kernel_params(name)
    assert len(args) == len(params), f"{name}: {len(args)} arguments for {len(params)} parameters"
    for i, ((kind, pointer), arg) in enumerate(zip(params, args)):
        if pointer:
            assert arg is None or isinstance(arg, torch.Tensor), f"{name} arg {i}: pointer expected, got {type(arg)}"
            if arg is not None:
                want = prob_dtype if kind == "T" else _CTYPE_DTYPE[kind]
                assert arg.dtype == want, f"{name} arg {i} ({kind}*): {arg.dtype}"
                assert arg.is_contiguous()
        else:
            assert isinstance(arg, np.int64) and kind == "int64_t", f"{name} arg {i}: value {kind}, got {type(arg)}"
    assert all(g >= 1 for g in grid) and len(block) == 1 and block[0] % 32 == 0 and block[0] <= 1024


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_path_launch_matches_kernel_signature(recorded, rule, dtype):
    cand, p, q, u, uf = random_batch(3, 4, 50, 0, dtype)
    for n in (None, torch.tensor([0, 2, 4])):
        recorded.clear()
        accept, tokens = cuda_jit.verify(rule, cand, p, q, u.float(), uf, n)
        assert len(recorded) == 1 and recorded[0][0][0] == rule
        _check_launch(*recorded[0])
        assert accept.dtype == torch.int32 and tokens.shape == (3, 5)
        assert (recorded[0][3][5] is None) == (n is None)


@pytest.mark.parametrize("L", [0, 3])
def test_gbv_launches_match_kernel_signatures(recorded, L):
    cand, p, q, u, uf = tree_batch(2, 3, L, 40, 1, torch.bfloat16)
    accept, tokens, chosen = cuda_jit.gbv_verify(cand, p, q, u, uf)
    names = [k[0] for k, *_ in recorded]
    # the pipeline of csrc/cuda/gbv.cu: walk, L depth passes, accept, the residual's ranking, sample
    want = ["gbv_walk"] + ["gbv_fill_keys", "gbv_depth"] * L + ["gbv_accept"] + (["gbv_fill_keys"] if L else [])
    assert names == want + ["gbv_sample"]
    for launch in recorded:
        _check_launch(*launch)
    assert tokens.shape == (2, L + 1) and chosen.dtype == torch.int32


def test_jit_rejects_what_the_kernels_cannot_hold():
    cand, p, q, u, uf = random_batch(1, 65, 8, 0)
    with pytest.raises(ValueError, match="at most 64 draft tokens"):
        cuda_jit.verify("block", cand, p, q, u, uf)
    cand, p, q, u, uf = tree_batch(1, 33, 1, 8, 0, torch.float32)
    with pytest.raises(ValueError, match="1 to 32 paths"):
        cuda_jit.gbv_verify(cand, p, q, u, uf)


def _nvrtc_or_skip():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - ImportError or a missing libnvrtc
        pytest.skip(f"CuPy's NVRTC is not usable here: {exc}")
    if not cuda_jit.cuda_include_dirs():
        pytest.skip("no CUDA headers for NVRTC")


def test_headers_compile_with_nvrtc_for_hopper():
    """Every kernel the JIT path launches compiles with NVRTC (no GPU needed) and has the declared arity."""
    _nvrtc_or_skip()
    ptx, lowered = cuda_jit.compile_ptx("compute_90")
    assert len(lowered) == 2 * len(cuda_jit.kernel_names(torch.float32)) - 1  # gbv_accept is not templated
    for dtype in (torch.float32, torch.bfloat16):
        for short, expression in cuda_jit.kernel_names(dtype).items():
            entry = re.search(rf"\.entry {re.escape(lowered[expression])}\((.*?)\)", ptx, re.S)
            assert entry, f"{expression} missing from the PTX"
            assert entry.group(1).count(".param") == len(_kernel_params(short))


def test_nvrtc_errors_carry_the_log(monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setattr(cuda_jit, "_source", lambda: '#include "verify.cuh"\nthis is not C++;\n')
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        cuda_jit.compile_ptx()


def test_dispatch_order(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "has_op_for", lambda op, device: device.type == "cpu")
    monkeypatch.setattr(cuda_jit, "unavailable_reason", lambda: None)
    assert kernels.choose_implementation("gbv_verify", "auto", cuda, torch.float32) == "cupy"
    assert kernels.choose_implementation("gbv_verify", "auto", torch.device("cpu"), torch.float32) == "compiled"
    assert kernels.choose_implementation("gbv_verify", "auto", cuda, torch.float64) == "reference"
    assert kernels.choose_implementation("gbv_verify", "reference", cuda, torch.float32) == "reference"
    monkeypatch.setattr(kernels, "has_op_for", lambda op, device: True)
    assert kernels.choose_implementation("chain_verify", "auto", cuda, torch.bfloat16) == "compiled"
    assert kernels.choose_implementation("chain_verify", "cupy", cuda, torch.bfloat16) == "cupy"


def test_dispatch_says_why_it_falls_back(monkeypatch, caplog):
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "has_op_for", lambda op, device: False)
    monkeypatch.setattr(cuda_jit, "unavailable_reason", lambda: "CuPy is not installed (test)")
    monkeypatch.setattr(kernels, "_warned", set())
    with caplog.at_level("WARNING", logger="specadapt.kernels"):
        assert kernels.choose_implementation("block_verify", "auto", cuda, torch.float32) == "reference"
    assert "no CuPy JIT (CuPy is not installed (test))" in caplog.text
    with pytest.raises(ValueError, match="impl='cupy'.*CuPy is not installed"):
        kernels.choose_implementation("block_verify", "cupy", cuda, torch.float32)
    with pytest.raises(ValueError, match="impl='cupy'.*CUDA, not cpu"):
        kernels.choose_implementation("block_verify", "cupy", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels.choose_implementation("block_verify", "jit", cuda, torch.float32)


def test_cupy_impl_on_cpu_tensors_is_refused():
    cand, p, q, u, uf = random_batch(2, 2, 6, 0)
    with pytest.raises(ValueError, match="impl='cupy'"):
        kernels.verify("chain", cand, p, q, u, uf, impl="cupy")
