"""A GGUF file's own quantised blocks as :class:`~.formats.PackedWeight` s, under transformers' tensor names.

transformers de-quantises a GGUF file to float32 on load; the native forward can instead keep the file's blocks
(the target is then exactly the file's model: the same weights, de-quantised in the kernels). Block layouts
(ggml, ``ggml-common.h``), per block along K:

- Q8_0, 34 bytes per 32: ``d`` float16, 32 int8 codes; ``w = d * q``.
- Q4_1, 20 bytes per 32: ``d``, ``m`` float16, 16 bytes of nibbles (value j low, j + 16 high); ``w = d * q + m``.
- Q5_0, 22 bytes per 32: ``d`` float16, 32 high bits (uint32), 16 bytes of nibbles; ``w = d * (q - 16)``. Stored
  as Q8_0 with codes ``q - 16`` and the same ``d`` (exact; 8.5 bits a weight instead of 5.5).
- Q4_K, 144 bytes per 256: ``d``, ``dmin`` float16, 12 bytes of eight 6-bit ``sc`` / ``m`` pairs, 128 bytes of
  nibbles (64-value chunk c: byte j's low nibble is value 64c + j, its high nibble value 64c + 32 + j);
  ``w = (d * sc) * q - dmin * m`` per block of 32.
- Q6_K, 210 bytes per 256: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 ``sc`` (one per 16
  values), ``d`` float16; ``w = (d * sc) * (q - 32)``.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of Llama-architecture files for its RoPE
layout; transformers undoes it (``LlamaTensorProcessor``) and so do we, on whole rows, which blocks (along K)
never cross. Qwen2 files are not permuted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .formats import BLOCK, SUPER_BLOCK, PackedWeight, WeightFormat

__all__ = ["read_gguf_blocks", "read_gguf_model", "load_gguf_model_cached", "tensor_index", "GGUFModel", "GGUF_LLAMA_NAMES", "BLOCK_TYPES",
           "UnsupportedBlockType", "decode_tensor"]

#: GGUF tensor name -> transformers name, for the Llama family (``{i}`` = layer index).
GGUF_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

#: GGUF block type -> (the native format it is stored in, bytes per block, values per block).
BLOCK_TYPES = {
    "Q8_0": (WeightFormat.Q8_0, 34, BLOCK),
    "Q4_1": (WeightFormat.Q4_1, 20, BLOCK),
    "Q5_0": (WeightFormat.Q8_0, 22, BLOCK),
    "Q4_K": (WeightFormat.Q4_K, 144, SUPER_BLOCK),
    "Q6_K": (WeightFormat.Q6_K, 210, SUPER_BLOCK),
}
#: architectures whose q / k rows llama.cpp's converter permutes
_PERMUTED_QK = {"llama", "mistral"}


class UnsupportedBlockType(ValueError):
    """A GGUF matrix in a block type the native forward does not read (the message names the type and tensor)."""


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        key = "blk.{i}." + ".".join(parts[2:])
        target = GGUF_LLAMA_NAMES.get(key)
        return None if target is None else target.format(i=parts[1])
    return GGUF_LLAMA_NAMES.get(gguf_name)


def _in_layers(name: str, layers: int | None) -> bool:
    """Whether a transformers tensor name is kept when only decoder layers ``< layers`` are (``None``: all)."""
    return layers is None or not name.startswith("model.layers.") or int(name.split(".")[2]) < layers


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf_rows = gguf_rows[order]``."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


def _f16(raw: np.ndarray, start: int) -> torch.Tensor:
    """float16 at byte ``start`` of every block of ``raw [..., block_bytes] uint8`` -> ``[...] float16``."""
    return torch.from_numpy(np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0].copy())


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K blocks ``[..., 12]`` -> ``(sc, m)`` each ``[..., 8]`` uint8 (6-bit values):
    entries 0-3 are the low 6 bits of bytes 0-3 / 4-7; entries 4-7 take their low 4 bits from bytes 8-11 (sc:
    low nibble, m: high nibble) and their top 2 bits from the top of bytes 0-3 / 4-7."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def decode_tensor(type_name: str, raw: np.ndarray, rows: int, cols: int) -> PackedWeight:
    """One GGUF matrix ``[rows, cols]`` from its bytes ``raw`` (``rows * blocks * block_bytes`` uint8) as a
    :class:`PackedWeight` in the format of :data:`BLOCK_TYPES`.

    Raises:
        UnsupportedBlockType: a type not in :data:`BLOCK_TYPES`.
        ValueError: ``raw``'s size does not fit the shape, or ``cols`` is not a multiple of the block.
    """
    if type_name not in BLOCK_TYPES:
        raise UnsupportedBlockType(f"GGUF block type {type_name} is not read by the native forward "
                                   f"(supported: {', '.join(BLOCK_TYPES)})")
    fmt, block_bytes, per = BLOCK_TYPES[type_name]
    if cols % per:
        raise ValueError(f"a {type_name} matrix needs K divisible by {per}, got {cols}")
    nblk = cols // per
    raw = np.asarray(raw).reshape(-1)
    if raw.size != rows * nblk * block_bytes:
        raise ValueError(f"{raw.size} bytes do not hold a {rows} x {cols} {type_name} matrix")
    raw = raw.reshape(rows, nblk, block_bytes)
    if type_name == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(rows, cols).copy())
        return PackedWeight.from_blocks(fmt, codes, _f16(raw, 0))
    if type_name == "Q4_1":
        nibbles = raw[:, :, 4:]  # [N, nb, 16]: element j low, j + 16 high
        codes = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], axis=2).reshape(rows, cols).copy())
        return PackedWeight.from_blocks(fmt, codes, _f16(raw, 0), _f16(raw, 2))
    if type_name == "Q5_0":
        high = np.ascontiguousarray(raw[:, :, 2:6]).view(np.uint32)  # [N, nb, 1]
        bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, nb, 32]
        nibbles = raw[:, :, 6:]
        low = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)
        codes = (low | (bits << 4)).astype(np.int8) - np.int8(16)
        return PackedWeight.from_blocks(fmt, torch.from_numpy(codes.reshape(rows, cols)), _f16(raw, 0))
    if type_name == "Q4_K":
        sc, m = _q4_k_scales(raw[:, :, 4:16])
        qs = raw[:, :, 16:].reshape(rows, nblk, 4, 1, 32)
        codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, cols)  # sub-block 2c low, 2c + 1 high
        return PackedWeight.from_kquant(fmt, torch.from_numpy(codes), _f16(raw, 0),
                                        torch.from_numpy(sc.reshape(rows, nblk * 8)), dmin=_f16(raw, 2),
                                        m=torch.from_numpy(m.reshape(rows, nblk * 8)))
    # Q6_K: in each half of 128 values, value 32k + l takes its low nibble from ql[l] (k = 0), ql[32 + l] (1), their
    # high nibbles (2, 3), and its top 2 bits from bits 2k..2k+1 of qh[l]
    ql = raw[:, :, 0:128].reshape(rows, nblk, 2, 1, 64)
    low = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(rows, nblk, 2, 128)
    qh = raw[:, :, 128:192].reshape(rows, nblk, 2, 1, 32)
    high = ((qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 3).reshape(rows, nblk, 2, 128)
    codes = (low | (high << 4)).reshape(rows, cols)
    sc = np.ascontiguousarray(raw[:, :, 192:208]).view(np.int8).reshape(rows, nblk * 16)
    return PackedWeight.from_kquant(fmt, torch.from_numpy(codes), _f16(raw, 208), torch.from_numpy(sc.copy()))


@dataclass
class GGUFModel:
    """What :func:`read_gguf_model` read: block matrices and float32 vectors (norms, biases) under transformers'
    names, the architecture, and the matrices left out (name -> GGUF type) because their type is not read."""

    architecture: str
    matrices: dict[str, PackedWeight] = field(default_factory=dict)
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # transformers name -> GGUF type of every matrix


def tensor_index(path: str) -> dict:
    """``{"architecture": str, "tensors": {gguf name: [type name, [dims], byte offset, bytes]}}`` of a GGUF file.

    Parsing a GGUF header builds every metadata field (the tokenizer's 151,936 tokens and merges take several
    seconds), so the index is cached beside the other derived files of the file
    (:func:`specadapt.engine.cache_dirs.derived_cache_dir`) and read from there later.
    """
    import json

    from ..cache_dirs import derived_cache_dir

    cached = derived_cache_dir(path) / "index.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    import gguf  # a transformers dependency for GGUF loading; read-only use

    reader = gguf.GGUFReader(path)
    field_ = reader.fields.get("general.architecture")
    arch = bytes(field_.parts[field_.data[0]]).decode() if field_ is not None else "?"
    index = {"architecture": arch,
             "tensors": {t.name: [t.tensor_type.name, [int(v) for v in t.shape], int(t.data_offset), int(t.n_bytes)]
                         for t in reader.tensors}}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(index))
    tmp.replace(cached)
    return index


def read_gguf_model(path: str, num_heads: int, num_kv_heads: int, types: set[str] | None = None,
                    layers: int | None = None) -> GGUFModel:
    """Every tensor of a Llama-family GGUF file that the native forward reads, keyed by transformers name.

    Args:
        path: the ``.gguf`` file.
        num_heads, num_kv_heads: the model's attention heads (for the q / k row permutation of Llama files).
        types: read only matrices of these GGUF block types (``None``: every type in :data:`BLOCK_TYPES`);
            others are listed in ``unsupported`` when not in :data:`BLOCK_TYPES`.
        layers: read only decoder layers ``< layers`` (``None``: all).

    Raises:
        ValueError: a block tensor whose byte size does not fit its shape.
    """
    index = tensor_index(path)
    arch = index["architecture"]
    out = GGUFModel(architecture=arch)
    with open(path, "rb") as handle:
        _read_tensors(handle, index, arch, out, num_heads, num_kv_heads, types, layers)
    return out


def _read_tensors(handle, index: dict, arch: str, out: GGUFModel, num_heads: int, num_kv_heads: int,
                  types: set[str] | None, layers: int | None) -> None:
    # Each tensor's bytes are read into a buffer of their own and dropped once decoded (not a memory map of the
    # file, whose touched pages would count in the process's resident memory beside the decoded copy).
    for gguf_name, (kind, shape, offset, nbytes) in index["tensors"].items():
        name = _hf_name(gguf_name)
        if name is None:
            continue
        if not _in_layers(name, layers):
            continue
        def read() -> np.ndarray:
            handle.seek(offset)
            raw = np.frombuffer(handle.read(nbytes), dtype=np.uint8)
            if raw.size != nbytes:
                raise ValueError(f"{gguf_name}: the file ends {nbytes - raw.size} bytes before this tensor does")
            return raw

        if kind in ("F32", "F16") and len(shape) == 1:
            dtype = np.float32 if kind == "F32" else np.float16
            out.vectors[name] = torch.from_numpy(np.frombuffer(read(), dtype=dtype).astype(np.float32))
            continue
        out.types[name] = kind
        if kind not in BLOCK_TYPES:
            out.unsupported[name] = kind
            continue
        if types is not None and kind not in types:
            continue
        raw = read()
        cols, rows = shape[:2]  # ggml lists the fastest-varying dimension first
        try:
            if arch in _PERMUTED_QK and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
                heads = num_heads if ".attn_q." in gguf_name else num_kv_heads
                raw = np.asarray(raw).reshape(rows, -1)[_unpermute_rows(rows, heads)]
            out.matrices[name] = decode_tensor(kind, np.asarray(raw), rows, cols)
        except ValueError as exc:
            raise ValueError(f"{gguf_name}: {exc}") from None


_CACHE_DIR = "blocks"  # one safetensors shard per decoder layer plus one for the rest, and index.json
_CACHE_INDEX = "index.json"


def _shard_of(name: str) -> str:
    """The cache shard a tensor name belongs to: ``layer_NN`` for decoder layer NN, ``model`` otherwise."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    return f"layer_{int(m.group(1)):03d}" if m else "model"


def _save_block_cache(out: GGUFModel, folder: Path) -> None:
    """Write ``out`` as per-layer safetensors shards (so serialising holds one layer's bytes at a time, not a
    second copy of the whole model), then ``index.json`` last: a folder without it is incomplete."""
    import json
    import shutil

    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    keys = []
    for name, w in out.matrices.items():
        for k, t in zip(("data", "scales", "mins"), w.tensors()):
            if t is not None:
                shards.setdefault(_shard_of(name), {})[f"{name}::{k}"] = t.contiguous()
                keys.append(f"{name}::{k}")
    for name, v in out.vectors.items():
        shards.setdefault(_shard_of(name), {})[f"{name}::vector"] = v.contiguous()
    for shard, tensors in shards.items():
        save_file(tensors, str(tmp / f"{shard}.safetensors"))
    meta = {"architecture": out.architecture, "types": out.types, "unsupported": out.unsupported,
            "matrices": {n: [int(w.format), w.rows] for n, w in out.matrices.items()},
            "vectors": list(out.vectors), "keys": keys, "shards": sorted(shards)}
    (tmp / _CACHE_INDEX).write_text(json.dumps(meta), encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)


def _read_block_cache(folder: Path, layers: int | None) -> GGUFModel:
    import json

    from safetensors import safe_open

    meta = json.loads((folder / _CACHE_INDEX).read_text(encoding="utf-8"))
    out = GGUFModel(architecture=meta["architecture"])
    out.types, out.unsupported = meta["types"], meta["unsupported"]
    keys = set(meta["keys"])
    handles = {}
    try:
        def get(key: str, name: str) -> torch.Tensor:
            shard = _shard_of(name)
            if shard not in handles:
                handles[shard] = safe_open(str(folder / f"{shard}.safetensors"), framework="pt")
            return handles[shard].get_tensor(key)

        for name, (fmt, rows) in meta["matrices"].items():
            if _in_layers(name, layers):
                parts = [get(f"{name}::{k}", name) if f"{name}::{k}" in keys else None
                         for k in ("data", "scales", "mins")]
                out.matrices[name] = PackedWeight(WeightFormat(fmt), parts[0], parts[1], parts[2], rows)
        for name in meta["vectors"]:
            if _in_layers(name, layers):
                out.vectors[name] = get(f"{name}::vector", name)
    finally:
        handles.clear()
    return out


def load_gguf_model_cached(path: str, num_heads: int, num_kv_heads: int, layers: int | None = None) -> GGUFModel:
    """:func:`read_gguf_model` of every supported type, through a cache of the decoded, interleaved blocks.

    The first call decodes the file's blocks (about 15 s for a 1.1 GB file on our CPUs) and saves them with
    safetensors into the file's derived cache directory (``blocks/``: a shard per decoder layer, about the file's
    size in all, written one shard at a time so the first load's peak memory stays near the decoded model's);
    later calls read that back. Set ``SPECADAPT_NO_BLOCK_CACHE=1`` to decode every time.
    """
    import os

    from ..cache_dirs import derived_cache_dir

    folder = derived_cache_dir(path) / _CACHE_DIR
    use_cache = os.environ.get("SPECADAPT_NO_BLOCK_CACHE", "") in ("", "0")
    if use_cache and (folder / _CACHE_INDEX).is_file():
        return _read_block_cache(folder, layers)
    out = read_gguf_model(path, num_heads, num_kv_heads)
    if use_cache:
        _save_block_cache(out, folder)
        (folder.parent / "blocks.safetensors").unlink(missing_ok=True)  # the single-file cache of 2026-12-07
    out.matrices = {n: w for n, w in out.matrices.items() if _in_layers(n, layers)}
    out.vectors = {n: v for n, v in out.vectors.items() if _in_layers(n, layers)}
    return out


def read_gguf_blocks(path: str, num_heads: int, num_kv_heads: int) -> dict[str, PackedWeight]:
    """The Q8_0 / Q4_1 matrices of a Llama-family GGUF file, keyed by transformers name (the embedded default's
    ``int4`` path: other types are left to the de-quantised transformers model)."""
    return read_gguf_model(path, num_heads, num_kv_heads, types={"Q8_0", "Q4_1"}).matrices
