"""Losslessness of chain and block verification (docs/design/specs/verification.md section 6).

Exact: the law of the first L+1 emitted tokens, enumerated over every draft path with the coins integrated out,
equals the target's joint law to 1e-12 in float64. Statistical: the coin-driven batch functions reproduce the
exact one-round law (chi-square). Toy values: E[tau] = 10/9 (chain) and 11/9 (block).
"""

import itertools

import numpy as np
import pytest
import torch

from tests.helpers.exact_law import RandomTables, chi_square_pvalue, sample_path_batch, single_path_outcomes, speculative_law, target_joint
from specadapt.verification import ROUND_LAWS, VERIFY_RULES, block_round_law, chain_round_law

CASES = [(3, 1), (3, 2), (3, 3), (4, 2), (5, 1), (6, 1)]


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("vocab,num_drafts", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_output_law_equals_target_joint(rule, vocab, num_drafts, seed):
    tables = RandomTables(vocab, seed=seed)
    n = num_drafts + 1
    law = speculative_law(tables, ROUND_LAWS[rule], num_drafts, n)
    joint = target_joint(tables, n)
    assert law.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(law, joint, atol=1e-12, rtol=0)


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_oracle_detects_a_lossy_rule(rule):
    """The oracle must be able to fail: a rule that skips the residual (resamples from p) is biased."""
    tables = RandomTables(3, seed=3, zero_fraction=0.0)

    def lossy(P, Q, drafts):
        tau_probs, _ = ROUND_LAWS[rule](P, Q, drafts)
        return tau_probs, P / P.sum(dim=1, keepdim=True)

    law = speculative_law(tables, lossy, 2, 3)
    assert np.abs(law - target_joint(tables, 3)).max() > 1e-3


def _toy_expected_tau(round_law, num_drafts=2):
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    total = 0.0
    for path in itertools.product(range(2), repeat=num_drafts):
        q_path = float(np.prod([q[x] for x in path]))
        tau_probs, _ = round_law(p.repeat(num_drafts + 1, 1), q.repeat(num_drafts, 1), torch.tensor(path))
        total += q_path * float((tau_probs * torch.arange(num_drafts + 1)).sum())
    return total


def test_toy_values():
    assert _toy_expected_tau(chain_round_law) == pytest.approx(10 / 9, abs=1e-12)
    assert _toy_expected_tau(block_round_law) == pytest.approx(11 / 9, abs=1e-12)


def _expected_tau(tables, round_law, num_drafts):
    total = 0.0
    for path in itertools.product(range(tables.vocab), repeat=num_drafts):
        q_path = float(np.prod([tables.q(path[:i])[x] for i, x in enumerate(path)]))
        if q_path == 0:
            continue
        P = torch.tensor(np.stack([tables.p(path[:i]) for i in range(num_drafts + 1)]))
        Q = torch.tensor(np.stack([tables.q(path[:i]) for i in range(num_drafts)]))
        tau_probs, _ = round_law(P, Q, torch.tensor(path))
        total += q_path * float((tau_probs * torch.arange(num_drafts + 1)).sum())
    return total


def test_block_never_worse_than_chain_on_average():
    gaps = []
    for seed in range(12):
        tables = RandomTables(4, seed=100 + seed)
        gaps.append(_expected_tau(tables, block_round_law, 3) - _expected_tau(tables, chain_round_law, 3))
    assert min(gaps) > -1e-12
    assert np.mean(gaps) > 0


@pytest.mark.parametrize("rule", ["chain", "block"])
def test_coin_driven_batch_matches_exact_round_law(rule):
    """Monte Carlo (200k rounds, fixed seed) of the batch function against the exact one-round law."""
    tables = RandomTables(4, seed=7)
    num_drafts, batch = 2, 200_000
    gen = torch.Generator().manual_seed(1234)
    cand, P, Q = (t[:, 0] for t in sample_path_batch(tables, num_drafts, 1, batch, seed=1234))
    out = VERIFY_RULES[rule](
        cand, P, Q, torch.rand(batch, num_drafts, generator=gen, dtype=torch.float64),
        torch.rand(batch, generator=gen, dtype=torch.float64),
    )
    # float32 inputs: compare against the law computed from the same float32-rounded tables.
    exact = single_path_outcomes(tables, ROUND_LAWS[rule], num_drafts)
    pvalue = chi_square_pvalue(out.output_tokens, out.accept_len, exact, batch)
    assert pvalue > 1e-4, f"chi-square p-value {pvalue:.2e}"


def _thresholds(rule, P, Q, path):
    """Per-position pass thresholds on the coins: min(1, p/q) for chain, h_i for block."""
    from specadapt.verification.block import block_weights_and_thresholds
    from specadapt.verification.chain import chain_acceptance
    from specadapt.verification.common import check_inputs

    L = len(path)
    inputs = check_inputs(torch.tensor([[0, *path]]), P[None], Q[None], torch.zeros(1, L), torch.zeros(1))
    if rule == "chain":
        return chain_acceptance(inputs)[0]
    return block_weights_and_thresholds(inputs)[1][0]


@pytest.mark.parametrize("rule", ["chain", "block"])
@pytest.mark.parametrize("seed", range(5))
def test_coin_thresholds_decide_tau_exactly(rule, seed):
    """Coins just below / above the analytic thresholds give exactly the tau the rule prescribes."""
    tables = RandomTables(5, seed=20 + seed, zero_fraction=0.0)
    path = (seed % 5, (seed * 3 + 1) % 5, (seed + 2) % 5)
    L = len(path)
    P = torch.tensor(np.stack([tables.p(path[:i]) for i in range(L + 1)]))
    Q = torch.tensor(np.stack([tables.q(path[:i]) for i in range(L)]))
    h = _thresholds(rule, P, Q, path)
    cand = torch.tensor([[0, *path]])
    checked = 0
    for want in range(L + 1):
        coins = torch.zeros(1, L, dtype=torch.float64)
        # chain: coins 1..want pass and coin want+1 fails (later coins are never read);
        # block: coin `want` passes (if want > 0) and every later coin fails.
        must = {i: (i < want) for i in range(min(want + 1, L))} if rule == "chain" else {
            i: (i == want - 1) for i in range(max(want - 1, 0), L)
        }
        for i, passes in must.items():
            coins[0, i] = max(float(h[i]) - 1e-9, 0.0) if passes else min(float(h[i]) + 1e-9, 1 - 1e-12)
        if not all(bool(coins[0, i] < h[i]) == passes for i, passes in must.items()):
            continue
        out = VERIFY_RULES[rule](cand, P[None], Q[None], coins, torch.zeros(1, dtype=torch.float64))
        assert int(out.accept_len[0]) == want
        assert out.output_tokens[0, :want].tolist() == list(path[:want])
        checked += 1
    assert checked >= 1
