"""The EAGLE-style draft head (:class:`specadapt.engine.eagle.EagleHead`) on the native forward.

The head's own matrices (``fuse`` [3h -> h], ``input_proj`` [2h -> h], its one decoder layer) are packed in a
weight format; the target's embedding, final norm and LM-head rows of the draft vocabulary are shared with the
target's native model (the LM-head rows are selected once, in the target's format). A step is

    x = input_proj([embed(token), fuse(target features) or g]);  g = layer(x);  logits = head(norm(g))

over the head's own slot KV cache (:class:`~.cache.SlotKVCache`), so a draft step reads only the head's bytes.
Test-Time Speculation trains the transformers module; :meth:`NativeEagleHead.refresh_from` re-packs it into
the same storage at every publish.
"""

from __future__ import annotations

import torch

from .formats import RUN_FORMATS, pack_weight
from .model import NativeLlama, NativeOutput, TokenBatch, _pack_layer, refresh_layer, run_linear

__all__ = ["NativeEagleHead"]


class NativeEagleHead:
    """Native forward of an attached EagleHead (see the module docstring).

    Args:
        head: the attached :class:`~specadapt.engine.eagle.EagleHead` (its ``layer``, ``fuse``, ``input_proj``,
            ``draft_vocab`` and rotary embedding are read).
        target: the target's :class:`~.model.NativeLlama` (embedding, final norm, LM head shared).
        dtype_name: the head's weight format (``float32`` keeps the head's trained matrices exactly; a block
            format makes a step read about a tenth of the bytes of a float32 one).
    """

    def __init__(self, head, target: NativeLlama, dtype_name: str | None = None) -> None:
        dtype_name = dtype_name or target.dtype_name
        layer_fmt = RUN_FORMATS[dtype_name][0]
        self.dtype_name = dtype_name
        self.hidden_size = head.hidden_size
        self.target = target
        pack = lambda name, t, fmt: pack_weight(t, fmt)  # noqa: E731
        device = target.device
        self.fuse = pack_weight(head.fuse.weight, layer_fmt).to(device)
        self.input_proj = pack_weight(head.input_proj.weight, layer_fmt).to(device)
        layer = _pack_layer(head.layer, "layer.", layer_fmt, pack, "EagleHead").to(device)
        rows = target.lm_head.select_rows(head.draft_vocab.to(torch.int64))
        positions = target.max_positions
        with torch.no_grad():
            probe = torch.zeros(1, dtype=torch.float32, device=target.device)
            cos, sin = head.rotary(probe, torch.arange(positions, device=target.device)[None])
        self.stack = NativeLlama(head.config, [layer], target.embed, rows, target.final_norm,
                                 cos[0].float().contiguous(), sin[0].float().contiguous(), dtype_name,
                                 RUN_FORMATS[dtype_name][2], "EAGLE head", kv_dtype=target.kv_dtype)
        self.num_layers = 1
        self.device = target.device

    @property
    def weight_bytes(self) -> int:
        """Bytes one single-token step reads (the fused-feature matrix only on the steps that use it)."""
        return self.stack.layers[0].nbytes() + self.input_proj.nbytes + self.stack.lm_head.nbytes

    def new_kv(self, slots: int, capacity: int):
        return self.stack.new_kv(slots, capacity)

    def forward(self, batch: TokenBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                logit_rows: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                features: torch.Tensor | None = None, rows_only: bool = False) -> NativeOutput:
        """One packed step. ``features``: ``[N, 3h]`` target features (fused here) or ``[N, h]`` the head's own
        earlier outputs ``g``. Returns ``hidden = g [N, h]`` and logits over the draft vocabulary. ``rows_only``:
        only ``logit_rows``' outputs are read (a catch-up): the layer runs past its cache writes for them only and
        ``hidden`` is ``[M, h]``.

        Raises:
            ValueError: missing features or a width that is neither 3h nor h.
        """
        hidden = self.hidden_size
        if features is None:
            raise ValueError("the EAGLE head needs features (target features or its own outputs)")
        features = features.float()
        if features.shape[-1] == 3 * hidden:
            features = run_linear(features, self.fuse)
        elif features.shape[-1] != hidden:
            raise ValueError(f"features must have width {3 * hidden} or {hidden}, got {features.shape[-1]}")
        x = run_linear(torch.cat([self.stack.embed_tokens(batch.ids), features], dim=-1), self.input_proj)
        out_rows = logit_rows if rows_only else None
        g, normed, _ = self.stack.run_layers(x, batch, k_cache, v_cache, out_rows=out_rows)
        return NativeOutput(hidden=g, logits=self.stack.logits_of_rows(normed, logit_rows, out_rows is not None))

    def refresh_from(self, head) -> None:
        """Re-pack the (trained) head's own matrices into this head's storage in place."""
        fmt = self.fuse.format
        self.fuse.copy_(pack_weight(head.fuse.weight, fmt))
        self.input_proj.copy_(pack_weight(head.input_proj.weight, fmt))
        refresh_layer(self.stack.layers[0], head.layer)

