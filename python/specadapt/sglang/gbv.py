"""K-path sampled drafting inside SGLang's EAGLE draft, and greedy multi-path block verification (GBV) of it.

SGLang 0.5.23 drafts a top-k beam tree (``--speculative-eagle-topk K``) or, under rejection sampling, one
sampled chain. GBV needs K paths drawn independently from the draft, with every row ``q`` they were drawn from.
The plugin gets them out of SGLang's own tree machinery, unchanged, by choosing what it is fed:

* **Depth 1.** After the draft extend (prefill and decode, outside any CUDA graph) each request's next-round
  input carries ``draft_probs = q_1 [B, V]``; :func:`first_draft_samples` replaces its ``topk_index [B, K]`` by K
  independent samples from ``q_1`` (with replacement; a greedy request gets its top-K tokens) and its
  ``topk_p`` by the fixed, strictly decreasing branch scores ``s_0 > ... > s_{K-1} > 0``.
* **Depths 2..L.** Inside ``draft_forward`` (captured in SGLang's draft CUDA graph) each of the ``B*K`` rows
  of step ``i`` is one branch; :func:`~specadapt.sglang.draft_hooks.sample_draft_proposal_around` draws one
  token per row from that row's ``q`` (SGLang's own sampler, per-branch seeds), copies ``q`` into a static buffer
  allocated before capture (``q_rows[i] [B*K, V]``) and returns ``topk_p`` one-hot on the sample. ``select_top_k_tokens`` then scores
  the K*K candidates ``s_j * onehot``: exactly the K branch continuations are non-zero, in branch order, so
  step ``i+1`` row ``j`` is again branch ``j`` (and SGLang's per-branch draft KV slots hold each chain's own
  history). ``organize_draft_results`` with ``--speculative-num-draft-tokens = K*L + 1`` keeps exactly the
  K*L non-zero nodes: the tree is K chains of depth L.
* **Verify.** The replaced chain sampler (:func:`specadapt.sglang.verify.chain_speculative_sampling`) sees the
  tree; :func:`gbv_speculative_sampling` reads the chains off ``retrive_next_token`` / ``retrive_next_sibling``
  (:func:`~specadapt.sglang.layout.chain_nodes`), gathers each path's target rows, tokens and q rows (depth 1
  from ``draft_probs[:, 0]``, deeper from the buffer), runs :func:`specadapt.kernels.verify_paths` and writes the
  chosen path's accepted nodes into SGLang's ``accept_index`` / ``predicts`` (SGLang then compacts the accepted path, as for any top-k tree).

Greedy batches keep SGLang's top-k tree and greedy verification (the draft graph's greedy variant). This module
holds the drafting state and the algorithms; the hooks that feed SGLang's draft are in :mod:`.draft_hooks`.
Nothing here imports sglang at module import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .. import kernels
from ..verification.gbv import GBVOutput
from .layout import assert_all, chain_nodes, scatter_sglang_outputs

logger = logging.getLogger("specadapt.sglang")

__all__ = [
    "GBVDrafting",
    "GBVRound",
    "branch_scores",
    "branch_seeds",
    "first_draft_samples",
    "gbv_speculative_sampling",
]

#: Offset between the per-branch seeds of a seeded request (odd, so distinct for every branch index).
_BRANCH_SEED_STRIDE = 0x9E3779B1


def branch_scores(num_paths: int, batch: int, device=None) -> torch.Tensor:
    """``[B, K] float32`` scores ``s_k = 1 - k / (2K)``: positive and strictly decreasing, so SGLang's top-k
    selections keep the branches in order (their values matter for nothing else)."""
    scores = 1.0 - torch.arange(num_paths, dtype=torch.float32, device=device) / (2.0 * num_paths)
    return scores[None, :].expand(batch, num_paths).contiguous()


def branch_seeds(sampling_seed: torch.Tensor | None, num_paths: int) -> torch.Tensor | None:
    """``[B*K] int64`` seeds of the K branches of each request (``None`` without per-request seeds): distinct
    for every branch of a request, row ``b*K + k`` for branch ``k`` of request ``b``."""
    if sampling_seed is None:
        return None
    seeds = sampling_seed.reshape(-1).to(torch.int64).repeat_interleave(num_paths)
    offsets = torch.arange(num_paths, dtype=torch.int64, device=seeds.device).repeat(sampling_seed.numel())
    return seeds + offsets * _BRANCH_SEED_STRIDE


#: ``fast_sample``'s contract: ``(probs [N, V], num_samples, *, sampling_seed, positions) -> (p, index [N, 1])``.
Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _fast_sample() -> Sampler:
    from sglang.srt.speculative.spec_utils import fast_sample

    return fast_sample


@dataclass
class GBVDrafting:
    """K-path drafting state of one scheduler process.

    Attributes:
        num_paths: K; num_steps: L (draft depth).
        q_rows: ``[L-1, capacity, V] float32``: ``q_rows[i, b*K + k]`` is the row branch ``k`` of request ``b``
            sampled its depth-``i+2`` token from (allocated before CUDA-graph capture: graphs write into it).
        overflow: same for eager batches larger than ``capacity`` rows (never captured).
        sampler: ``fast_sample``-compatible callable for the depth-1 samples (``None``: SGLang's ``fast_sample``).
    """

    num_paths: int
    num_steps: int
    q_rows: torch.Tensor | None = None
    overflow: torch.Tensor | None = None
    sampler: Sampler | None = None

    @classmethod
    def allocate(cls, num_paths: int, num_steps: int, vocab: int, max_requests: int, device) -> "GBVDrafting":
        """Allocate the q-row buffer for ``max_requests`` requests (the largest captured draft batch)."""
        if num_paths < 2 or num_steps < 1 or vocab < 1 or max_requests < 1:
            raise ValueError(f"GBV drafting needs K >= 2, L >= 1, V >= 1, max_requests >= 1; got "
                             f"{num_paths}, {num_steps}, {vocab}, {max_requests}")
        q_rows = torch.zeros(max(num_steps - 1, 0), max_requests * num_paths, vocab, dtype=torch.float32,
                             device=device)
        logger.info("specadapt: GBV drafting K=%d L=%d, q-row buffer %.1f MB", num_paths, num_steps,
                    q_rows.numel() * 4 / 2**20)
        return cls(num_paths, num_steps, q_rows)

    def record(self, draft_step: int, probs: torch.Tensor) -> None:
        """Keep ``probs [B*K, V]``, the rows of draft step ``draft_step`` (1-based: depth ``draft_step + 1``)."""
        rows = probs.shape[0]
        if not 1 <= draft_step <= self.num_steps - 1:
            raise ValueError(f"draft_step {draft_step} outside [1, {self.num_steps - 1}]")
        if self.q_rows is not None and rows <= self.q_rows.shape[1]:
            self.q_rows[draft_step - 1, :rows].copy_(probs)
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"specadapt GBV: a captured draft batch of {rows} rows exceeds the q-row buffer "
                               f"({0 if self.q_rows is None else self.q_rows.shape[1]} rows)")
        if self.overflow is None or self.overflow.shape[1] < rows or self.overflow.shape[2] != probs.shape[1]:
            self.overflow = torch.zeros(self.num_steps - 1, rows, probs.shape[1], dtype=torch.float32,
                                        device=probs.device)
        self.overflow[draft_step - 1, :rows].copy_(probs)

    def rows_for(self, batch: int) -> torch.Tensor:
        """``[L-1, B*K, V]``: the q rows of the last draft of ``batch`` requests."""
        rows = batch * self.num_paths
        if self.q_rows is not None and rows <= self.q_rows.shape[1]:
            return self.q_rows[:, :rows]
        if self.overflow is None or self.overflow.shape[1] < rows:
            raise RuntimeError(f"specadapt GBV: no q rows recorded for a batch of {batch} requests")
        return self.overflow[:, :rows]


def first_draft_samples(probs: torch.Tensor, num_paths: int, top_ks: torch.Tensor | None = None,
                        sampling_seed: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                        sampler: Sampler | None = None):
    """The K depth-1 drafts of each request: independent samples from its ``q_1`` row.

    Args:
        probs: ``[B, V] float`` the draft's depth-1 law ``q_1`` (SGLang's ``draft_probs``).
        num_paths: K.
        top_ks: ``[B]`` per-request top-k; rows with ``top_k <= 1`` are greedy and propose their argmax on every
            path (their target law is one-hot, so any proposal is exact for them).
        sampling_seed, positions: ``[B]`` SGLang's per-request seeds and positions (deterministic sampling); the
            K branches get distinct seeds.
        sampler: ``fast_sample``-compatible callable; by default ``torch.multinomial`` with replacement without
            seeds, SGLang's ``fast_sample`` on K copies of the rows with seeds.

    Returns:
        ``(topk_p [B, K] float32`` branch scores, ``topk_index [B, K] int64)``.
    """
    batch, vocab = probs.shape
    if sampling_seed is None and sampler is None:
        index = torch.multinomial(probs, num_paths, replacement=True)  # i.i.d., no K-fold copy of the rows
    else:
        sampler = sampler or _fast_sample()
        rows = probs.repeat_interleave(num_paths, dim=0)
        seeds = branch_seeds(sampling_seed, num_paths)
        pos = None if positions is None else positions.reshape(-1).repeat_interleave(num_paths)
        _, index = sampler(rows, 1, sampling_seed=seeds, positions=pos)
    index = index.reshape(batch, num_paths).to(torch.int64)
    if top_ks is not None:  # greedy rows: K copies of the argmax (q > 0 there; any proposal is exact for them)
        greedy = (top_ks.reshape(-1) <= 1)[:, None]
        index = torch.where(greedy, probs.argmax(dim=-1, keepdim=True).to(torch.int64), index)
    return branch_scores(num_paths, batch, probs.device), index


# ---- verification -----------------------------------------------------------------------------------------
@dataclass
class GBVRound:
    """What one GBV call decided: ``out`` (:class:`specadapt.verification.gbv.GBVOutput`), ``path_nodes`` ``[B,
    L+1]`` local node ids (root first) of each request's chosen path, ``draft_probs`` ``[B, L, V]`` the q rows
    its drafts were sampled from."""

    out: GBVOutput
    path_nodes: torch.Tensor
    draft_probs: torch.Tensor


def gbv_speculative_sampling(drafting: GBVDrafting, predicts, accept_index, accept_token_num, candidates,
                             retrive_index, retrive_next_token, retrive_next_sibling, uniform_samples,
                             uniform_samples_for_final_sampling, target_probs, draft_probs, impl: str = "auto",
                             caps: torch.Tensor | None = None, broadcast=None, rule: str = "gbv") -> GBVRound:
    """GBV over the K chains of SGLang's verify tree, written into SGLang's in-place outputs.

    Layout (SGLang 0.5.23 ``eagle_sample`` under rejection sampling, top-k K): ``candidates [B, N] int64`` (node 0
    the last committed token), ``retrive_index / retrive_next_token / retrive_next_sibling [B, N]``,
    ``uniform_samples [B, N]`` (the first L are GBV's per-position coins), ``uniform_samples_for_final_sampling
    [B]``, ``target_probs [B, N, V]`` (row of node n = target law after n), ``draft_probs [B, L, V]`` (row 0 =
    ``q_1``, shared by the K paths), with ``N = K*L + 1``. Outputs: ``predicts [B*N]``, ``accept_index [B, L+1]``
    (root then the accepted nodes of the chosen path), ``accept_token_num [B]`` (accepted drafts).
    ``caps [B]`` (adaptive verification) verifies at most ``caps[b]`` drafts of each path (a prefix of every
    path is again K sampled paths: exact). ``broadcast`` (TP > 1) makes every rank keep rank 0's chosen path,
    as SGLang keeps rank 0's accepted tokens. ``rule``: the multi-path rule's registry name
    (:mod:`specadapt.verification.rules`).

    Returns:
        The :class:`GBVRound` (chosen paths and their q rows, for TTS).

    Raises:
        ValueError: a tree that is not K chains of depth L, or shapes off this layout.
    """
    k, depth = drafting.num_paths, drafting.num_steps
    batch, width = candidates.shape
    vocab = target_probs.shape[-1]
    nodes = chain_nodes(retrive_next_token, retrive_next_sibling, k, depth)  # [B, K, L]
    branch = nodes[:, :, 0] - 1  # depth-1 nodes are local 1..K in branch order (organize_draft_results)
    assert_all(((branch >= 0) & (branch < k)).all(), "specadapt GBV: depth-1 nodes are not local nodes 1..K")
    if draft_probs.dim() != 3 or draft_probs.shape[1] != depth or draft_probs.shape[2] != vocab:
        raise ValueError(f"specadapt GBV: draft_probs must be [B, L, V] = [{batch}, {depth}, {vocab}], got "
                         f"{tuple(draft_probs.shape)}")
    path_nodes = torch.cat([torch.zeros(batch, k, 1, dtype=torch.int64, device=nodes.device), nodes], dim=2)
    flat = path_nodes.reshape(batch, -1)
    tokens = candidates.to(torch.int64).gather(1, flat).reshape(batch, k, depth + 1)
    target = target_probs.gather(1, flat[..., None].expand(-1, -1, vocab)).reshape(batch, k, depth + 1, vocab)
    q_first = draft_probs[:, 0].float()[:, None, None, :].expand(batch, k, 1, vocab)
    if depth > 1:
        deeper = drafting.rows_for(batch).reshape(depth - 1, batch, k, vocab)  # [L-1, B, K(branch), V]
        index = branch[None, :, :, None].expand(depth - 1, -1, -1, vocab)
        deeper = deeper.gather(2, index).permute(1, 2, 0, 3)  # [B, K(path), L-1, V]
        q = torch.cat([q_first, deeper.to(q_first.dtype)], dim=2)
    else:
        q = q_first.contiguous()
    # a greedy request's drafts need not be samples of q (its target law is one-hot, so any proposal is exact),
    # and a top-K draft can underflow to q = 0; keep the q of every token drafted at a depth positive in every
    # path's row of that depth (paths with a common prefix share rows; a sampled token has q > 0 already)
    drafted = tokens[:, :, 1:].transpose(1, 2)[:, None].expand(batch, k, depth, k)  # [B, K, L, K tokens]
    q = q.contiguous().scatter(-1, drafted, q.gather(-1, drafted).clamp_min(torch.finfo(q.dtype).tiny))
    coins = uniform_samples[:, :depth].float()
    final = uniform_samples_for_final_sampling.reshape(-1).float()
    caps_host = None if caps is None else caps.to("cpu", torch.int64)  # adaptive verification syncs anyway
    if caps_host is None or bool((caps_host >= depth).all()):
        out = kernels.verify_paths(rule, tokens, target.float(), q.contiguous(), coins, final, impl=impl)
    else:
        out = kernels.verify_paths_capped(rule, tokens, target.float(), q, coins, final, caps_host, impl=impl)
    chosen = out.chosen_path.to(torch.int64).contiguous()
    if broadcast is not None:  # SGLang broadcasts rank 0's accepted tokens after the sampler; keep its path too
        broadcast(chosen)
    chosen_nodes = path_nodes.gather(1, chosen[:, None, None].expand(-1, 1, depth + 1)).squeeze(1)
    global_ids = retrive_index.to(torch.int64).gather(1, chosen_nodes)
    scatter_sglang_outputs(out.accept_len, out.output_tokens, global_ids, predicts, accept_index, accept_token_num)
    chosen_q = q.gather(1, chosen[:, None, None, None].expand(-1, 1, depth, vocab)).squeeze(1)
    return GBVRound(out, chosen_nodes, chosen_q)
