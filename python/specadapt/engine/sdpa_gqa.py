"""Grouped-query SDPA for :class:`~specadapt.engine.kv.RaggedKVCache` forwards, chosen per call and per thread.

With an explicit attention mask, transformers' SDPA attention repeats every key / value head to every query head
(``repeat_kv``: an O(T) copy per layer per forward) unless ``TRANSFORMERS_SDPA_FORCE_GQA=1`` is in the process
environment; torch's CPU SDPA takes grouped-query attention directly. Setting that variable around each forward
is not thread-safe (the Test-Time Speculation trainer thread runs forwards of the draft meanwhile) and leaks into
every other model. Instead the cache's forward selects :data:`ATTENTION_NAME` for its model and sets the explicit
flag of :func:`grouped_query` for its own thread only; :func:`gqa_sdpa_attention` then calls torch's SDPA with
``enable_gqa=True`` exactly as transformers' SDPA would under the variable, and on any other call (another
thread, no mask, no GQA) is transformers' own SDPA attention unchanged.

This module is part of the adapter layer (it registers into transformers); techniques never import it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["ATTENTION_NAME", "gqa_sdpa_attention", "grouped_query", "register"]

ATTENTION_NAME = "specadapt_sdpa_gqa"

_FORCE: contextvars.ContextVar[bool] = contextvars.ContextVar("specadapt_sdpa_gqa", default=False)


@contextlib.contextmanager
def grouped_query(enabled: bool = True):
    """Within the block, :func:`gqa_sdpa_attention` runs grouped-query SDPA for this thread (context) only."""
    token = _FORCE.set(bool(enabled))
    try:
        yield
    finally:
        _FORCE.reset(token)


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """Transformers' SDPA attention; inside :func:`grouped_query` with an explicit mask and grouped key / value
    heads, torch's SDPA with ``enable_gqa=True`` (no ``repeat_kv`` copy).

    Args and returns: those of ``transformers.integrations.sdpa_attention.sdpa_attention_forward``
    (``query [B, H, n, D]``, ``key`` / ``value [B, Hkv, T, D]``, ``attention_mask [B, 1, n, T]`` or ``None``)
    -> ``(output [B, n, H, D], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (
        not _FORCE.get()
        or attention_mask is None
        or getattr(module, "num_key_value_groups", 1) <= 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # transformers' path with use_gqa_in_sdpa() true: an explicit mask means is_causal=False, no cropping
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`gqa_sdpa_attention` with transformers as :data:`ATTENTION_NAME` (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, gqa_sdpa_attention)
