"""Installation in a scheduler (TP worker) process: the process state built from the scheduler's speculative
worker (:func:`build_state`: verify runtime, GBV drafting buffer, adaptive verification, the TTS student), made
current (:mod:`.state`), and the hook table (:mod:`.targets`) applied through SGLang's registry
(:mod:`.registry`). Called from the plugin's AROUND hook on ``Scheduler.maybe_init_draft_worker``
(:mod:`.plugin`): :func:`install_pre_worker_hooks` before the speculative worker is built,
:func:`install_worker_hooks` once it exists and before any CUDA graph is captured.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from .config import PluginConfig
from .gbv import GBVDrafting
from .probes import draft_vocab, graph_max_batch, resolved, tensor_parallel, tp_broadcast
from .registry import apply_targets
from .state import PluginState, VerifyRuntime, install as install_state
from .targets import EAGLE_FAMILY, plan_targets, pre_worker_targets

if TYPE_CHECKING:
    from .tts_dflash import SGLangDFlashTTS

logger = logging.getLogger("specadapt.sglang")

__all__ = ["build_state", "install_pre_worker_hooks", "install_worker_hooks", "refresh_fused_kv"]


def install_pre_worker_hooks(config: PluginConfig) -> None:
    """Register and apply :func:`~specadapt.sglang.targets.pre_worker_targets` (from the AROUND hook on
    ``maybe_init_draft_worker``, before the speculative worker is built).

    Raises:
        RuntimeError: a hook SGLang did not apply.
    """
    targets = pre_worker_targets(config)
    if targets:
        apply_targets(targets)


def build_state(scheduler: Any, config: PluginConfig, asynchronous_tts: bool = True) -> PluginState:
    """The process state for ``config`` from the scheduler's resolved settings and speculative worker (not
    installed: see :func:`install_worker_hooks`).

    Raises:
        RuntimeError: GBV with a resolved ``--speculative-eagle-topk`` other than ``--specadapt-num-paths``, or
            without an EAGLE draft worker.
        ValueError: TTS on a draft without a student (see :func:`specadapt.sglang.students.build_student`).
    """
    server_args = scheduler.server_args
    algorithm = str(server_args.speculative_algorithm or "").upper()
    runtime = VerifyRuntime(rule=config.rule, seed=config.seed)
    state = PluginState(config=config, runtime=runtime, algorithm=algorithm)
    worker = scheduler.draft_worker
    runtime.broadcast = tp_broadcast()
    steps = int(resolved(server_args, "speculative_num_steps") or 1)
    if config.adaptive_verification:
        from .adaptive import SGLangAdaptiveVerification

        state.adaptive = SGLangAdaptiveVerification(
            config, steps, max_requests=int(resolved(server_args, "max_running_requests") or 256),
            broadcast=runtime.broadcast,
        )
    if config.tts and algorithm == "DFLASH":
        state.tts = _dflash_tts(worker, config, asynchronous_tts)
    elif config.tts:
        from .students import build_student
        from .tts import SGLangTTS

        draft_model = worker.draft_worker.draft_runner.model
        student = build_student(draft_model, draft_model.config, config.tts_params, config.tts_lora_rank,
                                tp=tensor_parallel())
        state.tts = SGLangTTS(student, config, asynchronous=asynchronous_tts)
    if config.multi_path and algorithm in EAGLE_FAMILY:
        topk = resolved(server_args, "speculative_eagle_topk")
        if topk is not None and int(topk) != config.num_paths:
            raise RuntimeError(f"specadapt GBV: the server resolved --speculative-eagle-topk {topk}, not "
                               f"--specadapt-num-paths {config.num_paths}")
        if worker is None or getattr(worker, "draft_worker", None) is None:
            raise RuntimeError("specadapt GBV: this scheduler has no EAGLE draft worker (pipeline parallelism?)")
        # rows of the largest captured draft batch (graphs write into this buffer); larger eager batches use an
        # overflow buffer allocated on demand
        state.drafting = GBVDrafting.allocate(config.num_paths, steps, draft_vocab(worker),
                                              graph_max_batch(server_args), getattr(worker, "device", "cpu"))
    return state


def install_worker_hooks(scheduler: Any, config: PluginConfig, asynchronous_tts: bool = True) -> PluginState:
    """Build the process state from the scheduler's speculative worker (:func:`build_state`), install it, then
    register and apply the heavy hooks (:func:`~specadapt.sglang.targets.plan_targets`) and check they applied.

    Raises:
        RuntimeError: a hook SGLang did not apply; the errors of :func:`build_state`.
        ValueError: TTS on a draft without a student (see :func:`specadapt.sglang.students.build_student`).
    """
    state = install_state(build_state(scheduler, config, asynchronous_tts))
    targets = plan_targets(config, state.algorithm)
    apply_targets(targets)
    logger.info("specadapt: installed %d hook(s) in the scheduler (%s): %s", len(targets), state.algorithm,
                ", ".join(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t, _, _ in targets))
    return state


def _dflash_tts(worker: Any, config: PluginConfig, asynchronous: bool) -> SGLangDFlashTTS:
    """TTS of a DFLASH worker: the student over its draft and the target's (shared) embedding and LM head."""
    from .students.dflash import DFlashStudent
    from .tts_dflash import SGLangDFlashTTS

    draft_model = worker.draft_model
    target = worker.target_worker.model_runner.model
    embed = target.get_input_embeddings().weight
    head = target.lm_head
    try:  # a LoRA-wrapped head (SGLang's own init_lm_head unwraps it the same way)
        from sglang.srt.lora.layers import unwrap_lora_layer

        head = unwrap_lora_layer(head)
    except ImportError:
        pass
    head = head.weight

    student = DFlashStudent(draft_model, draft_model.config, embed, head, config.tts_params, config.tts_lora_rank,
                            on_refresh=lambda: refresh_fused_kv(worker))
    return SGLangDFlashTTS(student, config, worker._mask_token_id, asynchronous=asynchronous)


@torch.no_grad()
def refresh_fused_kv(worker) -> None:
    """Copy the DFLASH draft's current K/V weights and K norms into SGLang's fused context-KV helper, which keeps
    its own copies (``FusedKVMaterializeHelper.flat_kv_weight_t`` ``[in, layers * 2 kv]``, ``k_norm_weights``
    ``[layers, head_dim]``), in place (no re-allocation, no log line per publish). No-op without the helper."""
    helper = getattr(worker, "_fused_kv_helper", None)
    if helper is None:
        return
    attns = [layer.self_attn for layer in worker.draft_model.layers]
    kv = [a.qkv_proj.weight[a.q_size: a.q_size + 2 * a.kv_size] for a in attns]
    helper.flat_kv_weight_t.copy_(torch.stack(kv).reshape(len(kv) * kv[0].shape[0], -1).transpose(0, 1))
    helper.k_norm_weights.copy_(torch.stack([a.k_norm.weight for a in attns]))
