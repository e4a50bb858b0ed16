"""Per-request verification budget for adaptive verification (docs/design/specs/adaptive_verification.md section 5)."""

from .budget import allocate_prefixes, choose_budget, survival
from .costs import CostTable

__all__ = ["CostTable", "allocate_prefixes", "choose_budget", "survival"]
