"""One differentiable pass over the EAGLE head for all of a TTS update's examples, sharing their context windows.

A TTS update of the EAGLE head (``--tts``, stride ``S``) re-runs each supervised round's drafting: the head over
the round's last ``w`` (feature, token) pairs, then its own chain of ``C`` steps. The ``S`` rounds of one request
that an update sees have windows that are stretches of one stream shifted by a few tokens, so running each
window on its own repeats almost all of the work (``S x w`` positions through the layer where about
``w + S x 2`` are distinct: 330 against 75 on the coder's code answers at ``S = 5``, ``w = 64``).

:func:`shared_window_logits` groups the examples whose windows are stretches of one stream (checked exactly: the
overlapping tokens *and* features must be equal), runs each group's union once, and gives every example its own
window by the attention mask: the head has one decoder layer, so keys and values at a position depend on that
position's inputs only, and a query that attends to exactly its example's window ``[s, e)`` (plus the example's
own chain steps) computes what the example's own forward computes. RoPE positions are the union's, so relative
offsets are the example's own; results equal the per-example forward up to float rounding (tested against
:meth:`~specadapt.engine.tts_students.EagleDraftStudent.logits_one`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["WindowGroup", "group_windows", "shared_window_logits"]


@dataclass
class WindowGroup:
    """Examples whose windows are stretches of one stream.

    Attributes:
        features: ``[U, F]`` the union's features; tokens: ``[U] int64`` its tokens.
        members: ``(example index, start, end)``: the example's window is the union's ``[start, end)``.
        slot: the examples' adapter slot (``--tts-scope request``; all members share it).
    """

    features: torch.Tensor
    tokens: torch.Tensor
    slot: int = 0
    members: list[tuple[int, int, int]] = field(default_factory=list)


def _offset_in(group: WindowGroup, features: torch.Tensor, tokens: torch.Tensor) -> int | None:
    """The offset ``o`` at which ``(features, tokens)`` continues ``group``'s union (the overlap, at least one pair,
    equal in tokens and features), or ``None``."""
    union = group.tokens
    for o in (union == tokens[0]).nonzero().flatten().tolist():
        overlap = min(union.shape[0] - o, tokens.shape[0])
        if torch.equal(union[o:o + overlap], tokens[:overlap]) and \
                torch.equal(group.features[o:o + overlap], features[:overlap]):
            return o
    return None


def group_windows(contexts: list, slots: list[int] | None = None) -> list[WindowGroup]:
    """Group ``contexts`` (``[(features [w, F], tokens [w] int64)]``) into unions of overlapping windows.

    An example joins the first group (same slot) whose union it overlaps exactly and where no member with the same
    end has another start (one query position, one window); otherwise it starts a group.

    Raises:
        ValueError: an empty window.
    """
    slots = slots or [0] * len(contexts)
    groups: list[WindowGroup] = []
    for i, (features, tokens) in enumerate(contexts):
        if tokens.shape[0] < 1:
            raise ValueError(f"example {i} has an empty context window")
        placed = False
        for group in groups:
            if group.slot != slots[i]:
                continue
            o = _offset_in(group, features, tokens)
            if o is None:
                continue
            end = o + tokens.shape[0]
            if any(e == end and s != o for _, s, e in group.members):
                continue
            size = group.tokens.shape[0]
            if end > size:
                group.tokens = torch.cat([group.tokens, tokens[size - o:]])
                group.features = torch.cat([group.features, features[size - o:]])
            group.members.append((i, o, end))
            placed = True
            break
        if not placed:
            groups.append(WindowGroup(features, tokens, slots[i], [(i, 0, tokens.shape[0])]))
    return groups


def shared_window_logits(module: nn.Module, contexts: list, drafts: list[torch.Tensor],
                         lora_slots=None, slots: list[int] | None = None) -> torch.Tensor:
    """The EAGLE head's drafting logits of every example, each from its own window, in shared passes.

    Args:
        module: the :class:`~specadapt.engine.eagle.EagleHead` (or its TTS shadow copy); one decoder layer.
        contexts: per example ``(features [w_i, 3h], tokens [w_i] int64)``, the pairs that end with the round's
            slot 0.
        drafts: per example ``[C_i] int64`` the round's drafted tokens (``C_i >= 1``).
        lora_slots: the module's :class:`~specadapt.tts.LoRASlots` (``--tts-scope request``) or ``None``;
            slots: per example adapter slot.

    Returns:
        ``[N, C_max, Vd]`` logits (the head's dtype); row ``i``'s first ``C_i`` positions are the logits that gave
        ``q_1..q_{C_i}``, later ones are padding.

    Raises:
        ValueError: no examples, an empty window or an example without drafts.
    """
    from transformers import DynamicCache

    if not contexts or len(contexts) != len(drafts):
        raise ValueError(f"need one drafts tensor per context, got {len(contexts)} contexts, {len(drafts)} drafts")
    if any(d.shape[0] < 1 for d in drafts):
        raise ValueError("every example needs at least one draft")
    groups = group_windows(contexts, slots)
    device, dtype = module.fuse.weight.device, module.fuse.weight.dtype
    if lora_slots is not None:
        lora_slots.rows = torch.tensor([g.slot for g in groups])
    neg = torch.finfo(dtype).min
    n_groups, n = len(groups), len(contexts)
    width = max(g.tokens.shape[0] for g in groups)
    slots_per_group = max(len(g.members) for g in groups)
    c_max = max(int(d.shape[0]) for d in drafts)
    feats = torch.zeros(n_groups, width, groups[0].features.shape[1])
    tokens = torch.zeros(n_groups, width, dtype=torch.int64)
    pads = []
    for gi, g in enumerate(groups):
        pad = width - g.tokens.shape[0]
        pads.append(pad)
        feats[gi, pad:] = g.features
        tokens[gi, pad:] = g.tokens
    col = torch.arange(width)
    pad_t = torch.tensor(pads)
    positions = (col[None, :] - pad_t[:, None]).clamp_min(0)
    valid = col[None, :] >= pad_t[:, None]
    allowed = valid[:, None, :] & (col[None, None, :] <= col[None, :, None])  # default: causal over real keys
    allowed = allowed | torch.eye(width, dtype=torch.bool)[None]  # padded queries see themselves (no NaN)
    # the member slot table maps (group, slot) -> example and its window [start, end) in the padded columns
    member_of = torch.full((n_groups, slots_per_group), -1, dtype=torch.int64)
    start_col = torch.zeros(n_groups, slots_per_group, dtype=torch.int64)
    end_col = torch.zeros(n_groups, slots_per_group, dtype=torch.int64)
    for gi, g in enumerate(groups):
        for j, (i, s, e) in enumerate(g.members):
            member_of[gi, j] = i
            start_col[gi, j], end_col[gi, j] = pads[gi] + s, pads[gi] + e
    real = member_of >= 0
    member_g, member_j = real.nonzero(as_tuple=True)
    window_keys = (col[None, None, :] >= start_col[:, :, None]) & (col[None, None, :] < end_col[:, :, None]) \
        & real[:, :, None]  # [G, S, width]: each member's window
    # each member's query (its window's last pair) sees its window only, in the first pass and in its chain steps
    allowed[member_g, end_col[member_g, member_j] - 1] = window_keys[member_g, member_j]
    mask = torch.where(allowed, 0.0, neg).to(dtype)[:, None]
    cache = DynamicCache(config=module.config)
    out = module(tokens.to(device), feats.to(device), attention_mask=mask.to(device),
                 position_ids=positions.to(device), cache=cache, use_cache=True, logits_to_keep=1)
    query = (end_col - 1).clamp_min(0)
    g_prev = out.hidden[torch.arange(n_groups)[:, None], query.to(device)]  # [G, S, h]
    logits = [module.logits_of(g_prev)]  # [G, S, Vd]
    step_tokens = torch.zeros(n_groups, slots_per_group, c_max, dtype=torch.int64)
    for gi in range(n_groups):
        for j in range(slots_per_group):
            i = int(member_of[gi, j])
            if i >= 0:
                step_tokens[gi, j, : drafts[i].shape[0]] = drafts[i].cpu()
    own = torch.eye(slots_per_group, dtype=torch.bool)[None].expand(n_groups, -1, -1)  # slot j sees its own keys
    chain_keys = torch.zeros(n_groups, slots_per_group, 0, dtype=torch.bool)
    chain_origin = end_col - pad_t[:, None]  # a member's first chain step sits at its window's end (union coords)
    for k in range(1, c_max):
        chain_keys = torch.cat([chain_keys, own], dim=2)  # its chain steps 1..k (a padded slot: only these)
        keys = torch.cat([window_keys, chain_keys], dim=2)  # [G, S, width + k * S]
        step_mask = torch.where(keys, 0.0, neg).to(dtype)[:, None]
        pos = (chain_origin + k - 1).clamp_min(0)
        step = module(step_tokens[:, :, k - 1].to(device), g_prev, attention_mask=step_mask.to(device),
                      position_ids=pos.to(device), cache=cache, use_cache=True)
        g_prev = step.hidden
        logits.append(step.logits)
    stacked = torch.stack(logits, dim=2)  # [G, S, C_max, Vd]
    order = torch.argsort(member_of[member_g, member_j])  # every example is exactly one member
    return stacked[member_g[order].to(device), member_j[order].to(device)]
