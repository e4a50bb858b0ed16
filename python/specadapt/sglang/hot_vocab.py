"""EAGLE-3 drafts with a reduced ("hot") vocabulary under the plugin's verification rules.

Most EAGLE-3 checkpoints predict over ``V_d`` hot tokens (``d2t``: draft id -> target id; e.g. 32k of Llama 3's
128k). SGLang 0.5.23 refuses rejection sampling for them ("FIXME: ... scattering draft probs into the target vocab
via the d2t map"), so without this the plugin's rules could not run on them. Rejection sampling, block
verification and GBV are exact for any proposal law on the target vocabulary; the draft's law is ``q_d`` on the
hot ids and 0 elsewhere. The plugin therefore hands SGLang every q row scattered into the target vocabulary:

* AROUND ``EagleDraftWorker.alloc_memory_pool``: SGLang's vocabulary check is skipped (rejection sampling hidden
  for the call), and the draft's ``hot_token_id`` (set there by ``init_lm_head``) is recorded;
* the draft sampler and the draft extends (:mod:`specadapt.sglang.gbv` hooks) return ``q`` over ``V`` while the
  sampled ids stay draft ids (SGLang maps them through ``hot_token_id`` itself).

Nothing here imports sglang at module import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("specadapt.sglang")

__all__ = ["HotVocab", "alloc_memory_pool_around", "get_hot_vocab", "set_hot_vocab", "to_draft", "to_target"]


@dataclass
class HotVocab:
    """``ids [V_d] int64``: target id of each draft id; ``target_vocab``: ``V``.

    Raises:
        ValueError: ids outside ``[0, V)`` or repeated.
    """

    ids: torch.Tensor
    target_vocab: int

    def __post_init__(self) -> None:
        self.ids = torch.as_tensor(self.ids).reshape(-1).to(torch.int64)
        if self.ids.numel() and (int(self.ids.min()) < 0 or int(self.ids.max()) >= self.target_vocab):
            raise ValueError(f"hot_token_id has ids outside [0, {self.target_vocab})")
        if torch.unique(self.ids).numel() != self.ids.numel():
            raise ValueError("hot_token_id repeats a target id")

    def to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """``[..., V_d]`` -> ``[..., V]`` (zeros outside the hot ids); other widths are returned unchanged."""
        if probs.shape[-1] != self.ids.numel():
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.target_vocab)
        ids = self.ids.to(probs.device)
        return out.index_copy_(probs.dim() - 1, ids, probs)

    def to_draft(self, probs: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` -> ``[..., V_d]`` (the hot ids' entries); other widths are returned unchanged."""
        if probs.shape[-1] != self.target_vocab or self.ids.numel() == self.target_vocab:
            return probs
        return probs.index_select(-1, self.ids.to(probs.device))


_HOT: HotVocab | None = None


def set_hot_vocab(hot: HotVocab | None) -> None:
    """Install (or clear) this process's :class:`HotVocab`."""
    global _HOT
    _HOT = hot


def get_hot_vocab() -> HotVocab | None:
    """This process's :class:`HotVocab` (``None``: the draft predicts the target vocabulary)."""
    return _HOT


def to_target(probs):
    """q rows over the target vocabulary (no-op without a hot vocabulary or for ``None``)."""
    return probs if _HOT is None or probs is None else _HOT.to_target(probs)


def to_draft(probs):
    """q rows over the draft vocabulary (no-op without a hot vocabulary or for ``None``)."""
    return probs if _HOT is None or probs is None else _HOT.to_draft(probs)


def alloc_memory_pool_around(original, worker, *args, **kwargs):
    """AROUND ``EagleDraftWorker.alloc_memory_pool``: run it with rejection sampling hidden (SGLang refuses a hot
    vocabulary under it), then record the draft's ``hot_token_id`` for the q-row scatter."""
    from sglang.srt.runtime_context import get_spec

    with get_spec().override(speculative_use_rejection_sampling=False):
        result = original(worker, *args, **kwargs)
    if not get_spec().speculative_use_rejection_sampling:
        return result
    target_vocab = int(worker.target_worker.model_config.vocab_size)
    draft_rows = int(worker.draft_runner.model_config.vocab_size)  # width of SGLang's draft_probs graph buffers
    if draft_rows != target_vocab:
        raise RuntimeError(f"specadapt: the draft's config vocab_size ({draft_rows}) differs from the target's "
                           f"({target_vocab}); q rows over the target vocabulary would not fit SGLang's buffers")
    hot = getattr(worker, "hot_token_id", None)
    if hot is not None:
        mode = getattr(getattr(worker, "server_args", None), "disaggregation_mode", None)
        if mode not in (None, "null"):
            raise RuntimeError(f"specadapt: a hot-vocabulary draft with --disaggregation-mode {mode} is not supported "
                               "(the prefill-decode handover builds q over draft ids)")
        set_hot_vocab(HotVocab(hot, target_vocab))
        logger.info("specadapt: the draft predicts %d hot tokens of %d; q rows are scattered into the target "
                    "vocabulary for verification", int(hot.numel()), target_vocab)
    return result
