"""SGLang's speculative tensor layouts (0.5.23), shared by the chain / block sampler (:mod:`.verify`) and GBV
(:mod:`.gbv`): writing a verification result into SGLang's in-place outputs, and reading the chains off its
verify tree. Plain torch; nothing here imports sglang.
"""

from __future__ import annotations

import torch

__all__ = ["assert_all", "chain_nodes", "scatter_sglang_outputs"]


def scatter_sglang_outputs(accept_len, output_tokens, retrive_index, predicts, accept_index, accept_token_num):
    """Write a specadapt result into SGLang's in-place chain-verification outputs.

    Args:
        accept_len: ``[B] int32`` accepted drafts (tau).
        output_tokens: ``[B, L+1] int32``, the tau accepted drafts then the extra token.
        retrive_index: ``[B, L+1] int64`` global node id of each slot (``b * (L+1) + j`` in SGLang's chain).
        predicts: ``[B * (L+1)] int32`` (mutated): the token following each accepted node.
        accept_index: ``[B, >= L+1] int32`` (mutated): global ids of the root and the accepted nodes, -1 after.
        accept_token_num: ``[B] int32`` (mutated): tau.
    """
    batch, slots = output_tokens.shape
    tau = accept_len.to(torch.int64)
    position = torch.arange(slots, device=output_tokens.device)[None, :]
    live = position <= tau[:, None]
    index = retrive_index[:, :slots].to(torch.int64)
    accept_index.fill_(-1)
    accept_index[:, :slots].copy_(torch.where(live, index, torch.full_like(index, -1)).to(accept_index.dtype))
    predicts[index[live]] = output_tokens[live].to(predicts.dtype)
    accept_token_num.copy_(accept_len.to(accept_token_num.dtype))


def chain_nodes(retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor, num_paths: int,
                num_steps: int) -> torch.Tensor:
    """Local node ids ``[B, K, L] int64`` of the K root-to-leaf chains of SGLang's verify tree.

    Args:
        retrive_next_token: ``[B, N]`` first child of each local node (-1 none); retrive_next_sibling: ``[B, N]``
            next sibling (-1 none); ``N = K*L + 1``, node 0 the root.

    Raises:
        ValueError: the tree is not K chains of depth L (a missing child or sibling).
    """
    batch, width = retrive_next_token.shape
    if width != num_paths * num_steps + 1:
        raise ValueError(f"specadapt GBV: the verify tree has {width} nodes per request, expected K*L+1 = "
                         f"{num_paths * num_steps + 1}; set --speculative-num-draft-tokens {num_paths * num_steps + 1}")
    nxt = retrive_next_token.to(torch.int64)
    sib = retrive_next_sibling.to(torch.int64)
    first = [nxt[:, 0]]
    for _ in range(num_paths - 1):
        first.append(sib.gather(1, first[-1].clamp_min(0)[:, None]).squeeze(1))
    levels = [torch.stack(first, dim=1)]  # [B, K]
    for _ in range(num_steps - 1):
        levels.append(nxt.gather(1, levels[-1].clamp_min(0)))
    nodes = torch.stack(levels, dim=2)
    assert_all((nodes >= 0).all(), "specadapt GBV: the verify tree is not K chains of depth L (was it drafted by "
                                   "the plugin's K-path hooks?)")
    return nodes


def assert_all(condition: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` when ``condition`` (a bool tensor) is false: on the host for CPU tensors,
    as an asynchronous device assertion otherwise (no host sync in SGLang's verify path)."""
    if condition.device.type == "cpu":
        if not bool(condition):
            raise ValueError(message)
    else:
        torch._assert_async(condition, message)
