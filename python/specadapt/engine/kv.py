"""A batched KV cache with ragged per-request lengths and per-request rollback, over a transformers model.

transformers' ``DynamicCache`` stores one physical time axis for the whole batch and can only crop it for
everyone at once (and 5.x changed ``crop`` to take the number of tokens to REMOVE). Speculative decoding needs
each request to keep a different number of the positions it just wrote. This cache keeps the physical axis
shared and tracks, per request, which physical slots are valid:

- every forward appends one chunk of ``n`` slots to all rows; row ``r`` fills its first ``num_valid[r]`` slots
  with real tokens, the rest are holes (right padding, so a padded query always sees a real earlier key and
  never produces NaN);
- a 4-D additive attention mask built here hides holes and applies causality, and ``position_ids`` carry each
  token's logical position, so a hole never shifts RoPE positions;
- ``truncate(lengths)`` rolls each row back to its own logical length by turning its later valid slots into
  holes, then crops the columns that are holes in every row;
- when holes waste too much of the physical axis, ``compact()`` gathers each row's valid slots to the front
  (keys already carry RoPE for their logical positions, so moving them is exact).
"""

from __future__ import annotations

import inspect

import torch

from . import packing as _packing
from . import sdpa_gqa as _sdpa_gqa
from .packing import Packing, active_packing

__all__ = ["RaggedKVCache"]


def _is_prefix_view(tensor: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """True when ``tensor`` is ``buffer[:, :, :n]`` (same storage start and strides)."""
    return (
        buffer is not None
        and tensor.dim() == 4
        and tensor.data_ptr() == buffer.data_ptr()
        and tensor.stride() == buffer.stride()
        and tensor.shape[:2] == buffer.shape[:2]
        and tensor.shape[3] == buffer.shape[3]
        and tensor.shape[2] <= buffer.shape[2]
    )


def _preallocated_layer_class():
    """A transformers ``DynamicLayer`` that appends into spare capacity instead of concatenating.

    ``DynamicLayer.update`` rebuilds the whole cache with ``torch.cat`` at every forward: O(T) bytes per layer per
    forward, which made long-context decoding slow down with the context (scripts/bench_kv_context.py: a 6-token
    verify forward of SmolLM2-135M at 4,300 tokens of context, 124.8 ms with transformers' cache against 96.0 ms
    with this one and grouped-query SDPA, same run). This layer keeps keys / values as
    prefix views of buffers grown by 1.5x, so an append copies only the new tokens. Anything that replaces
    ``keys`` / ``values`` by a tensor that is not a prefix view (compaction, row selection) is adopted into a new
    buffer at the next append.
    """
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        _kbuf: torch.Tensor | None = None
        _vbuf: torch.Tensor | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            packing = active_packing()
            if packing is not None:  # a packed forward: [1, H, N, D] -> the chunk's [B, H, n, D] slots
                key_states = packing.unpack_heads(key_states)
                value_states = packing.unpack_heads(value_states)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys, values = self.keys, self.values
            length = keys.shape[-2] if keys.numel() else 0
            need = length + key_states.shape[-2]
            fits = (
                length == 0 or (_is_prefix_view(keys, self._kbuf) and _is_prefix_view(values, self._vbuf))
            ) and self._kbuf is not None and need <= self._kbuf.shape[2] and (
                self._kbuf.shape[:2] == key_states.shape[:2] and self._kbuf.shape[3] == key_states.shape[3]
                and self._vbuf.shape[3] == value_states.shape[3] and self._kbuf.dtype == key_states.dtype
            )
            if not fits:
                batch, heads, _, dim = key_states.shape
                capacity = max(256, need + need // 2)
                kbuf = key_states.new_empty(batch, heads, capacity, dim)
                vbuf = value_states.new_empty(batch, heads, capacity, value_states.shape[3])
                if length:
                    kbuf[:, :, :length].copy_(keys)
                    vbuf[:, :, :length].copy_(values)
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[:, :, length:need].copy_(key_states)
            self._vbuf[:, :, length:need].copy_(value_states)
            self.keys = self._kbuf[:, :, :need]
            self.values = self._vbuf[:, :, :need]
            return self.keys, self.values

        def reset(self) -> None:
            self._kbuf = self._vbuf = None
            super().reset()

    return PreallocatedLayer


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


class RaggedKVCache:
    """Per-request-length KV cache for one causal LM (target or draft).

    Args:
        model: a transformers causal LM (``forward(input_ids, attention_mask, position_ids, cache/past_key_values,
            use_cache, logits_to_keep)``), in eval mode.
        batch_size: number of rows.
        compact_min_waste: compaction runs when the physical length exceeds the longest row by more than
            ``max(compact_min_waste, compact_fraction * longest)`` slots.
        fast_append: append into preallocated capacity and use grouped-query SDPA on CPU (default); ``False``
            keeps transformers' concatenating ``DynamicCache`` as is (the baseline of scripts/bench_kv_context.py).
        packed: run a chunk with holes as a packed forward (:mod:`specadapt.engine.packing`): only the
            ``sum(num_valid)`` real tokens go through the projections, MLPs and LM head, so a pruned draft (or a
            shorter prompt) costs no compute there. Needs ``fast_append``. Outputs keep the padded ``[B, n, ...]``
            layout (holes hold zeros).
        pack_below: pack only chunks whose real tokens are at most this fraction of ``B * n`` (packing has a
            fixed cost per layer: scattering queries / keys / values and gathering outputs). Measured on the
            2-core CPU with SmolLM2-135M and 200 tokens of context (scripts/bench_packed_forward.py): 7 of 12 real,
            packed 75 ms vs padded 66 ms; 12 of 32, 72 vs 94 ms; 27 of 128, 108-123 vs 234-271 ms.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batch_size: int,
        compact_min_waste: int = 64,
        compact_fraction: float = 0.25,
        fast_append: bool = True,
        packed: bool = False,
        pack_below: float = 0.5,
    ) -> None:
        from transformers import DynamicCache  # adapters may import transformers; techniques may not

        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = DynamicCache(config=model.config)
        from transformers.cache_utils import DynamicLayer

        if fast_append:
            layer_class = _preallocated_layer_class()
            self.cache.layers = [layer_class() if type(layer) is DynamicLayer else layer for layer in self.cache.layers]
        # On CPU, grouped-query attention with an explicit mask otherwise repeats K/V to every query head at every
        # forward (another O(T) copy); torch's CPU SDPA takes GQA directly. (On CUDA that switch would select the
        # math kernel, so it is left alone there.) Chosen per forward and per thread (engine/sdpa_gqa.py), never
        # through the process environment.
        self._force_gqa = fast_append and self.device.type == "cpu"
        if self._force_gqa:
            _sdpa_gqa.register()
        if packed and not fast_append:
            raise ValueError("packed=True needs fast_append=True (the packed keys are unpacked by its cache layer)")
        self.packed = packed
        if not 0.0 <= pack_below <= 1.0:
            raise ValueError(f"pack_below must lie in [0, 1], got {pack_below}")
        self.pack_below = pack_below
        self.num_packed_forwards = 0
        if packed:
            _packing.register()
        self._cache_name = _cache_kwarg(model)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)  # [B, T_phys]
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # [B]
        self.compact_min_waste = compact_min_waste
        self.compact_fraction = compact_fraction
        self.num_compactions = 0
        self._last_chunk = 0

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def physical_length(self) -> int:
        return self.valid.shape[1]

    def _attention_mask(
        self, num_new: int, new_valid: torch.Tensor, chunk_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        batch = self.batch_size
        past = self.valid[:, None, :].expand(batch, num_new, self.physical_length)
        if chunk_mask is None:
            chunk_mask = torch.ones(num_new, num_new, dtype=torch.bool, device=self.device).tril()[None]
        new = chunk_mask.to(self.device) & new_valid[:, None, :]
        allowed = torch.cat([past, new], dim=2)[:, None]  # [B, 1, n, T+n]
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        neg = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, neg)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        num_valid: torch.Tensor,
        logits_to_keep: int = 0,
        chunk_mask: torch.Tensor | None = None,
        chunk_positions: torch.Tensor | None = None,
        return_outputs: bool = False,
        logit_columns: torch.Tensor | None = None,
        hidden_from_row: int = 0,
        **model_kwargs,
    ):
        """Append one chunk and return its logits.

        Args:
            input_ids: ``[B, n] int64``; row ``r``'s real tokens in its first ``num_valid[r]`` columns
                (any id in the rest).
            num_valid: ``[B] int64`` in ``[0, n]``.
            logits_to_keep: 0 for logits at every column, ``k`` for the last ``k`` columns only.
            chunk_mask: optional ``[B, n, n] bool``, which chunk columns each chunk column attends to (a tree
                attention mask: ancestors and self); default causal.
            chunk_positions: optional ``[B, n] int64`` position offsets of the chunk's tokens after the row's
                current length (tree depth); default ``0..n-1``.
            return_outputs: return the model's whole output object instead of its logits (e.g. with
                ``output_hidden_states=True`` in ``model_kwargs``).
            logit_columns: optional ``[B] int64``, the one column of each row whose outputs are read (an EAGLE
                catch-up's last fed pair); the logits, and the output's ``hidden`` where the model returns one,
                are then ``[B, 1, ...]``, zeros for a negative or hole column. Overrides ``logits_to_keep``. (This
                cache runs the model over every column and keeps those; :class:`~specadapt.engine.native.
                SlotKVCache` runs the last layer for them only.)
            hidden_from_row: the output's ``hidden_states`` (and ``hidden`` where the model returns one, without
                ``logit_columns``) hold rows ``hidden_from_row..B-1`` only (a join's new rows; rows before it
                must take no tokens). Here a slice of the full outputs; :class:`~specadapt.engine.native.
                SlotKVCache` unpacks only those rows.
            model_kwargs: passed to the model's forward (e.g. ``features=`` for an EAGLE head).

        Returns:
            ``[B, n or k, V]`` logits (model dtype), or the output object. Columns past ``num_valid`` are
            meaningless.
        """
        batch, num_new = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(f"input_ids has {batch} rows but the cache has {self.batch_size}")
        first = int(hidden_from_row)
        if not 0 <= first <= batch or (first and bool((num_valid[:first] != 0).any())):
            raise ValueError(f"hidden_from_row must lie in [0, {batch}] with no tokens in the rows before it, got "
                             f"{hidden_from_row}")
        if logit_columns is not None:
            if tuple(logit_columns.shape) != (batch,):
                raise ValueError(f"logit_columns must have shape [{batch}], got {tuple(logit_columns.shape)}")
            logits_to_keep = 0
        num_valid = num_valid.to(self.device, torch.int64)
        cols = torch.arange(num_new, device=self.device)
        new_valid = cols[None, :] < num_valid[:, None]
        offsets = cols[None, :] if chunk_positions is None else chunk_positions.to(self.device, torch.int64)
        position_ids = self.lengths[:, None] + offsets
        mask = self._attention_mask(num_new, new_valid, chunk_mask)
        input_ids = input_ids.to(self.device)
        packing, kept, keep_last = None, None, int(logits_to_keep)
        config = self.model.config
        previous_attention = config._attn_implementation_internal
        attention = config._attn_implementation
        if self._force_gqa and attention == "sdpa":  # grouped-query SDPA for this call (see __init__)
            attention = _sdpa_gqa.ATTENTION_NAME
        real = int(num_valid.sum()) if self.packed else 0  # (a host sync on CUDA: only when packing is on)
        if self.packed and 0 < real < batch * num_new and real <= self.pack_below * batch * num_new:
            packing = Packing.from_valid(new_valid, attention)
            input_ids, position_ids = packing.pack(input_ids), packing.pack(position_ids)
            if keep_last:  # the packed indices of the chunk's last k columns that hold real tokens
                kept = ((packing.flat % num_new) >= num_new - keep_last).nonzero().squeeze(1)
                logits_to_keep = kept
        if packing is not None:
            token = packing.activate()
            config._attn_implementation_internal = _packing.ATTENTION_NAME
        elif attention != previous_attention:
            config._attn_implementation_internal = attention
        try:
            with _sdpa_gqa.grouped_query(self._force_gqa):
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=position_ids,
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                    **{self._cache_name: self.cache},
                    **model_kwargs,
                )
        finally:
            config._attn_implementation_internal = previous_attention
            if packing is not None:
                packing.deactivate(token)
        if packing is not None:
            self._unpack_outputs(out, packing, keep_last, kept)
            self.num_packed_forwards += 1
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.lengths = self.lengths + num_valid
        self._last_chunk = num_new
        if logit_columns is not None:
            columns = logit_columns.to(self.device, torch.int64)
            read = (columns >= 0) & (columns < num_valid)
            index = columns.clamp(0, max(num_new - 1, 0))[:, None]
            keep = read[:, None, None]
            out.logits = torch.where(keep, out.logits.gather(
                1, index[:, :, None].expand(-1, 1, out.logits.shape[-1])), 0.0)
            if getattr(out, "hidden", None) is not None:
                out.hidden = torch.where(keep, out.hidden.gather(
                    1, index[:, :, None].expand(-1, 1, out.hidden.shape[-1])), 0.0)
        if first and return_outputs:
            if getattr(out, "hidden_states", None) is not None:
                out.hidden_states = tuple(None if h is None else h[first:] for h in out.hidden_states)
            if logit_columns is None and getattr(out, "hidden", None) is not None:
                out.hidden = out.hidden[first:]
        return out if return_outputs else out.logits

    @staticmethod
    def _unpack_outputs(out, packing: Packing, keep_last: int, kept: torch.Tensor | None) -> None:
        """Give a packed forward's logits / hidden states the padded ``[B, n or k, ...]`` layout (zeros in holes).

        ``kept``: the packed indices whose logits were computed when ``keep_last = k > 0`` (the real tokens among
        the chunk's last k columns).
        """
        if kept is not None:
            full = out.logits.new_zeros(packing.batch * packing.width, out.logits.shape[-1])
            full.index_copy_(0, packing.flat[kept], out.logits[0])
            out.logits = full.view(packing.batch, packing.width, -1)[:, packing.width - keep_last:]
        else:
            out.logits = packing.unpack(out.logits)
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(packing.unpack(h) for h in out.hidden_states)

    def keep_last_chunk(self, keep: torch.Tensor) -> None:
        """Keep only the marked slots of the chunk appended last (``[B, n] bool``), e.g. one root-to-leaf path
        of a token tree. Kept slots must have been valid and must be in logical order along the row.

        Raises:
            ValueError: a kept slot that was a hole, or a mask of the wrong shape.
        """
        n = self._last_chunk
        keep = keep.to(self.device, torch.bool)
        if tuple(keep.shape) != (self.batch_size, n):
            raise ValueError(f"keep must be [B, n] = [{self.batch_size}, {n}], got {tuple(keep.shape)}")
        start = self.physical_length - n
        old = self.valid[:, start:]
        if bool((keep & ~old).any()):
            raise ValueError("keep marks slots that are holes")
        self.lengths = self.lengths - old.sum(dim=1) + keep.sum(dim=1)
        self.valid = torch.cat([self.valid[:, :start], keep], dim=1)
        self._crop_tail()
        self._maybe_compact()

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row ``r`` becomes rows ``r*repeats .. r*repeats+repeats-1``)."""
        rows = torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats)
        self.select(rows)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to ``lengths[r]`` valid tokens (must not exceed its current length).

        Raises:
            ValueError: a requested length is negative or longer than the row.
        """
        lengths = lengths.to(self.device, torch.int64)
        if bool(((lengths < 0) | (lengths > self.lengths)).any()):
            raise ValueError("truncate lengths must lie in [0, current length] per row")
        rank = self.valid.to(torch.int64).cumsum(dim=1)
        self.valid = self.valid & (rank <= lengths[:, None])
        self.lengths = lengths.clone()
        self._crop_tail()
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        longest = int(self.lengths.max()) if self.batch_size else 0
        waste = self.physical_length - longest
        if waste > max(self.compact_min_waste, self.compact_fraction * longest):
            self.compact()

    def _crop_tail(self) -> None:
        any_valid = self.valid.any(dim=0)
        keep = int(any_valid.nonzero().max()) + 1 if bool(any_valid.any()) else 0
        if keep < self.physical_length:
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                    layer.keys = layer.keys[:, :, :keep]
                    layer.values = layer.values[:, :, :keep]
            self.valid = self.valid[:, :keep]

    def compact(self) -> None:
        """Move each row's valid slots to the front of the physical axis (left-aligned), dropping holes."""
        longest = int(self.lengths.max()) if self.batch_size else 0
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :longest]  # [B, longest]
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            heads, head_dim = layer.keys.shape[1], layer.keys.shape[3]
            index = order[:, None, :, None].expand(-1, heads, -1, head_dim)
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index.expand(-1, -1, -1, layer.values.shape[3]))
        self.valid = torch.arange(longest, device=self.device)[None, :] < self.lengths[:, None]
        self.num_compactions += 1

    #: a batch whose rows all left cannot take new rows (its layers' tensors lose their shape): the engine starts
    #: a new cache instead (the native SlotKVCache reuses its slots)
    add_rows_reuses_slots = False

    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows (new requests of a running batch): every physical slot of a new row is a
        hole, so the existing rows are untouched.

        Raises:
            ValueError: ``count < 0``.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count == 0:
            return
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(count, *layer.keys.shape[1:])])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(count, *layer.values.shape[1:])])
        self.valid = torch.cat([self.valid, self.valid.new_zeros(count, self.physical_length)])
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(count)])

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (``[B'] int64`` indices), e.g. when requests finish."""
        rows = rows.to(self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self._crop_tail()
