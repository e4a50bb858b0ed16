"""TTS students on SGLang 0.5.23's real draft model classes (built on CPU, weights loaded by SGLang's own
``load_weights``; run in a subprocess: it creates a process group)."""

from __future__ import annotations

import pytest

from tests_sglang.helpers import _probe


@pytest.fixture(scope="module")
def students():
    return _probe("students", env={"SPECADAPT_NO_CUDA": "1"})


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_tied"])
def test_standalone_student_matches_transformers_on_sglangs_loaded_weights(students, family):
    """SGLang fuses q/k/v and gate/up at load time; the student reads that layout and computes the same logits
    as the transformers model the weights came from."""
    got = students[family]
    assert got["student"] == "DenseLMStudent"
    assert got["max_abs_diff"] < 1e-4, got
    assert got["aliased"], "the student must alias every SGLang tensor (publishes land in the served storage)"
    assert got["lora_merged_in_place"], "LoRA refresh must write W0 + B A into SGLang's own tensor"
    assert got["tied"] == (family == "qwen3_tied")


def test_eagle3_student_on_sglangs_class(students):
    got = students["eagle3"]
    assert got["student"] == "Eagle3LlamaStudent" and got["aliased"] and got["finite"]
    # SGLang pads the head's rows to a multiple of 64; the student's logits keep the draft's own ids
    assert got["logits_width"] == got["draft_vocab_size"] == 16 and got["lm_head_rows"] == 64
    adapted = {n.split("__", 1)[1] for n in got["lora_trainable"]}
    assert adapted == {"model__fc__weight", "model__layers__0__self_attn__qkv_proj__weight",
                       "model__layers__0__self_attn__o_proj__weight", "model__layers__0__mlp__gate_up_proj__weight",
                       "model__layers__0__mlp__down_proj__weight"}


@pytest.fixture(scope="module")
def tp_students():
    return _probe("tp_students", env={"SPECADAPT_NO_CUDA": "1"})


@pytest.mark.parametrize("family", ["llama_kv1", "qwen2", "qwen3"])
def test_students_at_tensor_parallelism_two(tp_students, family):
    """Two gloo ranks: SGLang shards the weights with its own loader (Llama's single key/value head replicated
    on both ranks); each rank's student gathers them and matches the unsharded transformers model, and after a
    LoRA publish the served shards hold exactly the merged weights."""
    for got in tp_students["ranks"]:
        assert got["tp_size"] == 2
        row = got[family]
        assert row["max_abs_diff"] < 1e-4, row
        assert row["after_publish_diff"] < 1e-4, row
        assert row["in_place"]
        assert row["shard_rows"] == 32  # SGLang really sharded qkv_proj (2 of 4 query heads + key/value)
    assert sorted(g["tp_rank"] for g in tp_students["ranks"]) == [0, 1]


def test_eagle3_student_at_tensor_parallelism_two(tp_students):
    for got in tp_students["ranks"]:
        assert got["eagle3_max_abs_diff"] < 1e-4


@pytest.fixture(scope="module")
def sglang_forwards():
    return _probe("sglang_forwards", env={"SPECADAPT_NO_CUDA": "1"})


@pytest.mark.parametrize("model", ["eagle3_plain", "eagle3_norm_before_fc", "eagle3_fc_norm", "llama", "qwen2",
                                   "qwen3"])
def test_students_equal_sglangs_own_forward(sglang_forwards, model):
    """SGLang's real draft forwards, run on CPU through its torch_native attention backend: the students compute
    the same logits (what TTS trains is what serving runs)."""
    assert sglang_forwards[model]["max_abs_diff"] < 1e-4, sglang_forwards[model]
    if model == "eagle3_norm_before_fc":
        assert "model.input_norm.weight" in sglang_forwards[model]["params"]
    if model == "eagle3_fc_norm":
        assert "model.fc_norm.2.weight" in sglang_forwards[model]["params"]



def test_dflash_student_equals_sglangs_own_dflash_forward():
    """SGLang's DFlashDraftModel on CPU: context K/V materialised with the model's own methods (as the worker
    does), the block [bonus, mask, ...] through torch_native's ENCODER_ONLY attention, a target LM head."""
    got = _probe("dflash_forward", env={"SPECADAPT_NO_CUDA": "1"})
    assert got["attn_types"] == ["AttentionType.ENCODER_ONLY"] * 2
    assert got["max_abs_diff"] < 1e-4 * max(1.0, got["ref_scale"]), got


def test_dflash_worker_holds_what_the_tts_hooks_use():
    import inspect

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    params = inspect.signature(DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc).parameters
    assert {"target_hidden", "commit_lens", "extend_lens"} <= {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    assert callable(getattr(DFlashWorkerV2, "_init_fused_kv_helper", None))  # rebuilt after publishes
    source = inspect.getsource(DFlashWorkerV2)
    assert "self._mask_token_id" in source and "self.draft_model = " in source
