"""Shared fixtures: tiny randomly initialised Llama models (fast) and the real embedded model (slow)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The helpers' asserts report their operands like the tests' own (must run before the helpers are imported).
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.models import WORDS, loaded, save_tiny_model_dir, tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target():
    return loaded(tiny_llama(seed=0))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), WORDS)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default (SmolLM2-135M-Instruct), loaded once per session."""
    from specadapt.engine.models import load_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return load_model("smollm2-135m")
