"""Errors of the model loaders, in a module of their own so every loader can raise them without importing another."""

from __future__ import annotations

__all__ = ["ModelLoadError"]


class ModelLoadError(ValueError):
    """A model spec that cannot be resolved or loaded (message says which and why)."""
