"""One contract for the float64 references and the compiled kernels (issue 19, items 3-5 and 7): padded draft ids,
GBV shape checks, row sums of p and q, dtype / slot-0 / V = 0 checks."""

import pytest
import torch

from tests.helpers.batches import random_batch, tree_batch
from specadapt import kernels
from specadapt.verification import VERIFY_RULES
from specadapt.verification.gbv import gbv_verify as gbv_reference

RULES = sorted(VERIFY_RULES)
needs_compiled = pytest.mark.skipif(not kernels.has_op_for("chain_verify", torch.device("cpu")),
                                    reason="specadapt._C is not built")


# ---- item 3: padded (-1) draft ids past num_draft_tokens ------------------------------------------------------
def _padded_batch(seed=0):
    cand, p, q, u, uf = random_batch(4, 3, 9, seed)
    n = torch.tensor([3, 1, 0, 2])
    for b, k in enumerate(n.tolist()):
        cand[b, k + 1 :] = -1  # padding, as ragged batches and SGLang's layout write it
    return cand, p, q, u, uf, n


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_reference_ignores_padded_draft_ids_past_num_draft_tokens(rule, dtype):
    cand, p, q, u, uf, n = _padded_batch()
    out = VERIFY_RULES[rule](cand, p.to(dtype), q.to(dtype), u, uf, num_draft_tokens=n)
    for b, k in enumerate(n.tolist()):  # each row equals the call truncated to its own drafts
        ref = VERIFY_RULES[rule](cand[b : b + 1, : k + 1], p[b : b + 1, : k + 1].to(dtype),
                                 q[b : b + 1, :k].to(dtype), u[b : b + 1, :k], uf[b : b + 1])
        assert int(out.accept_len[b]) == int(ref.accept_len[0])
        assert out.output_tokens[b, : k + 1].tolist() == ref.output_tokens[0].tolist()
        assert (out.output_tokens[b, k + 1 :] == -1).all()
    auto = kernels.verify(rule, cand, p.to(dtype), q.to(dtype), u, uf, n, impl="auto")  # float64/16: the reference
    assert torch.equal(auto.output_tokens, out.output_tokens)


@needs_compiled
@pytest.mark.parametrize("rule", RULES)
def test_padded_draft_ids_give_the_same_tokens_in_reference_and_compiled_kernel(rule):
    cand, p, q, u, uf, n = _padded_batch(3)
    ref = VERIFY_RULES[rule](cand, p, q, u, uf, num_draft_tokens=n)
    got = kernels.verify(rule, cand, p, q, u, uf, n, impl="compiled")
    assert torch.equal(ref.accept_len, got.accept_len) and torch.equal(ref.output_tokens, got.output_tokens)
    live_bad = cand.clone()
    live_bad[1, 1] = -1  # a LIVE slot with a padding id still raises in both
    for impl in ("reference", "compiled"):
        with pytest.raises(ValueError, match="outside"):
            kernels.verify(rule, live_bad, p, q, u, uf, n, impl=impl)


# ---- item 4: GBV shape checks before any reshape ---------------------------------------------------------------
def _gbv_batch(B=3, K=2, L=2, V=7, seed=0):
    return tree_batch(B, K, L, V, seed, torch.float32)


def _gbv_shape_cases():
    cand, p, q, u, uf = _gbv_batch()
    B, K = cand.shape[:2]
    return [
        ((cand, p[:, :1], q, u, uf), "target_probs"),  # wrong K in target_probs
        ((cand, p.transpose(0, 1).contiguous(), q, u, uf), "target_probs"),  # [K, B, ...]: same B x K
        ((cand, p, q.transpose(0, 1).contiguous(), u, uf), "draft_probs"),
        ((cand, p, q[:, :, :1], u, uf), "draft_probs"),
        ((cand, p, q[..., :5], u, uf), "draft_probs"),
        ((cand, p[..., :0], q[..., :0], u, uf), "target_probs"),  # V = 0
        ((cand, p, q, u, uf.repeat(K)), "uniforms_final"),
        ((cand, p, q, u.repeat(K, 1), uf), "uniforms"),
        ((cand[:, :, 0], p, q, u, uf), "candidates"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_gbv_reference_checks_shapes_naming_the_argument(case):
    args, needle = _gbv_shape_cases()[case]
    pattern = f"^{needle} must"  # the shape message, not a later error that happens to name the argument
    with pytest.raises(ValueError, match=pattern):
        gbv_reference(*args)
    if kernels.has_op_for("gbv_verify", torch.device("cpu")):
        with pytest.raises(ValueError, match=pattern):
            kernels.gbv_verify(*args, impl="compiled")


# ---- item 7: dtype match, slot-0 ids, V = 0 --------------------------------------------------------------------
@pytest.mark.parametrize("rule", RULES + ["gbv"])
@pytest.mark.parametrize("impl", ["reference", "compiled"])
def test_draft_probs_of_another_dtype_are_refused_by_every_implementation(rule, impl):
    if impl == "compiled" and not kernels.has_op_for("chain_verify", torch.device("cpu")):
        pytest.skip("specadapt._C is not built")
    if rule == "gbv":
        cand, p, q, u, uf = _gbv_batch()
        call = lambda q_: kernels.gbv_verify(cand, p, q_, u, uf, impl=impl)  # noqa: E731
    else:
        cand, p, q, u, uf = random_batch(3, 2, 7, 1)
        call = lambda q_: kernels.verify(rule, cand, p, q_, u, uf, impl=impl)  # noqa: E731
    call(q)
    for other in (torch.float64, torch.bfloat16):
        with pytest.raises(ValueError, match="draft_probs dtype must match target_probs"):
            call(q.to(other))


@pytest.mark.parametrize("rule", RULES + ["gbv"])
@pytest.mark.parametrize("impl", ["reference", "compiled"])
@pytest.mark.parametrize("bad", [-1, 7])
def test_out_of_range_id_in_slot_0_raises(rule, impl, bad):
    """Slot 0 (the last committed token) is an id like the drafts: outside [0, V) it raises, as the docs say."""
    if impl == "compiled" and not kernels.has_op_for("chain_verify", torch.device("cpu")):
        pytest.skip("specadapt._C is not built")
    if rule == "gbv":
        cand, p, q, u, uf = _gbv_batch(V=7)
        cand[1, :, 0] = bad
        call = lambda: kernels.gbv_verify(cand, p, q, u, uf, impl=impl)  # noqa: E731
    else:
        cand, p, q, u, uf = random_batch(3, 2, 7, 1)
        cand[1, 0] = bad
        call = lambda: kernels.verify(rule, cand, p, q, u, uf, impl=impl)  # noqa: E731
    with pytest.raises(ValueError, match="candidates holds token ids outside"):
        call()


@needs_compiled
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("L", [0, 2])
def test_empty_vocabulary_names_target_probs_in_every_implementation(rule, L):
    cand = torch.zeros(2, L + 1, dtype=torch.int64)
    p, q = torch.zeros(2, L + 1, 0), torch.zeros(2, L, 0)
    u, uf = torch.rand(2, L), torch.rand(2)
    for impl in ("reference", "compiled"):
        with pytest.raises(ValueError, match="^target_probs must have a vocabulary of V >= 1"):
            kernels.verify(rule, cand, p, q, u, uf, impl=impl)


# ---- item 5: rows of p and q must sum to 1 (within a stated tolerance) -----------------------------------------
def _compiled_impls():
    return ["reference"] + (["compiled"] if kernels.has_op_for("chain_verify", torch.device("cpu")) else [])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("impl", _compiled_impls())
def test_the_issue_example_is_refused_not_biased(rule, impl):
    """p = 2 x (0.5, 0.5), q = (0.9, 0.1), L = 1: the first token came out 0.899 / 0.101 instead of the target's
    0.5 / 0.5 in every implementation; now the row is refused, naming target_probs."""
    cand = torch.tensor([[0, 0]])
    p = torch.tensor([[[1.0, 1.0], [0.5, 0.5]]])
    q = torch.tensor([[[0.9, 0.1]]])
    with pytest.raises(ValueError, match=r"^target_probs row \(0, 0\) sums to 2"):
        kernels.verify(rule, cand, p, q, torch.tensor([[0.5]]), torch.tensor([0.5]), impl=impl)


def _off_row_cases(dtype):
    """(rows of p, rows of q, needle or None): each a single live row off by inside / outside the tolerance."""
    tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3
    inside, outside = 1.0 + 0.5 * tol, 1.0 + 2.0 * tol
    if dtype == torch.bfloat16:  # exactly representable: 1 + 2^-8 (inside 1e-2), 1 + 2^-6 (outside)
        inside, outside = 1.0 + 2.0 ** -8, 1.0 + 2.0 ** -6
    return [(0, None, inside, None), (0, None, outside, "target_probs"), (2, None, outside, "target_probs"),
            (None, 0, outside, "draft_probs"), (None, 1, 1.0 - 2.0 * tol, "draft_probs"),
            (None, 1, inside, None)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("impl", _compiled_impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", range(6))
def test_rows_off_by_more_than_the_tolerance_raise_in_every_implementation(rule, impl, dtype, case):
    if impl == "compiled" and dtype == torch.float64:
        pytest.skip("the compiled kernels take float32 / bfloat16")
    p_row, q_row, total, needle = _off_row_cases(dtype)[case]
    cand = torch.tensor([[0, 1, 2]])
    p = torch.full((1, 3, 4), 0.25, dtype=torch.float64)
    q = torch.full((1, 2, 4), 0.25, dtype=torch.float64)
    if p_row is not None:
        p[0, p_row, 3] = total - 0.75
    if q_row is not None:
        q[0, q_row, 3] = total - 0.75
    p, q = p.to(dtype), q.to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    row = p[0, p_row] if p_row is not None else q[0, q_row]
    off = abs(float(row.double().sum()) - 1.0)  # the case means what it says after rounding to dtype
    assert off <= 0.6 * tol if needle is None else off >= 1.5 * tol
    args = (cand, p, q, torch.tensor([[0.3, 0.6]]), torch.tensor([0.4]))
    if needle is None:
        kernels.verify(rule, *args, impl=impl)
    else:
        with pytest.raises(ValueError, match=f"^{needle} row"):
            kernels.verify(rule, *args, impl=impl)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("impl", _compiled_impls())
def test_rows_past_num_draft_tokens_are_not_checked(rule, impl):
    """Only the rows a request's output can depend on (p rows 0..n, q rows 0..n-1) must sum to 1; padding rows
    (zeros, as the engine and SGLang leave them) are never read."""
    cand, p, q, u, uf, n = _padded_batch(5)
    for b, k in enumerate(n.tolist()):
        p[b, k + 1 :] = 0.0
        q[b, k:] = 0.0
    ref = VERIFY_RULES[rule](cand, p, q, u, uf, num_draft_tokens=n)
    got = kernels.verify(rule, cand, p, q, u, uf, n, impl=impl)
    assert torch.equal(ref.output_tokens, got.output_tokens)
    p[1, 1, 0] += 0.5  # row 1 of request 1 (n = 1) is live
    with pytest.raises(ValueError, match=r"^target_probs row \(1, 1\)"):
        kernels.verify(rule, cand, p, q, u, uf, n, impl=impl)


@pytest.mark.parametrize("impl", _compiled_impls())
def test_gbv_refuses_off_rows_on_the_walked_path(impl):
    """GBV checks the rows its output depends on: the chosen path's p rows 0..L and the q rows of the walked
    nodes. The issue's example as a K = 2 tree, and an off row of a path the walk does not take (never read)."""
    cand = torch.tensor([[[0, 0], [0, 0]]])
    p = torch.tensor([[[1.0, 1.0], [0.5, 0.5]]]).expand(1, 2, 2, 2).contiguous()
    q = torch.tensor([[0.9, 0.1]]).expand(1, 2, 1, 2).contiguous()
    u, uf = torch.tensor([[0.5]]), torch.tensor([0.5])
    with pytest.raises(ValueError, match="^target_probs row"):
        kernels.gbv_verify(cand, p, q, u, uf, impl=impl)
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]).expand(1, 2, 2, 2).contiguous()
    with pytest.raises(ValueError, match="^draft_probs row"):
        kernels.gbv_verify(cand, p, q * 1.5, u, uf, impl=impl)
    out = kernels.gbv_verify(cand, p, q, u, uf, impl=impl)
    assert int(out.chosen_path[0]) == 0
    p_other = p.clone()
    p_other[0, 1] *= 3.0  # path 1 repeats path 0's prefix: its rows are never read (the chosen path is 0)
    again = kernels.gbv_verify(cand, p_other, q, u, uf, impl=impl)
    assert torch.equal(again.output_tokens, out.output_tokens)
