"""Helper programs run in fresh subprocesses (hook state is per process): ``python _probes.py NAME``.
Each prints one JSON line on stdout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

# The repository root, so the shared helpers import by qualified name (tests.helpers.sglang).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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

    from specadapt.sglang import state as plugin_state
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
        from tests.helpers.sglang import _sglang_chain_inputs

        cand, ridx, coins, final, target, draft = _sglang_chain_inputs(seed=0, vocab=7)
        batch, slots = cand.shape
        before = plugin_state.require().runtime.calls
        fn(predicts=torch.zeros(batch * slots, dtype=torch.int32),
           accept_index=torch.full((batch, slots), -1, dtype=torch.int32),
           accept_token_num=torch.zeros(batch, dtype=torch.int32), candidates=cand, retrive_index=ridx,
           retrive_next_token=None, retrive_next_sibling=None, uniform_samples=coins,
           uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=draft,
           threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        return plugin_state.require().runtime.calls == before + 1

    replaced = algorithm != "DFLASH"
    return {
        "patched": sorted(HookRegistry._patched),
        "sampler_replaced": replaced and runs_ours(rs.chain_speculative_sampling_triton),
        "eagle_utils_rebound": replaced and runs_ours(eu.chain_speculative_sampling_triton),
    }


def install_gbv():
    """The GBV path of the scheduler-side installation on a stand-in scheduler: the constructor hook before the
    worker exists, then the heavy hooks; where SGLang's bindings point afterwards."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    import sglang.srt.speculative.eagle_utils as eu
    import sglang.srt.speculative.eagle_worker_v2 as ew

    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.config import PluginConfig
    from specadapt.sglang.install import install_pre_worker_hooks, install_worker_hooks

    load_plugins()
    config = PluginConfig(verify="gbv", num_paths=3)
    install_pre_worker_hooks(config)
    server_args = SimpleNamespace(speculative_algorithm="EAGLE3", speculative_num_steps=4, cuda_graph_max_bs_decode=5,
                                  max_running_requests=64)
    runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=17))
    worker = SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=runner), device="cpu")
    install_worker_hooks(SimpleNamespace(server_args=server_args, draft_worker=worker), config)
    drafting = plugin_state.require().drafting
    return {
        "patched": sorted(HookRegistry._patched),
        "sampler_rebound_in_worker": getattr(ew.sample_draft_proposal, "__wrapped__", None) is not None,
        "chain_sampler_rebound": getattr(eu.chain_speculative_sampling_triton, "__wrapped__", None) is not None,
        "runtime_rule": plugin_state.require().runtime.rule,
        "q_rows_shape": list(drafting.q_rows.shape),
    }


def triton_compare(num_seeds):
    """SGLang's own Triton chain / block kernel (TRITON_INTERPRET=1 on CPU) against the replacement."""
    import torch
    from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton as sglang_kernel
    from tests.helpers.sglang import _sglang_chain_inputs

    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.state import PluginState, VerifyRuntime
    from specadapt.sglang.verify import chain_speculative_sampling

    result = {}
    for rule in ("chain", "block"):
        agree = total = 0
        for seed in range(int(num_seeds)):
            cand, ridx, coins, final, target, draft = _sglang_chain_inputs(seed=seed, vocab=7)
            batch, slots = cand.shape
            outs = []
            for fn in (sglang_kernel, chain_speculative_sampling):
                plugin_state.install(PluginState(runtime=VerifyRuntime(rule=rule, impl="auto")))
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


def seeded_verify(num_seeds):
    """Per-request seeds on the EAGLE path (issue 19.8): SGLang's own seeded verify coins (``_verify_coins`` with
    ``sampling_info.sampling_seed``, its murmur-hash Triton kernel interpreted on CPU) through the replaced
    sampler: each request's accepted drafts and tokens are the same alone, in the whole batch and in another batch
    order; another seed changes them."""
    import torch
    import triton
    from sglang.kernels.ops.sampling import murmur_hash
    from sglang.srt.speculative.eagle_utils import _verify_coins
    from tests.helpers.sglang import _sglang_chain_inputs

    def interpreted_hash(seed, positions, col_indices):
        """SGLang's own murmur-hash Triton kernel, interpreted on CPU tensors (its CPU branch calls sgl_kernel's
        compiled op, which needs libcuda to load)."""
        n, m = seed.shape[0], col_indices.shape[0]
        hashed = torch.empty((n, m), dtype=torch.uint32)
        murmur_hash.murmur_hash32_kernel[(n, triton.cdiv(m, 1024))](seed, positions, col_indices, hashed, n, m,
                                                                    BLOCK_SIZE=1024)
        return hashed

    murmur_hash.murmur_hash32 = interpreted_hash  # _seeded_verify_coins imports it at call time

    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.state import PluginState, VerifyRuntime
    from specadapt.sglang.verify import chain_speculative_sampling

    def run(cand, target, draft, seeds, seq_lens, rows):
        rows = torch.tensor(rows)
        batch, slots = len(rows), cand.shape[1]
        coins, final = _verify_coins(sampling_info=SimpleNamespace(sampling_seed=seeds[rows]), seq_lens=seq_lens[rows],
                                     draft_token_num=slots, candidates=cand[rows], device="cpu")
        ridx = torch.arange(batch * slots).reshape(batch, slots)
        predicts = torch.full((batch * slots,), -1, dtype=torch.int32)
        accept_index = torch.full((batch, slots), -1, dtype=torch.int32)
        accept_num = torch.zeros(batch, dtype=torch.int32)
        chain_speculative_sampling(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                                   candidates=cand[rows], retrive_index=ridx, retrive_next_token=None,
                                   retrive_next_sibling=None, uniform_samples=coins,
                                   uniform_samples_for_final_sampling=final, target_probs=target[rows],
                                   draft_probs=draft[rows], threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        return [(int(accept_num[b]), predicts[ridx[b, : int(accept_num[b]) + 1]].tolist()) for b in range(batch)]

    result = {}
    for rule in ("chain", "block"):
        plugin_state.install(PluginState(runtime=VerifyRuntime(rule=rule, impl="auto")))
        same = total = changed = 0
        for seed in range(int(num_seeds)):
            cand, _, _, _, target, draft = _sglang_chain_inputs(seed=seed, vocab=7)
            seeds = torch.tensor([11, 22, 33, 44], dtype=torch.int64) + 100 * seed
            seq_lens = torch.tensor([5, 9, 5, 12]) + seed
            full = run(cand, target, draft, seeds, seq_lens, [0, 1, 2, 3])
            for rows in ([2], [3, 0], [1, 3, 0, 2]):
                got = run(cand, target, draft, seeds, seq_lens, rows)
                for b, r in enumerate(rows):
                    total += 1
                    same += int(got[b] == full[r])
            other = run(cand, target, draft, seeds + 1, seq_lens, [0, 1, 2, 3])
            changed += int(other != full)
        result[rule] = [same, total, changed]
    plugin_state.reset()
    return result


def _stub_vllm():
    """A stand-in for the vllm rotary op SGLang's RotaryEmbedding imports off CUDA (never called here)."""
    import types

    if "vllm" not in sys.modules:
        vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = None
        vllm._custom_ops = ops
        sys.modules["vllm"], sys.modules["vllm._custom_ops"] = vllm, ops


def _hf_and_sglang(config, hf_cls, sg_cls):
    """A transformers model (norms and biases perturbed, so a missed one shows) and SGLang's model class loaded
    from its weights by SGLang's own ``load_weights`` (which fuses and, at TP > 1, shards them)."""
    import torch

    hf = hf_cls(config).eval()
    with torch.no_grad():
        for name, prm in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                prm.add_(torch.randn_like(prm) * 0.1)
    draft = sg_cls(config)
    with torch.no_grad():  # SGLang allocates with torch.empty: a tensor load_weights missed must not pass
        for prm in draft.parameters():
            prm.fill_(float("nan"))
    draft.load_weights(list(hf.state_dict().items()))
    require_loaded(draft)
    return hf, draft


def require_loaded(model):
    """Raise naming every parameter of ``model`` that holds NaN / inf (a tensor SGLang's ``load_weights`` or the
    probe never wrote: SGLang allocates parameters with ``torch.empty``, so it would be uninitialised memory)."""
    import torch

    bad = [name for name, prm in model.named_parameters() if not bool(torch.isfinite(prm).all())]
    if bad:
        raise AssertionError(f"{type(model).__name__}: parameters never written (uninitialised): {bad}")


def sglang_model(cls, config):
    """SGLang's model class ``cls(config)`` with every parameter set deterministically from torch's global
    seed (norm weights near 1, the rest N(0, 0.2^2)) instead of the uninitialised memory ``torch.empty`` gives."""
    import torch

    model = cls(config)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.copy_(1 + 0.1 * torch.randn_like(prm) if "norm" in name else 0.2 * torch.randn_like(prm))
    return model


def _sglang_models_on_cpu():
    """Make SGLang's model classes constructible on a CPU-only host: one gloo process group of size 1 (SGLang's
    own test helper) and a stand-in for the vllm rotary op SGLang imports off CUDA (never called: only the
    weights are used)."""
    import socket

    _stub_vllm()
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
        hf, draft = _hf_and_sglang(config, hf_cls, sg_cls)
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
    eagle = sglang_model(LlamaForCausalLMEagle3, config)
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
        "draft_vocab_size": eagle.config.draft_vocab_size,
        "lora_trainable": sorted(n for n, p in build_student(eagle, eagle.config, "lora").module.named_parameters()
                                 if n.startswith("lora_")),
    }
    assert isinstance(student, Eagle3LlamaStudent) and DenseLMStudent
    return out


def gbv_draft(num_paths, num_steps, hot="0"):
    """SGLang's own ``EagleDraftWorker.draft_forward`` (eager, on a stand-in worker whose draft model's logits
    depend on the input token), ``select_top_k_tokens``, ``organize_draft_results`` and the Triton tree builder
    (interpreted) under the plugin's K-path hooks; then the plugin's GBV over the resulting tree. ``hot="1"``:
    the draft head predicts 6 hot ids of the 11-token vocabulary (SGLang maps sampled ids through
    ``hot_token_id``; the plugin scatters q rows)."""
    import torch
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    import sglang.srt.speculative.eagle_utils as eu
    import sglang.srt.speculative.eagle_worker_v2 as ew

    from specadapt.sglang import draft_hooks, gbv, hot_vocab, layout
    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.state import PluginState
    from specadapt.sglang.targets import DRAFT_SAMPLER

    k, depth, batch, vocab, hidden = int(num_paths), int(num_steps), 3, 11, 8
    hot_ids = torch.tensor([9, 2, 4, 0, 7, 5]) if hot == "1" else None
    HookRegistry.register(DRAFT_SAMPLER, draft_hooks.sample_draft_proposal_around, HookType.AROUND)
    HookRegistry.apply_hooks()
    drafting = gbv.GBVDrafting.allocate(k, depth, vocab, batch, "cpu")
    plugin_state.install(PluginState(drafting=drafting,
                                     hot_vocab=None if hot_ids is None else hot_vocab.HotVocab(hot_ids, vocab)))
    g = torch.Generator().manual_seed(0)
    width = vocab if hot_ids is None else hot_ids.numel()
    table = torch.randn(vocab, width, generator=g) * 2  # the stand-in draft: logits = table[input token]
    temperature = 0.8

    class Runner:
        model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLMEagle3"]),
                                       model_is_mrope=False)
        canary_manager = None

        def forward(self, forward_batch):
            logits = table[forward_batch.input_ids].clone()
            return SimpleNamespace(logits_output=SimpleNamespace(
                next_token_logits=logits, hidden_states=forward_batch.spec_info.hidden_states + 1))

    worker = SimpleNamespace(hot_token_id=hot_ids, topk=k, speculative_num_steps=depth,
                             speculative_num_draft_tokens=k * depth + 1, index_share_for_mtp_iteration=False,
                             seed_dsa_topk_from_draft_extend=False, draft_runner=Runner(),
                             draft_attn_backend=SimpleNamespace(attn_backends=[None] * depth),
                             _topk1_parents_prealloc=torch.zeros(0))
    ew.get_spec = lambda: SimpleNamespace(speculative_use_rejection_sampling=True)  # what the server resolves
    q1 = draft_hooks.to_target(torch.softmax(torch.randn(batch, width, generator=g), -1))  # the extend's output
    topk_p, topk_index = gbv.first_draft_samples(draft_hooks.to_draft(q1), k)  # draft ids
    forward_batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: False),
        spec_info=SimpleNamespace(topk_p=topk_p, topk_index=topk_index, hidden_states=torch.zeros(batch, hidden),
                                  draft_probs=q1),
        out_cache_loc=torch.arange(batch * k * depth), batch_size=batch, moe_num_token_non_padded=None,
        sampling_info=SimpleNamespace(is_all_greedy=False, temperatures=torch.full((batch, 1), temperature),
                                      top_ks=torch.zeros(batch, dtype=torch.int64), sampling_seed=None),
        positions=torch.full((batch * k,), 5), input_ids=None)
    parent_list, top_scores_index, draft_tokens, draft_probs = ew.EagleDraftWorker.draft_forward(worker, forward_batch)
    eu.build_tree_kernel_efficient_func = spec_tree.sgl_build_tree_kernel_triton  # the CUDA kernel's twin
    bonus = torch.tensor([3, 4, 5])
    tree_mask, positions, ridx, nxt, sib, candidates = eu.build_tree_kernel_efficient(
        bonus, parent_list, top_scores_index, draft_tokens, torch.tensor([5, 7, 9]), 21, k, depth, k * depth + 1)
    n = k * depth + 1
    candidates = candidates.reshape(batch, n)
    nodes = layout.chain_nodes(nxt, sib, k, depth)
    chains = candidates.gather(1, nodes.reshape(batch, -1)).reshape(batch, k, depth)
    # each path starts with its own depth-1 sample and each deeper q row is the draft's law after that path's
    # previous token (the stand-in draft reads only the input token)
    first_ok = bool(torch.equal(chains[:, :, 0], topk_index if hot_ids is None else hot_ids[topk_index]))
    rows = drafting.rows_for(batch).reshape(depth - 1, batch, k, vocab)
    law = lambda token: draft_hooks.to_target(torch.softmax(table[token] / temperature, -1))  # noqa: E731
    q_ok = all(
        torch.allclose(rows[d - 2, b, int(nodes[b, j, 0]) - 1], law(chains[b, j, d - 2]))
        for b in range(batch) for j in range(k) for d in range(2, depth + 1))
    in_vocab = bool(hot_ids is None or torch.isin(chains, hot_ids).all())
    q_of_drafts = bool(all(float(rows[d - 2, b, int(nodes[b, j, 0]) - 1, chains[b, j, d - 1]]) > 0
                           for b in range(batch) for j in range(k) for d in range(2, depth + 1)))
    depths_ok = bool(torch.equal(positions.reshape(batch, n).gather(1, nodes.reshape(batch, -1)).reshape(batch, k, depth)
                                 - torch.tensor([5, 7, 9])[:, None, None], torch.arange(1, depth + 1).expand(batch, k, depth)))
    target = torch.softmax(torch.randn(batch, n, vocab, generator=g), -1)
    predicts = torch.zeros(batch * n, dtype=torch.int32)
    accept_index = torch.full((batch, depth + 1), -1, dtype=torch.int32)
    accept_num = torch.zeros(batch, dtype=torch.int32)
    out = gbv.gbv_speculative_sampling(drafting, predicts, accept_index, accept_num, candidates, ridx, nxt, sib,
                                       torch.rand(batch, n, generator=g), torch.rand(batch, generator=g), target,
                                       draft_probs, impl="reference").out
    path_ok = True
    for b in range(batch):
        c, t = int(out.chosen_path[b]), int(out.accept_len[b])
        path = [0] + nodes[b, c].tolist()
        path_ok &= accept_index[b].tolist() == [int(ridx[b, x]) for x in path[: t + 1]] + [-1] * (depth - t)
        path_ok &= [int(predicts[int(ridx[b, x])]) for x in path[:t]] == chains[b, c, :t].tolist()
    return {"nodes_per_request": n, "draft_probs_shape": list(draft_probs.shape), "first_samples_kept": first_ok,
            "q_rows_match_each_path": q_ok, "depths_ok": depths_ok, "gbv_path_written": bool(path_ok),
            "drafts_in_hot_vocab": in_vocab, "q_positive_at_drafts": q_of_drafts,
            "top_scores_index": top_scores_index[0].tolist()}


def gbv_worker_init():
    """The plugin's AROUND on EagleDraftWorker.__init__ hides rejection sampling from SGLang's top-k-1 assertion
    for the constructor only (real ``get_spec()`` of a published GBV server configuration)."""
    from sglang.srt.runtime_context import get_spec, publish
    from sglang.srt.server_args import prepare_server_args

    from specadapt.sglang import draft_hooks
    from specadapt.sglang import state as plugin_state
    from specadapt.sglang.state import PluginState
    from sglang.srt.plugins import load_plugins

    load_plugins()
    models = json.loads(os.environ["SPECADAPT_TINY_MODELS"])
    server_args = prepare_server_args([
        "--model-path", models["target"], "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
        models["eagle3"], "--device", "cuda", "--skip-tokenizer-init", "--specadapt-verify", "gbv",
        "--specadapt-num-paths", "3", "--speculative-num-steps", "4"])
    server_args.resolve_once()
    publish(server_args, role="test")
    seen = {}

    def constructor(worker, *args, **kwargs):  # stands for EagleDraftWorker.__init__'s check
        seen["inside"] = get_spec().speculative_use_rejection_sampling
        seen["topk"] = get_spec().speculative_eagle_topk

    draft_hooks.draft_worker_init_around(constructor, object())

    def alloc_memory_pool(worker):  # stands for EagleDraftWorker.alloc_memory_pool: init_lm_head, vocab check
        worker.hot_token_id = torch.tensor([3, 1, 4])
        seen["pool_rs"] = get_spec().speculative_use_rejection_sampling

    import torch

    worker = SimpleNamespace(target_worker=SimpleNamespace(model_config=SimpleNamespace(vocab_size=256)),
                             draft_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=256)))
    plugin_state.install(PluginState())  # the scheduler-side installation precedes the pool's allocation
    draft_hooks.alloc_memory_pool_around(alloc_memory_pool, worker)
    hot = plugin_state.require().hot_vocab
    worker.draft_runner.model_config.vocab_size = 300  # a draft config whose vocabulary differs from the target's
    try:
        draft_hooks.alloc_memory_pool_around(alloc_memory_pool, worker)
        seen["width_mismatch"] = "accepted"
    except RuntimeError as exc:
        seen["width_mismatch"] = "refused" if "differs from the target" in str(exc) else str(exc)
    return {"outside": get_spec().speculative_use_rejection_sampling, **seen,
            "draft_tokens": get_spec().speculative_num_draft_tokens,
            "hot_ids": hot.ids.tolist(), "target_vocab": hot.target_vocab}


def tp_students():
    """TTS students at tensor parallelism 2: two gloo processes, each building SGLang's real model classes sharded
    by SGLang's own weight loader; returns each rank's findings (:func:`tp_rank`)."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "tp_rank", str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err) in zip(procs, outs):
        if proc.returncode:
            raise RuntimeError(err[-3000:])
    return {"ranks": [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]}


def tp_rank(rank, port):
    """One rank of :func:`tp_students`: SGLang Llama (key/value heads replicated over the ranks), Qwen2 (q/k/v
    biases) and Qwen3 (q/k norms) drafts loaded with TP 2 from transformers weights, and an EAGLE-3 draft; each
    student's logits against the unsharded reference, then a LoRA publish read back through the served shards."""
    import torch

    rank = int(rank)
    _stub_vllm()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.test.test_utils import publish_build_topology

    make_group = parallel_state.init_model_parallel_group  # CPU: gloo only, no NCCL communicators

    def cpu_group(*args, **kwargs):
        return make_group(*args, **{**kwargs, "use_pynccl": False, "use_custom_allreduce": False,
                                    "use_mscclpp": False, "use_torch_symm_mem_allreduce": False})

    parallel_state.init_model_parallel_group = cpu_group
    init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo")
    publish_build_topology(world_rank=rank, tp_size=2, ep_size=1, pp_size=1)
    initialize_model_parallel(backend="gloo")

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM as SgLlama
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM as SgQwen2
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM as SgQwen3

    from specadapt.sglang.probes import tensor_parallel
    from specadapt.sglang.students import build_student

    tp = tensor_parallel()
    small = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, tie_word_embeddings=False)
    out = {"tp_rank": tp.rank, "tp_size": tp.size}
    for family, (config_cls, hf_cls, sg_cls, extra) in {
        "llama_kv1": (LlamaConfig, LlamaForCausalLM, SgLlama, {"num_key_value_heads": 1}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, SgQwen2, {"num_key_value_heads": 2}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, SgQwen3, {"num_key_value_heads": 2, "head_dim": 8}),
    }.items():
        torch.manual_seed(0)  # the same model on both ranks
        config = config_cls(**small, **extra)
        hf, draft = _hf_and_sglang(config, hf_cls, sg_cls)
        tokens = torch.randint(128, (2, 7))
        mask = torch.ones(2, 7, dtype=torch.bool)
        student = build_student(draft, draft.config, "lora", 4, tp=tp)
        with torch.no_grad():
            diff = float((student.logits(student.module, None, tokens, mask) - hf(tokens).logits).abs().max())
            for name, p in student.module.named_parameters():
                if name.startswith("lora_b__"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
            adapted = student.logits(student.module, None, tokens, mask)
        served = {n: p.data_ptr() for n, p in draft.named_parameters()}
        student.refresh()
        fresh = build_student(draft, draft.config, "full", tp=tp)  # gathers the served shards again
        with torch.no_grad():
            after = float((fresh.logits(fresh.module, None, tokens, mask) - adapted).abs().max())
        out[family] = {"max_abs_diff": diff, "after_publish_diff": after,
                       "in_place": served == {n: p.data_ptr() for n, p in draft.named_parameters()},
                       "shard_rows": int(draft.model.layers[0].self_attn.qkv_proj.weight.shape[0])}
    # EAGLE-3: the TP-2 student against a TP-1 student over the full fused tensors
    torch.manual_seed(1)
    config = LlamaConfig(**{**small, "num_hidden_layers": 1}, num_key_value_heads=2, draft_vocab_size=128)
    eagle = LlamaForCausalLMEagle3(config)
    full = {n: torch.randn(p.shape[0] * (2 if n != "model.fc.weight" and p.dim() and "norm" not in n else 1),
                           *p.shape[1:]) for n, p in eagle.named_parameters()}
    hidden = 32
    full["model.layers.0.self_attn.qkv_proj.weight"] = torch.randn((4 + 2 * 2) * 8, 2 * hidden)
    full["model.layers.0.self_attn.o_proj.weight"] = torch.randn(hidden, 4 * 8)
    full["model.layers.0.mlp.down_proj.weight"] = torch.randn(hidden, 48)
    full["model.fc.weight"] = torch.randn(hidden, 3 * hidden)
    for n in list(full):
        if "norm" in n:
            full[n] = 1 + 0.1 * torch.randn(hidden)
    pre = "model.layers.0."
    hf_names = {pre + "self_attn.q_proj.weight": full[pre + "self_attn.qkv_proj.weight"][:32],
                pre + "self_attn.k_proj.weight": full[pre + "self_attn.qkv_proj.weight"][32:48],
                pre + "self_attn.v_proj.weight": full[pre + "self_attn.qkv_proj.weight"][48:],
                pre + "mlp.gate_proj.weight": full[pre + "mlp.gate_up_proj.weight"][:48],
                pre + "mlp.up_proj.weight": full[pre + "mlp.gate_up_proj.weight"][48:]}
    state = {n: t for n, t in full.items() if "qkv_proj" not in n and "gate_up_proj" not in n}
    state.update(hf_names)
    eagle.load_weights([(n.replace("model.", "", 1) if n.startswith("model.") else n, t) for n, t in state.items()])
    require_loaded(eagle)
    student = build_student(eagle, eagle.config, "full", tp=tp)
    from torch import nn
    from tests.helpers.sglang import with_parameters

    ref_draft = with_parameters(type("LlamaForCausalLMEagle3", (nn.Module,), {})(),
                                {name: value.clone() for name, value in full.items()})
    reference = build_student(ref_draft, eagle.config, "full")
    feats, toks = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(2)), torch.randint(128, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad():
        out["eagle3_max_abs_diff"] = float((student.logits(student.module, feats, toks, mask)
                                            - reference.logits(reference.module, feats, toks, mask)).abs().max())
    return out


def sglang_forwards():
    """The TTS students against SGLang's own model forwards, run on CPU through SGLang's torch_native attention
    backend (its attention-unittest kit's mock model runner, an EXTEND batch of two requests from position 0):
    LlamaForCausalLMEagle3 plain / with norm_before_fc / with fc_norm, and the dense STANDALONE families."""
    import torch
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    from specadapt.sglang.students import build_student

    _sglang_models_on_cpu()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.llama import LlamaForCausalLM as SgLlama
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM as SgQwen2
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM as SgQwen3
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit

    hidden, heads, kv_heads, head_dim, vocab = 32, 4, 2, 8, 64
    lengths = (5, 3)

    def run(model, layers, features=None):
        case = kit.DenseAttentionCase(name="tts", backend="torch_native", forward_mode=ForwardMode.EXTEND,
                                      num_heads=heads, num_kv_heads=kv_heads, page_size=1, prefix_lens=(0, 0),
                                      extend_lens=lengths)
        config = kit.TinyModelConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
                                     context_len=64, sliding_window_size=None)
        runner = kit.MockModelRunner(case=case, model_config=config, dtype=torch.float32, device="cpu",
                                     max_context_len=64, head_dim=head_dim)
        runner.token_to_kv_pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=kv_heads,
                                                   head_dim=head_dim, layer_num=layers, device="cpu",
                                                   enable_memory_saver=False, enable_alt_stream=False)
        backend = ATTENTION_BACKENDS["torch_native"](runner)
        batch = kit._make_forward_batch(case, runner, max_context_len=64, device="cpu")
        batch.input_ids = torch.randint(vocab, (sum(lengths),), generator=torch.Generator().manual_seed(3))
        batch.mm_input_embeds = None
        batch.contains_mm_inputs = lambda: False
        batch.spec_info = SimpleNamespace(hidden_states=features, capture_hidden_mode=CaptureHiddenMode.NULL)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(batch)
            out = model.model(batch.input_ids, batch.positions, batch)
        hidden_states = out[0] if isinstance(out, tuple) else out
        return torch.nn.functional.linear(hidden_states, model.lm_head.weight), batch.input_ids

    def student_logits(model, tokens, features=None):
        student = build_student(model, model.config)
        rows, start = [], 0
        with torch.no_grad():
            for n in lengths:
                f = None if features is None else features[start:start + n][None]
                rows.append(student.logits(student.module, f, tokens[start:start + n][None],
                                           torch.ones(1, n, dtype=torch.bool))[0])
                start += n
        return torch.cat(rows)

    out = {}
    for variant, extra in (("plain", {}), ("norm_before_fc", {"norm_before_fc": True}), ("fc_norm", {"fc_norm": True})):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, draft_vocab_size=vocab,
                             max_position_embeddings=64, **extra)
        model = sglang_model(LlamaForCausalLMEagle3, config)
        features = torch.randn(sum(lengths), 3 * hidden)
        ref, tokens = run(model, 1, features)
        ours = student_logits(model, tokens, features)
        out[f"eagle3_{variant}"] = {"max_abs_diff": float((ours - ref[..., : ours.shape[-1]]).abs().max()),
                                    "params": sorted(n for n, _ in model.named_parameters() if "norm" in n and "layers" not in n)}
    for family, (config_cls, cls, extra) in {"llama": (LlamaConfig, SgLlama, {}),
                                             "qwen2": (Qwen2Config, SgQwen2, {}),
                                             "qwen3": (Qwen3Config, SgQwen3, {"head_dim": head_dim})}.items():
        torch.manual_seed(1)
        config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                            tie_word_embeddings=False, **extra)
        model = sglang_model(cls, config)
        ref, tokens = run(model, 2)
        ours = student_logits(model, tokens)
        out[family] = {"max_abs_diff": float((ours - ref[..., :vocab]).abs().max())}
    return out


def dflash_forward():
    """The DFLASH student against SGLang's own ``DFlashDraftModel`` forward on CPU: context K/V materialised with
    the model's own ``project_target_hidden`` / ``kv_proj_only`` / ``apply_k_norm`` / ``apply_k_rope`` (what
    the worker does), then the block ``[bonus, mask, ...]`` as an EXTEND batch over that prefix through the
    torch_native backend (ENCODER_ONLY: bidirectional in the block), logits through a target LM head."""
    import torch
    from transformers import Qwen3Config

    from specadapt.sglang.students.dflash import DFlashStudent

    _sglang_models_on_cpu()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit

    hidden, heads, kv_heads, head_dim, vocab, block, mask_id = 32, 4, 2, 8, 64, 4, 5
    contexts = (6, 3)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=128)
    config.dflash_config = {"target_layer_ids": [1, 3], "block_size": block, "mask_token_id": mask_id}
    config.architectures = ["DFlashDraftModel"]
    torch.manual_seed(0)
    model = sglang_model(DFlashDraftModel, config)
    embed = torch.randn(vocab, hidden) * 0.5
    lm_head = torch.randn(vocab, hidden) * 0.3
    features = [torch.randn(c, 2 * hidden) for c in contexts]
    bonus = torch.tensor([7, 11])

    case = kit.DenseAttentionCase(name="dflash", backend="torch_native", forward_mode=ForwardMode.EXTEND,
                                  num_heads=heads, num_kv_heads=kv_heads, page_size=1, prefix_lens=contexts,
                                  extend_lens=(block, block))
    tiny = kit.TinyModelConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
                               context_len=64, sliding_window_size=None)
    runner = kit.MockModelRunner(case=case, model_config=tiny, dtype=torch.float32, device="cpu",
                                 max_context_len=64, head_dim=head_dim)
    runner.token_to_kv_pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=kv_heads,
                                               head_dim=head_dim, layer_num=2, device="cpu",
                                               enable_memory_saver=False, enable_alt_stream=False)
    backend = ATTENTION_BACKENDS["torch_native"](runner)
    batch = kit._make_forward_batch(case, runner, max_context_len=64, device="cpu")
    with torch.no_grad():
        for layer in model.layers:  # the worker's context-KV materialisation, request by request
            attn = layer.self_attn
            for r, (c, f) in enumerate(zip(contexts, features)):
                ctx = model.prepare_context_hidden_for_kv(layer, model.project_target_hidden(f))
                k, v = attn.kv_proj_only(ctx)
                k = attn.apply_k_rope(torch.arange(c), attn.apply_k_norm(k))
                locs = runner.req_to_token_pool.req_to_token[r, :c].to(torch.int64)
                runner.token_to_kv_pool.set_kv_buffer(attn.attn, locs, k.view(-1, kv_heads, head_dim),
                                                      v.view(-1, kv_heads, head_dim))
        block_ids = torch.stack([torch.tensor([int(b)] + [mask_id] * (block - 1)) for b in bonus])
        with forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(batch)
            out = model(block_ids.reshape(-1), batch.positions, batch,
                        input_embeds=torch.nn.functional.embedding(block_ids.reshape(-1), embed))
        ref = torch.nn.functional.linear(out.hidden_states, lm_head).reshape(2, block, vocab)
        student = DFlashStudent(model, config, embed, lm_head)
        c_max = max(contexts)
        feats = torch.zeros(2, c_max, 2 * hidden)
        mask = torch.zeros(2, c_max, dtype=torch.bool)
        for r, (c, f) in enumerate(zip(contexts, features)):
            feats[r, :c], mask[r, :c] = f, True
        ours = student.block_logits(student.module, feats, mask, block_ids)
    return {"max_abs_diff": float((ours - ref).abs().max()), "ref_scale": float(ref.abs().max()),
            "attn_types": [str(layer.self_attn.attn.attn_type) for layer in model.layers]}


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name in ("triton_compare", "seeded_verify"):
        os.environ["TRITON_INTERPRET"] = "1"
    print(json.dumps(globals()[name](*args)))
