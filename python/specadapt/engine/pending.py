"""Per-request queues of target features an EAGLE-style head has not been fed yet (its deferred catch-up).

While speculation is off (issue 16) the head runs no forward, but it must later see the target's features of
every committed token, in order. This store keeps them in a slot-based buffer, like the engine's KV cache: a
request occupies one slot of ``[capacity, F]`` pairs, dropping rows (finished requests) only remaps rows to
slots and frees theirs, new rows take free slots, a round's pairs are written in place, and the capacity grows
by doubling. The padded ``[B, m, F]`` tensor this replaces was copied whole on every finished or joined request
and rebuilt by boolean masks every round: at batch 32 with speculation off that made a plain round 12-17%
slower than a target-only engine's.
"""

from __future__ import annotations

import torch

__all__ = ["PendingFeatures"]


def _zero_past(features: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``features [B, w, F]`` with the columns at or past ``counts[r]`` (``[B] int64``, CPU) of each row zeroed,
    in place: the store's unwritten entries are uninitialised memory, and a padded forward (transformers' path)
    multiplies hole columns by zero attention weights, which keeps a NaN a NaN."""
    width = features.shape[1]
    if width and bool((counts < width).any()):
        past = torch.arange(width)[None, :] >= counts[:, None]  # [B, w]
        features.masked_fill_(past.to(features.device)[:, :, None], 0)
    return features


#: the most bytes a store reserves ahead of its rows' needs (uninitialised, see ``reserve``)
_RESERVE_BYTES = 2 << 30

#: batches of at most this many rows append with one slice copy per row instead of one indexed copy (batch 1, an
#: append of 2 pairs + a take: 28.7 us against 40.2 on a 2-core AMX Xeon)
_ROW_COPIES = 4


class PendingFeatures:
    """Row ``r``'s first ``counts[r]`` pending feature vectors, in commit order.

    Args:
        feature_size: ``F`` (for an EAGLE head, 3 x the target's hidden size).
        dtype, device: of the stored features (the target's hidden states').
        reserve: pairs per slot the store is allocated for whenever it is (re)allocated, however few are queued
            (capped at 2 GiB over all slots; the store exceeds that only where the queued pairs themselves need
            more): the store is uninitialised memory, and on a CPU host that maps
            pages lazily capacity that is never written costs nothing, where growing by doubling copies every
            queued pair again each time (at batch 32 with speculation off, 0.20 s of 400 rounds' flushes against
            0.05 s with the context reserved, 2-core AVX2 EPYC). 0: grow by doubling only (a GPU allocates what
            it reserves).

    Attributes:
        counts: ``[B] int64`` (CPU) pending pairs per row.

    :meth:`append_one` (a plain round: one pair per row) only queues its features in a list; the queue is written
    into the store in one indexed copy by the next other call (a run of plain rounds costs one list append each).
    """

    def __init__(self, feature_size: int, dtype: torch.dtype = torch.float32, device="cpu", reserve: int = 0) -> None:
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {reserve}")
        self.feature_size = int(feature_size)
        self.reserve = int(reserve)
        self._pair_bytes = self.feature_size * torch.empty(0, dtype=dtype).element_size()
        self.dtype = dtype
        self.device = torch.device(device)
        self._store = torch.zeros(0, 0, self.feature_size, dtype=dtype, device=self.device)  # [slots, cap, F]
        self._row_slot = torch.zeros(0, dtype=torch.int64)
        self._free: list[int] = []
        self._counts = torch.zeros(0, dtype=torch.int64)
        self._queued: list[torch.Tensor] = []  # append_one's [B, F] rows, oldest first, not yet in the store

    @property
    def counts(self) -> torch.Tensor:
        self._flush()
        return self._counts

    @counts.setter
    def counts(self, value: torch.Tensor) -> None:
        self._flush()
        self._counts = value

    def _flush(self) -> None:
        """Write the queued plain-round pairs into the store (every row gains ``len(queue)`` pairs)."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        width = len(queued)
        self._ensure(self._store.shape[0], int(self._counts.max()) + width)
        block = torch.stack(queued, dim=1).to(self.device, self.dtype)  # [B, width, F]
        columns = self._counts[:, None] + torch.arange(width)[None, :]
        slots = self._row_slot[:, None].expand(-1, width)
        self._store[slots.to(self.device), columns.to(self.device)] = block
        self._counts = self._counts + width

    def _ensure(self, slots: int, capacity: int) -> None:
        """Grow the store to hold at least ``slots`` slots (doubling) of ``capacity`` pairs each (the live queues'
        need, doubled when outgrown, or the capped reserve if larger).

        The new store is left uninitialised and only the live rows' queued pairs are copied into it: a store of
        zeros with the old one copied whole wrote every slot's whole capacity (at batch 32 a store of 100-450 MB
        after a few hundred rounds off), 0.33 s of page faults and memset over 400 rounds (0.8 ms a round, on a
        2-core AVX2 EPYC) where the pairs themselves are ~0.2 MB a round. Untouched capacity costs no memory on
        hosts that map pages lazily. Unwritten entries are never returned (:meth:`take` and :meth:`peek` zero
        the columns past each row's count)."""
        have_slots, have_cap = self._store.shape[:2]
        if slots <= have_slots and capacity <= have_cap:
            return
        new_slots = max(slots, have_slots if slots <= have_slots else 2 * have_slots)
        # the live queues' need (only queued pairs are copied), doubled when it outgrows the store; the reserve on
        # top is capped over all slots, so more slots never multiply a reserved width past the cap
        need = max(capacity, int(self._counts.max()) if self._counts.numel() else 0)
        new_cap = need if need <= have_cap else max(need, 2 * have_cap)
        new_cap = max(new_cap, min(self.reserve, _RESERVE_BYTES // max(new_slots * self._pair_bytes, 1)))
        grown = torch.empty(new_slots, new_cap, self.feature_size, dtype=self.dtype, device=self.device)
        for slot, count in zip(self._row_slot.tolist(), self._counts.tolist()):
            if count:
                grown[slot, :count] = self._store[slot, :count]
        self._free += list(range(have_slots, new_slots))
        self._store = grown

    def add_rows(self, features: torch.Tensor | None, counts: torch.Tensor) -> None:
        """Append rows at the end of the batch, row ``i`` holding the first ``counts[i]`` of ``features[i]``.

        Args:
            features: ``[n, m, F]`` (``m >= max(counts)``), or ``None`` when every count is 0.
            counts: ``[n] int64``.

        Raises:
            ValueError: a features tensor narrower than its counts, or of the wrong feature size.
        """
        self._flush()
        counts = counts.to("cpu", torch.int64)
        n = int(counts.numel())
        if n == 0:
            return
        width = int(counts.max())
        if width and (features is None or features.shape[1] < width or features.shape[2] != self.feature_size):
            raise ValueError(f"features must be [{n}, >= {width}, {self.feature_size}], got "
                             f"{None if features is None else tuple(features.shape)}")
        self._ensure(self._store.shape[0] + max(n - len(self._free), 0), width)
        self._free.sort()
        slots, self._free = self._free[:n], self._free[n:]
        slot_ids = torch.tensor(slots, dtype=torch.int64)
        if width:
            self._store[slot_ids.to(self.device), :width] = features[:, :width].detach().to(self.device, self.dtype)
        self._row_slot = torch.cat([self._row_slot, slot_ids])
        self.counts = torch.cat([self.counts, counts])

    def append(self, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first ``counts[r]`` of ``features [B, n, F]`` to row ``r``'s queue (``counts [B] int64``)."""
        self._flush()
        add = counts.to("cpu", torch.int64).tolist()
        width = max(add, default=0)
        if width == 0:
            return
        have = self._counts.tolist()
        if len(add) != len(have):
            raise ValueError(f"counts must have {len(have)} entries (one per row), got {len(add)}")
        self._ensure(self._store.shape[0], max(h + a for h, a in zip(have, add)))
        features = features.detach().to(self.device, self.dtype)
        if len(add) <= _ROW_COPIES:  # a few rows: one slice copy each (an indexed copy costs more set-up)
            for r, (slot, h, a) in enumerate(zip(self._row_slot.tolist(), have, add)):
                if a:
                    self._store[slot, h : h + a] = features[r, :a]
        elif all(a == width for a in add):  # every row adds the same number (a plain round: 1 each)
            slots = self._row_slot[:, None].expand(-1, width)
            columns = self._counts[:, None] + torch.arange(width)[None, :]
            self._store[slots.to(self.device), columns.to(self.device)] = features[:, :width]
        else:
            counts = torch.tensor(add, dtype=torch.int64)
            new = torch.arange(width)[None, :] < counts[:, None]  # [B, width]
            rows, cols = new.nonzero(as_tuple=True)
            slots = self._row_slot.index_select(0, rows)
            columns = self._counts.index_select(0, rows) + cols
            self._store[slots.to(self.device), columns.to(self.device)] = features[rows.to(self.device),
                                                                                   cols.to(self.device)]
        self._counts = torch.tensor([h + a for h, a in zip(have, add)], dtype=torch.int64)

    def append_one(self, features: torch.Tensor) -> None:
        """Append one pair to every row: ``features [B, 1, F]`` (or ``[B, F]``), the round of a plain decode step
        (every row commits exactly one token). Same result as ``append(features, ones)``; it only queues the
        tensor (kept by reference: the caller must not write to it later), as this runs once a round while
        speculation is off, where every microsecond is overhead over target-only decoding.

        Raises:
            ValueError: ``features`` not of ``B`` rows and ``F`` features.
        """
        rows = features[:, 0] if features.dim() == 3 and features.shape[1] == 1 else features
        if rows.dim() != 2 or rows.shape[0] != self._counts.shape[0] or rows.shape[1] != self.feature_size:
            raise ValueError(f"features must be [{self._counts.shape[0]}, 1, {self.feature_size}], got "
                             f"{tuple(features.shape)}")
        if rows.shape[0]:
            self._queued.append(rows.detach())

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove the pending pairs of the marked rows and return them.

        Args:
            rows: ``[B] bool``: rows to feed now (the others keep their queues).

        Returns:
            ``(features [B, w, F], counts [B] int64)``: ``w`` = the largest taken count; row ``r``'s first
            ``counts[r]`` columns are its pairs (0 for rows not taken); the rest of each row is zeros.
        """
        self._flush()
        have, taken = self._counts.tolist(), rows.to("cpu", torch.bool).tolist()
        if len(taken) != len(have):
            raise ValueError(f"rows must have {len(have)} entries (one per row), got {len(taken)}")
        counts = [h if t else 0 for h, t in zip(have, taken)]
        width = max(counts, default=0)
        features = self._store[self._row_slot.to(self.device), :width]
        counts_t = torch.tensor(counts, dtype=torch.int64)
        self._counts = torch.tensor([h - c for h, c in zip(have, counts)], dtype=torch.int64)
        return _zero_past(features, counts_t), counts_t

    def peek(self, rows: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``min(counts[r], window)`` pending pairs of the marked rows, left in the queue (a probe's
        scratch context, :attr:`specadapt.engine.drafts.Draft.probe_window`).

        Args:
            rows: ``[B] bool``: rows to read (the others get count 0).
            window: the most pairs read per row, ``>= 1``: one int, or ``[B] int64`` (one per row).

        Returns:
            ``(features [B, w, F], counts [B] int64)`` as :meth:`take` returns them: ``w`` = the largest count
            read; row ``r``'s first ``counts[r]`` columns are its newest pairs in commit order.

        Raises:
            ValueError: ``window < 1`` or ``rows`` not of ``B`` entries.
        """
        self._flush()
        have, marked = self._counts.tolist(), rows.to("cpu", torch.bool).tolist()
        if len(marked) != len(have):
            raise ValueError(f"rows must have {len(have)} entries (one per row), got {len(marked)}")
        windows = window.tolist() if isinstance(window, torch.Tensor) else [window] * len(have)
        if len(windows) != len(have) or min(windows, default=1) < 1:
            raise ValueError(f"window must be >= 1 (an int or one per row of {len(have)}), got {window}")
        counts = [min(h, w) if m else 0 for h, m, w in zip(have, marked, windows)]
        width = max(counts, default=0)
        start = torch.tensor([h - c for h, c in zip(have, counts)], dtype=torch.int64)
        columns = (start[:, None] + torch.arange(width)[None, :]).clamp(max=max(self._store.shape[1] - 1, 0))
        slots = self._row_slot[:, None].expand(-1, width)
        features = self._store[slots.to(self.device), columns.to(self.device)]
        counts_t = torch.tensor(counts, dtype=torch.int64)
        return _zero_past(features, counts_t), counts_t

    def drop(self, rows: torch.Tensor) -> None:
        """Forget every pending pair of the marked rows (``[B] bool``): they were fed by other means."""
        marked = rows.to("cpu", torch.bool)
        self.counts = torch.where(marked, torch.zeros_like(self.counts), self.counts)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order (``[B'] int64``); the others' slots are freed (nothing copied)."""
        self._flush()
        rows = rows.to("cpu", torch.int64)
        kept = self._row_slot.index_select(0, rows)
        gone = set(self._row_slot.tolist()) - set(kept.tolist())
        self._free += sorted(gone)
        self._row_slot = kept
        self.counts = self.counts.index_select(0, rows)
