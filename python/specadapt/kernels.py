"""Access to the compiled ops of ``specadapt._C``, the CuPy JIT of the CUDA kernels, and the float64 references.

The extension registers its ops with ``TORCH_LIBRARY`` under the ``specadapt::`` namespace; this module loads
it, registers the fake (meta) implementations used by ``torch.compile`` and ``torch.library.opcheck``, and
exposes Python functions that dispatch to the compiled op when it exists for the tensors' device, on CUDA to
the CuPy (NVRTC) JIT of the same headers when the extension was built without CUDA, and to the float64
reference otherwise, saying so once in the log (never silently): :func:`choose_implementation`.

CUDA launches report device-side failures through error flags (:mod:`specadapt.kernel_errors`), read without a
sync on the launch path: :func:`check_device_errors` on demand, or after every launch in debug mode
(:func:`set_debug`, ``SPECADAPT_DEBUG_KERNELS=1``). The IRLS op's wrapper lives with its reference in
:mod:`specadapt.estimator.irls` (the estimator depends on this module, not the reverse).
"""

from __future__ import annotations

import functools
import logging

import torch

from . import kernel_errors
from .kernel_errors import check_device_errors, set_debug
from .verification import VerifyOutput
from .verification.block import residual_mass_reference
from .verification.common import sample_from_unnormalized
from .verification.gbv import GBVOutput
from .verification.rules import RULES, VerificationRule, get_rule, rule_names

logger = logging.getLogger(__name__)

__all__ = [
    "extension_available",
    "extension_error",
    "block_residual_mass",
    "has_op_for",
    "verify",
    "verify_paths",
    "verify_paths_capped",
    "gbv_verify",
    "gbv_verify_capped",
    "IMPLEMENTATIONS",
    "choose_implementation",
    "check_device_errors",
    "set_debug",
]

IMPLEMENTATIONS = ("auto", "compiled", "cupy", "reference")

try:
    from . import _C  # noqa: F401  (import registers the ops)

    _EXTENSION_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _EXTENSION_ERROR = str(exc)

_warned: set[str] = set()


def extension_available() -> bool:
    """True when ``specadapt._C`` was built and imported."""
    return _EXTENSION_ERROR is None


def extension_error() -> str | None:
    """Why the extension could not be imported (``None`` when it was)."""
    return _EXTENSION_ERROR


if extension_available():

    @torch.library.register_fake("specadapt::block_residual_mass")
    def _block_residual_mass_fake(target_probs, draft_probs, weights):
        torch._check(target_probs.dim() == 2)
        return target_probs.new_empty((target_probs.shape[0],), dtype=torch.float32)

    def _single_path_fake(candidates, target_probs, draft_probs, uniforms, uniforms_final, num_draft_tokens=None,
                          error=None):
        torch._check(candidates.dim() == 2)
        batch, slots = candidates.shape
        return (
            candidates.new_empty((batch,), dtype=torch.int32),
            candidates.new_empty((batch, slots), dtype=torch.int32),
        )

    def _multi_path_fake(candidates, target_probs, draft_probs, uniforms, uniforms_final, error=None):
        torch._check(candidates.dim() == 3)
        batch, _, slots = candidates.shape
        return (
            candidates.new_empty((batch,), dtype=torch.int32),
            candidates.new_empty((batch, slots), dtype=torch.int32),
            candidates.new_empty((batch,), dtype=torch.int32),
        )

    for _spec in RULES.values():  # one fake per registered rule, by its op signature
        _fake = _multi_path_fake if _spec.multi_path else _single_path_fake
        torch.library.register_fake(f"specadapt::{_spec.op}")(_fake)

    @torch.library.register_fake("specadapt::irls_accumulate")
    def _irls_fake(features, predictions, accepted, verified):
        torch._check(features.dim() == 2)
        return features.new_empty((features.shape[1], 6), dtype=torch.float64)


def has_op_for(op_name: str, device: torch.device) -> bool:
    """Whether ``specadapt::<op_name>`` has a compiled kernel for ``device``'s dispatch key (looked up once per
    op and device type: the registrations are fixed when ``specadapt._C`` is imported)."""
    return _has_op_for(op_name, torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _has_op_for(op_name: str, device_type: str) -> bool:
    if not extension_available():
        return False
    key = "CUDA" if device_type == "cuda" else "CPU" if device_type == "cpu" else None
    if key is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"specadapt::{op_name}", key)


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(message)


def block_residual_mass(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Block-verification residual reduction ``Z[n] = sum_v max(w[n] p[n, v] - q[n, v], 0)``.

    Sun et al., arXiv 2403.10444, Algorithm 2 (the ``Z_i`` of docs/design/specs/verification.md section 2).

    Args:
        target_probs: ``[N, V]`` float32 or bfloat16.
        draft_probs: ``[N, V]`` same dtype as ``target_probs``.
        weights: ``[N]`` float32.

    Returns:
        ``[N] float32``, accumulated in float32.

    Raises:
        RuntimeError: from the compiled op for wrong shapes / dtypes / devices (the message names the argument).
    """
    if has_op_for("block_residual_mass", target_probs.device):
        return torch.ops.specadapt.block_residual_mass(target_probs, draft_probs, weights)
    _warn_once(
        f"block_residual_mass:{target_probs.device.type}",
        f"specadapt::block_residual_mass has no compiled kernel for {target_probs.device.type} "
        f"({extension_error() or 'not built for this device'}); using the PyTorch reference",
    )
    return residual_mass_reference(target_probs.float(), draft_probs.float(), weights.float())


def choose_implementation(op_name: str, impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which implementation of ``specadapt::<op_name>`` runs for probabilities on ``device`` as ``dtype``.

    ``auto``: the compiled extension when it has a kernel for the device, else (CUDA only) the CuPy JIT of the same
    CUDA headers (:mod:`specadapt.cuda_jit`), else the float64 reference, with a logged warning saying why (once
    per op / device / dtype). ``compiled``, ``cupy`` and ``reference`` force one.

    Returns:
        ``"compiled"``, ``"cupy"`` or ``"reference"``.

    Raises:
        ValueError: unknown ``impl``; a forced implementation that cannot run here (the message says why).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "reference":
        return "reference"
    kernel_dtype = dtype in (torch.float32, torch.bfloat16)
    compiled = kernel_dtype and has_op_for(op_name, device)
    from . import cuda_jit

    jit_reason = cuda_jit.unavailable_reason() if device.type == "cuda" else f"the CuPy JIT runs on CUDA, not {device.type}"
    jit = kernel_dtype and jit_reason is None
    if impl == "compiled" and not compiled:
        raise ValueError(
            f"impl='compiled' but specadapt::{op_name} has no kernel for target_probs on {device.type} "
            f"as {dtype} (kernels take float32 / bfloat16; {extension_error() or 'built devices only'})"
        )
    if impl == "cupy" and not jit:
        raise ValueError(f"impl='cupy' but the CuPy JIT cannot run {op_name} on {device.type} as {dtype}: "
                         f"{jit_reason or 'kernels take float32 / bfloat16'}")
    if impl in ("compiled", "cupy"):
        return impl
    if compiled:
        return "compiled"
    if jit:
        _warn_once(f"{op_name}:{device.type}:jit", f"specadapt::{op_name} is not compiled for {device.type}; "
                   "running the CuPy (NVRTC) JIT of the same CUDA kernels")
        return "cupy"
    _warn_once(
        f"{op_name}:{device.type}:{dtype}",
        f"specadapt::{op_name} has no compiled kernel for {device.type} / {dtype}"
        + (f" and no CuPy JIT ({jit_reason})" if device.type == "cuda" else "")
        + "; using the float64 PyTorch reference",
    )
    return "reference"


def _check_finite_target(target_probs: torch.Tensor) -> None:
    if not bool(torch.isfinite(target_probs).all()) or bool((target_probs < 0).any()):
        raise ValueError("target_probs contains NaN, inf or negative entries")


def _error_flag(kernel: str, target_probs: torch.Tensor) -> torch.Tensor | None:
    """The device error flag of a CUDA launch (:func:`specadapt.kernel_errors.flag`); ``None`` on CPU, whose
    kernels raise directly."""
    return kernel_errors.flag(kernel, target_probs.device) if target_probs.device.type == "cuda" else None


def _after_launch(kernel: str, target_probs: torch.Tensor) -> None:
    if target_probs.device.type == "cuda":
        kernel_errors.after_launch(kernel, target_probs.device)


def _call_op(op, *args):
    try:
        return op(*args)
    except RuntimeError as exc:  # TORCH_CHECK failures: same exception type as the reference
        raise ValueError(str(exc).split("\n")[0]) from None


def verify(
    rule: str,
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    impl: str = "auto",
    debug: bool = False,
) -> VerifyOutput:
    """Single-path verification (a rule of :data:`specadapt.verification.rules.RULES` with ``multi_path`` false:
    ``chain``, ``block``) with the fastest implementation available.

    Same contract and the same tokens for the same coins as the float64 references in
    :mod:`specadapt.verification` (``candidates [B, L+1] int64``, ``target_probs [B, L+1, V]``,
    ``draft_probs [B, L, V]`` float32/bfloat16, ``uniforms [B, L]``, ``uniforms_final [B]``, optional
    ``num_draft_tokens [B]``; returns ``accept_len [B] int32`` and ``output_tokens [B, L+1] int32``).

    Args:
        rule: a single-path rule name (``chain`` or ``block``).
        impl: ``auto`` (compiled kernel when one exists for the device and dtype, else on CUDA the CuPy JIT of the
            same kernels, else the reference, with a logged warning), ``compiled`` / ``cupy`` (error if
            unavailable) or ``reference``; see :func:`choose_implementation`.
        debug: raise on NaN/inf/negative target probabilities.

    Raises:
        ValueError: unknown or multi-path rule, unknown impl, bad shapes/dtypes/ids/coins (the message names the
            argument); on CPU also a row that does not sum to 1 or a massless target row. On CUDA those two cannot
            raise without a sync: the kernel writes -1 as the extra token and sets its device error flag, read by
            :func:`check_device_errors` (after every launch in debug mode, :func:`set_debug`).
    """
    spec = _rule(rule, multi_path=False)
    tensors = (candidates, target_probs, draft_probs, uniforms, uniforms_final)
    return _dispatch(spec, tensors, (num_draft_tokens,), impl, debug, VerifyOutput,
                     lambda cuda_jit: functools.partial(cuda_jit.verify, spec.name))


def _dispatch(spec: VerificationRule, tensors: tuple, extra: tuple, impl: str, debug: bool, output_type, jit_entry):
    """Run ``spec``'s reference, compiled op or CuPy JIT pipeline (``jit_entry(cuda_jit)``) on ``tensors``
    (candidates, target_probs, draft_probs, uniforms, uniforms_final) plus the op's ``extra`` arguments; on CUDA
    the launch gets its device error flag (:mod:`specadapt.kernel_errors`)."""
    target_probs = tensors[1]
    if not isinstance(target_probs, torch.Tensor):
        raise TypeError(f"target_probs must be a torch.Tensor, got {type(target_probs).__name__}")
    chosen = choose_implementation(spec.op, impl, target_probs.device, target_probs.dtype)
    if chosen == "reference":
        return spec.reference(*tensors, *extra, debug=debug)
    if debug:
        _check_finite_target(target_probs)
    error = _error_flag(spec.op, target_probs)
    if chosen == "cupy":
        from . import cuda_jit

        cuda_jit.check_args(*tensors, paths=spec.multi_path)
        out = output_type(*jit_entry(cuda_jit)(*tensors, *extra, error=error))
    else:
        out = output_type(*_call_op(getattr(torch.ops.specadapt, spec.op), *tensors, *extra, error))
    _after_launch(spec.op, target_probs)
    return out


def _rule(rule: str, multi_path: bool) -> VerificationRule:
    """The registered rule ``rule``, checked to be single- or multi-path as the caller needs."""
    spec = get_rule(rule, "rule")
    if spec.multi_path != multi_path:
        kind, call = ("multi-path", "verify_paths") if spec.multi_path else ("single-path", "verify")
        raise ValueError(f"rule {rule!r} is a {kind} rule: call kernels.{call} (rules here: "
                         f"{', '.join(rule_names(multi_path))})")
    return spec


def verify_paths(
    rule: str,
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    impl: str = "auto",
    debug: bool = False,
) -> GBVOutput:
    """Multi-path verification (a rule with ``multi_path`` true: ``gbv``) with the fastest implementation available.

    Contract of the rule's reference (:func:`specadapt.verification.gbv.gbv_verify`): ``candidates [B, K, L+1]``,
    ``target_probs [B, K, L+1, V]``, ``draft_probs [B, K, L, V]``, ``uniforms [B, L]``, ``uniforms_final [B]``
    -> ``accept_len [B]``, ``output_tokens [B, L+1]``, ``chosen_path [B]`` (int32).

    Raises:
        ValueError: unknown or single-path rule; otherwise as :func:`verify`.
    """
    spec = _rule(rule, multi_path=True)
    tensors = (candidates, target_probs, draft_probs, uniforms, uniforms_final)
    # the rule's host pipeline of JIT kernels is named like its op (cuda_jit.gbv_verify)
    return _dispatch(spec, tensors, (), impl, debug, GBVOutput, lambda cuda_jit: getattr(cuda_jit, spec.op))


def gbv_verify(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    impl: str = "auto",
    debug: bool = False,
) -> GBVOutput:
    """Greedy multi-path block verification: :func:`verify_paths` with ``rule="gbv"`` (same contract and errors)."""
    return verify_paths("gbv", candidates, target_probs, draft_probs, uniforms, uniforms_final, impl=impl,
                        debug=debug)


def verify_paths_capped(
    rule: str,
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    caps: torch.Tensor,
    impl: str = "auto",
) -> GBVOutput:
    """:func:`verify_paths` with request ``b`` verifying only the first ``caps[b]`` drafts of every path (adaptive
    verification's per-request budget, a rule's ``adaptive_caps == "shared_prefix"``): the rule at depth
    ``caps[b]`` on the paths' prefixes, one call per distinct cap; a request with cap 0 takes its next token
    straight from the target (``target_probs[b, 0, 0]`` with ``uniforms_final[b]``, inverse CDF). Exact when the
    caps do not depend on the drafted tokens (for example chosen from the committed context only, as the embedded
    engine does).

    Args:
        rule: a multi-path rule name (``gbv``).
        candidates ... uniforms_final: as :func:`verify_paths` (``[B, K, L+1]``, ``[B, K, L+1, V]``, ``[B, K, L, V]``,
            ``[B, L]``, ``[B]``).
        caps: ``[B]`` int, clamped to ``[0, L]``.

    Returns:
        :class:`GBVOutput` (``accept_len [B]``, ``output_tokens [B, L+1]``, ``chosen_path [B]``, int32; columns past
        ``caps[b] + 1`` are 0).
    """
    _rule(rule, multi_path=True)
    batch, _, slots = candidates.shape
    depth = slots - 1
    device = candidates.device
    caps_host = caps.to("cpu", torch.int64).clamp(0, depth)
    if bool((caps_host >= depth).all()):
        return verify_paths(rule, candidates, target_probs, draft_probs, uniforms, uniforms_final, impl=impl)
    accept_len = torch.zeros(batch, dtype=torch.int32, device=device)
    output = torch.zeros(batch, slots, dtype=torch.int32, device=device)
    chosen = torch.zeros(batch, dtype=torch.int32, device=device)
    for cap in sorted(set(caps_host.tolist())):
        rows = (caps_host == cap).nonzero().squeeze(1).to(device)
        if cap == 0:  # nothing verified: the next token straight from the target
            p = target_probs[rows, 0, 0].double()
            output[rows, 0] = sample_from_unnormalized(p, p, uniforms_final[rows].double()).to(torch.int32)
            continue
        part = verify_paths(rule, candidates[rows, :, : cap + 1].contiguous(),
                            target_probs[rows, :, : cap + 1].contiguous(), draft_probs[rows, :, :cap].contiguous(),
                            uniforms[rows, :cap].contiguous(), uniforms_final[rows].contiguous(), impl=impl)
        accept_len[rows] = part.accept_len.to(torch.int32)
        output[rows, : cap + 1] = part.output_tokens.to(torch.int32)
        chosen[rows] = part.chosen_path.to(torch.int32)
    return GBVOutput(accept_len, output, chosen)


def gbv_verify_capped(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    uniforms_final: torch.Tensor,
    caps: torch.Tensor,
    impl: str = "auto",
) -> GBVOutput:
    """:func:`verify_paths_capped` with ``rule="gbv"`` (same contract)."""
    return verify_paths_capped("gbv", candidates, target_probs, draft_probs, uniforms, uniforms_final, caps, impl=impl)

