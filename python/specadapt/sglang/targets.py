"""The hook table: which SGLang attribute the plugin patches with which hook, per feature and algorithm. The heavy
hooks are installed in each scheduler (TP worker) process once its speculative worker exists and before CUDA
graphs are captured (:mod:`.install`, from the AROUND hook on ``Scheduler.maybe_init_draft_worker``).

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

Hook bodies: :mod:`.hooks` (target side), :mod:`.draft_hooks` (draft worker), :mod:`.verify` (the replaced
sampler and DFLASH acceptance). After ``HookRegistry.apply_hooks()`` every target is checked
(:func:`specadapt.sglang.registry.check_applied`). Nothing here imports sglang.
"""

from __future__ import annotations

from typing import Any, Callable

from .config import PluginConfig
from .draft_hooks import (alloc_memory_pool_around, draft_extend_for_decode_around, draft_extend_for_prefill_around,
                          draft_worker_init_around, sample_draft_proposal_around)
from .hooks import (add_request_around, dflash_accept_around, dflash_append_around, eagle_sample_around,
                    forward_batch_generation_around, request_finished_after)
from .verify import chain_speculative_sampling

__all__ = ["EAGLE_FAMILY", "HOOK_TARGETS", "Target", "plan_targets", "pre_worker_targets"]

#: ``(dotted SGLang target, HookType name, hook)``.
Target = tuple[str, str, Callable[..., Any]]

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


def plan_targets(config: PluginConfig, algorithm: str) -> list[Target]:
    """``(target, hook type name, hook)`` for ``config`` on ``algorithm`` (no sglang import)."""
    algorithm = algorithm.upper()
    targets: list[Target] = []
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
        targets.append((ALLOC_POOL, "AROUND", alloc_memory_pool_around))
        targets.append((DRAFT_SAMPLER, "AROUND", sample_draft_proposal_around))
        targets.append((EXTEND_PREFILL, "AROUND", draft_extend_for_prefill_around))
    if eagle and config.multi_path:
        targets.append((EXTEND_DECODE, "AROUND", draft_extend_for_decode_around))
    if config.replaces_verification and (eagle or algorithm == "DFLASH"):
        targets.append((ADD_REQUEST, "AROUND", add_request_around))
    return targets


def pre_worker_targets(config: PluginConfig) -> list[Target]:
    """Hooks the speculative worker's constructor needs, installed before it runs (no sglang import)."""
    if config.multi_path:
        return [(DRAFT_WORKER_INIT, "AROUND", draft_worker_init_around)]
    return []
