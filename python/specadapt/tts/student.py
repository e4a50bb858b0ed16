"""The :class:`Student` protocol -- what Test-Time Speculation needs from a draft -- and :func:`distillation_loss`,
the one loss every adapter hands to :class:`~specadapt.tts.updater.TTSUpdater`.

A student is the draft's differentiable forward over the tensors the updater trains. The embedded engine's drafts
(:mod:`specadapt.engine.tts_students`) and the SGLang plugin's students (:mod:`specadapt.sglang.students`) both
implement it; adapters may extend it with what only they need (the engine's context capture, the plugin's
snapshot layout), but the updater and the loss only ever see this protocol, :class:`~.example.TTSExample` and
:func:`~.example.collate`.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from .example import TTSExample, collate
from .loss import tts_loss

__all__ = ["Student", "distillation_loss"]


@runtime_checkable
class Student(Protocol):
    """The differentiable forward of one draft (implement it by subclassing, which also inherits the default
    :meth:`shared`; ``isinstance(obj, Student)`` checks the members below).

    Attributes:
        module: the ``nn.Module`` the updater trains: it deep-copies it into a shadow (sharing frozen tensors and
            :meth:`shared` objects), trains the shadow, and copies the trained tensors back into ``module`` in
            place at every publish.
        draft_vocab: ``[V'] int64`` target-vocabulary id of each row the draft outputs (a reduced-vocabulary head:
            EAGLE, EAGLE-3 hot vocabulary), or ``None`` when the draft predicts the target's vocabulary.
    """

    module: nn.Module
    draft_vocab: torch.Tensor | None

    def trainable(self, name: str, param: nn.Parameter) -> bool:
        """Whether ``module``'s parameter ``name`` trains (the draft's own layers, or its LoRA adapters; never
        tensors shared with the target such as its embedding)."""
        ...

    def shared(self) -> Sequence[Any]:
        """Objects the shadow copy must share instead of copying (e.g. modules borrowed from the target)."""
        return ()

    def refresh(self) -> None:
        """After a publish / rollback: update what serving reads from ``module`` (re-pack native weights, merge
        LoRA adapters); nothing when serving reads ``module``'s tensors directly."""
        ...

    def example_logits(self, module: nn.Module, examples: Sequence[TTSExample]) -> torch.Tensor:
        """The draft's logits at the supervised positions, differentiable in ``module``'s trainable parameters.

        Args:
            module: ``module`` itself or the updater's shadow copy of it.
            examples: ``N`` examples built by the student's adapter (their ``tokens`` / ``features`` /
                ``context`` / ``drafts`` are what this student reads).

        Returns:
            ``[N, W, V'] float`` logits; row ``i``'s first ``examples[i].teacher.shape[0]`` positions predict its
            teacher rows, later ones are padding (any finite value: zero weight). ``W`` is at least the longest
            example's ``C``.
        """
        ...


def distillation_loss(student: Student, module: nn.Module, examples: Sequence[TTSExample],
                      temperature: float = 1.0, proximal_weight: float = 0.0) -> torch.Tensor:
    """The TTS objective of one update: the student's logits against the collated examples.

    Args:
        student: the draft's :class:`Student`; module: the module to differentiate (the updater's shadow).
        examples: the update's examples (at least one).
        temperature: the student's temperature in the loss (``q = softmax(logits / T)``; 0 means 1).
        proximal_weight: ``lambda`` of the proximal term (applied only when the examples carry ``proximal`` rows).

    Returns:
        A scalar tensor (:func:`~specadapt.tts.loss.tts_loss`).

    Raises:
        ValueError: no example, or logits narrower than an example's supervised positions.
    """
    logits = student.example_logits(module, examples)
    batch = collate(examples, width=logits.shape[1], device=logits.device)
    return tts_loss(logits, batch.teacher, batch.weights, temperature, batch.proximal,
                    proximal_weight if batch.proximal is not None else 0.0)
