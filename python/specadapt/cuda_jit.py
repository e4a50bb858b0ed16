"""Run-time compilation of specadapt's CUDA verification kernels with CuPy (NVRTC).

The kernels live in torch-free headers (``csrc/cuda/verify.cuh``, ``gbv.cuh``). When ``specadapt._C`` was built
without CUDA (a CPU build of the wheel, no nvcc at install time) but the process has a CUDA device and CuPy,
:mod:`specadapt.kernels` runs the SAME headers compiled here by NVRTC: the dispatch order is compiled extension
> CuPy JIT > float64 reference, and the log says which one runs. The GBV ranking sort, which the compiled binding
does with CUB, is a stable ``torch.sort`` here; everything else is the headers' kernels, launched on torch's
current stream (no host synchronisation).

Headers are found in the installed package (``specadapt/cuda_headers``, copied there by ``setup.py``) or in the
source tree (editable installs); the CUDA headers NVRTC needs (``cuda_bf16.h``) in ``$CUDA_PATH`` /
``$CUDA_HOME``, ``/usr/local/cuda`` or the ``nvidia-*`` pip wheels.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from pathlib import Path

import torch

from .verification.rules import RULES, get_rule

logger = logging.getLogger(__name__)

__all__ = ["available", "unavailable_reason", "headers_dir", "compile_ptx", "kernel_names", "check_args", "verify",
           "gbv_verify"]

THREADS = 256
MAX_DRAFTS = 64  # the kMaxDrafts of block_verify_kernel (path weights in shared memory)
MAX_PATHS = 32  # the kMaxPaths of gbv_walk_kernel
_CTYPE = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16"}


def kernel_names(dtype: torch.dtype) -> dict[str, str]:
    """C++ name expressions of the kernel instantiations for probabilities of ``dtype`` (float32 / bfloat16):
    ``{short name: expression}`` over every registered rule's ``jit_kernels`` (:mod:`specadapt.verification.rules`)."""
    t = _CTYPE[dtype]
    return {
        short: "specadapt::cuda::" + template.format(t=t, max_drafts=MAX_DRAFTS, max_paths=MAX_PATHS)
        for rule in RULES.values()
        for short, template in rule.jit_kernels
    }


def headers_dir() -> Path:
    """Directory holding ``verify.cuh`` / ``gbv.cuh``. Raises FileNotFoundError when neither copy exists."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_headers", here.parents[1] / "csrc" / "cuda"):
        if (candidate / "gbv.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"specadapt's CUDA headers (gbv.cuh) are neither in {here / 'cuda_headers'} nor in a source tree; "
        "reinstall specadapt"
    )


def cuda_include_dirs() -> list[str]:
    """Directories with the CUDA toolkit headers NVRTC needs (``cuda_bf16.h``), most specific first."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    dirs = [os.path.join(r, "include") for r in roots if r]
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        dirs += sorted(d for root in nvidia.__path__ for d in glob.glob(os.path.join(root, "*", "include")))
    except ImportError:
        pass
    return [d for d in dict.fromkeys(dirs) if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]


def _source() -> str:
    headers = dict.fromkeys(rule.cuda_header for rule in RULES.values())
    return "".join(f'#include "{h}"\n' for h in headers)


def _options() -> tuple[str, ...]:
    # --fmad=false: no fused multiply-adds, so products and differences round as in the CPU kernel and reference
    return ("-std=c++17", "--fmad=false", f"-I{headers_dir()}", *(f"-I{d}" for d in cuda_include_dirs()))


def compile_ptx(arch: str = "compute_90") -> tuple[str, dict[str, str]]:
    """Compile the headers with NVRTC (no GPU needed) and return ``(ptx, {name expression: lowered name})``.

    Raises:
        ImportError: CuPy or its NVRTC library is missing. RuntimeError: NVRTC failed (the log is in the message).
    """
    from cupy.cuda import nvrtc

    names = [n for dtype in _CTYPE for n in kernel_names(dtype).values()]
    names = list(dict.fromkeys(names))
    prog = nvrtc.createProgram(_source(), "specadapt_jit.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *_options()])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed on specadapt's CUDA headers: {exc}\n{nvrtc.getProgramLog(prog)}") from None
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        ptx = nvrtc.getPTX(prog)
        return (ptx.decode() if isinstance(ptx, bytes) else ptx), lowered
    finally:
        nvrtc.destroyProgram(prog)


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why the JIT path cannot run in this process (``None`` when it can): no CUDA device, no CuPy, no headers."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); pip install cupy-cuda12x or cupy-cuda13x to match the driver"
    try:
        headers_dir()
    except FileNotFoundError as exc:
        return str(exc)
    if not cuda_include_dirs():
        return "no CUDA headers (cuda_bf16.h) for NVRTC: set CUDA_PATH or pip install nvidia-cuda-runtime"
    return None


def available() -> bool:
    """True when the CuPy JIT path can run here."""
    return unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def _module(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        names = [n for dtype in _CTYPE for n in kernel_names(dtype).values()]
        module = cupy.RawModule(code=_source(), options=_options(), name_expressions=list(dict.fromkeys(names)))
        module.compile()
    logger.info("specadapt: compiled the CUDA verification kernels with NVRTC (CuPy) for device %d", device_index)
    return module


def _kernel(name: str, dtype: torch.dtype, device: torch.device):
    return _module(device.index if device.index is not None else torch.cuda.current_device()).get_function(
        kernel_names(dtype)[name]
    )


def check_args(candidates, target_probs, draft_probs, uniforms, uniforms_final, paths: bool = False) -> None:
    """Check shapes, dtypes and devices for the JIT path (the compiled ops check these in C++): the single-path
    contract of :func:`specadapt.kernels.verify`, or with ``paths`` the K-path one of
    :func:`specadapt.kernels.verify_paths`.

    Raises:
        ValueError: the first violation, naming the argument.
    """
    lead = 2 if paths else 1
    if candidates.dim() != lead + 1 or target_probs.dim() != lead + 2 or draft_probs.dim() != lead + 2:
        raise ValueError(f"candidates / target_probs / draft_probs must be [B, {'K, ' if paths else ''}L+1] / "
                         f"[..., L+1, V] / [..., L, V], got {tuple(candidates.shape)}, {tuple(target_probs.shape)}, "
                         f"{tuple(draft_probs.shape)}")
    if target_probs.shape[:-1] != candidates.shape or draft_probs.shape[:-2] != candidates.shape[:-1] \
            or draft_probs.shape[-2] != candidates.shape[-1] - 1 or draft_probs.shape[-1] != target_probs.shape[-1]:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} and draft_probs {tuple(draft_probs.shape)} do not "
                         f"fit candidates {tuple(candidates.shape)}")
    if target_probs.shape[-1] < 1 or (paths and candidates.shape[1] < 1):
        raise ValueError(f"target_probs needs V >= 1 and candidates K >= 1 paths, got {tuple(target_probs.shape)}")
    if draft_probs.dtype != target_probs.dtype:
        raise ValueError(f"draft_probs dtype must match target_probs ({target_probs.dtype}), got {draft_probs.dtype}")
    if candidates.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"candidates must be int64 or int32, got {candidates.dtype}")
    B, L = candidates.shape[0], candidates.shape[-1] - 1
    if tuple(uniforms.shape) != (B, L) or tuple(uniforms_final.shape) != (B,):
        raise ValueError(f"uniforms must be [B, L] = [{B}, {L}] and uniforms_final [B] = [{B}], got "
                         f"{tuple(uniforms.shape)} and {tuple(uniforms_final.shape)}")
    devices = {t.device for t in (candidates, target_probs, draft_probs, uniforms, uniforms_final)}
    if len(devices) != 1:
        raise ValueError("candidates, target_probs, draft_probs, uniforms and uniforms_final must be on one device")


def _ptr(t: torch.Tensor | None):
    """A kernel pointer argument: the tensor's device address as a 64-bit value (null for ``None``).

    Raw addresses rather than ``cupy.from_dlpack``: CuPy's DLPack import refuses or mishandles bfloat16 in several
    versions, and per-argument DLPack exchange costs a device switch and stream handshakes on every launch. The
    caller keeps the tensors alive until the launch is enqueued on torch's stream, which orders their reuse.
    """
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr())


def _launch(kernel, grid, block, args, device: torch.device) -> None:
    import cupy

    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        kernel(grid, block, args)


def _error_flag(error: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The caller's error flag, checked (``[>= 1] int32`` on ``device``), or a zeroed scratch one."""
    if error is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    if not isinstance(error, torch.Tensor) or error.dtype != torch.int32 or error.numel() < 1 \
            or error.device != device:
        raise ValueError(f"error must be an int32 tensor with at least one element on {device}, got "
                         f"{getattr(error, 'dtype', type(error).__name__)} {tuple(getattr(error, 'shape', ()))} "
                         f"on {getattr(error, 'device', '?')}")
    return error


def verify(rule, candidates, target_probs, draft_probs, uniforms, uniforms_final, num_draft_tokens=None,
           error=None):
    """Single-path verification (``chain`` / ``block``: the rule's one JIT kernel) through the JIT-compiled
    headers; contract of :func:`specadapt.kernels.verify` (CUDA tensors, probabilities float32 / bfloat16, L <= 64).

    ``error``: the ``[>= 1] int32`` device flag the kernel ORs its error bits into (``csrc/cuda/errors.cuh``;
    :func:`specadapt.kernel_errors.flag`), or ``None`` for a scratch flag nobody reads.

    Returns ``(accept_len [B] int32, output_tokens [B, L+1] int32)``. Raises ValueError for L > 64, a rule that
    is not a registered single-path rule, or a bad flag.
    """
    import numpy as np

    spec = get_rule(rule, "rule")
    if spec.multi_path:
        raise ValueError(f"rule {rule!r} verifies K paths; cuda_jit.verify runs single-path rules")

    B, L, V = candidates.shape[0], candidates.shape[1] - 1, target_probs.shape[2]
    if L > MAX_DRAFTS:
        raise ValueError(f"the CUDA kernels support at most {MAX_DRAFTS} draft tokens, got L = {L}")
    dev = target_probs.device
    cand = candidates.to(torch.int64).contiguous()
    p, q = target_probs.contiguous(), draft_probs.contiguous()
    u, uf = uniforms.to(torch.float64).contiguous(), uniforms_final.to(torch.float64).contiguous()
    n = num_draft_tokens.to(torch.int64).contiguous() if num_draft_tokens is not None else None
    accept_len = torch.zeros(B, dtype=torch.int32, device=dev)
    output_tokens = torch.full((B, L + 1), -1, dtype=torch.int32, device=dev)
    error = _error_flag(error, dev)
    if B:
        args = (_ptr(p), _ptr(q), _ptr(cand), _ptr(u), _ptr(uf), _ptr(n), _ptr(accept_len), _ptr(output_tokens),
                _ptr(error), np.int64(L), np.int64(V))
        _launch(_kernel(spec.jit_kernels[0][0], p.dtype, dev), (B,), (THREADS,), args, dev)
    return accept_len, output_tokens


def gbv_verify(candidates, target_probs, draft_probs, uniforms, uniforms_final, error=None):
    """GBV through the JIT-compiled headers (the pipeline of ``csrc/cuda/gbv.cu``, with a stable ``torch.sort``
    per depth for the ranking); contract of :func:`specadapt.kernels.verify_paths` on CUDA tensors, K <= 32. The
    host pipeline of the ``gbv`` rule (named like its op, ``gbv_verify``, as the registry says).
    ``error``: as for :func:`verify` (set by the walk and sample kernels).

    Returns ``(accept_len [B], output_tokens [B, L+1], chosen_path [B])`` int32. Raises ValueError for K > 32 or
    a bad flag.
    """
    import numpy as np

    B, K, L, V = candidates.shape[0], candidates.shape[1], candidates.shape[2] - 1, target_probs.shape[3]
    if not 1 <= K <= MAX_PATHS:
        raise ValueError(f"the CUDA GBV kernel supports 1 to {MAX_PATHS} paths, got K = {K}")
    if V < 1:
        raise ValueError(f"target_probs must have a vocabulary of V >= 1 entries, got V = {V}")
    dev, dtype = target_probs.device, target_probs.dtype
    cand = candidates.to(torch.int64).contiguous()
    p, q = target_probs.contiguous(), draft_probs.contiguous()
    u, uf = uniforms.to(torch.float64).contiguous(), uniforms_final.to(torch.float64).contiguous()
    i32 = dict(dtype=torch.int32, device=dev)
    f64 = dict(dtype=torch.float64, device=dev)
    accept_len, chosen = torch.zeros(B, **i32), torch.zeros(B, **i32)
    output_tokens = torch.full((B, L + 1), -1, **i32)
    if B == 0:
        return accept_len, output_tokens, chosen
    error = _error_flag(error, dev)
    keys, ids, cum = torch.empty(B, V, **f64), torch.empty(B, V, **i32), torch.empty(B, V, **f64)
    r, weights = torch.zeros(B, L + 1, **f64), torch.ones(B, L + 1, **f64)
    residual_mass = torch.zeros(B, max(L, 1), **f64)
    node_path = torch.zeros(B, max(L, 1), **i32)
    k64 = (np.int64(K), np.int64(L), np.int64(V))
    fill_grid = (B, min((V + THREADS - 1) // THREADS, 64))

    def ranked(depth_per_request, depth):
        _launch(_kernel("gbv_fill_keys", dtype, dev), fill_grid, (THREADS,),
                (_ptr(p), _ptr(q), _ptr(node_path), _ptr(depth_per_request), np.int64(depth), _ptr(keys), _ptr(ids),
                 *k64), dev)
        order = torch.sort(keys, dim=-1, stable=True).indices  # ties keep ascending token ids
        return torch.gather(ids, 1, order).contiguous()

    _launch(_kernel("gbv_walk", dtype, dev), (B,), (32,),
            (_ptr(p), _ptr(q), _ptr(cand), _ptr(chosen), _ptr(node_path), _ptr(error), *k64), dev)
    sorted_ids = ids
    for d in range(L):
        sorted_ids = ranked(None, d)
        _launch(_kernel("gbv_depth", dtype, dev), (B,), (THREADS,),
                (_ptr(p), _ptr(q), _ptr(cand), _ptr(chosen), _ptr(node_path), _ptr(sorted_ids), _ptr(cum), _ptr(r),
                 _ptr(weights), _ptr(residual_mass), np.int64(d), *k64), dev)
    _launch(_kernel("gbv_accept", dtype, dev), ((B + 127) // 128,), (128,),
            (_ptr(cand), _ptr(chosen), _ptr(u), _ptr(weights), _ptr(residual_mass), _ptr(accept_len),
             _ptr(output_tokens), np.int64(B), np.int64(K), np.int64(L)), dev)
    if L > 0:
        sorted_ids = ranked(accept_len, 0)
    _launch(_kernel("gbv_sample", dtype, dev), (B,), (THREADS,),
            (_ptr(p), _ptr(q), _ptr(chosen), _ptr(node_path), _ptr(accept_len), _ptr(sorted_ids), _ptr(cum), _ptr(r),
             _ptr(weights), _ptr(uf), _ptr(output_tokens), _ptr(error), *k64), dev)
    return accept_len, output_tokens, chosen
