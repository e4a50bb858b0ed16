"""``specadapt eval-estimator``: AUC, log-loss and ECE (10 bins) of the acceptance estimator, overall and per
draft position, for the fitted estimator and for unfitted q_max, from a ``generate --log-drafts`` file."""

from __future__ import annotations

import argparse
import json

from .common import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("eval-estimator", help="calibration of the acceptance estimator from a --log-drafts file",
                       description=__doc__.split("\n\n")[0].replace("``", ""),
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("log", metavar="PATH", help="JSON-lines file written by specadapt generate --log-drafts")
    p.add_argument("--min-refits", type=int, default=1,
                   help="use predictions made after this many refits (out of sample: fitted on earlier windows only)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the metrics as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..estimator.evaluation import evaluate_records, format_report, read_draft_log

    if args.min_refits < 0:
        raise UsageError(f"--min-refits must be >= 0, got {args.min_refits}")
    try:
        records = read_draft_log(args.log)
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
