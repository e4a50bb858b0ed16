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


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name == "triton_compare":
        os.environ["TRITON_INTERPRET"] = "1"
    print(json.dumps(globals()[name](*args)))
