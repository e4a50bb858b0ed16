#!/usr/bin/env python
"""Where a speculation round goes: wall-clock per engine component of one ``specadapt generate`` run.

Wraps the engine's methods with timers (inclusive times: a caller's total contains its callees'), runs the
``generate`` command given after ``--``, and prints calls, total and per-call milliseconds of each component:
the round (``engine.step`` per draft kind, so a ``--baseline`` run gives the target-only step beside it), the
slot-cache forwards by model and chunk width (``kv.forward:NativeLlama/w3`` = a target forward of 3 tokens),
the decoder stack (``run_layers:N3``; ``head`` for the EAGLE head's layer), the LM heads by vocabulary and rows,
the draft's proposal and its parts (catch-up feed, head step, sampling), the target's sampling transform
(``target_probs``) and verification, and per round kind the time inside specadapt's kernels (``kernels``: the
forwards, LM heads, sampling transform, verification) and the rest (``outside kernels``: the engine's own Python
and small tensor operations, which a faster forward does not shrink); then the machine's copy rate, measured
after the run, and each round kind's time as a multiple of the target's weight floor (its native weights read
once at that rate). Timers cost about a microsecond per call; the figures of one run compare
with each other, not with another machine's or another run's (these CPUs drift by 10-30% between runs).

    python scripts/profile_round.py -- --draft eagle --num-draft-tokens 2 --batch-size 1 --dataset aime24 \
        --limit 2 --max-new-tokens 256 --baseline --no-progress

Native forward only (the wrapped methods are those of ``specadapt.engine.native``); a ``--forward hf`` run
reports the round and draft parts only.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time


def _install_timers(totals: dict, counts: collections.Counter) -> None:
    """Replace the timed methods by wrappers that add their wall-clock time to ``totals[label]``."""
    import torch

    from specadapt import kernels
    from specadapt.engine import drafts, eagle_draft
    from specadapt.engine import loop as loop_mod
    from specadapt.engine.native import cache as cache_mod
    from specadapt.engine.native import model as model_mod

    def wrap(owner, name: str, label: str, key=None) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            full = label if key is None else f"{label}:{key(args)}"
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[full] += time.perf_counter() - start
                counts[full] += 1

        setattr(owner, name, timed)

    inside = {"step": None}  # the draft kind of the round running now (kernel time is split by it)

    def step_timed(original):
        def timed(*args, **kwargs):
            kind = type(args[0].draft).__name__
            inside["step"] = kind
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                inside["step"] = None
                totals[f"engine.step:{kind}"] += time.perf_counter() - start
                counts[f"engine.step:{kind}"] += 1
        return timed

    loop_mod.SpeculativeEngine.step = step_timed(loop_mod.SpeculativeEngine.step)
    # every specadapt kernel a round calls, summed per round kind: the round minus its kernels is the engine's own
    # Python and small tensor operations (the bookkeeping a faster forward does not shrink)
    ops = torch.ops.specadapt
    for name in ("native_llama_forward", "native_linear", "native_embedding", "sampling_probs", "sample_tokens",
                 "chain_verify", "block_verify", "gbv_verify"):
        if not hasattr(ops, name):
            continue

        def op_timed(*args, _op=getattr(ops, name), **kwargs):
            start = time.perf_counter()
            try:
                return _op(*args, **kwargs)
            finally:
                if inside["step"] is not None:
                    totals[f"kernels:{inside['step']}"] += time.perf_counter() - start

        setattr(ops, name, op_timed)
    wrap(cache_mod.SlotKVCache, "forward", "kv.forward",
         key=lambda a: _note_target(a[0].model) or f"{type(a[0].model).__name__}/w{a[1].shape[1]}")
    wrap(model_mod.NativeLlama, "run_layers", "run_layers",
         key=lambda a: f"N{a[1].shape[0]}" if a[0].num_layers > 1 else "head")
    wrap(model_mod.NativeLlama, "logits", "lm_head", key=lambda a: f"V{a[0].vocab_size}/M{a[1].shape[0]}")
    wrap(eagle_draft.EagleDraft, "propose", "draft.propose")
    wrap(eagle_draft.EagleDraft, "_feed_pending", "draft.feed")
    wrap(eagle_draft.EagleDraft, "_step", "draft.step")
    wrap(eagle_draft.EagleDraft, "_sample", "draft.sample")
    wrap(eagle_draft.EagleDraft, "commit", "draft.commit")
    wrap(drafts.NgramDraft, "propose", "ngram.propose")
    wrap(loop_mod, "_real_row_probs", "target_probs")
    wrap(kernels, "verify", "verify")


_TARGET: dict = {}  # the target's native model, seen at its first forward (its weight bytes set the floor)


def _note_target(model) -> None:
    if "model" not in _TARGET and getattr(model, "num_layers", 0) > 1 and hasattr(model, "weight_bytes"):
        _TARGET["model"] = model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [--min-calls N] -- GENERATE_ARGS...")
    ap.add_argument("--min-calls", type=int, default=3,
                    help="leave out components called fewer times (prefills, warm-up) (default: 3)")
    own, _, generate_args = _split(sys.argv[1:])
    args = ap.parse_args(own)
    if not generate_args:
        ap.error("give the `specadapt generate` arguments after --")
    import torch

    from specadapt.bench.forward import cpu_name, measure_machine

    totals: dict = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    _install_timers(totals, counts)
    from specadapt.cli import main as cli_main

    code = cli_main(["generate", *generate_args])
    print(f"\nper component (inclusive wall-clock; {cpu_name()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"{'component':42s} {'calls':>7s} {'total ms':>10s} {'ms/call':>9s}")
    for label in [k for k in totals if k.startswith("kernels:")]:  # per round, and the rest of the round
        kind = label.split(":", 1)[1]
        rounds, kernel_s = counts[f"engine.step:{kind}"], totals.pop(label)
        if rounds:
            totals[label], counts[label] = kernel_s, rounds
            totals[f"outside kernels:{kind}"] = totals[f"engine.step:{kind}"] - kernel_s
            counts[f"outside kernels:{kind}"] = rounds
    for label in sorted(totals, key=lambda k: -totals[k]):
        if counts[label] < args.min_calls:
            continue
        print(f"{label:42s} {counts[label]:7d} {totals[label] * 1e3:10.1f} {totals[label] / counts[label] * 1e3:9.3f}")
    if "model" in _TARGET:  # the machine's own limit, measured now: one read of the target's weights
        machine = measure_machine("cpu")
        floor_ms = _TARGET["model"].weight_bytes / (machine["copy_gbps"] * 1e9) * 1e3
        print(f"\nmachine: copy {machine['copy_gbps']:.1f} GB/s; target weight floor {floor_ms:.2f} ms "
              f"({_TARGET['model'].weight_bytes / 1e6:.0f} MB at the copy rate)")
        for label in [k for k in totals if k.startswith("engine.step:")]:
            per_round = totals[label] / counts[label] * 1e3
            print(f"{label:42s} {per_round:7.3f} ms = {per_round / floor_ms:5.2f}x the weight floor")
    return int(code or 0)


def _split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``(own args, "--", generate args)`` split at the first ``--``."""
    if "--" not in argv:
        return argv, "", []
    i = argv.index("--")
    return argv[:i], "--", argv[i + 1:]


if __name__ == "__main__":
    sys.exit(main())
