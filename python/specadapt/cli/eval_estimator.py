"""``specadapt eval-estimator``: AUC, log-loss and ECE (10 bins) of the acceptance estimator, overall and per
draft position, for the fitted estimator and for unfitted q_max, from a ``generate --log-drafts`` file."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ..estimator.config import EstimatorConfig
from ..settings import SettingError
from .common import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("eval-estimator", help="calibration of the acceptance estimator from a --log-drafts file",
                       description=__doc__.split("\n\n")[0].replace("``", ""),
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("log", metavar="PATH", help="JSON-lines file written by specadapt generate --log-drafts")
    p.add_argument("--min-refits", type=int, default=1,
                   help="use predictions made after this many refits (out of sample: fitted on earlier windows only)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the metrics as JSON")
    r = p.add_argument_group("replay (re-fit the estimator on the logged drafts with other settings)")
    r.add_argument("--replay", action="store_true",
                   help="re-run a fresh estimator over the logged rounds and score its predictions instead of the "
                        "logged ones (exact for logs of runs without --adaptive-verification)")
    defaults = EstimatorConfig()  # the estimator's own defaults (the engine's --av-* flags share them)
    r.add_argument("--refit-interval", type=int, default=defaults.refit_interval,
                   help="N: rounds between refits (replay)")
    r.add_argument("--damping", type=float, default=defaults.damping,
                   help="D of the evidence damping n/(n+D) (replay)")
    r.add_argument("--init-slope", type=float, default=defaults.init_slope, help="initial slope omega (replay)")
    r.add_argument("--init-intercept", type=float, default=defaults.init_intercept,
                   help="initial intercepts beta_k (replay)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..estimator.evaluation import evaluate_records, format_report, read_draft_log

    if args.min_refits < 0:
        raise UsageError(f"--min-refits must be >= 0, got {args.min_refits}")
    try:
        records = read_draft_log(args.log)
        if args.replay:
            records = _replay(records, args)
        result = evaluate_records(records, args.min_refits)
    except FileNotFoundError as exc:
        raise UsageError(f"PATH: {exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _replay(records: list[dict], args) -> list[dict]:
    from ..estimator import AcceptanceEstimator
    from ..estimator.evaluation import replay_records

    try:
        config = replace(EstimatorConfig(), refit_interval=args.refit_interval, damping=args.damping,
                         init_slope=args.init_slope, init_intercept=args.init_intercept)
    except SettingError as exc:  # names the field: report this command's flag (refit_interval -> --refit-interval)
        raise UsageError(exc.render(lambda field: "--" + field.replace("_", "-"))) from None
    positions = max(int(r["position"]) for r in records)
    estimator = AcceptanceEstimator.from_config(positions, config)
    replayed = replay_records(records, estimator)
    print(f"replayed {len(replayed)} drafts over {estimator.steps} rounds: {estimator.refits} refits, final slope "
          f"{estimator.slope:.3f}, intercepts {[round(b, 3) for b in estimator.intercepts.tolist()]}")
    return replayed
