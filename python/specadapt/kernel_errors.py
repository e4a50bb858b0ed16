"""Device-side errors of the CUDA verification kernels: the flags they write, their decoding, and reading them.

A CUDA kernel cannot raise without a host synchronisation, so the chain / block / GBV kernels OR error bits
(``csrc/cuda/errors.cuh``, mirrored by :data:`ERROR_BITS`) into an ``int32`` flag and write ``-1`` where a token
could not be drawn. This module owns those flags: one ``int32`` per kernel family (:data:`KERNELS`) and device,
handed to each launch (compiled extension or CuPy JIT) by :func:`flag`. Nothing reads them on the hot path;
:func:`check_device_errors` reads (one device-to-host copy, a sync), resets and raises:

* on demand (tests, a serving loop at a point where it synchronises anyway, after a run);
* after every launch in debug mode: ``SPECADAPT_DEBUG_KERNELS=1`` in the environment or :func:`set_debug`.

The CPU kernels and the float64 references raise the same conditions directly (ValueError / RuntimeError) and
never touch a flag. No torch-free-header or framework import here: a leaf module that ``kernels`` and
``cuda_jit`` share.
"""

from __future__ import annotations

import os
import threading

import torch

from .verification.rules import RULES

__all__ = [
    "DEBUG_ENV",
    "ERROR_BITS",
    "KERNELS",
    "DeviceKernelError",
    "after_launch",
    "check_device_errors",
    "debug_enabled",
    "describe",
    "flag",
    "set_debug",
]

DEBUG_ENV = "SPECADAPT_DEBUG_KERNELS"

#: Kernel families with a flag (one slot each per device), as the ``specadapt::`` op names: every registered
#: verification rule's op (:mod:`specadapt.verification.rules`).
KERNELS = tuple(rule.op for rule in RULES.values())

#: bit -> (name of the constant in csrc/cuda/errors.cuh, meaning, the ``__global__`` kernels that set it).
ERROR_BITS: dict[int, tuple[str, str, dict[str, str]]] = {
    1: ("kErrorNoTargetMass", "the target row of the extra token has no mass: nothing can be sampled (extra token -1)",
        {"chain_verify": "chain_verify_kernel", "block_verify": "block_verify_kernel",
         "gbv_verify": "gbv_sample_kernel"}),
    2: ("kErrorZeroDraftProb", "draft_probs gives probability 0 to a drafted token on the walked path (not a sample "
        "from q)", {"gbv_verify": "gbv_walk_kernel"}),
    4: ("kErrorRowSum", "a row of target_probs or draft_probs the output depends on does not sum to 1 (extra "
        "token -1)", {"chain_verify": "chain_verify_kernel", "block_verify": "block_verify_kernel",
                      "gbv_verify": "gbv_sample_kernel"}),
}


class DeviceKernelError(RuntimeError):
    """A CUDA verification kernel reported an error through its device flag.

    Attributes:
        errors: ``{(kernel, device): code}`` of every non-zero flag read (``kernel`` in :data:`KERNELS`).
    """

    def __init__(self, errors: dict[tuple[str, str], int]):
        self.errors = dict(errors)
        super().__init__("; ".join(describe(kernel, code, device) for (kernel, device), code in self.errors.items()))


def describe(kernel: str, code: int, device: str | torch.device = "cuda") -> str:
    """One line naming ``kernel`` (a :data:`KERNELS` entry), ``device`` and every bit of ``code`` decoded.

    Raises:
        ValueError: ``kernel`` is not in :data:`KERNELS`.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    code = int(code)
    parts = []
    for bit, (const, meaning, where) in ERROR_BITS.items():
        if code & bit:
            parts.append(f"{const} ({meaning}; {where.get(kernel, 'not set by this kernel')})")
    unknown = code & ~sum(ERROR_BITS)
    if unknown:
        parts.append(f"unknown bits {unknown:#x}")
    return f"specadapt::{kernel} on {device} reported device error {code}: " + ", ".join(parts)


_lock = threading.Lock()
_flags: dict[torch.device, torch.Tensor] = {}
_debug: bool | None = None  # None: follow the environment


def flag(kernel: str, device: torch.device) -> torch.Tensor:
    """The ``[1] int32`` error flag of ``kernel`` on ``device`` (a view of one persistent per-device buffer,
    zeroed at creation; launches OR bits into it on their stream). Pass it to the kernel's launch.

    Raises:
        ValueError: ``kernel`` is not in :data:`KERNELS`.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _flags.get(device)
    if buf is None:
        with _lock:
            buf = _flags.get(device)
            if buf is None:
                buf = _flags[device] = torch.zeros(len(KERNELS), dtype=torch.int32, device=device)
    i = KERNELS.index(kernel)
    return buf[i : i + 1]


def check_device_errors(device: torch.device | str | None = None) -> None:
    """Read, reset and raise the error flags of every device (or only ``device``).

    Synchronises with each flagged device's current stream (one small device-to-host copy per device with flags):
    call it on demand, not per launch on the hot path. Bits set by launches enqueued before the call are seen;
    the reset is enqueued on the same stream, so later launches' bits are kept for the next check.

    Raises:
        DeviceKernelError: (a RuntimeError) some flag was non-zero; the message names the kernel, the device and
            the decoded bits; ``.errors`` holds ``{(kernel, device): code}``.
    """
    wanted = None if device is None else torch.device(device)
    errors: dict[tuple[str, str], int] = {}
    for dev, buf in list(_flags.items()):
        if wanted is not None and (dev.type != wanted.type or (wanted.index is not None and dev.index != wanted.index)):
            continue
        snapshot = buf.clone()
        buf.zero_()
        for kernel, code in zip(KERNELS, snapshot.cpu().tolist()):
            if code:
                errors[(kernel, str(dev))] = int(code)
    if errors:
        raise DeviceKernelError(errors)


def set_debug(enabled: bool | None) -> None:
    """Debug mode on (``True``: check the flags after every launch, a host sync each) or off (``False``);
    ``None`` follows ``SPECADAPT_DEBUG_KERNELS`` again."""
    global _debug
    _debug = None if enabled is None else bool(enabled)


def debug_enabled() -> bool:
    """Whether :func:`after_launch` checks the flags (:func:`set_debug`, else ``SPECADAPT_DEBUG_KERNELS=1``)."""
    if _debug is not None:
        return _debug
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def after_launch(kernel: str, device: torch.device) -> None:
    """Hook the launchers call after enqueuing ``kernel`` on ``device``: in debug mode, :func:`check_device_errors`
    for that device (skipped while a CUDA graph is being captured, where a sync is not allowed); otherwise
    nothing (no sync)."""
    if not debug_enabled():
        return
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    check_device_errors(device)
