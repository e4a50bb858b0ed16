"""Tests against the real sglang==0.5.23 (``make test-sglang``, run by .ci/run).

They need a virtual environment with sglang installed (the Makefile builds ``.venv-sglang``). With
``SPECADAPT_REQUIRE_SGLANG=1`` (set by ``make test-sglang``) a missing or different sglang FAILS the run;
without it the tests are skipped.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The helpers' asserts report their operands like the tests' own (must run before the helpers are imported).
pytest.register_assert_rewrite("tests.helpers", "tests_sglang.helpers")

EXPECTED_VERSION = "0.5.23"


def _sglang_version():
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return None


def pytest_collection_modifyitems(config, items):
    found = _sglang_version()
    required = os.environ.get("SPECADAPT_REQUIRE_SGLANG") == "1"
    if found == EXPECTED_VERSION:
        return
    reason = f"sglang=={EXPECTED_VERSION} is not installed (found {found})"
    if required:
        raise pytest.UsageError(f"SPECADAPT_REQUIRE_SGLANG=1 but {reason}")
    for item in items:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Config-only model directories (a Llama target, an EAGLE-3 draft) for SGLang's argument resolution."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("models")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(root / "target")
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.num_hidden_layers = 1
    config.save_pretrained(root / "eagle3")
    return {"target": str(root / "target"), "eagle3": str(root / "eagle3")}


@pytest.fixture(scope="session")
def plugins_loaded():
    """SGLang's own plugin loading, as in launch_server (light hooks only in this process)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True
