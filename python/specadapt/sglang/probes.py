"""Probes of the running SGLang (0.5.23): the settings it resolved, its CUDA-graph sizes, the draft's
vocabulary, its tensor-parallel groups. Each reads SGLang's process context lazily and falls back to plain
attributes / ``None`` where there is none (stand-ins in tests, TP = 1), so importing this module does not
import sglang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .state import Broadcast

if TYPE_CHECKING:  # the students package (torch.nn models) is imported only when TP > 1
    from .students import TensorParallel

__all__ = ["capturing", "draft_vocab", "graph_max_batch", "resolved", "tensor_parallel", "tp_broadcast"]


def resolved(server_args, field: str):
    """A speculative / scheduling setting as SGLang resolved it (resolution hooks declare values on the side and
    leave ``ServerArgs`` fields untouched); plain attribute lookup for stand-ins."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(server_args, field)
    except Exception:  # noqa: BLE001 - not a ServerArgs (tests) or another sglang
        return getattr(server_args, field, None)


def graph_max_batch(server_args) -> int:
    """The largest decode batch SGLang captures CUDA graphs for (the draft graphs write GBV's q rows)."""
    try:
        from sglang.srt.runtime_context import get_exec

        config = get_exec().graph.cuda_graph_config
        if config is not None and config.decode.max_bs:
            return int(config.decode.max_bs)
    except Exception:  # noqa: BLE001 - no published runtime context (tests)
        pass
    return int(resolved(server_args, "cuda_graph_max_bs_decode") or 64)


def draft_vocab(worker) -> int:
    """Vocabulary of the draft's q rows (the target's: rejection sampling needs a shared vocabulary)."""
    runner = worker.draft_worker.draft_runner
    return int(runner.model_config.vocab_size)


def tensor_parallel() -> TensorParallel | None:
    """This rank's :class:`~specadapt.sglang.students.TensorParallel` in SGLang's TP group (the draft's weights are
    sharded over it), or ``None`` when TP = 1 / no process group."""
    try:
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().tp_group
    except Exception:  # noqa: BLE001 - no parallel context (tests, TP = 1)
        return None
    size = int(getattr(group, "world_size", 1))
    if size <= 1:
        return None
    from .students import TensorParallel

    def gather(tensor):
        return list(group.all_gather(tensor.contiguous().unsqueeze(0), dim=0).unbind(0))

    return TensorParallel(rank=int(group.rank_in_group), size=size, gather=gather,
                          broadcast=lambda tensor: group.broadcast(tensor, src=0))


def tp_broadcast() -> Broadcast | None:
    """In-place broadcast from rank 0 of the group that shares a batch (the attention-TP group under DP
    attention, as SGLang's own verify broadcast), or ``None`` when that group has one rank / no process group."""
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        group = parallel.attn_tp_group if is_dp_attention_enabled() else parallel.tp_group
    except Exception:  # noqa: BLE001 - no parallel context (tests, TP = 1)
        return None
    if getattr(group, "world_size", 1) <= 1:
        return None
    return lambda tensor: group.broadcast(tensor, src=0)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (hooks skip host-side work inside captures)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
