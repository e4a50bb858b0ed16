"""The prompt split between draft training and evaluation (docs/draft_training.md).

Evaluation keeps, never trained on: all of AIME 2024, the first :data:`EVAL_LIVECODEBENCH` LiveCodeBench
problems and the first :data:`EVAL_MATH500` MATH-500 problems. Training draws from the rest of MATH-500 and
LiveCodeBench.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..datasets import load_prompts

__all__ = ["EVAL_LIVECODEBENCH", "EVAL_MATH500", "PROMPT_SETS", "TrainPrompt", "training_prompts", "evaluation_prompt_ids"]

#: LiveCodeBench problems ``[0, 32)`` are evaluation only.
EVAL_LIVECODEBENCH = 32
#: MATH-500 problems ``[0, 100)`` are evaluation only.
EVAL_MATH500 = 100


@dataclass(frozen=True)
class TrainPrompt:
    """One training prompt: ``key`` (``dataset:index``, stable across runs) and its text."""

    key: str
    text: str


#: The prompt sets :func:`training_prompts` can draw from (``--prompts`` of scripts/gen_draft_data.py).
PROMPT_SETS = {"all": ("math500", "livecodebench"), "math": ("math500",), "code": ("livecodebench",)}


def training_prompts(prompt_set: str = "all") -> list[TrainPrompt]:
    """The training prompts of ``prompt_set`` (a key of :data:`PROMPT_SETS`): MATH-500 ``[100, 500)`` and/or
    LiveCodeBench ``[32, end)``, in that order and in file order.

    Raises:
        ValueError: an unknown ``prompt_set`` (the message lists the known ones).
    """
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt_set must be one of {sorted(PROMPT_SETS)}, got {prompt_set!r}")
    sets = PROMPT_SETS[prompt_set]
    out = []
    if "math500" in sets:
        out += [TrainPrompt(f"math500:{i}", p.text) for i, p in enumerate(load_prompts("math500")) if i >= EVAL_MATH500]
    if "livecodebench" in sets:
        out += [TrainPrompt(f"livecodebench:{i}", p.text) for i, p in enumerate(load_prompts("livecodebench"))
                if i >= EVAL_LIVECODEBENCH]
    return out


def evaluation_prompt_ids() -> set[str]:
    """Keys (``dataset:index``) that must never appear in training data."""
    keys = {f"aime24:{i}" for i in range(len(load_prompts("aime24")))}
    keys |= {f"math500:{i}" for i in range(EVAL_MATH500)}
    keys |= {f"livecodebench:{i}" for i in range(EVAL_LIVECODEBENCH)}
    return keys
