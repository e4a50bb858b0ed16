"""Adaptive verification in the embedded engine: the state (:class:`specadapt.budget.adaptive.
AdaptiveVerification`, re-exported here) and the cost profiling of the engine's forward path.

Pruned drafts are never sent to the target (they are holes of the ragged verify forward).
"""

from __future__ import annotations

import logging

import torch

from ..budget import CostTable
from ..budget.adaptive import AdaptiveVerification
from ..timing import median_seconds
from .drafts import Draft, NoDraft, NgramDraft

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveVerification", "profile_engine_costs", "profile_sizes"]


def profile_sizes(largest: int) -> list[int]:
    """Sizes a cost table is timed at, ``1..largest``: every size up to 8, then about 1.4x apart, and the largest
    (the others are interpolated linearly; forwards on these CPUs cost piecewise-linearly in tokens)."""
    if largest < 1:
        raise ValueError(f"largest must be >= 1, got {largest}")
    sizes = list(range(1, min(largest, 8) + 1))
    while sizes[-1] < largest:
        sizes.append(min(largest, max(sizes[-1] + 1, int(round(sizes[-1] * 1.4)))))
    return sizes


def _interpolate(sizes: list[int], values: list[float], largest: int) -> list[float]:
    out = []
    for n in range(1, largest + 1):
        j = next(i for i, s in enumerate(sizes) if s >= n)
        if sizes[j] == n or j == 0:
            out.append(values[j])
        else:
            a, b = sizes[j - 1], sizes[j]
            out.append(values[j - 1] + (values[j] - values[j - 1]) * (n - a) / (b - a))
    return out


def _median_ms(fn, repeats: int, warmup: int = 1) -> float:
    return 1e3 * median_seconds(fn, repeats, warmup)


def profile_engine_costs(target, draft: Draft | None, max_tokens: int, max_requests: int, num_drafts: int,
                         repeats: int = 5, context: int = 256) -> CostTable:
    """Cost table of the forward path the engine runs (native slot cache or transformers), by timing it.

    ``target_ms[n - 1]``: one target forward over ``n`` tokens spread over ``min(n, max_requests)`` rows of a
    cache holding ``context`` positions per row (the shape of a verify forward: a plain decode step of ``n`` rows
    when ``n <= max_requests``, else ``1 + L_r`` tokens per row), with the hidden states the draft reads.
    ``draft_ms[r - 1]``: one drafting round of ``r`` requests through the draft object itself -- the catch-up
    of one committed token and ``num_drafts`` positions, sampling included, no early stop -- (0 for drafts
    without a model: ngram, none), and ``draft_first_ms`` the same round drafting position 1 only (the fixed
    part: catch-up, first q row). Sizes are timed at :func:`profile_sizes` and interpolated.

    Args:
        target: the engine's :class:`~specadapt.engine.models.LoadedModel` (its forward attached).
        draft: the engine's draft (it is started on dummy prompts here; the engine starts it again), or ``None``.
        max_tokens, max_requests: largest sizes, e.g. ``(L + 1) * B`` and ``B``.
        num_drafts: L, positions a drafting round drafts.
        repeats: timed calls per size (median), after one warm-up.
        context: cache positions per row before the timed forwards.

    Raises:
        ValueError: a size below 1.
    """
    if max_tokens < 1 or max_requests < 1 or num_drafts < 0 or context < 1:
        raise ValueError(f"profile sizes must be >= 1, got max_tokens={max_tokens}, max_requests={max_requests}, "
                         f"num_drafts={num_drafts}, context={context}")
    needs_hidden = bool(draft is not None and draft.needs_target_hidden)
    logger.info("profiling costs on the %s forward: target up to %d tokens, draft up to %d requests",
                target.forward_name, max_tokens, max_requests)
    rows = max_requests
    per_row = -(-max_tokens // rows)
    cache = target.new_cache(rows, capacity=context + per_row + 8)
    with torch.no_grad():
        cache.forward(torch.ones(rows, context, dtype=torch.int64), torch.full((rows,), context), logits_to_keep=1)

        def target_forward(n: int) -> None:
            active = min(n, rows)
            counts = torch.zeros(rows, dtype=torch.int64)
            counts[:active] = n // active
            counts[: n % active] += 1
            before = cache.lengths.cpu().clone()
            cache.forward(torch.ones(rows, int(counts.max()), dtype=torch.int64), counts, return_outputs=True,
                          output_hidden_states=needs_hidden)
            cache.truncate(before)

        for _ in range(10):  # warm the weights and the allocator before any timed call
            target_forward(1)
        sizes = profile_sizes(max_tokens)
        # small sizes are cheap and decide the most: time them more often
        target_ms = _interpolate(sizes, [_median_ms(lambda n=n: target_forward(n), 3 * repeats if n <= 8 else repeats)
                                         for n in sizes], max_tokens)
        if draft is None or isinstance(draft, (NoDraft, NgramDraft)) or num_drafts == 0:
            return CostTable(target_ms, [0.0] * max_requests)
        r_sizes = profile_sizes(max_requests)
        draft_ms = _interpolate(r_sizes, [_draft_round_ms(target, draft, r, num_drafts, repeats, context)
                                          for r in r_sizes], max_requests)
        first_ms = None
        if num_drafts > 1:
            first_ms = _interpolate(r_sizes, [_draft_round_ms(target, draft, r, 1, repeats, context)
                                              for r in r_sizes], max_requests)
    return CostTable(target_ms, draft_ms, first_ms)


def _draft_round_ms(target, draft: Draft, requests: int, num_drafts: int, repeats: int, context: int) -> float:
    """Median ms of one drafting round of ``requests`` rows through ``draft`` (its own cache and sampling)."""
    histories = [[1 + (i + r) % 7 for i in range(context)] for r in range(requests)]
    saved = draft.row_seeds, draft.history_counts, draft.row_sampling, draft.context_capacity
    draft.history_counts, draft.row_sampling = None, None
    draft.row_seeds = torch.arange(requests, dtype=torch.int64)
    draft.context_capacity = context + (num_drafts + 2) * (3 * repeats + 8)
    hidden = 3 * target.model.config.hidden_size if draft.needs_target_hidden else 0
    try:
        draft.start(histories)
        if draft.needs_target_hidden:
            draft.observe_target(torch.zeros(requests, context - 1, hidden))

        def one_round() -> None:
            draft.propose(histories, torch.full((requests,), num_drafts), target.vocab_size)
            if draft.needs_target_hidden:
                draft.observe_target(torch.zeros(requests, 1, hidden))
            draft.commit(torch.zeros(requests, dtype=torch.int64))
            for h in histories:
                h.append(3)

        return _median_ms(one_round, 3 * repeats, warmup=3)
    finally:
        draft.row_seeds, draft.history_counts, draft.row_sampling, draft.context_capacity = saved
