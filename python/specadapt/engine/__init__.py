"""The embedded speculative decoding engine over Hugging Face transformers models (an adapter layer).

Main pieces: :func:`load_model` (target / standalone draft), :func:`build_draft` (``ngram`` / ``self:N`` /
path), :class:`SpeculativeEngine` (the batched loop), :mod:`.metrics` (acceptance statistics).
"""

from .drafts import Draft, ModelDraft, NgramDraft, NoDraft, VocabularyMismatchError
from .factory import DEFAULT_DRAFT, build_draft
from .loop import RequestResult, RoundRecord, SpeculativeEngine
from .models import EMBEDDED_DEFAULT, LoadedModel, ModelLoadError, load_model

__all__ = [
    "DEFAULT_DRAFT",
    "EMBEDDED_DEFAULT",
    "Draft",
    "LoadedModel",
    "ModelDraft",
    "ModelLoadError",
    "NgramDraft",
    "NoDraft",
    "RequestResult",
    "RoundRecord",
    "SpeculativeEngine",
    "VocabularyMismatchError",
    "build_draft",
    "load_model",
]
