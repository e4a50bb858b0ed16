"""Random verification inputs shared by the CPU and CUDA kernel tests (torch only: the GPU check machine has no
scipy). Probabilities are softmaxes of random logits with exact zeros, as top-k / top-p produce them."""

import torch


def random_batch(B, L, V, seed, dtype=torch.float32, sparse=True, K=None):
    """candidates [B, (K,) L+1] int64, p [B, (K,) L+1, V], q [B, (K,) L, V], uniforms [B, L], uniforms_final [B]."""
    g = torch.Generator().manual_seed(seed)
    lead = (B,) if K is None else (B, K)
    logits_p = torch.randn(*lead, L + 1, V, generator=g) * 2
    logits_q = logits_p[..., :L, :] + torch.randn(*lead, L, V, generator=g)
    if sparse:  # exact zeros as top-k produces them
        logits_p = logits_p.masked_fill(torch.rand(logits_p.shape, generator=g) < 0.3, float("-inf"))
        logits_q = logits_q.masked_fill(torch.rand(logits_q.shape, generator=g) < 0.3, float("-inf"))
        logits_p[..., 0] = 0.0
        logits_q[..., 0] = 0.0
    p = torch.softmax(logits_p, -1).to(dtype)
    q = torch.softmax(logits_q, -1).to(dtype)
    drafts = torch.multinomial(q.float().reshape(-1, V), 1, generator=g).reshape(*lead, L)
    cand = torch.cat([torch.randint(0, V, (*lead, 1), generator=g), drafts], dim=-1)
    u = torch.rand(B, L, generator=g, dtype=torch.float64)
    uf = torch.rand(B, generator=g, dtype=torch.float64)
    return cand, p, q, u, uf


def tree_batch(B, K, L, V, seed, dtype):
    """K paths per request drawn from q as a tree: paths that share a prefix share the p / q rows below it."""
    cand, p, q, u, uf = random_batch(B, L, V, seed, torch.float32, K=K)
    g = torch.Generator().manual_seed(seed + 1)
    for b in range(B):
        for k in range(K):
            for d in range(L):
                prefix = cand[b, k, 1 : d + 1].tolist()
                twin = next((j for j in range(k) if cand[b, j, 1 : d + 1].tolist() == prefix), None)
                if twin is not None:
                    p[b, k, d] = p[b, twin, d]
                    q[b, k, d] = q[b, twin, d]
                else:  # a peaked q puts most mass on few tokens, so paths often merge
                    q[b, k, d] = q[b, k, d] ** 3 / (q[b, k, d] ** 3).sum()
                cand[b, k, d + 1] = int(torch.multinomial(q[b, k, d], 1, generator=g))
            prefix = cand[b, k, 1:].tolist()
            twin = next((j for j in range(k) if cand[b, j, 1:].tolist() == prefix), None)
            if twin is not None:
                p[b, k, L] = p[b, twin, L]
    return cand, p.to(dtype), q.to(dtype), u, uf
