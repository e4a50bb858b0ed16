"""The registry of verification rules: one :class:`VerificationRule` per rule, read by every consumer.

The kernels dispatch (:mod:`specadapt.kernels`), the CuPy JIT (:mod:`specadapt.cuda_jit`), the embedded engine,
the CLI and the SGLang plugin all look a rule up here instead of comparing its name: whether it verifies one
draft path or a tree of K paths, its float64 reference, its compiled op, its CUDA kernels, how adaptive
verification applies, and the defaults the CLI fills in for it.

Adding a rule: write its kernels (``csrc/cpu``, ``csrc/cuda``, registered as ``specadapt::<op>`` with the
single- or multi-path op signature below) and its float64 reference, then add one entry to :data:`RULES`.

This module imports neither torch nor the rules' modules (the CLI builds its parser, and the SGLang plugin its
flags, from it without importing torch): a rule's reference and round law are named ``"module:function"``
within this package and imported on first use (:attr:`VerificationRule.reference`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "DEFAULT_RULE",
    "RULES",
    "RULE_NAMES",
    "VerificationRule",
    "get_rule",
    "join_names",
    "rule_names",
]


@dataclass(frozen=True)
class VerificationRule:
    """One lossless verification rule.

    Attributes:
        name: the rule's name (``--verify``, ``--specadapt-verify``, ``kernels.verify(rule=...)``).
        description: one line for CLI help.
        multi_path: ``False``: one draft path per request; the reference and the op take ``candidates [B, L+1]``,
            ``target_probs [B, L+1, V]``, ``draft_probs [B, L, V]``, ``uniforms [B, L]``, ``uniforms_final [B]``,
            optional ``num_draft_tokens [B]`` and return ``(accept_len [B], output_tokens [B, L+1])`` int32.
            ``True``: K sampled paths per request (a token tree); the inputs gain a K axis after B
            (``[B, K, L+1]``, ``[B, K, L+1, V]``, ``[B, K, L, V]``; the coins stay ``[B, L]`` / ``[B]``), there is
            no ``num_draft_tokens`` and the output adds ``chosen_path [B]`` int32.
        reference_name: ``"module:function"`` (a module of this package) of the float64 PyTorch oracle of that
            contract (``debug=`` keyword for strict target checks); :attr:`reference` is the function.
        op: the ``specadapt::<op>`` the compiled extension registers (CPU and CUDA). For a multi-path rule it is
            also the name of the host pipeline in :mod:`specadapt.cuda_jit` that launches its JIT kernels.
        cuda_header: the torch-free header (``csrc/cuda``) holding the rule's kernels, for the CuPy JIT.
        jit_kernels: ``(short name, C++ name expression)`` of each kernel the JIT launches; the expression has the
            placeholders ``{t}`` (probability type), ``{max_drafts}`` and ``{max_paths}``. A single-path rule has
            exactly one kernel, whose short name is the rule's name.
        round_law_name: ``"module:function"`` of ``(target_probs [L+1, V], draft_probs [L, V], drafts [L]) ->
            (tau_probs [L+1], extra_dists [L+1, V])``, the exact law of one round on one fixed path (single-path
            rules), or ``None``; :attr:`round_law` is the function.
        adaptive: whether adaptive verification applies (its caps keep the rule exact; see :attr:`adaptive_caps`).
        plain_round_rule: multi-path rules only: the single-path rule that runs a round verifying no tree
            (speculation off, an adaptive round capped at 0 drafts).
        default_num_paths: K when the user gives none (1 for single-path rules).
        measured_num_draft_tokens: the CLI's default L for draft families with a measured L (``None``: the
            family's measured L).
    """

    name: str
    description: str
    multi_path: bool
    reference_name: str
    op: str
    cuda_header: str
    jit_kernels: tuple[tuple[str, str], ...]
    round_law_name: str | None = None
    adaptive: bool = True
    plain_round_rule: str | None = None
    default_num_paths: int = 1
    measured_num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.jit_kernels:
            raise ValueError(f"rule {self.name!r}: jit_kernels is empty")
        if self.multi_path:
            if self.plain_round_rule is None or self.default_num_paths < 1:
                raise ValueError(f"rule {self.name!r}: a multi-path rule needs plain_round_rule and "
                                 "default_num_paths >= 1")
        else:
            if self.plain_round_rule is not None or self.default_num_paths != 1:
                raise ValueError(f"rule {self.name!r}: a single-path rule has no plain_round_rule and one path")
            if len(self.jit_kernels) != 1 or self.jit_kernels[0][0] != self.name:
                raise ValueError(f"rule {self.name!r}: a single-path rule has one JIT kernel named {self.name!r}")

    @property
    def reference(self) -> Callable:
        """The float64 reference function (imported on first use)."""
        return _resolve(self.reference_name)

    @property
    def round_law(self) -> Callable | None:
        """The exact one-round law function, or ``None`` (imported on first use)."""
        return None if self.round_law_name is None else _resolve(self.round_law_name)

    @property
    def plain_rule(self) -> str:
        """The single-path rule that runs a round of this rule verifying no tree (the rule itself when single-path)."""
        return self.plain_round_rule or self.name

    @property
    def adaptive_caps(self) -> str | None:
        """How adaptive verification caps this rule: ``"per_draft"`` (single path: each draft's own q row is a
        feature, the cap truncates the path), ``"shared_prefix"`` (K paths: one cap per request from the committed
        context only, every path verifies the same prefix), ``None`` when it does not apply."""
        if not self.adaptive:
            return None
        return "shared_prefix" if self.multi_path else "per_draft"


#: Every rule, in the order the CLI lists them.
RULES: dict[str, VerificationRule] = {
    rule.name: rule
    for rule in (
        VerificationRule(
            name="chain",
            description="token-level rejection sampling (Leviathan et al. 2023)",
            multi_path=False,
            reference_name="chain:chain_verify",
            op="chain_verify",
            cuda_header="verify.cuh",
            jit_kernels=(("chain", "chain_verify_kernel<{t}>"),),
            round_law_name="chain:chain_round_law",
        ),
        VerificationRule(
            name="block",
            description="block verification (Sun et al. 2024)",
            multi_path=False,
            reference_name="block:block_verify",
            op="block_verify",
            cuda_header="verify.cuh",
            jit_kernels=(("block", "block_verify_kernel<{t}, {max_drafts}>"),),
            round_law_name="block:block_round_law",
        ),
        VerificationRule(
            name="gbv",
            description="greedy multi-path block verification over K sampled paths",
            multi_path=True,
            reference_name="gbv:gbv_verify",
            op="gbv_verify",
            cuda_header="gbv.cuh",
            jit_kernels=(
                ("gbv_walk", "gbv_walk_kernel<{t}, {max_paths}>"),
                ("gbv_fill_keys", "gbv_fill_keys_kernel<{t}>"),
                ("gbv_depth", "gbv_depth_kernel<{t}>"),
                ("gbv_accept", "gbv_accept_kernel"),
                ("gbv_sample", "gbv_sample_kernel<{t}>"),
            ),
            plain_round_rule="chain",
            default_num_paths=3,
            measured_num_draft_tokens=2,
        ),
    )
}

#: Names of :data:`RULES`, in order.
RULE_NAMES: tuple[str, ...] = tuple(RULES)

#: The rule used when none is named (the embedded engine's default; SGLang's builtin rule with adaptive caps).
DEFAULT_RULE = "chain"


def _resolve(qualified: str) -> Callable:
    module, _, function = qualified.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def get_rule(name: str, argument: str = "rule") -> VerificationRule:
    """The registered rule called ``name``.

    Args:
        name: a rule name (:data:`RULE_NAMES`).
        argument: the caller's argument or flag name, for the error message.

    Raises:
        ValueError: ``"<argument>: unknown verification rule 'x'; choose one of chain, block, gbv"``.
    """
    rule = RULES.get(name) if isinstance(name, str) else None
    if rule is None:
        raise ValueError(f"{argument}: unknown verification rule {name!r}; choose one of {', '.join(RULE_NAMES)}")
    return rule


def rule_names(multi_path: bool | None = None) -> tuple[str, ...]:
    """Names of the rules, all of them or only the single-path (``False``) / multi-path (``True``) ones."""
    return tuple(r.name for r in RULES.values() if multi_path is None or r.multi_path == multi_path)


def join_names(names, conjunction: str = "or") -> str:
    """``"chain, block or gbv"``: names for a message or help text (``conjunction`` joins the last two)."""
    names = list(names)
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}"
