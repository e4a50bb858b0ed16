"""Differentiable forwards of SGLang draft architectures for Test-Time Speculation (plain torch).

SGLang's draft modules run fused kernels without autograd and need a ForwardBatch and KV pool, so TTS trains
a plain-torch re-implementation whose parameters alias SGLang's tensors: the updater's publish copies into
exactly the storage SGLang's CUDA graphs replay (``--tts-params full``), or, with ``--tts-params lora``, the
publish merges the trained low-rank adapters into that storage (:class:`StudentWeights`).

* :class:`Eagle3LlamaStudent` -- EAGLE / EAGLE3: ``LlamaForCausalLMEagle3`` (one decoder layer over target
  features).
* :class:`DenseLMStudent` -- STANDALONE: a dense Llama / Mistral / Qwen2 / Qwen3 draft LM.
* :class:`~.dflash.DFlashStudent` -- DFLASH: the plain block-diffusion draft.

Each implements :class:`SGLangStudent` (:class:`specadapt.tts.Student` plus ``uses_features`` / ``vocab_size``).
"""

from __future__ import annotations

from torch import nn

from ._common import SGLangStudent, StudentWeights, TokenStudent
from .sharding import Layout, TensorParallel
from .eagle3 import Eagle3LlamaStudent
from .standalone import SUPPORTED_ARCHITECTURES, DenseLMStudent

__all__ = ["DenseLMStudent", "Eagle3LlamaStudent", "Layout", "SGLangStudent", "StudentWeights", "TensorParallel",
           "TokenStudent", "build_student"]


def build_student(draft_model: nn.Module, config, params: str = "full", lora_rank: int = 8, tp=None):
    """The student for ``draft_model``'s architecture.

    Args:
        draft_model: SGLang's serving draft module; config: its HF config.
        params: ``full`` or ``lora`` (``--tts-params``); lora_rank: ``--tts-lora-rank``.
        tp: this rank's :class:`~.sharding.TensorParallel` when the draft is sharded over TP ranks (``None``: 1).

    Raises:
        ValueError: an architecture without a student (the message lists the supported ones), or a layout the
            student cannot train (see the student classes).
    """
    arch = type(draft_model).__name__
    names = dict(draft_model.named_parameters())
    if arch == "LlamaForCausalLMEagle3" or "model.layers.0.hidden_norm.weight" in names:
        return Eagle3LlamaStudent(draft_model, config, params, lora_rank, tp)
    if arch in SUPPORTED_ARCHITECTURES:
        return DenseLMStudent(draft_model, config, params, lora_rank, tp)
    raise ValueError(f"TTS has no training forward for the draft architecture {arch}; supported: "
                     f"LlamaForCausalLMEagle3 (EAGLE/EAGLE3), {', '.join(SUPPORTED_ARCHITECTURES)} (STANDALONE)")
