"""Entry point of the SGLang plugin (group ``sglang.srt.plugins``, name ``specadapt``).

``register()`` runs in every SGLang process that calls ``load_plugins()`` (launcher, scheduler = TP worker,
DP controller, detokenizer). It registers only light hooks there:

* AFTER ``ServerArgs.add_cli_args`` -- adds the specadapt flags (:mod:`.flags`), so they show in
  ``python -m sglang.launch_server --help``;
* AFTER ``ServerArgs.from_cli_args`` -- parses them into a :class:`~.config.PluginConfig`, validates it against
  the speculative flags and stores it as the bookkeeping attribute ``ServerArgs._specadapt`` (a plain dict:
  it survives pickling to the spawned scheduler processes);
* a resolution hook on ``handle_speculative_decoding`` -- same validation for ``sglang.Engine(**kw)`` users
  (config from ``$SPECADAPT_SGLANG_CONFIG``), and the speculative flags the replaced sampler needs (SGLang only
  materialises the draft's q with rejection sampling on);
* AROUND ``Scheduler.maybe_init_draft_worker`` -- in the scheduler process: before the speculative worker is
  built, the hooks its constructor needs (GBV only); after, once it exists and before any CUDA graph is
  captured, the heavy hooks (:mod:`.install`); both checked applied.

SGLang logs hook failures instead of raising; :func:`specadapt.sglang.registry.check_applied` turns a missing
hook into an error.
"""

from __future__ import annotations

import logging
from typing import Any

from .config import PluginConfig, PluginConfigError, config_from_env, validate_for_server
from .flags import FLAG_DESTS, add_arguments, config_from_namespace
from .registry import check_applied

logger = logging.getLogger("specadapt.sglang")

__all__ = [
    "ADD_CLI_ARGS",
    "FROM_CLI_ARGS",
    "INIT_DRAFT_WORKER",
    "LIGHT_TARGETS",
    "SERVER_ARGS_ATTR",
    "config_of",
    "register",
]

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
INIT_DRAFT_WORKER = "sglang.srt.managers.scheduler.Scheduler.maybe_init_draft_worker"
LIGHT_TARGETS = (ADD_CLI_ARGS, FROM_CLI_ARGS, INIT_DRAFT_WORKER)
RESOLUTION_STEP = "handle_speculative_decoding"
#: The bookkeeping attribute of ``ServerArgs`` carrying ``PluginConfig.to_dict()`` to every process.
SERVER_ARGS_ATTR = "_specadapt"
#: Draft depth chosen when the user sets no --speculative-num-steps and the plugin needs a chain.
DEFAULT_CHAIN_STEPS = 3

_registered = False


def register() -> None:
    """Register the light hooks (idempotent per process). Called by SGLang's ``load_plugins()``."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADD_CLI_ARGS, _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, _after_from_cli_args, HookType.AFTER)
    HookRegistry.register(INIT_DRAFT_WORKER, _around_init_draft_worker, HookType.AROUND)
    register_resolution_hook(RESOLUTION_STEP)(_resolve_speculative)
    _registered = True


def config_of(server_args: Any) -> PluginConfig | None:
    """The plugin config carried by ``server_args`` (or, failing that, ``$SPECADAPT_SGLANG_CONFIG``)."""
    data = getattr(server_args, SERVER_ARGS_ATTR, None)
    if data is not None:
        return PluginConfig.from_dict(dict(data), source=f"ServerArgs.{SERVER_ARGS_ATTR}")
    return config_from_env()


# ---- light hooks ---------------------------------------------------------------------------------------------
def _after_add_cli_args(result, parser, *args, **kwargs):
    add_arguments(parser)
    return result


def _after_from_cli_args(result, *args, **kwargs):
    namespace = args[-1] if args else kwargs.get("args")
    explicit = any(getattr(namespace, d, None) is not None for d in ("specadapt_config", *FLAG_DESTS))
    config = config_from_namespace(namespace) if explicit else (config_from_env() or PluginConfig())
    validate_for_server(config, result)
    if config.enabled:
        check_applied([INIT_DRAFT_WORKER])
        logger.info("specadapt: %s", _describe(config))
    setattr(result, SERVER_ARGS_ATTR, config.to_dict())
    return result


def _describe(config: PluginConfig) -> str:
    parts = [f"verify={config.verify}" + (f" K={config.num_paths}" if config.multi_path else "")]
    if config.adaptive_verification:
        parts.append("adaptive verification")
    if config.tts:
        parts.append(f"TTS stride={config.tts_stride} lr={config.tts_lr} params={config.tts_params}")
    return ", ".join(parts)


def _resolve_speculative(server_args, previous) -> None:
    """Resolution hook on ``handle_speculative_decoding`` (launcher only; declarations ride to children)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    config = config_of(server_args) or PluginConfig()
    if getattr(server_args, SERVER_ARGS_ATTR, None) is None:
        setattr(server_args, SERVER_ARGS_ATTR, config.to_dict())  # Engine(**kw) users: from the environment
    view = resolving_view(server_args)
    validate_for_server(config, view)
    algo = str(view.speculative_algorithm or "").upper()
    needs_q = config.replaces_verification and algo in ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
    if needs_q and config.multi_path:
        # K sampled chains as the branches of SGLang's top-K tree, every node kept (gbv.py); SGLang's own check
        # refuses rejection sampling with a top-k above 1 (its chain kernel's need): hide the flag from it.
        steps = int(view.speculative_num_steps or DEFAULT_CHAIN_STEPS)
        declare_resolution(server_args, "specadapt", speculative_num_steps=steps,
                           speculative_eagle_topk=config.num_paths,
                           speculative_num_draft_tokens=config.num_paths * steps + 1,
                           speculative_use_rejection_sampling=False)
        previous(server_args)
        declare_resolution(server_args, "specadapt", speculative_use_rejection_sampling=True)
        validate_for_server(config, resolving_view(server_args))
        return
    if needs_q:
        topk = view.speculative_eagle_topk
        if topk not in (None, 1):
            flag = "--adaptive-verification" if config.verify == "builtin" else f"--specadapt-verify {config.verify}"
            raise PluginConfigError(
                f"{flag} verifies a chain of sampled drafts: set --speculative-eagle-topk 1 (got {topk})"
            )
        if view.speculative_num_steps is None and not view.speculative_adaptive:
            # SGLang would auto-choose (steps, topk, tokens) as a triple, possibly a top-k tree: choose a chain
            # of the same default depth instead (its topk-1 default).
            declare_resolution(server_args, "specadapt", speculative_num_steps=DEFAULT_CHAIN_STEPS,
                               speculative_eagle_topk=1, speculative_num_draft_tokens=DEFAULT_CHAIN_STEPS + 1)
        elif topk is None:
            declare_resolution(server_args, "specadapt", speculative_eagle_topk=1)
    if needs_q and algo == "STANDALONE":
        # SGLang rejects rejection sampling for STANDALONE although its draft worker (an EagleDraftWorker)
        # produces q the same way; hide the flag from the built-in check, then declare it.
        declare_resolution(server_args, "specadapt", speculative_use_rejection_sampling=False)
        previous(server_args)
        declare_resolution(server_args, "specadapt", speculative_use_rejection_sampling=True)
    else:
        if needs_q:
            declare_resolution(server_args, "specadapt", speculative_use_rejection_sampling=True)
        previous(server_args)
    validate_for_server(config, resolving_view(server_args))


def _around_init_draft_worker(original, scheduler, *args, **kwargs):
    """AROUND ``Scheduler.maybe_init_draft_worker``: hooks the draft worker's constructor needs (GBV) before it
    runs, the heavy hooks after (the speculative worker exists; no CUDA graph is captured yet)."""
    config = config_of(scheduler.server_args)
    if config is None or not config.enabled:
        return original(scheduler, *args, **kwargs)
    from .install import install_pre_worker_hooks, install_worker_hooks

    install_pre_worker_hooks(config)
    result = original(scheduler, *args, **kwargs)
    install_worker_hooks(scheduler, config)
    return result


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("specadapt.sglang.plugin is loaded by SGLang through its entry point; see docs/sglang.md")
