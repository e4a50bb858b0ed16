"""Settings of adaptive verification (the ``--av-*`` flags of both front ends, generated from the fields here):
the estimator's (:class:`~specadapt.estimator.config.EstimatorConfig`), the budget's and the cost model's."""

from __future__ import annotations

from dataclasses import dataclass

from ..estimator.config import EstimatorConfig
from ..settings import check_choices, nested, require, setting

__all__ = ["AVConfig"]


@dataclass(frozen=True)
class AVConfig:
    """Adaptive-verification settings (:class:`~specadapt.budget.adaptive.AdaptiveVerification`).

    Attributes:
        estimator: the acceptance estimator's settings (refit interval, damping, starting coefficients).
        early_stop: let model drafts stop drafting rows whose next slot falls outside the budget
            (:meth:`~specadapt.budget.adaptive.AdaptiveVerification.draft_caps`; same caps, less work).
        probe_interval, probe_interval_max: with speculation switched off, rounds before a probe round, and the
            cap of its doubling.
        probe_share: the share of decode time probes may cost while speculation is off: once a probe's extra
            time has been measured, the wait after a probe that keeps speculation off is at least what makes it
            this share of the plain rounds it waits (past ``probe_interval_max``, to at most 16x it); 0 disables
            it.
        probe_depth: drafts per request a probe round verifies (unpruned).
        probe_window: the most deferred (feature, token) pairs per request a probe round's EAGLE head reads: a
            request with more drafts from a scratch context of its newest ``probe_window`` pairs (at their true
            positions), rolled back after the round, and its whole queue is fed exactly when speculation resumes;
            0 feeds the whole queue at the probe. Without it a probe's catch-up grows with the rounds it waited
            (batch 16, 2 cores: an up-to-255-pair catch-up took 83 ms of a 130 ms probe), and the exact catch-up
            of every pair costs about the head's share of the target's FLOPs (~1.4%, estimated from parameter
            counts) whether or not speculation ever resumes.
        probe_pairs: the most deferred pairs a round's scratch contexts read over the whole batch: above
            ``probe_pairs / probe_window`` requests the per-request window shrinks to ``probe_pairs // B`` (at
            least 1; 0: no cap). With ``catch_up = "budget"`` speculative rounds read scratch contexts too (for
            every request not ranked in), so their total is capped rather than growing with the batch.
        probe_rows: the most requests a probe round verifies (0: all): every request drafts, so the next ``B*``
            sees each one's position-1 feature, but only a rotating subset of this many verifies its draft (the
            estimator learns from those); the rest decode plainly in the same forward. At batch 32 on 2 cores each
            verified row adds about 2 ms to the probe's target forward.
        resume_probes: probes in a row that must choose ``B* > 0`` before speculation resumes after a switch-off
            (the opening probe included); a probe that would resume earlier keeps speculation off and the next
            probe comes after ``probe_interval`` rounds off. Default 1: with ``catch_up = "budget"`` a resume pays
            the backlog of the requests the budget verifies only (batch 32, 1,024-round cells: 100-204 ms resumed
            rounds against 73-80 ms plain, sweep v19); 2 was the default while a resume paid every request's backlog (1.9-2.2
            s), and it cost the looping prompt at batch 1 its speed-up (1.07x with 1, 0.98x with 2, one run each).
        catch_up: which requests pay their deferred catch-up when speculation resumes. ``"budget"``: only those
            the budget ranked into its top-``B*`` slots in the round before (the probe that resumed speculation,
            then each speculative round); every other request with more than ``probe_window`` deferred pairs
            drafts from a scratch window as in a probe and keeps its queue, fed exactly in the round after the
            budget first ranks it in. ``"all"``: every request's whole queue is fed in the resuming round (at
            batch 32 after ~1,000 rounds off, 1.9-2.2 s against 80-85 ms plain). Without ``probe_window`` (0) or
            with Test-Time Speculation (which trains on the fed context) it is ``"all"``.
        online_overhead: learn the ms a round costs beyond the cost table's forwards from measured rounds.
        overhead_weight: weight of the newest residual in that exponential average.
        max_cost_samples: most ``(predicted, measured, calibrated)`` round times kept for the cost-model report.
        cost_table: path of a JSON cost table (:class:`~specadapt.budget.CostTable`), or ``None``; what a front
            end does with it (load or profile and save; load only) is its own.

    Raises:
        SettingError (a ValueError): a value out of range, naming the field.
    """

    estimator: EstimatorConfig = nested(EstimatorConfig)
    early_stop: bool = setting(True, flag="--av-no-early-stop", negate=True, fronts=("engine",),
                               help="draft every position even when the budget cannot verify it (default: model "
                                    "drafts stop a request's drafting at its first slot outside the budget; same "
                                    "caps, less work)")
    probe_interval: int = setting(4, flag="--av-probe-interval", fronts=("engine",),
                                  help="with speculation switched off: rounds before a probe round (one draft per "
                                       "request, verified) tests whether it pays again; doubles after each probe that "
                                       "keeps it off")
    probe_interval_max: int = setting(64, flag="--av-probe-interval-max", fronts=("engine",),
                                      help="cap of the doubling probe interval (worst case about 1 probe round in "
                                           "this many)")
    probe_share: float = setting(0.01, flag="--av-probe-share", fronts=("engine",), type=float,
                                 help="with speculation switched off, the share of decode time probes may cost: "
                                      "once a probe's extra time is measured, the wait between probes is at least "
                                      "what keeps them within this share of the plain rounds' time (past "
                                      "--av-probe-interval-max, up to 16x it; 0: only the doubling)")
    probe_depth: int = setting(1)
    probe_window: int = setting(32, flag="--av-probe-window", fronts=("engine",),
                                help="a probe round's EAGLE head drafts from each request's newest N deferred "
                                     "pairs (a scratch context, rolled back; the whole queue is fed exactly when "
                                     "speculation resumes), so a probe's cost does not grow with the rounds it "
                                     "waited; 0: feed the whole queue at the probe")
    probe_pairs: int = setting(256, flag="--av-probe-pairs", fronts=("engine",),
                               help="the most deferred pairs the scratch contexts of a round read over the whole "
                                    "batch: above N / --av-probe-window requests each request's window shrinks to "
                                    "N // batch (0: no cap)")
    probe_rows: int = setting(8, flag="--av-probe-rows", fronts=("engine",),
                              help="the most requests a probe round verifies (a rotating subset; every request "
                                   "still drafts, so the budget sees each one's draft confidence); 0: all")
    resume_probes: int = setting(1, flag="--av-resume-probes", fronts=("engine",),
                                 help="probes in a row that must find speculation pays before it resumes after a "
                                      "switch-off (with --av-catch-up all a resume pays every request's deferred "
                                      "catch-up at once: 2 keeps one noisy probe from triggering it); the opening "
                                      "probe counts as the first; each confirming probe comes after "
                                      "--av-probe-interval rounds off")
    catch_up: str = setting("budget", flag="--av-catch-up", choices=("budget", "all"), fronts=("engine",),
                            help="when speculation resumes, feed the deferred catch-up of only the requests the "
                                 "budget verifies ('budget'; the others draft from a scratch window of "
                                 "--av-probe-window pairs until it ranks them in) or of every request ('all')")
    online_overhead: bool = setting(True)
    overhead_weight: float = setting(0.1)
    max_cost_samples: int = setting(100_000)
    cost_table: str | None = setting(None, flag="--av-cost-table", metavar="PATH", type=str, help={
        "engine": "load the cost table from PATH if it exists, else profile it at start-up and save it there",
        "sglang": "target/draft cost table JSON (specadapt generate --av-cost-table writes one)",
    })

    def __post_init__(self) -> None:
        require(self.probe_interval >= 1, "probe_interval", f"must be >= 1, got {self.probe_interval}")
        require(self.probe_interval_max >= self.probe_interval, "probe_interval_max",
                f"must be >= {{probe_interval}} ({self.probe_interval}), got {self.probe_interval_max}",
                "probe_interval")
        require(0 <= self.probe_share < 1, "probe_share", f"must lie in [0, 1), got {self.probe_share}")
        require(self.probe_depth >= 1, "probe_depth", f"must be >= 1, got {self.probe_depth}")
        require(self.probe_window >= 0, "probe_window", f"must be >= 0, got {self.probe_window}")
        require(self.probe_pairs >= 0, "probe_pairs", f"must be >= 0, got {self.probe_pairs}")
        require(self.probe_rows >= 0, "probe_rows", f"must be >= 0, got {self.probe_rows}")
        check_choices(self)
        require(self.resume_probes >= 1, "resume_probes", f"must be >= 1, got {self.resume_probes}")
        require(0 < self.overhead_weight <= 1, "overhead_weight", f"must lie in (0, 1], got {self.overhead_weight}")
        require(self.max_cost_samples >= 0, "max_cost_samples", f"must be >= 0, got {self.max_cost_samples}")
