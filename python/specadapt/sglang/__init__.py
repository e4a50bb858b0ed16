"""specadapt as an SGLang plugin: the only package of specadapt that imports sglang (tested with 0.5.23).

Installed with ``pip install "specadapt[sglang]"``; SGLang finds :func:`specadapt.sglang.plugin.register`
through the ``sglang.srt.plugins`` entry point. Modules:

* :mod:`.config`, :mod:`.flags` -- the settings and their CLI flags (no sglang import);
* :mod:`.plugin` -- registration, flag plumbing, start-up validation, the lazy install in the scheduler;
* :mod:`.install` -- the heavy hooks installed in each scheduler (TP worker) process;
* :mod:`.verify` -- the specadapt rules in SGLang's sampler / DFLASH acceptance conventions;
* :mod:`.adaptive` -- adaptive verification (estimator + per-request caps);
* :mod:`.tts` and :mod:`.students` -- Test-Time Speculation (snapshots, strided async updates, publishes).

Importing this package does not import sglang. Docs: docs/sglang.md.
"""

__all__ = ["register"]


def register() -> None:
    """SGLang plugin entry point (see :func:`specadapt.sglang.plugin.register`)."""
    from .plugin import register as _register

    _register()
