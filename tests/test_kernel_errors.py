"""Device-side errors of the CUDA verification kernels (issue 17): the bits of csrc/cuda/errors.cuh, their decoding,
the flags handed to each launch, and reading them on demand or in debug mode. Checked on CPU: the launches of the
CuPy JIT path are replaced by fakes that set bits as the kernels would (real launches: tests/test_cuda_kernels.py),
and the CPU ops raise the same conditions directly."""

import re

import pytest
import torch
from tests.helpers.batches import random_batch, tree_batch

from specadapt import cuda_jit, kernel_errors, kernels

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean_flags():
    """No flag of one test leaks into another; debug mode back to the environment's."""
    kernel_errors._flags.pop(CPU, None)
    kernel_errors.set_debug(None)
    yield
    kernel_errors._flags.pop(CPU, None)
    kernel_errors.set_debug(None)


def test_error_bits_mirror_the_cuda_header():
    text = (cuda_jit.headers_dir() / "errors.cuh").read_text()
    header = {int(v): name for name, v in re.findall(r"constexpr int32_t (kError\w+) = (\d+);", text)}
    assert header == {bit: entry[0] for bit, entry in kernel_errors.ERROR_BITS.items()}
    assert all(bit & (bit - 1) == 0 for bit in header)  # one bit each: codes OR together
    for name in ("verify.cuh", "gbv.cuh"):  # the kernels name the constants, not bare numbers
        src = (cuda_jit.headers_dir() / name).read_text()
        assert "report_error(" in src and not re.search(r"atomicOr\(\s*error", src)


def test_describe_names_the_kernel_the_device_and_every_bit():
    line = kernel_errors.describe("gbv_verify", 6, "cuda:1")
    assert line.startswith("specadapt::gbv_verify on cuda:1 reported device error 6")
    assert "kErrorZeroDraftProb" in line and "gbv_walk_kernel" in line
    assert "kErrorRowSum" in line and "gbv_sample_kernel" in line and "kErrorNoTargetMass" not in line
    chain = kernel_errors.describe("chain_verify", 1)
    assert "chain_verify_kernel" in chain and "no mass" in chain
    assert "unknown bits 0x10" in kernel_errors.describe("block_verify", 16 | 4)
    with pytest.raises(ValueError, match="kernel"):
        kernel_errors.describe("verify", 1)


def test_fake_flag_is_read_reset_and_raised_naming_the_kernel():
    flag = kernel_errors.flag("block_verify", CPU)
    assert flag.dtype == torch.int32 and flag.shape == (1,) and int(flag) == 0
    assert kernel_errors.flag("block_verify", CPU).data_ptr() == flag.data_ptr()  # one persistent slot
    kernel_errors.check_device_errors()  # nothing set: no raise
    flag.fill_(4)
    with pytest.raises(RuntimeError, match=r"specadapt::block_verify on cpu .*kErrorRowSum") as info:
        kernel_errors.check_device_errors(CPU)
    assert isinstance(info.value, kernel_errors.DeviceKernelError)
    assert info.value.errors == {("block_verify", "cpu"): 4}
    assert int(flag) == 0
    kernel_errors.check_device_errors()  # reset by the read
    kernel_errors.flag("gbv_verify", CPU).fill_(2)
    kernel_errors.check_device_errors("cuda")  # another device type: not read, still set
    with pytest.raises(kernel_errors.DeviceKernelError, match="gbv_walk_kernel"):
        kernel_errors.check_device_errors()
    with pytest.raises(ValueError, match="kernel"):
        kernel_errors.flag("sample", CPU)


def test_debug_mode_checks_after_each_launch(monkeypatch):
    monkeypatch.delenv(kernel_errors.DEBUG_ENV, raising=False)
    assert not kernel_errors.debug_enabled()
    kernel_errors.flag("chain_verify", CPU).fill_(1)
    kernel_errors.after_launch("chain_verify", CPU)  # debug off: no read, no sync, the flag stays
    assert int(kernel_errors.flag("chain_verify", CPU)) == 1
    monkeypatch.setenv(kernel_errors.DEBUG_ENV, "1")
    assert kernel_errors.debug_enabled()
    with pytest.raises(kernel_errors.DeviceKernelError, match="chain_verify"):
        kernel_errors.after_launch("chain_verify", CPU)
    kernel_errors.set_debug(False)  # the explicit switch wins over the environment
    assert not kernel_errors.debug_enabled()
    monkeypatch.delenv(kernel_errors.DEBUG_ENV)
    kernel_errors.set_debug(True)
    assert kernel_errors.debug_enabled() and kernels.set_debug is kernel_errors.set_debug
    assert kernels.check_device_errors is kernel_errors.check_device_errors


@pytest.fixture
def fake_kernels(monkeypatch):
    """The CuPy launches replaced by fakes: each records its kernel name and error argument, and ORs into that
    argument the bits the real kernel would set for the batch (``bits[name]``)."""
    bits, seen = {}, []
    monkeypatch.setattr(cuda_jit, "_kernel", lambda name, dtype, device: name)
    monkeypatch.setattr(cuda_jit, "_ptr", lambda t: t)
    error_arg = {"chain": 8, "block": 8, "gbv_walk": 5, "gbv_sample": 11}

    def launch(name, grid, block, args, device):
        if name in error_arg:
            error = args[error_arg[name]]
            seen.append((name, error))
            error.bitwise_or_(bits.get(name, 0))

    monkeypatch.setattr(cuda_jit, "_launch", launch)
    return bits, seen


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_jit_launcher_writes_the_flag_it_is_given(fake_kernels, rule):
    bits, seen = fake_kernels
    cand, p, q, u, uf = random_batch(3, 4, 50, 0, torch.float32)
    flag = kernel_errors.flag(f"{rule}_verify", CPU)
    cuda_jit.verify(rule, cand, p, q, u, uf, error=flag)
    assert seen[-1][1].data_ptr() == flag.data_ptr()
    kernel_errors.check_device_errors()  # a clean launch sets nothing
    bits[rule] = 4  # an off row, as the kernel reports it
    cuda_jit.verify(rule, cand, p, q, u, uf, error=flag)
    with pytest.raises(kernel_errors.DeviceKernelError, match=rf"{rule}_verify .*{rule}_verify_kernel"):
        kernel_errors.check_device_errors()
    cuda_jit.verify(rule, cand, p, q, u, uf)  # no flag given: a scratch one, nobody's business
    assert seen[-1][1].data_ptr() != flag.data_ptr()
    kernel_errors.check_device_errors()
    with pytest.raises(ValueError, match="error must be an int32"):
        cuda_jit.verify(rule, cand, p, q, u, uf, error=torch.zeros(1, dtype=torch.int64))


def test_jit_gbv_walk_and_sample_share_the_flag(fake_kernels):
    bits, seen = fake_kernels
    cand, p, q, u, uf = tree_batch(2, 3, 2, 40, 1, torch.float32)
    flag = kernel_errors.flag("gbv_verify", CPU)
    bits.update(gbv_walk=2, gbv_sample=1)
    cuda_jit.gbv_verify(cand, p, q, u, uf, error=flag)
    assert [name for name, _ in seen] == ["gbv_walk", "gbv_sample"]
    assert all(e.data_ptr() == flag.data_ptr() for _, e in seen)
    with pytest.raises(kernel_errors.DeviceKernelError) as info:
        kernel_errors.check_device_errors()
    assert info.value.errors == {("gbv_verify", "cpu"): 3}
    assert "gbv_walk_kernel" in str(info.value) and "gbv_sample_kernel" in str(info.value)


needs_cpu_ops = pytest.mark.skipif(not kernels.has_op_for("block_verify", CPU), reason="specadapt._C not built")


@needs_cpu_ops
def test_cpu_ops_raise_directly_and_take_no_flag():
    """The CPU kernels check what the CUDA kernels can only flag: they raise, and kernels.* hands them no flag."""
    cand, p, q, u, uf = random_batch(2, 3, 40, 0, torch.float32)
    p[0, 0] *= 1.5
    for rule in ("chain", "block"):
        with pytest.raises(ValueError, match="sums to"):
            kernels.verify(rule, cand, p, q, u, uf, impl="compiled")
    cand, p, q, u, uf = tree_batch(2, 2, 2, 40, 1, torch.float32)
    p[1, :, 0] *= 1.5
    with pytest.raises(ValueError, match="sums to"):
        kernels.gbv_verify(cand, p, q, u, uf, impl="compiled")
    assert CPU not in kernel_errors._flags
    # the op's schema takes the flag, and the CPU kernel leaves it alone
    flag = torch.zeros(1, dtype=torch.int32)
    cand, p, q, u, uf = random_batch(2, 3, 40, 0, torch.float32)
    torch.ops.specadapt.chain_verify(cand, p, q, u, uf, None, flag)
    assert int(flag) == 0
