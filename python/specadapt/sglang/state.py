"""The plugin's process state: one :class:`PluginState`, held here and nowhere else.

A scheduler (TP worker) process builds it once (:func:`specadapt.sglang.install.install_worker_hooks`) and
every hook reads it through :func:`current` (``None`` before installation: hooks then pass through to SGLang)
or :func:`require` (hooks that cannot run without it). Tests build partial states (every field has a default)
and call :func:`install` / :func:`reset`.

Nothing here imports sglang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..verification.rules import DEFAULT_RULE
from .config import PluginConfig
from .gbv import GBVDrafting, GBVRound
from .hot_vocab import HotVocab

if TYPE_CHECKING:  # annotations only: no import cost (torch.nn, the TTS updater) for the state's readers
    from .adaptive import SGLangAdaptiveVerification
    from .tts import SGLangTTS

__all__ = ["PluginState", "VerifyRuntime", "current", "install", "require", "reset"]

#: In-place broadcast of a tensor from TP rank 0 (the group that shares a batch).
Broadcast = Callable[[torch.Tensor], None]


@dataclass
class VerifyRuntime:
    """What the replaced verification functions read and hand over within one round.

    Attributes:
        rule: ``chain``, ``block`` or ``gbv``.
        impl: kernel implementation passed to :func:`specadapt.kernels.verify` (``auto``).
        seed: seed of the coins the plugin draws itself (DFLASH), mixed into the per-request streams when SGLang
            carries per-request seeds, the seed of one generator for the batch otherwise.
        pending_min_ps: ``[B] float32`` SGLang's per-request min-p of the batch being verified (set by the
            ``eagle_sample`` hook when a request uses min-p, consumed by the sampler), or ``None``.
        pending_caps: ``[B] int64`` drafts each request may verify this round (adaptive verification sets it
            right before SGLang's sampler runs and it is consumed by that call), or ``None``.
        calls: number of verification calls served (for start-up checks and logs).
        last_gbv: the :class:`~specadapt.sglang.gbv.GBVRound` of the last GBV call (read by the TTS hook).
        broadcast: in-place broadcast from TP rank 0, or ``None`` at TP 1.
    """

    rule: str = DEFAULT_RULE
    impl: str = "auto"
    seed: int = 0
    pending_caps: torch.Tensor | None = None
    pending_min_ps: torch.Tensor | None = None
    calls: int = 0
    last_gbv: GBVRound | None = None
    broadcast: Broadcast | None = None
    _generators: dict[str, torch.Generator] = field(default_factory=dict)

    def take_caps(self) -> torch.Tensor | None:
        """The pending caps, cleared (each round's caps serve one sampler call)."""
        caps, self.pending_caps = self.pending_caps, None
        return caps

    def take_min_ps(self) -> torch.Tensor | None:
        """The pending min-p values, cleared."""
        min_ps, self.pending_min_ps = self.pending_min_ps, None
        return min_ps

    def generator(self, device: torch.device) -> torch.Generator:
        """The batch-wide generator of ``device`` (coins of requests without an SGLang per-request seed)."""
        key = str(device)
        if key not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return self._generators[key]


@dataclass
class PluginState:
    """Everything the hooks of one scheduler process share.

    Attributes:
        config: the plugin settings.
        runtime: the verification runtime (rule, pending caps / min-p, coins).
        algorithm: SGLang's speculative algorithm, upper case (``EAGLE3``, ``DFLASH``...).
        drafting: the K-path drafting state with ``--specadapt-verify gbv`` on the EAGLE family, else ``None``.
        hot_vocab: the draft's hot vocabulary (recorded when SGLang allocates the draft's memory pool), or
            ``None`` when the draft predicts the target vocabulary.
        adaptive: adaptive verification with ``--adaptive-verification``, else ``None``.
        tts: Test-Time Speculation with ``--tts`` (:class:`~specadapt.sglang.tts_dflash.SGLangDFlashTTS` for
            DFLASH), else ``None``.
        rids: request ids of the batch in flight (set at the worker's ``forward_batch_generation``).
        extend_lens: its prefill lengths (host list), when a prefill batch.
    """

    config: PluginConfig = field(default_factory=PluginConfig)
    runtime: VerifyRuntime = field(default_factory=VerifyRuntime)
    algorithm: str = ""
    drafting: GBVDrafting | None = None
    hot_vocab: HotVocab | None = None
    adaptive: SGLangAdaptiveVerification | None = None
    tts: SGLangTTS | None = None
    rids: list[str] = field(default_factory=list)
    extend_lens: list[int] | None = None


_CURRENT: PluginState | None = None


def current() -> PluginState | None:
    """The installed state of this process (``None`` before installation)."""
    return _CURRENT


def require() -> PluginState:
    """The installed state of this process.

    Raises:
        RuntimeError: the plugin installed no state in this process.
    """
    if _CURRENT is None:
        raise RuntimeError("specadapt: the plugin state is not installed in this process")
    return _CURRENT


def install(state: PluginState) -> PluginState:
    """Make ``state`` this process's state (replacing any previous one) and return it.

    Raises:
        TypeError: ``state`` is not a :class:`PluginState`.
    """
    global _CURRENT
    if not isinstance(state, PluginState):
        raise TypeError(f"state must be a PluginState, got {type(state).__name__}")
    _CURRENT = state
    return state


def reset() -> None:
    """Forget the installed state (tests; hooks pass through to SGLang afterwards)."""
    global _CURRENT
    _CURRENT = None
