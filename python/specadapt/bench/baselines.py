"""External baselines of ``specadapt bench-kernels``: build a baseline's arguments from our inputs and call it.

Two baselines, both GPU-only and both optional (used only when importable):

* ``flashinfer_chain``: ``flashinfer.sampling.chain_speculative_sampling(draft_probs, draft_token_ids,
  target_probs, ...)``, compared with our ``chain`` op. It draws its own coins (recent flashinfer has no
  ``uniform_samples`` argument; versions that still take one get ours).
* ``sglang_triton``: SGLang 0.5.23's Triton chain kernel, compared with our ``chain`` op and, with
  ``block_verification=True``, our ``block`` op; its loader and argument builder live with the other
  sglang-facing code in :mod:`specadapt.sglang.baselines` (this module never touches sglang).

Nothing imports flashinfer, sglang or triton at module import: each baseline's ``load`` does.
Timing and the report live in :mod:`specadapt.bench.kernels`.

Our inputs (``make_inputs``): ``cand [B, L+1] int64`` (slot 0 the root), ``p [B, L+1, V]``, ``q [B, L, V]``,
``u [B, L] float64`` (per-position coins), ``uf [B] float64`` (final coin).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..sglang import baselines as _sglang  # imports no sglang: only its loader does

__all__ = [
    "BASELINES",
    "Baseline",
    "LoadedBaseline",
    "flashinfer_chain_kwargs",
    "resolve",
    "status_line",
]


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


def _load_flashinfer():
    import flashinfer
    from flashinfer.sampling import chain_speculative_sampling

    return chain_speculative_sampling, f"flashinfer {getattr(flashinfer, '__version__', '?')}"


BASELINES: dict[str, Baseline] = {
    "flashinfer_chain": Baseline("flashinfer_chain", ("chain",), _load_flashinfer, flashinfer_chain_kwargs),
    "sglang_triton": Baseline("sglang_triton", ("chain", "block"), _sglang.load_triton_chain,
                              _sglang.triton_chain_kwargs),
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
