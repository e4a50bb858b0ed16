"""Bad input and numerics of the verification rules (docs/design/specs/verification.md section 5)."""

import pytest
import torch

from specadapt.verification import VERIFY_RULES, sample_from_unnormalized

RULES = sorted(VERIFY_RULES)


def _batch(B=2, L=3, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    cand = torch.randint(0, V, (B, L + 1), generator=g)
    p = torch.softmax(torch.randn(B, L + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, L, V, generator=g), -1)
    u = torch.rand(B, L, generator=g)
    uf = torch.rand(B, generator=g)
    return cand, p, q, u, uf


@pytest.mark.parametrize("rule", RULES)
def test_output_layout(rule):
    cand, p, q, u, uf = _batch()
    out = VERIFY_RULES[rule](cand, p, q, u, uf)
    assert out.accept_len.dtype == torch.int32 and out.output_tokens.dtype == torch.int32
    assert out.output_tokens.shape == (2, 4)
    for b in range(2):
        tau = int(out.accept_len[b])
        assert out.output_tokens[b, :tau].tolist() == cand[b, 1 : tau + 1].tolist()
        assert 0 <= int(out.output_tokens[b, tau]) < 6
        assert (out.output_tokens[b, tau + 1 :] == -1).all()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda a: a.__setitem__(0, a[0][:, :2]), "from candidates"),
        (lambda a: a.__setitem__(1, a[1][:, :, :4]), "draft_probs"),
        (lambda a: a.__setitem__(2, a[2][:, :2]), "draft_probs"),
        (lambda a: a.__setitem__(3, a[3][:, :2]), "uniforms"),
        (lambda a: a.__setitem__(4, a[4][:1]), "uniforms_final"),
        (lambda a: a.__setitem__(0, a[0].float()), "candidates"),
        (lambda a: a.__setitem__(1, a[1].to(torch.int64)), "target_probs"),
        (lambda a: a[0].__setitem__((0, 1), 6), "outside"),
        (lambda a: a[0].__setitem__((1, 2), -1), "outside"),
        (lambda a: a[3].__setitem__((0, 0), 1.0), "uniforms"),
        (lambda a: a[4].__setitem__(0, -0.1), "uniforms_final"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(rule, mutate, needle):
    args = list(_batch())
    mutate(args)
    with pytest.raises(ValueError, match=needle):
        VERIFY_RULES[rule](*args)


@pytest.mark.parametrize("rule", RULES)
def test_not_a_tensor(rule):
    cand, p, q, u, uf = _batch()
    with pytest.raises(TypeError, match="uniforms"):
        VERIFY_RULES[rule](cand, p, q, u.tolist(), uf)


@pytest.mark.parametrize("rule", RULES)
def test_bad_num_draft_tokens(rule):
    args = _batch()
    with pytest.raises(ValueError, match="num_draft_tokens"):
        VERIFY_RULES[rule](*args, num_draft_tokens=torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        VERIFY_RULES[rule](*args, num_draft_tokens=torch.tensor([1.0, 1.0]))


@pytest.mark.parametrize("rule", RULES)
def test_nan_in_target_is_an_error_in_debug_and_zero_otherwise(rule):
    cand, p, q, u, uf = _batch()
    p[0, 1, 3] = 0.0
    p[0, 1] /= p[0, 1].sum()  # the row without the NaN entry still sums to 1 (rows must: common.check_row_sums)
    p[0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="target_probs"):
        VERIFY_RULES[rule](cand, p, q, u, uf, debug=True)
    out = VERIFY_RULES[rule](cand, p, q, u, uf)
    assert (out.output_tokens[out.output_tokens >= 0] != -1).all()
    tau = int(out.accept_len[0])
    if tau == 1:  # the extra token came from the row with the NaN: it has zero mass there
        assert int(out.output_tokens[0, 1]) != 3


@pytest.mark.parametrize("rule", RULES)
def test_nan_inf_negative_in_draft_are_zero(rule):
    cand, p, q, u, uf = _batch(B=1, L=1, V=4)
    cand[0, 1] = 2
    q_bad = q.clone()
    q_bad[0, 0] = torch.tensor([float("nan"), float("inf"), -1.0, 1.0])
    q_clean = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]])  # cleaned, the row sums to 1 (as rows must)
    a = VERIFY_RULES[rule](cand, p, q_bad, u, uf)
    b = VERIFY_RULES[rule](cand, p, q_clean, u, uf)
    assert torch.equal(a.output_tokens, b.output_tokens)


@pytest.mark.parametrize("rule", RULES)
def test_zero_draft_prob_on_drafted_token(rule):
    """q(X) = 0 on the drafted token: accept whatever the coin if p(X) > 0, reject whatever the coin if p(X) = 0."""
    q = torch.tensor([[[0.0, 0.0, 1.0]]])
    p_pos = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    out = VERIFY_RULES[rule](torch.tensor([[0, 0]]), p_pos, q, torch.tensor([[0.999]]), torch.tensor([0.3]))
    assert int(out.accept_len[0]) == 1
    p_zero = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]]])
    out = VERIFY_RULES[rule](torch.tensor([[0, 0]]), p_zero, q, torch.tensor([[0.0]]), torch.tensor([0.3]))
    assert int(out.accept_len[0]) == 0
    assert int(out.output_tokens[0, 0]) in (1, 2)


@pytest.mark.parametrize("rule", RULES)
def test_zero_mass_residual_falls_back_to_p(rule):
    """p == q and a rejection forced by a coin: the residual has no mass; the extra token comes from p."""
    p = torch.tensor([[[0.25, 0.25, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]]])
    q = p[:, :1].clone()
    cand = torch.tensor([[0, 2]])
    # With p == q every draft is accepted (ratio 1), so the residual is only reached by rounding; test the sampler.
    res = torch.zeros(1, 4, dtype=torch.float64)
    tok = sample_from_unnormalized(res, p[0, :1].double(), torch.tensor([0.6], dtype=torch.float64))
    assert int(tok) == 2  # inverse CDF of p at 0.6: cumsum 0.25, 0.5, 1.0 -> index 2
    out = VERIFY_RULES[rule](cand, p, q, torch.tensor([[0.5]]), torch.tensor([0.99]))
    assert int(out.accept_len[0]) == 1


def test_inverse_cdf_never_picks_zero_mass_tokens():
    w = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]], dtype=torch.float64)
    for u in torch.linspace(0, 1 - 1e-12, 101, dtype=torch.float64):
        assert int(sample_from_unnormalized(w, w, u[None])) in (1, 3)
    assert int(sample_from_unnormalized(w, w, torch.tensor([1 - 1e-16], dtype=torch.float64))) == 3


def test_zero_mass_target_row_is_an_error():
    with pytest.raises(ValueError, match="target_probs"):
        z = torch.zeros(1, 3, dtype=torch.float64)
        sample_from_unnormalized(z, z, torch.tensor([0.5], dtype=torch.float64))


@pytest.mark.parametrize("rule", RULES)
def test_greedy_reduces_to_argmax_matching(rule):
    """One-hot p and q (temperature 0): accept while the draft equals the target argmax, then emit the argmax."""
    V, L = 7, 4
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        target_argmax = torch.randint(0, V, (L + 1,), generator=g)
        drafts = target_argmax[:L].clone()
        cut = int(torch.randint(0, L + 1, (1,), generator=g))
        if cut < L:
            drafts[cut] = (drafts[cut] + 1) % V
        p = torch.nn.functional.one_hot(target_argmax, V).float()[None]
        q = torch.nn.functional.one_hot(drafts, V).float()[None]
        cand = torch.cat([torch.tensor([0]), drafts])[None]
        out = VERIFY_RULES[rule](cand, p, q, torch.rand(1, L, generator=g), torch.rand(1, generator=g))
        assert int(out.accept_len[0]) == cut
        assert out.output_tokens[0, : cut + 1].tolist() == target_argmax[: cut + 1].tolist()


@pytest.mark.parametrize("rule", RULES)
def test_ragged_rows_equal_truncated_calls(rule):
    """A row with num_draft_tokens = k behaves exactly as a call with L = k on that row."""
    cand, p, q, u, uf = _batch(B=3, L=4, V=5, seed=9)
    n = torch.tensor([4, 2, 0])
    out = VERIFY_RULES[rule](cand, p, q, u, uf, num_draft_tokens=n)
    for b, k in enumerate(n.tolist()):
        ref = VERIFY_RULES[rule](cand[b : b + 1, : k + 1], p[b : b + 1, : k + 1], q[b : b + 1, :k],
                                 u[b : b + 1, :k], uf[b : b + 1])
        assert int(out.accept_len[b]) == int(ref.accept_len[0])
        assert out.output_tokens[b, : k + 1].tolist() == ref.output_tokens[0].tolist()
