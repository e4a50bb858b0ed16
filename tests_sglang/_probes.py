"""Helper programs run in fresh subprocesses (hook state is per process): ``python _probes.py NAME``.
Each prints one JSON line on stdout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def discovery():
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    eps = [f"{e.name}={e.value}" for e in entry_points(group="sglang.srt.plugins")]
    load_plugins()
    return {"entry_points": eps, "patched": sorted(HookRegistry._patched)}


def install(algorithm, verify, adaptive):
    """install_worker_hooks on a stand-in scheduler: which targets got patched, and where the sampler lands."""
    import torch
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from specadapt.sglang import verify as sa_verify
    from specadapt.sglang.config import PluginConfig
    from specadapt.sglang.install import install_worker_hooks

    load_plugins()
    config = PluginConfig(verify=verify, adaptive_verification=adaptive == "1")
    server_args = SimpleNamespace(speculative_algorithm=algorithm, speculative_num_steps=3, max_running_requests=8)
    scheduler = SimpleNamespace(server_args=server_args, draft_worker=None)
    install_worker_hooks(scheduler, config)
    import sglang.kernels.ops.speculative.reject_sampling as rs
    import sglang.srt.speculative.eagle_utils as eu

    def runs_ours(fn):
        """Call ``fn`` in SGLang's layout; True when the specadapt sampler served the call."""
        from test_sglang_adapter import _sglang_chain_inputs

        cand, ridx, coins, final, target, draft = _sglang_chain_inputs(seed=0, vocab=7)
        batch, slots = cand.shape
        before = sa_verify.get_runtime().calls
        fn(predicts=torch.zeros(batch * slots, dtype=torch.int32),
           accept_index=torch.full((batch, slots), -1, dtype=torch.int32),
           accept_token_num=torch.zeros(batch, dtype=torch.int32), candidates=cand, retrive_index=ridx,
           retrive_next_token=None, retrive_next_sibling=None, uniform_samples=coins,
           uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=draft,
           threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        return sa_verify.get_runtime().calls == before + 1

    replaced = algorithm != "DFLASH"
    return {
        "patched": sorted(HookRegistry._patched),
        "sampler_replaced": replaced and runs_ours(rs.chain_speculative_sampling_triton),
        "eagle_utils_rebound": replaced and runs_ours(eu.chain_speculative_sampling_triton),
    }


def triton_compare(num_seeds):
    """SGLang's own Triton chain / block kernel (TRITON_INTERPRET=1 on CPU) against the replacement."""
    import torch
    from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton as sglang_kernel
    from test_sglang_adapter import _sglang_chain_inputs

    from specadapt.sglang.verify import VerifyRuntime, chain_speculative_sampling, set_runtime

    result = {}
    for rule in ("chain", "block"):
        agree = total = 0
        for seed in range(int(num_seeds)):
            cand, ridx, coins, final, target, draft = _sglang_chain_inputs(seed=seed, vocab=7)
            batch, slots = cand.shape
            outs = []
            for fn in (sglang_kernel, chain_speculative_sampling):
                set_runtime(VerifyRuntime(rule=rule, impl="auto"))
                predicts = torch.full((batch * slots,), -1, dtype=torch.int32)
                accept_index = torch.full((batch, slots), -1, dtype=torch.int32)
                accept_num = torch.zeros(batch, dtype=torch.int32)
                extra = {"block_verification": rule == "block"} if fn is sglang_kernel else {}
                fn(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=cand,
                   retrive_index=ridx, retrive_next_token=torch.zeros_like(ridx),
                   retrive_next_sibling=torch.zeros_like(ridx), uniform_samples=coins,
                   uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=draft,
                   threshold_single=1.0, threshold_acc=1.0, deterministic=True, **extra)
                outs.append((predicts, accept_index, accept_num))
            for b in range(batch):
                total += 1
                agree += int(torch.equal(outs[0][2][b], outs[1][2][b])
                             and torch.equal(outs[0][1][b], outs[1][1][b])
                             and torch.equal(outs[0][0][ridx[b]], outs[1][0][ridx[b]]))
        result[rule] = [agree, total]
    return result


def _sglang_models_on_cpu():
    """Make SGLang's model classes constructible on a CPU-only host: one gloo process group of size 1 (SGLang's
    own test helper) and a stand-in for the vllm rotary op SGLang imports off CUDA (never called: only the
    weights are used)."""
    import socket
    import types

    if "vllm" not in sys.modules:
        vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = None
        vllm._custom_ops = ops
        sys.modules["vllm"], sys.modules["vllm._custom_ops"] = vllm, ops
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_single_process_dist(master_port=port)


def students():
    """TTS students on SGLang's real draft classes: dense STANDALONE drafts loaded by SGLang's own load_weights
    from a transformers model (student logits vs the transformers forward), the EAGLE-3 draft class (every
    tensor aliased), and LoRA merges landing in SGLang's tensors in place."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from specadapt.sglang.students import DenseLMStudent, Eagle3LlamaStudent, build_student

    _sglang_models_on_cpu()
    from sglang.srt.models.llama import LlamaForCausalLM as SgLlama
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM as SgQwen2
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM as SgQwen3

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    out = {}
    for family, (config_cls, hf_cls, sg_cls, extra) in {
        "llama": (LlamaConfig, LlamaForCausalLM, SgLlama, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, SgQwen2, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, SgQwen3, {"head_dim": 8}),
        "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, SgQwen3, {"head_dim": 8, "tie_word_embeddings": True}),
    }.items():
        torch.manual_seed(0)
        config = config_cls(**small, **extra)
        if "tie_word_embeddings" not in extra:
            config.tie_word_embeddings = False
        hf = hf_cls(config).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        draft = sg_cls(config)
        draft.load_weights(list(hf.state_dict().items()))
        student = build_student(draft, draft.config)
        tokens = torch.randint(64, (2, 7))
        mask = torch.ones(2, 7, dtype=torch.bool)
        with torch.no_grad():
            diff = float((student.logits(student.module, None, tokens, mask) - hf(tokens).logits).abs().max())
        aliased = all(student.weights.get(student.module, n).data_ptr() == p.data_ptr()
                      for n, p in draft.named_parameters())
        lora = build_student(draft, draft.config, "lora", 4)
        target = draft.model.layers[0].self_attn.qkv_proj.weight
        ptr, before = target.data_ptr(), target.detach().clone()
        with torch.no_grad():
            getattr(lora.module, "lora_b__model__layers__0__self_attn__qkv_proj__weight").fill_(0.01)
        lora.refresh()
        a = getattr(lora.module, "lora_a__model__layers__0__self_attn__qkv_proj__weight")
        merged = bool(torch.allclose(target, before + 0.01 * a.sum(0, keepdim=True).expand_as(before), atol=1e-6))
        out[family] = {"max_abs_diff": diff, "student": type(student).__name__, "aliased": aliased,
                       "lora_merged_in_place": merged and target.data_ptr() == ptr, "tied": student.tied}
    config = LlamaConfig(**{**small, "num_hidden_layers": 1}, draft_vocab_size=16)
    eagle = LlamaForCausalLMEagle3(config)
    student = build_student(eagle, eagle.config)
    with torch.no_grad():
        logits = student.logits(student.module, torch.randn(2, 5, 96), torch.randint(64, (2, 5)),
                                torch.ones(2, 5, dtype=torch.bool))
    out["eagle3"] = {
        "student": type(student).__name__,
        "aliased": all(student.weights.get(student.module, n).data_ptr() == p.data_ptr()
                       for n, p in eagle.named_parameters()),
        "finite": bool(torch.isfinite(logits).all()),
        "logits_width": logits.shape[-1], "lm_head_rows": eagle.lm_head.weight.shape[0],
        "lora_trainable": sorted(n for n, p in build_student(eagle, eagle.config, "lora").module.named_parameters()
                                 if n.startswith("lora_")),
    }
    assert isinstance(student, Eagle3LlamaStudent) and DenseLMStudent
    return out


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name == "triton_compare":
        os.environ["TRITON_INTERPRET"] = "1"
    print(json.dumps(globals()[name](*args)))
