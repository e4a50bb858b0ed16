"""SGLang's Triton chain / block verification kernel as a ``specadapt bench-kernels`` baseline.

The kernel is ``sglang.kernels.ops.speculative.reject_sampling.chain_speculative_sampling_triton`` (SGLang 0.5.23);
:mod:`specadapt.bench.baselines` registers it as ``sglang_triton`` and times it against our ``chain`` op and, with
``block_verification=True``, our ``block`` op. Without an installed ``sglang`` the kernel's file can be loaded from
a path given in ``SPECADAPT_SGLANG_REJECT_SAMPLING`` (the file imports only triton), e.g. from an unpacked sglang
wheel. Importing this module imports neither sglang nor triton: :func:`load_triton_chain` does.

Our inputs: ``cand [B, L+1] int64`` (slot 0 the root), ``p [B, L+1, V]``, ``q [B, L, V]``, ``u [B, L] float64``
(per-position coins), ``uf [B] float64`` (final coin).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from typing import Callable

import torch

__all__ = ["SGLANG_FILE_ENV", "SGLANG_MODULE", "load_triton_chain", "triton_chain_kwargs"]

SGLANG_FILE_ENV = "SPECADAPT_SGLANG_REJECT_SAMPLING"
SGLANG_MODULE = "sglang.kernels.ops.speculative.reject_sampling"


def _takes_block_switch(fn: Callable) -> bool:
    """Whether ``fn`` accepts ``block_verification`` (True when it takes ``**kwargs`` or has no signature)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "block_verification" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def triton_chain_kwargs(op: str, fn: Callable, inputs: list) -> dict:
    """Arguments of SGLang's ``chain_speculative_sampling_triton`` for our chain / block inputs.

    SGLang's chain layout (``eagle_utils`` / ``dflash_utils`` in 0.5.23): ``candidates [B, L+1] int64``,
    ``retrive_index [B, L+1] int64`` (``b * (L+1) + j``), ``retrive_next_token`` / ``retrive_next_sibling``
    ``[B, L+1] int64`` (a chain: next is j+1, last -1; no siblings), ``uniform_samples [B, L+1] float32`` (the
    first L are the coins), ``uniform_samples_for_final_sampling [B] float32``, ``target_probs [B, L+1, V]``
    and ``draft_probs [B, L, V]`` float32, outputs ``predicts [B*(L+1)]``, ``accept_index [B, L+1]``,
    ``accept_token_num [B]`` int32; ``block_verification=True`` for our ``block`` op.

    Raises:
        ValueError: ``op`` is neither ``chain`` nor ``block``; inputs that are not chain / block inputs; ``op`` is
            ``block`` and this SGLang's kernel has no ``block_verification`` switch.
    """
    if op not in ("chain", "block"):
        raise ValueError(f"sglang_triton compares with chain and block, not {op}")
    cand, p, q, u, uf = inputs
    if cand.dim() != 2 or p.dim() != 3 or q.dim() != 3:
        raise ValueError("baselines take chain / block inputs: cand [B, L+1], p [B, L+1, V], q [B, L, V]")
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
        if not _takes_block_switch(fn):
            raise ValueError("this SGLang kernel has no block_verification argument")
        kw["block_verification"] = True
    return kw


def load_triton_chain() -> tuple[Callable, str]:
    """``(chain_speculative_sampling_triton, version string)`` from the installed sglang, else from the file named
    by ``SPECADAPT_SGLANG_REJECT_SAMPLING``.

    Raises:
        ImportError: neither is available (the message names the environment variable), or the file's imports
            (triton) fail.
    """
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
