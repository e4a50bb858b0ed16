"""Loading a GGUF model for its own blocks: config and tokenizer without the weights, cached per file.

transformers builds a GGUF model's config and tokenizer by parsing the file's metadata (for a 151,936-token
vocabulary about 10 s each on our CPUs) and de-quantises every tensor to float32 (6 GB for a 1.5B model). When the
native forward runs the file's own blocks (``--dtype gguf``), none of the float32 weights are needed: the model
is a skeleton on the ``meta`` device (its config, generation config and module tree; no storage), and the native
forward reads the blocks itself (:meth:`specadapt.engine.native.NativeLlama.from_gguf`). The config and
tokenizer are saved once into the file's derived cache directory (:mod:`specadapt.engine.cache_dirs`) and read
from there on every later start.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .cache_dirs import derived_cache_dir

logger = logging.getLogger(__name__)

__all__ = ["gguf_block_types", "wants_file_blocks", "load_skeleton", "FILE_ONLY_TYPES"]

#: Block types transformers' float32 path would have to de-quantise (any of them in a file makes ``--dtype
#: auto`` pick the file's own blocks); the embedded default holds only Q4_1 / Q8_0 / F32: its blocks are what ``int4`` runs,
#: so it loads as a skeleton too (:func:`_int4_is_the_file`).
FILE_ONLY_TYPES = {"Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1", "Q4_0"}


def gguf_block_types(path: str) -> dict[str, str]:
    """``{tensor name: GGUF type name}`` of every tensor of a GGUF file (from its cached tensor index)."""
    from .native.gguf_blocks import tensor_index

    return {name: entry[0] for name, entry in tensor_index(path)["tensors"].items()}


def wants_file_blocks(gguf_path: str | None, forward: str, weights: str) -> bool:
    """Whether a model should load as a skeleton for the native forward over the file's own blocks: a GGUF file,
    a forward that may be native, and ``weights`` ``gguf``, or ``auto`` with block types of
    :data:`FILE_ONLY_TYPES` in the file or a file whose blocks are exactly what ``int4`` runs (Q4_1 layers).

    A file with a matrix in a type the kernels lack is an error under ``gguf`` (naming the tensor and type) and,
    under ``auto``, a logged fallback to transformers' de-quantisation.

    Raises:
        ValueError: ``weights == "gguf"`` and a matrix type the native forward does not read.
    """
    from .native.gguf_blocks import BLOCK_TYPES

    if gguf_path is None or forward == "hf" or weights not in ("auto", "gguf"):
        return False
    types = gguf_block_types(gguf_path)
    lacking = {name: kind for name, kind in types.items() if kind not in BLOCK_TYPES and kind not in ("F32", "F16")}
    if lacking:
        name, kind = next(iter(lacking.items()))
        message = (f"{gguf_path}: tensor {name} is {kind}, a block type the native forward does not read "
                   f"(it reads {', '.join(BLOCK_TYPES)})")
        if weights == "gguf":
            raise ValueError(f"--dtype gguf: {message}")
        logger.warning("%s: loading it through transformers' float32 de-quantisation instead", message)
        return False
    kinds = set(types.values())
    return weights == "gguf" or bool(kinds & FILE_ONLY_TYPES) or _int4_is_the_file(types)


def _int4_is_the_file(types: dict[str, str]) -> bool:
    """Whether ``--dtype int4`` would run exactly the file's own blocks: every layer matrix Q4_1 and the embedding /
    LM head Q8_0 (the embedded default's file). Such a file then loads as a skeleton under ``--dtype auto`` too, the
    same native model bit for bit, without the float32 de-quantisation transformers makes of it (its config and
    tokenizer cached after the first load: the start-up drops from about 15 s to about 4 s on 2 cores)."""
    matrices = {name: kind for name, kind in types.items() if kind not in ("F32", "F16")}
    layers = {kind for name, kind in matrices.items() if name.startswith("blk.")}
    others = {kind for name, kind in matrices.items() if not name.startswith("blk.")}
    return layers == {"Q4_1"} and others <= {"Q8_0"}


def load_skeleton(folder: str, gguf_file: str):
    """``(config, tokenizer, model)`` of a GGUF file with the model on the ``meta`` device (no weights).

    The first call for a file builds the config and tokenizer from its metadata and saves both to
    :func:`derived_cache_dir`; later calls load them from there.

    Raises:
        OSError / ValueError: the file or its cached config / tokenizer cannot be read (the caller reports it).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = str(Path(folder) / gguf_file)
    cache = derived_cache_dir(path)
    ready = cache / "READY"
    if ready.is_file():
        config = AutoConfig.from_pretrained(str(cache))
        tokenizer = AutoTokenizer.from_pretrained(str(cache))
        logger.info("config and tokenizer of %s from the cache %s", gguf_file, cache)
    else:
        logger.info("reading the config and tokenizer of %s (once; cached in %s)", gguf_file, cache)
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        cache.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(cache))
        tokenizer.save_pretrained(str(cache))
        ready.write_text(path + "\n")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.eval()
    model.requires_grad_(False)
    return config, tokenizer, model
