"""Settings of Test-Time Speculation (``--tts*`` flags); defaults and why (specs/tts.md marks "ours")."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TTSConfig"]


@dataclass(frozen=True)
class TTSConfig:
    """Test-Time Speculation settings.

    Attributes:
        stride: ``S``, rounds between updates; the paper's best throughput used 5.
        lr: Adam learning rate. Default 3e-5, measured on the shipped EAGLE head (AIME, 1,024 tokens, T = 1.0,
            S = 5): acceptance length 1.44 without TTS, 1.49 at 1e-4, 1.58 at 3e-5, and 1.25 at 1e-3 (at 512
            tokens). The spec's probe preferred 1e-3 for a briefly trained head; a well-trained one is hurt by
            Adam's ~lr-sized per-weight steps.
        proximal_weight: ``lambda`` of the proximal term. 0.1: a mild pull towards the rows that drafted the
            round (with a full-context student on fresh weights its gradient would vanish; with stale weights or
            the truncated context of ``context_window`` it does not).
        position_decay: ``gamma`` of the position weights ``gamma^(k-1)`` (0.8, the spec's value).
        params: ``full`` (the draft's own layers) or ``lora`` (rank-``lora_rank`` adapters on them).
        lora_rank: adapter rank for ``params="lora"`` (8, the spec's value).
        scope: ``shared`` (one draft adapts on all traffic) or ``request`` (per-request LoRA adapters, fresh for
            every batch of requests; needs ``params="lora"``; memory: concurrent requests x adapter size).
        supervise: ``accepted`` (positions up to the first rejection plus one, the spec's default) or
            ``canvas`` (every verified position).
        rounds: ``all`` (one update trains on every round since the last one) or ``latest`` (the last round).
        grad_clip: gradient-norm clip (1.0).
        rollback_margin: roll back (to the pre-adaptation weights) when the rolling acceptance length falls
            below ``(1 - margin) * baseline`` (baseline: the rounds before the first publish). 0.5: acceptance
            decays on long outputs without any fault of the updates; only a collapse should trigger a rollback.
        rollback_window: rounds in the rolling acceptance length.
        context_window: committed tokens of context the differentiable draft forward sees per example.
        topk: 0 (default): the KL terms over the full (draft) vocabulary in float32, the spec's default. ``k > 0``:
            snapshots keep only the target's top-k probabilities per position (and the drafting rows' top-k for
            the proximal term), renormalised, as values + indices: snapshot memory falls by about ``V / (2k)``
            (the spec's memory-saving flag); the KL is then taken against the truncated teacher.
    """

    stride: int = 5
    lr: float = 3e-5
    proximal_weight: float = 0.1
    position_decay: float = 0.8
    params: str = "full"
    lora_rank: int = 8
    scope: str = "shared"
    supervise: str = "accepted"
    rounds: str = "all"
    grad_clip: float = 1.0
    rollback_margin: float = 0.5
    rollback_window: int = 32
    context_window: int = 64
    topk: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.stride >= 1, f"--tts-stride must be >= 1, got {self.stride}"),
            (self.lr > 0, f"--tts-lr must be > 0, got {self.lr}"),
            (self.proximal_weight >= 0, f"--tts-lambda must be >= 0, got {self.proximal_weight}"),
            (0 < self.position_decay <= 1, f"--tts-position-decay must lie in (0, 1], got {self.position_decay}"),
            (self.params in ("full", "lora"), f"--tts-params must be full or lora, got {self.params!r}"),
            (self.lora_rank >= 1, f"--tts-lora-rank must be >= 1, got {self.lora_rank}"),
            (self.scope in ("shared", "request"), f"--tts-scope must be shared or request, got {self.scope!r}"),
            (self.scope == "shared" or self.params == "lora",
             "--tts-scope request must come with --tts-params lora (per-request low-rank adapters)"),
            (self.supervise in ("accepted", "canvas"), f"--tts-supervise must be accepted or canvas, got {self.supervise!r}"),
            (self.rounds in ("all", "latest"), f"--tts-rounds must be all or latest, got {self.rounds!r}"),
            (self.grad_clip > 0, f"TTS grad_clip must be > 0, got {self.grad_clip}"),
            (0 < self.rollback_margin <= 1, f"--tts-rollback-margin must lie in (0, 1], got {self.rollback_margin}"),
            (self.rollback_window >= 1, f"TTS rollback_window must be >= 1, got {self.rollback_window}"),
            (self.context_window >= 1, f"--tts-context-window must be >= 1, got {self.context_window}"),
            (self.topk >= 0, f"--tts-topk must be >= 0 (0 = the full vocabulary), got {self.topk}"),
        ]
        for ok, message in checks:  # messages name the CLI flag of each setting (shared by every front end)
            if not ok:
                raise ValueError(message)
