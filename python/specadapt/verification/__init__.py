"""Lossless verification rules (docs/design/specs/verification.md).

Each rule takes the batch contract of :mod:`specadapt.verification.common` and the coins, and returns
:class:`VerifyOutput`. The float64 PyTorch implementations here are the oracle the fused kernels are tested
against. :mod:`specadapt.verification.rules` is the registry every consumer reads (:data:`RULES`,
:func:`get_rule`).

Importing this package does not import torch: the registry is torch-free, and the rules' functions below are
imported from their modules on first access, so tools can read the registry without torch. (The CLI's parser
imports torch anyway today, through the settings records of budget/ and tts/, whose packages import torch.)
"""

from importlib import import_module

from .rules import DEFAULT_RULE, RULE_NAMES, RULES, VerificationRule, get_rule

#: name -> module of this package that defines it (imported on first access)
_FUNCTIONS = {
    "VerifyOutput": "common",
    "check_inputs": "common",
    "sample_from_unnormalized": "common",
    "block_round_law": "block",
    "block_verify": "block",
    "residual_mass_reference": "block",
    "chain_round_law": "chain",
    "chain_verify": "chain",
}


def __getattr__(name: str):
    """``VERIFY_RULES`` (float64 references of the single-path rules, by name), ``ROUND_LAWS`` (exact one-round
    laws, by name), both derived from :data:`RULES`, and the functions of :data:`_FUNCTIONS`."""
    if name == "VERIFY_RULES":
        value = {r.name: r.reference for r in RULES.values() if not r.multi_path}
    elif name == "ROUND_LAWS":
        value = {r.name: r.round_law for r in RULES.values() if r.round_law_name is not None}
    elif name in _FUNCTIONS:
        value = getattr(import_module(f".{_FUNCTIONS[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


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
