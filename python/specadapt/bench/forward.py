"""Forward-pass benchmark of the embedded engine against the machine's own limits, measured in the same run.

For the target (and the EAGLE draft head) it times one forward of ``q`` new tokens per request on top of ``ctx``
cached positions, for batch sizes ``B``, through transformers (``hf``), the native fused kernels (``native``)
and, for float formats, ``torch.compile`` of the native forward's PyTorch path (``native-compiled``, the path a
GPU captures in CUDA graphs). Caches are filled with random keys / values (attention time does not depend on
their values), so long contexts cost no prefill.

Machine limits (same run): copy bandwidth (bytes read + written by a 256 MB ``copy_``), read bandwidth (a 256 MB
``sum``), float32 and bfloat16 GEMM rates (2048^3 matmuls). Per case:

- weight floor = bytes one forward reads of weights (layers + LM head) / copy bandwidth;
- FLOP floor = 2 x parameters x B x q / float32 GEMM rate;
- roofline = max(weight floor, FLOP floor); ``x_roofline`` = median ms / roofline;
- KV floor = cached keys / values read / copy bandwidth (reported beside, not part of the roofline).

Used by ``specadapt bench-forward`` and ``scripts/bench_forward.py``.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from ..timing import median_seconds

logger = logging.getLogger(__name__)

__all__ = ["measure_machine", "ForwardResult", "run_forward_benchmark", "cpu_name", "cpu_flags"]


def _cpuinfo(key: str) -> str | None:
    """The first ``key : value`` of ``/proc/cpuinfo`` (stripped), or ``None`` (no such line, no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``), else ``platform.processor()``."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The widest vector instruction set of this CPU that specadapt's kernels use: ``AMX``, ``AVX-512 VNNI``,
    ``AVX-512``, ``AVX2`` or ``baseline`` (figures are compared only between machines of one ISA)."""
    flags = cpu_flags()
    for flag, name in (("amx_bf16", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "baseline"


def machine_label() -> str:
    """``"<CPU model> (<ISA>), <N> cores"``: what a figure ran on, printed beside it."""
    import os

    return f"{cpu_name()} ({cpu_isa()}), {os.cpu_count()} cores"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags``, e.g. ``avx2``, ``avx512_vnni``, ``amx_bf16``);
    empty where that file is missing."""
    return set((_cpuinfo("flags") or "").split())


def measure_machine(device: str = "cpu") -> dict:
    """Copy / read bandwidth (GB/s) and float32 / bfloat16 GEMM rates (GFLOP/s) of ``device``, plus its name."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    x = torch.ones(64 * 1024 * 1024, device=device)  # 256 MB of float32
    y = torch.empty_like(x)

    def timed(fn):
        def run():
            fn()
            sync()
        return median_seconds(run, 7)

    copy = 2 * x.numel() * 4 / timed(lambda: y.copy_(x)) / 1e9
    read = x.numel() * 4 / timed(lambda: x.sum()) / 1e9
    del x, y
    fp32 = _gemm_gflops(torch.float32, device, timed)
    bf16 = _gemm_gflops(torch.bfloat16, device, timed)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu_name()
    return {"device": device, "name": name, "threads": torch.get_num_threads(), "copy_gbps": copy,
            "read_gbps": read, "gemm_fp32_gflops": fp32, "gemm_bf16_gflops": bf16, "torch": torch.__version__}


def _gemm_gflops(dtype: torch.dtype, device: str, timed, largest: int = 2048, budget_s: float = 0.25) -> float:
    """GFLOP/s of an ``n x n`` GEMM in ``dtype``: ``n = largest`` (2048), or less where one product would take
    longer than ``budget_s``, judged from one 256 x 256 product first (n a multiple of 64, at least 256). Without
    the bound a CPU with no bfloat16 arithmetic (AVX2-only EPYC: 0.3 GFLOP/s) spent 8 minutes on 8 bfloat16
    products of 2048 x 2048 before every benchmark."""
    probe = torch.randn(256, 256, device=device).to(dtype)
    rate = 2 * 256**3 / timed(lambda: probe @ probe)  # FLOP/s
    n = largest
    if 2 * n**3 / rate > budget_s:
        n = max(256, min(largest, int((budget_s * rate / 2) ** (1 / 3)) // 64 * 64))
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / timed(lambda: a @ b) / 1e9


@dataclass
class ForwardResult:
    """One timed configuration (milliseconds; floors from the machine limits of the same run)."""

    model: str  # "target" or "draft"
    forward: str  # "hf", "native", "native-compiled"
    weight_format: str
    batch: int
    query: int
    context: int
    median_ms: float
    weight_mb: float
    weight_floor_ms: float
    flop_floor_ms: float
    kv_floor_ms: float
    compile_seconds: float | None = None
    phases_ms: dict = field(default_factory=dict)

    @property
    def roofline_ms(self) -> float:
        return max(self.weight_floor_ms, self.flop_floor_ms)

    def record(self) -> dict:
        out = asdict(self)
        out["roofline_ms"] = self.roofline_ms
        out["x_roofline"] = self.median_ms / self.roofline_ms if self.roofline_ms > 0 else None
        return out


# ---- caches with synthetic contexts --------------------------------------------------------------------------
def _native_cache(native, batch: int, context: int, query: int):
    from ..engine.native import SlotKVCache

    cache = SlotKVCache(native, batch, capacity=context + query + 16)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_((torch.randn(cache.k.shape, generator=g) * 0.5).to(cache.k.dtype))
    cache.v.copy_((torch.randn(cache.v.shape, generator=g) * 0.5).to(cache.v.dtype))
    cache.lengths = torch.full((batch,), context, dtype=torch.int64)
    return cache


def _hf_cache(model, batch: int, context: int):
    """A RaggedKVCache over ``model`` holding ``context`` random positions per row."""
    from ..engine.kv import RaggedKVCache

    cache = RaggedKVCache(model, batch)
    cache.forward(torch.ones(batch, 1, dtype=torch.int64), torch.ones(batch, dtype=torch.int64))  # create layers
    config = model.config
    heads = int(getattr(config, "num_key_value_heads", config.num_attention_heads))
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    for layer in cache.cache.layers:
        layer.keys = (torch.randn(batch, heads, context, dim, generator=g) * 0.5).to(dtype)
        layer.values = (torch.randn(batch, heads, context, dim, generator=g) * 0.5).to(dtype)
        layer._kbuf = layer._vbuf = None
    cache.valid = torch.ones(batch, context, dtype=torch.bool)
    cache.lengths = torch.full((batch,), context, dtype=torch.int64)
    return cache


def _kv_bytes(layers: int, kv_heads: int, head_dim: int, batch: int, context: int, entry: int) -> int:
    return 2 * layers * kv_heads * head_dim * batch * context * entry


# ---- the sweep -----------------------------------------------------------------------------------------------
def run_forward_benchmark(
    formats: list[str], forwards: list[str], batches: list[int], queries: list[int], contexts: list[int],
    repeats: int = 10, draft: bool = True, model_spec: str = "smollm2-135m", compile_cases: int = 2,
    progress=None,
) -> dict:
    """Time every (forward, format, B, q, ctx) of the sweep; see the module docstring for the figures.

    Args:
        formats: weight formats (``float32``, ``bfloat16``, ``int8``, ``int4``); ``hf`` runs float32 / bfloat16.
        forwards: any of ``hf``, ``native``, ``native-compiled`` (float formats, batch 1, the first
            ``compile_cases`` query sizes, first context: compiling is slow).
        batches, queries, contexts: the sweep.
        repeats: timed forwards per configuration (median reported).
        draft: also time the EAGLE head's draft step (one token per request) in each format.
        progress: ``callable(str)`` told about every finished configuration.

    Returns:
        ``{"machine": {...}, "results": [ForwardResult.record(), ...], "ratios": {...}}``.
    """
    from ..engine import load_model
    from ..engine.eagle import eagle_default_path, load_eagle_head, shipped_heads
    from ..engine.native import NativeLlama
    from ..engine.native.eagle import NativeEagleHead
    from ..engine.models import EMBEDDED_DEFAULT

    machine = measure_machine()
    copy_bps = machine["copy_gbps"] * 1e9
    gemm = machine["gemm_fp32_gflops"] * 1e9
    from ..engine.models import file_blocks_for

    # the file's own blocks alone (--formats gguf) need no float32 copy of the model
    skeleton = list(formats) == ["gguf"] and "hf" not in forwards and file_blocks_for(model_spec, "native", "gguf")
    loaded = load_model(model_spec, file_blocks=skeleton)
    results: list[ForwardResult] = []
    tell = progress or (lambda message: None)
    head = None
    if draft and model_spec == EMBEDDED_DEFAULT and EMBEDDED_DEFAULT in shipped_heads():
        head = load_eagle_head(eagle_default_path(), loaded.model)
    for fmt in formats:
        native = NativeLlama.from_hf(loaded.model, fmt, gguf_path=loaded.gguf_path)
        params = native.num_parameters
        entry = 2 if native.kv_dtype == torch.float16 else 4
        kv = lambda b, c: _kv_bytes(native.num_layers, native.num_kv_heads, native.head_dim, b, c, entry)  # noqa

        def add(model, forward, b, q, c, seconds, weight_bytes, n_params, kv_bytes, compile_s=None, phases=None):
            result = ForwardResult(model, forward, fmt, b, q, c, seconds * 1e3, weight_bytes / 1e6,
                                   weight_bytes / copy_bps * 1e3, 2 * n_params * b * q / gemm * 1e3,
                                   kv_bytes / copy_bps * 1e3, compile_s, phases or {})
            results.append(result)
            tell(f"{model} {forward} {fmt} B={b} q={q} ctx={c}: {result.median_ms:.2f} ms "
                 f"({result.median_ms / result.roofline_ms:.2f}x roofline)")

        for b in batches:
            for c in contexts:
                if "native" in forwards:
                    cache = _native_cache(native, b, c, max(queries))
                    for q in queries:
                        ids, counts = torch.ones(b, q, dtype=torch.int64), torch.full((b,), q, dtype=torch.int64)
                        start = cache.lengths.clone()

                        def step():
                            cache.forward(ids, counts)
                            cache.truncate(start)

                        phases = _phase_ms(step) if (b == 1 and q in (1, 2, 6) and c == contexts[0]) else None
                        add("target", "native", b, q, c, median_seconds(step, repeats), native.weight_bytes, params,
                            kv(b, c), phases=phases)
                    del cache
                if head is not None and "native" in forwards:
                    native_head = NativeEagleHead(head, native)
                    cache = _native_cache(native_head, b, c, 1)
                    ids, one = torch.ones(b, 1, dtype=torch.int64), torch.ones(b, dtype=torch.int64)
                    feats = torch.randn(b, 1, native.hidden_size)
                    start = cache.lengths.clone()

                    def draft_step():
                        cache.forward(ids, one, return_outputs=True, features=feats)
                        cache.truncate(start)

                    head_params = sum(w.rows * w.cols for w in (native_head.input_proj, native_head.stack.lm_head)) + \
                        sum(w.rows * w.cols for w in native_head.stack.layers[0].matrices())
                    add("draft", "native", b, 1, c, median_seconds(draft_step, repeats), native_head.weight_bytes,
                        head_params, _kv_bytes(1, native.num_kv_heads, native.head_dim, b, c, entry))
                    del cache
        if "native-compiled" in forwards and fmt in ("float32", "bfloat16"):
            for q in queries[:compile_cases]:
                seconds, compile_s = _time_compiled(native, 1, q, contexts[0], repeats)
                if seconds is not None:
                    add("target", "native-compiled", 1, q, contexts[0], seconds, native.weight_bytes, params,
                        kv(1, contexts[0]), compile_s=compile_s)
        del native
    if "hf" in forwards:
        for fmt in [f for f in formats if f in ("float32", "bfloat16")]:
            dtype = torch.float32 if fmt == "float32" else torch.bfloat16
            model = loaded.model.to(dtype)
            weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
            n_params = sum(p.numel() for p in model.parameters())
            entry = 4 if fmt == "float32" else 2
            for b in batches:
                for c in contexts:
                    for q in queries:
                        cache = _hf_cache(model, b, c)
                        ids, counts = torch.ones(b, q, dtype=torch.int64), torch.full((b,), q, dtype=torch.int64)
                        start = cache.lengths.clone()

                        def hf_step():
                            cache.forward(ids, counts)
                            cache.truncate(start)

                        cfg = model.config
                        kv_heads = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
                        dim = cfg.hidden_size // cfg.num_attention_heads
                        add("target", "hf", b, q, c, median_seconds(hf_step, max(3, repeats // 3)), weight_bytes,
                            n_params, _kv_bytes(cfg.num_hidden_layers, kv_heads, dim, b, c, entry))
                        del cache
            loaded.model.to(torch.float32)
    return {"machine": machine, "results": [r.record() for r in results], "ratios": _ratios(results)}


def _phase_ms(step) -> dict:
    """Per-phase milliseconds of the native decoder stack over 10 steps (``native_phase_times``)."""
    from .. import kernels

    if not kernels.has_op_for("native_llama_forward", torch.device("cpu")):
        return {}
    ops = torch.ops.specadapt
    names = ["norms_rope_cache", "qkv", "attention", "o_proj", "gate_up", "activation", "down_proj"]
    ops.native_set_profiling(True)
    for _ in range(10):
        step()
    seconds = ops.native_phase_times()
    ops.native_set_profiling(False)
    return {name: s / 10 * 1e3 for name, s in zip(names, seconds)}


def _time_compiled(native, batch: int, query: int, context: int, repeats: int):
    """``torch.compile`` of the native PyTorch path for one bucket: ``(median seconds, compile seconds)``."""
    from ..engine.native.model import TokenBatch, layers_reference

    cache = _native_cache(native, batch, context, query)
    try:
        n = batch * query
        index = torch.arange(context, context + query).repeat(batch)
        batch_tokens = TokenBatch(ids=torch.ones(n, dtype=torch.int64), slot=torch.arange(batch).repeat_interleave(query),
                                  index=index, position=index.clone(), visible=index + 1,
                                  tree_base=torch.zeros(n, dtype=torch.int64), tree_mask=torch.zeros(n, dtype=torch.int64))
        hidden = native.embed_tokens(batch_tokens.ids)

        def eager():
            return layers_reference(native, hidden, batch_tokens, cache.k, cache.v)

        compiled = torch.compile(eager, dynamic=False)
        start = time.perf_counter()
        compiled()
        compile_seconds = time.perf_counter() - start
        return median_seconds(compiled, repeats), compile_seconds
    except Exception as exc:  # a compile failure is a result to report, not a crash of the sweep
        logger.warning("torch.compile of the native forward failed: %s: %s", type(exc).__name__, exc)
        return None, None


def _ratios(results: list[ForwardResult]) -> dict:
    """q=6 / q=1 per (forward, format, B, ctx), draft step / target step (q=1), native / hf speedups."""
    by = {(r.model, r.forward, r.weight_format, r.batch, r.query, r.context): r.median_ms for r in results}
    out: dict = {"q6_over_q1": {}, "draft_over_target": {}, "native_speedup_over_hf_float32": {}}
    for (model, forward, fmt, b, q, c), ms in by.items():
        key = f"{forward} {fmt} B={b} ctx={c}"
        if model == "target" and q == 6 and (model, forward, fmt, b, 1, c) in by:
            out["q6_over_q1"][key] = ms / by[(model, forward, fmt, b, 1, c)]
        if model == "draft" and ("target", forward, fmt, b, 1, c) in by:
            out["draft_over_target"][key] = ms / by[("target", forward, fmt, b, 1, c)]
        if model == "target" and forward == "native" and ("target", "hf", "float32", b, q, c) in by:
            out["native_speedup_over_hf_float32"][f"{fmt} B={b} q={q} ctx={c}"] = \
                by[("target", "hf", "float32", b, q, c)] / ms
    return out
