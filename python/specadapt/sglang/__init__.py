"""specadapt as an SGLang plugin: the only package of specadapt that imports sglang (tested with 0.5.23).

Installed with ``pip install "specadapt[sglang]"``; SGLang finds :func:`specadapt.sglang.plugin.register`
through the ``sglang.srt.plugins`` entry point. Modules:

* :mod:`.config`, :mod:`.flags` -- the settings and their CLI flags (no sglang import);
* :mod:`.plugin` -- registration, flag plumbing, start-up validation, the lazy install in the scheduler;
* :mod:`.registry` -- SGLang's ``HookRegistry``: register, apply, check applied;
* :mod:`.install` -- builds the process state in each scheduler (TP worker) process and applies the hooks;
* :mod:`.state` -- the process state (:class:`~.state.PluginState`), held in one place;
* :mod:`.targets` -- the hook table (which SGLang attribute is patched with what);
* :mod:`.probes` -- reads of the running SGLang (resolved settings, graph sizes, TP groups);
* :mod:`.hooks`, :mod:`.draft_hooks` -- the hook bodies (target side; draft worker: GBV paths, hot vocabulary);
* :mod:`.verify` -- the specadapt rules in SGLang's sampler / DFLASH acceptance conventions;
* :mod:`.gbv`, :mod:`.hot_vocab`, :mod:`.layout` -- GBV drafting and verification, the hot-vocabulary map,
  SGLang's tensor layouts;
* :mod:`.adaptive` -- adaptive verification (estimator + per-request caps);
* :mod:`.tts` and :mod:`.students` -- Test-Time Speculation (snapshots, strided async updates, publishes).

Importing this package does not import sglang. Docs: docs/sglang.md.
"""

__all__ = ["register"]


def register() -> None:
    """SGLang plugin entry point (see :func:`specadapt.sglang.plugin.register`)."""
    from .plugin import register as _register

    _register()
