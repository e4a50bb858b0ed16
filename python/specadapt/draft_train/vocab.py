"""The draft vocabulary: the target tokens the head can propose (EAGLE-3's reduced LM head).

The head's LM head has one row per draft-vocabulary token, so its size sets the cost of every draft step's
largest matrix product; a token outside it can never be drafted (its draft probability is 0, so a round whose
target samples it rejects there). The vocabulary is the most frequent tokens of the target's own answers in the
training data, plus the end-of-sequence tokens.
"""

from __future__ import annotations

import torch

__all__ = ["answer_token_counts", "top_vocabulary", "coverage"]


def answer_token_counts(sequences, vocab_size: int) -> torch.Tensor:
    """``[V] int64`` occurrences of each token in the answers (tokens after each sequence's prompt).

    Args:
        sequences: objects with ``tokens [T] int64`` and ``prompt_len``; vocab_size: ``V``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in sequences:
        counts += torch.bincount(s.tokens[s.prompt_len :], minlength=vocab_size)[:vocab_size]
    return counts


def top_vocabulary(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """The ``size`` most frequent ids (ties: lower id first), always including ``always``; sorted ``[size]
    int64``.

    Raises:
        ValueError: ``size`` outside ``[len(always), V]``.
    """
    vocab = counts.shape[0]
    always = sorted(set(int(a) for a in always))
    if not len(always) <= size <= vocab:
        raise ValueError(f"draft vocabulary size must lie in [{len(always)}, {vocab}], got {size}")
    score = counts.double().clone()
    score[torch.tensor(always, dtype=torch.int64)] = float("inf")
    order = torch.argsort(-score, stable=True)  # stable: ties keep the lower id first
    return order[:size].sort().values


def coverage(tokens: torch.Tensor, vocab: torch.Tensor) -> float:
    """Fraction of ``tokens [N]`` that lie in ``vocab`` (an upper bound on how often the head can draft the
    token the target samples)."""
    if tokens.numel() == 0:
        return float("nan")
    return float(torch.isin(tokens, vocab).double().mean())
