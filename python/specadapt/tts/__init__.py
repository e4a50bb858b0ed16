"""Test-Time Speculation: online distillation of the draft from the target's verification pass
(Kumar, Sanghavi, Das, arXiv 2605.09329; docs/design/specs/tts.md).

Pieces: :func:`tts_loss` (forward KL + proximal term with position weights), :class:`TTSUpdater` (shadow copy,
strided asynchronous steps, publish by in-place copy at a round boundary, rollback), :func:`add_lora`
(low-rank adapters for ``--tts-params lora``), :class:`TTSConfig`, and what both adapters share: the
:class:`Student` protocol (a draft's differentiable forward), one example type :class:`TTSExample`, its
:func:`collate` into the loss inputs and :func:`distillation_loss` (the updater's ``loss_fn``). No transformers /
sglang imports here: the embedded engine and the SGLang plugin implement :class:`Student` for their drafts.
"""

from .config import TTSConfig
from .example import CollatedExamples, TTSExample, collate
from .lora import LoRALinear, LoRASlots, PerRequestLoRALinear, add_lora, add_per_request_lora, find_lora_slots
from .loss import position_weights, supervised_counts, tts_loss
from .student import Student, distillation_loss
from .topk import dense_rows, top_k_rows
from .updater import TTSStats, TTSUpdater, background_trainer_pays

__all__ = [
    "CollatedExamples",
    "LoRALinear",
    "LoRASlots",
    "PerRequestLoRALinear",
    "Student",
    "TTSConfig",
    "TTSExample",
    "TTSStats",
    "TTSUpdater",
    "add_lora",
    "add_per_request_lora",
    "background_trainer_pays",
    "collate",
    "dense_rows",
    "distillation_loss",
    "find_lora_slots",
    "position_weights",
    "supervised_counts",
    "top_k_rows",
    "tts_loss",
]
