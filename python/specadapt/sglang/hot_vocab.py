"""EAGLE-3 drafts with a reduced ("hot") vocabulary under the plugin's verification rules.

Most EAGLE-3 checkpoints predict over ``V_d`` hot tokens (``d2t``: draft id -> target id; e.g. 32k of Llama 3's
128k). SGLang 0.5.23 refuses rejection sampling for them ("FIXME: ... scattering draft probs into the target vocab
via the d2t map"), so without this the plugin's rules could not run on them. Rejection sampling, block
verification and GBV are exact for any proposal law on the target vocabulary; the draft's law is ``q_d`` on the
hot ids and 0 elsewhere. The plugin therefore hands SGLang every q row scattered into the target vocabulary:

* AROUND ``EagleDraftWorker.alloc_memory_pool``: SGLang's vocabulary check is skipped (rejection sampling hidden
  for the call), and the draft's ``hot_token_id`` (set there by ``init_lm_head``) is recorded as a
  :class:`HotVocab` in the process state (:attr:`specadapt.sglang.state.PluginState.hot_vocab`);
* the draft sampler and the draft extends return ``q`` over ``V`` while the sampled ids stay draft ids (SGLang
  maps them through ``hot_token_id`` itself).

Those hooks are in :mod:`.draft_hooks`; this module holds the map. Nothing here imports sglang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HotVocab"]


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
