"""Acceptance estimator (IRLS) and the exactness argument for pruning on logit(q_max)."""

import math

import numpy as np
import pytest
import torch

from specadapt.estimator import (
    AcceptanceEstimator,
    draft_confidence_feature,
    irls_accumulate_reference,
    irls_labels,
    irls_solve,
)
from specadapt.verification import chain_round_law


def test_feature_is_logit_of_qmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0], [5.0, 4.9, -3.0, 0.0]])
    for t in (0.5, 1.0, 2.0):
        q = torch.softmax(logits.double() / t, -1)
        qmax = q.max(-1).values
        want = torch.log(qmax / (1 - qmax))
        torch.testing.assert_close(draft_confidence_feature(logits, t).double(), want, atol=1e-5, rtol=1e-5)


def test_feature_is_stable_and_clamped():
    from specadapt.estimator.features import FEATURE_CLAMP

    assert FEATURE_CLAMP == 8.0
    f = draft_confidence_feature(torch.tensor([[100.0, 0.0, 0.0], [0.0, -5.0, -5.0], [0.0, -9.0, -9.0]]), 1.0)
    assert float(f[0]) == FEATURE_CLAMP  # q_max rounds to 1 in float32; the stable form still gives a finite value
    assert math.isclose(float(f[1]), 5 - math.log(2), rel_tol=1e-5)
    assert float(f[2]) == FEATURE_CLAMP  # 9 - log 2 = 8.3: clamped
    assert draft_confidence_feature(torch.tensor([[0.0, 100.0, 0.0]]), 1.0).tolist() == [FEATURE_CLAMP]
    assert draft_confidence_feature(torch.tensor([[-100.0, 0.0], [0.0, 0.0]]), 1.0)[1].item() == 0.0
    assert draft_confidence_feature(torch.tensor([[1.0, 2.0]]), 0.0).tolist() == [FEATURE_CLAMP]
    assert torch.isnan(draft_confidence_feature(torch.tensor([[float("nan"), 1.0]]), 0.0)).all()
    with pytest.raises(ValueError, match="temperature"):
        draft_confidence_feature(torch.zeros(1, 3), -1.0)


def test_labels_up_to_and_including_the_first_rejection():
    y, m = irls_labels(torch.tensor([0, 2, 3, 1]), torch.tensor([3, 3, 3, 1]), 3)
    assert m.tolist() == [[True, False, False], [True, True, True], [True, True, True], [True, False, False]]
    assert y[m].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def _simulate(slope, intercepts, steps, batch, estimator, gen):
    K = len(intercepts)
    for _ in range(steps):
        f = torch.randn(batch, K, generator=gen, dtype=torch.float64) * 1.5
        true_p = torch.sigmoid(slope * f + torch.tensor(intercepts))
        accept = torch.rand(batch, K, generator=gen, dtype=torch.float64) < true_p
        accepted = accept.to(torch.int64).cumprod(1).sum(1)
        pred = estimator.predict(f)
        estimator.observe(f, pred, accepted, torch.full((batch,), K))


def test_recovers_known_slope_and_intercepts():
    est = AcceptanceEstimator(3, refit_interval=50)
    _simulate(0.7, [0.8, 0.0, -0.8], 600, 64, est, torch.Generator().manual_seed(0))
    assert est.refits == 12
    assert abs(est.slope - 0.7) < 0.08
    np.testing.assert_allclose(est.intercepts.numpy(), [0.8, 0.0, -0.8], atol=0.15)


def test_position_without_labels_keeps_its_intercept():
    est = AcceptanceEstimator(4, init_intercept=-0.2, refit_interval=5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):  # only 2 of 4 positions are ever verified
        f = torch.randn(32, 2, generator=gen, dtype=torch.float64)
        est.observe(f, est.predict(f), torch.randint(0, 3, (32,), generator=gen), torch.full((32,), 2))
    assert est.intercepts[2:].tolist() == [-0.2, -0.2]
    assert est.intercepts[:2].tolist() != [-0.2, -0.2]


def test_damping_scales_steps_by_evidence():
    g = torch.Generator().manual_seed(2)
    f = torch.randn(40, 1, generator=g, dtype=torch.float64)
    p = torch.full((40, 1), 0.4, dtype=torch.float64)
    stats = irls_accumulate_reference(f, p, torch.randint(0, 2, (40,), generator=g), torch.ones(40, dtype=torch.int64))
    n = float(stats[:, 5].sum())
    inf = float("inf")  # no trust region: the damping alone
    s0, b0 = irls_solve(stats, 0.5, torch.zeros(1), damping=0.0, max_step=inf)
    s50, _ = irls_solve(stats, 0.5, torch.zeros(1), damping=50.0, max_step=inf)
    assert (s50 - 0.5) == pytest.approx((s0 - 0.5) * n / (n + 50), rel=1e-12)
    # intercept step: (g1 - b * d_slope) / c~ * n_k / (n_k + D)
    _, b50 = irls_solve(stats, 0.5, torch.zeros(1), damping=50.0, max_step=inf)
    a, b, c, g0, g1, nk = stats[0].tolist()
    want = (g1 - b * (s50 - 0.5)) / (c + 1e-3) * nk / (nk + 50)
    assert float(b50[0]) == pytest.approx(want, rel=1e-12)


def test_nan_never_reaches_the_coefficients():
    gen = torch.Generator().manual_seed(3)
    f = torch.randn(64, 3, generator=gen, dtype=torch.float64)
    acc = torch.randint(0, 4, (64,), generator=gen)
    ver = torch.full((64,), 3)
    clean = AcceptanceEstimator(3, refit_interval=1)
    dirty = AcceptanceEstimator(3, refit_interval=1)
    clean_f = f.clone()
    dirty_f = f.clone()
    dirty_f[::7, 1] = float("nan")
    clean_f[::7, 1] = 0.0  # the reference must simply skip these entries: compare with masked statistics
    stats_dirty = irls_accumulate_reference(dirty_f, dirty.predict(dirty_f), acc, ver)
    assert torch.isfinite(stats_dirty).all()
    dirty.observe(dirty_f, dirty.predict(dirty_f), acc, ver)
    assert math.isfinite(dirty.slope) and torch.isfinite(dirty.intercepts).all()
    nan_pred = dirty.predict(f)
    nan_pred[0, 0] = float("nan")
    dirty.observe(f, nan_pred, acc, ver)
    assert math.isfinite(dirty.slope) and torch.isfinite(dirty.intercepts).all()


def test_negative_slope_step_is_dropped():
    stats = torch.zeros(1, 6, dtype=torch.float64)
    stats[0] = torch.tensor([1.0, 0.0, 1.0, -100.0, 0.0, 10.0])  # a gradient pushing omega far below 0
    slope, _ = irls_solve(stats, 0.5, torch.zeros(1), max_step=float("inf"))
    assert slope == 0.5


def test_intercepts_use_the_slope_step_actually_taken():
    # b != 0 couples the two steps: when the slope step is dropped, the intercepts must take the step they would
    # take with d_slope = 0 (spec section 4 computes d_beta after the guard), not the one paired with the dropped
    # slope step.
    stats = torch.tensor([[4.0, 2.0, 1.5, -30.0, 0.3, 20.0], [2.0, -1.0, 1.0, -10.0, -0.2, 10.0]],
                         dtype=torch.float64)
    slope, beta = irls_solve(stats, 0.5, torch.zeros(2), damping=50.0, max_step=float("inf"))
    assert slope == 0.5
    a, b, c, g0, g1, n = stats.unbind(1)
    want = g1 / (c + 1e-3) * n / (n + 50)
    torch.testing.assert_close(beta, want, rtol=1e-12, atol=0)


def _first_token_law(p, q, prune):
    """Exact law of the first emitted token when draft x ~ q is pruned (target samples alone) iff prune(x)."""
    P = torch.tensor([p, p], dtype=torch.float64)
    Q = torch.tensor([q], dtype=torch.float64)
    out = np.zeros(len(p))
    for x in range(len(p)):
        if prune(x):
            out += q[x] * np.array(p)
            continue
        tau_probs, extra = chain_round_law(P, Q, torch.tensor([x]))
        law = float(tau_probs[1]) * np.eye(len(p))[x] + float(tau_probs[0]) * extra[0].numpy()
        out += q[x] * law
    return out


def test_pruning_on_the_sampled_token_is_biased_and_on_qmax_is_exact():
    p, q = [0.5, 0.5], [0.2, 0.8]
    biased = _first_token_law(p, q, prune=lambda x: q[x] < 0.5)
    np.testing.assert_allclose(biased, [0.4, 0.6], atol=1e-12)
    f = float(draft_confidence_feature(torch.tensor([q]).log(), 1.0))
    for threshold in (f - 1.0, f + 1.0):  # the decision depends on the prefix only: same for every x
        exact = _first_token_law(p, q, prune=lambda x: f < threshold)
        np.testing.assert_allclose(exact, p, atol=1e-12)


def test_fused_irls_accumulate_matches_reference():
    from specadapt import kernels  # noqa: F401  (registers the fake of specadapt::irls_accumulate for opcheck)
    from specadapt.estimator.irls import irls_accumulate

    gen = torch.Generator().manual_seed(5)
    for B, K in ((1, 1), (37, 5), (256, 8)):
        f = torch.randn(B, K, generator=gen) * 3
        p = torch.rand(B, K, generator=gen)
        f[::5, 0] = float("nan")
        acc = torch.randint(0, K + 1, (B,), generator=gen)
        ver = torch.clamp(acc + torch.randint(0, 2, (B,), generator=gen), max=K)
        ref = irls_accumulate_reference(f, p, acc, ver)
        got = irls_accumulate(f, p, acc, ver)
        assert got.dtype == torch.float64 and got.shape == (K, 6)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="predictions"):
        irls_accumulate(f, p[:, :2], acc, ver)
    with pytest.raises(ValueError, match="verified"):
        irls_accumulate(f, p, acc, ver[:3])
    torch.library.opcheck(torch.ops.specadapt.irls_accumulate.default, (f, p, acc, ver),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_saturated_predictions_do_not_blow_up():
    """A one-hot draft (feature always 40) saturates predictions; the fit must stay bounded and move the
    intercept toward the observed acceptance rate (measured before the trust region: steps of -1e5)."""
    est = AcceptanceEstimator(1, refit_interval=1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(60):
        f = torch.full((64, 1), 40.0, dtype=torch.float64)
        accepted = (torch.rand(64, generator=gen) < 0.3).to(torch.int64)
        est.observe(f, est.predict(f), accepted, torch.ones(64, dtype=torch.int64))
    rate = float(est.predict(torch.full((1, 1), 40.0))[0, 0])
    assert abs(rate - 0.3) < 0.1
    assert abs(est.intercepts[0]) < 100


def test_refit_of_an_empty_window_keeps_the_fit_without_solving(monkeypatch):
    """Rounds that verified nothing (speculation off) still step the refit schedule; a window holding no
    statistics leaves the fit as the solve would (its Newton step is 0) without calling it, and a window with data
    after it is solved as before."""
    import specadapt.estimator.estimator as module

    solves = []

    def counting_solve(*args):
        solves.append(args[0].clone())
        return irls_solve(*args)

    monkeypatch.setattr(module, "irls_solve", counting_solve)
    est = AcceptanceEstimator(3, init_slope=0.9, init_intercept=0.3, refit_interval=4)
    slope, intercepts = est.slope, est.intercepts.clone()
    solved = irls_solve(torch.zeros(3, 6, dtype=torch.float64), slope, intercepts)
    assert solved[0] == slope and torch.equal(solved[1], intercepts)  # what skipping it relies on
    for _ in range(8):
        est.observe_nothing()
    assert est.refits == 2 and solves == []
    assert est.slope == slope and torch.equal(est.intercepts, intercepts)
    gen = torch.Generator().manual_seed(3)
    f = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    est.observe(f, est.predict(f), torch.randint(0, 4, (16,), generator=gen), torch.full((16,), 3))
    for _ in range(3):
        est.observe_nothing()
    assert est.refits == 3 and len(solves) == 1 and float(solves[0][:, 5].sum()) > 0
    assert (est.slope, est.intercepts.tolist()) != (slope, intercepts.tolist())
    for _ in range(4):  # the window after it is empty again
        est.observe_nothing()
    assert est.refits == 4 and len(solves) == 1
