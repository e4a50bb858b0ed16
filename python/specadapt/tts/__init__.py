"""Test-Time Speculation: online distillation of the draft from the target's verification pass
(Kumar, Sanghavi, Das, arXiv 2605.09329; specs/tts.md).

Pieces: :func:`tts_loss` (forward KL + proximal term with position weights), :class:`TTSUpdater` (shadow copy,
strided asynchronous steps, publish by in-place copy at a round boundary, rollback), :func:`add_lora`
(low-rank adapters for ``--tts-params lora``), :class:`TTSConfig`. No transformers / sglang imports here: the
engine and the SGLang plugin supply the draft's differentiable forward as ``loss_fn``.
"""

from .config import TTSConfig
from .lora import LoRALinear, LoRASlots, PerRequestLoRALinear, add_lora, add_per_request_lora, find_lora_slots
from .loss import position_weights, supervised_counts, tts_loss
from .topk import dense_rows, top_k_rows
from .updater import TTSStats, TTSUpdater

__all__ = [
    "LoRALinear",
    "LoRASlots",
    "PerRequestLoRALinear",
    "TTSConfig",
    "TTSStats",
    "TTSUpdater",
    "add_lora",
    "add_per_request_lora",
    "dense_rows",
    "find_lora_slots",
    "position_weights",
    "supervised_counts",
    "top_k_rows",
    "tts_loss",
]
