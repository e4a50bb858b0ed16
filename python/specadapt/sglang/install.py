"""The heavy hooks, installed in each scheduler (TP worker) process once its speculative worker exists and
before CUDA graphs are captured (from the AFTER hook on ``Scheduler.maybe_init_draft_worker``).

| feature | algorithms | hook |
|---|---|---|
| ``--specadapt-verify chain/block``, ``--adaptive-verification`` | EAGLE, EAGLE3, STANDALONE | REPLACE ``reject_sampling.chain_speculative_sampling_triton`` |
| same, ``--tts`` | DFLASH | AROUND ``DFlashWorkerV2._accept_block`` (rule; TTS example) |
| ``--tts`` | DFLASH | AROUND ``DFlashWorkerV2.forward_batch_generation`` (round boundary) and ``_append_target_hidden_to_draft_kv_by_loc`` (context) |
| a specadapt rule, ``--adaptive-verification``, ``--tts`` | EAGLE family | AROUND ``eagle_utils.eagle_sample`` (min-p of the batch, caps, snapshots, outcomes) |
| a specadapt rule, ``--adaptive-verification`` | all | AROUND ``Scheduler._add_request_to_queue``: refuse requests with sampling options the rules cannot honour (:func:`~specadapt.sglang.verify.sampling_refusal`) |
| ``--tts`` | EAGLE family | AROUND ``EAGLEWorkerV2.forward_batch_generation`` (round boundary, publish) |
| ``--tts`` | EAGLE family | AFTER ``BaseSpecWorker.note_request_finished`` (drop history) |
| ``--specadapt-verify`` not builtin, ``--adaptive-verification`` | EAGLE family | AROUND ``EagleDraftWorker.alloc_memory_pool``, ``spec_utils.sample_draft_proposal``, ``EagleDraftWorker._draft_extend_for_prefill``: q rows over the target vocabulary (:mod:`.hot_vocab`) |
| ``--specadapt-verify gbv`` | EAGLE family | the same and AROUND ``EagleDraftWorker._draft_extend_for_decode`` (K sampled chains, :mod:`.gbv`); before the worker exists, AROUND ``EagleDraftWorker.__init__`` |

After ``HookRegistry.apply_hooks()`` every target is checked (:func:`specadapt.sglang.plugin.check_applied`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import gbv, hot_vocab
from .config import PluginConfig
from .verify import VerifyRuntime, chain_speculative_sampling, dflash_accept_block, sampling_refusal, set_runtime

logger = logging.getLogger("specadapt.sglang")

__all__ = ["HOOK_TARGETS", "PluginState", "add_request_around", "eagle_sample_around", "forward_batch_generation_around",
           "get_state", "install_worker_hooks", "plan_targets", "request_finished_after", "reset_state"]

CHAIN_SAMPLER = "sglang.kernels.ops.speculative.reject_sampling.chain_speculative_sampling_triton"
DFLASH_ACCEPT = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._accept_block"
EAGLE_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
EAGLE_FORWARD = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation"
REQUEST_FINISHED = "sglang.srt.speculative.base_spec_worker.BaseSpecWorker.note_request_finished"
DRAFT_WORKER_INIT = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.__init__"
DRAFT_SAMPLER = "sglang.srt.speculative.spec_utils.sample_draft_proposal"
EXTEND_PREFILL = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill"
EXTEND_DECODE = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode"
ALLOC_POOL = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.alloc_memory_pool"
DFLASH_FORWARD = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation"
DFLASH_APPEND = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc"
ADD_REQUEST = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
#: Every target the plugin may hook in a scheduler process (tests check each exists in the installed sglang).
HOOK_TARGETS = (CHAIN_SAMPLER, DFLASH_ACCEPT, EAGLE_SAMPLE, EAGLE_FORWARD, REQUEST_FINISHED, DRAFT_WORKER_INIT,
                DRAFT_SAMPLER, EXTEND_PREFILL, EXTEND_DECODE, ALLOC_POOL, DFLASH_FORWARD, DFLASH_APPEND, ADD_REQUEST)
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")


@dataclass
class PluginState:
    """Everything the hooks of one scheduler process share."""

    config: PluginConfig
    runtime: VerifyRuntime
    adaptive: object = None  # SGLangAdaptiveVerification
    tts: object = None  # SGLangTTS (SGLangDFlashTTS for DFLASH)
    algorithm: str = ""
    rids: list = None  # request ids of the batch in flight (set at the worker's forward_batch_generation)
    extend_lens: object = None  # its prefill lengths (host list), when a prefill batch


_STATE: PluginState | None = None


def get_state() -> PluginState | None:
    """The installed state of this process (``None`` before installation)."""
    return _STATE


def plan_targets(config: PluginConfig, algorithm: str) -> list[tuple[str, str, object]]:
    """``(target, hook type name, hook)`` for ``config`` on ``algorithm`` (no sglang import)."""
    algorithm = algorithm.upper()
    targets = []
    eagle = algorithm in EAGLE_FAMILY
    if config.replaces_verification and eagle:
        targets.append((CHAIN_SAMPLER, "REPLACE", chain_speculative_sampling))
    if algorithm == "DFLASH" and (config.replaces_verification or config.tts):
        targets.append((DFLASH_ACCEPT, "AROUND", dflash_accept_around))
    if algorithm == "DFLASH" and config.tts:
        targets.append((DFLASH_FORWARD, "AROUND", forward_batch_generation_around))
        targets.append((DFLASH_APPEND, "AROUND", dflash_append_around))
        targets.append((REQUEST_FINISHED, "AFTER", request_finished_after))
    if eagle and (config.replaces_verification or config.tts):
        targets.append((EAGLE_SAMPLE, "AROUND", eagle_sample_around))
    if eagle and config.tts:
        targets.append((EAGLE_FORWARD, "AROUND", forward_batch_generation_around))
        targets.append((REQUEST_FINISHED, "AFTER", request_finished_after))
    if eagle and config.replaces_verification:
        # q rows over the target vocabulary (hot-vocabulary EAGLE-3 heads) and, for GBV, K sampled paths
        targets.append((ALLOC_POOL, "AROUND", hot_vocab.alloc_memory_pool_around))
        targets.append((DRAFT_SAMPLER, "AROUND", gbv.sample_draft_proposal_around))
        targets.append((EXTEND_PREFILL, "AROUND", gbv.draft_extend_for_prefill_around))
    if eagle and config.verify == "gbv":
        targets.append((EXTEND_DECODE, "AROUND", gbv.draft_extend_for_decode_around))
    if config.replaces_verification and (eagle or algorithm == "DFLASH"):
        targets.append((ADD_REQUEST, "AROUND", add_request_around))
    return targets


def pre_worker_targets(config: PluginConfig) -> list[tuple[str, str, object]]:
    """Hooks the speculative worker's constructor needs, installed before it runs (no sglang import)."""
    if config.verify == "gbv":
        return [(DRAFT_WORKER_INIT, "AROUND", gbv.draft_worker_init_around)]
    return []


def install_pre_worker_hooks(config: PluginConfig) -> None:
    """Register and apply :func:`pre_worker_targets` (from the AROUND hook on ``maybe_init_draft_worker``).

    Raises:
        RuntimeError: a hook SGLang did not apply.
    """
    targets = pre_worker_targets(config)
    if not targets:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .plugin import check_applied

    for target, kind, hook in targets:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    check_applied([t for t, _, _ in targets])


def install_worker_hooks(scheduler, config: PluginConfig, asynchronous_tts: bool = True) -> PluginState:
    """Build the process state from the scheduler's speculative worker, register and apply the heavy hooks,
    and check they applied.

    Raises:
        RuntimeError: a hook SGLang did not apply.
        ValueError: TTS on a draft without a student (see :func:`specadapt.sglang.students.build_student`).
    """
    global _STATE
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .plugin import check_applied

    server_args = scheduler.server_args
    algorithm = str(server_args.speculative_algorithm or "").upper()
    runtime = VerifyRuntime(rule=config.rule, seed=config.seed)
    state = PluginState(config=config, runtime=runtime, algorithm=algorithm)
    worker = scheduler.draft_worker
    runtime.broadcast = _tp_broadcast()
    steps = int(_resolved(server_args, "speculative_num_steps") or 1)
    if config.adaptive_verification:
        from .adaptive import SGLangAdaptiveVerification

        state.adaptive = SGLangAdaptiveVerification(
            config, steps, max_requests=int(_resolved(server_args, "max_running_requests") or 256),
            broadcast=runtime.broadcast,
        )
    if config.tts and algorithm == "DFLASH":
        state.tts = _dflash_tts(worker, config, asynchronous_tts)
    elif config.tts:
        from .students import build_student
        from .tts import SGLangTTS

        draft_model = worker.draft_worker.draft_runner.model
        student = build_student(draft_model, draft_model.config, config.tts_params, config.tts_lora_rank,
                                tp=_tensor_parallel())
        state.tts = SGLangTTS(student, config, asynchronous=asynchronous_tts)
    if config.verify == "gbv" and algorithm in EAGLE_FAMILY:
        topk = _resolved(server_args, "speculative_eagle_topk")
        if topk is not None and int(topk) != config.num_paths:
            raise RuntimeError(f"specadapt GBV: the server resolved --speculative-eagle-topk {topk}, not "
                               f"--specadapt-num-paths {config.num_paths}")
        if worker is None or getattr(worker, "draft_worker", None) is None:
            raise RuntimeError("specadapt GBV: this scheduler has no EAGLE draft worker (pipeline parallelism?)")
        # rows of the largest captured draft batch (graphs write into this buffer); larger eager batches use an
        # overflow buffer allocated on demand
        runtime.gbv = gbv.GBVDrafting.allocate(config.num_paths, steps, _draft_vocab(worker),
                                               _graph_max_batch(server_args), getattr(worker, "device", "cpu"))
        gbv.set_drafting(runtime.gbv)
    set_runtime(runtime)
    _STATE = state
    targets = plan_targets(config, algorithm)
    for target, kind, hook in targets:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    check_applied([t for t, _, _ in targets])
    logger.info("specadapt: installed %d hook(s) in the scheduler (%s): %s", len(targets), algorithm,
                ", ".join(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t, _, _ in targets))
    return state


def _dflash_tts(worker, config: PluginConfig, asynchronous: bool):
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


def _resolved(server_args, field: str):
    """A speculative / scheduling setting as SGLang resolved it (resolution hooks declare values on the side and
    leave ``ServerArgs`` fields untouched); plain attribute lookup for stand-ins."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(server_args, field)
    except Exception:  # noqa: BLE001 - not a ServerArgs (tests) or another sglang
        return getattr(server_args, field, None)


def _graph_max_batch(server_args) -> int:
    """The largest decode batch SGLang captures CUDA graphs for (the draft graphs write GBV's q rows)."""
    try:
        from sglang.srt.runtime_context import get_exec

        config = get_exec().graph.cuda_graph_config
        if config is not None and config.decode.max_bs:
            return int(config.decode.max_bs)
    except Exception:  # noqa: BLE001 - no published runtime context (tests)
        pass
    return int(_resolved(server_args, "cuda_graph_max_bs_decode") or 64)


def _draft_vocab(worker) -> int:
    """Vocabulary of the draft's q rows (the target's: rejection sampling needs a shared vocabulary)."""
    runner = worker.draft_worker.draft_runner
    return int(runner.model_config.vocab_size)


def _tensor_parallel():
    """This rank's :class:`~specadapt.sglang.students.TensorParallel` in SGLang's TP group (the draft's weights are
    sharded over it), or ``None`` when TP = 1 / no process group."""
    try:
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().tp_group
    except Exception:  # noqa: BLE001 - no parallel context (tests, TP = 1)
        return None
    size = int(getattr(group, "world_size", 1))
    if size <= 1:
        return None
    from .students import TensorParallel

    def gather(tensor):
        return list(group.all_gather(tensor.contiguous().unsqueeze(0), dim=0).unbind(0))

    return TensorParallel(rank=int(group.rank_in_group), size=size, gather=gather,
                          broadcast=lambda tensor: group.broadcast(tensor, src=0))


def _tp_broadcast():
    """In-place broadcast from rank 0 of the group that shares a batch (the attention-TP group under DP
    attention, as SGLang's own verify broadcast), or ``None`` when that group has one rank / no process group."""
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        group = parallel.attn_tp_group if is_dp_attention_enabled() else parallel.tp_group
    except Exception:  # noqa: BLE001 - no parallel context (tests, TP = 1)
        return None
    if getattr(group, "world_size", 1) <= 1:
        return None
    return lambda tensor: group.broadcast(tensor, src=0)


# ---- hooks ---------------------------------------------------------------------------------------------------
def eagle_sample_around(original, verify_input, batch, logits_output, *args, **kwargs):
    """AROUND ``eagle_sample``: the batch's min-p and caps before the sampler, TTS snapshot of the raw verify
    outputs, and the outcomes (estimator, TTS history) after. Returns the original's ``(predict, accept_lens,
    accept_index)``."""
    state = _STATE
    mode = getattr(batch, "forward_mode", None)
    if state is None or (mode is not None and mode.is_idle()):
        return original(verify_input, batch, logits_output, *args, **kwargs)
    info = getattr(batch, "sampling_info", None)
    # SGLang's target_probs leave min-p out: the replaced sampler applies it (per request, 0 = off)
    state.runtime.pending_min_ps = info.min_ps if getattr(info, "need_min_p_sampling", False) else None
    draft_probs = getattr(verify_input, "draft_probs", None)
    plan = None
    if state.adaptive is not None and draft_probs is not None and draft_probs.dim() == 3:
        caps, features, predictions = state.adaptive.plan(draft_probs)
        state.runtime.pending_caps = caps
        plan = (caps, features, predictions)
    snap = None
    uses_features = state.tts is not None and getattr(state.tts.student, "uses_features", True)
    tree = state.runtime.rule == "gbv"  # a verify tree: snapshot every node, keep the chosen path afterwards
    if state.tts is not None and (logits_output.hidden_states is not None or not uses_features):
        snap = state.tts.snapshot(
            [req.rid for req in batch.reqs], verify_input.draft_token, logits_output.hidden_states,
            logits_output.next_token_logits, batch.sampling_info.temperatures, None if tree else draft_probs,
        )
    state.runtime.last_gbv = None
    try:
        result = original(verify_input, batch, logits_output, *args, **kwargs)
    finally:
        leftover = state.runtime.pending_caps  # not consumed: greedy verification ran instead of the sampler
        state.runtime.pending_caps = None
        state.runtime.pending_min_ps = None
    if snap is not None and tree:
        chosen = state.runtime.last_gbv
        if chosen is None:  # greedy tree verification ran: no chosen path to learn from this round
            snap = None
        else:
            snap = state.tts.select_path(snap, chosen.path_nodes, chosen.draft_probs)
    accepted = result[1].to(torch.int64) - 1  # accept_lens include the bonus token
    if plan is not None:
        caps, features, predictions = plan
        verified = caps if leftover is None else torch.full_like(caps, features.shape[1])
        state.adaptive.observe(features, predictions, accepted, verified)
    if snap is not None:
        state.tts.record(snap, accepted)
    return result


def add_request_around(original, scheduler, req, *args, **kwargs):
    """AROUND ``Scheduler._add_request_to_queue(req, is_retracted=False)``: a new request whose sampling options
    the specadapt rules cannot verify exactly (:func:`~specadapt.sglang.verify.sampling_refusal`: penalties,
    ``min_new_tokens``, custom logit processors) is finished with a 400 error, the way SGLang refuses requests
    it cannot serve (``set_finish_with_abort`` before queueing), instead of being decoded from another law.
    Retracted requests and requests SGLang already aborts pass through."""
    state = _STATE
    retracted = bool(args[0]) if args else bool(kwargs.get("is_retracted", False))
    if (state is not None and state.config.replaces_verification and not retracted
            and getattr(req, "to_finish", None) is None):
        reason = sampling_refusal(getattr(req, "sampling_params", None), getattr(req, "custom_logit_processor", None))
        if reason is not None:
            req.set_finish_with_abort(reason)
    return original(scheduler, req, *args, **kwargs)


def forward_batch_generation_around(original, worker, batch, *args, **kwargs):
    """AROUND ``EAGLEWorkerV2`` / ``DFlashWorkerV2.forward_batch_generation``: the round boundary of TTS for
    decode batches (on the current = forward stream, before this round's draft replay), and the batch's request
    ids for the hooks inside the call."""
    state = _STATE
    mode = getattr(batch, "forward_mode", None)
    is_decode = mode is not None and not (mode.is_extend() or getattr(batch, "is_extend_in_batch", False))
    if state is not None and state.tts is not None and is_decode and not _capturing():
        state.tts.on_round_start()
    if state is not None:
        state.rids = [req.rid for req in getattr(batch, "reqs", None) or []]
        state.extend_lens = getattr(batch, "extend_lens", None)  # host list at prefill (no device sync)
    return original(worker, batch, *args, **kwargs)


def dflash_accept_around(original, worker, *args, **kwargs):
    """AROUND ``DFlashWorkerV2._accept_block``: the specadapt rule (when one replaces SGLang's), then the TTS
    example of the round from the target's verify logits."""
    state = _STATE
    if state is not None and state.config.replaces_verification:
        result = dflash_accept_block(original, worker, *args, **kwargs)
    else:
        result = original(worker, *args, **kwargs)
    if state is not None and state.tts is not None and kwargs.get("candidates") is not None:
        info = kwargs.get("sampling_info")
        candidates = kwargs["candidates"]
        temps = getattr(info, "temperatures", None)
        if temps is None:
            temps = torch.ones(candidates.shape[0])
        state.tts.record_block(state.rids[: candidates.shape[0]], candidates, kwargs.get("next_token_logits"),
                               temps, result[0])
    return result


def dflash_append_around(original, worker, *args, **kwargs):
    """AROUND ``DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc``: the committed target features become
    the requests' TTS context, as they become the draft's KV."""
    result = original(worker, *args, **kwargs)
    state = _STATE
    hidden = kwargs.get("target_hidden")
    if state is not None and state.tts is not None and hidden is not None and hidden.numel():
        extend_lens = kwargs.get("extend_lens")
        if extend_lens is not None and isinstance(state.extend_lens, (list, tuple)):
            extend_lens = list(state.extend_lens)  # the batch's host copy of the same lengths
        state.tts.append_context(state.rids, hidden, commit_lens=kwargs.get("commit_lens"), extend_lens=extend_lens)
    return result


def request_finished_after(result, worker, rid, *args, **kwargs):
    """AFTER ``note_request_finished``: drop the request's TTS history."""
    state = _STATE
    if state is not None and state.tts is not None:
        state.tts.request_finished(rid)
    return result


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def reset_state() -> None:
    """Forget the installed state (tests)."""
    global _STATE
    _STATE = None
    set_runtime(None)
    gbv.set_drafting(None)
    hot_vocab.set_hot_vocab(None)

