"""The specadapt verification rules in SGLang's calling conventions (adapters over :mod:`specadapt.kernels`).

* :func:`chain_speculative_sampling` replaces
  ``sglang.kernels.ops.speculative.reject_sampling.chain_speculative_sampling_triton`` (EAGLE / EAGLE3 /
  STANDALONE with rejection sampling, top-k 1): same signature, same in-place outputs, driven by SGLang's coins.
* :func:`dflash_accept_block` wraps (AROUND) ``DFlashWorkerV2._accept_block`` for sampled requests: the DFLASH
  draft block is deterministic given the context, so its proposal law is the point mass on each drafted token
  and verifying against it is exact.
* :func:`target_probs_for_requests` turns SGLang's per-request sampling settings into the target law.
* :func:`sampling_refusal` says which of a request's SGLang sampling options the plugin cannot honour (the
  scheduler hook in :mod:`.hooks` refuses such a request).

What reaches the target law (SGLang 0.5.23, read from ``eagle_utils.eagle_sample`` and
``dflash_utils.apply_dflash_verify_logits_adjustments``): SGLang adds the logit bias and applies grammar masks
(per tree node) to the verify logits before the plugin sees them, and computes temperature / top-k / top-p; it
drops min-p, which the plugin applies to the target rows itself (:func:`chain_speculative_sampling`,
:func:`target_probs_for_requests`). SGLang's penalties reach the verify logits only "relaxed" (counts of one token
per round, the same for every draft position), custom logit processors not at all on the EAGLE path: the plugin
refuses requests that use them rather than verify against a law plain decoding would not sample from.

Nothing here imports sglang at module import; the layouts are documented per function.
"""

from __future__ import annotations

import logging

import torch

from .. import kernels
from ..sampling import SamplingParams, apply_min_p, logits_to_probs
from ..verification.rules import RULES
from .gbv import gbv_speculative_sampling
from .layout import scatter_sglang_outputs
from .state import VerifyRuntime, current, require

logger = logging.getLogger("specadapt.sglang")

__all__ = [
    "chain_speculative_sampling",
    "dflash_accept_block",
    "dflash_verify",
    "request_verify_coins",
    "sampling_refusal",
    "target_probs_for_requests",
]


def chain_speculative_sampling(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single,
    threshold_acc,
    deterministic,
    *,
    block_verification: bool = False,
):
    """Drop-in replacement of SGLang's chain rejection sampler running the specadapt rule.

    Layout (SGLang 0.5.23, eagle_utils.eagle_sample): ``candidates [B, L+1] int64`` (slot 0 the last committed
    token), ``retrive_index [B, L+1] int64``, ``uniform_samples [B, L+1] float32`` (the first L are the
    per-position coins), ``uniform_samples_for_final_sampling [B]``, ``target_probs [B, L+1, V] float32``,
    ``draft_probs [B, L, V] float32``. Outputs are written in place: ``predicts [B*(L+1)] int32``,
    ``accept_index [B, L+1] int32``, ``accept_token_num [B] int32`` (accepted drafts, bonus excluded).
    ``retrive_next_*``, the thresholds, ``deterministic`` and SGLang's own ``block_verification`` switch are
    ignored: the rule is ``--specadapt-verify`` (chain: Leviathan et al. 2023; block: Sun et al. 2024, Alg. 2;
    GBV over the tree of K chains with the state's :class:`~specadapt.sglang.gbv.GBVDrafting`), and adaptive
    verification's per-request caps (``VerifyRuntime.pending_caps``) limit the drafts verified. The rule and
    its pending values are read from the installed :class:`~specadapt.sglang.state.PluginState`.
    SGLang's ``target_probs`` leave min-p out; with ``VerifyRuntime.pending_min_ps`` set (the ``eagle_sample``
    hook) each request's rows get its min-p first (:func:`specadapt.sampling.apply_min_p`), GBV trees included.

    Raises:
        ValueError: shapes that are not SGLang's chain layout, or no draft law (``draft_probs`` of the target's
            shape means SGLang ran without rejection sampling, so q does not exist).
        RuntimeError: no plugin state installed in this process; the GBV rule without its drafting state.
    """
    state = require()
    runtime = state.runtime
    min_ps = runtime.take_min_ps()
    if min_ps is not None:
        target_probs = apply_min_p(target_probs, min_ps.reshape(-1, 1, 1).to(target_probs.device))
    if RULES[runtime.rule].multi_path:
        if state.drafting is None:
            raise RuntimeError(f"specadapt: --specadapt-verify {runtime.rule} without its K-path drafting state")
        runtime.last_gbv = gbv_speculative_sampling(
            state.drafting, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
            retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
            impl=runtime.impl, caps=runtime.take_caps(), broadcast=runtime.broadcast, rule=runtime.rule)
        runtime.calls += 1
        return
    batch, slots = candidates.shape
    num_drafts = slots - 1
    if draft_probs.dim() != 3 or draft_probs.shape[1] != num_drafts:
        raise ValueError(
            f"specadapt: draft_probs must be [B, L, V] = [{batch}, {num_drafts}, V] (got {tuple(draft_probs.shape)}); "
            "SGLang passes zeros of the target's shape when rejection sampling is off -- the plugin's resolution "
            "hook turns it on, so this means the hook did not run"
        )
    caps = runtime.take_caps()
    out = kernels.verify(
        runtime.rule,
        candidates.to(torch.int64),
        target_probs,
        draft_probs,
        uniform_samples[:, :num_drafts],
        uniform_samples_for_final_sampling,
        num_draft_tokens=caps,
        impl=runtime.impl,
    )
    scatter_sglang_outputs(out.accept_len, out.output_tokens, retrive_index, predicts, accept_index, accept_token_num)
    runtime.calls += 1


def target_probs_for_requests(logits, temperatures, top_ps, top_ks, min_ps=None) -> torch.Tensor:
    """Per-request target law from SGLang's sampling settings.

    Args:
        logits: ``[B, S, V]`` float, S verified slots per request (SGLang's logit bias and grammar masks already
            applied).
        temperatures: ``[B]`` or ``[B, 1]`` float; 0 (or top-k 1) = greedy.
        top_ps: ``[B]`` float in (0, 1].
        top_ks: ``[B]`` int; values <= 0 or >= V disable top-k.
        min_ps: ``[B]`` float in [0, 1] or ``None`` (no min-p).

    Returns:
        ``[B, S, V] float32`` probabilities (:func:`specadapt.sampling.logits_to_probs` row by row).

    Raises:
        ValueError: ``logits`` not ``[B, S, V]``, settings without one entry per request, out-of-range values.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, S, V], got {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    temps = temperatures.reshape(-1).tolist()
    tops = top_ps.reshape(-1).tolist()
    ks = top_ks.reshape(-1).tolist()
    mins = [0.0] * len(temps) if min_ps is None else min_ps.reshape(-1).tolist()
    if not (len(temps) == len(tops) == len(ks) == len(mins) == logits.shape[0]):
        raise ValueError("temperatures, top_ps, top_ks and min_ps need one entry per request")
    rows = []
    for b in range(logits.shape[0]):
        k = int(ks[b])
        greedy = float(temps[b]) <= 0 or k == 1
        params = SamplingParams(
            temperature=0.0 if greedy else float(temps[b]),
            top_p=min(max(float(tops[b]), 1e-6), 1.0),
            top_k=k if 0 < k < vocab else 0,
            min_p=float(mins[b]),
        )
        rows.append(logits_to_probs(logits[b], params))
    return torch.stack(rows)


def request_verify_coins(sampling_seed, counters, num_drafts: int, seed: int = 0):
    """Verification coins from each request's own stream (SGLang's per-request ``sampling_seed``).

    Args:
        sampling_seed: ``[B] int64`` per-request seeds (SGLang carries them in ``sampling_info.sampling_seed``
            under ``--enable-deterministic-inference``: the request's ``sampling_seed``, 42 by default).
        counters: ``[B] int64`` the requests' committed lengths at the round's start (a new value every round).
        num_drafts: drafts per request (coins per row).
        seed: the plugin's ``--specadapt-seed``, mixed into every stream.

    Returns:
        ``(uniforms [B, num_drafts] float64, uniforms_final [B] float64)`` in ``[0, 1)``, a function of each
        request's (seed, counter) only: the same whatever else is in the batch.
    """
    from ..engine.coins import ACCEPT, FINAL, request_coins

    seeds = torch.as_tensor(sampling_seed).reshape(-1).to(torch.int64).cpu()
    seeds = seeds ^ (int(seed) * 0x2545F4914F6CDD1D & ((1 << 63) - 1))
    counters = torch.as_tensor(counters).reshape(-1).to(torch.int64).cpu()
    return request_coins(seeds, counters, ACCEPT, num_drafts), request_coins(seeds, counters, FINAL, 1)[:, 0]


def dflash_verify(runtime: VerifyRuntime, candidates, logits, sampling_info, prefix_lens=None):
    """The specadapt rule on a sampled DFLASH block (no sglang import).

    Args:
        runtime: the process runtime (rule, implementation, caps, seed).
        candidates: ``[B, S] int64`` (slot 0 the last committed token, then the block's S - 1 drafts).
        logits: ``[B * S, V]`` SGLang's verify logits (its logit bias, grammar masks applied).
        sampling_info: SGLang's ``SamplingBatchInfo`` (temperatures, top_ps, top_ks, min_ps, need_min_p_sampling,
            sampling_seed).
        prefix_lens: ``[B]`` committed lengths (the coins' counters when SGLang carries per-request seeds).

    Returns:
        ``(accept_len [B] int32, bonus [B] int64)``. With ``sampling_info.sampling_seed`` set the coins come from
        each request's own stream (:func:`request_verify_coins`), else from the runtime's batch-wide generator.
    """
    batch, slots = candidates.shape
    vocab = logits.shape[-1]
    min_ps = sampling_info.min_ps if getattr(sampling_info, "need_min_p_sampling", False) else None
    probs = target_probs_for_requests(logits.reshape(batch, slots, vocab), sampling_info.temperatures,
                                      sampling_info.top_ps, sampling_info.top_ks, min_ps)
    drafts = candidates[:, 1:].to(torch.int64)
    draft_probs = torch.zeros(batch, slots - 1, vocab, dtype=torch.float32, device=probs.device)
    draft_probs.scatter_(2, drafts[..., None], 1.0)
    seeds = getattr(sampling_info, "sampling_seed", None)
    if seeds is not None:
        if prefix_lens is None:
            raise ValueError("specadapt DFLASH: per-request seeds need the block's prefix_lens")
        coins, final = request_verify_coins(seeds, prefix_lens, slots - 1, runtime.seed)
        coins, final = coins.to(probs.device), final.to(probs.device)
    else:
        gen = runtime.generator(probs.device)
        coins = torch.rand(batch, slots - 1, generator=gen, device=probs.device)
        final = torch.rand(batch, generator=gen, device=probs.device)
    out = kernels.verify(runtime.rule, candidates.to(torch.int64), probs, draft_probs, coins, final,
                         num_draft_tokens=runtime.take_caps(), impl=runtime.impl)
    accept_len = out.accept_len.to(torch.int32)
    bonus = out.output_tokens.to(torch.int64).gather(1, accept_len.to(torch.int64)[:, None]).squeeze(1)
    return accept_len, bonus


def sampling_refusal(sampling_params, custom_logit_processor=None) -> str | None:
    """Why the plugin cannot verify a request exactly, or ``None`` when it can (no sglang import).

    The plugin's rules are exact for the law SGLang's own (non-speculative) sampler draws from, given the target
    rows SGLang hands them. SGLang 0.5.23 builds those rows with temperature, top-k, top-p, the logit bias and
    grammar masks (the plugin adds min-p); its penalties reach speculative verification only "relaxed" (one token
    counted per round, the same counts at every draft position: ``eagle_sample``, ``eagle_prepare_for_decode``;
    DFLASH drops the repetition penalty), and custom logit processors do not reach EAGLE verification at all.

    Args:
        sampling_params: SGLang's ``SamplingParams`` of the request (or any object with ``frequency_penalty``,
            ``presence_penalty``, ``repetition_penalty``, ``min_new_tokens``).
        custom_logit_processor: the request's serialised custom logit processor, or ``None``.

    Returns:
        A one-line message naming the option, or ``None``.
    """
    options = []
    if float(getattr(sampling_params, "frequency_penalty", 0.0) or 0.0) != 0.0:
        options.append("frequency_penalty")
    if float(getattr(sampling_params, "presence_penalty", 0.0) or 0.0) != 0.0:
        options.append("presence_penalty")
    if float(getattr(sampling_params, "repetition_penalty", 1.0) or 1.0) != 1.0:
        options.append("repetition_penalty")
    if int(getattr(sampling_params, "min_new_tokens", 0) or 0) > 0:
        options.append("min_new_tokens")
    if custom_logit_processor:
        options.append("custom_logit_processor")
    if not options:
        return None
    return (f"specadapt: {', '.join(options)} cannot be verified exactly by the specadapt rules: SGLang 0.5.23 "
            "applies penalties to speculative verification only approximately (counted once per round, the same at "
            "every draft position) and custom logit processors not at all; drop "
            f"{'it' if len(options) == 1 else 'them'}, or serve with --specadapt-verify builtin (SGLang's own "
            "acceptance) and no --adaptive-verification")


def dflash_accept_block(original, worker, *args, **kwargs):
    """AROUND hook of ``DFlashWorkerV2._accept_block`` (keyword-only arguments in 0.5.23).

    Sampled batches without a selector draft are verified with the specadapt rule against the point-mass
    proposal of the deterministic DFLASH block; greedy batches, selector drafts and a precomputed
    ``target_predict`` go to the original. Returns SGLang's tuple ``(accept_len int32 [B], commit_lens int32
    [B] = accept_len + 1, bonus int64 [B], out_tokens int64 [B, S], None)``.
    """
    candidates = kwargs.get("candidates")
    logits = kwargs.get("next_token_logits")
    sampling_info = kwargs.get("sampling_info")
    state = current()
    if (
        state is None
        or args
        or candidates is None
        or logits is None
        or kwargs.get("target_predict") is not None
        or getattr(worker, "_selector_sample", None) is not None
        or sampling_info is None
        or getattr(sampling_info, "is_all_greedy", True)
    ):
        return original(worker, *args, **kwargs)
    runtime = state.runtime
    accept_len, bonus = dflash_verify(runtime, candidates, logits, sampling_info, kwargs.get("prefix_lens"))
    sync = getattr(worker, "_tp_sync", None)
    if sync is not None:
        from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

        sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, accept_len)
        sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, bonus)
    from sglang.srt.speculative.dflash_worker_v2 import _commit_accept  # SGLang's own block assembly

    out_tokens, commit_lens = _commit_accept(candidates, accept_len, bonus)
    runtime.calls += 1
    return accept_len, commit_lens, bonus, out_tokens, None
