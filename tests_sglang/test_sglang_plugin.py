"""The plugin inside the real sglang==0.5.23 (CPU: SGLang cannot serve here, but its argument handling, plugin
loading, hook registry and the modules holding the hook targets all run)."""

from __future__ import annotations

import inspect
import json
import pickle
import pkgutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from specadapt.sglang.config import ENV_CONFIG, PluginConfigError
from specadapt.sglang.plugin import LIGHT_TARGETS, SERVER_ARGS_ATTR
from specadapt.sglang.targets import HOOK_TARGETS
from tests_sglang.helpers import _args, _probe


# ---- discovery, flags ----------------------------------------------------------------------------------------
def test_entry_point_discovered_and_load_plugins_applies_the_light_hooks():
    out = _probe("discovery")
    assert "specadapt=specadapt.sglang.plugin:register" in out["entry_points"]
    assert set(LIGHT_TARGETS) <= set(out["patched"])


def test_launch_server_help_lists_the_flags():
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--tts", "--tts-stride", "--tts-lr", "--specadapt-verify", "--specadapt-num-paths",
                 "--adaptive-verification", "--av-refit-interval", "--specadapt-config", "specadapt plugin"):
        assert flag in proc.stdout, flag


def test_prepare_server_args_carries_the_values_to_the_scheduler(plugins_loaded, tiny_models):
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(_args(tiny_models, "--tts", "--tts-stride", "7", "--tts-lr", "1e-4",
                                   "--specadapt-verify", "block", "--adaptive-verification"))
    carried = getattr(sa, SERVER_ARGS_ATTR)
    assert (carried["tts"], carried["tts_stride"], carried["tts_lr"], carried["verify"],
            carried["adaptive_verification"]) == (True, 7, 1e-4, "block", True)
    # the path to the spawned scheduler processes is pickle
    assert getattr(pickle.loads(pickle.dumps(sa)), SERVER_ARGS_ATTR) == carried
    from specadapt.sglang.plugin import config_of

    assert config_of(sa).tts_stride == 7


def test_standalone_tts_with_lora_resolves(plugins_loaded, tiny_models):
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(_args(tiny_models, "--tts", "--tts-params", "lora", "--tts-lora-rank", "4",
                                   "--specadapt-verify", "block", algorithm="STANDALONE"))
    sa.resolve_once()
    carried = getattr(sa, SERVER_ARGS_ATTR)
    assert (carried["tts"], carried["tts_params"], carried["tts_lora_rank"]) == (True, "lora", 4)
    assert resolved_view(sa).speculative_use_rejection_sampling is True


def test_no_flags_means_plugin_off(plugins_loaded, tiny_models):
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", tiny_models["target"], "--skip-tokenizer-init"])
    assert getattr(sa, SERVER_ARGS_ATTR)["verify"] == "builtin" and not getattr(sa, SERVER_ARGS_ATTR)["tts"]


@pytest.mark.parametrize("extra, algorithm, match", [
    (["--tts"], None, "need speculative decoding"),
    (["--tts"], "NGRAM", "has none"),
    (["--specadapt-verify", "gbv", "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5"], "EAGLE3",
     "--speculative-num-draft-tokens 13"),
    (["--specadapt-verify", "gbv", "--speculative-eagle-topk", "2"], "EAGLE3", "speculative-eagle-topk 3"),
    (["--specadapt-verify", "block"], "NGRAM", "cannot replace"),
    (["--tts-stride", "0"], "EAGLE3", "--tts-stride"),
])
def test_invalid_combinations_fail_at_start_up(plugins_loaded, tiny_models, extra, algorithm, match):
    from sglang.srt.server_args import prepare_server_args

    if algorithm is None:
        argv = ["--model-path", tiny_models["target"], "--skip-tokenizer-init", *extra]
    else:
        argv = ["--model-path", tiny_models["target"], "--speculative-algorithm", algorithm,
                "--skip-tokenizer-init", *extra]
        if algorithm != "NGRAM":
            argv += ["--speculative-draft-model-path", tiny_models["eagle3"]]
    with pytest.raises(PluginConfigError, match=match):
        prepare_server_args(argv)


# ---- resolution (what the launcher decides before spawning the scheduler) -------------------------------------
@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE"])
def test_resolution_turns_on_rejection_sampling_on_a_chain(plugins_loaded, tiny_models, algorithm):
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(_args(tiny_models, "--specadapt-verify", "block", algorithm=algorithm))
    sa.resolve_once()
    view = resolved_view(sa)
    assert view.speculative_use_rejection_sampling is True  # q exists for the replaced sampler
    assert view.speculative_eagle_topk == 1
    assert view.speculative_num_draft_tokens == view.speculative_num_steps + 1


def test_resolution_rejects_a_tree_for_a_chain_rule(plugins_loaded, tiny_models):
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(_args(tiny_models, "--specadapt-verify", "chain", "--speculative-num-steps", "3",
                                   "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"))
    with pytest.raises(PluginConfigError, match="--speculative-eagle-topk 1"):
        sa.resolve_once()


def test_engine_users_configure_through_the_environment(plugins_loaded, tiny_models, monkeypatch):
    """sglang.Engine(**kw) builds ServerArgs without the CLI: the config comes from $SPECADAPT_SGLANG_CONFIG."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(ENV_CONFIG, json.dumps({"verify": "block", "tts_stride": 9}))
    sa = ServerArgs(model_path=tiny_models["target"], speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=tiny_models["eagle3"], device="cuda", skip_tokenizer_init=True)
    sa.resolve_once()
    assert getattr(sa, SERVER_ARGS_ATTR)["verify"] == "block"
    assert getattr(sa, SERVER_ARGS_ATTR)["tts_stride"] == 9
    assert resolved_view(sa).speculative_use_rejection_sampling is True
    monkeypatch.setenv(ENV_CONFIG, json.dumps({"tts": True}))
    bad = ServerArgs(model_path=tiny_models["target"], device="cuda", skip_tokenizer_init=True)
    with pytest.raises(PluginConfigError, match="need speculative decoding"):
        bad.resolve_once()


# ---- hook targets ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", HOOK_TARGETS + LIGHT_TARGETS)
def test_every_hook_target_exists(target):
    obj_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(obj_path)
    assert callable(getattr(owner, attr)), target


def test_replacement_sampler_has_sglangs_signature():
    from sglang.kernels.ops.speculative import reject_sampling

    from specadapt.sglang.verify import chain_speculative_sampling

    original = inspect.signature(reject_sampling.chain_speculative_sampling_triton)
    ours = inspect.signature(chain_speculative_sampling)
    assert [(p.name, p.kind) for p in original.parameters.values()] == [
        (p.name, p.kind) for p in ours.parameters.values()]


def test_dflash_accept_block_signature_is_keyword_only():
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    params = inspect.signature(DFlashWorkerV2._accept_block).parameters
    assert [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY] == [
        "candidates", "next_token_logits", "sampling_info", "draft_input", "prefix_lens", "bs", "target_predict"]


@pytest.mark.parametrize("algorithm, verify, adaptive", [("EAGLE3", "block", "1"), ("STANDALONE", "chain", "0"),
                                                         ("DFLASH", "block", "0")])
def test_install_applies_every_heavy_hook(algorithm, verify, adaptive):
    out = _probe("install", algorithm, verify, adaptive)
    if algorithm == "DFLASH":
        assert "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._accept_block" in out["patched"]
        assert not out["sampler_replaced"]
    else:
        assert out["sampler_replaced"] and out["eagle_utils_rebound"]
        assert "sglang.srt.speculative.eagle_utils.eagle_sample" in out["patched"]  # min-p, caps
    assert "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue" in out["patched"]


# ---- the replaced functions in SGLang's exact layout ----------------------------------------------------------
def test_replacement_agrees_with_sglangs_own_triton_kernel():
    """SGLang's Triton chain / block kernel, interpreted on CPU, and the specadapt replacement give the same
    accept lengths, accept indices and tokens for the same coins (120 requests per rule)."""
    out = _probe("triton_compare", "30")
    for rule in ("chain", "block"):
        agree, total = out[rule]
        assert total == 120 and agree == total, (rule, agree, total)


def test_seeded_requests_verify_the_same_alone_and_in_any_batch():
    """Issue 19.8: with SGLang's per-request ``sampling_seed`` (deterministic inference) a request's verification
    in the replaced sampler depends on its own seed, committed length and rows only."""
    out = _probe("seeded_verify", "10")
    for rule in ("chain", "block"):
        same, total, changed = out[rule]
        assert total == 70 and same == total, (rule, same, total)  # 10 seeds x (1 + 2 + 4) requests
        assert changed > 0, rule


def test_dflash_seeded_acceptance_alone_and_in_a_batch():
    """The DFLASH hook with SGLang's per-request seeds (real ``_commit_accept``): a request's accepted drafts,
    bonus and committed tokens are the same alone and in batches of other compositions."""
    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.state import PluginState, VerifyRuntime
    from specadapt.sglang.verify import dflash_accept_block

    plugin_state.install(PluginState(runtime=VerifyRuntime(rule="block", impl="reference", seed=2)))
    worker = SimpleNamespace(_selector_sample=None, _tp_sync=None)
    try:
        candidates, logits, info = _dflash_inputs(seed=3)
        batch, block = candidates.shape
        info.sampling_seed = torch.arange(batch, dtype=torch.int64) * 7 + 1
        info.min_ps, info.need_min_p_sampling = torch.full((batch,), 0.05), True
        prefix = torch.arange(batch) + 20

        def run(rows):
            rows = torch.tensor(rows)
            flat = (rows[:, None] * block + torch.arange(block)).reshape(-1)
            sub = SimpleNamespace(**{k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(info).items()})
            accept_len, _, bonus, out_tokens, _ = dflash_accept_block(
                None, worker, candidates=candidates[rows], next_token_logits=logits[flat], sampling_info=sub,
                draft_input=None, prefix_lens=prefix[rows], bs=len(rows), target_predict=None)
            return [(int(accept_len[b]), int(bonus[b]), out_tokens[b, : int(accept_len[b]) + 1].tolist())
                    for b in range(len(rows))]

        full = run(list(range(batch)))
        for rows in ([4], [3, 1], [2, 0, 4, 1, 3]):
            assert run(rows) == [full[r] for r in rows]
    finally:
        plugin_state.reset()


def test_requests_with_unhonourable_options_are_refused_with_sglangs_abort():
    """Issue 19.9: SGLang's real Req and SamplingParams through the request hook: penalties, min_new_tokens and a
    custom logit processor finish the request with SGLang's 400 abort naming the option; min-p, logit bias and a
    plain request are queued untouched."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.config import PluginConfig
    from specadapt.sglang.hooks import add_request_around
    from specadapt.sglang.state import PluginState, VerifyRuntime

    plugin_state.install(PluginState(config=PluginConfig(verify="block"), runtime=VerifyRuntime(), algorithm="EAGLE3"))
    queued = []
    try:
        def req(custom=None, **params):
            return Req(f"r{len(queued)}", "", [1, 2, 3], SamplingParams(max_new_tokens=8, **params),
                       custom_logit_processor=custom)

        cases = [(req(frequency_penalty=0.5), "frequency_penalty"), (req(presence_penalty=0.5), "presence_penalty"),
                 (req(repetition_penalty=1.2), "repetition_penalty"), (req(min_new_tokens=3), "min_new_tokens"),
                 (req(custom="{}"), "custom_logit_processor"), (req(min_p=0.1), None),
                 (req(logit_bias={"2": 3.0}), None), (req(), None)]
        from sglang.srt.runtime_context import get_parallel

        for r, option in cases:
            with get_parallel().override(tp_rank=0):  # a scheduler process has its rank published
                add_request_around(lambda scheduler, q, *a, **k: queued.append(q), None, r)
            if option is None:
                assert r.to_finish is None
            else:
                assert isinstance(r.to_finish, FINISH_ABORT) and option in r.to_finish.message
                assert r.to_finish.to_json()["status_code"] == 400
        assert len(queued) == len(cases)
    finally:
        plugin_state.reset()


def _dflash_inputs(batch=5, block=4, vocab=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    candidates = torch.randint(vocab, (batch, block), generator=g)
    logits = torch.randn(batch * block, vocab, generator=g) * 2
    sampling_info = SimpleNamespace(is_all_greedy=False, temperatures=torch.full((batch, 1), 0.8),
                                    top_ps=torch.full((batch,), 0.9), top_ks=torch.zeros(batch, dtype=torch.int64))
    return candidates, logits, sampling_info


def test_dflash_accept_matches_reference_with_sglang_commit():
    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.state import PluginState, VerifyRuntime
    from specadapt.sglang.verify import dflash_accept_block, target_probs_for_requests
    from specadapt.verification import block_verify

    runtime = VerifyRuntime(rule="block", impl="reference", seed=5)
    plugin_state.install(PluginState(runtime=runtime))
    worker = SimpleNamespace(_selector_sample=None, _tp_sync=None)
    try:
        for seed in range(10):
            candidates, logits, sampling_info = _dflash_inputs(seed=seed)
            batch, block = candidates.shape
            state = runtime.generator(torch.device("cpu")).get_state()
            accept_len, commit_lens, bonus, out_tokens, new_seq_lens = dflash_accept_block(
                None, worker, candidates=candidates, next_token_logits=logits, sampling_info=sampling_info,
                draft_input=None, prefix_lens=torch.zeros(batch), bs=batch, target_predict=None)
            gen = torch.Generator().set_state(state)
            coins, final = torch.rand(batch, block - 1, generator=gen), torch.rand(batch, generator=gen)
            probs = target_probs_for_requests(logits.reshape(batch, block, -1), sampling_info.temperatures,
                                              sampling_info.top_ps, sampling_info.top_ks)
            q = torch.nn.functional.one_hot(candidates[:, 1:], probs.shape[-1]).float()
            ref = block_verify(candidates, probs, q, coins, final)
            assert torch.equal(accept_len, ref.accept_len) and torch.equal(commit_lens, ref.accept_len + 1)
            for b in range(batch):
                tau = int(ref.accept_len[b])
                assert out_tokens[b, : tau + 1].tolist() == ref.output_tokens[b, : tau + 1].tolist()
                assert int(bonus[b]) == int(ref.output_tokens[b, tau])
            assert new_seq_lens is None
    finally:
        plugin_state.reset()


def test_dflash_greedy_batches_go_to_sglang():
    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.state import PluginState, VerifyRuntime
    from specadapt.sglang.verify import dflash_accept_block

    plugin_state.install(PluginState(runtime=VerifyRuntime(rule="block")))
    try:
        candidates, logits, sampling_info = _dflash_inputs()
        sampling_info.is_all_greedy = True
        calls = []
        out = dflash_accept_block(lambda w, **kw: calls.append(kw) or "sglang", SimpleNamespace(_selector_sample=None),
                                  candidates=candidates, next_token_logits=logits, sampling_info=sampling_info,
                                  draft_input=None, prefix_lens=None, bs=5, target_predict=None)
        assert out == "sglang" and len(calls) == 1
    finally:
        plugin_state.reset()
