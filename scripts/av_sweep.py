#!/usr/bin/env python
"""Throughput sweep of adaptive verification against target-only decoding and every fixed draft length.

    python scripts/av_sweep.py --out results/av_sweep

Per dataset (default AIME 2024 and MATH-500 prompts) and batch size (default 1, 4, 8, 16, 32), T = 1.0, top-p
0.95, the embedded default on the engine's default forward and format (native int4 here), the shipped EAGLE
head: target-only, fixed L in {1, 2, 3, 5, 7}, and adaptive verification at L = 7 (with the default
``--speculation auto``: a budget of 0 switches speculation off, probe rounds switch it back on). Each cell is a
running batch kept full: a request ends at its natural EOS (or ``--max-new-tokens``) and the next prompt of the
list joins in its place (continuous batching, prompts cycled with fresh seeds), until ``--cell-tokens x batch``
tokens, and at least ``--min-cell-tokens``, were emitted; tokens/s = emitted tokens / wall time (prefills of joining requests included). Every cell of
one (dataset, batch) decodes the same prompt sequence with the same seeds. The cost table of adaptive
verification is profiled once per batch size on the forward in use, as the engine does at start-up.

Reports the machine's copy bandwidth and fp32 GEMM rate measured in the same run and the weight floor of one
target step (its weight bytes at the copy rate); per cell: tokens/s, speedup over target-only, ms per round and
its ratio to the weight floor, acceptance length (tokens per request-round), for AV the
share of rounds with speculation off, probe rounds, and the cost model's error against the measured round times;
per (dataset, batch) AV / max(target-only, best fixed L). With ``--same-text`` (default), every speculative cell is
followed by target-only decoding replaying that cell's own text (``forced`` requests, same order and refills):
its "speedup, same text" compares the two on the same contexts, so the ratio is free of how long the sampled
answers happened to be (at batch 1 that alone moves tokens/s by up to 20%); AV / reference is also given on
those speedups. With ``--lockstep`` (default) the cells of one (dataset, batch) -- and their same-text replays,
each just behind the cell it replays -- run side by side, one round of each engine in turn, every engine timed on
its own calls only: the host's drift (target-only tokens/s moved by 6% between cells minutes apart) hits every
setting alike, where cells run one after another (``--no-lockstep``) it did not. Cells where that ratio is within
``--close-margin`` of 1
are re-run ``--repeats-close`` times in total (AV and the reference) and reported as median and spread. Each AV
cell with a same-text replay also reports where its time over that replay went, by round kind (rounds off,
probes, speculative rounds, joins: ``extra_over_same_text`` in the JSON, one line per cell on stdout). A looping
workload (``--loop-prompt`` at T = 0.6) shows AV switching speculation on where drafts pay. Writes
``--out/sweep.json``, ``--out/table.md`` and ``--out/av_sweep.png`` (tokens/s vs batch size per setting).
Run nothing else on the machine meanwhile: two torch processes on two cores slow each other about tenfold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from specadapt.bench.forward import measure_machine  # noqa: E402
from specadapt.budget import CostTable  # noqa: E402
from specadapt.budget.config import AVConfig  # noqa: E402
from specadapt.cli.engine_args import _tokenize, load_target_and_draft  # noqa: E402
from specadapt.datasets import load_prompts  # noqa: E402
from specadapt.engine import NoDraft, SpeculativeEngine  # noqa: E402
from specadapt.engine.adaptive import AdaptiveVerification, profile_engine_costs  # noqa: E402
from specadapt.engine.loop import Request  # noqa: E402
from specadapt.estimator import AcceptanceEstimator  # noqa: E402
from specadapt.sampling import SamplingParams  # noqa: E402

LOOP_PROMPT = ("Write the word 'apple' one hundred times, separated by commas, and nothing else.")


class CellRun:
    """One cell's running batch, a round at a time: ``batch`` requests kept running (a request that ends is replaced
    by the next prompt of the list, cycled, with a fresh seed) until ``budget_tokens`` tokens were emitted.

    ``source``: this (target-only) run replays another run's text -- its requests in the order ``source`` started
    them, each forced to emit exactly the tokens ``source``'s request emitted (read live from that request's
    output, so the replay can run in lock-step just behind its source: a source round emits at least one token per
    row, a replay round exactly one), and ends where ``source`` ended. Only the engine's own calls (joins and
    rounds) are timed, so runs can be interleaved (:func:`run_lockstep`)."""

    def __init__(self, engine, prompts, batch, budget_tokens, max_new, seed, source=None):
        self.engine, self.prompts, self.batch, self.max_new, self.seed = engine, prompts, batch, max_new, seed
        self.budget_tokens, self.source = budget_tokens, source
        self.started, self.running, self.counter = [], [], 0
        self.emitted = self.row_rounds = self.rounds = self.finished = 0
        self.seconds = 0.0
        self.done = False
        # adaptive verification's time by round kind: kind -> [ms, rounds, tokens] (joins: [ms, joins, 0])
        self.adaptive = getattr(engine, "adaptive", None)
        self.kinds = {kind: [0.0, 0, 0] for kind in ("off", "probe", "on", "join")}

    def _fresh(self, count):
        out = []
        for _ in range(count):
            if self.source is not None:
                if self.counter >= len(self.source.started):
                    break
                src = self.source.started[self.counter]
                req = Request(src.prompt, src.max_new_tokens, src.seed, forced=src.result.output_ids)
            else:
                req = Request(self.prompts[self.counter % len(self.prompts)], self.max_new, self.seed + self.counter)
            out.append(req)
            self.started.append(req)
            self.counter += 1
        return out

    def _join(self, count):
        new = self._fresh(count)
        if not new:
            return
        t0 = time.perf_counter()
        self.engine.join(new)
        elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        self._count("join", elapsed, 0)
        self.running.extend(new)

    def _count(self, kind, seconds, tokens):
        entry = self.kinds[kind]
        entry[0] += 1e3 * seconds
        entry[1] += 1
        entry[2] += tokens

    def start(self):
        self.engine.open_batch()
        self._join(self.batch)

    def _replay_blocked(self) -> bool:
        """A replay row whose source has not emitted its next token yet (only once the source stopped: its
        request was left unfinished there); such rows are dropped, as the source dropped them."""
        short = [r for r in self.running if len(r.forced) <= len(r.result.output_ids)]
        if short and self.source.done:
            self.engine.cancel(short)
            self.running = [r for r in self.running if all(r is not x for x in short)]
        return bool(short) and not self.source.done

    def turn(self):
        """One round (and the refills it needs); sets :attr:`done` when the cell is complete."""
        if self.done:
            return
        if self.source is not None:
            if self._replay_blocked():
                return
            missing = self.batch - len(self.running)
            if missing:
                self._join(missing)
            if not self.running:
                self.done = self.source.done
                return
        t0 = time.perf_counter()
        events = self.engine.step()
        elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        self.rounds += 1
        self.row_rounds += len(events)
        tokens = sum(len(tokens) for _, tokens, _ in events)
        self.emitted += tokens
        if self.adaptive is not None:
            self._count(self.adaptive.round_kind, elapsed, tokens)
        done = sum(1 for _, _, d in events if d)
        self.finished += done
        if done:
            ended = [req for req, _, d in events if d]
            self.running = [r for r in self.running if all(r is not x for x in ended)]
        if self.source is None:
            if self.emitted >= self.budget_tokens:
                self.done = True  # no request joins (and prefills) after the last timed round
            elif done:
                self._join(done)

    def result(self):
        self.engine.close_batch()
        seconds = max(self.seconds, 1e-9)
        out = {"tokens": self.emitted, "seconds": self.seconds, "tokens_per_s": self.emitted / seconds,
               "rounds": self.rounds, "ms_per_round": 1e3 * self.seconds / max(self.rounds, 1),
               "acceptance_length": self.emitted / max(self.row_rounds, 1), "requests_finished": self.finished,
               "texts": [list(r.result.output_ids) for r in self.started
                         if r.result is not None and r.result.output_ids]}
        out["join_ms"] = self.kinds["join"][0]
        if self.adaptive is not None:
            out["time_by_kind"] = {kind: {"ms": ms, "rounds": n, "tokens": t} for kind, (ms, n, t) in self.kinds.items()}
        return out


def run_lockstep(runs):
    """Step ``runs`` one round each in turn (in list order: a replay must come after its source) until all are
    done: the host's drift over the minutes a cell lasts hits every run alike. Returns their results."""
    for run in runs:
        run.start()
    while not all(run.done for run in runs):
        for run in runs:
            run.turn()
    return [run.result() for run in runs]


def extra_over_same_text(cell, replay):
    """Where an adaptive-verification cell's time over target-only on its own text goes: per round kind (off,
    probe, on) its ms minus what the same-text replay spent per token on as many tokens, and its joins' ms minus
    the replay's; each also as a share of the cell's time. ``cell["time_by_kind"]`` and the replay's ``seconds``,
    ``tokens``, ``join_ms`` (:meth:`CellRun.result`)."""
    per_token = (1e3 * replay["seconds"] - replay["join_ms"]) / max(replay["tokens"], 1)
    total = 1e3 * cell["seconds"]
    out = {}
    for kind, entry in cell["time_by_kind"].items():
        if kind == "join":
            extra = entry["ms"] - replay["join_ms"]
        else:
            extra = entry["ms"] - entry["tokens"] * per_token
        out[kind] = {"rounds": entry["rounds"], "extra_ms": extra, "share": extra / max(total, 1e-9),
                     "ms_each": entry["ms"] / max(entry["rounds"], 1)}
    out["replay_ms_per_token"] = per_token
    return out


def _label(cells, dataset):
    """Mark ``cells`` with their dataset and print each AV cell's time over its replay by round kind."""
    for cell in cells:
        cell["dataset"] = dataset
        if "extra_over_same_text" in cell:
            _print_extra(cell)


def _print_extra(cell):
    parts = [f"{kind} {e['rounds']}x {e['ms_each']:.1f} ms, {100 * e['share']:+.2f}%"
             for kind, e in cell["extra_over_same_text"].items() if isinstance(e, dict) and e["rounds"]]
    print(f"  {cell['dataset']} batch {cell['batch_size']} {cell['setting']}: speedup on its text "
          f"{cell['speedup_same_text']:.3f}; over the replay by round kind: " + "; ".join(parts), flush=True)


def run_cell(engine, prompts, batch, budget_tokens, max_new, seed, forced=None):
    """Keep ``batch`` requests running (refill at EOS) until ``budget_tokens`` tokens were emitted.

    ``forced``: a target-only engine replays these outputs (one token list per request, in the order the other
    cell started them; its budget is their total): the same text, so the same contexts, as the cell that wrote
    them. The returned cell's ``texts`` holds every started request's output (for such a replay)."""
    if forced is not None:
        source = _FinishedSource(prompts, max_new, seed, forced)
        run = CellRun(engine, prompts, batch, 0, max_new, seed, source=source)
    else:
        run = CellRun(engine, prompts, batch, budget_tokens, max_new, seed)
    run.start()
    while not run.done:
        run.turn()
    return run.result()


class _FinishedSource:
    """A finished run's texts, as a :class:`CellRun` replay source (sequential replays)."""

    def __init__(self, prompts, max_new, seed, texts):
        self.done = True
        self.started = []
        for i, text in enumerate(texts):
            req = Request(prompts[i % len(prompts)], len(text), seed + i)
            req.result = SimpleNamespace(output_ids=text)
            self.started.append(req)


def av_over_reference(cells):
    """(reference cell, AV / reference tokens/s): the reference is the fastest of every cell but the last (AV)."""
    reference = max(cells[:-1], key=lambda c: c["tokens_per_s"])
    return reference, cells[-1]["tokens_per_s"] / reference["tokens_per_s"]


def make_engine(target, draft, sampling, L, costs, refit, seed, av_config=None):
    """A target-only engine (``L = 0``), a fixed-L engine, or (``costs`` given) an AV engine with ``av_config``
    (default settings when ``None``)."""
    if L == 0:
        return SpeculativeEngine(target, NoDraft(), sampling, 0, "chain", seed=seed), None
    av = None
    if costs is not None:
        av = AdaptiveVerification(AcceptanceEstimator(L, refit_interval=refit), costs,
                                  AVConfig() if av_config is None else av_config)
    return SpeculativeEngine(target, draft, sampling, L, "chain", seed=seed, adaptive=av), av


def measure(target, draft, sampling, name, L, costs, prompts, batch, args):
    engine, av = make_engine(target, draft, sampling, L, costs, args.refit_interval, args.seed, args.av_config)
    cell = run_cell(engine, prompts, batch, max(args.cell_tokens * batch, args.min_cell_tokens), args.max_new_tokens,
                    args.seed)
    texts = cell.pop("texts")
    cell.update(setting=name, batch_size=batch)
    if av is not None:
        cell.update(rounds_off_share=av.rounds_off / max(av.rounds, 1), probe_rounds=av.probe_rounds,
                    verified=av.verified, pruned=av.pruned, cost_model=av.cost_model_error())
    if L > 0 and args.same_text:
        # target-only decoding of this cell's own text, right after it: the same contexts, so a ratio free of
        # the text's length (at batch 1 two samples' tokens/s differ by up to 20% from their lengths alone)
        replay = run_cell(make_engine(target, draft, sampling, 0, None, args.refit_interval, args.seed)[0],
                          prompts, batch, 0, args.max_new_tokens, args.seed, forced=texts)
        cell.update(same_text_target_tokens_per_s=replay["tokens_per_s"],
                    speedup_same_text=cell["tokens_per_s"] / replay["tokens_per_s"])
        if "time_by_kind" in cell:
            cell["extra_over_same_text"] = extra_over_same_text(cell, replay)
    elif L == 0:
        cell["speedup_same_text"] = 1.0
    return cell


_LOCKSTEP_DRAFTS: dict = {}  # (setting name, SamplingParams) -> its draft: engines side by side need their own


def measure_lockstep(target, sampling, chosen, costs, prompts, batch, args):
    """The cells of ``chosen`` settings (``(name, L, adaptive)``) run in lock-step (:func:`run_lockstep`): one
    round of each engine in turn, each with its own draft, and with ``--same-text`` each speculative engine
    followed by a target-only engine replaying its text as it is written. Returns the cells, in ``chosen``
    order, with the fields :func:`measure` gives."""
    from specadapt.engine import build_draft

    dtype = next(target.model.parameters()).dtype
    runs, plan = [], []
    budget = max(args.cell_tokens * batch, args.min_cell_tokens)
    for name, L, adaptive in chosen:
        draft = None
        if L > 0:  # one draft object per (setting, sampling), loaded once and restarted by each new engine
            key = (name, sampling)
            if key not in _LOCKSTEP_DRAFTS:
                _LOCKSTEP_DRAFTS[key] = build_draft(args.draft, target, sampling, args.seed, dtype=dtype)
            draft = _LOCKSTEP_DRAFTS[key]
        engine, av = make_engine(target, draft, sampling, L, costs if adaptive else None, args.refit_interval,
                                 args.seed, args.av_config)
        run = CellRun(engine, prompts, batch, budget, args.max_new_tokens, args.seed)
        runs.append(run)
        replay = None
        if L > 0 and args.same_text:
            plain = make_engine(target, None, sampling, 0, None, args.refit_interval, args.seed)[0]
            replay = CellRun(plain, prompts, batch, 0, args.max_new_tokens, args.seed, source=run)
            runs.append(replay)
        plan.append((name, L, av, run, replay))
    results = dict(zip(map(id, runs), run_lockstep(runs)))
    cells = []
    for name, L, av, run, replay in plan:
        cell = results[id(run)]
        cell.pop("texts")
        cell.update(setting=name, batch_size=batch, lockstep=True)
        if av is not None:
            cell.update(rounds_off_share=av.rounds_off / max(av.rounds, 1), probe_rounds=av.probe_rounds,
                        verified=av.verified, pruned=av.pruned, cost_model=av.cost_model_error())
        if replay is not None:
            again = results[id(replay)]
            cell.update(same_text_target_tokens_per_s=again["tokens_per_s"],
                        speedup_same_text=cell["tokens_per_s"] / again["tokens_per_s"])
            if "time_by_kind" in cell:
                cell["extra_over_same_text"] = extra_over_same_text(cell, again)
        elif L == 0:
            cell["speedup_same_text"] = 1.0
        cells.append(cell)
    return cells


def av_over_reference_same_text(cells):
    """(reference setting, AV / reference) where each cell's speed is its speedup over target-only on its own
    text: the reference is the best of target-only (1.0) and the fixed L cells."""
    reference = max(cells[:-1], key=lambda c: c.get("speedup_same_text", 0.0))
    return reference, cells[-1]["speedup_same_text"] / reference["speedup_same_text"]


def parse_av_settings(ap, pairs: list[str]) -> AVConfig:
    """``AVConfig`` with ``FIELD=VALUE`` overrides (``--av-set``; each value converted to the field's default's
    type); a bad pair is an argparse error naming it."""
    defaults, overrides = AVConfig(), {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not hasattr(defaults, name) or name == "estimator":
            ap.error(f"--av-set: {pair!r} is not FIELD=VALUE with FIELD an AVConfig setting")
        kind = type(getattr(defaults, name))
        if kind is bool:
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                ap.error(f"--av-set: {pair!r}: {value!r} is not true / false")
            overrides[name] = value.lower() in ("1", "true", "yes")
            continue
        if kind is type(None):  # an optional path (cost_table)
            kind = str
        try:
            overrides[name] = kind(value)
        except (TypeError, ValueError):
            ap.error(f"--av-set: {pair!r}: {value!r} is not a {kind.__name__}")
    try:
        return AVConfig(**overrides)
    except ValueError as exc:
        ap.error(f"--av-set: {exc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="eagle")
    ap.add_argument("--datasets", nargs="*", default=["aime24", "math500"],
                    help="prompt sets (none: only the looping prompt)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    ap.add_argument("--fixed-l", nargs="*", type=int, default=[1, 2, 3, 5, 7],
                    help="fixed draft lengths to compare (none: AV against target-only only)")
    ap.add_argument("--adaptive-l", type=int, default=7)
    ap.add_argument("--cell-tokens", type=int, default=384, help="tokens emitted per cell, per batch row")
    ap.add_argument("--min-cell-tokens", type=int, default=3072,
                    help="tokens a cell emits at least, in all (small batches: a 384-token cell at batch 1 lasts "
                         "about 2 s, and paired runs of it spread by 15%%)")
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="cap of one request (most end at EOS)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--refit-interval", type=int, default=20, help="estimator refit interval (rounds)")
    ap.add_argument("--repeats-close", type=int, default=3, help="runs of AV and its reference in close cells")
    ap.add_argument("--close-margin", type=float, default=0.05)
    ap.add_argument("--loop-prompt", default=LOOP_PROMPT, help="the looping workload ('' skips it)")
    ap.add_argument("--loop-temperature", type=float, default=0.6)
    ap.add_argument("--loop-batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--same-text", action=argparse.BooleanOptionalAction, default=True,
                    help="after every speculative cell, time target-only decoding replaying that cell's text "
                         "(speedup on the same text: both read the same contexts)")
    ap.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                    help="run a (dataset, batch)'s cells side by side, one round of each engine in turn (each "
                         "engine timed on its own calls), so the host's drift during the minutes a cell lasts hits "
                         "every setting alike; --no-lockstep runs the cells one after another")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--forward", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--av-set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="AV settings other than the defaults (AVConfig fields, e.g. catch_up=all resume_probes=1)")
    ap.add_argument("--out", default="results/av_sweep")
    args = ap.parse_args()
    args.av_config = parse_av_settings(ap, args.av_set)
    if args.cell_tokens < 1 or args.min_cell_tokens < 0:
        ap.error("--cell-tokens must be >= 1 and --min-cell-tokens >= 0")
    for flag in ("batch_sizes", "fixed_l"):
        if min(getattr(args, flag), default=1) < 1:
            ap.error(f"--{flag.replace('_', '-')} values must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    sampling = SamplingParams(args.temperature, args.top_p)
    target, draft = load_target_and_draft(args.model, args.draft, sampling, args.seed, args.dtype, "cpu",
                                          forward=args.forward)
    limits = measure_machine("cpu")  # the machine's own limits, measured in this run
    weight_bytes = target.native.weight_bytes if target.native is not None else None
    machine = {"cpu": limits["name"], "threads": torch.get_num_threads(), "torch": torch.__version__,
               "forward": target.forward_name, "weights": target.weight_format,
               "copy_gbps": limits["copy_gbps"], "gemm_fp32_gflops": limits["gemm_fp32_gflops"],
               "weight_mb": None if weight_bytes is None else weight_bytes / 1e6,
               # one target step reads every weight once: its floor at the measured copy byte rate (as
               # specadapt.bench.forward computes it)
               "weight_floor_ms": None if weight_bytes is None else weight_bytes / (limits["copy_gbps"] * 1e6)}
    print(f"machine: {machine}", flush=True)
    settings = [("target-only", 0, False)] + [(f"L={L}", L, False) for L in args.fixed_l]
    settings.append((f"AV L={args.adaptive_l}", args.adaptive_l, True))
    rows, summary = [], []
    total = len(args.datasets) * len(args.batch_sizes) * len(settings)
    bar = tqdm(total=total, desc="sweep", unit="cell")
    costs_by_batch: dict[int, CostTable] = {}
    for batch in args.batch_sizes:
        t0 = time.perf_counter()
        costs_by_batch[batch] = profile_engine_costs(target, draft, (args.adaptive_l + 1) * batch, batch,
                                                     args.adaptive_l)
        print(f"batch {batch}: cost table profiled in {time.perf_counter() - t0:.1f} s "
              f"(target 1 token {costs_by_batch[batch].verify_cost(1):.2f} ms, {batch} tokens "
              f"{costs_by_batch[batch].verify_cost(batch):.2f} ms, {(args.adaptive_l + 1) * batch} tokens "
              f"{costs_by_batch[batch].verify_cost((args.adaptive_l + 1) * batch):.2f} ms; draft round "
              f"{costs_by_batch[batch].draft_cost(batch):.2f} ms)", flush=True)
    for dataset in args.datasets:
        prompts = [_tokenize(target.tokenizer, p.text) for p in load_prompts(dataset)]
        for batch in args.batch_sizes:
            warm = make_engine(target, draft, sampling, 2, None, args.refit_interval, args.seed)[0]
            run_cell(warm, prompts, batch, 8 * batch, 16, args.seed + 10_000)  # warm-up, not timed
            cells = []
            if args.lockstep:
                cells = measure_lockstep(target, sampling, settings, costs_by_batch[batch], prompts, batch, args)
                _label(cells, dataset)
                bar.update(len(cells))
                bar.set_postfix(dataset=dataset, batch=batch, av_tps=f"{cells[-1]['tokens_per_s']:.1f}")
            for name, L, adaptive in settings if not args.lockstep else []:
                cell = measure(target, draft, sampling, name, L, costs_by_batch[batch] if adaptive else None,
                               prompts, batch, args)
                _label([cell], dataset)
                cells.append(cell)
                bar.update(1)
                bar.set_postfix(dataset=dataset, batch=batch, setting=name, tps=f"{cell['tokens_per_s']:.1f}")
            base = cells[0]["tokens_per_s"]
            for cell in cells:
                cell["speedup"] = cell["tokens_per_s"] / base
            reference, ratio = av_over_reference(cells)
            av_cell = cells[-1]
            entry = {"dataset": dataset, "batch_size": batch, "reference": reference["setting"],
                     "av_over_reference": ratio, "rounds_off_share": av_cell["rounds_off_share"],
                     "cost_model": av_cell["cost_model"]}
            same_ratio = None
            if args.same_text:
                same_ref, same_ratio = av_over_reference_same_text(cells)
                entry.update(reference_same_text=same_ref["setting"], av_over_reference_same_text=same_ratio)
            close = abs(ratio - 1) <= args.close_margin or (same_ratio is not None
                                                             and abs(same_ratio - 1) <= args.close_margin)
            if close and args.repeats_close > 1:
                ratios, same_ratios = [ratio], [same_ratio]
                ref_spec = next(s for s in settings if s[0] == reference["setting"])
                same_spec = next(s for s in settings if s[0] == entry.get("reference_same_text", "target-only"))
                for _ in range(args.repeats_close - 1):
                    if args.lockstep:  # AV and its references again, in lock-step
                        chosen = [ref_spec] + ([same_spec] if same_spec != ref_spec else []) + [settings[-1]]
                        rerun = measure_lockstep(target, sampling, chosen, costs_by_batch[batch], prompts, batch, args)
                        ref, again = rerun[0], rerun[-1]
                        same_ref = rerun[1] if same_spec != ref_spec else ref
                    else:
                        ref = measure(target, draft, sampling, ref_spec[0], ref_spec[1], None, prompts, batch, args)
                        again = measure(target, draft, sampling, av_cell["setting"], args.adaptive_l,
                                        costs_by_batch[batch], prompts, batch, args)
                        if args.same_text:
                            same_ref = ref if same_spec == ref_spec else measure(
                                target, draft, sampling, same_spec[0], same_spec[1], None, prompts, batch, args)
                    _label([again], dataset)
                    ratios.append(again["tokens_per_s"] / ref["tokens_per_s"])
                    if args.same_text:
                        same_ratios.append(again["speedup_same_text"] / same_ref["speedup_same_text"])
                entry.update(repeats=len(ratios), av_over_reference_runs=ratios,
                             av_over_reference_median=statistics.median(ratios),
                             spread=max(ratios) - min(ratios))
                if args.same_text:
                    entry.update(av_over_reference_same_text_runs=same_ratios,
                                 av_over_reference_same_text_median=statistics.median(same_ratios),
                                 spread_same_text=max(same_ratios) - min(same_ratios))
            summary.append(entry)
            rows.extend(cells)
    bar.close()
    loop_rows = []
    if args.loop_prompt:
        loop_sampling = SamplingParams(args.loop_temperature, args.top_p)
        from specadapt.engine import build_draft

        loop_draft = None if args.lockstep else build_draft(args.draft, target, loop_sampling, args.seed)
        prompt = [_tokenize(target.tokenizer, args.loop_prompt)]
        for batch in args.loop_batch_sizes:
            chosen = [settings[0], (f"L={args.adaptive_l}", args.adaptive_l, False)]
            if batch in costs_by_batch:
                chosen.append(settings[-1])
            if args.lockstep:
                cells = measure_lockstep(target, loop_sampling, chosen, costs_by_batch.get(batch), prompt, batch, args)
            else:
                cells = [measure(target, loop_draft, loop_sampling, name, L,
                                 costs_by_batch.get(batch) if adaptive else None, prompt, batch, args)
                         for name, L, adaptive in chosen]
            _label(cells, "loop")
            loop_rows.extend(cells)
    floor = (f"; weights {machine['weight_mb']:.0f} MB, one target step's weight floor "
             f"{machine['weight_floor_ms']:.2f} ms" if machine["weight_floor_ms"] else "")
    lines = [f"Machine: {machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}, "
             f"{machine['forward']} forward, {machine['weights']} weights; measured in this run: copy "
             f"{machine['copy_gbps']:.1f} GB/s, fp32 GEMM {machine['gemm_fp32_gflops']:.0f} GFLOP/s{floor}.", "",
             "| dataset | batch | setting | tok/s | speedup | speedup, same text | acc. length | ms / round (x weight floor) | rounds off | cost model (measured / predicted) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows + loop_rows:
        off = f"{100 * r['rounds_off_share']:.0f}% ({r['probe_rounds']} probes)" if "rounds_off_share" in r else ""
        cm = f"{r['cost_model']['median_ratio']:.2f}" if "cost_model" in r else ""
        speed = f"{r['speedup']:.2f}" if "speedup" in r else ""
        ms = f"{r['ms_per_round']:.1f}"
        if machine["weight_floor_ms"]:
            ms += f" ({r['ms_per_round'] / machine['weight_floor_ms']:.1f}x)"
        same = f"{r['speedup_same_text']:.3f}" if "speedup_same_text" in r else ""
        lines.append(f"| {r['dataset']} | {r['batch_size']} | {r['setting']} | {r['tokens_per_s']:.1f} | {speed} | "
                     f"{same} | {r['acceptance_length']:.2f} | {ms} | {off} | {cm} |")
    lines += ["", "| dataset | batch | reference (best of target-only, fixed L) | AV / reference | runs | "
                  "reference, same text | AV / reference, same text | runs | rounds off |",
              "|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        runs = (f"median {e['av_over_reference_median']:.3f}, spread {e['spread']:.3f} ({e['repeats']} runs)"
                if "repeats" in e else "1")
        same_ref = e.get("reference_same_text", "")
        same = f"{e['av_over_reference_same_text']:.3f}" if "av_over_reference_same_text" in e else ""
        same_runs = (f"median {e['av_over_reference_same_text_median']:.3f}, spread {e['spread_same_text']:.3f}"
                     if "av_over_reference_same_text_median" in e else ("1" if same else ""))
        lines.append(f"| {e['dataset']} | {e['batch_size']} | {e['reference']} | {e['av_over_reference']:.3f} | {runs} | "
                     f"{same_ref} | {same} | {same_runs} | {100 * e['rounds_off_share']:.0f}% |")
    md = "\n".join(lines)
    (out / "table.md").write_text(md + "\n")
    config = {k: v for k, v in vars(args).items() if k != "av_config"}
    (out / "sweep.json").write_text(json.dumps({"config": config, "machine": machine, "rows": rows,
                                                "summary": summary, "loop": loop_rows}, indent=2))
    print(md)
    if not args.datasets:
        return 0  # the looping prompt only: no tokens/s-vs-batch curve to draw
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.datasets), figsize=(5.5 * len(args.datasets), 4), squeeze=False)
        for ax, dataset in zip(axes[0], args.datasets):
            for name, _, adaptive in settings:
                pts = [(r["batch_size"], r["tokens_per_s"]) for r in rows if r["dataset"] == dataset and r["setting"] == name]
                ax.plot(*zip(*pts), marker="*" if adaptive else "o", lw=2.5 if adaptive else 1, label=name,
                        color="black" if name == "target-only" else None, ls="--" if name == "target-only" else "-")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_title(f"{dataset}, T = {args.temperature}, {machine['weights']} weights")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("total tokens/s")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "av_sweep.png", dpi=110)
        print(f"wrote {out / 'av_sweep.png'}")
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
