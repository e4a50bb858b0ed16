"""Student of SGLang's plain ``DFlashDraftModel`` (DFLASH block-diffusion draft), tensor parallelism 1.

A DFLASH draft predicts a whole block at once. The target's hidden states of the committed tokens (``K_f``
target layers concatenated) become the draft's context: ``ctx = hidden_norm(fc(features))``, and every layer
reads that same ``ctx`` as keys / values (``k_norm``, RoPE at the context positions; no input norm). The block
``[bonus, mask, ..., mask]`` (target embedding) runs through the layers with queries attending to all context
tokens and bidirectionally to the whole block (SGLang's ENCODER_ONLY attention); the final norm and the
target's LM head give the logits. Block position ``j`` predicts the token at that position (no shift), so
positions ``1..S-1`` are the drafts. The target's embedding and LM head are shared and never trained.

Only the plain architecture trains; variants that change the math (grouped convolutions, the Domino
projector, selector / DFlash2 / LiLiCorr heads, Laguna, Nemotron embeddings, Gemma norms, attention sinks,
value scale, causal or sliding layers, attention bias, non-neox RoPE) are refused with the reason.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...tts import TTSExample
from ._common import SGLangStudent, StudentWeights, qkv_layout, rms_norm, rope_parameters, rotate

__all__ = ["DFlashStudent"]

_LAYER_PARAMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def _refuse(config, draft_model) -> None:
    dflash = getattr(config, "dflash_config", None) or {}
    get = (dflash.get if isinstance(dflash, dict) else lambda k, d=None: getattr(dflash, k, d))
    reasons = []
    for key in ("conv_kernel_size", "selector_rank", "selector_top_k", "attention_sink_bias", "attention_value_scale"):
        if get(key) or getattr(config, key, None):
            reasons.append(key)
    if (get("projector_type") or getattr(config, "projector_type", None)) not in (None, "", "mlp", "default"):
        reasons.append(f"projector_type={get('projector_type') or getattr(config, 'projector_type', None)}")
    for key in ("use_gemma_norm", "attention_bias"):
        if getattr(config, key, False):
            reasons.append(key)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        reasons.append("sliding / non-full layer_types")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "is_causal", None):
        reasons.append("is_causal")
    if not bool(getattr(config, "rope_is_neox_style", getattr(config, "is_neox_style", True))):
        reasons.append("non-neox RoPE")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        reasons.append("partial_rotary_factor")
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if isinstance(scaling, dict) and "rope_dim" in scaling:
        reasons.append("rope_scaling.rope_dim")
    if getattr(config, "hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act={config.hidden_act}")
    if getattr(draft_model, "embed_tokens", None) is not None:
        reasons.append("its own embedding (Nemotron)")
    if reasons:
        raise ValueError(f"TTS: the DFLASH student trains the plain DFlashDraftModel only; this draft has "
                         f"{', '.join(reasons)}")


class DFlashStudent(SGLangStudent):
    """Differentiable forward of SGLang's plain ``DFlashDraftModel``.

    Args:
        draft_model: the serving draft (``DFlashWorkerV2.draft_model``), parameters named ``fc.weight``,
            ``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.{input_layernorm,post_attention_layernorm}
            .weight``, ``layers.{i}.self_attn.{qkv_proj,o_proj,q_norm,k_norm}.weight``, ``layers.{i}.mlp.
            {gate_up_proj,down_proj}.weight``.
        config: its HF config (heads, ``head_dim``, ``rms_norm_eps``, RoPE settings, ``vocab_size``).
        embed_weight: ``[V, H]`` the target's input embedding (shared, frozen).
        lm_head_weight: ``[V', H]`` the target's LM head (shared, frozen; rows past ``vocab_size`` are padding).
        params: ``full`` (the draft's own layers, ``fc`` and norms) or ``lora`` (adapters on ``fc`` and every
            layer's four projections); lora_rank: adapter rank.
        on_refresh: called after every publish (SGLang's fused context-KV helper keeps copies of the K/V
            weights and K norms; the hook rebuilds it).

    Raises:
        ValueError: another DFLASH variant (see the module docstring), a missing or unknown parameter, or
            shapes that are not the configured heads (tensor parallelism > 1 is not supported).
    """

    uses_features = True
    draft_vocab = None

    def __init__(self, draft_model: nn.Module, config, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 params: str = "full", lora_rank: int = 8, on_refresh=None) -> None:
        if type(draft_model).__name__ not in ("DFlashDraftModel", "MuseGlimmerAssistantModel"):
            raise ValueError(f"TTS: no student for the DFLASH draft class {type(draft_model).__name__}; the plain "
                             "DFlashDraftModel only")
        _refuse(config, draft_model)
        named = dict(draft_model.named_parameters())
        layers = sorted({int(n.split(".")[1]) for n in named if n.startswith("layers.")})
        self.num_layers = len(layers)
        if layers != list(range(self.num_layers)) or not layers:
            raise ValueError(f"TTS: the DFLASH draft's layers are not 0..N-1 (found {layers[:8]})")
        names = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
            f"layers.{i}.{p}" for i in range(self.num_layers) for p in _LAYER_PARAMS]
        missing = [n for n in names if n not in named]
        unknown = sorted(set(named) - set(names))
        if missing or unknown:
            raise ValueError(f"TTS: the DFLASH student does not match this draft (missing {missing[:4]}, "
                             f"unknown {unknown[:4]})")
        self.config = config
        qkv = qkv_layout(config, named["layers.0.self_attn.qkv_proj.weight"])  # TP 1 only for DFLASH
        self.num_heads, self.num_kv_heads, self.head_dim = qkv.heads, qkv.kv_heads, qkv.head_dim
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.vocab_size = int(config.vocab_size)
        if embed_weight.shape[0] < self.vocab_size or lm_head_weight.shape[0] < self.vocab_size:
            raise ValueError(f"TTS: the target's embedding / LM head have {embed_weight.shape[0]} / "
                             f"{lm_head_weight.shape[0]} rows for a {self.vocab_size}-token vocabulary (a vocab "
                             "shard: DFLASH TTS needs tensor parallelism 1)")
        shared = {"embed.weight": embed_weight, "lm_head.weight": lm_head_weight}
        adapted = ["fc.weight"] + [f"layers.{i}.{p}" for i in range(self.num_layers)
                                   for p in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                             "mlp.gate_up_proj.weight", "mlp.down_proj.weight")]
        self.weights = StudentWeights({**named, **shared}, names + list(shared), adapted, params, lora_rank)
        self.module = self.weights.module
        self.inv_freq, self.rope_scale = rope_parameters(config, self.head_dim)
        self.on_refresh = on_refresh
        self.weights.set_trained(self.trainable)

    def trainable(self, name: str, param: nn.Parameter) -> bool:
        """LoRA: the adapters. Full: the draft's own tensors, never the target's embedding / LM head."""
        if self.weights.params == "lora":
            return self.weights.is_adapter(name)
        return not name.startswith(("base__", "lora_", "embed__", "lm_head__"))

    def refresh(self) -> None:
        """After a publish / rollback: merge LoRA adapters, then let SGLang rebuild its weight copies."""
        self.weights.refresh()
        if self.on_refresh is not None:
            self.on_refresh()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [N, heads, T, D]`` rotated at ``positions [N, T]`` (neox layout)."""
        angles = positions.float()[..., None] * self.inv_freq.to(x.device)  # [N, T, D/2]
        cos = (torch.cat([angles.cos(), angles.cos()], -1)[:, None] * self.rope_scale).to(x.dtype)
        sin = (torch.cat([angles.sin(), angles.sin()], -1)[:, None] * self.rope_scale).to(x.dtype)
        return rotate(x, cos, sin)

    def block_logits(self, module: nn.Module, features: torch.Tensor, context_mask: torch.Tensor,
                     block_tokens: torch.Tensor) -> torch.Tensor:
        """The draft's logits over one block per row.

        Args:
            features: ``[N, C, K_f*H]`` the target features of each row's committed context (left-aligned).
            context_mask: ``[N, C]`` bool, valid context entries (row n has ``c_n`` of them at positions
                ``0..c_n-1``; its block sits at ``c_n .. c_n+S-1``: RoPE is relative, so offsets cancel).
            block_tokens: ``[N, S]`` int64 ``[bonus, mask, ..., mask]``.

        Returns:
            ``[N, S, V]`` float32; position ``j`` predicts the block's token ``j``.
        """
        w = self.weights
        p = lambda name: w.get(module, name)  # noqa: E731
        n, c = context_mask.shape
        s = block_tokens.shape[1]
        dtype = p("fc.weight").dtype
        ctx = rms_norm(w.linear(module, "fc.weight", features.to(dtype)), p("hidden_norm.weight"), self.eps)
        ctx_pos = torch.arange(c, device=ctx.device)[None].expand(n, c)
        block_pos = context_mask.sum(1, keepdim=True) + torch.arange(s, device=ctx.device)[None]
        allowed = torch.cat([context_mask, torch.ones(n, s, dtype=torch.bool, device=ctx.device)], 1)
        allowed = allowed[:, None, None, :]  # every block query sees the valid context and the whole block
        h = F.embedding(block_tokens, p("embed.weight")).to(dtype)
        nq, nkv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        heads = lambda t, k: t.reshape(n, t.shape[1], k, d).transpose(1, 2)  # noqa: E731
        residual = None
        for i in range(self.num_layers):
            pre = f"layers.{i}."
            residual = h if residual is None else h + residual
            x = rms_norm(residual, p(pre + "input_layernorm.weight"), self.eps)
            qkv = w.linear(module, pre + "self_attn.qkv_proj.weight", x)
            q, k, v = heads(qkv[..., :nq], self.num_heads), heads(qkv[..., nq:nq + nkv], self.num_kv_heads), \
                heads(qkv[..., nq + nkv:], self.num_kv_heads)
            q = self._rope(rms_norm(q, p(pre + "self_attn.q_norm.weight"), self.eps), block_pos)
            k = self._rope(rms_norm(k, p(pre + "self_attn.k_norm.weight"), self.eps), block_pos)
            ckv = w.linear(module, pre + "self_attn.qkv_proj.weight", ctx)[..., nq:]  # context: K/V only
            ck, cv = heads(ckv[..., :nkv], self.num_kv_heads), heads(ckv[..., nkv:], self.num_kv_heads)
            ck = self._rope(rms_norm(ck, p(pre + "self_attn.k_norm.weight"), self.eps), ctx_pos)
            keys, values = torch.cat([ck, k], 2), torch.cat([cv, v], 2)
            if self.num_kv_heads != self.num_heads:
                rep = self.num_heads // self.num_kv_heads
                keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=1.0 / math.sqrt(d))
            attn = w.linear(module, pre + "self_attn.o_proj.weight", attn.transpose(1, 2).reshape(n, s, nq))
            residual = residual + attn
            x = rms_norm(residual, p(pre + "post_attention_layernorm.weight"), self.eps)
            gate, up = w.linear(module, pre + "mlp.gate_up_proj.weight", x).chunk(2, dim=-1)
            h = w.linear(module, pre + "mlp.down_proj.weight", F.silu(gate) * up)
        h = rms_norm(h + residual, p("norm.weight"), self.eps)
        return F.linear(h, p("lm_head.weight"))[..., : self.vocab_size].float()

    def example_logits(self, module: nn.Module, examples: Sequence[TTSExample]) -> torch.Tensor:
        """Examples of ``features [C, K_f*H]`` context and ``tokens [S]`` block, padded into one
        :meth:`block_logits` pass: ``[N, S - 1, V]``, the outputs at the block's drafts."""
        n = len(examples)
        ref = examples[0]
        device = ref.teacher.device
        width = max(ex.features.shape[0] for ex in examples)
        feats = ref.features.new_zeros(n, width, ref.features.shape[-1])
        mask = torch.zeros(n, width, dtype=torch.bool, device=device)
        blocks = torch.stack([ex.tokens for ex in examples]).to(device)
        for i, ex in enumerate(examples):
            c = ex.features.shape[0]
            feats[i, :c], mask[i, :c] = ex.features, True
        return self.block_logits(module, feats, mask, blocks)[:, 1:]  # outputs at the drafts
