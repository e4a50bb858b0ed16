"""GBV inside the real sglang 0.5.23: start-up resolution, SGLang's own draft_forward / select_top_k_tokens /
organize_draft_results / Triton tree builder under the plugin's K-path hooks, and the worker-constructor hook
(subprocesses: hooks and the published runtime configuration are per process)."""

from __future__ import annotations

import inspect
import json

import pytest

from specadapt.sglang.plugin import SERVER_ARGS_ATTR
from tests_sglang.helpers import _args, _probe


@pytest.mark.parametrize("num_paths, num_steps, hot", [(3, 4, "0"), (2, 2, "0"), (3, 3, "1")])
def test_sglangs_draft_forward_drafts_k_sampled_chains(num_paths, num_steps, hot):
    got = _probe("gbv_draft", str(num_paths), str(num_steps), hot,
                 env={"SPECADAPT_NO_CUDA": "1", "TORCHDYNAMO_DISABLE": "1", "TRITON_INTERPRET": "1"})
    assert got["nodes_per_request"] == num_paths * num_steps + 1
    assert got["draft_probs_shape"] == [3, num_steps, 11]  # SGLang's [B, L, V] layout is kept
    assert got["first_samples_kept"], "depth 1 must be the K independent samples"
    assert got["q_rows_match_each_path"], "every deeper q row must be the law its path's token was drawn from"
    assert got["depths_ok"], "the tree builder must place path nodes at depths 1..L"
    assert got["gbv_path_written"], "accept_index / predicts must follow the chosen path"
    assert got["drafts_in_hot_vocab"] and got["q_positive_at_drafts"]


def test_gbv_resolution_sets_the_tree_shape(plugins_loaded, tiny_models):
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(_args(tiny_models, "--specadapt-verify", "gbv", "--specadapt-num-paths", "3",
                                   "--speculative-num-steps", "4"))
    sa.resolve_once()
    view = resolved_view(sa)
    assert (view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (3, 13)
    assert view.speculative_use_rejection_sampling is True  # q rows exist
    assert getattr(sa, SERVER_ARGS_ATTR)["verify"] == "gbv"


def test_the_scheduler_reads_the_resolved_depth(plugins_loaded, tiny_models):
    """Resolution declares values beside the ServerArgs fields; the scheduler-side installation must read the
    declarations (no --speculative-num-steps given: the plugin's default depth)."""
    from sglang.srt.server_args import prepare_server_args

    from specadapt.sglang.probes import resolved
    from specadapt.sglang.plugin import DEFAULT_CHAIN_STEPS

    sa = prepare_server_args(_args(tiny_models, "--specadapt-verify", "gbv", "--specadapt-num-paths", "2"))
    sa.resolve_once()
    assert sa.speculative_num_steps is None  # the raw field stays unset
    assert resolved(sa, "speculative_num_steps") == DEFAULT_CHAIN_STEPS
    assert resolved(sa, "speculative_eagle_topk") == 2
    assert resolved(sa, "speculative_num_draft_tokens") == 2 * DEFAULT_CHAIN_STEPS + 1


def test_worker_hooks_hide_rejection_sampling_only_inside(tiny_models):
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    source = inspect.getsource(EagleDraftWorker.__init__)
    assert "speculative_use_rejection_sampling" in source and "self.topk == 1" in source  # what the hook is for
    got = _probe("gbv_worker_init", env={"SPECADAPT_NO_CUDA": "1", "SPECADAPT_TINY_MODELS": json.dumps(tiny_models)})
    assert got == {"outside": True, "inside": False, "topk": 3, "draft_tokens": 13, "pool_rs": False,
                   "hot_ids": [3, 1, 4], "target_vocab": 256, "width_mismatch": "refused"}


def test_alloc_memory_pool_still_holds_the_vocabulary_check_the_plugin_bypasses():
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    source = inspect.getsource(EagleDraftWorker.alloc_memory_pool)
    assert "speculative_use_rejection_sampling" in source and "share one vocab" in source
    assert "init_lm_head" in source  # where hot_token_id is set, before the plugin reads it


def test_install_applies_the_gbv_hooks():
    got = _probe("install_gbv", env={"SPECADAPT_NO_CUDA": "1"})
    prefix = "sglang.srt.speculative."
    for target in ("eagle_worker_v2.EagleDraftWorker.__init__", "spec_utils.sample_draft_proposal",
                   "eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill",
                   "eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode"):
        assert prefix + target in got["patched"]
    assert got["sampler_rebound_in_worker"], "draft_forward must call the hooked sample_draft_proposal"
    assert got["chain_sampler_rebound"] and got["runtime_rule"] == "gbv"
    assert got["q_rows_shape"] == [3, 5 * 3, 17]  # (L-1, cuda_graph_max_bs * K, V)
