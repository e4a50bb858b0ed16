"""A GGUF file's own quantised blocks as :class:`~.formats.PackedWeight` s, under transformers' tensor names.

transformers de-quantises a GGUF file to float32 on load; the native forward can instead keep the file's Q8_0 /
Q4_1 blocks (the target is then exactly the file's model: the same weights, de-quantised in the kernels). Block
layouts (ggml): Q8_0 is 34 bytes per 32 values (``d`` float16, 32 int8 codes), Q4_1 is 20 bytes (``d``, ``m``
float16, 16 bytes of nibbles). llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its RoPE
layout; transformers undoes it (``LlamaTensorProcessor``), and so do we, on whole rows, which blocks (along K)
never cross.
"""

from __future__ import annotations

import numpy as np
import torch

from .formats import BLOCK, PackedWeight, WeightFormat

__all__ = ["read_gguf_blocks", "GGUF_LLAMA_NAMES"]

#: GGUF tensor name -> transformers name, for the Llama family (``{i}`` = layer index).
GGUF_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_BLOCK_TYPES = {"Q8_0": (WeightFormat.Q8_0, 34), "Q4_1": (WeightFormat.Q4_1, 20)}


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        key = "blk.{i}." + ".".join(parts[2:])
        target = GGUF_LLAMA_NAMES.get(key)
        return None if target is None else target.format(i=parts[1])
    return GGUF_LLAMA_NAMES.get(gguf_name)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf_rows = gguf_rows[order]``."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def read_gguf_blocks(path: str, num_heads: int, num_kv_heads: int) -> dict[str, PackedWeight]:
    """The Q8_0 / Q4_1 matrices of a Llama-family GGUF file, keyed by transformers name.

    Tensors in other types (float32 norms, other quantisations) are left out: the caller takes those from the
    de-quantised transformers model.

    Args:
        path: the ``.gguf`` file.
        num_heads, num_kv_heads: the model's attention heads (for the q / k row permutation).

    Raises:
        ValueError: a block tensor whose byte size does not fit its shape.
    """
    import gguf  # a transformers dependency for GGUF loading; read-only use

    reader = gguf.GGUFReader(path)
    out: dict[str, PackedWeight] = {}
    for tensor in reader.tensors:
        kind = _BLOCK_TYPES.get(tensor.tensor_type.name)
        name = _hf_name(tensor.name)
        if kind is None or name is None:
            continue
        fmt, block_bytes = kind
        cols, rows = (int(v) for v in tensor.shape[:2])  # ggml lists the fastest-varying dimension first
        raw = np.asarray(tensor.data)
        if raw.size != rows * (cols // BLOCK) * block_bytes:
            raise ValueError(f"{tensor.name}: {raw.size} bytes do not hold a {rows} x {cols} {fmt.name} matrix")
        raw = raw.reshape(rows, cols // BLOCK, block_bytes)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
            raw = raw[_unpermute_rows(rows, heads)]
        d = torch.from_numpy(np.ascontiguousarray(raw[:, :, 0:2]).view(np.float16)[..., 0].copy())
        if fmt == WeightFormat.Q8_0:
            codes = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(rows, cols).copy())
            out[name] = PackedWeight.from_blocks(fmt, codes, d)
        else:
            m = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:4]).view(np.float16)[..., 0].copy())
            nibbles = np.ascontiguousarray(raw[:, :, 4:])  # [N, nb, 16]: element j low, j + 16 high
            codes = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], axis=2).reshape(rows, cols).copy())
            out[name] = PackedWeight.from_blocks(fmt, codes, d, m)
    return out
