"""Weight formats of the native forward: float32, bfloat16, and the GGUF block formats Q8_0, Q4_1, Q4_K and Q6_K.

A :class:`PackedWeight` holds one matrix ``W [N, K]`` (``y = x @ W^T``):

- ``F32`` / ``BF16``: ``data [N, K]`` float32 / bfloat16, row-major;
- ``Q8_0``: ``w = d * q`` with int8 codes ``q`` and a float16 scale ``d`` per block of 32 along K;
- ``Q4_1``: ``w = d * q + m`` with 4-bit codes and float16 ``d``, ``m`` per block (GGUF's Q4_1);
- ``Q4_K``: ``w = (d * sc) * q - (dmin * m)``, 4-bit codes, float16 ``d``, ``dmin`` per super-block of 256 and
  6-bit ``sc``, ``m`` per block of 32 (llama.cpp's Q4_K; the two products are float32, exact);
- ``Q6_K``: ``w = (d * sc) * (q - 32)``, 6-bit codes, float16 ``d`` per super-block of 256 and an int8 ``sc``
  per 16 values (llama.cpp's Q6_K).

Block formats are stored in the kernels' 16-row interleaved layout (csrc/cpu/native_linear.h): rows in groups of
16, and within a (group, block) the 4 consecutive codes of each of the 16 rows side by side, so a vector of 16
32-bit lanes is 4 codes of 16 rows (Q4_1 packs two such vectors per 64 bytes, low and high nibbles).
:meth:`PackedWeight.from_blocks` / :meth:`PackedWeight.block_codes` convert from / to plain row-major codes.
``d * q`` is exact in float32, so :meth:`PackedWeight.dequantize` equals what the GGUF reader (and transformers)
produce for a file's blocks, bit for bit; the K-quants are de-quantised in ggml's order (the block's scale as a
float32 product, then times the code), which the ``gguf`` package's reference also follows. K-quants come only
from a file (:mod:`.gguf_blocks`); :func:`pack_weight` does not produce them.

K-quant storage (csrc/cpu/native_linear.h): ``data`` holds the codes in the Q4_1 layout (Q6_K: the low 4 bits so,
then two 64-byte planes of the high 2 bits per (group, block)), ``scales`` the super-block float16 values per row
of the group, ``mins`` the per-block bytes (Q4_K: 16 ``sc`` then 16 ``m``; Q6_K: 16 ``sc`` of the first 16
values, then 16 of the last 16).

The run-level formats (``--dtype`` of the native forward) map to these: ``float32`` -> F32, ``bfloat16`` -> BF16
weights, ``int8`` -> Q8_0, ``int4`` -> Q4_1 layers with a Q8_0 embedding / LM head (the layout of llama.cpp's
Q4_1 files). With ``int8`` / ``int4`` the activations are quantised to 8 bits per block of 32 for integer dot
products (:func:`linear_reference`); float32 and bfloat16 keep float32 activations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "WeightFormat",
    "RUN_FORMATS",
    "PackedWeight",
    "pack_weight",
    "dequantize_kquant",
    "FILE_FORMAT",
    "SUPER_BLOCK",
    "quantize_activations_reference",
    "linear_reference",
]

BLOCK = 32


class WeightFormat(enum.IntEnum):
    """Storage format of one matrix (the integer is the C++ kernels' format id)."""

    F32 = 0
    BF16 = 1
    Q8_0 = 2
    Q4_1 = 3
    Q4_K = 4
    Q6_K = 5

    @property
    def is_block(self) -> bool:
        return self in (WeightFormat.Q8_0, WeightFormat.Q4_1, WeightFormat.Q4_K, WeightFormat.Q6_K)

    @property
    def is_k(self) -> bool:
        """A K-quant (super-blocks of 256 values along K)."""
        return self in (WeightFormat.Q4_K, WeightFormat.Q6_K)

    @property
    def block_data_bytes(self) -> int:
        """Bytes of codes per (group of 16 rows, block of 32)."""
        return {WeightFormat.Q8_0: 512, WeightFormat.Q6_K: 384}.get(self, 256)


SUPER_BLOCK = 256


#: ``--dtype`` of the native forward -> (format of the decoder layers' matrices, format of embedding / LM head,
#: 8-bit activations).
RUN_FORMATS: dict[str, tuple[WeightFormat, WeightFormat, bool]] = {
    "float32": (WeightFormat.F32, WeightFormat.F32, False),
    "bfloat16": (WeightFormat.BF16, WeightFormat.BF16, False),
    "int8": (WeightFormat.Q8_0, WeightFormat.Q8_0, True),
    "int4": (WeightFormat.Q4_1, WeightFormat.Q8_0, True),
    # every matrix in its own block type from the GGUF file (NativeLlama.from_gguf); matrices that are not in a
    # file (an EAGLE head's) are packed as int4's
    "gguf": (WeightFormat.Q4_1, WeightFormat.Q8_0, True),
}
#: ``--dtype gguf``: the file's own blocks (Q8_0, Q4_1, Q5_0 as Q8_0, Q4_K, Q6_K), 8-bit activations.
FILE_FORMAT = "gguf"


def _groups(rows: int) -> int:
    return -(-rows // 16)


@dataclass
class PackedWeight:
    """One matrix ``[rows, cols]`` in a :class:`WeightFormat` (see the module docstring for the storage).

    Attributes:
        format: the storage format.
        data: ``[N, K]`` float32 / bfloat16; ``[G, nb * 512] int8`` (Q8_0), ``[G, nb * 256] uint8`` (Q4_1, Q4_K)
            or ``[G, nb * 384] uint8`` (Q6_K) in the interleaved layout, ``G = ceil(N / 16)``, ``nb = K / 32``.
        scales: ``[G, nb * 16] float16`` block scales (Q8_0, Q4_1), ``[G, nsb * 32]`` (Q4_K: d, dmin) or
            ``[G, nsb * 16]`` (Q6_K: d) super-block scales (``nsb = K / 256``), else ``None``.
        mins: ``[G, nb * 16] float16`` block minimums (Q4_1), ``[G, nb * 32]`` uint8 (Q4_K) / int8 (Q6_K)
            block bytes, else ``None``.
        num_rows: ``N`` (block formats pad the last group to 16 rows).
    """

    format: WeightFormat
    data: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    num_rows: int | None = None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0]) if self.num_rows is None else int(self.num_rows)

    @property
    def cols(self) -> int:
        if not self.format.is_block:
            return int(self.data.shape[1])
        return int(self.data.shape[1]) // self.format.block_data_bytes * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes read by one pass over the matrix (data, scales and mins)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self.data, self.scales, self.mins

    # ---- the interleaved layout <-> row-major codes ---------------------------------------------------------
    @classmethod
    def from_blocks(cls, fmt: WeightFormat, codes: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor | None = None) -> "PackedWeight":
        """Interleave row-major block codes: ``codes [N, K]`` (int8 for Q8_0, 0..15 for Q4_1), ``scales`` /
        ``mins`` ``[N, K/32] float16``."""
        fmt = WeightFormat(fmt)
        rows, cols = codes.shape
        nb, groups = cols // BLOCK, _groups(rows)
        pad = groups * 16 - rows

        def grouped(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [G, 16, ...] with zero padding rows
            if pad:
                t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
            return t.reshape(groups, 16, *t.shape[1:])

        def interleave_scales(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return grouped(t.to(torch.float16)).permute(0, 2, 1).reshape(groups, nb * 16).contiguous()

        c = grouped(codes).reshape(groups, 16, nb, 8, 4)  # [G, r, b, chunk, j]: k = 4 * chunk + j
        if fmt == WeightFormat.Q8_0:
            data = c.to(torch.int8).permute(0, 2, 3, 1, 4).reshape(groups, nb * 512)
        elif fmt == WeightFormat.Q4_1:
            c = c.to(torch.uint8)
            low, high = c[:, :, :, :4], c[:, :, :, 4:]  # chunks 0-3 (low nibbles) and 4-7 (high nibbles)
            data = (low | (high << 4)).permute(0, 2, 3, 1, 4).reshape(groups, nb * 256)
        else:
            raise ValueError(f"{fmt.name} is not a block format")
        return cls(fmt, data.contiguous(), interleave_scales(scales), interleave_scales(mins), rows)

    @classmethod
    def from_kquant(cls, fmt: WeightFormat, codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor,
                    dmin: torch.Tensor | None = None, m: torch.Tensor | None = None) -> "PackedWeight":
        """Interleave a K-quant matrix given row-major parts.

        Args:
            fmt: ``Q4_K`` or ``Q6_K``.
            codes: ``[N, K]`` unsigned codes (0..15 for Q4_K, 0..63 for Q6_K), ``K`` divisible by 256.
            d: ``[N, K/256] float16`` super-block scales; ``dmin`` the same for Q4_K's minimums.
            sc: ``[N, K/32] uint8`` (Q4_K, 0..63) or ``[N, K/16] int8`` (Q6_K) block scales; ``m``: ``[N, K/32]
                uint8`` Q4_K block minimums.

        Raises:
            ValueError: another format, ``K`` not divisible by 256, or missing Q4_K minimums.
        """
        fmt = WeightFormat(fmt)
        rows, cols = codes.shape
        if not fmt.is_k or cols % SUPER_BLOCK:
            raise ValueError(f"from_kquant builds Q4_K / Q6_K with K divisible by 256, got {fmt.name}, K = {cols}")
        if fmt == WeightFormat.Q4_K and (dmin is None or m is None):
            raise ValueError("Q4_K needs dmin and m")
        nb, nsb, groups = cols // BLOCK, cols // SUPER_BLOCK, _groups(rows)
        pad = groups * 16 - rows

        def grouped(t: torch.Tensor) -> torch.Tensor:
            if pad:
                t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
            return t.reshape(groups, 16, *t.shape[1:])

        c = grouped(codes.to(torch.uint8)).reshape(groups, 16, nb, 8, 4)  # [G, r, b, chunk, j]
        low = c & 15
        nibbles = (low[:, :, :, :4] | (low[:, :, :, 4:] << 4)).permute(0, 2, 3, 1, 4).reshape(groups, nb, 256)
        if fmt == WeightFormat.Q6_K:
            high = (c >> 4).reshape(groups, 16, nb, 2, 4, 4)  # [G, r, b, plane, i, j]: chunk 4 * plane + i
            planes = high[:, :, :, :, 0] | (high[:, :, :, :, 1] << 2) | (high[:, :, :, :, 2] << 4) | \
                (high[:, :, :, :, 3] << 6)  # [G, r, b, plane, j]
            planes = planes.permute(0, 2, 3, 1, 4).reshape(groups, nb, 128)
            data = torch.cat([nibbles, planes], dim=2).reshape(groups, nb * 384)
            supers = grouped(d.to(torch.float16)).permute(0, 2, 1).reshape(groups, nsb * 16)
            subs = grouped(sc.to(torch.int8)).reshape(groups, 16, nb, 2).permute(0, 2, 3, 1).reshape(groups, nb * 32)
        else:
            data = nibbles.reshape(groups, nb * 256)
            both = torch.stack([grouped(d.to(torch.float16)), grouped(dmin.to(torch.float16))], dim=2)  # [G, r, 2, nsb]
            supers = both.permute(0, 3, 2, 1).reshape(groups, nsb * 32)
            bs = torch.stack([grouped(sc.to(torch.uint8)), grouped(m.to(torch.uint8))], dim=2)  # [G, r, 2, nb]
            subs = bs.permute(0, 3, 2, 1).reshape(groups, nb * 32)
        return cls(fmt, data.contiguous(), supers.contiguous(), subs.contiguous(), rows)

    def kquant_parts(self) -> dict[str, torch.Tensor]:
        """Row-major parts of a K-quant (the inverse of :meth:`from_kquant`): ``codes [N, K] int32``, ``d``
        ``[N, K/256] float16``, ``sc`` (``[N, K/32] uint8`` / Q6_K ``[N, K/16] int8``), and for Q4_K ``dmin``,
        ``m``."""
        if not self.format.is_k:
            raise ValueError(f"{self.format.name} is not a K-quant")
        rows, cols = self.rows, self.cols
        nb, nsb, groups = cols // BLOCK, cols // SUPER_BLOCK, self.data.shape[0]
        raw = self.data.view(groups, nb, self.format.block_data_bytes).to(torch.int32)
        nib = raw[:, :, :256].reshape(groups, nb, 4, 16, 4)  # [G, b, i, r, j]
        c = torch.cat([nib & 15, nib >> 4], dim=2)  # [G, b, chunk, r, j]
        if self.format == WeightFormat.Q6_K:
            planes = raw[:, :, 256:].reshape(groups, nb, 2, 16, 4)  # [G, b, plane, r, j]
            high = torch.stack([(planes >> (2 * i)) & 3 for i in range(4)], dim=3)  # [G, b, plane, i, r, j]
            c = c | (high.reshape(groups, nb, 8, 16, 4) << 4)
        codes = c.permute(0, 3, 1, 2, 4).reshape(groups * 16, cols)[:rows]
        out = {"codes": codes}
        if self.format == WeightFormat.Q6_K:
            out["d"] = self.scales.view(groups, nsb, 16).permute(0, 2, 1).reshape(groups * 16, nsb)[:rows]
            out["sc"] = self.mins.view(groups, nb, 2, 16).permute(0, 3, 1, 2).reshape(groups * 16, 2 * nb)[:rows]
        else:
            sup = self.scales.view(groups, nsb, 2, 16).permute(0, 3, 2, 1)  # [G, r, 2, nsb]
            out["d"], out["dmin"] = (sup[:, :, k].reshape(groups * 16, nsb)[:rows] for k in range(2))
            sub = self.mins.view(groups, nb, 2, 16).permute(0, 3, 2, 1)  # [G, r, 2, nb]
            out["sc"], out["m"] = (sub[:, :, k].reshape(groups * 16, nb)[:rows] for k in range(2))
        return out

    def block_codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row-major ``(codes [N, K] int32, scales [N, K/32] float16, mins or None)`` of Q8_0 / Q4_1."""
        if not self.format.is_block or self.format.is_k:
            raise ValueError(f"{self.format.name} has no per-block codes and scales (see kquant_parts)")
        rows, cols = self.rows, self.cols
        nb, groups = cols // BLOCK, self.data.shape[0]
        if self.format == WeightFormat.Q8_0:
            c = self.data.view(groups, nb, 8, 16, 4).to(torch.int32)
        else:
            raw = self.data.view(groups, nb, 4, 16, 4).to(torch.int32)
            c = torch.cat([raw & 15, raw >> 4], dim=2)  # chunks 0-3, then 4-7
        codes = c.permute(0, 3, 1, 2, 4).reshape(groups * 16, cols)[:rows]

        def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.view(groups, nb, 16).permute(0, 2, 1).reshape(groups * 16, nb)[:rows]

        return codes, rows_of(self.scales), rows_of(self.mins)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix ``[N, K]`` this weight stands for (exact; pure PyTorch)."""
        if not self.format.is_block:
            return self.data.float()
        if self.format.is_k:
            return dequantize_kquant(self.format, self.kquant_parts())
        codes, d, m = self.block_codes()
        wide = lambda t: t.float().repeat_interleave(BLOCK, dim=1)  # noqa: E731
        if self.format == WeightFormat.Q8_0:
            return wide(d) * codes.float()
        return torch.addcmul(wide(m), wide(d), codes.float())

    def select_groups(self, groups: torch.Tensor) -> "PackedWeight":
        """The weight made of the 16-row groups ``groups`` (``[g] int64``, block formats): ``16 g`` rows, group
        ``groups[i]``'s rows ``16 i .. 16 i + 15`` (a padded last group keeps its zero padding rows)."""
        if not self.format.is_block:
            raise ValueError(f"{self.format.name} is not stored in 16-row groups")
        count = self.data.shape[0]
        pick = lambda t: None if t is None else t.view(count, -1).index_select(0, groups).contiguous()  # noqa: E731
        return PackedWeight(self.format, pick(self.data), pick(self.scales), pick(self.mins), 16 * int(groups.numel()))

    def select_rows(self, rows: torch.Tensor, chunk_groups: int = 256) -> "PackedWeight":
        """A new weight holding only ``rows`` (``[R] int64``, any order, repeats allowed), e.g. an EAGLE head's
        draft vocabulary.

        Block formats are unpacked only in the 16-row groups that hold a selected row, ``chunk_groups`` groups at
        a time, so selecting 16K rows of a 152K x 1536 K-quant LM head never materialises the whole matrix's
        codes (a 0.9 GB int32 copy that took 7 s on 2 cores).

        Raises:
            IndexError: a row outside ``[0, rows)``.
        """
        rows = rows.to(self.data.device, torch.int64).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"select_rows: rows must lie in [0, {self.rows}), got [{int(rows.min())}, "
                             f"{int(rows.max())}]")
        if not self.format.is_block:
            return PackedWeight(self.format, self.data.index_select(0, rows).contiguous())
        groups, inverse = torch.unique(rows // 16, sorted=True, return_inverse=True)
        local = inverse * 16 + rows % 16  # each selected row's place in the weight of the unique groups
        order = torch.argsort(local, stable=True)
        ranked = local[order]
        pieces: list[dict[str, torch.Tensor]] = []
        start = 0
        for first in range(0, int(groups.numel()), chunk_groups):
            sub = self.select_groups(groups[first:first + chunk_groups])
            end = int(torch.searchsorted(ranked, torch.tensor(16 * (first + chunk_groups))))
            take = ranked[start:end] - 16 * first
            start = end
            if self.format.is_k:
                parts = sub.kquant_parts()
                parts["codes"] = parts["codes"].to(torch.uint8)  # codes < 64: a quarter of the int32 bytes
            else:
                parts = dict(zip(("codes", "d", "m"), sub.block_codes()))
                parts["codes"] = parts["codes"].to(torch.int8 if self.format == WeightFormat.Q8_0 else torch.uint8)
            pieces.append({k: v.index_select(0, take) for k, v in parts.items() if v is not None})
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        joined = {k: torch.cat([p[k] for p in pieces]).index_select(0, back) for k in pieces[0]} if pieces else None
        if joined is None:  # no rows: an empty weight of this format
            empty = self.select_groups(groups)
            return PackedWeight(self.format, empty.data, empty.scales, empty.mins, 0)
        if self.format.is_k:
            return PackedWeight.from_kquant(self.format, **joined)
        return PackedWeight.from_blocks(self.format, joined["codes"], joined["d"], joined.get("m"))

    def copy_(self, other: "PackedWeight") -> None:
        """Overwrite this weight's storage in place with ``other`` (same format and shapes), so kernels, compiled
        code and captured graphs holding these tensors see the new values.

        Raises:
            ValueError: another format or shape.
        """
        if other.format != self.format or other.data.shape != self.data.shape or other.rows != self.rows:
            raise ValueError(f"cannot copy a {other.format.name} {other.rows} x {other.cols} weight into a "
                             f"{self.format.name} {self.rows} x {self.cols} one")
        for mine, theirs in zip(self.tensors(), other.tensors()):
            if mine is not None:
                mine.copy_(theirs)

    def to(self, device) -> "PackedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedWeight(self.format, move(self.data), move(self.scales), move(self.mins), self.num_rows)


def dequantize_kquant(fmt: WeightFormat, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[N, K] float32`` from :meth:`PackedWeight.kquant_parts`, in ggml's order: Q4_K ``(d * sc) * q - dmin *
    m``, Q6_K ``(d * sc) * (q - 32)``, each product rounded to float32 (exact but for the last)."""
    codes = parts["codes"].float()
    if fmt == WeightFormat.Q6_K:
        scale = parts["d"].float().repeat_interleave(16, dim=1) * parts["sc"].float()  # [N, K/16]
        return scale.repeat_interleave(16, dim=1) * (codes - 32)
    scale = parts["d"].float().repeat_interleave(8, dim=1) * parts["sc"].float()  # [N, K/32]
    minimum = parts["dmin"].float().repeat_interleave(8, dim=1) * parts["m"].float()
    return scale.repeat_interleave(BLOCK, dim=1) * codes - minimum.repeat_interleave(BLOCK, dim=1)


def pack_weight(weight: torch.Tensor, fmt: WeightFormat) -> PackedWeight:
    """Store a float matrix ``[N, K]`` in ``fmt`` (round to nearest for the block formats).

    Q8_0: ``d = max|w| / 127`` per block (float16), ``q = round(w / d)``. Q4_1: ``d = (max - min) / 15``,
    ``m = min`` (float16), ``q = clamp(round((w - m) / d), 0, 15)``. Blocks of zeros get ``d = 0``.

    Raises:
        ValueError: not a 2-D tensor, or a block format with ``K`` not divisible by 32.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
    fmt = WeightFormat(fmt)
    w = weight.detach().float().cpu()
    if fmt == WeightFormat.F32:
        return PackedWeight(fmt, w.contiguous().clone())
    if fmt == WeightFormat.BF16:
        return PackedWeight(fmt, w.to(torch.bfloat16).contiguous())
    if fmt.is_k:
        raise ValueError(f"{fmt.name} weights come from a GGUF file only: pack_weight quantises to Q8_0 or Q4_1")
    rows, cols = w.shape
    if cols % BLOCK:
        raise ValueError(f"{fmt.name} needs K divisible by {BLOCK}, got K = {cols}")
    from ... import kernels

    if kernels.has_op_for("native_pack", w.device):  # the same rule in C++ (Test-Time Speculation re-packs often)
        parts = torch.ops.specadapt.native_pack(w.contiguous(), int(fmt))
        return PackedWeight(fmt, parts[0], parts[1], parts[2] if len(parts) > 2 else None, rows)
    return _pack_blocks_reference(w, fmt)


def _pack_blocks_reference(w: torch.Tensor, fmt: WeightFormat) -> PackedWeight:
    """:func:`pack_weight` for the block formats in PyTorch operations (the C++ op's reference)."""
    rows, cols = w.shape
    blocks = w.view(rows, cols // BLOCK, BLOCK)
    if fmt == WeightFormat.Q8_0:
        d = (blocks.abs().amax(dim=2) / 127).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d.float()))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127)
        return PackedWeight.from_blocks(fmt, q.reshape(rows, cols).to(torch.int8), d)
    low, high = blocks.amin(dim=2), blocks.amax(dim=2)
    d = ((high - low) / 15).half()
    m = low.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d.float()))
    q = torch.round((blocks - m.float()[..., None]) * inv[..., None]).clamp(0, 15)
    return PackedWeight.from_blocks(fmt, q.reshape(rows, cols).to(torch.uint8), d, m)


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit block quantisation of activations ``x [M, K] float32`` (K divisible by 32), the kernels' rule.

    Returns:
        ``(codes [M, K] int8, scales [M, K/32] float32)`` with ``e = max|x| / 127`` per block and
        ``codes = round(x * (1 / e))`` (0 for an all-zero block): ``x ~ e * codes``.
    """
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    e = blocks.abs().amax(dim=2) / 127
    inv = torch.where(e > 0, 1 / e, torch.zeros_like(e))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    return codes.reshape(rows, cols).to(torch.int8), e


def linear_reference(x: torch.Tensor, weight: PackedWeight, int8_activations: bool = False) -> torch.Tensor:
    """``x [..., K] @ W^T`` in float64, the law the C++ / CUDA kernels implement (returned as float32).

    Block formats (and ``int8_activations``) first replace ``x`` by its 8-bit block quantisation
    (:func:`quantize_activations_reference`), as the kernels do.

    Raises:
        ValueError: ``x``'s last dimension is not ``K``, or 8-bit activations with a float format.
    """
    int8_activations = int8_activations or weight.format.is_block
    if x.shape[-1] != weight.cols:
        raise ValueError(f"x must be [..., {weight.cols}], got {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.cols).float()
    if int8_activations:
        if not weight.format.is_block:
            raise ValueError(f"8-bit activations need a block format, got {weight.format.name}")
        codes, e = quantize_activations_reference(x2)
        x2 = codes.double() * e.double().repeat_interleave(BLOCK, dim=1)
    y = x2.double() @ weight.dequantize().double().T
    return y.float().reshape(*lead, weight.rows)
