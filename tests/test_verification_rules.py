"""The registry of verification rules (specadapt.verification.rules): lookups, its consistency with the references,
the compiled CPU ops and the JIT kernel list, and that it imports without torch."""

import subprocess
import sys

import pytest
import torch
from tests.helpers.batches import random_batch, tree_batch

from specadapt import cuda_jit, kernels
from specadapt.verification import ROUND_LAWS, VERIFY_RULES
from specadapt.verification.rules import DEFAULT_RULE, RULE_NAMES, RULES, get_rule, join_names, rule_names


def test_unknown_rule_names_the_argument_and_the_choices():
    with pytest.raises(ValueError,
                       match=r"--verify: unknown verification rule 'tree'; choose one of chain, block, gbv"):
        get_rule("tree", "--verify")
    with pytest.raises(ValueError, match=r"^rule: unknown verification rule None"):
        get_rule(None)
    assert get_rule("gbv") is RULES["gbv"]


def test_names_and_derived_tables():
    assert RULE_NAMES == ("chain", "block", "gbv") and DEFAULT_RULE in RULES
    assert rule_names(multi_path=False) == ("chain", "block") and rule_names(multi_path=True) == ("gbv",)
    assert join_names(RULE_NAMES) == "chain, block or gbv"
    assert join_names(["chain", "block"], "and") == "chain and block"
    assert VERIFY_RULES == {n: RULES[n].reference for n in rule_names(multi_path=False)}
    assert ROUND_LAWS == {n: RULES[n].round_law for n in ("chain", "block")}


@pytest.mark.parametrize("name", RULE_NAMES)
def test_rule_properties_are_consistent(name):
    rule = RULES[name]
    assert rule.name == name and callable(rule.reference) and rule.description
    if rule.multi_path:
        assert not get_rule(rule.plain_rule).multi_path and rule.default_num_paths >= 1
        assert rule.round_law is None and rule.adaptive_caps == "shared_prefix"
    else:
        assert rule.plain_rule == name and rule.default_num_paths == 1 and callable(rule.round_law)
        assert rule.jit_kernels[0][0] == name and rule.adaptive_caps == "per_draft"
    names = cuda_jit.kernel_names(torch.float32)
    for short, _ in rule.jit_kernels:
        assert short in names
    assert f'#include "{rule.cuda_header}"' in cuda_jit._source()


@pytest.mark.skipif(not kernels.extension_available(), reason="specadapt._C is not built")
@pytest.mark.parametrize("name", RULE_NAMES)
def test_every_rule_has_a_cpu_op_of_its_kind_that_matches_its_reference(name):
    rule = RULES[name]
    assert kernels.has_op_for(rule.op, torch.device("cpu"))
    schema = getattr(torch.ops.specadapt, rule.op).default._schema
    assert len(schema.returns) == (3 if rule.multi_path else 2)
    names = [a.name for a in schema.arguments]
    assert names[-1] == "error"  # the device error flag (kernel_errors), last in every verification op
    assert names[-2] == ("uniforms_final" if rule.multi_path else "num_draft_tokens")
    if rule.multi_path:
        args = tree_batch(3, 2, 3, 12, seed=5, dtype=torch.float32)
        got = kernels.verify_paths(name, *args, impl="compiled")
        ref = kernels.verify_paths(name, *args, impl="reference")
        assert torch.equal(got.chosen_path, ref.chosen_path)
    else:
        args = random_batch(4, 3, 12, seed=5)
        got = kernels.verify(name, *args, impl="compiled")
        ref = kernels.verify(name, *args, impl="reference")
    assert torch.equal(got.accept_len, ref.accept_len) and torch.equal(got.output_tokens, ref.output_tokens)


def test_the_dispatch_refuses_a_rule_of_the_other_kind():
    cand, p, q, u, uf = random_batch(2, 2, 8, seed=1)
    with pytest.raises(ValueError, match="rule 'gbv' is a multi-path rule: call kernels.verify_paths"):
        kernels.verify("gbv", cand, p, q, u, uf)
    with pytest.raises(ValueError, match="rule 'block' is a single-path rule: call kernels.verify "):
        kernels.verify_paths("block", cand, p, q, u, uf)
    with pytest.raises(ValueError, match="unknown verification rule 'tree'"):
        kernels.verify("tree", cand, p, q, u, uf)


def test_the_registry_imports_without_torch():
    code = ("import sys; from specadapt.verification.rules import RULES; import specadapt.verification; "
            "print('torch' in sys.modules, len(RULES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "3"]
