"""Hooks on SGLang's EAGLE draft worker (``EagleDraftWorker``, ``spec_utils.sample_draft_proposal``): the K
sampled paths of GBV (:mod:`.gbv`) and q rows over the target vocabulary for hot-vocabulary EAGLE-3 heads
(:mod:`.hot_vocab`). Each reads the process state (:mod:`.state`); without one they pass through.

The table of which SGLang attribute gets which hook is :mod:`.targets`. Nothing here imports sglang at module
import.
"""

from __future__ import annotations

import logging

import torch

from .gbv import branch_seeds, first_draft_samples
from .hot_vocab import HotVocab
from .state import current, require

logger = logging.getLogger("specadapt.sglang")

__all__ = [
    "alloc_memory_pool_around",
    "draft_extend_for_decode_around",
    "draft_extend_for_prefill_around",
    "draft_worker_init_around",
    "sample_draft_proposal_around",
    "to_draft",
    "to_target",
]


def to_target(probs: torch.Tensor | None) -> torch.Tensor | None:
    """q rows ``[..., V_d]`` over the target vocabulary ``[..., V]`` (no-op without an installed hot vocabulary,
    for other widths, or for ``None``)."""
    state = current()
    hot = None if state is None else state.hot_vocab
    return probs if hot is None or probs is None else hot.to_target(probs)


def to_draft(probs: torch.Tensor | None) -> torch.Tensor | None:
    """q rows ``[..., V]`` over the draft vocabulary ``[..., V_d]`` (no-op without an installed hot vocabulary,
    for other widths, or for ``None``)."""
    state = current()
    hot = None if state is None else state.hot_vocab
    return probs if hot is None or probs is None else hot.to_draft(probs)


def draft_worker_init_around(original, worker, *args, **kwargs):
    """AROUND ``EagleDraftWorker.__init__``: SGLang asserts a top-k of 1 under rejection sampling there (its
    chain kernel's need); GBV drafts K sampled chains, so the flag is hidden for the constructor only."""
    from sglang.srt.runtime_context import get_spec

    with get_spec().override(speculative_use_rejection_sampling=False):
        return original(worker, *args, **kwargs)


def _finish_first(draft_input, sampling_info, positions) -> None:
    """Depth-1 proposal of the next round: K samples (GBV) drawn in the draft's vocabulary, and ``draft_probs``
    over the target vocabulary (a hot-vocabulary EAGLE-3 head: :mod:`.hot_vocab`)."""
    probs = getattr(draft_input, "draft_probs", None)
    if draft_input is None or probs is None or probs.dim() != 2 or probs.shape[0] == 0:
        return
    state = current()
    drafting = None if state is None else state.drafting
    if drafting is not None:
        draft_probs = to_draft(probs).float()
        if getattr(sampling_info, "is_all_greedy", False):
            # verified as SGLang's greedy beam tree (the draft graph's greedy variant): its usual top-K start
            topk_p, topk_index = draft_probs.topk(drafting.num_paths, dim=-1)
        else:
            topk_p, topk_index = first_draft_samples(draft_probs, drafting.num_paths,
                                                     getattr(sampling_info, "top_ks", None),
                                                     getattr(sampling_info, "sampling_seed", None), positions,
                                                     sampler=drafting.sampler)
        draft_input.topk_p, draft_input.topk_index = topk_p, topk_index  # draft ids: SGLang maps them itself
    draft_input.draft_probs = to_target(probs)


def draft_extend_for_prefill_around(original, worker, batch, *args, **kwargs):
    """AROUND ``EagleDraftWorker._draft_extend_for_prefill``: K depth-1 samples from the returned ``q_1`` (GBV),
    ``q_1`` over the target vocabulary."""
    result = original(worker, batch, *args, **kwargs)
    _finish_first(result, getattr(batch, "sampling_info", None), getattr(batch, "seq_lens", None))
    return result


def draft_extend_for_decode_around(original, worker, batch, batch_result, *args, **kwargs):
    """AROUND ``EagleDraftWorker._draft_extend_for_decode``: K depth-1 samples for the next round (GBV)."""
    result = original(worker, batch, batch_result, *args, **kwargs)
    _finish_first(getattr(batch_result, "next_draft_input", None), getattr(batch, "sampling_info", None),
                  getattr(batch_result, "new_seq_lens", None))
    return result


def sample_draft_proposal_around(original, next_token_logits, temperatures, top_ks=None, *, sampling_seed=None,
                                 positions=None, draft_step: int = 0):
    """AROUND ``spec_utils.sample_draft_proposal`` (SGLang's draft sampler, run inside the draft graph).

    Returned q rows are over the target vocabulary (scattered from a hot-vocabulary head; sampled ids stay
    draft ids). With GBV, for a draft step (``draft_step >= 1``) over ``B*K`` branch rows: one sample per row with
    per-branch settings, the rows' ``q`` kept in the :class:`~specadapt.sglang.gbv.GBVDrafting` buffer,
    ``topk_p [B*K, K]`` one-hot on the sample (column 0), ``topk_index [B*K, K]`` the sample repeated, and branch
    0's ``q`` ``[B, V]`` as the step's ``draft_probs`` entry (SGLang stacks one ``[B, V]`` per depth).
    """
    state = current()
    drafting = None if state is None else state.drafting
    batch = temperatures.shape[0] if temperatures is not None else 0
    rows = next_token_logits.shape[0]
    if drafting is None or draft_step < 1 or batch == 0 or rows != batch * drafting.num_paths:
        probs, p, index = original(next_token_logits, temperatures, top_ks, sampling_seed=sampling_seed,
                                   positions=positions, draft_step=draft_step)
        return to_target(probs), p, index
    k = drafting.num_paths
    temps = temperatures.repeat_interleave(k, dim=0)
    ks = None if top_ks is None else top_ks.reshape(-1).repeat_interleave(k)
    seeds = branch_seeds(sampling_seed, k)
    pos = positions
    if pos is not None and pos.numel() == batch:
        pos = pos.reshape(-1).repeat_interleave(k)
    probs, _, index = original(next_token_logits, temps, ks, sampling_seed=seeds, positions=pos,
                               draft_step=draft_step)
    probs = to_target(probs)
    drafting.record(draft_step, probs)
    topk_p = torch.zeros(rows, k, dtype=torch.float32, device=probs.device)
    topk_p[:, 0] = 1.0
    topk_index = index.reshape(rows, 1).to(torch.int64).expand(rows, k).contiguous()
    return probs.reshape(batch, k, -1)[:, 0], topk_p, topk_index


def alloc_memory_pool_around(original, worker, *args, **kwargs):
    """AROUND ``EagleDraftWorker.alloc_memory_pool``: run it with rejection sampling hidden (SGLang refuses a hot
    vocabulary under it), then record the draft's ``hot_token_id`` in the process state for the q-row scatter.

    Raises:
        RuntimeError: the draft's q rows are not as wide as the target vocabulary; a hot-vocabulary draft under
            prefill-decode disaggregation; a hot-vocabulary draft and no installed plugin state.
    """
    from sglang.srt.runtime_context import get_spec

    with get_spec().override(speculative_use_rejection_sampling=False):
        result = original(worker, *args, **kwargs)
    if not get_spec().speculative_use_rejection_sampling:
        return result
    target_vocab = int(worker.target_worker.model_config.vocab_size)
    draft_rows = int(worker.draft_runner.model_config.vocab_size)  # width of SGLang's draft_probs graph buffers
    if draft_rows != target_vocab:
        raise RuntimeError(f"specadapt: the draft's config vocab_size ({draft_rows}) differs from the target's "
                           f"({target_vocab}); q rows over the target vocabulary would not fit SGLang's buffers")
    hot = getattr(worker, "hot_token_id", None)
    if hot is not None:
        mode = getattr(getattr(worker, "server_args", None), "disaggregation_mode", None)
        if mode not in (None, "null"):
            raise RuntimeError(f"specadapt: a hot-vocabulary draft with --disaggregation-mode {mode} is not supported "
                               "(the prefill-decode handover builds q over draft ids)")
        require().hot_vocab = HotVocab(hot, target_vocab)
        logger.info("specadapt: the draft predicts %d hot tokens of %d; q rows are scattered into the target "
                    "vocabulary for verification", int(hot.numel()), target_vocab)
    return result
