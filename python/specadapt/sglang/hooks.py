"""The hook bodies on SGLang's scheduler and speculative workers (target side): min-p, adaptive caps and TTS
around the EAGLE verify (``eagle_sample``), the round boundary (``forward_batch_generation``), the DFLASH block
acceptance and context, finished requests, and the refusal of requests the rules cannot verify exactly.

Each reads the process state (:func:`specadapt.sglang.state.current`) and passes through to SGLang without one.
Which SGLang attribute gets which hook is :mod:`.targets`; the draft-worker hooks are :mod:`.draft_hooks`.
Nothing here imports sglang.
"""

from __future__ import annotations

import torch

from ..verification.rules import RULES
from .probes import capturing
from .state import current
from .verify import dflash_accept_block, sampling_refusal

__all__ = ["add_request_around", "dflash_accept_around", "dflash_append_around", "eagle_sample_around",
           "forward_batch_generation_around", "request_finished_after"]


def eagle_sample_around(original, verify_input, batch, logits_output, *args, **kwargs):
    """AROUND ``eagle_sample``: the batch's min-p and caps before the sampler, TTS snapshot of the raw verify
    outputs, and the outcomes (estimator, TTS history) after. Returns the original's ``(predict, accept_lens,
    accept_index)``."""
    state = current()
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
    tree = RULES[state.runtime.rule].multi_path  # a verify tree: snapshot every node, keep the chosen path afterwards
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
    state = current()
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
    state = current()
    mode = getattr(batch, "forward_mode", None)
    is_decode = mode is not None and not (mode.is_extend() or getattr(batch, "is_extend_in_batch", False))
    if state is not None and state.tts is not None and is_decode and not capturing():
        state.tts.on_round_start()
    if state is not None:
        state.rids = [req.rid for req in getattr(batch, "reqs", None) or []]
        lens = getattr(batch, "extend_lens", None)  # host list at prefill (no device sync)
        state.extend_lens = list(lens) if isinstance(lens, (list, tuple)) else None
    return original(worker, batch, *args, **kwargs)


def dflash_accept_around(original, worker, *args, **kwargs):
    """AROUND ``DFlashWorkerV2._accept_block``: the specadapt rule (when one replaces SGLang's), then the TTS
    example of the round from the target's verify logits."""
    state = current()
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
    state = current()
    hidden = kwargs.get("target_hidden")
    if state is not None and state.tts is not None and hidden is not None and hidden.numel():
        extend_lens = kwargs.get("extend_lens")
        if extend_lens is not None and state.extend_lens is not None:
            extend_lens = list(state.extend_lens)  # the batch's host copy of the same lengths
        state.tts.append_context(state.rids, hidden, commit_lens=kwargs.get("commit_lens"), extend_lens=extend_lens)
    return result


def request_finished_after(result, worker, rid, *args, **kwargs):
    """AFTER ``note_request_finished``: drop the request's TTS history."""
    state = current()
    if state is not None and state.tts is not None:
        state.tts.request_finished(rid)
    return result
