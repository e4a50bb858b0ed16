"""Lossless verification rules (specs/verification.md).

Each rule takes the batch contract of :mod:`specadapt.verification.common` and the coins, and returns
:class:`VerifyOutput`. The float64 PyTorch implementations here are the oracle the fused kernels are tested
against. :mod:`specadapt.verification.rules` is the registry every consumer reads (:data:`RULES`,
:func:`get_rule`).
"""

from .block import block_round_law, block_verify, residual_mass_reference
from .chain import chain_round_law, chain_verify
from .common import VerifyOutput, check_inputs, sample_from_unnormalized
from .rules import DEFAULT_RULE, RULE_NAMES, RULES, VerificationRule, get_rule

#: Float64 references of the single-path rules, by name (derived from :data:`RULES`).
VERIFY_RULES = {r.name: r.reference for r in RULES.values() if not r.multi_path}
#: Exact one-round laws of the rules that have one, by name (derived from :data:`RULES`).
ROUND_LAWS = {r.name: r.round_law for r in RULES.values() if r.round_law is not None}


__all__ = [
    "DEFAULT_RULE",
    "RULES",
    "RULE_NAMES",
    "ROUND_LAWS",
    "VERIFY_RULES",
    "VerificationRule",
    "VerifyOutput",
    "block_round_law",
    "block_verify",
    "chain_round_law",
    "chain_verify",
    "check_inputs",
    "get_rule",
    "residual_mass_reference",
    "sample_from_unnormalized",
]
