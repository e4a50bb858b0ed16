"""Adaptive verification state: the online acceptance estimator and the per-request budget, round by round.

Per round: features ``logit(q_max)`` of the draft's q rows -> predicted acceptance -> survival; the number of
drafts each request verifies is its share of the global top-B* slots, with ``B*`` chosen from the PREVIOUS
round's survivals (exactness, see :mod:`specadapt.budget.budget`); after verification the outcomes train the
estimator. Used by the embedded engine (``specadapt.engine``) and the SGLang plugin (``specadapt.sglang``).

Which survivals choose the next ``B*`` (``budget_from_verified``, the engine's default): those of the slots the
round verified -- at least position 1 of every request that could draft, whose q row the draft always computes
-- and, beyond them up to the request's proposed depth, survivals extrapolated with the estimator at the feature
of the request's last such slot. That is the information early stop of drafting (:meth:`AdaptiveVerification.
draft_caps`) always has, so drafting with and without early stop choose the same ``B*`` round after round (with
equal costs) and hence verify the same caps; and a round with ``B* = 0`` still knows position 1 of every
request, so the budget can return from 0 (issue 19). Choosing it from the drafted slots only, as before, let
early stop ratchet ``B*`` down: slots early stop did not draft have survival 0, so ``B*`` could never exceed the
previous one, and one round with ``B* = 0`` stopped drafting for good.

Speculation off (issue 16, ``speculation="auto"``, the engine's default). ``B = 0`` is one of the budget's
options, costed as a plain target decode step (no draft work, :func:`~specadapt.budget.budget.choose_budget`'s
``zero_is_off``). After a round chose ``B* = 0``, the next rounds draft nothing at all
(:meth:`AdaptiveVerification.round_draft_limit` returns 0: the engine runs plain target steps and a model draft
defers its catch-up to the round drafting resumes). Probe rounds keep the estimator learning while speculation is
off: after ``probe_interval`` rounds off, one round drafts ``probe_depth`` token(s) per request and verifies them
unpruned; its survivals (position 1 known, extrapolated to L) choose the next ``B*`` as in any round. A probe that
leaves ``B* = 0`` doubles the wait before the next one, up to ``probe_interval_max`` (so a batch where speculation
never pays spends at most about one round in ``probe_interval_max`` probing); once a probe's extra time (its
deferred catch-up, draft step and extra verified tokens, over a plain round) has been measured, the wait is at
least what keeps probes within ``probe_share`` of the plain rounds' time (up to 16x ``probe_interval_max``; at
batch 32 on 2 cores a probe costs about 2 plain rounds, so 1% means about 200 rounds: probing every 64 rounds
cost 5% of the decode time); a round that speculates resets it to ``probe_interval``. The first round of an engine
(no ``B*`` yet) is a probe too (the opening probe: it does not double the wait). At a batch above ``probe_rows`` a
probe verifies a rotating subset of that many requests' drafts; every request drafts (the next ``B*`` ranks every
request's position-1 survival), the rest decode plainly. A probe's EAGLE head reads at most ``probe_window``
deferred pairs per request (a scratch context rolled back after the round,
:attr:`~specadapt.engine.drafts.Draft.probe_window`), so its cost no longer grows with its wait; the deferred
catch-up is then paid when speculation resumes, which therefore takes ``resume_probes`` probes in a row choosing
``B* > 0`` (the confirming ones ``probe_interval`` rounds apart), and with ``catch_up = "budget"`` only by the
requests the previous round's budget ranked into its slots (:attr:`AdaptiveVerification.budget_rows`); the others
draft from a scratch window, as in a probe, until a round ranks them in. Whether a round is off or a probe
depends only on earlier rounds, never on this round's drafted tokens (the exactness condition above).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..estimator import AcceptanceEstimator
from ..estimator.features import FEATURE_CLAMP, feature_from_probs
from .config import AVConfig
from .budget import allocate_prefixes, choose_budget, survival
from .costs import CostTable

__all__ = ["AdaptiveVerification"]


@dataclass
class AdaptiveVerification:
    """State of adaptive verification for one engine.

    Args (the constructor's; everything else is state):
        estimator: the online acceptance estimator (K = the engine's L); :meth:`from_config` builds it from
            ``config.estimator``.
        costs: target / draft cost table.
        config: the settings (:class:`~specadapt.budget.config.AVConfig`: early stop, probe intervals, online
            overhead, ...).
        prune: ``False`` runs the estimator without pruning (every draft verified), e.g. to log it at fixed L.
        draft_log: an open text file receiving one JSON line per verified draft (see
            :mod:`specadapt.estimator.evaluation`), or ``None``.
        budget_from_verified: choose the next ``B*`` from the verified slots' survivals (at least position 1
            of each request) extrapolated to the proposed depth (see the module docstring; the same in both
            early-stop modes); ``False`` ranks every proposed slot's survival (the SGLang plugin, whose draft
            always runs every step).
        speculation: ``"auto"``: a round with ``B* = 0`` turns speculation off until a probe round turns it on
            again (module docstring); ``"on"``: ``B = 0`` still pays the draft's round and drafting never stops
            (the SGLang plugin, whose draft graph always runs).

    Attributes:
        stale_budget: B* chosen from the previous round (``None`` before the first round: under
            ``speculation="auto"`` the first round is a probe, drafting ``probe_depth`` per request, all
            verified; otherwise it verifies every draft).
        pruned, verified: counters of draft tokens pruned / verified so far.
        rounds_off, probe_rounds: counters of rounds with speculation off / probe rounds so far.
        round_kind: what :meth:`round_draft_limit` made of the latest round: ``"off"``, ``"probe"`` (the opening
            probe included) or ``"on"`` (``None`` before the first round); benchmarks split time by it.
        budget_rows: ``[B] bool`` set by :meth:`plan` (``None`` from :meth:`round_draft_limit` until then): the
            requests of the round just planned that hold at least one of the top-``B*`` slots its survivals rank
            for the next round (all ``False`` when ``B* = 0``); only computed with ``config.catch_up = "budget"``
            (else ``None``), where the engine feeds the deferred catch-up of only these requests in the next
            speculative round.
        cost_samples: ``(table_ms, measured_ms, calibrated_ms)`` of recent rounds (:meth:`record_round_time`; at
            most ``config.max_cost_samples`` kept): the cost table's prediction, the measured wall time, and the
            prediction with the learnt overhead, to check the cost model against the rounds it chose.
        overhead_ms: with ``config.online_overhead``, the ms a round costs beyond the table's forwards learnt
            from measured round times (sampling, verification, Python; separately for rounds with speculation off
            and on: an exponential average of measured - predicted with weight ``config.overhead_weight``, over
            steady rounds: not the first round, not probe rounds, which also pay a deferred catch-up), added to
            the budget's costs. Exact as any stale B*: it depends on earlier rounds only.

    Raises:
        ValueError: ``speculation`` not auto / on; ``config.probe_depth`` above the estimator's K.
    """

    estimator: AcceptanceEstimator
    costs: CostTable
    config: AVConfig = field(default_factory=AVConfig)
    prune: bool = True
    draft_log: object = None  # an open text file: one JSON line per verified draft (--log-drafts)
    budget_from_verified: bool = True
    speculation: str = "auto"
    stale_budget: int | None = field(default=None, init=False)
    pruned: int = field(default=0, init=False)
    verified: int = field(default=0, init=False)
    rounds: int = field(default=0, init=False)
    rounds_off: int = field(default=0, init=False)
    probe_rounds: int = field(default=0, init=False)
    round_kind: str | None = field(default=None, init=False)
    budget_rows: torch.Tensor | None = field(default=None, init=False)
    cost_samples: list = field(default_factory=list, init=False)
    overhead_ms: dict = field(default_factory=lambda: {"on": None, "off": None}, init=False)
    _plan_refits: int = field(default=0, init=False)
    _off_streak: int = field(default=0, init=False)
    _probe_wait: int = field(default=0, init=False)
    _probing: bool = field(default=False, init=False)
    _probe_cursor: int = field(default=0, init=False)  # the first row the next probe verifies (probe_rows)
    _positive_probes: int = field(default=0, init=False)  # probes in a row that chose B* > 0 (resume_probes)
    _held_wait: int | None = field(default=None, init=False)  # the probe wait before a held probe shortened it
    # probe_share: the measured extra ms of a probe round over a plain one (average), and a plain round's ms
    _probe_excess_ms: float | None = field(default=None, init=False)
    _plain_round_ms: float | None = field(default=None, init=False)
    _round_is_probe: bool = field(default=False, init=False)
    _round_limit: int | None = field(default=None, init=False)
    _predicted_ms: float | None = field(default=None, init=False)
    _off_round_ms: dict = field(default_factory=dict, init=False)  # batch size -> the table's cost of a round off
    # draft_caps' features of the positions drafted so far, and its num_drafts at step 0 (the proposed depths)
    _round_features: torch.Tensor | None = field(default=None, init=False)
    _round_proposed: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.speculation not in ("auto", "on"):
            raise ValueError(f"speculation must be 'auto' or 'on', got {self.speculation!r}")
        if self.config.probe_depth > self.estimator.num_positions:
            raise ValueError(f"probe_depth must be in [1, {self.estimator.num_positions}], got "
                             f"{self.config.probe_depth}")
        self._probe_wait = self.config.probe_interval
        self._predicted_off = False
        self._learn_round = True

    @classmethod
    def from_config(cls, num_positions: int, costs: CostTable, config: AVConfig | None = None,
                    **kwargs) -> "AdaptiveVerification":
        """Adaptive verification over ``num_positions`` (L) draft positions with a fresh estimator built from
        ``config.estimator``; ``kwargs``: the other constructor arguments (``prune``, ``draft_log``, ...)."""
        config = AVConfig() if config is None else config
        return cls(AcceptanceEstimator.from_config(num_positions, config.estimator), costs, config, **kwargs)

    @property
    def early_stop(self) -> bool:
        """Whether model drafts stop drafting rows whose next slot falls outside the budget (``config``'s)."""
        return self.config.early_stop

    @property
    def speculation_off(self) -> bool:
        """Whether the budget has turned speculation off (``B* = 0`` under ``speculation="auto"``)."""
        return self.speculation == "auto" and self.prune and self.stale_budget == 0

    def round_draft_limit(self) -> int | None:
        """Called once at the start of each round, before drafting: the most drafts a request may propose.

        Returns:
            ``None`` (no limit: speculation on), ``0`` (speculation off: no request drafts, no draft work at
            all) or ``probe_depth`` (a probe round: every request drafts that many, all verified; also the first
            round under ``speculation="auto"``, which has no survival to choose a budget from). See the module
            docstring; the answer depends on earlier rounds only.
        """
        self._probing = False
        self._round_limit = None
        self.budget_rows = None
        if self.stale_budget is None and self.speculation == "auto" and self.prune:
            # the opening probe: no survival is known yet, so the first round drafts probe_depth per request
            # instead of all L (verifying everything up front cost 10x a plain step at batch 8 on the shipped
            # head); its survivals choose the first B* as any probe's do
            self._off_streak = 0
            self._probing = True
            self.probe_rounds += 1
            self.round_kind = "probe"
            self._round_limit = self.config.probe_depth
            return self._round_limit
        if not self.speculation_off:
            self._off_streak = 0
            self.round_kind = "on"
            return None
        self._off_streak += 1
        if self._off_streak > self._probe_wait:
            self._off_streak = 0
            self._probing = True
            self.probe_rounds += 1
            self.round_kind = "probe"
            self._round_limit = self.config.probe_depth
        else:
            self.rounds_off += 1
            self.round_kind = "off"
            self._round_limit = 0
        return self._round_limit

    def scratch_window(self, batch: int) -> int | None:
        """The most deferred pairs per request a scratch context reads in a round of ``batch`` requests:
        ``probe_window``, shrunk to ``probe_pairs // batch`` (at least 1) when that is smaller; ``None`` without a
        window (``probe_window = 0``: the whole queue is fed)."""
        window = self.config.probe_window
        if not window:
            return None
        if self.config.probe_pairs and batch > 0:
            window = min(window, max(self.config.probe_pairs // batch, 1))
        return window

    def record_round_time(self, measured_ms: float) -> None:
        """The measured wall time of the round :meth:`plan` just costed (the engine calls it after the round)."""
        if self._predicted_ms is None:
            return
        mode = "off" if self._predicted_off else "on"
        calibrated = self._predicted_ms + self._overhead(mode)
        if len(self.cost_samples) < self.config.max_cost_samples:
            self.cost_samples.append((self._predicted_ms, float(measured_ms), calibrated))
        if self._round_is_probe and self._plain_round_ms is not None:
            excess = max(float(measured_ms) - self._plain_round_ms, 0.0)
            old = self._probe_excess_ms
            self._probe_excess_ms = excess if old is None else 0.5 * (old + excess)
            self._round_is_probe = False
        if self._learn_round:
            residual = float(measured_ms) - self._predicted_ms
            old = self.overhead_ms[mode]
            self.overhead_ms[mode] = residual if old is None else old + self.config.overhead_weight * (residual - old)
        self._predicted_ms = None

    def share_wait(self) -> int:
        """Rounds off a probe must wait for its measured extra ms over a plain round to be at most
        ``probe_share`` of the plain rounds' ms it waits (0 while no probe has been measured, or without a
        share)."""
        if self.config.probe_share > 0 and self._probe_excess_ms and self._plain_round_ms:
            return math.ceil(self._probe_excess_ms / (self.config.probe_share * self._plain_round_ms))
        return 0

    def probe_wait_cap(self) -> int:
        """The most rounds off between probes: ``probe_interval_max``, raised (to at most 16x it) to
        :meth:`share_wait`."""
        return min(max(self.config.probe_interval_max, self.share_wait()), 16 * self.config.probe_interval_max)

    def next_probe_wait(self) -> int:
        """The wait after a probe that left ``B* = 0``: the current wait doubled (up to ``probe_interval_max``),
        but never less than :meth:`share_wait` (up to :meth:`probe_wait_cap`): once a probe's cost has been
        measured the wait jumps to what keeps probing within ``probe_share`` of the decode time, instead of
        doubling towards it (at batch 32 on 2 cores a probe costs about 2 plain rounds, so a 1% share means
        about 200 rounds between probes; the doubling from 4 spent 3-4% of a 384-round cell on probes)."""
        doubled = min(2 * self._probe_wait, self.config.probe_interval_max)
        return min(max(doubled, self.share_wait()), self.probe_wait_cap())

    def _overhead(self, mode: str) -> float:
        """The learnt overhead of a round with speculation ``mode`` (``on`` / ``off``); 0 while unmeasured or
        without ``online_overhead``.

        An unmeasured ``off`` is 0, not ``on``'s: borrowing ``on``'s overhead (which holds the draft's Python
        work) priced the plain step as dear as a speculative one, so a batch that never switched off never
        measured what off costs (measured: 0% of rounds off at batch 1 and 4, acceptance 1.3, at 0.5-0.75x
        target-only). Optimism here makes the budget try speculation off; its first rounds measure the real
        overhead, and probe rounds switch speculation back on if that was wrong."""
        if not self.config.online_overhead:
            return 0.0
        value = self.overhead_ms[mode]
        return 0.0 if value is None else value

    def cost_model_error(self) -> dict:
        """How well the cost table predicted the rounds it chose (:attr:`cost_samples`).

        Returns:
            ``{"rounds", "median_ratio"`` (median of measured / table-predicted ms), ``"median_abs_rel_error"``
            (median of |measured - predicted| / measured, table alone), ``"calibrated_median_ratio",
            "calibrated_median_abs_rel_error"`` (the same with the learnt overhead), ``"mean_predicted_ms",
            "mean_measured_ms", "overhead_ms"}``; zeros when no round was recorded.
        """
        import statistics

        rows = [(p, m, c) for p, m, c in self.cost_samples if p > 0 and m > 0 and c > 0]
        if not rows:
            return {"rounds": 0, "median_ratio": 0.0, "median_abs_rel_error": 0.0, "calibrated_median_ratio": 0.0,
                    "calibrated_median_abs_rel_error": 0.0, "mean_predicted_ms": 0.0, "mean_measured_ms": 0.0,
                    "overhead_ms": dict(self.overhead_ms)}
        return {
            "rounds": len(rows),
            "median_ratio": statistics.median(m / p for p, m, _ in rows),
            "median_abs_rel_error": statistics.median(abs(m - p) / m for p, m, _ in rows),
            "calibrated_median_ratio": statistics.median(m / c for _, m, c in rows),
            "calibrated_median_abs_rel_error": statistics.median(abs(m - c) / m for _, m, c in rows),
            "mean_predicted_ms": statistics.fmean(p for p, _, _ in rows),
            "mean_measured_ms": statistics.fmean(m for _, m, _ in rows),
            "overhead_ms": dict(self.overhead_ms),
        }

    def plan(self, draft_probs: torch.Tensor, num_drafts: torch.Tensor):
        """Decide how many drafts each request verifies.

        Args:
            draft_probs: ``[B, L, V]`` q rows of the proposal.
            num_drafts: ``[B]`` drafts proposed.

        Also chooses the ``B*`` of the next round (module docstring), also when the proposal has width 0
        (every row stopped by :meth:`draft_caps` at position 1: the features it computed there are used).

        Returns:
            ``(num_verify [B] int64, features [B, L], predictions [B, L])``.
        """
        batch, width = draft_probs.shape[:2]
        if width == 0:
            return self.plan_features(torch.zeros(batch, 0), num_drafts)
        return self.plan_features(feature_from_probs(draft_probs), num_drafts)

    def plan_features(self, features: torch.Tensor, num_drafts: torch.Tensor):
        """:meth:`plan` from precomputed ``[B, L]`` features (CPU), e.g. computed where the q rows live, or a draft's
        own confidence; clamped to the estimator's range ``[-FEATURE_CLAMP, FEATURE_CLAMP]`` here."""
        features = features.float().clamp(-FEATURE_CLAMP, FEATURE_CLAMP)
        if self._round_limit == 0 and not self._probing:
            return self._plan_off_round(features, num_drafts)
        return self._plan_general(features, num_drafts)

    def _plan_general(self, features: torch.Tensor, num_drafts: torch.Tensor):
        """:meth:`plan_features` of a round that drafted (or could have): survivals, caps and the next ``B*``."""
        predictions = self.estimator.predict(features)
        surv = survival(predictions, num_drafts)
        self._plan_refits = self.estimator.refits
        probing = self._probing
        opening = self.stale_budget is None  # the engine's first round (under "auto", the opening probe)
        if self.stale_budget is None or not self.prune or probing:
            num_verify = num_drafts.clone()  # a probe round verifies what it drafted (probe_depth per request)
            if probing and 0 < self.config.probe_rows < num_verify.shape[0]:
                num_verify = self._probe_subset(num_verify)
        else:
            num_verify = torch.minimum(allocate_prefixes(surv, self.stale_budget), num_drafts)
        # with early stop the draft runs only as deep as the budget reaches: cost the depth (L = estimator's K)
        depth_cost = self.estimator.num_positions
        steps = depth_cost if self.config.early_stop else None
        self._predicted_ms = self._round_cost(num_drafts.shape[0], features.shape[1], int(num_verify.sum()))
        self._predicted_off = self._round_limit == 0
        # a probe pays the deferred catch-up of every round it was off, the first round catches up the prompts
        # (and, without "auto", verifies all L): neither is a steady round, so neither teaches the overhead
        # (they are still recorded in cost_samples)
        # The round a probe resumed speculation in (it feeds every request's backlog, ~1-2 s at batch 32 after
        # 1,000 rounds off) IS learnt: it prices later B > 0 high, which switches a resume that did not pay off at
        # once. Not learning it was measured (2026-12-06): the loop at batch 1 0.99x -> 1.03x target-only, but
        # batch 32 0.97x -> 0.93x (19 unpaid speculative rounds a cell instead of 2); kept until resumes are
        # costed per request.
        self._learn_round = not probing and not opening
        if self.budget_from_verified:
            # draft_caps' features / proposed depths when early stop ran this round; else the proposal's own
            known = self._round_features if self._round_features is not None else features
            proposed = self._round_proposed if self._round_proposed is not None else num_drafts
            if probing:  # a probe drafts probe_depth: extrapolate its rows to the full depth L
                proposed = torch.where(num_drafts > 0, torch.full_like(num_drafts, depth_cost), num_drafts)
            surv = self.extrapolated_survival(known, proposed, num_verify)
        self._round_features = self._round_proposed = None
        self.stale_budget = choose_budget(surv, self.costs, draft_steps=steps,
                                          zero_is_off=self.speculation == "auto", overhead_ms=self._overhead("on"),
                                          overhead_off_ms=self._overhead("off"))
        # the requests the next round's budget would verify (the same ranking with the same B*): with catch_up
        # "budget" only they pay their deferred catch-up in it (set from this round's rows only: exact)
        # (a second ranking of the slots: only when something reads it)
        if self.config.catch_up == "budget":
            self.budget_rows = torch.zeros(num_drafts.shape[0], dtype=torch.bool)
            if self.stale_budget > 0 and surv.shape[1] > 0:
                self.budget_rows = (allocate_prefixes(surv, self.stale_budget) > 0) & (surv[:, 0] > 0)
        self._round_is_probe = probing and not opening
        if self._round_is_probe:  # what a plain round of this batch would cost: the probe's extra time is over it
            self._plain_round_ms = self.costs.verify_cost(num_drafts.shape[0]) + self._overhead("off")
        held = False  # a probe chose B* > 0 but fewer than resume_probes in a row have: speculation stays off
        if probing:
            if self.stale_budget > 0:
                self._positive_probes += 1
                held = self._positive_probes < self.config.resume_probes
                if held:
                    self.stale_budget = 0
                    if self.budget_rows is not None:  # speculation stays off: no request is ranked in
                        self.budget_rows = torch.zeros_like(self.budget_rows)
                else:
                    self._positive_probes = 0  # speculation resumes: the next switch-off counts afresh
            else:
                self._positive_probes = 0
        if held:  # the confirming probe comes soon; if it fails, the backoff goes on from the wait before
            self._held_wait = self._probe_wait if self._held_wait is None else self._held_wait
            self._probe_wait = self.config.probe_interval
        elif probing and self.stale_budget == 0 and not opening:
            if self._held_wait is not None:
                self._probe_wait, self._held_wait = self._held_wait, None
            self._probe_wait = self.next_probe_wait()
        elif self._round_limit is None:
            self._probe_wait = self.config.probe_interval  # speculation ran: a later switch-off probes early again
        if self.stale_budget > 0:
            self._held_wait = None
        self._probing = False
        self._round_limit = None
        self.pruned += int((num_drafts - num_verify).sum())
        self.verified += int(num_verify.sum())
        return num_verify, features, predictions

    def _probe_subset(self, num_verify: torch.Tensor) -> torch.Tensor:
        """A probe's verified rows: ``probe_rows`` consecutive rows of the batch from a cursor that moves on by as
        many each probe (wrapping), so every row's draft is verified in turn; the others verify nothing. The
        choice depends on the probe count only, never on a drafted token (exact). ``[B] int64`` in and out."""
        batch, k = num_verify.shape[0], self.config.probe_rows
        rows = (self._probe_cursor + torch.arange(k)) % batch
        keep = torch.zeros(batch, dtype=torch.bool)
        keep[rows] = True
        self._probe_cursor = (self._probe_cursor + k) % batch
        return torch.where(keep, num_verify, torch.zeros_like(num_verify))

    def _plan_off_round(self, features: torch.Tensor, num_drafts: torch.Tensor):
        """:meth:`plan_features` of a round with speculation off: nothing was drafted, so no survival is known and
        the next ``B*`` stays 0 (what the general path computes from an empty survival table), the probe schedule
        is unchanged; only the round's cost is recorded. Skips the estimator and budget work (about 0.3 ms a
        round, a few % of a batch-1 target step on 2 cores)."""
        batch = num_drafts.shape[0]
        self._cost_off_round(batch)
        zeros = torch.zeros(batch, dtype=torch.int64)
        return zeros, features, torch.zeros(features.shape, dtype=torch.float64)

    def _cost_off_round(self, batch: int) -> None:
        """Cost a round with speculation off (for :meth:`record_round_time`); the next ``B*`` stays 0."""
        self._plan_refits = self.estimator.refits
        if batch not in self._off_round_ms:  # a plain target step of `batch` tokens (no draft work), interpolated
            self._off_round_ms[batch] = self.costs.verify_cost(batch)  # from the fixed table once per batch size
        self._predicted_ms = self._off_round_ms[batch]
        self._predicted_off = True
        self._learn_round = self.stale_budget is not None
        self._round_features = self._round_proposed = None
        self._round_limit = None

    def plain_round(self, batch: int) -> None:
        """A round with speculation off (:meth:`round_draft_limit` returned 0) that the engine ran as a plain
        target step without proposing: the bookkeeping :meth:`plan` and :meth:`observe` do for a round of zero
        drafts (its cost for :meth:`record_round_time`, the round and refit counts), without their tensors.

        Raises:
            RuntimeError: the round's limit was not 0 (a probe or speculation on must go through :meth:`plan`).
        """
        if self._round_limit != 0 or self._probing:
            raise RuntimeError("plain_round: this round's draft limit is not 0 (call plan / observe)")
        self._cost_off_round(batch)
        self.rounds += 1
        self.estimator.observe_nothing()

    def _round_cost(self, requests: int, drafted_depth: int, verified: int) -> float:
        """The cost model's ms for the round being planned: the draft's forwards (none when speculation is off;
        ``max(depth, 1)`` of ``L`` with early stop, else all ``L``) plus the target's forward over one token per
        request and the verified drafts."""
        if self._round_limit == 0:
            draft = 0.0
        else:
            steps = self.estimator.num_positions
            depth = min(max(drafted_depth, 1), steps) if self.config.early_stop else steps
            draft = self.costs.draft_depth_cost(requests, depth, steps)
        return draft + self.costs.verify_cost(requests + verified)

    def extrapolated_survival(self, features: torch.Tensor, proposed: torch.Tensor,
                              num_verify: torch.Tensor) -> torch.Tensor:
        """Survivals that choose the next ``B*`` (``budget_from_verified``): known slots, then extrapolated.

        Row ``r`` knows its first ``k_r = min(max(num_verify_r, 1), proposed_r, W)`` features (the verified
        slots, at least position 1); slot ``j >= k_r`` up to ``proposed_r`` is predicted with the feature of slot
        ``k_r - 1`` (``sigmoid(omega f + beta_j)``), the draft's confidence carried forward. A row with no known
        feature (``k_r = 0``) contributes nothing.

        Args:
            features: ``[B, W]`` features of the positions drafted this round (``W`` may be 0).
            proposed: ``[B]`` int64 depth each row proposed (before any early stop), ``<= L``.
            num_verify: ``[B]`` int64 drafts each row verifies this round.

        Returns:
            ``[B, max(proposed)]`` float64 survivals (0 past ``proposed`` and for rows without a known feature).
        """
        batch, known_width = features.shape[:2]
        width = int(proposed.max()) if proposed.numel() else 0
        if width == 0 or known_width == 0:
            return torch.zeros(batch, width, dtype=torch.float64)
        known = torch.minimum(torch.minimum(num_verify.clamp_min(1), proposed), torch.tensor(known_width))
        last = (known - 1).clamp_min(0)
        index = torch.minimum(torch.arange(width)[None, :], last[:, None]).clamp(max=known_width - 1)
        extended = features.to(torch.float64).gather(1, index)
        live = torch.where(known > 0, proposed, torch.zeros_like(proposed))
        return survival(self.estimator.predict(extended), live)

    def draft_caps(self, step: int, draft_probs: torch.Tensor, num_drafts: torch.Tensor,
                   lookahead: bool = True, features: torch.Tensor | None = None) -> torch.Tensor:
        """Early stop of drafting: how many positions each row drafts at most, decided after position ``step``.

        Called by a model draft after it computed the q rows of position ``step`` for every row (before any
        target work). With ``t`` the ``B*``-th largest survival of the slots known so far (positions
        ``<= step``; the final allocation ranks a superset of them with the same stale ``B*``, so its ``B*``-th
        largest is ``>= t``):

        - a row whose slot ``step`` has survival ``< t`` drops it and stops: cap ``step`` (the slot is never
          among the final top-``B*``, and neither is any later slot of its row: survival never increases);
        - look-ahead (ours): a row whose slot ``step + 1`` cannot reach ``t`` whatever its q row is -- its
          survival is at most ``S_step * sigmoid(|omega| * c + beta_{step+1})``, the feature being clamped to
          [-c, c] (``c`` = :data:`~specadapt.estimator.features.FEATURE_CLAMP`) -- stops after ``step``: cap ``step + 1``, and the draft skips the forward that would only
          have shown that slot ``step + 1`` is out of the budget.

        The caps :meth:`plan` then computes are the ones full drafting would give (every dropped slot is outside
        the final top-``B*``); only draft work and the target's forward width shrink. Decisions after position
        ``step`` depend on q rows ``<= step``, i.e. on the drafted tokens before ``step``, never on the token
        drawn at ``step`` (the exactness condition of spec section 1).

        Args:
            step: the position just drafted.
            draft_probs: ``[B, step + 1, V]`` q rows of positions ``0..step``.
            num_drafts: ``[B]`` int64 positions each row currently drafts (``> step`` = still drafting).
            lookahead: also stop rows whose next slot cannot be verified.
            features: ``[B, step + 1]`` the draft's own features of positions ``0..step`` (its ``confidence``,
                e.g. a greedy EAGLE head's temperature-1 confidence; clamped here as in :meth:`plan_features`),
                used instead of ``logit(q_max)`` of ``draft_probs``; the proposal's plan then reads the same.

        Returns:
            ``[B]`` int64 caps, ``<= num_drafts``.
        """
        batch = draft_probs.shape[0]
        keep = num_drafts > step
        if self.stale_budget is None or not self.prune or self._probing or not bool(keep.any()):
            return num_drafts.clone()
        if step == 0:
            self._round_proposed = num_drafts.clone()  # for plan(): the depth each row proposed
        if features is not None:
            features = features.to(torch.float32).clamp(-FEATURE_CLAMP, FEATURE_CLAMP)
            self._round_features = features
        else:
            features = self._draft_features(step, draft_probs)
        surv = survival(self.estimator.predict(features), torch.clamp(num_drafts, max=step + 1))  # [B, step+1]
        known = torch.arange(step + 1)[None, :] < torch.clamp(num_drafts, max=step + 1)[:, None]
        values = surv[known]
        budget = self.stale_budget
        if budget <= 0:
            threshold = float("inf")  # nothing can be verified
        elif values.numel() < budget:
            return num_drafts.clone()
        else:
            threshold = float(values.sort(descending=True).values[budget - 1])
        rows = torch.arange(batch)
        current = surv[rows, step]
        kept = keep & (current >= threshold)
        caps = torch.where(keep & ~kept, torch.full_like(num_drafts, step), num_drafts)
        if lookahead and step + 1 < self.estimator.num_positions:
            best_next = torch.sigmoid(torch.tensor(abs(self.estimator.slope) * FEATURE_CLAMP, dtype=torch.float64)
                                      + self.estimator.intercepts[step + 1])
            stop = kept & (num_drafts > step + 1) & ~(current * best_next >= threshold)
            caps = torch.where(stop, torch.full_like(num_drafts, step + 1), caps)
        self.pruned += int((num_drafts - caps).clamp_min(0).sum())  # never drafted: pruned
        return caps

    def _draft_features(self, step: int, draft_probs: torch.Tensor) -> torch.Tensor:
        """``[B, step + 1]`` features of the q rows drafted so far this round: positions ``< step`` come from the
        previous call (a draft calls :meth:`draft_caps` once per position, in order), only ``step`` is new."""
        cached = self._round_features
        if step > 0 and cached is not None and cached.shape == (draft_probs.shape[0], step):
            features = torch.cat([cached, feature_from_probs(draft_probs[:, step : step + 1])], dim=1)
        else:
            features = feature_from_probs(draft_probs)
        self._round_features = features
        return features

    def observe(self, features, predictions, accept_len, num_verify) -> None:
        """Feed verified outcomes back to the estimator: ``features [B, L]``, ``predictions [B, L]`` from
        :meth:`plan`, ``accept_len [B]`` (tau) and ``num_verify [B]`` (drafts verified) int64."""
        self.rounds += 1
        if features.shape[1] > 0 and self.draft_log is not None:
            self._log(features, predictions, accept_len, num_verify)
        # every round is a step of the estimator's refit schedule, also one that verified nothing (a width-0
        # proposal under early stop), so both early-stop modes refit at the same rounds
        self.estimator.observe(features, predictions, accept_len, num_verify)

    def _log(self, features, predictions, accept_len, num_verify) -> None:
        """One JSON line per verified draft up to and including the first rejection (the estimator's labels)."""
        import json

        for b in range(features.shape[0]):
            tau, n = int(accept_len[b]), int(num_verify[b])
            for k in range(min(tau + 1, n)):
                record = {"round": self.rounds, "row": b, "position": k + 1, "feature": float(features[b, k]),
                          "prediction": float(predictions[b, k]), "label": int(k < tau), "refits": self._plan_refits}
                self.draft_log.write(json.dumps(record) + "\n")
