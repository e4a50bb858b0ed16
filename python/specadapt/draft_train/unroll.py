"""EAGLE-3's training-time test: the draft head unrolled for ``k`` drafting steps over a whole sequence at once.

Notation (one sequence ``x_0 .. x_{T-1}``, target features ``f_t`` and final hidden states ``h_t``):

- step 1 at query ``i`` reads ``(f_i, x_{i+1})`` at position ``i`` and attends to the step-1 keys of positions
  ``j <= i``; its output ``g1_i`` gives ``q1(x_{i+2})``;
- step ``s > 1`` at query ``i`` reads ``(g{s-1}_i, x_{i+s})`` at position ``i+s-1`` and attends to the step-1
  keys ``j <= i`` and to the step-``m`` keys of the same ``i`` for ``2 <= m <= s`` (itself included): exactly
  the cache the drafting loop holds when it drafts its ``s``-th token after committed position ``i``
  (:class:`~specadapt.engine.eagle_draft.EagleDraft`); its output gives ``q_s(x_{i+s+1})``.

The step-1 keys are one causal attention over the sequence; the extra keys of step ``s`` are one per query (a
diagonal), so step ``s`` costs O(T^2) like step 1, not O(s T^2) as a dense mask over all keys would.

The teacher of ``q_s`` at query ``i`` is the target's ``p(x_{i+s+1} | x_<=i+s) = softmax(h_{i+s} @ W.T)``
restricted and renormalised to the draft vocabulary (the training loss is the forward KL to it); the
acceptance reported, ``sum_x min(p, q)`` with ``p`` over the full vocabulary, is what speculative sampling at
temperature 1 accepts (Leviathan et al. 2023, Theorem 1) on teacher-forced prefixes.

Only the head's own modules are used (``fuse``, ``input_proj``, ``layer``, ``rotary`` and the shared frozen
embedding / norm / LM-head rows): the unrolled forward is tested equal to :meth:`EagleHead.forward` run step by
step with a KV cache (tests/test_draft_train.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["UnrolledOutput", "unrolled_forward", "unrolled_loss", "StepStats", "full_teacher", "DIVERGENCES"]


@dataclass
class UnrolledOutput:
    """``hidden[s]``: ``[n_s - first[s], h]`` outputs of step ``s + 1`` at queries ``i = first[s] .. n_s - 1``
    (``n_s = T - 2 - s``: step ``s + 1`` at query ``i`` needs the token ``x_{i+s+1}``; step 1 runs at every
    query, later steps from ``first_query`` on)."""

    hidden: list[torch.Tensor]
    first: list[int]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [H, n, d]`` rotated by ``cos / sin [n, d]``."""
    return x * cos[None] + _rotate_half(x) * sin[None]


def _project(head, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    embed, _, _ = head.shared
    if features.shape[-1] == 3 * head.hidden_size:
        features = head.fuse(features)
    return head.input_proj(torch.cat([embed(ids).to(features.dtype), features], dim=-1))


def unrolled_forward(head, tokens: torch.Tensor, features: torch.Tensor, steps: int,
                     first_query: int = 0) -> UnrolledOutput:
    """Run ``steps`` unrolled drafting steps of ``head`` over one sequence (see the module docstring).

    Args:
        head: an attached :class:`~specadapt.engine.eagle.EagleHead` (float32 parameters).
        tokens: ``[T] int64`` the sequence.
        features: ``[T, 3h]`` target features ``f_t`` (any float dtype; rows ``T-2``, ``T-1`` unused).
        steps: ``k >= 1``.
        first_query: steps ``2 .. k`` run only at queries ``i >= first_query`` (the step-1 keys of every
            position are still computed: later queries attend to them).

    Returns:
        :class:`UnrolledOutput` with ``k`` tensors (differentiable in the head's parameters).

    Raises:
        ValueError: ``steps < 1``, a sequence shorter than ``steps + 2`` tokens, or mismatched shapes.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    T = int(tokens.shape[0])
    if T < steps + 2:
        raise ValueError(f"a sequence of {T} tokens is too short for {steps} unrolled steps (needs {steps + 2})")
    if features.shape[0] != T:
        raise ValueError(f"features has {features.shape[0]} rows for {T} tokens")
    layer = head.layer
    attn = layer.self_attn
    dtype = head.fuse.weight.dtype
    heads = head.config.num_attention_heads
    kv_heads = head.config.num_key_value_heads
    groups = heads // kv_heads
    d = attn.head_dim
    scale = attn.scaling
    n1 = T - 2
    positions = torch.arange(T, device=tokens.device)
    cos_all, sin_all = head.rotary(features[:1].to(dtype)[None], positions[None])
    cos_all, sin_all = cos_all[0].to(dtype), sin_all[0].to(dtype)

    def qkv(x: torch.Tensor, pos: slice):
        n = x.shape[0]
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(n, heads, d).transpose(0, 1)
        k = attn.k_proj(h).view(n, kv_heads, d).transpose(0, 1)
        v = attn.v_proj(h).view(n, kv_heads, d).transpose(0, 1)
        cos, sin = cos_all[pos], sin_all[pos]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def finish(x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x + attn.o_proj(attended.transpose(0, 1).reshape(n, heads * d))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    # step 1: causal attention over the real pairs
    x1 = _project(head, features[:n1].to(dtype), tokens[1 : n1 + 1])
    q1, k1, v1 = qkv(x1, slice(0, n1))
    k1x = k1.repeat_interleave(groups, dim=0)  # [H, n1, d]
    v1x = v1.repeat_interleave(groups, dim=0)
    out = F.scaled_dot_product_attention(q1, k1x, v1x, is_causal=True, scale=scale)
    hidden = [finish(x1, out)]
    extra_k: list[torch.Tensor] = []  # step-m keys / values per query i (m >= 2), [H, n_m, d]
    extra_v: list[torch.Tensor] = []
    first = [0]
    lo = max(int(first_query), 0)
    for s in range(2, steps + 1):
        n = T - 1 - s
        if lo >= n:  # no query left for this step (nor for later ones)
            hidden.append(hidden[-1][:0])
            first.append(n)
            continue
        prev = hidden[-1][lo - first[-1] : n - first[-1]]
        x = _project(head, prev, tokens[lo + s : n + s])
        q, k, v = qkv(x, slice(lo + s - 1, n + s - 1))
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
        width = n - lo
        extra_k = [e[:, :width] for e in extra_k] + [k]
        extra_v = [e[:, :width] for e in extra_v] + [v]
        scores = torch.matmul(q, k1x.transpose(1, 2)) * scale  # [H, width, n1]
        causal = torch.arange(n1, device=q.device)[None, :] <= torch.arange(lo, n, device=q.device)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = torch.stack([(q * e).sum(-1) * scale for e in extra_k], dim=-1)  # [H, width, s-1]
        wide = torch.promote_types(scores.dtype, torch.float32)  # the softmax in float32 also under a bf16 autocast
        weights = torch.softmax(torch.cat([scores.to(wide), diag.to(wide)], dim=-1), dim=-1)
        attended = torch.matmul(weights[..., :n1], v1x)
        attended = attended + (weights[..., n1:, None] * torch.stack(extra_v, dim=-2)).sum(-2)
        hidden.append(finish(x, attended))
        first.append(lo)
    return UnrolledOutput(hidden=hidden, first=first)


@dataclass
class StepStats:
    """Per unrolled step ``s``: summed ``sum_x min(p, q)`` (acceptance), top-1 agreement, and query count."""

    acceptance: float = 0.0
    top1: float = 0.0
    count: int = 0


def full_teacher(final: torch.Tensor, full_head_weight: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-vocabulary log normaliser and argmax of the target at every position.

    Args:
        final: ``[T, h]`` final normed hidden states; full_head_weight: ``[V, h]`` the target's LM head.

    Returns:
        ``(log_z [T] float32, argmax [T] int64)`` of ``h_t @ W.T`` (computed in chunks of ``chunk`` rows).
    """
    logz, argmax = [], []
    with torch.no_grad():
        for a in range(0, final.shape[0], chunk):
            logits = final[a : a + chunk].float() @ full_head_weight.T.float()
            logz.append(torch.logsumexp(logits, dim=-1))
            argmax.append(logits.argmax(-1))
    return torch.cat(logz), torch.cat(argmax)


DIVERGENCES = ("fkl", "tvd")


def unrolled_loss(head, tokens: torch.Tensor, features: torch.Tensor, final: torch.Tensor, steps: int,
                  step_weights: list[float], first_query: int = 0,
                  teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
                  stats: list[StepStats] | None = None, divergence: str = "fkl") -> torch.Tensor | None:
    """Divergence of the unrolled head from the target over the draft vocabulary, for one sequence.

    ``divergence``: ``"fkl"`` the forward KL(p || q) (EAGLE-3), or ``"tvd"`` the total-variation distance
    ``1 - sum_x min(p(x), q(x))`` (DistillSpec, Zhou et al. 2024: the divergence whose minimum is the acceptance
    rate of speculative sampling itself), with ``p`` the teacher renormalised on the draft vocabulary.

    Args:
        head: an attached :class:`~specadapt.engine.eagle.EagleHead`.
        tokens / features: see :func:`unrolled_forward`; ``final``: ``[T, h]`` the target's final normed hidden
            states (``h_t``).
        steps: unrolled steps ``k``; ``step_weights``: ``k`` loss weights.
        first_query: the loss counts queries ``i >= first_query`` only (``prompt_len - 1``: the first draft the
            engine makes follows the first answer token); earlier queries still give their keys.
        teacher: :func:`full_teacher` of ``final``, needed for ``stats`` (the acceptance uses the
            full-vocabulary ``p``).
        stats: when given (``k`` entries), accumulated (no gradient).

    Returns:
        The weighted mean of the steps' mean KL (a scalar tensor), or ``None`` when no query is counted.

    Raises:
        ValueError: ``len(step_weights) != steps``, ``stats`` without ``teacher``, or an unknown ``divergence``.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if len(step_weights) != steps:
        raise ValueError(f"step_weights needs {steps} entries, got {len(step_weights)}")
    if stats is not None and teacher is None:
        raise ValueError("stats needs teacher (the acceptance uses the full-vocabulary p)")
    out = unrolled_forward(head, tokens, features, steps, first_query=first_query)
    _, norm, head_weight = head.shared
    vocab = head.draft_vocab
    T = int(tokens.shape[0])
    base = max(int(first_query), 0) + 1  # teacher rows h_{i+s} of every counted query: [base, T-1)
    if base >= T - 1:
        return None
    # the teacher once per sequence (step s reads rows i + s), in float32 also under a bf16 autocast
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        t_logits_all = final[base : T - 1].float() @ head_weight.T.float()
        p_all = torch.softmax(t_logits_all, dim=-1)
        # -H(p), only the forward KL reads it
        neg_entropy_all = (p_all * torch.log(p_all.clamp_min(1e-30))).sum(-1) if divergence == "fkl" else None
    total, counted = None, False
    for s, (g, first) in enumerate(zip(out.hidden, out.first), start=1):
        n = first + g.shape[0]  # queries first .. n-1
        lo = max(first_query, first, 0)
        if lo >= n:
            continue
        g = g[lo - first :]
        rows = slice(lo + s - base, n + s - base)  # h_{i+s} for queries i = lo .. n-1
        p, t_logits = p_all[rows], t_logits_all[rows]
        # the draft logits in float32 also under a bf16 autocast: rounding logits of size ~10-20 to bf16 (steps of
        # 0.06-0.125) moves q by 3-6%, as much as the acceptance differences the loss has to resolve
        with torch.autocast("cpu", enabled=False):  # g itself is cast first: the norm keeps its input's dtype
            wide = torch.promote_types(g.dtype, torch.float32)
            logits = F.linear(norm(g.to(wide)), head_weight.to(wide))
        if divergence == "fkl":  # KL(p || q) = cross-entropy(p, q) - H(p): one fused soft-label cross-entropy
            div = F.cross_entropy(logits, p) + neg_entropy_all[rows].mean()
        else:  # TV(p, q) = 1 - sum_x min(p, q); its gradient flows through q where q < p
            div = 1.0 - torch.minimum(p, torch.softmax(logits, dim=-1)).sum(-1).mean()
        term = step_weights[s - 1] * div
        total = term if total is None else total + term
        counted = True
        if stats is not None:
            with torch.no_grad():
                log_z, argmax = teacher[0][lo + s : n + s], teacher[1][lo + s : n + s]
                p_full = (t_logits - log_z[:, None]).exp()  # full-vocabulary p on the draft vocabulary
                q = torch.softmax(logits.detach(), dim=-1)
                st = stats[s - 1]
                st.acceptance += float(torch.minimum(p_full, q).sum())
                st.top1 += float((argmax == vocab[q.argmax(-1)]).sum())
                st.count += int(g.shape[0])
    if not counted:
        return None
    return total / sum(step_weights)
