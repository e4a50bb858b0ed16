#!/usr/bin/env python
"""The Test-Time Speculation study: long generations with a draft, without and with TTS at several strides,
beside the ngram draft and the target-only baseline; tabulated per output-position bucket (per context-position
bucket with ``--session``).

Each setting is one `specadapt generate` run on the same prompts and sampling; the first (``ngram``) also runs
the target-only baseline (``--baseline``), whose tokens/s every row's speedup uses. Example (docs/tts.md):

    python scripts/tts_study.py --draft eagle --strides 1 2 5 10 --temperature 1.0 \
        --limit 3 --max-new-tokens 4096 --out results/tts_T1.0

Every request decodes the full --max-new-tokens (``--ignore-eos``), so each position bucket holds the same
requests in every setting. With ``--session N`` the study runs long sessions instead (``specadapt generate
--session N``: every answer ends at its natural EOS and the next problem is a new user turn until the context
is nearly full) and buckets acceptance by absolute context position 0-512-1K-2K-4K-8K, the regime of
docs/draft_training.md. ``--compare-drafts`` adds rows for other drafts (e.g. an older head file) without TTS.
Writes one JSON per setting under --out, the table to --out/table.md, and the acceptance-vs-position plot to
--out/acceptance.png (scripts/plot_acceptance.py).

    python scripts/tts_study.py --session 3 --limit 0 --strides 2 5 --max-new-tokens 2048 \
        --compare-drafts eagle:runs/eagle_old.safetensors --out results/sessions_aime24
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from specadapt.cli.long_gen.plot import acceptance_buckets, setting_label

TABLE_BUCKETS = [(0, 512), (512, 1024), (1024, 2048), (2048, 4096)]
FINE_EDGES = "0,256,512,768,1024,1536,2048,2560,3072,3584,4096,8192"
SESSION_BUCKETS = [(0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
SESSION_EDGES = "0,512,1024,2048,4096,8192"


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def bucket_acceptance(buckets: list[dict], start: int, end: int) -> float | None:
    """Acceptance length (tokens per round) over the fine buckets (``[{start, end, rounds, acceptance_length}]``)
    inside [start, end)."""
    rounds = tokens = 0.0
    for b in buckets:
        if b["start"] >= start and (b["end"] or 10**9) <= end and b["rounds"]:
            rounds += b["rounds"]
            tokens += b["rounds"] * b["acceptance_length"]
    return tokens / rounds if rounds else None


def table(reports: list[dict], baseline_tps: float | None, buckets=TABLE_BUCKETS, context: bool = False) -> str:
    """Markdown table, one row per report; bucket columns by output position, or by context position
    (``context``, long sessions)."""
    where = "context" if context else "output"
    head = ("| setting | acc. len | " + " | ".join(f"{where} [{a}, {b})" for a, b in buckets)
            + " | tok/s | end-to-end speedup vs target-only | repeat rate | tokens past first EOS"
              " | updates / skipped / rollbacks"
              " | publish wait s | TTS MB (x trainable) |")
    lines = [head, "|" + "---|" * (9 + len(buckets))]
    for r in reports:
        s, c = r["summary"], r["config"]
        t = c.get("tts_stats")
        counts = f"{t['updates']} / {t['skipped']} / {t['rollbacks']}" if t else "-"
        wait = _fmt(t["publish_wait_seconds"], ".1f") if t else "-"
        if t:
            mem = t["memory_bytes"]
            memory = f"{mem['total'] / 1e6:.1f} ({mem['total'] / mem['trainable']:.2f}x)"
        else:
            memory = "-"
        tps = s["tokens_per_s"]
        speedup = tps / baseline_tps if tps and baseline_tps else None
        lines.append(
            f"| {setting_label(r)} | {_fmt(s['acceptance_length'])} | "
            + " | ".join(_fmt(bucket_acceptance(acceptance_buckets(r, context), a, b)) for a, b in buckets)
            + f" | {_fmt(tps, '.1f')} | {_fmt(speedup)} | {_fmt(s['ngram_repeat_rate'])} | "
            f"{_fmt(s.get('share_past_first_eos'), '.1%')} | {counts} | {wait} | {memory} |"
        )
    if baseline_tps:
        lines.append(f"\ntarget-only baseline (same prompts, same run as the ngram row): {baseline_tps:.1f} tok/s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="eagle", help="the model draft adapted by TTS")
    ap.add_argument("--strides", nargs="*", type=int, default=[1, 2, 5, 10], help="TTS strides S to run")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dataset", default="aime24")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=4096)
    ap.add_argument("--num-draft-tokens", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=3)
    ap.add_argument("--session", type=int, default=0,
                    help="N > 0: N long sessions filled to the context (natural EOS, no --ignore-eos)")
    ap.add_argument("--compare-drafts", nargs="*", default=[], help="more drafts run without TTS (e.g. eagle:OLD_FILE)")
    ap.add_argument("--no-ngram", action="store_true", help="skip the ngram + target-only baseline run")
    ap.add_argument("--skip-existing", action="store_true", help="reuse JSON files already under --out")
    ap.add_argument("--out", default="results/tts_study")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="passed to every specadapt generate")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.session < 0:
        ap.error("--session must be >= 0")
    mode = (["--session", str(args.session), "--bucket-edges", SESSION_EDGES] if args.session
            else ["--bucket-edges", FINE_EDGES, "--ignore-eos"])
    common = ["--dataset", args.dataset, "--temperature", str(args.temperature), "--limit", str(args.limit),
              "--max-new-tokens", str(args.max_new_tokens), "--num-draft-tokens", str(args.num_draft_tokens),
              "--batch-size", str(args.batch_size), *mode, *args.extra]
    settings = [] if args.no_ngram else [("ngram", ["--draft", "ngram", "--baseline"])]
    for other in args.compare_drafts:
        settings.append((Path(other.split(":", 1)[-1]).stem if ":" in other else other, ["--draft", other]))
    settings.append((args.draft.replace(":", ""), ["--draft", args.draft]))
    for stride in args.strides:
        settings.append((f"{args.draft.replace(':', '')}_tts_S{stride}", ["--draft", args.draft, "--tts", "--tts-stride", str(stride)]))
    reports = []
    for name, flags in settings:
        path = out / f"{name}.json"
        if not (args.skip_existing and path.exists()):
            cmd = [sys.executable, "-m", "specadapt", "generate", *flags, *common, "--json", str(path)]
            print("$", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)
        reports.append(json.loads(path.read_text()))
    baseline = next((r["summary"]["baseline_tokens_per_s"] for r in reports if r["summary"].get("baseline_tokens_per_s")), None)
    md = table(reports, baseline, SESSION_BUCKETS if args.session else TABLE_BUCKETS, context=bool(args.session))
    (out / "table.md").write_text(md + "\n")
    print(md)
    plot = Path(__file__).with_name("plot_acceptance.py")
    subprocess.run([sys.executable, str(plot), *[str(out / f"{n}.json") for n, _ in settings],
                    "--out", str(out / "acceptance.png"), *(["--context"] if args.session else []), "--title",
                    f"{args.dataset}, T={args.temperature}, L={args.num_draft_tokens}, "
                    + (f"{args.session} sessions" if args.session else f"{args.limit} prompts")], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
