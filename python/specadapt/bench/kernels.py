"""Microbenchmark of the verification kernels: fused (C++ / CUDA) against the float64 PyTorch reference.

For each case (op, B, L, V, K) it reports the median time of the fused kernel, the achieved bandwidth (p and q
read once, outputs written once, divided by the time), that bandwidth as a fraction of the device's copy
bandwidth measured in the same run, and the speedup over the reference on the same inputs. On CUDA it also times
the external baselines of :mod:`specadapt.bench.baselines` that are importable (flashinfer's chain kernel,
SGLang's Triton chain / block kernel) on the same inputs: ``case["baselines"][name] = {"median_ms", "speedup"}``
with ``speedup = baseline_ms / our_ms``.

Used by ``specadapt bench-kernels`` and ``scripts/bench_kernels.py``.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .. import kernels
from ..verification.rules import RULES, get_rule
from . import baselines as baselines_mod

logger = logging.getLogger(__name__)

__all__ = ["Case", "CaseResult", "FULL_SWEEP", "QUICK_CASES", "copy_bandwidth_gbps", "run_case", "run_benchmark"]


@dataclass(frozen=True)
class Case:
    """One benchmark configuration: ``op`` a rule of :data:`specadapt.verification.rules.RULES` (chain / block /
    gbv), batch ``B``, drafts ``L``, vocab ``V``, paths ``K`` (1 for a single-path rule)."""

    op: str
    B: int
    L: int
    V: int
    K: int = 1


@dataclass
class CaseResult:
    op: str
    device: str
    B: int
    L: int
    V: int
    K: int
    median_ms: float
    gbps: float
    bandwidth_fraction: float
    speedup_vs_reference: float | None
    reference_ms: float | None
    impl: str = "compiled"  # which implementation of ours was timed: "compiled" (specadapt._C) or "cupy" (JIT)
    # {name: {"median_ms", "speedup"}} (plus "error" when the call failed); None: no baseline for this case
    baselines: dict | None = None

    def record(self) -> dict:
        """The JSON case: every field, ``baselines`` only when some baseline was timed."""
        out = asdict(self)
        if not out["baselines"]:
            out.pop("baselines")
        return out


def _full_sweep() -> list[Case]:
    cases = []
    for B, L, V in itertools.product((1, 8, 32, 64), (4, 8, 16), (32000, 49152, 151936)):
        for rule in RULES.values():
            for K in ((1, 2, 3, 4) if rule.multi_path else (1,)):
                cases.append(Case(rule.name, B, L, V, K))
    return cases


FULL_SWEEP = _full_sweep()
# The representative subset of `--quick` (includes the goal case block B=32, L=8, V=49152).
QUICK_CASES = [
    Case("chain", 32, 8, 49152),
    Case("block", 32, 8, 49152),
    Case("block", 1, 4, 32000),
    Case("block", 8, 16, 151936),
    Case("gbv", 8, 4, 32000, 2),
]


def copy_bandwidth_gbps(device: torch.device, megabytes: int = 512, repeats: int = 10) -> float:
    """Bandwidth of a large device-to-device tensor copy in GB/s (bytes read + bytes written per second).

    The best of ``repeats`` timed copies (after one warm-up), so fractions of it are conservative.
    """
    n = megabytes * (1 << 20) // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / min(times[1:]) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_inputs(case: Case, device: torch.device, seed: int = 0, dtype=torch.float32):
    """Random verification inputs of the contract (probability rows from softmax; drafts sampled from q)."""
    g = torch.Generator().manual_seed(seed)
    multi_path = get_rule(case.op, "case.op").multi_path
    lead = (case.B, case.K) if multi_path else (case.B,)
    p = torch.softmax(torch.randn(*lead, case.L + 1, case.V, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(*lead, case.L, case.V, generator=g) * 3, -1)
    if multi_path:  # one tree: the K paths share their rows, tokens drawn from q
        p[:, 1:] = p[:, :1]
        q[:, 1:] = q[:, :1]
    drafts = torch.multinomial(q.reshape(-1, case.V), 1, generator=g).reshape(*lead, case.L)
    if multi_path:
        # paths must be consistent with the shared rows: identical rows for every prefix are only valid if
        # all paths follow the same nodes, so use the same draws for every path
        drafts[:, 1:] = drafts[:, :1]
    cand = torch.cat([torch.zeros(*lead, 1, dtype=torch.int64), drafts], dim=-1)
    u = torch.rand(case.B, case.L, generator=g, dtype=torch.float64)
    uf = torch.rand(case.B, generator=g, dtype=torch.float64)
    return [t.to(device) for t in (cand, p.to(dtype), q.to(dtype), u, uf)]


def _call(case: Case, impl: str, args):
    if get_rule(case.op, "case.op").multi_path:
        return kernels.verify_paths(case.op, *args, impl=impl)
    return kernels.verify(case.op, *args, impl=impl)


def _time(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _time_baselines(case: Case, args, device: torch.device, fused_ms: float, loaded: dict, repeats: int) -> dict:
    """Time each loaded baseline that compares with ``case.op`` on ``args``; a failing call is recorded, not raised."""
    out = {}
    for name, base in loaded.items():
        if case.op not in base.baseline.ops:
            continue
        try:
            ms = _time(base.prepare(case.op, args), device, repeats)
        except Exception as exc:  # noqa: BLE001 - one broken baseline must not lose the whole benchmark
            logger.warning("baseline %s failed on %s: %s: %s", name, case, type(exc).__name__, exc)
            out[name] = {"median_ms": None, "speedup": None, "error": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = {"median_ms": ms, "speedup": ms / fused_ms}
    return out


def run_case(case: Case, device: torch.device, copy_gbps: float, repeats: int = 10,
             reference_repeats: int = 1, with_reference: bool = True, baselines: dict | None = None,
             impl: str = "compiled") -> CaseResult:
    """Time one case; the reference is timed ``reference_repeats`` times (it is slow) unless disabled.

    ``baselines``: ``{name: LoadedBaseline}`` (from :func:`specadapt.bench.baselines.resolve`), each timed
    ``repeats`` times on the same inputs when it compares with ``case.op``.
    """
    args = make_inputs(case, device)
    fused_ms = _time(lambda: _call(case, impl, args), device, repeats)
    elt = args[1].element_size()
    paths = case.K if get_rule(case.op, "case.op").multi_path else 1
    bytes_moved = case.B * paths * ((case.L + 1) + case.L) * case.V * elt + case.B * (case.L + 3) * 4
    gbps = bytes_moved / (fused_ms / 1e3) / 1e9
    ref_ms = _time(lambda: _call(case, "reference", args), device, reference_repeats) if with_reference else None
    return CaseResult(
        op=case.op, device=device.type, B=case.B, L=case.L, V=case.V, K=case.K, median_ms=fused_ms, gbps=gbps,
        bandwidth_fraction=gbps / copy_gbps, speedup_vs_reference=(ref_ms / fused_ms) if ref_ms else None,
        reference_ms=ref_ms, impl=impl,
        baselines=_time_baselines(case, args, device, fused_ms, baselines, repeats) if baselines else None,
    )


def run_benchmark(cases: list[Case], device: torch.device, repeats: int = 10, reference_repeats: int = 1,
                  with_reference: bool = True, progress: bool = True, with_baselines: bool = True,
                  impl: str = "compiled") -> dict:
    """Run ``cases`` and return ``{"copy_bandwidth_gbps", "cases": [...], "device", "torch", "baseline_status"}``.

    ``baseline_status`` is ``{"line", "found": {name: version}, "skipped": {name: reason}}``; the baselines
    found (CUDA only, when importable) are timed per case (``case["baselines"]``).

    ``impl``: ``compiled`` (specadapt._C) or ``cupy`` (the NVRTC JIT of the same CUDA headers, CUDA only).

    Raises:
        ValueError: ``impl`` cannot run on ``device`` (no compiled kernel, no CuPy).
    """
    if impl not in ("compiled", "cupy"):
        raise ValueError(f"impl must be compiled or cupy, got {impl!r}")
    if impl == "compiled" and not kernels.has_op_for("block_verify", device):
        raise ValueError(f"no compiled verification kernels for {device.type}: build specadapt._C for it")
    if impl == "cupy":
        kernels.choose_implementation("block_verify", "cupy", device, torch.float32)  # raises with the reason
    from tqdm import tqdm

    if with_baselines:
        loaded, skipped = baselines_mod.resolve(device)
    else:
        loaded, skipped = {}, {name: "disabled (--no-baselines)" for name in baselines_mod.BASELINES}
    line = baselines_mod.status_line(loaded, skipped)
    logger.info("%s", line)
    copy_gbps = copy_bandwidth_gbps(device)
    results = []
    for case in tqdm(cases, desc="bench-kernels", disable=not progress):
        op = get_rule(case.op, "case.op").op
        if impl == "compiled" and not kernels.has_op_for(op, device):
            logger.warning("skipping %s: no compiled %s for %s", case, op, device.type)
            continue
        results.append(run_case(case, device, copy_gbps, repeats, reference_repeats, with_reference,
                                baselines=loaded, impl=impl).record())
    return {
        "copy_bandwidth_gbps": copy_gbps,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": results,
        "baseline_status": {
            "line": line,
            "found": {name: b.version for name, b in loaded.items()},
            "skipped": skipped,
        },
    }
