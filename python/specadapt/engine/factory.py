"""Build a draft from its command-line spec (``none``, ``ngram``, ``suffix``, ``eagle``, ``eagle:PATH``,
``eagle+suffix`` / ``eagle:PATH+suffix`` (the hybrid), ``self:N``, or a model path)."""

from __future__ import annotations

import re

import torch

from ..sampling import SamplingParams
from .drafts import Draft, ModelDraft, NgramDraft, NoDraft, check_same_vocabulary, self_draft
from .models import LoadedModel, file_blocks_for, load_model

__all__ = ["DEFAULT_DRAFT", "build_draft", "parse_draft_spec"]

DEFAULT_DRAFT = "ngram"
_SELF = re.compile(r"^self:(\d+)$")


def parse_draft_spec(spec: str) -> tuple[str, int | str | None]:
    """Split a draft spec into ``("none", None)`` (target-only), ``("ngram", None)``, ``("suffix", None)``,
    ``("eagle", path or None)``, ``("hybrid", "eagle" or "eagle:PATH")`` (``...+suffix``), ``("self", N)`` or
    ``("model", path)``.

    Raises:
        ValueError: a ``self:`` spec without a positive integer; a ``+suffix`` spec whose model part is not
            ``eagle`` / ``eagle:PATH``.
    """
    if spec.endswith("+suffix"):
        model_spec = spec[: -len("+suffix")]
        if not (model_spec == "eagle" or (model_spec.startswith("eagle:") and len(model_spec) > 6)):
            raise ValueError(f"--draft {spec}: the hybrid's model draft must be eagle or eagle:PATH, got "
                             f"{model_spec!r}")
        return "hybrid", model_spec
    if spec in ("ngram", "none", "suffix"):
        return spec, None
    if spec == "eagle":
        return "eagle", None
    if spec.startswith("eagle:"):
        if not spec[6:]:
            raise ValueError("--draft eagle:PATH needs a path to a head file")
        return "eagle", spec[6:]
    if spec.startswith("self:"):
        m = _SELF.match(spec)
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"--draft self:N needs a positive integer N, got {spec!r}")
        return "self", int(m.group(1))
    return "model", spec


def build_draft(
    spec: str,
    target: LoadedModel,
    sampling: SamplingParams,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    native_format: str | None = None,
    suffix=None,
    trainable: bool = False,
    hybrid=None,
) -> Draft:
    """Construct the draft named by ``spec`` for ``target``. When the target runs on the native forward, a model
    draft does too, in ``native_format`` (default: the target's weight format). ``suffix``: the
    :class:`~specadapt.engine.suffix.SuffixConfig` of ``--draft suffix`` (default settings when ``None``);
    ``hybrid``: the :class:`~specadapt.engine.hybrid.HybridConfig` of ``--draft eagle+suffix``.
    ``trainable``: Test-Time Speculation will train the draft, so a standalone model draft loads its float32
    weights (not a skeleton over its GGUF file's blocks).

    Raises:
        ValueError: bad ``self:N``, an EAGLE head that does not fit the target, or ``eagle`` for a target
            other than the embedded default when no head path is given; FileNotFoundError: no head file; :class:`~specadapt.engine.models.ModelLoadError` for a model path that
            cannot be loaded; :class:`~specadapt.engine.drafts.VocabularyMismatchError` for a standalone draft
            whose vocabulary differs from the target's.
    """
    kind, value = parse_draft_spec(spec)
    draft_seed = seed + 1  # the draft's own seed (its coins also carry each request's seed)
    native = target.native
    if kind == "none":
        return NoDraft()
    if kind == "ngram":
        return NgramDraft()
    if kind == "suffix":
        from .suffix import SuffixDraft

        return SuffixDraft(suffix)
    if kind == "eagle":
        return _eagle(value, target, sampling, draft_seed, spec, native_format)
    if kind == "hybrid":
        from .hybrid import HybridDraft
        from .suffix import SuffixDraft

        model = _eagle(parse_draft_spec(value)[1], target, sampling, draft_seed, value, native_format)
        return HybridDraft(model, SuffixDraft(suffix), hybrid, name=spec)
    if kind == "self":
        if trainable and target.skeleton:
            raise ValueError(f"--draft {spec} with --tts trains the target's first layers, but {target.name} was loaded "
                             "without float32 weights (its own GGUF blocks); load it with --dtype int8 / float32")
        module = self_draft(target, int(value))
        draft_native = None
        if native is not None:
            from .native import NativeLlama

            draft_native = NativeLlama.from_hf(module, native_format or native.dtype_name, gguf_path=target.gguf_path,
                                               layers=int(value) if target.skeleton else None,
                                               kv_dtype=_kv_name(native))
        return ModelDraft(module, sampling, draft_seed, name=spec, native=draft_native)
    draft_format = native_format or (native.dtype_name if native is not None else None)
    file_blocks = (native is not None and not trainable and draft_format in ("auto", "gguf")
                   and file_blocks_for(str(value), "auto", "auto"))
    draft = load_model(str(value), dtype=dtype, device=device, file_blocks=file_blocks)
    check_same_vocabulary(target, draft)
    if native is not None:
        from .models import attach_forward

        attach_forward(draft, "auto", "auto" if file_blocks else draft_format, _kv_name(native))
    return ModelDraft(draft.model, sampling, draft_seed, name=spec, native=draft.native)


def _kv_name(native) -> str:
    return "float16" if native.kv_dtype == torch.float16 else "float32"


def _eagle(path, target: LoadedModel, sampling: SamplingParams, draft_seed: int, spec: str,
           native_format: str | None = None) -> Draft:
    from .eagle import eagle_default_path, load_eagle_head
    from .eagle_draft import EagleDraft

    if path is None:
        try:
            path = eagle_default_path(target.preset or target.name)
        except ValueError as exc:  # names the targets that have a head
            raise ValueError(f"--draft eagle: {exc}") from None
    head = load_eagle_head(path, target.model, native=target.native if target.skeleton else None)
    native = None
    if target.native is not None:
        from .native.eagle import NativeEagleHead

        native = NativeEagleHead(head, target.native, native_format)
    return EagleDraft(head, sampling, draft_seed, name=spec, native=native)
