"""The long-generation benchmark's report: run the chosen backend and assemble ``{"config", "requests", "summary",
"server_metrics"}`` (layout in ``scripts/bench_long_gen.py``), print it as a table, write it as JSON."""

from __future__ import annotations

import json
import math
import platform
import statistics
from pathlib import Path

from .client import run_http
from .embedded import run_embedded
from .options import ArgumentError, validate


def http_acceptance_by_position(records: list[dict], bucket_edges: str) -> list[dict] | None:
    """Acceptance length by output-position bucket from servers that return the tokens emitted by each round
    (``spec_round_emitted``): fills each such record's ``acceptance_by_position`` and returns the summary over all
    of their rounds, or ``None`` when no record has per-round counts."""
    from specadapt.engine import RoundRecord
    from specadapt.engine.metrics import acceptance_by_position

    edges = [int(x) for x in bucket_edges.split(",")]
    every = []
    for r in records:
        emitted = r.get("round_emitted")
        if not emitted:
            continue
        rounds, position = [], 0
        for e in emitted:
            rounds.append(RoundRecord(position=position, num_drafted=0, accepted=int(e) - 1, emitted=int(e)))
            position += int(e)
        r["acceptance_by_position"] = acceptance_by_position(rounds, edges)
        every += rounds
    return acceptance_by_position(every, edges) if every else None


def summarize(records: list[dict], wall: float, by_position: list[dict] | None = None,
              overall_acceptance: float | None = None) -> dict:
    """Totals over requests; fills each record's ``tokens_per_s``.

    Acceptance lengths over the requests whose acceptance length is known (``n_i`` tokens, ``a_i`` tokens per
    round, so ``n_i / a_i`` rounds): ``acceptance_length`` = total tokens / total rounds (the aggregate SGLang and
    ``specadapt generate`` report; ``overall_acceptance`` replaces it when the caller has every round, as the
    embedded engine does) and ``acceptance_length_token_weighted`` = sum n_i a_i / sum n_i (each request weighted by
    its output tokens). Seconds are wall clock; ``throughput_tok_s`` = output tokens / ``wall``.
    """
    for r in records:
        r["tokens_per_s"] = r["output_tokens"] / r["latency_s"] if r.get("latency_s") else None
    out_tokens = sum(r["output_tokens"] for r in records)
    latencies = sorted(r["latency_s"] for r in records if r.get("latency_s") is not None)
    known = [r for r in records if r.get("acceptance_length") and r["output_tokens"] > 0]
    acc_tokens = sum(r["output_tokens"] for r in known)
    acc_rounds = sum(r["output_tokens"] / r["acceptance_length"] for r in known)
    if overall_acceptance is None and acc_rounds > 0:
        overall_acceptance = acc_tokens / acc_rounds
    return {
        "requests": len(records),
        "output_tokens": out_tokens,
        "wall_seconds": wall,
        "throughput_tok_s": out_tokens / wall if wall > 0 else None,
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "latency_median_s": statistics.median(latencies) if latencies else None,
        "latency_p90_s": latencies[min(len(latencies) - 1, math.ceil(0.9 * len(latencies)) - 1)] if latencies else None,
        "acceptance_length": overall_acceptance,
        "acceptance_length_token_weighted": (
            sum(r["output_tokens"] * r["acceptance_length"] for r in known) / acc_tokens if acc_tokens else None
        ),
        "requests_with_acceptance": len(known),
        "acceptance_by_position": by_position,
    }


def print_report(report: dict) -> None:
    """A table per request and the summary, to stdout."""
    from specadapt.cli.report import fmt_value as _fmt
    from specadapt.cli.report import short_id
    header = f"{'id':<16} {'output':>7} {'latency s':>10} {'tok/s':>8} {'acc.len':>8} {'finish':>8}"
    print()
    print(header)
    print("-" * len(header))
    for r in report["requests"]:
        rid = short_id(str(r["id"]))
        print(f"{rid:<16} {r['output_tokens']:>7} {_fmt(r['latency_s']):>10} {_fmt(r['tokens_per_s'], '.1f'):>8} "
              f"{_fmt(r['acceptance_length']):>8} {str(r['finish_reason'] or '-'):>8}")
    s, c = report["summary"], report["config"]
    print()
    where = c.get("endpoint") or f"embedded {c.get('model')} draft {c.get('draft')}{' + TTS' if c.get('tts') else ''}"
    print(f"{where}  {c['dataset']}  max_tokens={c['max_tokens']}  T={c['temperature']}  top-p={c['top_p']}  "
          f"concurrency={c['concurrency']}")
    print(f"{s['requests']} requests  |  {s['output_tokens']} output tokens in {_fmt(s['wall_seconds'], '.1f')} s  |  "
          f"{_fmt(s['throughput_tok_s'], '.1f')} tok/s  |  latency mean {_fmt(s['latency_mean_s'])} s, "
          f"median {_fmt(s['latency_median_s'])} s")
    if c.get("chat_template_applied") is False:
        print("prompts sent as raw text to /generate (no chat template: pass --tokenizer to apply one)")
    if s["acceptance_length"] is None:
        print("acceptance length: - (no speculative metrics)")
    else:
        print(f"acceptance length {_fmt(s['acceptance_length'])} (tokens / rounds), "
              f"{_fmt(s['acceptance_length_token_weighted'])} (mean over requests weighted by tokens), "
              f"{s['requests_with_acceptance']} requests")
    if s.get("acceptance_by_position"):
        buckets = "  ".join(
            f"[{b['start']},{b['end'] if b['end'] is not None else ''}): {_fmt(b['acceptance_length'])}"
            for b in s["acceptance_by_position"] if b["rounds"]
        )
        print(f"acceptance length by output position: {buckets}")
    m = report.get("server_metrics")
    if m and m.get("after"):
        values = [x["value"] for x in m["after"].get("sglang:spec_accept_length", [])]
        if values:
            print(f"server gauge sglang:spec_accept_length after the run: {_fmt(statistics.fmean(values))}")


def write_json(report: dict, path: str) -> None:
    """Write ``report`` as indented JSON to ``path`` (parent folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


_HTTP_ONLY = ("base_url", "api", "timeout", "tokenizer", "no_meta_info", "scrape_metrics")
_EMBEDDED_ONLY = ("draft", "num_draft_tokens", "verify", "tts", "device", "dtype", "generate_args")


def run(args) -> dict:
    """Validate ``args`` (the parsed flags of ``scripts/bench_long_gen.py``), load the prompts, run the backend and
    assemble the report (its layout: the script's docstring and docs/bench_long_gen.md).

    Raises:
        ArgumentError: bad flags; BenchError: server failures.
    """
    from specadapt.datasets import DatasetError, load_prompts

    validate(args)
    try:
        prompts = load_prompts(args.dataset, args.prompt_field, args.limit or None)
    except DatasetError as exc:
        raise ArgumentError(f"--dataset: {exc}") from None
    other = _EMBEDDED_ONLY if args.backend == "openai" else _HTTP_ONLY
    config = {k: v for k, v in vars(args).items() if k not in ("no_progress", "api_key", *other)}
    metrics = None
    if args.backend == "openai":
        records, wall, extra, metrics = run_http(args, prompts)
        config["model"] = args.model
        summary = summarize(records, wall, http_acceptance_by_position(records, args.bucket_edges))
    else:
        records, wall, extra, by_position, overall = run_embedded(args, prompts)
        summary = summarize(records, wall, by_position, overall)
    config.update(extra)
    config.update(python=platform.python_version(), machine=platform.machine())
    summary["max_in_flight"] = extra.get("max_in_flight", min(args.concurrency, len(prompts)))
    if metrics is not None and metrics.get("after"):
        values = [x["value"] for x in metrics["after"].get("sglang:spec_accept_length", [])]
        summary["server_spec_accept_length_after"] = statistics.fmean(values) if values else None
    return {"config": config, "requests": records, "summary": summary, "server_metrics": metrics}

