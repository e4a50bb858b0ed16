"""The plugin's command-line flags, added to SGLang's parser (``python -m sglang.launch_server --help``).

Pure argparse: :func:`add_arguments` adds an argument group, :func:`config_from_namespace` turns the parsed
namespace into a :class:`~specadapt.sglang.config.PluginConfig`. Defaults come from ``PluginConfig`` so the
CLI, the JSON file and the environment variable agree. ``--specadapt-config PATH`` loads a JSON object of the
same settings (the flags given explicitly win).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from ..verification.rules import RULES, join_names
from .config import VERIFY_CHOICES, PluginConfig, PluginConfigError

__all__ = ["FLAG_DESTS", "add_arguments", "config_from_namespace"]

_D = PluginConfig()

#: argparse dest -> PluginConfig field, for every flag the plugin adds (``specadapt_config`` is the file).
FLAG_DESTS = {
    "specadapt_verify": "verify",
    "specadapt_num_paths": "num_paths",
    "specadapt_seed": "seed",
    "adaptive_verification": "adaptive_verification",
    "av_refit_interval": "av_refit_interval",
    "av_damping": "av_damping",
    "av_init_slope": "av_init_slope",
    "av_init_intercept": "av_init_intercept",
    "av_cost_table": "av_cost_table",
    "tts": "tts",
    "tts_stride": "tts_stride",
    "tts_lr": "tts_lr",
    "tts_lambda": "tts_lambda",
    "tts_position_decay": "tts_position_decay",
    "tts_params": "tts_params",
    "tts_lora_rank": "tts_lora_rank",
    "tts_rollback_margin": "tts_rollback_margin",
    "tts_context_window": "tts_context_window",
    "tts_topk": "tts_topk",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``specadapt`` argument group. Every default is ``None`` so that explicit flags can be told
    apart from defaults when merged over ``--specadapt-config``; the help text shows the effective default."""
    g = parser.add_argument_group(
        "specadapt plugin",
        "Long-generation speculative decoding (Test-Time Speculation, adaptive verification, block / GBV "
        "verification). Also settable through $SPECADAPT_SGLANG_CONFIG (a JSON object or file) for "
        "sglang.Engine users. Docs: docs/sglang.md.",
    )
    g.add_argument("--specadapt-config", default=None, metavar="PATH",
                   help="JSON file of specadapt settings (field names as in the flags, with underscores)")
    g.add_argument("--specadapt-verify", choices=VERIFY_CHOICES, default=None,
                   help=f"verification rule: builtin (SGLang's own), {join_names(RULES)} (specadapt kernels; "
                        f"default {_D.verify})")
    g.add_argument("--specadapt-num-paths", type=int, default=None, metavar="K",
                   help="K sampled draft paths per request for --specadapt-verify gbv (= --speculative-eagle-topk)")
    g.add_argument("--specadapt-seed", type=int, default=None, help=f"seed of plugin-drawn coins (default {_D.seed})")
    g.add_argument("--adaptive-verification", action="store_true", default=None,
                   help="online-fitted acceptance estimator caps the drafts each request verifies")
    g.add_argument("--av-refit-interval", type=int, default=None,
                   help=f"verify rounds between IRLS refits (default {_D.av_refit_interval})")
    g.add_argument("--av-damping", type=float, default=None, help=f"evidence damping D (default {_D.av_damping})")
    g.add_argument("--av-init-slope", type=float, default=None, help=f"starting slope (default {_D.av_init_slope})")
    g.add_argument("--av-init-intercept", type=float, default=None,
                   help=f"starting intercept (default {_D.av_init_intercept})")
    g.add_argument("--av-cost-table", default=None, metavar="PATH",
                   help="target/draft cost table JSON (specadapt generate --av-cost-table writes one)")
    g.add_argument("--tts", action="store_true", default=None,
                   help="Test-Time Speculation: distil the draft model online from the target's verification pass")
    g.add_argument("--tts-stride", type=int, default=None, help=f"rounds between draft updates S (default {_D.tts_stride})")
    g.add_argument("--tts-lr", type=float, default=None, help=f"Adam learning rate (default {_D.tts_lr})")
    g.add_argument("--tts-lambda", type=float, default=None, help=f"proximal-term weight (default {_D.tts_lambda})")
    g.add_argument("--tts-position-decay", type=float, default=None,
                   help=f"position weights gamma^(k-1) (default {_D.tts_position_decay})")
    g.add_argument("--tts-params", choices=("full", "lora"), default=None,
                   help=f"train the draft's own layers or LoRA adapters (default {_D.tts_params})")
    g.add_argument("--tts-lora-rank", type=int, default=None, help=f"LoRA rank (default {_D.tts_lora_rank})")
    g.add_argument("--tts-rollback-margin", type=float, default=None,
                   help=f"roll back when acceptance falls below (1 - margin) x baseline (default {_D.tts_rollback_margin})")
    g.add_argument("--tts-context-window", type=int, default=None,
                   help=f"committed tokens of context the training forward sees (default {_D.tts_context_window})")
    g.add_argument("--tts-topk", type=int, default=None,
                   help=f"keep the target's top-k per supervised position in snapshots; 0 = full vocabulary "
                        f"(default {_D.tts_topk})")


def config_from_namespace(args: argparse.Namespace) -> PluginConfig:
    """Merge ``--specadapt-config`` (if any) with the explicit flags (which win) into a :class:`PluginConfig`.

    Raises:
        PluginConfigError: bad file, unknown key or an invalid value (the message names the flag).
    """
    values = {}
    path = getattr(args, "specadapt_config", None)
    if path:
        values.update(PluginConfig.from_json(path, source="--specadapt-config").to_dict())
    for dest, name in FLAG_DESTS.items():
        value = getattr(args, dest, None)
        if value is not None:
            values[name] = value
    if values.get("verify") in RULES and "num_paths" not in values:
        values["num_paths"] = RULES[values["verify"]].default_num_paths
    known = {f.name for f in fields(PluginConfig)}
    assert set(values) <= known, set(values) - known
    try:
        return PluginConfig(**values)
    except TypeError as exc:  # pragma: no cover - a field type argparse cannot produce
        raise PluginConfigError(str(exc)) from None
