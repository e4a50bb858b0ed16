"""Settings are defined once (issue 17): every AVConfig / TTSConfig setting with a flag appears in both front ends
(the engine CLI of ``generate`` / ``serve`` and the SGLang plugin's flags) with the record's default; a bad value
names the field in the technique and the flag in a front end."""

import argparse
from dataclasses import fields

import pytest

from specadapt import settings
from specadapt.budget.adaptive import AdaptiveVerification
from specadapt.budget.config import AVConfig
from specadapt.budget.costs import CostTable
from specadapt.cli import build_parser, main
from specadapt.cli.engine_args import av_config, tts_config
from specadapt.estimator import AcceptanceEstimator, EstimatorConfig
from specadapt.sglang.config import PluginConfig, PluginConfigError
from specadapt.sglang.flags import FLAG_DESTS, add_arguments, config_from_namespace
from specadapt.tts.config import TTSConfig

CONFIGS = (AVConfig, TTSConfig)
#: settings the SGLang plugin has no flag for (it has no per-request adapters / supervision choices, and its
#: draft graph always runs: no early stop, no speculation-off probes)
ENGINE_ONLY = {"scope", "supervise", "rounds", "early_stop", "probe_interval", "probe_interval_max", "probe_share",
               "probe_window", "probe_rows", "resume_probes", "catch_up",
               "probe_pairs"}


def _engine_parser(command):
    sub = build_parser()._subparsers._group_actions[0]
    return sub.choices[command]


def _sglang_parser():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _actions(parser):
    return {opt: a for a in parser._actions for opt in a.option_strings}


@pytest.mark.parametrize("cls", CONFIGS)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flagged_setting_is_an_engine_flag_with_the_records_default(cls, command):
    actions = _actions(_engine_parser(command))
    flags = settings.flags_of(cls)
    assert flags and {f.name for f in settings.flags_of(cls, "engine")} == {f.name for f in flags}
    record = cls()
    for f in flags:
        action = actions[f.flag]
        value = record
        for part in f.path:
            value = getattr(value, part)
        assert action.dest == f.dest
        assert (not action.default if f.negate else action.default) == value, f.flag
        assert tuple(action.choices or ()) == tuple(f.choices or ()), f.flag


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_flagged_setting_is_an_sglang_flag_with_the_records_default(cls):
    actions = _actions(_sglang_parser())
    plugin = PluginConfig()
    exposed = settings.flags_of(cls, "sglang")
    assert {f.name for f in settings.flags_of(cls)} - {f.name for f in exposed} <= ENGINE_ONLY
    for f in exposed:
        assert actions[f.flag].dest == f.dest and actions[f.flag].default is None  # explicit flags win over JSON
        assert FLAG_DESTS[f.dest] == f.dest
        assert getattr(plugin, f.dest) == f.default, f.flag
    assert config_from_namespace(_sglang_parser().parse_args([])) == plugin
    assert plugin.tts_config() == TTSConfig() and plugin.av_config() == AVConfig()


def test_settings_without_a_flag_are_listed_nowhere():
    flagged = {f.name for cls in CONFIGS for f in settings.flags_of(cls)}
    unflagged = {f.name for cls in (TTSConfig, AVConfig, EstimatorConfig) for f in fields(cls)
                 if f.name != "estimator"} - flagged
    assert unflagged == {"grad_clip", "rollback_window", "probe_depth", "online_overhead", "overhead_weight",
                         "max_cost_samples", "ridge", "max_step"}


def test_engine_flags_build_the_records():
    args = _engine_parser("generate").parse_args(
        ["--av-refit-interval", "7", "--av-no-early-stop", "--av-init-slope", "0.25", "--tts-stride", "3",
         "--tts-lambda", "0.5", "--tts-scope", "request", "--tts-params", "lora"])
    av = av_config(args)
    assert (av.estimator.refit_interval, av.estimator.init_slope, av.early_stop) == (7, 0.25, False)
    assert av.estimator.damping == EstimatorConfig().damping and av.probe_interval == AVConfig().probe_interval
    tts = tts_config(args)
    assert (tts.stride, tts.proximal_weight, tts.scope, tts.params) == (3, 0.5, "request", "lora")
    assert tts_config(_engine_parser("serve").parse_args([])) == TTSConfig()
    assert av_config(_engine_parser("serve").parse_args([])) == AVConfig()


@pytest.mark.parametrize("cls,kwargs,field,flag", [
    (TTSConfig, {"stride": 0}, "stride", "--tts-stride"),
    (TTSConfig, {"proximal_weight": -1.0}, "proximal_weight", "--tts-lambda"),
    (TTSConfig, {"params": "most"}, "params", "--tts-params"),
    (TTSConfig, {"topk": -1}, "topk", "--tts-topk"),
    (TTSConfig, {"scope": "request"}, "scope", "--tts-scope"),
    (TTSConfig, {"grad_clip": 0.0}, "grad_clip", "grad_clip"),  # no flag: the field's name in every front end
    (AVConfig, {"probe_interval": 0}, "probe_interval", "--av-probe-interval"),
    (AVConfig, {"probe_interval": 8, "probe_interval_max": 4}, "probe_interval_max", "--av-probe-interval-max"),
    (AVConfig, {"probe_share": 1.0}, "probe_share", "--av-probe-share"),
    (AVConfig, {"probe_window": -1}, "probe_window", "--av-probe-window"),
    (AVConfig, {"probe_rows": -1}, "probe_rows", "--av-probe-rows"),
    (AVConfig, {"resume_probes": 0}, "resume_probes", "--av-resume-probes"),
    (EstimatorConfig, {"refit_interval": 0}, "refit_interval", "--av-refit-interval"),
    (EstimatorConfig, {"damping": -1.0}, "damping", "--av-damping"),
])
def test_a_bad_value_names_the_field_in_the_technique_and_the_flag_in_the_front_end(cls, kwargs, field, flag):
    with pytest.raises(settings.SettingError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert message.startswith(field + " ") and "--" not in message
    outer = AVConfig if cls is EstimatorConfig else cls
    reworded = settings.flag_message(info.value, outer, "engine")
    assert reworded.startswith(flag + " ")
    if cls is TTSConfig and field == "scope":
        assert "--tts-params lora" in reworded and "params lora" in message


def test_a_bad_value_names_the_flag_on_the_engine_command_line(capsys):
    for argv, flag in ((["--tts", "--draft", "self:2", "--tts-lambda", "-1"], "--tts-lambda"),
                       (["--av-damping", "-1"], "--av-damping"),
                       (["--av-probe-interval", "8", "--av-probe-interval-max", "4"], "--av-probe-interval-max")):
        code = main(["generate", "--no-progress", *argv])
        err = capsys.readouterr().err
        assert code == 2 and f"error: {flag} " in err, err


@pytest.mark.parametrize("kwargs,flag", [({"tts_stride": 0}, "--tts-stride"), ({"tts_lambda": -1.0}, "--tts-lambda"),
                                         ({"av_refit_interval": 0}, "--av-refit-interval"),
                                         ({"av_damping": -2.0}, "--av-damping")])
def test_a_bad_value_names_the_flag_in_the_sglang_plugin(kwargs, flag):
    with pytest.raises(PluginConfigError, match=f"^{flag} "):
        PluginConfig(**kwargs)


def test_adaptive_verification_takes_its_settings_at_construction():
    costs = CostTable(target_ms=[1.0] * 8, draft_ms=[0.0])
    log = []
    config = AVConfig(estimator=EstimatorConfig(refit_interval=3, init_slope=0.7), early_stop=False, probe_interval=2)
    av = AdaptiveVerification.from_config(4, costs, config, prune=False, draft_log=log)
    assert av.config is config and not av.early_stop and not av.prune and av.draft_log is log
    assert (av.estimator.num_positions, av.estimator.refit_interval, av.estimator.slope) == (4, 3, 0.7)
    with pytest.raises(AttributeError):
        av.early_stop = True  # a setting, not state: set it through the config
    assert AcceptanceEstimator(2).refit_interval == EstimatorConfig().refit_interval  # one default
