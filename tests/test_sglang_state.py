"""The SGLang plugin's process state (specadapt.sglang.state): one PluginState, installed and reset in one place,
read by every hook; built from a stand-in scheduler without sglang."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specadapt.sglang import draft_hooks
from specadapt.sglang import state as plugin_state
from specadapt.sglang.config import PluginConfig
from specadapt.sglang.hot_vocab import HotVocab
from specadapt.sglang.install import build_state
from specadapt.sglang.state import PluginState, VerifyRuntime
from specadapt.sglang.verify import chain_speculative_sampling, dflash_accept_block


@pytest.fixture(autouse=True)
def _clean_state():
    plugin_state.reset()
    yield
    plugin_state.reset()


def test_install_reset_and_require():
    assert plugin_state.current() is None
    with pytest.raises(RuntimeError, match="not installed"):
        plugin_state.require()
    first = PluginState(config=PluginConfig(verify="block"), runtime=VerifyRuntime(rule="block"))
    assert plugin_state.install(first) is first
    assert plugin_state.current() is first and plugin_state.require() is first
    second = PluginState()
    plugin_state.install(second)  # replaces, never merges
    assert plugin_state.current() is second
    plugin_state.reset()
    assert plugin_state.current() is None
    with pytest.raises(TypeError, match="state must be a PluginState"):
        plugin_state.install(VerifyRuntime())


def test_default_states_share_nothing():
    a, b = PluginState(), PluginState()
    assert a.runtime is not b.runtime and a.rids is not b.rids and a.config is not b.config
    assert a.drafting is None and a.hot_vocab is None and a.adaptive is None and a.tts is None
    assert a.extend_lens is None and a.rids == [] and a.algorithm == ""


def test_hooks_read_the_installed_state():
    """The replaced sampler needs a state; the DFLASH acceptance and the q-row scatter pass through without one,
    and follow the installed state (a reset forgets the hot vocabulary)."""
    with pytest.raises(RuntimeError, match="not installed"):
        chain_speculative_sampling(*([None] * 14))
    assert dflash_accept_block(lambda worker, **kw: "sglang", None, candidates=torch.zeros(1, 2)) == "sglang"
    q = torch.tensor([[0.25, 0.75]])
    assert draft_hooks.to_target(q) is q
    plugin_state.install(PluginState(hot_vocab=HotVocab(torch.tensor([3, 0]), 4)))
    assert draft_hooks.to_target(q).tolist() == [[0.75, 0.0, 0.0, 0.25]]
    plugin_state.reset()
    assert draft_hooks.to_target(q) is q


def test_build_state_keeps_the_gbv_drafting_once():
    """A stand-in scheduler (no sglang): the K-path drafting buffer lives on the state only, sized from the
    resolved depth, the largest captured batch and the draft's vocabulary; building does not install."""
    server_args = SimpleNamespace(speculative_algorithm="eagle3", speculative_num_steps=4, cuda_graph_max_bs_decode=5,
                                  max_running_requests=64)
    worker = SimpleNamespace(draft_worker=SimpleNamespace(
        draft_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=17))), device="cpu")
    config = PluginConfig(verify="gbv", num_paths=3, adaptive_verification=True)
    state = build_state(SimpleNamespace(server_args=server_args, draft_worker=worker), config)
    assert plugin_state.current() is None
    assert state.algorithm == "EAGLE3" and state.config is config
    assert state.runtime.rule == "gbv" and not hasattr(state.runtime, "gbv")
    assert state.drafting is not None and list(state.drafting.q_rows.shape) == [3, 5 * 3, 17]
    assert state.adaptive is not None and state.adaptive.num_drafts == 4 and state.tts is None
    server_args.speculative_eagle_topk = 2  # a resolved top-k other than K
    with pytest.raises(RuntimeError, match="--speculative-eagle-topk 2"):
        build_state(SimpleNamespace(server_args=server_args, draft_worker=worker), config)
