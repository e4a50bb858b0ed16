"""The plugin's command-line flags, added to SGLang's parser (``python -m sglang.launch_server --help``).

Pure argparse: :func:`add_arguments` adds an argument group, :func:`config_from_namespace` turns the parsed
namespace into a :class:`~specadapt.sglang.config.PluginConfig`. Defaults come from ``PluginConfig`` (whose
technique settings are AVConfig's and TTSConfig's) so the CLI, the JSON file, the environment variable and the
embedded engine's flags agree. ``--specadapt-config PATH`` loads a JSON object of the
same settings (the flags given explicitly win).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .. import settings
from ..budget.config import AVConfig
from ..settings import flags_of
from ..tts.config import TTSConfig
from ..verification.rules import RULES, join_names
from .config import TECHNIQUE_CONFIGS, VERIFY_CHOICES, PluginConfig, PluginConfigError

__all__ = ["FLAG_DESTS", "add_arguments", "config_from_namespace"]

_D = PluginConfig()

#: argparse dest -> PluginConfig field, for every flag the plugin adds (``specadapt_config`` is the file): its own
#: flags, then the technique settings' (generated from AVConfig / TTSConfig; dest = field name).
FLAG_DESTS = {
    "specadapt_verify": "verify",
    "specadapt_num_paths": "num_paths",
    "specadapt_seed": "seed",
    "adaptive_verification": "adaptive_verification",
    "tts": "tts",
    **{f.dest: f.dest for cls in TECHNIQUE_CONFIGS for f in flags_of(cls, "sglang")},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``specadapt`` argument group. Every default is ``None`` so that explicit flags can be told
    apart from defaults when merged over ``--specadapt-config``; the help text shows the effective default.
    The ``--av-*`` / ``--tts-*`` flags are generated from :class:`~specadapt.budget.config.AVConfig` and
    :class:`~specadapt.tts.config.TTSConfig` (:func:`specadapt.settings.add_arguments`)."""
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
    settings.add_arguments(g, AVConfig, "sglang", explicit_only=True)
    g.add_argument("--tts", action="store_true", default=None,
                   help="Test-Time Speculation: distil the draft model online from the target's verification pass")
    settings.add_arguments(g, TTSConfig, "sglang", explicit_only=True)


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
