"""SGLang's ``HookRegistry`` as the plugin uses it: register a table of targets, apply, and turn a hook SGLang
did not apply into an error. sglang is imported inside the functions only (this module is imported by the
plugin's entry point in every SGLang process).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["apply_targets", "check_applied"]


def check_applied(targets: Iterable[str]) -> None:
    """Raise ``RuntimeError`` naming every target of ``targets`` that SGLang did not patch.

    SGLang's ``HookRegistry.apply_hooks`` only logs a failure (a renamed function in another sglang version,
    an import error); serving on silently without the hook would run the wrong verification rule.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t in targets if t not in HookRegistry._patched]
    if missing:
        import sglang

        raise RuntimeError(
            f"specadapt: SGLang did not apply the hook(s) {missing} (sglang {getattr(sglang, '__version__', '?')}; "
            "specadapt is tested with sglang==0.5.23). See the log above for the reason."
        )


def apply_targets(targets: Iterable[tuple[str, str, Callable[..., Any]]]) -> None:
    """Register each ``(target, HookType name, hook)`` with SGLang's ``HookRegistry``, apply, and check.

    Raises:
        RuntimeError: a hook SGLang did not apply (:func:`check_applied`).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    targets = list(targets)
    for target, kind, hook in targets:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    check_applied([t for t, _, _ in targets])
