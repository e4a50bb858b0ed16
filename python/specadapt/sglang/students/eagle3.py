"""Student of SGLang's ``LlamaForCausalLMEagle3`` draft (EAGLE-3, Li et al. 2025), any tensor parallelism.

Fused target features ``fc(concat of the aux hidden states)`` (optionally normalised first: ``norm_before_fc``,
per-feature ``fc_norm``), one decoder layer whose attention reads
``[input_layernorm(embed(x)), hidden_norm(h)]`` (width 2H) with the un-normalised ``h`` as residual, final norm
and the draft's own LM head over the hot vocabulary. Teacher-forced: every position sees the target's features
(the first drafting step's regime). The target's embedding (shared with the target) is never trained.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import StudentWeights, TokenStudent, attention, qkv_layout, rms_norm, rope_parameters, vocab_layout
from .sharding import Layout

__all__ = ["Eagle3LlamaStudent"]


class Eagle3LlamaStudent(TokenStudent):
    """Differentiable forward of SGLang's EAGLE-3 Llama draft over its own tensors.

    Args:
        draft_model: the serving draft module (``worker.draft_worker.draft_runner.model``); parameters read by
            name: ``model.fc.weight``, ``model.layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}
            .weight``, ``model.layers.0.self_attn.{qkv_proj,o_proj}.weight``, ``model.layers.0.mlp.
            {gate_up_proj,down_proj}.weight``, ``model.norm.weight``, ``lm_head.weight``,
            ``model.embed_tokens.weight``; ``hot_token_id`` (``[V_d]``) when the head is a hot vocabulary.
        config: its HF config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
            RoPE settings).
        params: ``full`` (the draft's own layers, LM head and norms train; publishes copy in place) or ``lora``
            (rank-``lora_rank`` adapters on ``fc`` and the layer's four projections; publishes merge them).
        lora_rank: adapter rank for ``params="lora"``.
        tp: this rank's :class:`~.sharding.TensorParallel` (``None``: TP 1): the student gathers full tensors and
            publishes this rank's shards.

    Raises:
        ValueError: a missing parameter, more than one decoder layer, shards that do not match the heads and TP
            size, or a bad ``params``.
    """

    uses_features = True
    REQUIRED = (
        "model.fc.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
    )
    ADAPTED = ("model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
               "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight")

    def __init__(self, draft_model: nn.Module, config, params: str = "full", lora_rank: int = 8, tp=None) -> None:
        named = dict(draft_model.named_parameters())
        missing = [n for n in self.REQUIRED + ("model.embed_tokens.weight",) if n not in named]
        if missing:
            raise ValueError(f"TTS: the draft has no parameter(s) {missing}; not an EAGLE-3 Llama draft")
        if any(n.startswith("model.layers.1.") for n in named):
            raise ValueError("TTS: EAGLE-3 drafts with more than one decoder layer are not supported yet")
        # optional pieces of SGLang's LlamaForCausalLMEagle3: a norm over the concatenated features before fc
        # (norm_before_fc), per-feature norms (fc_norm / use_aux_norm), an fc bias
        self.optional = tuple(n for n in named if n == "model.input_norm.weight" or n == "model.fc.bias"
                              or n.startswith("model.fc_norm."))
        unknown = sorted(set(named) - set(self.REQUIRED) - {"model.embed_tokens.weight"} - set(self.optional))
        if unknown:
            raise ValueError(f"TTS: the EAGLE-3 student does not know the draft parameter(s) {unknown[:5]}")
        self.fc_norms = sorted((n for n in self.optional if n.startswith("model.fc_norm.")),
                               key=lambda n: int(n.split(".")[2]))
        self.config = config
        qkv = qkv_layout(config, named["model.layers.0.self_attn.qkv_proj.weight"], tp)
        self.num_heads, self.num_kv_heads, self.head_dim = qkv.heads, qkv.kv_heads, qkv.head_dim
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        pre = "model.layers.0."
        layouts = {pre + "self_attn.qkv_proj.weight": qkv, pre + "self_attn.o_proj.weight": Layout("cols"),
                   pre + "mlp.gate_up_proj.weight": Layout("merged"), pre + "mlp.down_proj.weight": Layout("cols"),
                   "model.embed_tokens.weight": vocab_layout(getattr(getattr(draft_model, "model", None),
                                                                    "embed_tokens", None)),
                   "lm_head.weight": vocab_layout(getattr(draft_model, "lm_head", None))}
        self.weights = StudentWeights(named, self.REQUIRED + ("model.embed_tokens.weight",) + self.optional,
                                      self.ADAPTED, params, lora_rank, tp=tp, layouts=layouts)
        self.module = self.weights.module
        # SGLang points the draft's head at the target's when the checkpoint has no draft_vocab_size
        self.head_shared = bool(getattr(draft_model, "load_lm_head_from_target", False))
        hot = getattr(draft_model, "hot_token_id", None)
        self.draft_vocab = None if hot is None else torch.as_tensor(hot).to(torch.int64).reshape(-1)
        # the head's rows are padded to a multiple of 64 (and TP); logits keep the draft's own ids
        self.vocab_size = (int(self.draft_vocab.numel()) if self.draft_vocab is not None
                           else int(getattr(config, "draft_vocab_size", None) or config.vocab_size))
        self.inv_freq, self.rope_scale = rope_parameters(config, self.head_dim)
        self.weights.set_trained(self.trainable)

    def trainable(self, name: str, param: nn.Parameter) -> bool:
        """LoRA: the adapters. Full: the draft's own tensors, never the embedding (shared with the target) nor an
        LM head borrowed from the target (a checkpoint without ``draft_vocab_size``)."""
        if self.weights.params == "lora":
            return self.weights.is_adapter(name)
        if name.startswith("lm_head__") and self.head_shared:
            return False
        return not name.startswith(("base__", "lora_")) and "embed_tokens" not in name

    def refresh(self) -> None:
        """After a publish / rollback: merge LoRA adapters into the serving weights (nothing to do for full)."""
        self.weights.refresh()

    def logits(self, module: nn.Module, features: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``features [N, T, 3H_t]`` (or ``[N, T, H]``), ``tokens [N, T]``, ``mask [N, T]`` -> ``[N, T, V_d]``."""
        w = self.weights
        p = lambda name: w.get(module, name)  # noqa: E731
        dtype = p("model.fc.weight").dtype
        embeds = F.embedding(tokens, p("model.embed_tokens.weight")).to(dtype)
        h = features.to(dtype)
        if h.shape[-1] != embeds.shape[-1]:
            if "model.input_norm.weight" in self.optional:
                h = rms_norm(h, p("model.input_norm.weight"), self.eps)
            if self.fc_norms:
                chunks = h.chunk(len(self.fc_norms), dim=-1)
                h = torch.cat([rms_norm(c, p(n), self.eps) for c, n in zip(chunks, self.fc_norms)], dim=-1)
            h = w.linear(module, "model.fc.weight", h, "model.fc.bias" if "model.fc.bias" in self.optional else None)
        residual = h
        x = torch.cat([rms_norm(embeds, p("model.layers.0.input_layernorm.weight"), self.eps),
                       rms_norm(h, p("model.layers.0.hidden_norm.weight"), self.eps)], dim=-1)
        n, t, _ = x.shape
        qkv = w.linear(module, "model.layers.0.self_attn.qkv_proj.weight", x)
        nq, nkv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        q = qkv[..., :nq].reshape(n, t, self.num_heads, d)
        k = qkv[..., nq:nq + nkv].reshape(n, t, self.num_kv_heads, d)
        v = qkv[..., nq + nkv:].reshape(n, t, self.num_kv_heads, d)
        attn = attention(q, k, v, mask, self.inv_freq, rope_scale=self.rope_scale)
        h = w.linear(module, "model.layers.0.self_attn.o_proj.weight", attn) + residual
        residual = h
        gate_up = w.linear(module, "model.layers.0.mlp.gate_up_proj.weight",
                           rms_norm(h, p("model.layers.0.post_attention_layernorm.weight"), self.eps))
        gate, up = gate_up.chunk(2, dim=-1)
        h = w.linear(module, "model.layers.0.mlp.down_proj.weight", F.silu(gate) * up) + residual
        logits = F.linear(rms_norm(h, p("model.norm.weight"), self.eps), p("lm_head.weight"))
        return logits[..., : self.vocab_size].float()
