"""The engine flags of the embedded engine's front ends (``specadapt generate`` and ``specadapt serve``): one
definition of each flag, its validation and the construction of target, draft and engine from them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..budget.config import AVConfig
from ..settings import add_arguments, flag_message, from_namespace
from ..tts.config import TTSConfig
from ..verification.rules import DEFAULT_RULE, RULES, get_rule, join_names, rule_names
from .common import UsageError, add_threads_argument, apply_threads

logger = logging.getLogger(__name__)

ENGINE_DEFAULTS = dict(
    model="smollm2-135m",
    draft="ngram",
    temperature=1.0,
    top_p=0.95,
    top_k=0,
    num_draft_tokens=None,  # per draft: default_num_draft_tokens()
    verify=DEFAULT_RULE,
    seed=0,
    dtype="auto",
    forward="auto",
    kv_dtype="auto",
    device="cpu",
)


def add_engine_arguments(p) -> None:
    """Add the engine flags (target, draft, sampling, verification, adaptive verification, Test-Time
    Speculation, weight format, device) to the argparse parser ``p``."""
    d = ENGINE_DEFAULTS
    p.add_argument("--model", default=d["model"], help="target: smollm2-135m (embedded), a preset (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b: make "
                        "install-coder / install-models, docs/models.md), a HF model directory or a .gguf file")
    add_threads_argument(p)
    p.add_argument(
        "--draft", default=d["draft"], help="ngram (prompt lookup), suffix (continuation frequencies over this request "
        "and earlier outputs, sized by the match; docs/suffix.md), eagle (the trained head shipped for the target: smollm2-135m, qwen2.5-coder-1.5b), eagle:PATH "
        "(a head file), eagle+suffix / eagle:PATH+suffix (the hybrid: suffix drafts where the text repeats, the head "
        "elsewhere; docs/suffix.md), self:N (first N target layers), a model path, or none (target-only decoding)"
    )
    p.add_argument("--suffix-max-depth", type=int, default=8, help="--draft suffix: longest context matched (tokens)")
    p.add_argument("--suffix-factor", type=float, default=1.0,
                   help="--draft suffix: drafts per matched token (a round drafts at most ceil(F x match length))")
    p.add_argument("--suffix-min-prob", type=float, default=0.1,
                   help="--draft suffix: stop a draft when its estimated probability falls below this")
    p.add_argument("--suffix-global-tokens", type=int, default=16384,
                   help="--draft suffix: earlier requests' output tokens kept in the shared index, oldest evicted "
                        "(0: per request only)")
    p.add_argument("--hybrid-min-match", type=int, default=4,
                   help="--draft eagle+suffix: suffix match length (tokens) from which a round takes the suffix draft")
    p.add_argument("--hybrid-min-tokens", type=int, default=2,
                   help="--draft eagle+suffix: fewest suffix drafts for a round to take the suffix draft")
    p.add_argument("--hybrid-model-tokens", type=int, default=1,
                   help="--draft eagle+suffix: the head's chain length on rounds it drafts (--num-draft-tokens caps "
                        "the suffix draft)")
    p.add_argument("--temperature", type=float, default=d["temperature"], help="0 = greedy")
    p.add_argument("--top-p", type=float, default=d["top_p"], help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=d["top_k"], help="0 disables top-k")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens with probability >= MIN_P x the most likely one's (after top-k / top-p); 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; logits of tokens in the prompt or the output so far: positive / it, negative x it; 1 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted once per occurrence of a token in the output so far (not the prompt)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted from tokens that occur in the output so far (not the prompt)")
    p.add_argument("--logit-bias", default=None, metavar="ID:BIAS,...",
                   help="biases added to the logits of token ids, e.g. 13:-5,2:1.5 (ids of the target's vocabulary)")
    p.add_argument("--num-draft-tokens", type=int, default=d["num_draft_tokens"],
                   help="L, drafts per round; default by measurement (docs/results.md): 1 for ngram and eagle with "
                        "chain / block, 2 with gbv, 5 for other drafts and with --adaptive-verification (it prunes); "
                        "4 for suffix (a cap: it sizes each round by its match)")
    p.add_argument("--verify", default=d["verify"], choices=list(RULES), help="verification rule: " + "; ".join(
        f"{r.name}: {r.description}" for r in RULES.values()))
    p.add_argument(
        "--num-paths", type=int, default=None,
        help=f"K, sampled draft paths per request for --verify {join_names(rule_names(multi_path=True))} (None: "
             + ", ".join(f"{RULES[n].default_num_paths} for {n}" for n in rule_names(multi_path=True))
             + f", 1 for {'/'.join(rule_names(multi_path=False))})",
    )
    p.add_argument(
        "--verify-impl", default="auto", choices=["auto", "compiled", "cupy", "reference"],
        help="verification implementation: fused C++/CUDA kernel, CuPy JIT of the CUDA kernels, float64 reference, "
             "or auto (kernel if built, else CuPy on CUDA, else reference)",
    )
    p.add_argument(
        "--no-packed-forward", dest="packed_forward", action="store_false",
        help="pad the target's ragged forwards to the widest row instead of packing the real tokens "
             "(packed: pruned drafts and shorter rows cost no compute)",
    )
    p.add_argument("--speculation", default="auto", choices=["auto", "on", "off"],
                   help="auto: speculate, and with --adaptive-verification let a budget of 0 switch speculation off "
                        "(plain target steps, no draft work; probe rounds switch it back on); on: never switch off; "
                        "off: no request speculates (target-only steps; the draft is loaded but never runs)")
    av = p.add_argument_group("adaptive verification")
    av.add_argument("--adaptive-verification", action="store_true",
                    help="prune each round's drafts to the budget an online acceptance estimator predicts pays")
    add_arguments(av, AVConfig, "engine")  # --av-*: AVConfig's fields
    av.add_argument("--log-drafts", default=None, metavar="PATH",
                    help="write one JSON line per verified draft (feature, position, prediction, label) for "
                         "`specadapt eval-estimator`; without --adaptive-verification the estimator runs without pruning")
    tts = p.add_argument_group("Test-Time Speculation (online distillation of a model draft)")
    tts.add_argument("--tts", action="store_true",
                     help="train the draft online on the target's verification pass (eagle, self:N or a model draft)")
    add_arguments(tts, TTSConfig, "engine")  # --tts-*: TTSConfig's fields
    tts.add_argument("--tts-sync", action="store_true",
                     help="run updates inline at the boundary instead of on a background thread (CUDA: a side "
                          "stream). Without it updates run in the background where they have compute of their own "
                          "(CUDA, or a CPU with more cores than the decoder's threads) and inline otherwise")
    p.add_argument("--seed", type=int, default=d["seed"], help="seeds the coins of verification and the draft")
    p.add_argument("--dtype", default=d["dtype"], choices=["auto", "float32", "bfloat16", "int8", "int4", "gguf"],
                   help="weight format of target and draft: float32, bfloat16, int8 (Q8_0 blocks), int4 (Q4_1 blocks; "
                        "a GGUF file's own 4-bit weights) or gguf (a GGUF file's own blocks, Q4_K / Q6_K / Q5_0 / "
                        "Q8_0 / Q4_1, read without a float32 copy), the block formats with 8-bit activations and "
                        "the native forward only; auto: gguf for a K-quant GGUF file (the qwen2.5-coder presets), "
                        "int4 for a Q4_1 GGUF file (the embedded default), else float32")
    p.add_argument("--forward", default=d["forward"], choices=["auto", "native", "hf"],
                   help="native: specadapt's fused Llama-family decoder over a static slot KV cache (Llama, Mistral, "
                        "Qwen2, Qwen3); hf: transformers' forward; auto: native when the architecture is supported")
    p.add_argument("--kv-dtype", default=d["kv_dtype"], choices=["auto", "float32", "float16"],
                   help="native KV cache entries (auto: float16 with int8 / int4 weights, else float32)")
    p.add_argument("--device", default=d["device"], help="cpu or cuda")


def validate_engine_args(args) -> None:
    """Check the engine flags (shared by ``generate`` and ``serve``) and fill their measured defaults
    (``num_draft_tokens``, ``logit_bias_map``; ``num_paths`` is :func:`num_paths_of`).

    Raises:
        UsageError: a value out of range or an incompatible combination, naming the flag.
    """
    apply_threads(args)
    if args.draft == "none":  # target-only decoding: no drafts, nothing to adapt or prune
        for flag, on in (("--tts", args.tts), ("--adaptive-verification", args.adaptive_verification),
                         ("--log-drafts", args.log_drafts),
                         (f"--verify {args.verify}", get_rule(args.verify, "--verify").multi_path)):
            if on:
                raise UsageError(f"{flag} needs a draft; --draft none decodes target-only")
        if args.num_draft_tokens not in (None, 0):
            raise UsageError(f"--num-draft-tokens {args.num_draft_tokens}: --draft none verifies no drafts (L = 0)")
        args.num_draft_tokens = 0
    if args.num_draft_tokens is None:
        args.num_draft_tokens = default_num_draft_tokens(args.draft, args.verify, args.adaptive_verification)
    if args.num_draft_tokens < 1 and args.draft != "none":
        raise UsageError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    if not 0 <= args.temperature < float("inf"):
        raise UsageError(f"--temperature must be a finite number >= 0 (below 1e-6 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {args.top_k}")
    args.logit_bias_map = parse_logit_bias(args.logit_bias)
    sampling_params(args)  # every sampling flag's range, named
    num_paths = num_paths_of(args)
    if num_paths < 1:
        raise UsageError(f"--num-paths must be >= 1, got {num_paths}")
    if num_paths > 1 and not get_rule(args.verify).multi_path:
        raise UsageError(f"--num-paths {num_paths} needs --verify {join_names(rule_names(multi_path=True))} "
                         f"({join_names(rule_names(multi_path=False), 'and')} verify one path)")
    av_config(args)  # every --av-* range, named
    if args.adaptive_verification and not get_rule(args.verify).adaptive:
        raise UsageError(f"--adaptive-verification does not apply to --verify {args.verify}")
    if args.log_drafts and get_rule(args.verify).multi_path:
        raise UsageError(f"--log-drafts logs the estimator of {' / '.join(rule_names(multi_path=False))} "
                         f"verification, not {args.verify}")
    from ..engine.factory import parse_draft_spec

    try:
        draft_kind, _ = parse_draft_spec(args.draft)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if draft_kind == "model":
        import os

        if not os.path.exists(args.draft):
            raise UsageError(f"--draft: {args.draft!r} is neither none, ngram, suffix, eagle, eagle:PATH, self:N nor an "
                             "existing model directory or .gguf file")
    if get_rule(args.verify).multi_path and draft_kind in ("ngram", "suffix", "hybrid"):
        raise UsageError(f"--verify {args.verify} needs a sampled draft (eagle, self:N or a model path): the "
                         f"{args.draft} draft proposes one path")
    if draft_kind == "hybrid" and args.adaptive_verification:
        raise UsageError(f"--adaptive-verification does not apply to --draft {args.draft} yet: its estimator is "
                         "fitted on one draft family's feature (use --draft suffix or eagle with it)")
    suffix_config(args)  # every --suffix-* range, named
    hybrid_config(args)  # every --hybrid-* range, named
    if args.tts:
        if draft_kind in ("ngram", "suffix"):
            raise UsageError(f"--tts needs a model draft (--draft eagle, self:N or a model path): {draft_kind} has no "
                             "weights")
        tts_config(args)  # every --tts-* range, named
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.verify_impl == "cupy" and not args.device.startswith("cuda"):
        raise UsageError("--verify-impl cupy runs the CUDA kernels through CuPy: it needs --device cuda")


#: L per draft where it was measured (scripts/speedup_study.py on the embedded default, native int4, T = 1.0,
#: AIME 2024, batch 1 and 3: the fastest L; docs/results.md). Other drafts keep 5.
MEASURED_NUM_DRAFT_TOKENS = {"ngram": 1, "eagle": 1}
#: The ``--num-draft-tokens`` default of ``--draft suffix``: a cap on the length it sizes from its match. 4 by
#: measurement (docs/suffix.md: code sessions on the 1.5B coder, T = 0: L = 4 1.74x, L = 8 1.57x target-only).
SUFFIX_NUM_DRAFT_TOKENS = 4


def default_num_draft_tokens(draft: str, verify: str, adaptive: bool) -> int:
    """The ``--num-draft-tokens`` default: 4 for ``suffix`` (a cap), 5 with adaptive verification (it prunes each round to what pays) and for
    drafts without a measurement, 2 for ``gbv`` (K paths of 2), else the measured L of the draft family."""
    family = "suffix" if draft.endswith("+suffix") else draft.split(":", 1)[0]
    if family == "suffix":  # a cap: the draft sizes each round from its match (--suffix-factor x match length); the
        return SUFFIX_NUM_DRAFT_TOKENS  # hybrid's suffix rounds too (--hybrid-model-tokens sizes the head's)
    if adaptive:
        return 5
    if family not in MEASURED_NUM_DRAFT_TOKENS:
        return 5
    measured = get_rule(verify, "verify").measured_num_draft_tokens  # gbv: K paths of 2
    return measured if measured is not None else MEASURED_NUM_DRAFT_TOKENS[family]


_SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                   "repetition_penalty": "--repetition-penalty", "frequency_penalty": "--frequency-penalty",
                   "presence_penalty": "--presence-penalty", "logit_bias": "--logit-bias"}


def parse_logit_bias(text: str | None) -> list[tuple[int, float]]:
    """``--logit-bias`` ``ID:BIAS,ID:BIAS`` -> ``[(id, bias), ...]`` (empty for ``None`` / ``""``). Only the syntax
    is checked here; the values (ids >= 0, finite biases, no repeated id) are checked by
    :class:`~specadapt.sampling.SamplingParams`, whose error :func:`sampling_params` reports under the flag.

    Raises:
        UsageError: an entry that is not ``int:float``.
    """
    out: list[tuple[int, float]] = []
    for entry in text.split(",") if text else []:
        key, sep, value = entry.strip().partition(":")
        try:
            out.append((int(key), float(value)))
        except ValueError:
            sep = ""
        if not sep:
            raise UsageError(f"--logit-bias: entries must be ID:BIAS (e.g. 13:-5,2:1.5), got {entry.strip()!r}")
    return out


def sampling_params(args):
    """The run's :class:`~specadapt.sampling.SamplingParams` from the sampling flags.

    Raises:
        UsageError: a value out of range, naming its flag.
    """
    from ..sampling import SamplingParams

    try:
        return SamplingParams(args.temperature, args.top_p, args.top_k, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty,
                              logit_bias=getattr(args, "logit_bias_map", None) or ())
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0].rstrip(":")
        raise UsageError(f"{_SAMPLING_FLAGS.get(field, '--' + field.replace('_', '-'))}: {message}") from None


def suffix_config(args):
    """The :class:`~specadapt.engine.suffix.SuffixConfig` of the ``--suffix-*`` flags.

    Raises:
        UsageError: a value out of range, naming its flag.
    """
    from ..engine.suffix import SuffixConfig

    values = {k: getattr(args, f"suffix_{k}", None) for k in ("max_depth", "factor", "min_prob", "global_tokens")}
    try:
        return SuffixConfig(**{k: v for k, v in values.items() if v is not None})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise UsageError(f"--suffix-{field.replace('_', '-')}: {exc}") from None


def hybrid_config(args):
    """The :class:`~specadapt.engine.hybrid.HybridConfig` of the ``--hybrid-*`` flags.

    Raises:
        UsageError: a value out of range, naming its flag.
    """
    from ..engine.hybrid import HybridConfig

    values = {k: getattr(args, f"hybrid_{k}", None) for k in ("min_match", "min_tokens", "model_tokens")}
    try:
        return HybridConfig(**{k: v for k, v in values.items() if v is not None})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise UsageError(f"--hybrid-{field.replace('_', '-')}: {exc}") from None


def load_target_and_draft(model: str, draft: str, sampling, seed: int, dtype: str, device: str,
                          error: type[Exception] = UsageError, forward: str = "auto", kv_dtype: str = "auto",
                          suffix=None, trainable_draft: bool = False, hybrid=None):
    """Load the target, attach its forward and build the draft as ``specadapt generate`` does.

    Args:
        model, draft: ``--model`` / ``--draft`` values; sampling: the run's ``SamplingParams``; dtype: a
            ``--dtype`` weight format; device: ``cpu`` / ``cuda``; forward: ``--forward``; kv_dtype: ``--kv-dtype``.
        error: exception class raised for a bad model, draft or format (its message names the flag).
        suffix: the ``SuffixConfig`` of ``--draft suffix`` (:func:`suffix_config`; ``None``: defaults).
        hybrid: the ``HybridConfig`` of ``--draft eagle+suffix`` (:func:`hybrid_config`; ``None``: defaults).
        trainable_draft: ``--tts`` will train the draft: a ``self:N`` draft needs the target's float32 weights (the
            target is then not loaded as a skeleton over its GGUF blocks) and a standalone draft loads its own.

    Returns:
        ``(LoadedModel, Draft)``; ``target.forward_name`` / ``target.weight_format`` say what runs.
    """
    import torch

    from ..engine import ModelLoadError, VocabularyMismatchError, build_draft, load_model
    from ..engine.models import attach_forward, file_blocks_for, parse_dtype

    hf_dtype = parse_dtype(dtype) if dtype in ("float32", "bfloat16") and forward == "hf" else parse_dtype("float32")
    try:
        self_draft = trainable_draft and draft.startswith("self:")
        target = load_model(model, dtype=hf_dtype, device=device,
                            file_blocks=device == "cpu" and not self_draft and file_blocks_for(model, forward, dtype))
    except ModelLoadError as exc:
        raise error(f"--model: {exc}") from None
    try:
        weights = attach_forward(target, forward, dtype, kv_dtype)
    except ValueError as exc:
        message = str(exc)
        raise error(message if message.startswith("--") else f"--forward: {message}") from None
    if target.native is None and weights == "float32" and dtype == "bfloat16":
        target.model.to(torch.bfloat16)
    logger.info("target %s: %s forward, %s weights", model, target.forward_name, target.weight_format)
    torch_dtype = next(target.model.parameters()).dtype
    try:
        built = build_draft(draft, target, sampling, seed, dtype=torch_dtype, device=device, suffix=suffix,
                            trainable=trainable_draft, hybrid=hybrid)
    except (ModelLoadError, VocabularyMismatchError, ValueError, FileNotFoundError) as exc:
        message = str(exc)
        raise error(message if message.startswith("--draft") else f"--draft: {message}") from None
    return target, built


def _tokenize(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    logger.warning("the tokenizer has no chat template: prompts are used as plain text")
    return list(tokenizer(text)["input_ids"])


def _silence_gguf_progress() -> None:
    """transformers' GGUF loader uses plain tqdm (not its logging switch): disable that bar too."""
    import functools

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return
    if hasattr(gguf_utils, "tqdm"):
        gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)


def num_paths_of(args) -> int:
    """K, the sampled draft paths per request: ``--num-paths``, or the rule's default (the registry's
    ``default_num_paths``: 3 for ``--verify gbv``, else 1)."""
    if args.num_paths is not None:
        return args.num_paths
    return get_rule(args.verify).default_num_paths


def _config_of(cls, args):
    try:
        return from_namespace(cls, args, "engine")
    except ValueError as exc:  # the message names the field: report the flag
        raise UsageError(flag_message(exc, cls, "engine")) from None


def tts_config(args) -> TTSConfig:
    """The run's :class:`~specadapt.tts.TTSConfig` from the ``--tts-*`` flags.

    Raises:
        UsageError: a value out of range, naming its flag.
    """
    return _config_of(TTSConfig, args)


def av_config(args) -> AVConfig:
    """The run's :class:`~specadapt.budget.config.AVConfig` from the ``--av-*`` flags.

    Raises:
        UsageError: a value out of range, naming its flag.
    """
    return _config_of(AVConfig, args)


def _adaptive(args, target, draft, batch_size: int, draft_log=None):
    """Estimator + cost table (loaded from --av-cost-table when the file exists, else profiled); pruning with
    ``--adaptive-verification``, else the estimator only runs (for ``--log-drafts``, written to ``draft_log``)."""
    from pathlib import Path

    from ..budget import CostTable
    from ..engine.adaptive import AdaptiveVerification, profile_engine_costs

    config = av_config(args)
    path = Path(config.cost_table) if config.cost_table else None
    if path is not None and path.exists():
        try:
            costs = CostTable.load(path)
        except ValueError as exc:
            raise UsageError(f"--av-cost-table: {exc}") from None
    else:
        costs = profile_engine_costs(target, draft, (args.num_draft_tokens + 1) * batch_size, batch_size,
                                     args.num_draft_tokens)
        if path is not None:
            costs.save(path)
    return AdaptiveVerification.from_config(args.num_draft_tokens, costs, config, prune=args.adaptive_verification,
                                            draft_log=draft_log,
                                            speculation="on" if args.speculation == "on" else "auto")


def _warm_up(target, draft) -> None:
    """One tiny forward per model so one-time start-up costs do not land in the first timed run."""
    from ..engine import NoDraft, SpeculativeEngine
    from ..sampling import SamplingParams

    greedy = SamplingParams(0.0)
    probe = [[1, 2, 3, 4]]
    SpeculativeEngine(target, NoDraft(), greedy, 0).generate(probe, 2)
    if getattr(draft, "model", None) is not None:
        SpeculativeEngine(target, draft, greedy, 2).generate(probe, 3)


@dataclass
class BuiltEngine:
    """What :func:`build_engine` made: the loaded target and draft, the run's sampling settings, the speculative
    engine and its optional parts (adaptive verification, TTS, the open ``--log-drafts`` file)."""

    target: object
    draft: object
    sampling: object
    engine: object
    adaptive: object = None
    tts: object = None
    draft_log: object = None

    def close(self) -> None:
        """Stop the TTS trainer thread and close the draft log."""
        if self.tts is not None:
            self.tts.close()
        if self.draft_log is not None:
            self.draft_log.close()


def build_engine(args, max_batch_size: int, ignore_eos: bool = False, error: type[Exception] = UsageError) -> BuiltEngine:
    """Load target and draft from validated engine flags (:func:`validate_engine_args`), warm them up and build
    the :class:`~specadapt.engine.SpeculativeEngine` (with adaptive verification and TTS when asked).

    Args:
        args: the parsed flags; max_batch_size: the most requests decoded together (sizes the cost table and
            the per-request TTS adapters); ignore_eos: the engine's default for requests.
        error: exception class for bad flags (the message names the flag).

    Raises:
        ``error``: a model, draft or setting that cannot be loaded or combined.
    """
    import torch

    from ..engine import SpeculativeEngine

    sampling = sampling_params(args)
    target, draft = load_target_and_draft(args.model, args.draft, sampling, args.seed, args.dtype, args.device,
                                          error=error, forward=args.forward, kv_dtype=args.kv_dtype,
                                          suffix=suffix_config(args) if "suffix" in args.draft else None,
                                          trainable_draft=bool(args.tts),
                                          hybrid=hybrid_config(args) if args.draft.endswith("+suffix") else None)
    if sampling.logit_bias and sampling.logit_bias[-1][0] >= target.vocab_size:
        raise error(f"--logit-bias: token id {sampling.logit_bias[-1][0]} is outside the model's vocabulary "
                    f"({target.vocab_size} tokens)")
    torch.manual_seed(args.seed)
    _warm_up(target, draft)
    draft_log = None
    if args.log_drafts:
        try:
            draft_log = open(args.log_drafts, "w", encoding="utf-8")
        except OSError as exc:
            raise error(f"--log-drafts: cannot write {args.log_drafts!r}: {exc.strerror}") from None
    adaptive = None
    if args.adaptive_verification or args.log_drafts:
        adaptive = _adaptive(args, target, draft, max_batch_size, draft_log)
    tts = None
    if args.tts:
        from ..engine.tts_bridge import EngineTTS

        tts = EngineTTS(draft, tts_config(args), sampling, asynchronous=False if args.tts_sync else None,
                        max_requests=max_batch_size)
    try:
        engine = SpeculativeEngine(
            target, draft, sampling, args.num_draft_tokens, args.verify, seed=args.seed,
            verify_impl=args.verify_impl, num_paths=num_paths_of(args), adaptive=adaptive, tts=tts,
            ignore_eos=ignore_eos, packed_forward=args.packed_forward,
            speculation=args.speculation,
        )
    except ValueError as exc:
        if tts is not None:
            tts.close()
        raise error(f"--verify: {exc}") from None
    return BuiltEngine(target, draft, sampling, engine, adaptive, tts, draft_log)
