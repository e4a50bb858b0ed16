"""An EAGLE-style draft head for a Llama-family target (Li et al., EAGLE, ICML 2024; EAGLE-3, 2025).

The head predicts the token after next from the target's own hidden states:

- input at position ``i``: the target's hidden states at three layers (low, middle, high; EAGLE-3's feature
  fusion) of position ``i``, fused to one hidden vector by ``fuse`` ``[3h -> h]``, concatenated with the
  target's (frozen, shared) embedding of token ``x_{i+1}`` and projected by ``input_proj`` ``[2h -> h]``;
- one Llama decoder layer (causal attention over the head's own KV cache);
- the target's frozen final norm and LM head (shared, never trained), restricted to a reduced draft
  vocabulary ``draft_vocab`` (EAGLE-3: the most frequent target tokens): on SmolLM2-135M the full LM head
  (49,152 x 576) costs seven times the decoder layer.

The output hidden state ``g_i`` of the layer gives ``q(x_{i+2})``. Drafting further than one token feeds
``g_i`` back in place of the fused target features (EAGLE-3's "training-time test" recurrence), which is
also how :mod:`scripts.train_draft` trains the head (two unrolled steps).

Only ``fuse``, ``input_proj`` and ``layer`` are parameters of the head; the shared modules are attached by
reference with :meth:`EagleHead.attach` and never appear in its ``parameters()`` or ``state_dict()``.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "EagleHead",
    "head_layer_config",
    "default_feature_layers",
    "load_eagle_head",
    "save_eagle_head",
    "EAGLE_DEFAULT_FILE",
    "EAGLE_HEADS",
    "eagle_default_path",
    "shipped_heads",
]

EAGLE_DEFAULT_FILE = "eagle_smollm2_135m.safetensors"
#: The heads shipped in the package, by target preset (``--draft eagle``); each has a ``.train_log.json`` beside it.
EAGLE_HEADS = {"smollm2-135m": EAGLE_DEFAULT_FILE, "qwen2.5-coder-1.5b": "eagle_qwen2.5_coder_1.5b.safetensors"}


def _data_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "data"


def shipped_heads() -> list[str]:
    """The targets whose EAGLE head file is in this installation (sorted)."""
    return sorted(t for t, name in EAGLE_HEADS.items() if (_data_dir() / name).is_file())


def eagle_default_path(target: str = "smollm2-135m") -> Path:
    """Path of the head shipped in the package for the preset ``target`` (a loaded model's
    :attr:`~specadapt.engine.models.LoadedModel.preset`, which also names a preset given by its GGUF path).

    Raises:
        ValueError: a target with no head file in this installation (the message names those that have one, and
            says when the target's head is planned but not trained here yet).
    """
    path = _data_dir() / EAGLE_HEADS.get(target, "")
    if target in EAGLE_HEADS and path.is_file():
        return path
    have = ", ".join(shipped_heads()) or "none"
    pending = (f" ({target}'s head is trained by scripts/train_draft.py, docs/draft_training.md, and not shipped "
               "in this installation yet)" if target in EAGLE_HEADS else "")
    raise ValueError(f"no EAGLE head is shipped for {target!r}{pending}; shipped heads: {have} (or pass "
                     "--draft eagle:PATH with a head trained by scripts/train_draft.py)")


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Indices into transformers' ``hidden_states`` tuple (0 = embeddings, i = output of layer i-1) of the
    low / middle / high target layers the head fuses: outputs of layers 2, N/2 and N-3 (EAGLE-3's choice)."""
    if num_layers < 3:
        return (1, 1, num_layers)
    return (3, num_layers // 2 + 1, num_layers - 2)


def head_layer_config(target_config, intermediate_size: int | None = None):
    """The transformers ``LlamaConfig`` of the head's one decoder layer: the target's attention shape, norm epsilon
    and RoPE, one layer, no biases (a Qwen2 target's q/k/v biases are not copied: the head layer is new), SDPA
    attention, and the MLP width ``intermediate_size`` (default: the target's)."""
    from transformers import LlamaConfig

    if getattr(target_config, "model_type", None) == "llama":
        config = copy.deepcopy(target_config)
    else:  # another Llama-family decoder (Qwen2): the same layer without biases
        hidden = int(target_config.hidden_size)
        heads = int(target_config.num_attention_heads)
        fields = dict(hidden_size=hidden, intermediate_size=int(target_config.intermediate_size),
                      num_attention_heads=heads,
                      num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
                      head_dim=int(getattr(target_config, "head_dim", None) or hidden // heads),
                      rms_norm_eps=float(target_config.rms_norm_eps), hidden_act=target_config.hidden_act,
                      max_position_embeddings=int(target_config.max_position_embeddings),
                      vocab_size=int(target_config.vocab_size), attention_bias=False, mlp_bias=False,
                      tie_word_embeddings=False)
        rope = getattr(target_config, "rope_parameters", None)
        if rope is not None:
            fields["rope_parameters"] = dict(rope)
        config = LlamaConfig(**fields)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:1]
    if intermediate_size is not None:
        config.intermediate_size = int(intermediate_size)
    config._attn_implementation = "sdpa"
    return config


class _NativeEmbedding(nn.Module):
    """The frozen token embedding of a target that runs on the native forward only (a GGUF skeleton): rows
    de-quantised from the native model's own blocks on each call (``[*] int64 -> [*, h] float32``)."""

    def __init__(self, native) -> None:
        super().__init__()
        self.__dict__["native"] = native  # not a submodule: never trained, never saved

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        return self.native.embed_tokens(flat).reshape(*ids.shape, -1)


class EagleHead(nn.Module):
    """The trainable part of an EAGLE-style draft (see the module docstring).

    Args:
        target_config: the target's transformers ``LlamaConfig`` (hidden size, heads, RoPE).
        feature_layers: three indices into the target's ``hidden_states``.
        draft_vocab: ``[Vd] int64`` target token ids the head can propose (sorted, unique); ``None`` = all.
        intermediate_size: the head layer's MLP width (default: the target's); a narrower layer keeps the head's
            file and its draft step small on a large target (the Qwen2.5-Coder-1.5B head: 2,816 against 8,960).

    Raises:
        ValueError: ``feature_layers`` not three valid indices, a bad ``draft_vocab`` or ``intermediate_size``.
    """

    def __init__(self, target_config, feature_layers: tuple[int, int, int], draft_vocab: torch.Tensor | None = None,
                 intermediate_size: int | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        hidden = int(target_config.hidden_size)
        num_layers = int(target_config.num_hidden_layers)
        if len(feature_layers) != 3 or not all(0 <= int(i) <= num_layers for i in feature_layers):
            raise ValueError(f"feature_layers must be three indices in [0, {num_layers}], got {feature_layers}")
        vocab = int(target_config.vocab_size)
        if draft_vocab is None:
            draft_vocab = torch.arange(vocab)
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.int64)
        if draft_vocab.ndim != 1 or draft_vocab.numel() == 0:
            raise ValueError("draft_vocab must be a non-empty 1-D tensor of token ids")
        if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= vocab:
            raise ValueError(f"draft_vocab ids must lie in [0, {vocab})")
        if bool((draft_vocab[1:] <= draft_vocab[:-1]).any()):
            raise ValueError("draft_vocab must be sorted and unique")
        if intermediate_size is not None and int(intermediate_size) < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
        config = head_layer_config(target_config, intermediate_size)
        self.config = config
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("draft_vocab", draft_vocab, persistent=True)
        self.__dict__["_shared"] = None  # (embed, norm, head_weight): not submodules, never trained

    @property
    def hidden_size(self) -> int:
        return self.fuse.out_features

    def attach(self, target_model: nn.Module, native=None) -> "EagleHead":
        """Share the target's embedding, final norm and LM head (restricted to ``draft_vocab``) by reference.

        A target loaded without weights (a GGUF skeleton on the ``meta`` device) shares them from ``native``, its
        :class:`~specadapt.engine.native.NativeLlama` (:meth:`attach_native`).

        Raises:
            ValueError: a target without ``model.embed_tokens`` / ``model.norm`` / an output embedding, with
                another hidden size, or a skeleton without ``native``.
        """
        if _on_meta(target_model):
            if native is None:
                raise ValueError("a target loaded without weights (a GGUF skeleton) shares its embedding and LM "
                                 "head from its native forward: pass native=")
            return self.attach_native(native, float(target_model.config.rms_norm_eps))
        decoder = getattr(target_model, "model", None)
        embed = getattr(decoder, "embed_tokens", None)
        norm = getattr(decoder, "norm", None)
        head = target_model.get_output_embeddings() if hasattr(target_model, "get_output_embeddings") else None
        if embed is None or norm is None or head is None:
            raise ValueError(f"{type(target_model).__name__} lacks model.embed_tokens / model.norm / an LM head")
        if head.weight.shape[1] != self.hidden_size:
            raise ValueError(f"target hidden size {head.weight.shape[1]} != head hidden size {self.hidden_size}")
        with torch.no_grad():
            head_weight = head.weight.detach().index_select(0, self.draft_vocab.to(head.weight.device))
        self.__dict__["_shared"] = (embed, norm, head_weight)
        return self

    def attach_native(self, native, eps: float) -> "EagleHead":
        """Share a native-only target's embedding, final norm and LM head (a GGUF skeleton whose transformers
        modules hold no weights): the embedding is read from the native model's blocks on each call, the final
        norm's weight and the draft vocabulary's LM-head rows are de-quantised once (``[Vd, h]`` float32).

        Raises:
            ValueError: a native model of another hidden size.
        """
        if int(native.hidden_size) != self.hidden_size:
            raise ValueError(f"target hidden size {native.hidden_size} != head hidden size {self.hidden_size}")
        rows = native.lm_head.select_rows(self.draft_vocab.to(torch.int64)).dequantize().float()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        norm = LlamaRMSNorm(self.hidden_size, eps=eps).requires_grad_(False)  # the target's final norm, frozen
        with torch.no_grad():
            norm.weight.copy_(native.final_norm.float())
        self.__dict__["_shared"] = (_NativeEmbedding(native), norm, rows)
        return self

    @property
    def shared(self):
        if self._shared is None:
            raise RuntimeError("EagleHead.attach(target_model) must be called before use")
        return self._shared

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``[B, n, 3h]``: the concatenated low / middle / high target hidden states of one forward."""
        return torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ) -> SimpleNamespace:
        """One chunk through the head.

        Args:
            input_ids: ``[B, n] int64`` the tokens ``x_{i+1}`` paired with each feature.
            features: ``[B, n, 3h]`` target features (fused here) or ``[B, n, h]`` the head's own earlier
                outputs ``g`` (used as is).
            attention_mask: additive ``[B, 1, n, T+n]`` mask (see :class:`~specadapt.engine.kv.RaggedKVCache`)
                or ``None``: every cached key plus causal attention inside the chunk.
            position_ids: ``[B, n] int64`` logical positions (RoPE).
            cache: a transformers ``DynamicCache`` holding the head's one layer, or ``None``.
            logits_to_keep: 0 = logits at every column, k = the last k columns.

        Returns:
            ``SimpleNamespace(logits=[B, n|k, Vd], hidden=[B, n, h])``: logits over ``draft_vocab`` (map an
            index back to a target id with ``draft_vocab[index]``) and the layer outputs ``g`` (before norm).

        Raises:
            ValueError: a feature width that is neither 3h nor h.
        """
        embed, norm, head_weight = self.shared
        hidden = self.hidden_size
        dtype = self.fuse.weight.dtype
        features = features.to(dtype)
        if features.shape[-1] == 3 * hidden:
            features = self.fuse(features)
        elif features.shape[-1] != hidden:
            raise ValueError(f"features must have width {3 * hidden} or {hidden}, got {features.shape[-1]}")
        tokens = embed(input_ids).to(dtype)
        x = self.input_proj(torch.cat([tokens, features], dim=-1))
        batch, n = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None].expand(batch, n)
        if attention_mask is None:  # every cached key, causal inside the chunk
            past = cache.get_seq_length() if cache is not None else 0
            allowed = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(diagonal=past)
            attention_mask = torch.zeros(allowed.shape, dtype=dtype, device=x.device).masked_fill(
                ~allowed, torch.finfo(dtype).min)[None, None]
            attention_mask = attention_mask.expand(batch, 1, n, past + n)
        position_embeddings = self.rotary(x, position_ids)
        out = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
        )
        g = out[0] if isinstance(out, tuple) else out
        kept = g if logits_to_keep == 0 else g[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.logits_of(kept), hidden=g)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., h]`` head outputs ``g`` -> ``[..., Vd]`` logits over ``draft_vocab`` (the target's final norm,
        then its LM-head rows of the draft vocabulary)."""
        _, norm, head_weight = self.shared
        return torch.nn.functional.linear(norm(hidden).to(head_weight.dtype), head_weight)


def _on_meta(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "meta"


def save_eagle_head(head: EagleHead, path: str | Path, metadata: dict | None = None) -> None:
    """Write the head's own weights (and its ``draft_vocab``) to a safetensors file; the shared target
    modules are not saved. ``metadata`` (JSON-serialisable) is stored with ``feature_layers``."""
    from safetensors.torch import save_file

    meta = {"feature_layers": json.dumps(list(head.feature_layers)), "format": "specadapt-eagle-v1",
            "intermediate_size": json.dumps(int(head.config.intermediate_size))}
    for key, value in (metadata or {}).items():
        meta[key] = json.dumps(value)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, str(path), metadata=meta)


def load_eagle_head(path: str | Path, target_model: nn.Module, dtype: torch.dtype | None = None,
                    native=None) -> EagleHead:
    """Load a head saved by :func:`save_eagle_head` and attach it to ``target_model``.

    Args:
        path: the safetensors file.
        target_model: the target transformers model (its config must match the one the head was trained on).
        dtype: parameter dtype (default: the target's; float32 for a skeleton target).
        native: the target's native model; needed for a skeleton target (:meth:`EagleHead.attach`).

    Returns:
        The head in eval mode, on the target's device.

    Raises:
        FileNotFoundError: no such file. ValueError: not a specadapt EAGLE head, or shapes that do not fit
        the target.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no EAGLE head at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != "specadapt-eagle-v1" or "draft_vocab" not in tensors:
        raise ValueError(f"{path} is not a specadapt EAGLE head (format {meta.get('format')!r})")
    layers = tuple(json.loads(meta["feature_layers"]))
    width = json.loads(meta["intermediate_size"]) if "intermediate_size" in meta else None
    head = EagleHead(target_model.config, layers, tensors["draft_vocab"], intermediate_size=width)
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{path} does not fit the target {type(target_model).__name__}: {exc}") from exc
    param = next(target_model.parameters())
    if param.device.type == "meta":  # a GGUF skeleton: the head lives on the native model's device, float32
        if native is None:
            raise ValueError("a target loaded without weights (a GGUF skeleton) needs its native forward to load "
                             "an EAGLE head: pass native=")
        head.to(device=native.device, dtype=dtype or torch.float32)
        head.draft_vocab = head.draft_vocab.to(torch.int64)
        head.attach(target_model, native)
        return head.eval()
    head.to(device=param.device, dtype=dtype or param.dtype)
    head.draft_vocab = head.draft_vocab.to(torch.int64)
    head.attach(target_model)
    return head.eval()

