"""Results of ``specadapt generate``: the JSON document and the table printed at the end of a run.

JSON layout::

    {"config": {...},
     "requests": [{"id", "prompt_tokens", "output_tokens", "rounds", "acceptance_length", "tokens_per_s",
                   "acceptance_by_position": [{"start", "end", "rounds", "acceptance_length"}],
                   "accept_rate_by_draft_position": [...], "ngram_repeat_rate", "finished_by_eos", "text"}],
     "summary": {"acceptance_length", "tokens_per_s", "baseline_tokens_per_s", "speedup", "end_to_end_speedup",
                 "prefill_tokens", "prefill_seconds", "prefill_tokens_per_s", "decode_seconds", "decode_tokens_per_s",
                 "baseline_prefill_tokens", "baseline_prefill_seconds", "baseline_prefill_tokens_per_s",
                 "baseline_decode_seconds", "baseline_decode_tokens_per_s", "ngram_repeat_rate",
                 "acceptance_by_position", "accept_rate_by_draft_position", "output_tokens", "rounds",
                 "seconds", "baseline_seconds", "baseline_ngram_repeat_rate",
                 "share_past_first_eos" (--ignore-eos runs; else null)}}

``tokens_per_s`` / ``seconds`` are end to end (output tokens over the whole run's wall time, prefill included).
``prefill_*`` and ``decode_*`` come from the engine's :class:`~specadapt.engine.loop.PhaseTimes`: prefill = the
joins (the prompts' target forward and the draft's own prefill), ``prefill_tokens`` the prompt tokens prefilled;
decode = the rounds, ``decode_tokens_per_s`` = tokens emitted per second of rounds. ``speedup`` is the ratio of
decode tokens/s (speculative over target-only), ``end_to_end_speedup`` the ratio of ``tokens_per_s`` (what
``speedup`` meant before prefill and decode were timed apart). The ``baseline_`` keys are the target-only run's;
every baseline key is null without ``--baseline``.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from ..engine.metrics import (
    acceptance_by_position,
    acceptance_length,
    accept_rate_by_draft_position,
    ngram_repeat_rate,
    tokens_past_first_eos,
)

__all__ = ["build_report", "print_report", "write_json"]


def _repeat_rate_over(results) -> float | None:
    hits = total = 0
    for res in results:
        rate = ngram_repeat_rate(res.output_ids)
        if rate is not None:
            n = len(res.output_ids) - 3
            hits += rate * n
            total += n
    return hits / total if total else None


def _phase_summary(phases, prefix: str = "") -> dict:
    """The summary's prefill / decode keys of one run's :class:`~specadapt.engine.loop.PhaseTimes` (all null for
    ``None``)."""
    return {
        f"{prefix}prefill_tokens": phases.prefill_tokens if phases is not None else None,
        f"{prefix}prefill_seconds": phases.prefill_seconds if phases is not None else None,
        f"{prefix}prefill_tokens_per_s": phases.prefill_tokens_per_s if phases is not None else None,
        f"{prefix}decode_seconds": phases.decode_seconds if phases is not None else None,
        f"{prefix}decode_tokens_per_s": phases.decode_tokens_per_s if phases is not None else None,
    }


def build_report(config, prompts, tokenizer, results, seconds, base_results, base_seconds, edges, num_draft_tokens,
                 eos_ids=None, phases=None, base_phases=None):
    """Assemble the JSON-able report of one run (see the module docstring for the layout). ``eos_ids`` (given for
    ``--ignore-eos`` runs) adds each request's ``tokens_past_first_eos`` and the summary's
    ``share_past_first_eos``: the share of output tokens generated after the first natural EOS. ``phases`` /
    ``base_phases``: the speculative and the target-only engine's
    :class:`~specadapt.engine.loop.PhaseTimes` of the run (``None``: the prefill / decode keys and ``speedup``,
    which is on decode tokens/s, are null)."""
    requests = []
    for prompt, res in zip(prompts, results):
        requests.append(
            {
                "id": prompt.id,
                "prompt_tokens": res.prompt_tokens,
                "output_tokens": len(res.output_ids),
                "rounds": len(res.rounds),
                "acceptance_length": acceptance_length(res.rounds),
                "tokens_per_s": len(res.output_ids) / res.seconds if res.seconds > 0 else None,
                "acceptance_by_position": acceptance_by_position(res.rounds, edges),
                "accept_rate_by_draft_position": accept_rate_by_draft_position(res.rounds, num_draft_tokens),
                "ngram_repeat_rate": ngram_repeat_rate(res.output_ids),
                "finished_by_eos": res.finished_by_eos,
                "text": tokenizer.decode(res.output_ids, skip_special_tokens=True),
            }
        )
        if eos_ids is not None:
            requests[-1]["tokens_past_first_eos"] = tokens_past_first_eos(res.output_ids, eos_ids)
    all_rounds = [r for res in results for r in res.rounds]
    out_tokens = sum(len(res.output_ids) for res in results)
    tps = out_tokens / seconds if seconds > 0 else None
    base_tps = None
    if base_results is not None and base_seconds:
        base_tps = sum(len(res.output_ids) for res in base_results) / base_seconds
    phase = _phase_summary(phases)
    base_phase = _phase_summary(base_phases if base_results is not None else None, "baseline_")
    decode_tps, base_decode_tps = phase["decode_tokens_per_s"], base_phase["baseline_decode_tokens_per_s"]
    summary = {
        "acceptance_length": acceptance_length(all_rounds),
        "tokens_per_s": tps,
        "baseline_tokens_per_s": base_tps,
        # on decode tokens/s (the rounds only): prefill, the same prompt forward in both runs, is left out
        "speedup": decode_tps / base_decode_tps if decode_tps and base_decode_tps else None,
        "end_to_end_speedup": tps / base_tps if tps and base_tps else None,
        **phase,
        **base_phase,
        "ngram_repeat_rate": _repeat_rate_over(results),
        "acceptance_by_position": acceptance_by_position(all_rounds, edges),
        "accept_rate_by_draft_position": accept_rate_by_draft_position(all_rounds, num_draft_tokens),
        "output_tokens": out_tokens,
        "rounds": len(all_rounds),
        "seconds": seconds,
        "baseline_seconds": base_seconds,
        "baseline_output_tokens": sum(len(r.output_ids) for r in base_results) if base_results else None,
        "baseline_ngram_repeat_rate": _repeat_rate_over(base_results) if base_results else None,
        "share_past_first_eos": (sum(r["tokens_past_first_eos"] for r in requests) / out_tokens
                                 if eos_ids is not None and out_tokens else None),
    }
    if "machine" not in config:  # generate records the CPU model and ISA (bench.forward.machine_label)
        config = dict(config, machine=f"{platform.machine()} {platform.processor() or ''}".strip())
    return {"config": config, "requests": requests, "summary": summary}


def short_id(text: str, width: int = 16) -> str:
    """``text`` cut to its last ``width - 1`` characters after an ellipsis when longer (table cells)."""
    return text if len(text) <= width else "…" + text[-(width - 1):]


def fmt_value(value, spec=".2f") -> str:
    """``value`` formatted with ``spec``, or ``-`` for ``None`` (table cells)."""
    return "-" if value is None else format(value, spec)


_fmt = fmt_value


def print_report(report: dict) -> None:
    """Print a per-request table and the summary to stdout."""
    header = f"{'id':<16} {'prompt':>7} {'output':>7} {'rounds':>7} {'acc.len':>8} {'tok/s':>8} {'repeat':>7}"
    print()
    print(header)
    print("-" * len(header))
    for req in report["requests"]:
        print(
            f"{short_id(str(req['id'])):<16} {req['prompt_tokens']:>7} {req['output_tokens']:>7} {req['rounds']:>7} "
            f"{_fmt(req['acceptance_length']):>8} {_fmt(req['tokens_per_s'], '.1f'):>8} "
            f"{_fmt(req['ngram_repeat_rate']):>7}"
        )
    s = report["summary"]
    cfg = report["config"]
    batch = cfg["batch_size"]
    if 0 < len(report["requests"]) < batch:  # fewer requests than --batch-size: say what actually ran together
        batch = f"{len(report['requests'])} (--batch-size {cfg['batch_size']})"
    print()
    print(
        f"target {cfg['model']}  draft {cfg['draft']}  verify {cfg['verify']}  L={cfg['num_draft_tokens']}  "
        f"T={cfg['temperature']}  top-p={cfg['top_p']}  batch={batch}  "
        f"forward {cfg.get('forward_used', '?')} {cfg.get('weight_format', '?')}"
    )
    if s["baseline_tokens_per_s"] is None:
        versus = "target-only: not run (add --baseline)"
    else:
        versus = (f"target-only {_fmt(s['baseline_tokens_per_s'], '.1f')} tok/s  |  decode speedup "
                  f"{_fmt(s.get('speedup'))}x (end to end {_fmt(s.get('end_to_end_speedup'))}x)")
    print(
        f"acceptance length {_fmt(s['acceptance_length'])}  |  {_fmt(s['tokens_per_s'], '.1f')} tok/s end to end  |  "
        f"{versus}  |  3-gram repeat rate {_fmt(s['ngram_repeat_rate'])}"
    )
    if s.get("decode_seconds") is not None:
        def phases(prefix):
            return (f"prefill {_fmt(s.get(prefix + 'prefill_tokens_per_s'), '.1f')} tok/s "
                    f"({s.get(prefix + 'prefill_tokens')} tokens, {_fmt(s.get(prefix + 'prefill_seconds'))} s), "
                    f"decode {_fmt(s.get(prefix + 'decode_tokens_per_s'), '.1f')} tok/s "
                    f"({_fmt(s.get(prefix + 'decode_seconds'))} s)")

        line = f"speculative: {phases('')}"
        if s.get("baseline_decode_seconds") is not None:
            line += f"  |  target-only: {phases('baseline_')}"
        print(line)
    buckets = "  ".join(
        f"[{b['start']},{b['end'] if b['end'] is not None else ''}): {_fmt(b['acceptance_length'])}"
        for b in s["acceptance_by_position"]
        if b["rounds"]
    )
    print(f"acceptance length by output position: {buckets}")
    if s.get("share_past_first_eos") is not None:
        print(f"--ignore-eos: {100 * s['share_past_first_eos']:.1f}% of the output tokens come after the first "
              f"natural EOS (text past the model's end of turn)")


def write_json(report: dict, path: str) -> None:
    """Write the report as indented JSON, creating parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
