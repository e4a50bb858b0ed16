"""External baselines of ``specadapt bench-kernels``: build a baseline's arguments from our inputs and call it.

Two baselines, both GPU-only and both optional (used only when importable):

* ``flashinfer_chain``: ``flashinfer.sampling.chain_speculative_sampling(draft_probs, draft_token_ids,
  target_probs, ...)``, compared with our ``chain`` op. It draws its own coins (recent flashinfer has no
  ``uniform_samples`` argument; versions that still take one get ours).
* ``sglang_triton``: SGLang 0.5.23's Triton kernel
  ``sglang.kernels.ops.speculative.reject_sampling.chain_speculative_sampling_triton``, compared with our
  ``chain`` op and, with ``block_verification=True``, our ``block`` op. Without an installed ``sglang`` the
  kernel's file can be loaded from a path given in ``SPECADAPT_SGLANG_REJECT_SAMPLING`` (the file imports only
  triton), e.g. from an unpacked sglang wheel.

Nothing here imports flashinfer, sglang or triton at module import: each baseline's ``load`` does.
Timing and the report live in :mod:`specadapt.bench.kernels`.

Our inputs (``make_inputs``): ``cand [B, L+1] int64`` (slot 0 the root), ``p [B, L+1, V]``, ``q [B, L, V]``,
``u [B, L] float64`` (per-position coins), ``uf [B] float64`` (final coin).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "BASELINES",
    "Baseline",
    "LoadedBaseline",
    "SGLANG_FILE_ENV",
    "flashinfer_chain_kwargs",
    "resolve",
    "sglang_triton_kwargs",
    "status_line",
]

SGLANG_FILE_ENV = "SPECADAPT_SGLANG_REJECT_SAMPLING"
SGLANG_MODULE = "sglang.kernels.ops.speculative.reject_sampling"


@dataclass(frozen=True)
class Baseline:
    """An external kernel timed against our ops.

    ``load()`` returns ``(function, version)`` and raises (ImportError, typically) when it is not available;
    ``kwargs(op, function, inputs)`` returns the keyword arguments of one call on our ``inputs`` for ``op``.
    """

    name: str
    ops: tuple[str, ...]
    load: Callable[[], tuple[Callable, str | None]]
    kwargs: Callable[[str, Callable, list], dict]
    devices: tuple[str, ...] = ("cuda",)


@dataclass
class LoadedBaseline:
    baseline: Baseline
    fn: Callable
    version: str | None = None

    def prepare(self, op: str, inputs: list) -> Callable[[], Any]:
        """A no-argument call of the baseline on ``inputs`` (arguments built once, outside any timing)."""
        kw = self.baseline.kwargs(op, self.fn, inputs)
        fn = self.fn
        return lambda: fn(**kw)


def _accepted_params(fn: Callable) -> set | None:
    """Parameter names of ``fn``, or None when it takes ``**kwargs`` (or has no signature)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def _split(inputs: list):
    cand, p, q, u, uf = inputs
    if cand.dim() != 2 or p.dim() != 3 or q.dim() != 3:
        raise ValueError("baselines take chain / block inputs: cand [B, L+1], p [B, L+1, V], q [B, L, V]")
    return cand, p, q, u, uf


def flashinfer_chain_kwargs(op: str, fn: Callable, inputs: list) -> dict:
    """Arguments of ``flashinfer.sampling.chain_speculative_sampling`` for our chain inputs.

    ``draft_probs [B, L, V] float32``, ``draft_token_ids [B, L] int32``, ``target_probs [B, L+1, V] float32``,
    the two ``[B] int32`` counters it adds into, ``deterministic=True``; plus ``uniform_samples [B, L+1]
    float32`` (our L coins then the final one) for flashinfer versions whose signature still has it.
    Arguments the function's signature does not name are left out.
    """
    if op != "chain":
        raise ValueError(f"flashinfer_chain compares with chain, not {op}")
    cand, p, q, u, uf = _split(inputs)
    batch, dev = cand.shape[0], cand.device
    kw = {
        "draft_probs": q.float().contiguous(),
        "draft_token_ids": cand[:, 1:].to(torch.int32).contiguous(),
        "target_probs": p.float().contiguous(),
        "maybe_output_accepted_token_num": torch.zeros(batch, dtype=torch.int32, device=dev),
        "maybe_output_emitted_draft_token_num": torch.zeros(batch, dtype=torch.int32, device=dev),
        "deterministic": True,
    }
    params = _accepted_params(fn)
    if params is not None and "uniform_samples" in params:
        kw["uniform_samples"] = torch.cat([u, uf[:, None]], dim=1).float().contiguous()
    if params is not None:
        kw = {k: v for k, v in kw.items() if k in params}
    return kw


def sglang_triton_kwargs(op: str, fn: Callable, inputs: list) -> dict:
    """Arguments of SGLang's ``chain_speculative_sampling_triton`` for our chain / block inputs.

    SGLang's chain layout (``eagle_utils`` / ``dflash_utils`` in 0.5.23): ``candidates [B, L+1] int64``,
    ``retrive_index [B, L+1] int64`` (``b * (L+1) + j``), ``retrive_next_token`` / ``retrive_next_sibling``
    ``[B, L+1] int64`` (a chain: next is j+1, last -1; no siblings), ``uniform_samples [B, L+1] float32`` (the
    first L are the coins), ``uniform_samples_for_final_sampling [B] float32``, ``target_probs [B, L+1, V]``
    and ``draft_probs [B, L, V]`` float32, outputs ``predicts [B*(L+1)]``, ``accept_index [B, L+1]``,
    ``accept_token_num [B]`` int32; ``block_verification=True`` for our ``block`` op.

    Raises:
        ValueError: ``op`` is ``block`` and this SGLang's kernel has no ``block_verification`` switch.
    """
    if op not in ("chain", "block"):
        raise ValueError(f"sglang_triton compares with chain and block, not {op}")
    cand, p, q, u, uf = _split(inputs)
    batch, slots = cand.shape
    dev = cand.device
    next_token = torch.arange(1, slots + 1, dtype=torch.int64, device=dev)
    next_token[-1] = -1
    kw = {
        "predicts": torch.zeros(batch * slots, dtype=torch.int32, device=dev),
        "accept_index": torch.zeros(batch, slots, dtype=torch.int32, device=dev),
        "accept_token_num": torch.zeros(batch, dtype=torch.int32, device=dev),
        "candidates": cand.to(torch.int64).contiguous(),
        "retrive_index": torch.arange(batch * slots, dtype=torch.int64, device=dev).view(batch, slots),
        "retrive_next_token": next_token.expand(batch, slots).contiguous(),
        "retrive_next_sibling": torch.full((batch, slots), -1, dtype=torch.int64, device=dev),
        "uniform_samples": torch.cat([u, uf[:, None]], dim=1).float().contiguous(),
        "uniform_samples_for_final_sampling": uf.float().contiguous(),
        "target_probs": p.float().contiguous(),
        "draft_probs": q.float().contiguous(),
        "threshold_single": 1.0,
        "threshold_acc": 1.0,
        "deterministic": True,
    }
    if op == "block":
        params = _accepted_params(fn)
        if params is not None and "block_verification" not in params:
            raise ValueError("this SGLang kernel has no block_verification argument")
        kw["block_verification"] = True
    return kw


def _load_flashinfer():
    import flashinfer
    from flashinfer.sampling import chain_speculative_sampling

    return chain_speculative_sampling, f"flashinfer {getattr(flashinfer, '__version__', '?')}"


def _load_sglang():
    try:
        module = importlib.import_module(SGLANG_MODULE)
        try:
            from importlib.metadata import version

            ver = f"sglang {version('sglang')}"
        except Exception:  # noqa: BLE001 - a version string is only informative
            ver = "sglang ?"
    except ImportError as exc:
        path = os.environ.get(SGLANG_FILE_ENV)
        if not path:
            raise ImportError(f"{exc} (or set {SGLANG_FILE_ENV} to sglang's kernels/ops/speculative/"
                              "reject_sampling.py)") from exc
        if not os.path.isfile(path):
            raise ImportError(f"{SGLANG_FILE_ENV}={path}: no such file") from exc
        spec = importlib.util.spec_from_file_location("_specadapt_sglang_reject_sampling", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # imports triton; raises ImportError without it
        ver = f"file {path}"
    return module.chain_speculative_sampling_triton, ver


BASELINES: dict[str, Baseline] = {
    "flashinfer_chain": Baseline("flashinfer_chain", ("chain",), _load_flashinfer, flashinfer_chain_kwargs),
    "sglang_triton": Baseline("sglang_triton", ("chain", "block"), _load_sglang, sglang_triton_kwargs),
}


def resolve(device: torch.device, registry: dict[str, Baseline] | None = None):
    """Load the baselines usable on ``device``.

    Returns:
        ``(loaded, skipped)``: ``{name: LoadedBaseline}`` and ``{name: reason}``; a reason is the device
        mismatch or the import error as ``"ExceptionType: message"``.
    """
    registry = BASELINES if registry is None else registry
    loaded, skipped = {}, {}
    for name, base in registry.items():
        if device.type not in base.devices:
            skipped[name] = f"needs {'/'.join(base.devices)}, device is {device.type}"
            continue
        try:
            fn, version = base.load()
        except Exception as exc:  # noqa: BLE001 - a broken install is skipped, not fatal
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        loaded[name] = LoadedBaseline(base, fn, version)
    return loaded, skipped


def status_line(loaded: dict, skipped: dict) -> str:
    """One line: which baselines were found (with version) and which were skipped and why."""
    found = ", ".join(f"{n} ({b.version or '?'})" for n, b in loaded.items()) or "none"
    miss = "; ".join(f"{n} ({why})" for n, why in skipped.items()) or "none"
    return f"baselines: found {found}; skipped {miss}"
