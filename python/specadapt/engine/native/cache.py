"""A preallocated, slot-based static KV cache for the native forward, behind the interface of
:class:`~specadapt.engine.kv.RaggedKVCache` (so the loop, the drafts and Test-Time Speculation use either).

Each request (row) occupies one slot of ``capacity`` positions: ``k_cache / v_cache [layers, slots, kv_heads,
capacity, head_dim]``. A forward appends a ragged chunk to each row (row ``r``'s first ``num_valid[r]`` columns)
at indices ``lengths[r] ..``; only those real tokens are packed into the forward (holes cost nothing), and
logits are computed only for the rows asked for. Rolling back is a length change (nothing is copied); keeping one
root-to-leaf path of a token tree moves the kept nodes' keys / values next to the prefix (at most ``n`` entries);
finished rows free their slot, which a later request can reuse. The capacity grows (doubling, with a log line)
only if a row would overflow it; the engine sizes it from the prompts and ``max_new_tokens`` up front.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from .model import TokenBatch

logger = logging.getLogger(__name__)

__all__ = ["SlotKVCache", "MAX_TREE_NODES"]

#: Token trees are passed to the kernels as 64-bit ancestor masks over the chunk.
MAX_TREE_NODES = 63


class SlotKVCache:
    """Slot KV cache + native forward of one model (a :class:`~.model.NativeLlama` or an EAGLE head).

    Args:
        model: the native model (``new_kv``, ``forward``, ``num_layers``, ``hidden_size``).
        batch_size: rows (requests) at the start.
        capacity: positions per slot (grown on demand).
        slots: slots to allocate (default ``batch_size``; more let :meth:`repeat_interleave` and new requests
            use free slots without reallocating).
        capture: transformers ``hidden_states`` indices to return when ``output_hidden_states`` is asked
            (default: all ``0 .. layers``).
    """

    packed = True
    #: rows that leave free their slot and :meth:`add_rows` takes free slots, so a running batch may empty and
    #: refill (continuous batching) without a new cache
    add_rows_reuses_slots = True

    def __init__(self, model, batch_size: int, capacity: int = 256, slots: int | None = None,
                 capture: tuple[int, ...] | None = None) -> None:
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        self.model = model
        self.device = model.device
        slots = max(batch_size, slots or 0, 1)
        self.k, self.v = model.new_kv(slots, max(int(capacity), 16))
        self.capacity = int(self.v.shape[3])
        self.row_slot = torch.arange(batch_size, dtype=torch.int64)
        self.free = list(range(batch_size, slots))
        self.lengths = torch.zeros(batch_size, dtype=torch.int64)
        self.capture = capture
        self._chunk_start: torch.Tensor | None = None
        self._chunk_width = 0
        self.num_forwards = 0
        self.num_packed_forwards = 0
        self.num_compactions = 0

    # ---- sizes ---------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.row_slot.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.k.shape[1])

    @property
    def physical_length(self) -> int:
        return int(self.lengths.max()) if self.batch_size else 0

    def _grow(self, need: int, slots: int | None = None) -> None:
        capacity = self.capacity
        while capacity < need:
            capacity *= 2
        slots = slots or self.num_slots
        if capacity == self.capacity and slots == self.num_slots:
            return
        logger.info("slot KV cache: growing to %d slots x %d positions", slots, capacity)
        k, v = self.model.new_kv(slots, capacity)
        k[:, : self.num_slots, :, : self.k.shape[3]] = self.k
        v[:, : self.num_slots, :, : self.capacity] = self.v
        self.free += list(range(self.num_slots, slots))
        self.k, self.v, self.capacity = k, v, int(v.shape[3])

    def _copy_positions(self, dst_slot: int, dst: torch.Tensor, src_slot: int, src: torch.Tensor) -> None:
        """Copy cache entries ``src`` of ``src_slot`` to ``dst`` of ``dst_slot`` (``[P] int64`` indices, every layer)."""
        dst, src = dst.to(self.device), src.to(self.device)
        self.k[:, dst_slot, :, dst // 16, :, dst % 16] = self.k[:, src_slot, :, src // 16, :, src % 16]
        self.v[:, dst_slot, :, dst] = self.v[:, src_slot, :, src]

    # ---- forward -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, num_valid: torch.Tensor, logits_to_keep: int = 0,
                chunk_mask: torch.Tensor | None = None, chunk_positions: torch.Tensor | None = None,
                return_outputs: bool = False, output_hidden_states: bool = False, features: torch.Tensor | None = None,
                logit_columns: torch.Tensor | None = None, hidden_from_row: int = 0, **unused):
        """Append one ragged chunk and run it (the contract of :meth:`RaggedKVCache.forward`).

        Args:
            input_ids: ``[B, n] int64``; row ``r``'s real tokens in its first ``num_valid[r]`` columns.
            num_valid: ``[B] int64`` in ``[0, n]``.
            logits_to_keep: 0 = logits of every column, ``k`` = of the last ``k`` columns only.
            chunk_mask: optional ``[B, n, n] bool`` tree attention mask (ancestors and self), ``n <= 63``.
            chunk_positions: optional ``[B, n] int64`` position offsets (tree depths).
            return_outputs: return an object (``logits``, ``hidden_states``, ``hidden``) instead of the logits.
            output_hidden_states: fill ``hidden_states`` (a tuple indexed like transformers', ``None`` where
                not captured), each ``[B, n, h]``.
            features: ``[B, n, F]`` per-token inputs of an EAGLE head (target features or its own outputs).
            logit_columns: optional ``[B] int64``: the one column of each row whose outputs are read (e.g. a
                ragged catch-up's last real token, ``num_valid[r] - 1``); a row whose column is a hole or
                negative gets zeros. Overrides ``logits_to_keep``; the logits and the output object's ``hidden``
                are then ``[B, 1, ...]``, and the last layer runs past its cache writes for those tokens only
                (the cache is written as without it).
            hidden_from_row: ``hidden_states`` and ``hidden`` hold rows ``hidden_from_row..B-1`` only (a join's
                new rows: the running rows take no tokens, and unpacking them is the larger part of the
                feature capture's cost at batch 32); rows before it must have ``num_valid = 0``. Ignored for
                ``hidden`` with ``logit_columns``.

        Returns:
            ``[B, n or k or 1, V] float32`` logits (zeros in holes), or the output object.

        Raises:
            ValueError: shapes that do not match the cache, ``num_valid`` outside ``[0, n]``, a tree wider than
                :data:`MAX_TREE_NODES`, ``hidden_from_row`` outside ``[0, B]`` or past a row with tokens.
        """
        batch, width = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(f"input_ids has {batch} rows but the cache has {self.batch_size}")
        # The chunk is packed with Python integers: a decode round's chunks hold a few tokens a row, and each small
        # tensor operation costs about 5 us on these 2-core hosts (this packing was ~20 of them a call).
        counts = num_valid.to("cpu", torch.int64).tolist()
        if any(c < 0 or c > width for c in counts):
            raise ValueError(f"num_valid must lie in [0, {width}]")
        first = int(hidden_from_row)
        if not 0 <= first <= batch or any(counts[:first]):
            raise ValueError(f"hidden_from_row must lie in [0, {batch}] with no tokens in the rows before it, got "
                             f"{hidden_from_row}")
        start = self.lengths
        starts, slots = start.tolist(), self.row_slot.tolist()
        need = max((s + c for s, c in zip(starts, counts)), default=0)
        if need > self.capacity:
            self._grow(need)
        dense = all(c == width for c in counts)  # every column real: packed token p is (p // width, p % width)
        offsets, rows_l, cols_l, slot_l, index_l = [], [], [], [], []
        for r, c in enumerate(counts):
            offsets.append(len(index_l))
            rows_l += [r] * c
            cols_l += range(c)
            slot_l += [slots[r]] * c
            index_l += range(starts[r], starts[r] + c)
        packed = torch.tensor([rows_l, cols_l, slot_l, index_l], dtype=torch.int64)  # [4, N]
        rows_idx, cols_idx, slot_t, index = packed[0], packed[1], packed[2], packed[3]
        if chunk_positions is None:
            position = index
        else:
            position = (index - cols_idx) + chunk_positions.to("cpu", torch.int64)[rows_idx, cols_idx]
        if chunk_mask is None:
            zeros = torch.zeros_like(index)
            visible, tree_base, tree_mask = index + 1, zeros, zeros
        else:
            if width > MAX_TREE_NODES:
                raise ValueError(f"token trees of more than {MAX_TREE_NODES} nodes are not supported, got {width}")
            valid = torch.arange(width)[None, :] < torch.tensor(counts, dtype=torch.int64)[:, None]
            bits = (chunk_mask.to("cpu", torch.bool) & valid[:, None, :]).to(torch.int64)
            weights = torch.bitwise_left_shift(torch.ones(width, dtype=torch.int64), torch.arange(width))
            tree = (bits * weights).sum(-1)  # [B, n] ancestor masks over the chunk
            base = index - cols_idx
            visible, tree_base, tree_mask = base, base, tree[rows_idx, cols_idx]
        dev = self.device
        ids = input_ids.to("cpu", torch.int64)
        ids = ids.reshape(-1) if dense else ids[rows_idx, cols_idx]
        tokens = TokenBatch(ids=ids.to(dev), slot=slot_t.to(dev), index=index.to(dev), position=position.to(dev),
                            visible=visible.to(dev), tree_base=tree_base.to(dev), tree_mask=tree_mask.to(dev))
        # logit_sel: the packed tokens whose logits are computed, as (row, output column) pairs
        if logit_columns is not None:
            wanted = logit_columns.to("cpu", torch.int64)
            if wanted.shape != (batch,):
                raise ValueError(f"logit_columns must have shape [{batch}], got {tuple(wanted.shape)}")
            logit_sel = [(r, 0, offsets[r] + w) for r, w in enumerate(wanted.tolist()) if 0 <= w < counts[r]]
            out_width = 1
        elif logits_to_keep:
            keep_cols = width - int(logits_to_keep)
            logit_sel = [(r, col - keep_cols, offsets[r] + col) for r, c in enumerate(counts)
                         for col in range(max(keep_cols, 0), c)]
            out_width = int(logits_to_keep)
        else:
            logit_sel, out_width = None, width
        logit_rows = None if logit_sel is None else torch.tensor([p for _, _, p in logit_sel], dtype=torch.int64)
        # a selection that fills every output row, in [B, out_width] order: the packed outputs are the result as is
        outputs_full = logit_sel is not None and len(logit_sel) == batch * out_width
        layers = self.model.num_layers
        capture = ()
        if output_hidden_states:
            capture = tuple(self.capture) if self.capture is not None else tuple(range(layers + 1))
        extra = {}
        if features is not None:
            features = features.to(dev)
            extra["features"] = (features[:, :width].reshape(batch * width, features.shape[-1]) if dense
                                 else features[rows_idx.to(dev), cols_idx.to(dev)])
        rows_only = logit_columns is not None and len(logit_sel) > 0
        if rows_only:  # only the chosen columns' outputs are read: the last layer runs for them only
            extra["rows_only"] = True
        out = self.model.forward(tokens, self.k, self.v, None if logit_rows is None else logit_rows.to(dev), capture,
                                 **extra)
        self.lengths = torch.tensor([s + c for s, c in zip(starts, counts)], dtype=torch.int64)
        self._chunk_start, self._chunk_width = start, width  # the old lengths tensor: nothing writes to it now
        self.num_forwards += 1
        if not dense:
            self.num_packed_forwards += 1
        vocab = out.logits.shape[-1]

        def scatter(rows_tensor: torch.Tensor, sel: list) -> torch.Tensor:
            """Rows ``[M, X]`` of the selected (row, column) pairs into ``[B, out_width, X]`` zeros."""
            full = rows_tensor.new_zeros(batch, out_width, rows_tensor.shape[-1])
            if sel:
                where = torch.tensor([(r, col) for r, col, _ in sel], dtype=torch.int64)
                full[where[:, 0].to(dev), where[:, 1].to(dev)] = rows_tensor
            return full

        def unpack(rows_tensor: torch.Tensor, first: int = 0) -> torch.Tensor:
            """Rows ``[N, X]`` of every packed token into ``[B - first, width, X]`` (rows ``first..B-1``; holes
            zero; a view when dense)."""
            if dense:
                return rows_tensor.reshape(batch, width, rows_tensor.shape[-1])[first:]
            full = rows_tensor.new_zeros(batch - first, width, rows_tensor.shape[-1])
            full[(rows_idx - first).to(dev), cols_idx.to(dev)] = rows_tensor
            return full

        if logit_sel is None:  # every column's logits
            logits = unpack(out.logits)
        elif outputs_full:
            logits = out.logits.reshape(batch, out_width, vocab)
        else:
            logits = scatter(out.logits, logit_sel)
        if not return_outputs:
            return logits

        hidden_states = None
        if output_hidden_states:
            hidden_states = tuple(unpack(out.captured[i], first) if i in out.captured else None
                                  for i in range(layers + 1))
        if logit_columns is not None:  # hidden of the chosen columns only, [B, 1, h] like the logits
            if not rows_only:
                hidden = out.hidden.new_zeros(batch, 1, out.hidden.shape[-1])
            elif outputs_full:
                hidden = out.hidden.reshape(batch, 1, out.hidden.shape[-1])
            else:
                hidden = scatter(out.hidden, logit_sel)
        else:
            hidden = unpack(out.hidden, first)
        return SimpleNamespace(logits=logits, hidden_states=hidden_states, hidden=hidden)

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to ``lengths[r]`` tokens (a length change: nothing is copied).

        Raises:
            ValueError: a length that is negative or longer than the row.
        """
        lengths = lengths.to("cpu", torch.int64)
        if lengths.shape != self.lengths.shape or any(
                n < 0 or n > have for n, have in zip(lengths.tolist(), self.lengths.tolist())):
            raise ValueError("truncate lengths must lie in [0, current length] per row")
        self.lengths = lengths.clone()

    def keep_last_chunk(self, keep: torch.Tensor) -> None:
        """Keep only the marked slots of the chunk appended last (``[B, n] bool``, in logical order), e.g. one
        root-to-leaf path of a token tree; the kept entries move next to the row's prefix.

        Raises:
            ValueError: a mask of the wrong shape, or kept slots that were holes.
        """
        keep = keep.to("cpu", torch.bool)
        n = self._chunk_width
        if self._chunk_start is None or tuple(keep.shape) != (self.batch_size, n):
            raise ValueError(f"keep must be [B, n] = [{self.batch_size}, {n}], got {tuple(keep.shape)}")
        start = self._chunk_start
        appended = self.lengths - start
        if bool((keep & ~(torch.arange(n)[None, :] < appended[:, None])).any()):
            raise ValueError("keep marks slots that are holes")
        for r in range(self.batch_size):
            kept = keep[r].nonzero().squeeze(1)
            count = int(kept.numel())
            if count and not torch.equal(kept, torch.arange(count)):
                slot, s = int(self.row_slot[r]), int(start[r])
                self._copy_positions(slot, s + torch.arange(count), slot, s + kept)
            self.lengths[r] = int(start[r]) + count

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (``[B'] int64``); the slots of the others are freed (nothing is copied)."""
        rows = rows.to("cpu", torch.int64)
        kept = set(self.row_slot.index_select(0, rows).tolist())
        self.free += [s for s in self.row_slot.tolist() if s not in kept]
        self.row_slot = self.row_slot.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self._chunk_start = None if self._chunk_start is None else self._chunk_start.index_select(0, rows)

    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows (new requests of a running batch, continuous batching): each takes a free
        slot (allocating more slots if needed) and starts at length 0; the existing rows are untouched.

        Raises:
            ValueError: ``count < 0``.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count == 0:
            return
        if len(self.free) < count:
            self._grow(self.capacity, self.num_slots + count - len(self.free))
        taken = [self.free.pop(0) for _ in range(count)]
        self.row_slot = torch.cat([self.row_slot, torch.tensor(taken, dtype=torch.int64)])
        self.lengths = torch.cat([self.lengths, torch.zeros(count, dtype=torch.int64)])
        self._chunk_start = None

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row ``r`` -> rows ``r*repeats ..``): the copies take free slots
        and a copy of the row's cached prefix (``lengths[r]`` positions)."""
        if repeats == 1:
            return
        extra = self.batch_size * (repeats - 1)
        if len(self.free) < extra:
            self._grow(self.capacity, self.num_slots + extra - len(self.free))
        new_slots, new_lengths = [], []
        for r in range(self.batch_size):
            slot, length = int(self.row_slot[r]), int(self.lengths[r])
            new_slots.append(slot)
            for _ in range(repeats - 1):
                other = self.free.pop(0)
                tiles = -(-length // 16)
                self.k[:, other, :, :tiles] = self.k[:, slot, :, :tiles]
                self.v[:, other, :, :length] = self.v[:, slot, :, :length]
                new_slots.append(other)
            new_lengths += [length] * repeats
        self.row_slot = torch.tensor(new_slots, dtype=torch.int64)
        self.lengths = torch.tensor(new_lengths, dtype=torch.int64)
        self._chunk_start = None

    def compact(self) -> None:
        """Nothing to do: rows never hold holes (kept for the :class:`RaggedKVCache` interface)."""
