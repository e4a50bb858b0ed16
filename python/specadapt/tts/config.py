"""Settings of Test-Time Speculation (the ``--tts-*`` flags of both front ends, generated from the fields here);
defaults and why (docs/design/specs/tts.md marks "ours")."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import check_choices, require, setting

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

    Raises:
        SettingError (a ValueError): a value out of range, naming the field.
    """

    stride: int = setting(5, flag="--tts-stride",
                          help="S, rounds between updates (the paper's best throughput used 5; 1 maximises acceptance)")
    lr: float = setting(3e-5, flag="--tts-lr",
                        help="Adam learning rate (measured on the shipped head: 3e-5 > 1e-4 > none > 1e-3, "
                             "docs/tts.md)")
    proximal_weight: float = setting(0.1, flag="--tts-lambda",
                                     help="weight of the proximal KL(q_t || q) term (acts on stale asynchronous steps)")
    position_decay: float = setting(0.8, flag="--tts-position-decay", help="gamma of the position weights gamma^(k-1)")
    params: str = setting("full", flag="--tts-params", choices=("full", "lora"),
                          help="train the draft's own layers, or low-rank adapters on them")
    lora_rank: int = setting(8, flag="--tts-lora-rank", help="adapter rank for --tts-params lora")
    scope: str = setting("shared", flag="--tts-scope", choices=("shared", "request"), fronts=("engine",),
                         help="one draft adapting on all traffic, or per-request LoRA adapters (with --tts-params "
                              "lora)")
    supervise: str = setting("accepted", flag="--tts-supervise", choices=("accepted", "canvas"), fronts=("engine",),
                             help="positions supervised: up to the first rejection plus one, or every verified "
                                  "position")
    rounds: str = setting("all", flag="--tts-rounds", choices=("all", "latest"), fronts=("engine",),
                          help="an update trains on every round since the previous one, or on the latest round only")
    grad_clip: float = setting(1.0)
    rollback_margin: float = setting(0.5, flag="--tts-rollback-margin",
                                     help="roll back when the rolling acceptance length < (1 - margin) x the "
                                          "pre-adaptation one")
    rollback_window: int = setting(32)
    context_window: int = setting(64, flag="--tts-context-window",
                                  help="committed tokens of context the differentiable draft forward sees")
    topk: int = setting(0, flag="--tts-topk",
                        help="keep only the target's top-k probabilities per supervised position in the snapshots "
                             "(0: the full vocabulary, exact KL; k > 0 saves snapshot memory)")

    def __post_init__(self) -> None:
        # messages name the field; a front end rewords them with its flag (specadapt.settings.flag_message)
        check_choices(self)
        require(self.stride >= 1, "stride", f"must be >= 1, got {self.stride}")
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        require(self.proximal_weight >= 0, "proximal_weight", f"must be >= 0, got {self.proximal_weight}")
        require(0 < self.position_decay <= 1, "position_decay", f"must lie in (0, 1], got {self.position_decay}")
        require(self.lora_rank >= 1, "lora_rank", f"must be >= 1, got {self.lora_rank}")
        require(self.scope == "shared" or self.params == "lora", "scope",
                "request must come with {params} lora (per-request low-rank adapters)", "params")
        require(self.grad_clip > 0, "grad_clip", f"must be > 0, got {self.grad_clip}")
        require(0 < self.rollback_margin <= 1, "rollback_margin", f"must lie in (0, 1], got {self.rollback_margin}")
        require(self.rollback_window >= 1, "rollback_window", f"must be >= 1, got {self.rollback_window}")
        require(self.context_window >= 1, "context_window", f"must be >= 1, got {self.context_window}")
        require(self.topk >= 0, "topk", f"must be >= 0 (0 = the full vocabulary), got {self.topk}")
