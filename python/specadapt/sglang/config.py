"""The plugin's settings: one frozen record built from CLI flags, a JSON file or an environment variable.

Pure Python (no sglang import) so that the flag surface and the validation rules are testable anywhere. The
validation reads only a handful of SGLang ``ServerArgs`` fields by name (``speculative_algorithm``,
``speculative_draft_model_path``, ``speculative_eagle_topk``, ``speculative_num_steps``, ``device``) and
raises :class:`PluginConfigError` naming the flag when a combination cannot work.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, make_dataclass
from pathlib import Path
from typing import Any

from ..budget.config import AVConfig
from ..settings import dataclass_fields_for, flag_message, from_namespace
from ..tts.config import TTSConfig
from ..verification.rules import DEFAULT_RULE, RULES

__all__ = [
    "ENV_CONFIG",
    "PluginConfig",
    "PluginConfigError",
    "TECHNIQUE_CONFIGS",
    "VERIFY_CHOICES",
    "config_from_env",
    "validate_for_server",
]

#: Environment variable read by every process: a path to a JSON file, or the JSON object itself. It is how
#: ``sglang.Engine(**kwargs)`` users (who cannot pass unknown kwargs) enable the plugin; spawned scheduler
#: processes inherit it.
ENV_CONFIG = "SPECADAPT_SGLANG_CONFIG"

#: ``builtin`` leaves SGLang's own acceptance untouched; the others replace it with the specadapt kernels.
VERIFY_CHOICES = ("builtin", *RULES)

#: Algorithms whose sampler / acceptance the plugin knows how to replace, per rule.
#: A multi-path rule needs K sampled paths (an EAGLE-family draft tree); a DFLASH block is one path.
_RULE_ALGORITHMS = {name: ("EAGLE", "EAGLE3", "STANDALONE") + (() if rule.multi_path else ("DFLASH",))
                    for name, rule in RULES.items()}
#: Algorithms whose draft TTS can train: the plugin has differentiable forwards for SGLang's EAGLE-3 style Llama
#: draft, dense Llama / Mistral / Qwen2 / Qwen3 STANDALONE drafts and the plain DFLASH draft
#: (:mod:`specadapt.sglang.students`).
_TTS_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "DFLASH")
#: Adaptive verification needs the draft's q rows (EAGLE-family drafts under rejection sampling); a DFLASH
#: block is deterministic, so its q is a point mass and carries no confidence signal.
_AV_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")


class PluginConfigError(ValueError):
    """A specadapt flag (or flag combination) that cannot work; the message names the flag."""


#: The technique settings the plugin exposes: each field whose flag the ``sglang`` front end lists becomes a
#: ``PluginConfig`` field named as the flag's dest (``--tts-lambda`` -> ``tts_lambda``), with the same default.
TECHNIQUE_CONFIGS = (AVConfig, TTSConfig)

_TechniqueSettings = make_dataclass(
    "_TechniqueSettings", [f for cls in TECHNIQUE_CONFIGS for f in dataclass_fields_for(cls, "sglang")], frozen=True)


@dataclass(frozen=True)
class PluginConfig(_TechniqueSettings):
    """specadapt settings inside an SGLang server (flags in :mod:`specadapt.sglang.flags`).

    Attributes:
        verify: ``builtin`` | ``chain`` | ``block`` | ``gbv`` (``--specadapt-verify``).
        num_paths: K draft paths per request for ``gbv`` (``--specadapt-num-paths``; 1 otherwise).
        adaptive_verification: fit the acceptance estimator online and cap each request's verified drafts.
        tts: Test-Time Speculation on the draft model.
        seed: seed of the coins the plugin draws when SGLang hands it none (DFLASH acceptance).
        av_*, tts_*: the settings of :class:`~specadapt.budget.config.AVConfig` and
            :class:`~specadapt.tts.config.TTSConfig` the plugin exposes, named as their flags (``av_refit_interval``,
            ``tts_stride``, ``tts_lambda``, ...; :data:`TECHNIQUE_CONFIGS`), with their defaults;
            :meth:`av_config` / :meth:`tts_config` build those records. ``av_cost_table``: a JSON cost table
            (``specadapt.budget.CostTable``) or ``None``: SGLang 0.5.23 verifies EAGLE drafts at a fixed padded
            width, so by default the verify cost is flat in the verified tokens and the budget keeps every draft
            (the estimator still fits and reports); a measured table of a ragged-verify deployment makes the caps
            prune.
    """

    verify: str = "builtin"
    num_paths: int = 1
    adaptive_verification: bool = False
    tts: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.verify in VERIFY_CHOICES, "--specadapt-verify", f"must be one of {VERIFY_CHOICES}, got {self.verify!r}"),
            (self.num_paths >= 1, "--specadapt-num-paths", f"must be >= 1, got {self.num_paths}"),
            (self.num_paths == 1 or self.multi_path, "--specadapt-num-paths",
             f"is the number of GBV paths; it needs --specadapt-verify gbv (got {self.verify!r} with {self.num_paths} paths)"),
        ]
        for ok, flag, message in checks:
            if not ok:
                raise PluginConfigError(f"{flag} {message}")
        for cls in TECHNIQUE_CONFIGS:  # the av_* / tts_* ranges are the technique's (messages name the field)
            try:
                from_namespace(cls, self, "sglang")
            except ValueError as exc:
                raise PluginConfigError(flag_message(exc, cls, "sglang")) from None
        if self.av_cost_table is not None and not Path(self.av_cost_table).is_file():
            raise PluginConfigError(f"--av-cost-table {self.av_cost_table!r}: no such file")

    @property
    def enabled(self) -> bool:
        """True when any specadapt feature is switched on."""
        return self.verify != "builtin" or self.adaptive_verification or self.tts

    @property
    def replaces_verification(self) -> bool:
        """True when the plugin's kernels decide acceptance (a specadapt rule, or adaptive caps)."""
        return self.verify != "builtin" or self.adaptive_verification

    @property
    def multi_path(self) -> bool:
        """True when ``verify`` names a multi-path rule of the registry (``gbv``: K sampled paths as SGLang's tree)."""
        return self.verify in RULES and RULES[self.verify].multi_path

    @property
    def rule(self) -> str:
        """The single-path rule used by the replaced sampler (``builtin`` + adaptive verification = chain)."""
        return DEFAULT_RULE if self.verify == "builtin" else self.verify

    def tts_config(self) -> TTSConfig:
        """The :class:`specadapt.tts.config.TTSConfig` of the ``tts_*`` settings (the plugin exposes no flag for
        the others: their defaults)."""
        return from_namespace(TTSConfig, self, "sglang")

    def av_config(self) -> AVConfig:
        """The :class:`specadapt.budget.config.AVConfig` of the ``av_*`` settings (the others: their defaults)."""
        return from_namespace(AVConfig, self, "sglang")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable), the form carried on ``ServerArgs._specadapt``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "PluginConfig":
        """Build from a dict of field values; unknown keys raise :class:`PluginConfigError` naming them."""
        if not isinstance(data, dict):
            raise PluginConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PluginConfigError(f"{source}: unknown specadapt setting(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path: str, source: str = ENV_CONFIG) -> "PluginConfig":
        """Parse a JSON object given inline (starts with ``{``) or as a file path."""
        text = text_or_path.strip()
        if not text.startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise PluginConfigError(f"{source}: {text!r} is neither a JSON object nor a file")
            source, text = f"{source} ({path})", path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PluginConfigError(f"{source}: invalid JSON ({exc})") from None
        return cls.from_dict(data, source)


def config_from_env(environ: dict[str, str] | None = None) -> PluginConfig | None:
    """The config in ``$SPECADAPT_SGLANG_CONFIG`` (JSON object or file path), or ``None`` when unset."""
    value = (os.environ if environ is None else environ).get(ENV_CONFIG)
    if not value:
        return None
    return PluginConfig.from_json(value)


def _field(server_args: Any, name: str, default: Any = None) -> Any:
    return getattr(server_args, name, default)


def validate_for_server(config: PluginConfig, server_args: Any) -> None:
    """Reject combinations that cannot work with the server's speculative settings.

    Args:
        config: the plugin settings.
        server_args: an SGLang ``ServerArgs`` (or any object with its field names).

    Raises:
        PluginConfigError: the message names the specadapt flag and the SGLang flag it conflicts with.
    """
    if not config.enabled:
        return
    algo = _field(server_args, "speculative_algorithm")
    algo = None if algo is None else str(algo).upper()
    if algo == "NEXTN":
        algo = "EAGLE"
    features = [name for name, on in (("--tts", config.tts), ("--adaptive-verification", config.adaptive_verification),
                                        (f"--specadapt-verify {config.verify}", config.verify != "builtin")) if on]
    if algo is None:
        raise PluginConfigError(
            f"{', '.join(features)} need speculative decoding: pass --speculative-algorithm EAGLE3, STANDALONE or DFLASH"
        )
    if config.replaces_verification and algo not in _RULE_ALGORITHMS[config.rule]:
        flag = "--adaptive-verification" if config.verify == "builtin" else f"--specadapt-verify {config.verify}"
        raise PluginConfigError(
            f"{flag} cannot replace the acceptance of --speculative-algorithm {algo}; "
            f"it supports {', '.join(_RULE_ALGORITHMS[config.rule])}"
        )
    if config.adaptive_verification and algo not in _AV_ALGORITHMS:
        raise PluginConfigError(
            f"--adaptive-verification reads the draft's q rows, which --speculative-algorithm {algo} does not "
            f"produce (use one of {', '.join(_AV_ALGORITHMS)})"
        )
    eagle_family = algo in ("EAGLE", "EAGLE3", "STANDALONE")
    if config.replaces_verification and eagle_family:
        # SGLang checks these under rejection sampling; for STANDALONE and GBV the plugin hides the flag from it
        for field, flag in (("speculative_accept_threshold_single", "--speculative-accept-threshold-single"),
                            ("speculative_accept_threshold_acc", "--speculative-accept-threshold-acc")):
            value = _field(server_args, field)
            if value is not None and float(value) != 1.0:
                raise PluginConfigError(f"{flag} {value}: the specadapt rules are exact rejection rules and take no "
                                        "acceptance thresholds (leave it at 1.0)")
    if config.multi_path:  # K sampled paths as SGLang's draft tree
        for field, flag, why in (
            ("enable_multi_layer_eagle", "--enable-multi-layer-eagle", "its draft worker has no K-path hooks"),
            ("speculative_adaptive", "--speculative-adaptive", "GBV's draft depth and q-row buffer are fixed"),
        ):
            if _field(server_args, field):
                raise PluginConfigError(f"--specadapt-verify {config.verify} cannot run with {flag}: {why}")
        mode = _field(server_args, "disaggregation_mode")
        if mode not in (None, "null"):
            raise PluginConfigError(
                f"--specadapt-verify {config.verify} cannot run with --disaggregation-mode {mode}: a prefill-decode handover "
                "carries one draft token and a point-mass q, not K sampled paths")
        pp = _field(server_args, "pp_size")
        if pp is not None and int(pp) > 1:
            raise PluginConfigError(f"--specadapt-verify {config.verify} supports pipeline parallelism 1 (got --pp-size {pp})")
        if config.num_paths < 2:
            raise PluginConfigError(f"--specadapt-verify {config.verify} needs --specadapt-num-paths >= 2 (K = 1 is block verification)")
        topk = _field(server_args, "speculative_eagle_topk")
        if topk is not None and int(topk) != config.num_paths:
            raise PluginConfigError(
                f"--specadapt-verify {config.verify} drafts --specadapt-num-paths={config.num_paths} sampled paths as the "
                f"branches of SGLang's draft tree: set --speculative-eagle-topk {config.num_paths} (got {topk})"
            )
        steps = _field(server_args, "speculative_num_steps")
        tokens = _field(server_args, "speculative_num_draft_tokens")
        if steps is not None and tokens is not None and int(tokens) != config.num_paths * int(steps) + 1:
            raise PluginConfigError(
                f"--specadapt-verify {config.verify} verifies K={config.num_paths} chains of depth --speculative-num-steps="
                f"{steps}: set --speculative-num-draft-tokens {config.num_paths * int(steps) + 1} (got {tokens})"
            )
    if config.tts and _field(server_args, "enable_dp_attention"):
        raise PluginConfigError(
            "--tts cannot run with --enable-dp-attention yet: the draft's weights are sharded over the attention-TP "
            "group while data-parallel replicas run different batches and publish rounds")
    if config.tts:
        if algo not in _TTS_ALGORITHMS:
            raise PluginConfigError(
                f"--tts trains a draft model; --speculative-algorithm {algo} has none "
                f"(use one of {', '.join(_TTS_ALGORITHMS)})"
            )
        if not _field(server_args, "speculative_draft_model_path"):
            raise PluginConfigError("--tts needs a draft model: pass --speculative-draft-model-path")
    device = _field(server_args, "device")
    # off CUDA SGLang drafts greedily, which its own chain sampler (and ours) verifies; the other rules need samples
    if config.replaces_verification and config.rule != "chain" and device not in (None, "cuda"):
        raise PluginConfigError(
            f"--specadapt-verify {config.verify} runs on sampled drafts, which SGLang produces on CUDA only "
            f"(--device {device} verifies greedily)"
        )
