"""One round's supervision of one request (:class:`TTSExample`) and the collate that turns a list of them into the
inputs of :func:`~specadapt.tts.loss.tts_loss` (:func:`collate`). Both adapters (the embedded engine and the SGLang
plugin) build the same example type; what differs per draft is only what its :class:`~.student.Student` reads as
input (``tokens``, ``features``, ``context``, ``drafts``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .topk import dense_rows

__all__ = ["CollatedExamples", "TTSExample", "collate"]


@dataclass
class TTSExample:
    """Supervision of one request in one round.

    Supervision (every adapter):
        teacher: ``[C, V] float32`` the target's rows at the round's ``C`` supervised draft positions (over the
            draft's output vocabulary ``V``), or with ``--tts-topk k`` the ``[C, k]`` renormalised top-k values
            whose token ids are ``teacher_index``.
        weights: ``[C] float32`` position weights (``gamma^(k-1)``, 0 = not supervised).
        proximal: ``[C, V] float32`` the draft's rows ``q_t`` the round was drafted from (top-k as ``teacher``),
            or ``None`` (no proximal term: a DFLASH block, a round drafted without q rows).
        teacher_index, proximal_index: ``[C, k] int32`` ids of the kept entries; ``None`` for dense rows.
        vocab: ``V``, the width of the dense rows (``None``: ``teacher.shape[1]``, rows stored dense).

    Student inputs (each student reads the ones its draft needs; the others stay ``None``):
        tokens: ``[T] int64`` input tokens (SGLang EAGLE-3 / STANDALONE: context tokens then the round's verified
            tokens except the last; DFLASH: the block ``[bonus, mask, ...]``).
        features: ``[T, H]`` target features of the inputs (SGLang; ``H = 0`` for a draft that reads none).
        context: the embedded engine draft's context (``[w] int64`` committed tokens of a model draft, or the
            EAGLE head's ``([w, 3h] features, [w] int64 tokens)`` of its last real pairs).
        drafts: ``[C] int64`` the round's drafted tokens (embedded engine).

    Bookkeeping:
        accepted: drafts accepted in the round (tau; already folded into ``weights``).
        first_valid: 1 when the SGLang request had no committed history (its first position has no preceding
            feature, so ``weights[0]`` is 0).
        slot: the request's adapter slot (engine, ``--tts-scope request``), else 0.
    """

    teacher: torch.Tensor
    weights: torch.Tensor
    proximal: torch.Tensor | None = None
    teacher_index: torch.Tensor | None = None
    proximal_index: torch.Tensor | None = None
    vocab: int | None = None
    tokens: torch.Tensor | None = None
    features: torch.Tensor | None = None
    context: Any = None
    drafts: torch.Tensor | None = None
    accepted: int = 0
    first_valid: int = 0
    slot: int = 0

    @property
    def width(self) -> int:
        """``V``: the width of the dense teacher / proximal rows."""
        return self.vocab if self.vocab is not None else int(self.teacher.shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the example holds (snapshot memory accounting)."""
        parts = list(self.context) if isinstance(self.context, (tuple, list)) else [self.context]
        tensors = parts + [self.teacher, self.weights, self.proximal, self.teacher_index, self.proximal_index,
                           self.tokens, self.features, self.drafts]
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    def teacher_rows(self) -> torch.Tensor:
        """``[C, V]`` dense teacher rows (zeros outside the top-k when truncated)."""
        return dense_rows(self.teacher, self.teacher_index, self.width)

    def proximal_rows(self) -> torch.Tensor | None:
        """``[C, V]`` dense drafting rows ``q_t`` (zeros outside the top-k when truncated), or ``None``."""
        return None if self.proximal is None else dense_rows(self.proximal, self.proximal_index, self.width)


@dataclass
class CollatedExamples:
    """The loss inputs of ``N`` examples padded to ``W`` positions (see :func:`collate`).

    Attributes:
        teacher: ``[N, W, V]`` dense teacher rows (zero rows past each example's ``C``).
        weights: ``[N, W] float32`` position weights (0 past each example's ``C``).
        proximal: ``[N, W, V]`` dense proximal rows, or ``None`` when no example carries any.
    """

    teacher: torch.Tensor
    weights: torch.Tensor
    proximal: torch.Tensor | None


def collate(examples: Sequence[TTSExample], width: int | None = None,
            device: torch.device | str | None = None) -> CollatedExamples:
    """Pad ``examples`` into the loss inputs of :func:`~specadapt.tts.loss.tts_loss`.

    Args:
        examples: one or more examples of one update; the dense width ``V`` is the first example's.
        width: ``W``, positions per row (``None``: the longest example's ``C``); the student's logits must have
            the same width.
        device: where the result lives (``None``: the first example's teacher's device).

    Returns:
        :class:`CollatedExamples`; an example without ``proximal`` among others with it gets zero proximal rows.

    Raises:
        ValueError: no example, or an example longer than ``width``.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    ref = examples[0]
    longest = max(int(ex.teacher.shape[0]) for ex in examples)
    width = longest if width is None else int(width)
    if longest > width:
        raise ValueError(f"an example supervises {longest} positions, more than width = {width}")
    n, vocab = len(examples), ref.width
    teacher = ref.teacher.new_zeros(n, width, vocab)
    weights = torch.zeros(n, width, dtype=torch.float32, device=ref.weights.device)
    with_proximal = any(ex.proximal is not None for ex in examples)
    proximal = ref.teacher.new_zeros(n, width, vocab) if with_proximal else None
    for i, ex in enumerate(examples):
        c = ex.teacher.shape[0]
        teacher[i, :c] = ex.teacher_rows()
        weights[i, :c] = ex.weights
        if proximal is not None and ex.proximal is not None:
            proximal[i, :c] = ex.proximal_rows()
    if device is not None:
        teacher, weights = teacher.to(device), weights.to(device)
        proximal = None if proximal is None else proximal.to(device)
    return CollatedExamples(teacher, weights, proximal)
