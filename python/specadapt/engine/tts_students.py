"""Test-Time Speculation students of the embedded engine's drafts (:class:`specadapt.tts.Student`).

A draft that TTS can train returns one from :meth:`~specadapt.engine.drafts.Draft.tts_student` (the base returns
``None``: ``ngram``, target-only): :class:`ModelDraftStudent` for a standalone / ``self:N`` draft LM and
:class:`EagleDraftStudent` for the EAGLE head. Beyond the protocol, an engine student says which submodules
``--tts-params lora`` adapts (``trainable_prefixes``), what context a snapshot keeps (:meth:`context`) and how to
make the draft keep enough of it (:meth:`keep_context`); :class:`EngineStudent` is that extension.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from ..tts import Student, TTSExample, find_lora_slots
from .tts_windows import shared_window_logits

__all__ = ["EagleDraftStudent", "EngineStudent", "ModelDraftStudent"]


@runtime_checkable
class EngineStudent(Student, Protocol):
    """A :class:`~specadapt.tts.Student` of an engine draft.

    Attributes:
        trainable_prefixes: submodule names of ``module`` that train (full parameters) or get LoRA adapters.
    """

    trainable_prefixes: tuple[str, ...]

    def context(self, row: int, history: list[int], window: int) -> Any:
        """What a snapshot of request ``row`` keeps to re-run the draft (at most ``window`` entries), given its
        committed tokens ``history`` before the round; stored as :attr:`TTSExample.context`."""
        ...

    def keep_context(self, window: int) -> None:
        """Make the draft keep at least ``window`` entries of context per request."""
        ...


class _EngineStudentBase(EngineStudent):
    """Shared pieces: full-parameter selection by prefix, per-request adapter slots."""

    def trainable(self, name: str, param: nn.Parameter) -> bool:
        """Full-parameter training: the parameters under :attr:`trainable_prefixes` (never LoRA adapters)."""
        return any(name == p or name.startswith(p + ".") for p in self.trainable_prefixes) and ".lora_" not in name

    def keep_context(self, window: int) -> None:
        return None

    @staticmethod
    def _select_slots(slots, examples: Sequence[TTSExample]) -> None:
        """With per-request adapters (``--tts-scope request``: ``slots`` is the module's
        :class:`~specadapt.tts.LoRASlots`, else ``None``), point the adapters' rows at the examples' slots."""
        if slots is not None:
            slots.rows = torch.tensor([ex.slot for ex in examples])


class ModelDraftStudent(_EngineStudentBase):
    """Student of a :class:`~specadapt.engine.drafts.ModelDraft` (a transformers causal LM over the target's
    vocabulary): its own decoder layers train; embeddings, final norm and LM head stay frozen."""

    trainable_prefixes = ("model.layers",)
    draft_vocab = None

    def __init__(self, draft) -> None:
        self.draft = draft
        self.module = draft.model

    def refresh(self) -> None:
        """After a publish: re-pack the trained layers into the native forward's storage (in place)."""
        if self.draft.native is not None:
            self.draft.native.refresh_from(self.module)

    def context(self, row: int, history: list[int], window: int) -> torch.Tensor:
        """The last ``window`` committed tokens of request ``row`` (``[w] int64``)."""
        return torch.tensor(history[-window:], dtype=torch.int64)

    @staticmethod
    def logits_one(module: nn.Module, context: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Differentiable teacher-forced forward of one example: ``[C, V]`` logits that gave ``q_1..q_C``."""
        device = next(module.parameters()).device
        ids = torch.cat([context, drafts[:-1]])[None].to(device)
        # the last C positions of ids are the last context token and d_1..d_{C-1}: they give q_1..q_C
        return module(input_ids=ids, use_cache=False, logits_to_keep=drafts.shape[0]).logits[0]

    def example_logits(self, module: nn.Module, examples: Sequence[TTSExample]) -> torch.Tensor:
        """One forward per example, zero-padded to the longest ``C``: ``[N, C_max, V] float32``."""
        width = max(ex.drafts.shape[0] for ex in examples)
        rows = []
        slots = find_lora_slots(module)
        for ex in examples:
            self._select_slots(slots, [ex])
            logits = self.logits_one(module, ex.context, ex.drafts).float()
            c = ex.drafts.shape[0]
            if c < width:
                logits = torch.cat([logits, logits.new_zeros(width - c, logits.shape[1])])
            rows.append(logits)
        return torch.stack(rows)


class EagleDraftStudent(_EngineStudentBase):
    """Student of an :class:`~specadapt.engine.eagle_draft.EagleDraft`: the head's fuse / input projection /
    layer train; the target's embedding, norm and LM-head rows it borrows are shared and frozen."""

    trainable_prefixes = ("fuse", "input_proj", "layer")

    def __init__(self, draft) -> None:
        self.draft = draft
        self.module = draft.head
        self.draft_vocab = draft.head.draft_vocab.cpu()

    def refresh(self) -> None:
        """After a publish: re-pack the trained head into the native forward's storage (in place)."""
        if self.draft.native is not None:
            self.draft.native.refresh_from(self.module)

    def shared(self) -> list:
        """Objects a TTS shadow copy must share: the target's embedding / norm / LM-head rows."""
        return [self.module._shared]

    def context(self, row: int, history: list[int], window: int):
        """The last ``window`` real (feature, token) pairs of request ``row`` (they end with the round's slot 0)."""
        return self.draft.recent_features[row][-window:], self.draft.recent_tokens[row][-window:]

    def keep_context(self, window: int) -> None:
        """The EAGLE proposer keeps ``draft.window`` recent (feature, token) pairs per request: at least ``window``."""
        self.draft.window = max(self.draft.window, window)

    @staticmethod
    def logits_one(module: nn.Module, context, drafts: torch.Tensor) -> torch.Tensor:
        """Differentiable re-run of one round's drafting: ``[C, Vd]`` logits that gave ``q_1..q_C``."""
        from transformers import DynamicCache

        features, tokens = context
        device = module.fuse.weight.device
        cache = DynamicCache(config=module.config)
        out = module(tokens[None].to(device), features[None].to(device), cache=cache, use_cache=True, logits_to_keep=1)
        g, logits = out.hidden[:, -1:], [out.logits[0, -1]]
        position = tokens.shape[0]
        for k in range(1, drafts.shape[0]):
            step = module(
                drafts[k - 1].view(1, 1).to(device), g, position_ids=torch.tensor([[position]], device=device),
                cache=cache, use_cache=True,
            )
            g = step.hidden[:, -1:]
            logits.append(step.logits[0, -1])
            position += 1
        return torch.stack(logits)

    @staticmethod
    def logits_batch(module: nn.Module, contexts: list, drafts: list[torch.Tensor],
                     slots: list[int] | None = None) -> torch.Tensor:
        """:meth:`logits_one` for many examples: ``[N, C_max, Vd]`` (row ``i``'s positions past its own ``C_i`` are
        meaningless). Examples whose windows overlap (the rounds of one request) share one pass over their union,
        each query masked to its own window (:func:`~specadapt.engine.tts_windows.shared_window_logits`).
        ``slots``: per example adapter slot with per-request LoRA adapters (``--tts-scope request``)."""
        lora = find_lora_slots(module) if slots is not None else None
        return shared_window_logits(module, contexts, drafts, lora, slots)

    def example_logits(self, module: nn.Module, examples: Sequence[TTSExample]) -> torch.Tensor:
        """All examples in shared passes (:meth:`logits_batch`): ``[N, C_max, Vd] float32``."""
        slots = [ex.slot for ex in examples] if find_lora_slots(module) is not None else None
        return self.logits_batch(module, [ex.context for ex in examples], [ex.drafts for ex in examples],
                                 slots).float()
