"""Student of a STANDALONE draft: a small dense decoder-only LM (SGLang's ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``, e.g. Qwen3-0.6B drafting for Qwen3-8B),
any tensor parallelism (:mod:`.sharding`).

The draft shares nothing with the target and reads no target features: the student is the model's own causal
LM forward over the request's recent committed tokens (``--tts-context-window``) and the round's verified
tokens, in SGLang's fused layout (``qkv_proj`` = rows of q, k, v; ``gate_up_proj`` = rows of gate, up), with
the optional pieces of the family (q/k/v biases of Qwen2, per-head q/k RMSNorm of Qwen3, tied embeddings).
What trains is what the embedded engine's standalone drafts train: the decoder layers (``--tts-params full``,
norms inside the layers included) or LoRA adapters on their four projections (``--tts-params lora``, the
lighter choice for a draft of this size); the embedding, final norm and LM head stay frozen.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ._common import StudentWeights, TokenStudent, attention, qkv_layout, rms_norm, rope_parameters, vocab_layout
from .sharding import Layout

__all__ = ["DenseLMStudent", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_LAYER_PARAM = re.compile(
    r"model\.layers\.(\d+)\.(input_layernorm\.weight|post_attention_layernorm\.weight|"
    r"self_attn\.(?:qkv_proj|o_proj)\.(?:weight|bias)|self_attn\.(?:q_norm|k_norm)\.weight|"
    r"mlp\.(?:gate_up_proj|down_proj)\.(?:weight|bias))$"
)


class DenseLMStudent(TokenStudent):
    """Differentiable forward of a STANDALONE dense draft LM over its own tensors.

    Args:
        draft_model: the serving draft module (``worker.draft_worker.draft_runner.model``), parameters named as
            SGLang names them: ``model.embed_tokens.weight``, ``model.layers.{i}.{input_layernorm,
            post_attention_layernorm}.weight``, ``model.layers.{i}.self_attn.{qkv_proj,o_proj}.weight`` (biases
            optional), ``model.layers.{i}.self_attn.{q_norm,k_norm}.weight`` (Qwen3), ``model.layers.{i}.mlp.
            {gate_up_proj,down_proj}.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent when tied).
        config: its HF config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``,
            ``rms_norm_eps``, ``vocab_size``, ``hidden_act``, RoPE settings).
        params: ``full`` or ``lora``; lora_rank: adapter rank.
        tp: this rank's :class:`~.sharding.TensorParallel` (``None``: TP 1).

    Raises:
        ValueError: an unsupported architecture or activation, a parameter the student does not know (MoE
            experts, extra norms), a missing one, or shards that do not match the heads and TP size.
    """

    uses_features = False

    def __init__(self, draft_model: nn.Module, config, params: str = "full", lora_rank: int = 8, tp=None) -> None:
        arch = type(draft_model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"TTS: no student for the STANDALONE draft architecture {arch}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"TTS: the draft's hidden_act is {act!r}; the student implements SwiGLU (silu) only")
        named = dict(draft_model.named_parameters())
        layers = sorted({int(m.group(1)) for n in named if (m := _LAYER_PARAM.match(n))})
        unknown = [n for n in named if n.startswith("model.layers.") and not _LAYER_PARAM.match(n)]
        if unknown:
            raise ValueError(f"TTS: the STANDALONE student does not know the draft parameter(s) {unknown[:5]} "
                             "(MoE or a variant layer); only dense Llama / Mistral / Qwen2 / Qwen3 drafts train")
        if not layers or layers != list(range(len(layers))):
            raise ValueError(f"TTS: the draft's decoder layers are not 0..N-1 (found {layers[:8]})")
        self.num_layers = len(layers)
        self.tied = "lm_head.weight" not in named
        head = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        required = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if self.tied else ["lm_head.weight"])
        for i in range(self.num_layers):
            required += [f"model.layers.{i}.{s}" for s in (
                "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")]
        missing = [n for n in required if n not in named]
        if missing:
            raise ValueError(f"TTS: the draft has no parameter(s) {missing[:5]}")
        self.config = config
        qkv = qkv_layout(config, named["model.layers.0.self_attn.qkv_proj.weight"], tp)
        self.num_heads, self.num_kv_heads, self.head_dim = qkv.heads, qkv.kv_heads, qkv.head_dim
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.vocab_size = int(getattr(config, "vocab_size", None) or named[head].shape[0])
        self.head = head
        names = sorted({n for n in named if _LAYER_PARAM.match(n)} | set(required))
        adapted = [f"model.layers.{i}.{s}.weight" for i in range(self.num_layers)
                   for s in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
        layouts = {"model.embed_tokens.weight": vocab_layout(getattr(getattr(draft_model, "model", None),
                                                                     "embed_tokens", None)),
                   "lm_head.weight": vocab_layout(getattr(draft_model, "lm_head", None))}
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            layouts.update({pre + "self_attn.qkv_proj.weight": qkv, pre + "self_attn.qkv_proj.bias": qkv,
                            pre + "self_attn.o_proj.weight": Layout("cols"),
                            pre + "mlp.gate_up_proj.weight": Layout("merged"),
                            pre + "mlp.gate_up_proj.bias": Layout("merged"),
                            pre + "mlp.down_proj.weight": Layout("cols")})
        self.weights = StudentWeights(named, names, adapted, params, lora_rank, tp=tp, layouts=layouts)
        self.module = self.weights.module
        self.draft_vocab = None
        self.inv_freq, self.rope_scale = rope_parameters(config, self.head_dim)
        self._has = set(names)
        self.weights.set_trained(self.trainable)

    def trainable(self, name: str, param: nn.Parameter) -> bool:
        """LoRA: the adapters. Full: the decoder layers (embedding, final norm and LM head stay frozen)."""
        if self.weights.params == "lora":
            return self.weights.is_adapter(name)
        return name.startswith("model__layers__")

    def refresh(self) -> None:
        """After a publish / rollback: merge LoRA adapters into the serving weights (nothing to do for full)."""
        self.weights.refresh()

    def _opt(self, name: str) -> str | None:
        return name if name in self._has else None

    def logits(self, module: nn.Module, features: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``tokens [N, T]`` int64, ``mask [N, T]`` bool (left-aligned valid inputs) -> ``[N, T, vocab_size]``
        float32 next-token logits; ``features`` is ignored (a STANDALONE draft reads no target features)."""
        w = self.weights
        p = lambda name: w.get(module, name)  # noqa: E731
        n, t = tokens.shape
        h = F.embedding(tokens, p("model.embed_tokens.weight"))
        nq, nkv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            residual = h
            x = rms_norm(h, p(pre + "input_layernorm.weight"), self.eps)
            qkv = w.linear(module, pre + "self_attn.qkv_proj.weight", x, self._opt(pre + "self_attn.qkv_proj.bias"))
            q = qkv[..., :nq].reshape(n, t, self.num_heads, d)
            k = qkv[..., nq:nq + nkv].reshape(n, t, self.num_kv_heads, d)
            v = qkv[..., nq + nkv:].reshape(n, t, self.num_kv_heads, d)
            q_norm = k_norm = None
            if pre + "self_attn.q_norm.weight" in self._has:
                qw, kw = p(pre + "self_attn.q_norm.weight"), p(pre + "self_attn.k_norm.weight")
                q_norm = lambda z, qw=qw: rms_norm(z, qw, self.eps)  # noqa: E731
                k_norm = lambda z, kw=kw: rms_norm(z, kw, self.eps)  # noqa: E731
            attn = attention(q, k, v, mask, self.inv_freq, q_norm, k_norm, rope_scale=self.rope_scale)
            h = residual + w.linear(module, pre + "self_attn.o_proj.weight", attn, self._opt(pre + "self_attn.o_proj.bias"))
            residual = h
            x = rms_norm(h, p(pre + "post_attention_layernorm.weight"), self.eps)
            gate, up = w.linear(module, pre + "mlp.gate_up_proj.weight", x,
                                self._opt(pre + "mlp.gate_up_proj.bias")).chunk(2, dim=-1)
            h = residual + w.linear(module, pre + "mlp.down_proj.weight", F.silu(gate) * up,
                                    self._opt(pre + "mlp.down_proj.bias"))
        h = rms_norm(h, p("model.norm.weight"), self.eps)
        return F.linear(h, p(self.head))[..., : self.vocab_size].float()
