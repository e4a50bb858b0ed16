"""Build a draft from its command-line spec (``ngram``, ``self:N``, or a model path)."""

from __future__ import annotations

import re

import torch

from ..sampling import SamplingParams
from .drafts import Draft, ModelDraft, NgramDraft, check_same_vocabulary, self_draft
from .models import LoadedModel, load_model

__all__ = ["DEFAULT_DRAFT", "build_draft", "parse_draft_spec"]

DEFAULT_DRAFT = "ngram"
_SELF = re.compile(r"^self:(\d+)$")


def parse_draft_spec(spec: str) -> tuple[str, int | str | None]:
    """Split a draft spec into ``("ngram", None)``, ``("self", N)`` or ``("model", path)``.

    Raises:
        ValueError: a ``self:`` spec without a positive integer.
    """
    if spec == "ngram":
        return "ngram", None
    if spec.startswith("self:"):
        m = _SELF.match(spec)
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"--draft self:N needs a positive integer N, got {spec!r}")
        return "self", int(m.group(1))
    return "model", spec


def build_draft(
    spec: str,
    target: LoadedModel,
    sampling: SamplingParams,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Draft:
    """Construct the draft named by ``spec`` for ``target``.

    Raises:
        ValueError: bad ``self:N``; :class:`~specadapt.engine.models.ModelLoadError` for a model path that
            cannot be loaded; :class:`~specadapt.engine.drafts.VocabularyMismatchError` for a standalone draft
            whose vocabulary differs from the target's.
    """
    kind, value = parse_draft_spec(spec)
    generator = torch.Generator().manual_seed(seed + 1)
    if kind == "ngram":
        return NgramDraft()
    if kind == "self":
        return ModelDraft(self_draft(target, int(value)), sampling, generator, name=spec)
    draft = load_model(str(value), dtype=dtype, device=device)
    check_same_vocabulary(target, draft)
    return ModelDraft(draft.model, sampling, generator, name=spec)
