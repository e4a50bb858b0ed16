"""Losslessness and the known values of greedy multi-path block verification (GBV)."""

import itertools

import numpy as np
import pytest
import torch

from tests.helpers.exact_law import RandomTables, gbv_law, gbv_outcomes, single_path_outcomes, target_joint
from specadapt.verification import block_round_law, block_verify
from specadapt.verification.gbv import gbv_select, gbv_verify, power_sum

# (V, L, K): every K-tuple of paths is enumerated in every round, so sizes stay small.
CASES = [(3, 1, 1), (3, 1, 2), (3, 1, 3), (3, 1, 4), (4, 1, 3), (6, 1, 2), (3, 2, 2), (3, 2, 3), (2, 3, 2),
         (2, 2, 4)]


@pytest.mark.parametrize("vocab,num_drafts,num_paths", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gbv_output_law_equals_target_joint(vocab, num_drafts, num_paths, seed):
    tables = RandomTables(vocab, seed=seed)
    n = num_drafts + 1
    law = gbv_law(tables, num_paths, num_drafts, n)
    np.testing.assert_allclose(law, target_joint(tables, n), atol=1e-12, rtol=0)


def test_gbv_oracle_detects_a_walk_that_disagrees_with_the_ranking(monkeypatch):
    """The walk must follow the LARGEST key of the order used for c_u; following the smallest is lossy."""
    from specadapt.verification import gbv as gbv_module

    monkeypatch.setattr(gbv_module, "_choose_child", lambda children, rank: int(children[rank[children].argmin()]))
    errors = [np.abs(gbv_law(RandomTables(3, seed=s), 2, 1, 2) - target_joint(RandomTables(3, seed=s), 2)).max()
              for s in range(3)]
    assert max(errors) > 1e-3


def test_toy_values():
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    for k, (qg_expected, accept) in {1: ((2 / 3, 1 / 3), 2 / 3), 2: ((4 / 9, 5 / 9), 8 / 9)}.items():
        total_accept = 0.0
        for combo in itertools.product(range(2), repeat=k):
            weight = float(np.prod([q[x] for x in combo]))
            drafts = torch.tensor(combo).reshape(k, 1)
            chosen, q_g = gbv_select(drafts, p.repeat(k, 2, 1), q.repeat(k, 1, 1))
            np.testing.assert_allclose(q_g[0].numpy(), qg_expected, atol=1e-15)
            tau_probs, _ = block_round_law(p.repeat(2, 1), q_g, drafts[chosen])
            total_accept += weight * float(tau_probs[1])
        assert total_accept == pytest.approx(accept, abs=1e-12)


def test_power_sum():
    a, b = torch.tensor([0.7, 1.0, 0.3]), torch.tensor([0.2, 0.0, 0.3])
    for k in range(1, 5):
        want = torch.where(a != b, (a**k - b**k) / (a - b), k * a ** (k - 1))
        torch.testing.assert_close(power_sum(a, b, k), want)


def _expected_tau(outcomes):
    return sum(w * (len(e) - 1) for e, w in outcomes.items())


def test_gbv_at_least_block_on_average():
    gains = []
    for seed in range(8):
        tables = RandomTables(3, seed=200 + seed, zero_fraction=0.0)
        block = _expected_tau(single_path_outcomes(tables, block_round_law, 2))
        gbv = _expected_tau(gbv_outcomes(tables, 3, 2))
        gains.append(gbv - block)
    assert np.mean(gains) > 0


def test_k1_equals_block_verification_for_the_same_coins():
    g = torch.Generator().manual_seed(0)
    B, L, V = 64, 3, 7
    cand = torch.randint(0, V, (B, 1, L + 1), generator=g)
    P = torch.softmax(torch.randn(B, 1, L + 1, V, generator=g), -1)
    Q = torch.softmax(torch.randn(B, 1, L, V, generator=g), -1)
    u, uf = torch.rand(B, L, generator=g), torch.rand(B, generator=g)
    a = gbv_verify(cand, P, Q, u, uf)
    b = block_verify(cand[:, 0], P[:, 0], Q[:, 0], u, uf)
    assert torch.equal(a.accept_len, b.accept_len) and torch.equal(a.output_tokens, b.output_tokens)
    assert (a.chosen_path == 0).all()


def test_gbv_shapes_and_errors():
    g = torch.Generator().manual_seed(1)
    B, K, L, V = 2, 3, 2, 5
    cand = torch.randint(0, V, (B, K, L + 1), generator=g)
    P = torch.softmax(torch.randn(B, K, L + 1, V, generator=g), -1)
    Q = torch.softmax(torch.randn(B, K, L, V, generator=g), -1)
    u, uf = torch.rand(B, L, generator=g), torch.rand(B, generator=g)
    out = gbv_verify(cand, P, Q, u, uf)
    assert out.output_tokens.shape == (B, L + 1) and out.chosen_path.dtype == torch.int32
    for b in range(B):
        tau = int(out.accept_len[b])
        assert out.output_tokens[b, :tau].tolist() == cand[b, int(out.chosen_path[b]), 1 : tau + 1].tolist()
    with pytest.raises(ValueError, match="candidates"):
        gbv_verify(cand[:, 0], P, Q, u, uf)
    with pytest.raises(ValueError, match="uniforms"):
        gbv_verify(cand, P, Q, u[:, :1], uf)
    bad = cand.clone()
    bad[0, 1, 1] = V
    with pytest.raises(ValueError, match="outside"):
        gbv_verify(bad, P, Q, u, uf)
    Q0 = Q.clone()
    Q0[:, :, 0, :] = 0.0
    Q0[:, :, 0, 0] = 1.0
    cand0 = cand.clone()
    cand0[:, :, 1] = 3
    with pytest.raises(ValueError, match="draft_probs"):
        gbv_verify(cand0, P, Q0, u, uf)
