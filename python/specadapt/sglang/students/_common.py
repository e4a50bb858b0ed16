"""Pieces every student shares: the plugin's student protocol :class:`SGLangStudent` (the technique's
:class:`specadapt.tts.Student` plus what snapshots need), :class:`TokenStudent` (examples of context-then-round
tokens and features, EAGLE-3 and STANDALONE), RMSNorm, RoPE, causal attention over left-aligned padded rows, and
:class:`StudentWeights` -- the student's view of the serving draft's tensors, either aliased (``--tts-params
full``: training updates them directly, publishes copy in place) or frozen behind low-rank adapters
(``--tts-params lora``: publishes merge ``W0 + (alpha / r) B A`` into them in place).

Plain torch (no sglang import); the RoPE initialisers come from transformers so scaled variants (llama3, yarn)
match the serving model.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from ...tts import Student, TTSExample

__all__ = ["SGLangStudent", "StudentWeights", "TokenStudent", "attention", "rms_norm", "rope_inv_freq", "qkv_layout",
           "rope_parameters", "rotate", "vocab_layout"]


@runtime_checkable
class SGLangStudent(Student, Protocol):
    """A :class:`specadapt.tts.Student` of an SGLang draft; ``module`` holds parameters that alias the serving
    draft's tensors (publishes land in the storage SGLang's CUDA graphs replay).

    Attributes:
        uses_features: whether the student reads target features (EAGLE-3: aux hidden states, DFLASH: context
            features; STANDALONE: none, so snapshots keep none).
        vocab_size: ``V_d``, the draft's output rows (a wider, padded target vocabulary is cut to it).
    """

    uses_features: bool
    vocab_size: int


class TokenStudent(SGLangStudent):
    """A student whose examples are ``tokens [T]`` / ``features [T, H]`` (context then the round, left-aligned)
    and whose :meth:`logits` predicts the next token at every input: EAGLE-3 and STANDALONE drafts."""

    def logits(self, module: nn.Module, features: torch.Tensor, tokens: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """``features [N, T, H]`` (target feature of the token before each input), ``tokens [N, T]`` int64,
        ``mask [N, T]`` bool (valid inputs, left-aligned) -> ``[N, T, V_d]`` float32 next-token logits."""
        raise NotImplementedError

    def example_logits(self, module: nn.Module, examples: Sequence[TTSExample]) -> torch.Tensor:
        """Pad the examples' inputs, run :meth:`logits` once, keep each row's last ``C`` valid positions (the
        round's drafts): ``[N, C_max, V_d]``."""
        n = len(examples)
        width = max(ex.teacher.shape[0] for ex in examples)
        length = max(ex.tokens.shape[0] for ex in examples)
        ref = examples[0]
        device = ref.teacher.device
        feats = ref.features.new_zeros(n, length, ref.features.shape[-1])
        tokens = torch.zeros(n, length, dtype=torch.int64, device=device)
        mask = torch.zeros(n, length, dtype=torch.bool, device=device)
        num = torch.zeros(n, dtype=torch.int64, device=device)
        for i, ex in enumerate(examples):
            t = ex.tokens.shape[0]
            feats[i, :t] = ex.features
            tokens[i, :t] = ex.tokens
            mask[i, :t] = True
            num[i] = ex.teacher.shape[0]
        logits = self.logits(module, feats, tokens, mask)  # [n, length, V_d]
        # the round's C positions are the last C valid inputs of each row
        ends = mask.sum(1)
        index = (ends[:, None] - num[:, None] + torch.arange(width, device=device)[None, :]).clamp_min(0)
        return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to ``weight``'s dtype (Llama / Qwen convention)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype) * weight


def rope_parameters(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``([head_dim / 2]`` float32 inverse RoPE frequencies, attention factor) of ``config`` -- transformers'
    initialisers, so the scaled variants match (YaRN / longrope scale cos and sin by the factor, as SGLang's
    rotary embeddings do; 1.0 otherwise). ``partial_rotary_factor`` / ``rope_dim`` are not supported."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type != "default" and rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return inv_freq.float(), float(factor or 1.0)
    theta = float((params or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """The inverse frequencies of :func:`rope_parameters`."""
    return rope_parameters(config, head_dim)[0]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout (Llama / Qwen)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, inv_freq: torch.Tensor,
              q_norm=None, k_norm=None, rope_scale: float = 1.0) -> torch.Tensor:
    """Causal GQA attention with RoPE over left-aligned padded rows.

    Args:
        q: ``[N, T, Hq, D]``; k, v: ``[N, T, Hkv, D]`` (``Hq`` a multiple of ``Hkv``).
        mask: ``[N, T]`` bool, valid inputs (left-aligned); padded rows attend to themselves only (finite).
        inv_freq: ``[D / 2]`` RoPE inverse frequencies; positions are ``0..T-1`` (RoPE is relative, so the
            window's absolute offset does not change the scores).
        q_norm, k_norm: per-head RMSNorm callables applied before RoPE (Qwen3), or ``None``.
        rope_scale: the RoPE attention factor (cos and sin are scaled by it: YaRN / longrope).

    Returns:
        ``[N, T, Hq * D]``.
    """
    n, t, heads, d = q.shape
    kv_heads = k.shape[2]
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    pos = torch.arange(t, device=q.device, dtype=torch.float32)
    angles = pos[:, None] * inv_freq.to(q.device)[None, :]
    cos = (torch.cat([angles.cos(), angles.cos()], -1) * rope_scale).to(q.dtype)
    sin = (torch.cat([angles.sin(), angles.sin()], -1) * rope_scale).to(q.dtype)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if kv_heads != heads:
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & mask[:, None, None, :]
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=q.device)[None, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0 / math.sqrt(d))
    return out.transpose(1, 2).reshape(n, t, heads * d)


def _key(name: str) -> str:
    return name.replace(".", "__")


class StudentWeights:
    """The student's parameters over the serving draft's tensors.

    ``module`` (an ``nn.Module``, what :class:`specadapt.tts.TTSUpdater` copies and trains) holds, for every
    name in ``names``, a frozen Parameter: with tensor parallelism 1 it shares storage with the serving tensor;
    with ``tp.size > 1`` it is the full tensor gathered from every rank's shard (:mod:`.sharding`). With
    ``params="lora"`` it also holds, for every name in ``adapted`` (2-D weights ``[out, in]``), a frozen copy of
    the original full weight ``W0`` and float32 adapters ``A [r, in]`` (Kaiming-uniform) and ``B [out, r]``
    (zeros, so the student starts equal to the draft). :meth:`linear` is ``x W0^T + (alpha / r) (x A^T) B^T``
    there. :meth:`refresh` (called after each publish and rollback) writes what serving must read into the
    served storage in place: ``W0 + (alpha / r) B A`` for adapted weights (SGLang's fused kernels and CUDA graphs
    read plain weights, so LoRA is merged, not run beside them), and with ``tp.size > 1`` this rank's shard of
    every trained full tensor.

    Args:
        named: serving tensors by dotted name (``dict(draft.named_parameters())``).
        names: the names the student reads.
        adapted: names that get LoRA adapters with ``params="lora"``.
        params: ``full`` or ``lora``.
        rank: LoRA rank ``r``; alpha: scale numerator (default ``r``: scale 1, as :class:`specadapt.tts.LoRALinear`).
        tp: this rank's :class:`~.sharding.TensorParallel` (``None``: TP 1); layouts: ``name -> Layout`` of the
            sharded names (others are replicated).

    Raises:
        ValueError: ``params`` not ``full``/``lora``, ``rank < 1``, or an adapted name that is not a 2-D weight.
    """

    def __init__(self, named: dict[str, torch.Tensor], names, adapted=(), params: str = "full", rank: int = 8,
                 alpha: float | None = None, tp=None, layouts=None) -> None:
        from .sharding import Layout, unshard

        if params not in ("full", "lora"):
            raise ValueError(f"--tts-params must be full or lora, got {params!r}")
        if params == "lora" and rank < 1:
            raise ValueError(f"--tts-lora-rank must be >= 1, got {rank}")
        self.params = params
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.layouts = {n: (layouts or {}).get(n, Layout()) for n in names}
        self.module = nn.Module()
        self.serving: dict[str, torch.Tensor] = {}
        for name in names:  # the same order on every rank: the gathers are collectives
            tensor = named[name].data
            full = tensor
            if self.tp is not None and self.layouts[name].kind != "replicated":
                full = unshard(self.layouts[name], [t.to(tensor.device) for t in self.tp.gather(tensor)],
                               self.tp.size)
            self.module.register_parameter(_key(name), nn.Parameter(full, requires_grad=False))
            self.serving[name] = tensor
        self.adapted = tuple(adapted) if params == "lora" else ()
        self.scale = (alpha if alpha is not None else rank) / rank
        self.trained: tuple[str, ...] = ()
        for name in self.adapted:
            w = self.get(self.module, name)
            if w.dim() != 2:
                raise ValueError(f"LoRA needs a 2-D weight, {name} has shape {tuple(w.shape)}")
            key = _key(name)
            self.module.register_parameter("base__" + key, nn.Parameter(w.detach().clone(), requires_grad=False))
            a = torch.empty(rank, w.shape[1], dtype=torch.float32, device=w.device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.module.register_parameter("lora_a__" + key, nn.Parameter(a))
            self.module.register_parameter(
                "lora_b__" + key, nn.Parameter(torch.zeros(w.shape[0], rank, dtype=torch.float32, device=w.device)))

    def set_trained(self, trainable) -> None:
        """Record which served tensors training changes (``trainable(key, param)`` over ``module``'s names)."""
        if self.params == "lora":
            self.trained = self.adapted
            return
        keys = {k for k, p in self.module.named_parameters() if trainable(k, p)}
        self.trained = tuple(n for n in self.serving if _key(n) in keys)

    def is_adapter(self, param_name: str) -> bool:
        """True for the LoRA adapters' parameter names in ``module``."""
        return param_name.startswith(("lora_a__", "lora_b__"))

    def get(self, module: nn.Module, name: str) -> torch.Tensor:
        """The tensor ``name`` in ``module`` (the serving module or the trainer's shadow)."""
        return getattr(module, _key(name))

    def linear(self, module: nn.Module, name: str, x: torch.Tensor, bias: str | None = None) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` through weight ``name`` (and bias ``bias``), adapters included."""
        b = None if bias is None else self.get(module, bias)
        if name not in self.adapted:
            return F.linear(x, self.get(module, name), b)
        key = _key(name)
        base = F.linear(x, getattr(module, "base__" + key), b)
        a, bb = getattr(module, "lora_a__" + key), getattr(module, "lora_b__" + key)
        return base + (self.scale * F.linear(F.linear(x.float(), a), bb)).to(base.dtype)

    @torch.no_grad()
    def merged(self, name: str) -> torch.Tensor:
        """``W0 + (alpha / r) B A`` of adapted weight ``name`` from the serving module's adapters, weight dtype."""
        key = _key(name)
        base = getattr(self.module, "base__" + key)
        a, b = getattr(self.module, "lora_a__" + key), getattr(self.module, "lora_b__" + key)
        return (base.float() + self.scale * (b @ a)).to(base.dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        """Write the trained state into the served storage in place: merged LoRA weights, and with TP > 1 this
        rank's shard of every trained tensor (no-op for ``params="full"`` at TP 1: the tensors are aliased)."""
        from .sharding import shard

        for name in self.trained:
            if self.tp is not None and self.tp.broadcast is not None:  # every rank serves rank 0's replica
                for key in ((("lora_a__", "lora_b__") if name in self.adapted else ("",))):
                    self.tp.broadcast(getattr(self.module, key + _key(name)).data)
            if name in self.adapted:
                full = self.merged(name)
            elif self.tp is not None and self.layouts[name].kind != "replicated":
                full = self.get(self.module, name)
            else:
                continue  # aliased: training already wrote the served tensor
            if self.tp is None:
                self.serving[name].copy_(full)
            else:
                self.serving[name].copy_(shard(self.layouts[name], full, self.tp.rank, self.tp.size))

    def nbytes_added(self) -> int:
        """Bytes the student adds beside the serving tensors (gathered full tensors, frozen copies, adapters)."""
        added = sum(p.numel() * p.element_size() for n, p in self.module.named_parameters()
                    if n.startswith(("base__", "lora_a__", "lora_b__")))
        for name, tensor in self.serving.items():
            full = self.get(self.module, name)
            if full.data_ptr() != tensor.data_ptr():
                added += full.numel() * full.element_size()
        return added


def vocab_layout(module):
    """The TP layout of a ``VocabParallelEmbedding`` / ``ParallelLMHead`` (``None``: a plain tensor): vocab rows
    when sharded, replicated when SGLang replicates the table (``SGLANG_ENABLE_EMBED_REPLICATION``).

    Raises:
        ValueError: added (LoRA) vocabulary rows, which SGLang places at the end of every shard.
    """
    from .sharding import Layout

    if int(getattr(module, "num_added_embeddings", 0) or 0) > 0:
        raise ValueError("TTS: an embedding / LM head with added vocabulary rows is not supported")
    if module is not None and (not getattr(module, "enable_tp", True) or int(getattr(module, "tp_size", 2)) == 1):
        return Layout()
    return Layout("rows")


def qkv_layout(config, qkv_weight: torch.Tensor, tp=None):
    """The attention heads of ``config`` (``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or
    ``hidden_size / heads``) as a ``qkv`` :class:`~.sharding.Layout`, checked against the served ``qkv_proj``
    shard ``[rows, in]`` of this rank.

    Raises:
        ValueError: the shard's rows are not the configured heads' on ``tp.size`` ranks.
    """
    from .sharding import Layout

    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    layout = Layout("qkv", heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    size = 1 if tp is None else tp.size
    if qkv_weight.shape[0] != layout.shard_rows(size):
        raise ValueError(f"TTS: qkv_proj has {qkv_weight.shape[0]} rows, expected {layout.shard_rows(size)} on each "
                         f"of {size} tensor-parallel rank(s)")
    return layout
