"""Lossless verification rules (specs/verification.md).

Each rule takes the batch contract of :mod:`specadapt.verification.common` and the coins, and returns
:class:`VerifyOutput`. The float64 PyTorch implementations here are the oracle the fused kernels are tested
against.
"""

from .block import block_round_law, block_verify, residual_mass_reference
from .chain import chain_round_law, chain_verify
from .common import VerifyOutput, check_inputs, sample_from_unnormalized

VERIFY_RULES = {"chain": chain_verify, "block": block_verify}
ROUND_LAWS = {"chain": chain_round_law, "block": block_round_law}


def get_rule(name: str):
    """Return the verification function called ``name`` (``chain`` or ``block``).

    Raises:
        ValueError: unknown rule name.
    """
    try:
        return VERIFY_RULES[name]
    except KeyError:
        raise ValueError(f"unknown verification rule {name!r}; choose one of {sorted(VERIFY_RULES)}") from None


__all__ = [
    "VERIFY_RULES",
    "ROUND_LAWS",
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
