"""Differentiable forwards of SGLang draft architectures for Test-Time Speculation (plain torch).

SGLang's draft modules run fused kernels without autograd and need a ForwardBatch and KV pool, so TTS trains
a plain-torch re-implementation whose parameters alias SGLang's tensors: the updater's publish copies into
exactly the storage SGLang's CUDA graphs replay.

:class:`Eagle3LlamaStudent` covers ``LlamaForCausalLMEagle3`` (EAGLE-3, Li et al. 2025): fused target features
``fc(concat of the aux hidden states)``, one decoder layer whose attention reads ``[input_layernorm(embed(x)),
hidden_norm(h)]`` (width 2H) with the un-normalised ``h`` as residual, final norm and the draft's own LM head
over the hot vocabulary. Teacher-forced: every position sees the target's features (the first drafting step's
regime); the target's embedding is frozen (shared with the target), as is anything named ``embed_tokens``.
Tensor-parallel size 1 only (a TP shard would need its slice of the fused ``qkv_proj`` / ``gate_up_proj``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Eagle3LlamaStudent", "build_student"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype) * weight


def _rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the draft's RoPE (transformers' initialisers, so scaled variants match)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type != "default" and rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return inv_freq.float()
    theta = float((params or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Eagle3LlamaStudent:
    """Student of SGLang's ``LlamaForCausalLMEagle3`` draft (TP = 1).

    Args:
        draft_model: the serving draft module (``worker.draft_worker.draft_runner.model``); parameters read by
            name: ``model.fc.weight``, ``model.layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}
            .weight``, ``model.layers.0.self_attn.{qkv_proj,o_proj}.weight``, ``model.layers.0.mlp.
            {gate_up_proj,down_proj}.weight``, ``model.norm.weight``, ``lm_head.weight``,
            ``model.embed_tokens.weight``; ``hot_token_id`` (``[V_d]``) when the head is a hot vocabulary.
        config: its HF config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
            RoPE settings).
        params: ``full`` (all the draft's own layers) or ``lora`` (not supported here: raises).

    Raises:
        ValueError: a missing parameter, more than one decoder layer, a TP-sharded layout, or ``params="lora"``.
    """

    REQUIRED = (
        "model.fc.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
    )

    def __init__(self, draft_model: nn.Module, config, params: str = "full") -> None:
        if params != "full":
            raise ValueError("--tts-params lora is not supported for SGLang EAGLE-3 drafts yet; use --tts-params full")
        named = dict(draft_model.named_parameters())
        missing = [n for n in self.REQUIRED if n not in named]
        if missing:
            raise ValueError(f"TTS: the draft has no parameter(s) {missing}; not an EAGLE-3 Llama draft")
        if any(n.startswith("model.layers.1.") for n in named):
            raise ValueError("TTS: EAGLE-3 drafts with more than one decoder layer are not supported yet")
        self.config = config
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        hidden = int(config.hidden_size)
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // self.num_heads)
        qkv_rows = named["model.layers.0.self_attn.qkv_proj.weight"].shape[0]
        expected = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv_rows != expected:
            raise ValueError(f"TTS: qkv_proj has {qkv_rows} rows, expected {expected}: tensor parallelism > 1 is not supported")
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        # The aliasing module: Parameters sharing storage with SGLang's tensors (publishes write into them).
        self.module = nn.Module()
        self._names = {}
        for name in self.REQUIRED + ("model.embed_tokens.weight",):
            if name in named:
                key = name.replace(".", "__")
                self.module.register_parameter(key, nn.Parameter(named[name].data, requires_grad=False))
                self._names[name] = key
        hot = getattr(draft_model, "hot_token_id", None)
        self.draft_vocab = None if hot is None else torch.as_tensor(hot).to(torch.int64).reshape(-1)
        self.inv_freq = _rope_inv_freq(config, self.head_dim)
        if "model.embed_tokens.weight" not in self._names:
            raise ValueError("TTS: the draft has no model.embed_tokens.weight (shared target embedding expected)")

    def trainable(self, name: str, param: nn.Parameter) -> bool:
        """The draft's own layers; never the embedding (shared with the target)."""
        return "embed_tokens" not in name

    def refresh(self) -> None:
        """Nothing derived from the weights is cached for this architecture."""

    def _p(self, module: nn.Module, name: str) -> torch.Tensor:
        return getattr(module, self._names[name])

    def logits(self, module: nn.Module, features: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``features [N, T, 3H_t]`` (or ``[N, T, H]``), ``tokens [N, T]``, ``mask [N, T]`` -> ``[N, T, V_d]``."""
        p = lambda name: self._p(module, name)  # noqa: E731
        dtype = p("model.fc.weight").dtype
        embeds = F.embedding(tokens, p("model.embed_tokens.weight")).to(dtype)
        h = features.to(dtype)
        if h.shape[-1] != embeds.shape[-1]:
            h = F.linear(h, p("model.fc.weight"))
        residual = h
        x = torch.cat([_rms_norm(embeds, p("model.layers.0.input_layernorm.weight"), self.eps),
                       _rms_norm(h, p("model.layers.0.hidden_norm.weight"), self.eps)], dim=-1)
        n, t, _ = x.shape
        qkv = F.linear(x, p("model.layers.0.self_attn.qkv_proj.weight"))
        nq, nkv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        q = qkv[..., :nq].reshape(n, t, self.num_heads, d).transpose(1, 2)
        k = qkv[..., nq:nq + nkv].reshape(n, t, self.num_kv_heads, d).transpose(1, 2)
        v = qkv[..., nq + nkv:].reshape(n, t, self.num_kv_heads, d).transpose(1, 2)
        pos = torch.arange(t, device=x.device, dtype=torch.float32)
        angles = pos[:, None] * self.inv_freq.to(x.device)[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1).to(q.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1).to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & mask[:, None, None, :]
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)[None, None]  # padded rows stay finite
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0 / math.sqrt(d))
        attn = F.linear(attn.transpose(1, 2).reshape(n, t, nq), p("model.layers.0.self_attn.o_proj.weight"))
        h = attn + residual
        residual = h
        gate_up = F.linear(_rms_norm(h, p("model.layers.0.post_attention_layernorm.weight"), self.eps),
                           p("model.layers.0.mlp.gate_up_proj.weight"))
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, p("model.layers.0.mlp.down_proj.weight")) + residual
        return F.linear(_rms_norm(h, p("model.norm.weight"), self.eps), p("lm_head.weight")).float()


def build_student(draft_model: nn.Module, config, params: str = "full"):
    """The student for ``draft_model``'s architecture.

    Raises:
        ValueError: an architecture without a student (message lists the supported ones).
    """
    arch = type(draft_model).__name__
    if arch == "LlamaForCausalLMEagle3" or "model.layers.0.hidden_norm.weight" in dict(draft_model.named_parameters()):
        return Eagle3LlamaStudent(draft_model, config, params)
    raise ValueError(f"TTS has no training forward for the draft architecture {arch}; supported: LlamaForCausalLMEagle3")
