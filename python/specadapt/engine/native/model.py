"""The native forward: a compact Llama-family decoder over a slot KV cache, in the weight formats of
:mod:`.formats`, with logits only for the rows verification reads.

transformers stays the loader (weights, config, tokenizer, chat template, RoPE tables); this module takes the
loaded model's tensors once, packs them (fused q/k/v and gate/up matrices), and runs packed tokens through

- on CPU, ``specadapt::native_llama_forward`` (csrc/cpu/native_llama.cpp: every layer in one op, the block
  kernels of csrc/cpu/native_linear.cpp / native_qdot.cpp),
- elsewhere (CUDA), :func:`layers_reference`, the same computation in PyTorch operations with no host
  synchronisation (so a bucketed step can be captured in a CUDA graph); on CPU it is the tests' reference.

Supported: ``LlamaForCausalLM`` / ``MistralForCausalLM`` (no sliding window) / ``Qwen2ForCausalLM`` (q/k/v bias) /
``Qwen3ForCausalLM`` (per-head q/k norms), SiLU MLPs, RoPE types transformers computes statically (default,
linear, llama3, YaRN, longrope). :func:`native_support` says why a model is not supported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .formats import FILE_FORMAT, RUN_FORMATS, PackedWeight, WeightFormat, linear_reference, pack_weight

logger = logging.getLogger(__name__)

__all__ = ["NativeUnsupported", "native_support", "NativeLlama", "TokenBatch", "NativeOutput", "run_linear",
           "layers_reference"]

_SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
_STATIC_ROPE = {"default", "linear", "llama3", "yarn", "longrope"}


class NativeUnsupported(ValueError):
    """The model cannot run on the native forward (the message names the architecture and the reason)."""


def native_support(config) -> str | None:
    """``None`` when ``config`` (a transformers config) can run natively, else the reason it cannot."""
    kind = getattr(config, "model_type", "?")
    if kind not in _SUPPORTED:
        return f"architecture {kind!r} ({', '.join(getattr(config, 'architectures', None) or [])}) is not one of " \
               f"{sorted(_SUPPORTED)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and kind != "qwen2":
        if int(window) < int(getattr(config, "max_position_embeddings", 0) or 0):
            return f"sliding-window attention (window {window})"
    if kind == "qwen2" and getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} (its tables depend on the sequence length)"
    return None


@dataclass
class TokenBatch:
    """Packed tokens of one forward (every tensor ``[N] int64`` on the model's device).

    Attributes:
        ids: token ids.
        slot: cache slot (request) of each token.
        index: cache index its keys / values are written at.
        position: RoPE position (a tree node's depth offset, not its index).
        visible: the token attends to indices ``[0, visible)`` of its slot ...
        tree_base, tree_mask: ... and, where ``tree_mask != 0``, to ``tree_base + j`` for each bit ``j``.
    """

    ids: torch.Tensor
    slot: torch.Tensor
    index: torch.Tensor
    position: torch.Tensor
    visible: torch.Tensor
    tree_base: torch.Tensor
    tree_mask: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class NativeOutput:
    """Result of :meth:`NativeLlama.forward`: ``hidden [N, h]`` (after the last layer, before the final norm),
    ``logits [M, V]`` of the requested rows (or ``None``), ``captured`` {hidden_states index: [N, h]}."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


def _use_kernels(device: torch.device) -> bool:
    from ... import kernels

    return device.type == "cpu" and kernels.has_op_for("native_llama_forward", device)


def run_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x [..., K] @ W^T`` with the kernels (CPU) or :func:`~.formats.linear_reference`-equivalent PyTorch
    operations elsewhere (float weights: a plain matmul; block formats: 8-bit activations, de-quantised weights)."""
    if _use_kernels(x.device):
        return torch.ops.specadapt.native_linear(x.float().contiguous(), *weight.tensors(), int(weight.format),
                                                 weight.rows)
    if not weight.format.is_block:
        return torch.nn.functional.linear(x.float(), weight.data.float())
    return linear_reference(x, weight)


#: A linear layer: one matrix, or the parts of a fused q/k/v or gate/up stored in different formats (their outputs
#: are concatenated; the kernels quantise the activations once for all parts).
Linear = "PackedWeight | list[PackedWeight]"


def linear_parts(w) -> list[PackedWeight]:
    """The matrices of a :data:`Linear` (a one-element list for a single matrix)."""
    return list(w) if isinstance(w, (list, tuple)) else [w]


def run_linear_parts(x: torch.Tensor, w) -> torch.Tensor:
    """:func:`run_linear` of a :data:`Linear`: ``x [..., K]`` -> ``[..., sum of the parts' rows]``."""
    parts = linear_parts(w)
    if len(parts) == 1:
        return run_linear(x, parts[0])
    return torch.cat([run_linear(x, p) for p in parts], dim=-1)


@dataclass
class _Layer:
    qkv: object  # a Linear: one fused matrix or [q, k, v]
    o: PackedWeight
    gate_up: object  # a Linear: one fused matrix or [gate, up]
    down: PackedWeight
    norm1: torch.Tensor
    norm2: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None

    def _slots(self) -> list:
        """The op's 7 weight slots (q, k, v, o, gate, up, down): fused matrices fill the first of theirs."""
        def spread(w, n: int) -> list:
            parts = linear_parts(w)
            return parts + [None] * (n - len(parts))
        return spread(self.qkv, 3) + [self.o] + spread(self.gate_up, 2) + [self.down]

    def op_tensors(self) -> list:
        out: list = []
        for w in self._slots():
            out.extend(w.tensors() if w is not None else (None, None, None))
        return out + [self.norm1, self.norm2, self.q_norm, self.k_norm, self.qkv_bias]

    def formats(self) -> list[int]:
        return [int(w.format) if w is not None else -1 for w in self._slots()]

    def to(self, device) -> "_Layer":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        move_linear = lambda w: w.to(device) if not isinstance(w, list) else [p.to(device) for p in w]  # noqa: E731
        return _Layer(move_linear(self.qkv), self.o.to(device), move_linear(self.gate_up), self.down.to(device),
                      move(self.norm1), move(self.norm2), move(self.q_norm), move(self.k_norm), move(self.qkv_bias))

    def matrices(self) -> list[PackedWeight]:
        return [w for w in self._slots() if w is not None]

    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.matrices())


class NativeLlama:
    """A Llama-family decoder stack with packed weights (see the module docstring).

    Build with :meth:`from_hf`. Attributes mirror the config: ``num_layers``, ``hidden_size``, ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size``, ``eps``, ``max_positions``.
    ``dtype_name`` is the run format (``float32`` / ``bfloat16`` / ``int8`` / ``int4``).
    """

    def __init__(self, config, layers: list[_Layer], embed: PackedWeight, lm_head: PackedWeight,
                 final_norm: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, dtype_name: str,
                 int8_activations: bool, source: str, kv_dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.layers = layers
        self.embed = embed
        self.lm_head = lm_head
        self.final_norm = final_norm
        self.rope_cos, self.rope_sin = rope_cos, rope_sin
        self.dtype_name = dtype_name
        self.int8_activations = int8_activations
        self.source = source
        if kv_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"kv_dtype must be torch.float32 or torch.float16, got {kv_dtype}")
        self.kv_dtype = kv_dtype
        self.num_layers = len(layers)
        self.hidden_size = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.num_heads)
        self.intermediate_size = int(config.intermediate_size)
        self.vocab_size = lm_head.rows
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.max_positions = int(rope_cos.shape[0])
        self.attn_scale = self.head_dim ** -0.5
        self.device = final_norm.device
        self._refresh_op_args()

    def refresh_from(self, model: torch.nn.Module) -> None:
        """Re-pack the decoder layers of ``model`` (the transformers module these were built from, after
        training) into this model's storage in place; the embedding, final norm and LM head are frozen."""
        for mine, layer in zip(self.layers, model.model.layers):
            refresh_layer(mine, layer)

    def _refresh_op_args(self) -> None:
        self._op_tensors = [t for layer in self.layers for t in layer.op_tensors()]
        self._op_formats = [f for layer in self.layers for f in layer.formats()]

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, model: torch.nn.Module, dtype_name: str = "float32", gguf_path: str | None = None,
                layers: int | None = None, kv_dtype: str = "auto") -> "NativeLlama":
        """Pack a transformers causal LM (``model.model.layers`` ...) for the native forward.

        Args:
            model: a loaded transformers model of a supported architecture (float weights).
            dtype_name: run format, one of :data:`~.formats.RUN_FORMATS`.
            gguf_path: the GGUF file the model was loaded from: its own Q8_0 / Q4_1 blocks are used where they
                are in the run format's block format (the file's model, not a re-quantisation).
            layers: keep only the first ``layers`` decoder layers (``self:N`` drafts).
            kv_dtype: ``float32``, ``float16`` (half the bytes attention reads; keys / values rounded to 11
                significant bits) or ``auto`` (float16 with the block formats ``int8`` / ``int4``, else float32).

        Raises:
            NativeUnsupported: an unsupported architecture or feature (the message names it).
            ValueError: an unknown ``dtype_name``.
        """
        if dtype_name not in RUN_FORMATS:
            raise ValueError(f"dtype must be one of {sorted(RUN_FORMATS)} for the native forward, got {dtype_name!r}")
        if dtype_name == FILE_FORMAT:
            if gguf_path is None:
                raise ValueError("--dtype gguf needs a model loaded from a .gguf file")
            rotary = type(model.model.rotary_emb)(config=model.config)  # on the CPU, even for a meta skeleton
            return cls.from_gguf(gguf_path, model.config, rotary, layers=layers, kv_dtype=kv_dtype)
        kv_choices = {"float32": torch.float32, "float16": torch.float16}
        if kv_dtype == "auto":
            kv_dtype = "float16" if RUN_FORMATS[dtype_name][0].is_block else "float32"
        if kv_dtype not in kv_choices:
            raise ValueError(f"kv_dtype must be auto, float32 or float16, got {kv_dtype!r}")
        config = model.config
        reason = native_support(config)
        if reason is not None:
            raise NativeUnsupported(f"--forward native cannot run {type(model).__name__}: {reason}")
        layer_fmt, head_fmt, int8 = RUN_FORMATS[dtype_name]
        decoder = model.model
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        blocks: dict[str, PackedWeight] = {}
        if gguf_path is not None and layer_fmt.is_block:
            from .gguf_blocks import read_gguf_blocks

            blocks = read_gguf_blocks(gguf_path, heads, kv_heads)
        used_file = []

        def packed(name: str, tensor: torch.Tensor, fmt: WeightFormat) -> PackedWeight:
            found = blocks.get(name)
            if found is not None and found.format == fmt:
                used_file.append(name)
                return found
            return pack_weight(tensor, fmt)

        keep = len(decoder.layers) if layers is None else layers
        native_layers = [_pack_layer(layer, f"model.layers.{i}.", layer_fmt, packed, type(model).__name__)
                         for i, layer in enumerate(list(decoder.layers)[:keep])]
        head_module = model.get_output_embeddings()
        tied = head_module.weight.data_ptr() == decoder.embed_tokens.weight.data_ptr()
        embed = packed("model.embed_tokens.weight", decoder.embed_tokens.weight, head_fmt)
        if tied:
            lm_head = embed
        else:
            lm_head = packed("lm_head.weight", head_module.weight, head_fmt)
        if getattr(head_module, "bias", None) is not None:
            raise NativeUnsupported(f"--forward native cannot run {type(model).__name__}: an LM-head bias")
        positions = int(getattr(config, "max_position_embeddings", 0) or 8192)
        param = next(model.parameters())
        with torch.no_grad():
            probe = torch.zeros(1, dtype=torch.float32, device=param.device)
            cos, sin = decoder.rotary_emb(probe, torch.arange(positions, device=param.device)[None])
        source = f"{len(used_file)} matrices from {gguf_path}" if used_file else "packed from the loaded weights"
        if param.device.type != "cpu":  # packing runs on the CPU; the forward runs where the model lives
            native_layers = [layer.to(param.device) for layer in native_layers]
            embed = embed.to(param.device)
            lm_head = embed if tied else lm_head.to(param.device)
        logger.info("native forward: %s %s, %d layers, %.1f MB of weights (%s)", type(model).__name__, dtype_name,
                    len(native_layers), sum(l.nbytes() for l in native_layers) / 1e6 + embed.nbytes / 1e6 +
                    (0 if tied else lm_head.nbytes / 1e6), source)
        return cls(config, native_layers, embed, lm_head, decoder.norm.weight.detach().float().contiguous(),
                   cos[0].float().contiguous(), sin[0].float().contiguous(), dtype_name, int8, source,
                   kv_choices[kv_dtype])

    @classmethod
    def from_gguf(cls, path: str, config, rotary_emb: torch.nn.Module, layers: int | None = None,
                  kv_dtype: str = "auto") -> "NativeLlama":
        """Build from a GGUF file's own blocks, with no float32 copy of the model (``--dtype gguf``): every
        matrix in its file type (:data:`~.gguf_blocks.BLOCK_TYPES`; Q5_0 as Q8_0), fused q/k/v and gate/up kept
        as parts where their types differ, norms and Qwen2 biases from the file's float32 vectors, the LM head
        the file's ``output.weight`` (or the embedding when tied).

        Args:
            path: the ``.gguf`` file; config: its transformers config; rotary_emb: a transformers rotary
                embedding module for ``config`` (on the CPU) giving the RoPE tables.
            layers: keep only the first ``layers`` decoder layers (``self:N`` drafts).
            kv_dtype: ``auto`` (float16), ``float16`` or ``float32``.

        Raises:
            NativeUnsupported: an unsupported architecture, or a matrix in a block type the kernels lack (the
                message names the type and the tensor).
            ValueError: a bad ``kv_dtype`` or a tensor missing from the file.
        """
        from .gguf_blocks import load_gguf_model_cached

        reason = native_support(config)
        if reason is not None:
            raise NativeUnsupported(f"--forward native cannot run {path}: {reason}")
        if kv_dtype not in ("auto", "float16", "float32"):
            raise ValueError(f"kv_dtype must be auto, float32 or float16, got {kv_dtype!r}")
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        read = load_gguf_model_cached(path, heads, kv_heads, layers=layers)
        return cls.from_gguf_model(read, config, rotary_emb, path, layers=layers, kv_dtype=kv_dtype)

    @classmethod
    def from_gguf_model(cls, read, config, rotary_emb: torch.nn.Module, path: str = "a GGUF file",
                        layers: int | None = None, kv_dtype: str = "auto") -> "NativeLlama":
        """:meth:`from_gguf` from what :func:`~.gguf_blocks.read_gguf_model` read (``read``, a
        :class:`~.gguf_blocks.GGUFModel`); ``path`` names the source in messages. Raises as :meth:`from_gguf`."""
        from .gguf_blocks import BLOCK_TYPES

        kv_choices = {"auto": torch.float16, "float16": torch.float16, "float32": torch.float32}
        if kv_dtype not in kv_choices:
            raise ValueError(f"kv_dtype must be auto, float32 or float16, got {kv_dtype!r}")
        if read.unsupported:
            name, kind = next(iter(read.unsupported.items()))
            raise NativeUnsupported(f"--dtype gguf: {path} holds {name} in block type {kind}, which the native "
                                    f"forward does not read (it reads {', '.join(BLOCK_TYPES)}); "
                                    f"{len(read.unsupported)} such matrices")

        def matrix(name: str) -> PackedWeight:
            if name not in read.matrices:
                raise ValueError(f"{path}: no tensor for {name}")
            return read.matrices[name]

        def vector(name: str, required: bool = True) -> torch.Tensor | None:
            if name not in read.vectors:
                if required:
                    raise ValueError(f"{path}: no tensor for {name}")
                return None
            return read.vectors[name].contiguous()

        keep = int(config.num_hidden_layers) if layers is None else layers
        native_layers = []
        for i in range(keep):
            p = f"model.layers.{i}."
            biases = [vector(p + f"self_attn.{x}_proj.bias", required=False) for x in "qkv"]
            native_layers.append(_Layer(
                qkv=fuse_rows([matrix(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                o=matrix(p + "self_attn.o_proj.weight"),
                gate_up=fuse_rows([matrix(p + "mlp.gate_proj.weight"), matrix(p + "mlp.up_proj.weight")]),
                down=matrix(p + "mlp.down_proj.weight"),
                norm1=vector(p + "input_layernorm.weight"), norm2=vector(p + "post_attention_layernorm.weight"),
                q_norm=vector(p + "self_attn.q_norm.weight", required=False),
                k_norm=vector(p + "self_attn.k_norm.weight", required=False),
                qkv_bias=torch.cat(biases).contiguous() if all(b is not None for b in biases) else None,
            ))
        embed = matrix("model.embed_tokens.weight")
        lm_head = read.matrices.get("lm_head.weight", embed)
        positions = int(getattr(config, "max_position_embeddings", 0) or 8192)
        with torch.no_grad():
            cos, sin = rotary_emb(torch.zeros(1), torch.arange(positions)[None])
        kinds = sorted(set(read.types.values()))
        logger.info("native forward: %s from %s, file blocks (%s), %d layers, %.1f MB of weights",
                    getattr(config, "model_type", "?"), path, ", ".join(kinds), len(native_layers),
                    (sum(l.nbytes() for l in native_layers) + embed.nbytes +
                     (0 if lm_head is embed else lm_head.nbytes)) / 1e6)
        return cls(config, native_layers, embed, lm_head, vector("model.norm.weight"), cos[0].float().contiguous(),
                   sin[0].float().contiguous(), "gguf", True, f"the file's own blocks ({', '.join(kinds)})",
                   kv_choices[kv_dtype])

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Bytes one single-token forward reads: every layer matrix and the LM head (the embedding rows it looks
        up are negligible)."""
        return sum(l.nbytes() for l in self.layers) + self.lm_head.nbytes

    @property
    def num_parameters(self) -> int:
        per_layer = sum(w.rows * w.cols for l in self.layers for w in l.matrices())
        return per_layer + self.lm_head.rows * self.lm_head.cols

    def new_kv(self, slots: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed caches for ``slots`` requests of ``capacity`` positions (rounded up to a multiple of 16):
        ``k_cache [layers, slots, kv_heads, capacity/16, head_dim, 16]`` (keys in transposed tiles of 16
        positions) and ``v_cache [layers, slots, kv_heads, capacity, head_dim]``, in :attr:`kv_dtype`."""
        return new_kv_tensors(self.num_layers, slots, self.num_kv_heads, capacity, self.head_dim, self.device,
                              self.kv_dtype)

    # ---- forward ---------------------------------------------------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """``[N] int64`` -> ``[N, h] float32`` embedding rows."""
        if _use_kernels(ids.device):
            return torch.ops.specadapt.native_embedding(ids, *self.embed.tensors(), int(self.embed.format),
                                                        self.embed.rows)
        if self.embed.format in (WeightFormat.F32, WeightFormat.BF16):
            return self.embed.data.index_select(0, ids).float()
        return self.embed.select_rows(ids).dequantize()

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """LM head of ``normed [M, h]`` (after the final norm) -> ``[M, V] float32``."""
        return run_linear(normed, self.lm_head)

    def logits_of_rows(self, normed: torch.Tensor, logit_rows: torch.Tensor | None, compacted: bool) -> torch.Tensor:
        """LM head of the rows verification reads: ``normed [N, h]`` and ``logit_rows [M] int64`` (``None``: every
        row) -> ``[M, V] float32``; ``compacted``: ``normed`` already holds just those rows (``run_layers``'
        ``out_rows``)."""
        rows = normed if logit_rows is None or compacted else normed.index_select(0, logit_rows)
        return self.logits(rows) if rows.shape[0] else normed.new_zeros(0, self.vocab_size)

    def run_layers(self, hidden: torch.Tensor, batch: TokenBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   capture: tuple[int, ...] = (), final_norm: bool = True, out_rows: torch.Tensor | None = None):
        """Decoder stack over packed tokens: returns ``(x [N, h], normed [N, h] or None, {i: input of layer i})``.
        Writes every token's keys / values into the caches at ``(slot, index)``.

        ``out_rows``: optional strictly increasing ``[M] int64`` packed token indices whose outputs are read: the
        last layer's attention, o_proj and MLP then run for them only (an EAGLE catch-up reads one token per
        row), and ``x`` / ``normed`` are ``[M, h]`` in that order. The caches are written as without it."""
        if _use_kernels(hidden.device):
            outs = torch.ops.specadapt.native_llama_forward(
                hidden.float().contiguous(), self._op_tensors, self._op_formats,
                self.final_norm if final_norm else None, k_cache, v_cache, batch.slot, batch.index, batch.position,
                batch.visible, batch.tree_base, batch.tree_mask, self.rope_cos, self.rope_sin, list(capture),
                self.eps, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size,
                self.attn_scale, out_rows)
            x, rest = outs[0], outs[1:]
            normed = rest[0] if final_norm else None
            captured = dict(zip(capture, rest[1:] if final_norm else rest))
            return x, normed, captured
        x, normed, captured = layers_reference(self, hidden, batch, k_cache, v_cache, capture, final_norm)
        if out_rows is not None:
            x = x.index_select(0, out_rows)
            normed = None if normed is None else normed.index_select(0, out_rows)
        return x, normed, captured

    def forward(self, batch: TokenBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                logit_rows: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                rows_only: bool = False) -> NativeOutput:
        """One packed forward: embeddings, decoder stack, final norm, LM head on ``logit_rows`` (``[M] int64``
        packed token indices, increasing; ``None`` = every token).

        ``capture`` holds transformers ``hidden_states`` indices: ``i < layers`` is the input of layer ``i``,
        ``layers`` the output after the final norm. ``rows_only``: only ``logit_rows``' outputs are read, so the
        last layer runs past its cache writes for them only and ``hidden`` is ``[M, h]`` (not with ``layers`` in
        ``capture``).
        """
        inner = tuple(i for i in capture if i < self.num_layers)
        out_rows = logit_rows if rows_only else None
        if out_rows is not None and self.num_layers in capture:
            raise ValueError("rows_only cannot capture the final hidden states of every token")
        x, normed, captured = self.run_layers(self.embed_tokens(batch.ids), batch, k_cache, v_cache, inner,
                                              out_rows=out_rows)
        if self.num_layers in capture:
            captured[self.num_layers] = normed
        logits = self.logits_of_rows(normed, logit_rows, out_rows is not None)
        return NativeOutput(hidden=x, logits=logits, captured=captured)


KEY_TILE = 16


def new_kv_tensors(layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int, device,
                   dtype: torch.dtype = torch.float32) -> tuple:
    """``(k_cache, v_cache)`` in the layout of csrc/cpu/native_attention.h (capacity rounded up to 16)."""
    capacity = -(-capacity // KEY_TILE) * KEY_TILE
    k = torch.zeros(layers, slots, kv_heads, capacity // KEY_TILE, head_dim, KEY_TILE, device=device, dtype=dtype)
    v = torch.zeros(layers, slots, kv_heads, capacity, head_dim, device=device, dtype=dtype)
    return k, v


def fuse_rows(parts: list[PackedWeight]):
    """Stack matrices along their rows (fused q/k/v or gate/up): one :class:`PackedWeight` when they share a
    format, else the list of parts (a :data:`Linear` the kernels run as one layer)."""
    fmt = parts[0].format
    if any(p.format != fmt for p in parts):
        return list(parts)
    if not fmt.is_block:
        return PackedWeight(fmt, torch.cat([p.data for p in parts]).contiguous())
    if all(p.rows % 16 == 0 for p in parts[:-1]):  # whole groups: the storage concatenates as it is
        cat = lambda ts: None if ts[0] is None else torch.cat(ts).contiguous()  # noqa: E731
        return PackedWeight(fmt, cat([p.data for p in parts]), cat([p.scales for p in parts]),
                            cat([p.mins for p in parts]), sum(p.rows for p in parts))
    if fmt.is_k:
        keys = parts[0].kquant_parts().keys()
        pieces = [p.kquant_parts() for p in parts]
        return PackedWeight.from_kquant(fmt, **{k: torch.cat([q[k] for q in pieces]) for k in keys})
    codes = [p.block_codes() for p in parts]
    cat = lambda i: None if codes[0][i] is None else torch.cat([c[i] for c in codes])  # noqa: E731
    return PackedWeight.from_blocks(fmt, cat(0), cat(1), cat(2))


def _pack_layer(layer, prefix: str, fmt: WeightFormat, packed, arch: str) -> _Layer:
    """One transformers decoder layer as a :class:`_Layer` (``packed(name, tensor, fmt)`` packs one matrix)."""
    attn, mlp = layer.self_attn, layer.mlp
    p = prefix
    qkv = fuse_rows([packed(p + "self_attn.q_proj.weight", attn.q_proj.weight, fmt),
                     packed(p + "self_attn.k_proj.weight", attn.k_proj.weight, fmt),
                     packed(p + "self_attn.v_proj.weight", attn.v_proj.weight, fmt)])
    if getattr(attn.o_proj, "bias", None) is not None:
        raise NativeUnsupported(f"--forward native cannot run {arch}: an o_proj bias")
    bias = None
    if getattr(attn.q_proj, "bias", None) is not None:
        bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().float().contiguous()
    norm = lambda m: None if m is None else m.weight.detach().float().contiguous()  # noqa: E731
    return _Layer(
        qkv=qkv,
        o=packed(p + "self_attn.o_proj.weight", attn.o_proj.weight, fmt),
        gate_up=fuse_rows([packed(p + "mlp.gate_proj.weight", mlp.gate_proj.weight, fmt),
                           packed(p + "mlp.up_proj.weight", mlp.up_proj.weight, fmt)]),
        down=packed(p + "mlp.down_proj.weight", mlp.down_proj.weight, fmt),
        norm1=norm(layer.input_layernorm), norm2=norm(layer.post_attention_layernorm),
        q_norm=norm(getattr(attn, "q_norm", None)), k_norm=norm(getattr(attn, "k_norm", None)),
        qkv_bias=bias,
    )


def refresh_layer(target: _Layer, layer) -> None:
    """Re-pack a (trained) transformers layer into ``target``'s storage in place (Test-Time Speculation
    publishes): kernels and captured graphs holding those tensors then see the new weights. Fused matrices are
    packed from their concatenation (block quantisation is per row, so that equals fusing packed parts)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(target.qkv, list) or isinstance(target.gate_up, list) or target.qkv.format.is_k:
        raise ValueError("a model in a GGUF file's own K-quant blocks cannot be re-packed after training "
                         "(Test-Time Speculation adapts Q8_0 / Q4_1 / float drafts)")
    fmt = target.qkv.format
    with torch.no_grad():
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float()
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float()
        for mine, weight in ((target.qkv, qkv), (target.o, attn.o_proj.weight), (target.gate_up, gate_up),
                             (target.down, mlp.down_proj.weight)):
            mine.copy_(pack_weight(weight, fmt))
        norms = {"norm1": layer.input_layernorm, "norm2": layer.post_attention_layernorm,
                 "q_norm": getattr(attn, "q_norm", None), "k_norm": getattr(attn, "k_norm", None)}
        for name, module in norms.items():
            if getattr(target, name) is not None:
                getattr(target, name).copy_(module.weight)
        if target.qkv_bias is not None:
            target.qkv_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = v.shape[-1] // 2
    rotated = torch.cat([-v[..., half:], v[..., :half]], dim=-1)
    return v * cos + rotated * sin


def layers_reference(model: NativeLlama, hidden: torch.Tensor, batch: TokenBatch, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, capture: tuple[int, ...] = (), final_norm: bool = True):
    """:meth:`NativeLlama.run_layers` in PyTorch operations (any device; no host synchronisation)."""
    n = hidden.shape[0]
    H, Hkv, D = model.num_heads, model.num_kv_heads, model.head_dim
    capacity = v_cache.shape[3]
    x = hidden.float().clone()
    tile, lane = batch.index // KEY_TILE, batch.index % KEY_TILE
    cos = model.rope_cos.index_select(0, batch.position)[:, None]  # [N, 1, D]
    sin = model.rope_sin.index_select(0, batch.position)[:, None]
    keys = torch.arange(capacity, device=x.device)
    allowed = keys[None, :] < batch.visible[:, None]
    offset = keys[None, :] - batch.tree_base[:, None]
    in_tree = (offset >= 0) & (offset < 64)
    bits = torch.bitwise_right_shift(batch.tree_mask[:, None], offset.clamp(0, 63)) & 1
    allowed = allowed | (in_tree & (bits == 1))  # [N, C]
    captured = {}
    for i, layer in enumerate(model.layers):
        if i in capture:
            captured[i] = x.clone()
        h = _rms(x, layer.norm1, model.eps)
        qkv = run_linear_parts(h, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q = qkv[:, : H * D].view(n, H, D)
        k = qkv[:, H * D : (H + Hkv) * D].view(n, Hkv, D)
        v = qkv[:, (H + Hkv) * D :].view(n, Hkv, D)
        if layer.q_norm is not None:
            q = _rms(q, layer.q_norm, model.eps)
        if layer.k_norm is not None:
            k = _rms(k, layer.k_norm, model.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_cache[i, batch.slot, :, tile, :, lane] = k.to(k_cache.dtype)
        v_cache[i, batch.slot, :, batch.index] = v.to(v_cache.dtype)
        ks = k_cache[i, batch.slot].permute(0, 1, 2, 4, 3).reshape(n, Hkv, capacity, D).float()  # [N, Hkv, C, D]
        vs = v_cache[i, batch.slot].float()
        mask = torch.where(allowed, 0.0, float("-inf")).to(x.dtype)[:, None, None, :]  # [N, 1, 1, C]
        attn = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], ks, vs, attn_mask=mask, scale=model.attn_scale, enable_gqa=True)  # [N, H, 1, D]
        x = x + run_linear(attn.reshape(n, H * D), layer.o)
        h = _rms(x, layer.norm2, model.eps)
        gu = run_linear_parts(h, layer.gate_up)
        gate, up = gu.chunk(2, dim=-1)
        x = x + run_linear(torch.nn.functional.silu(gate) * up, layer.down)
    normed = _rms(x, model.final_norm, model.eps) if final_norm else None
    return x, normed, captured
