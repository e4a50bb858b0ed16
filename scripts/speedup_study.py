#!/usr/bin/env python
"""End-to-end speedups over target-only decoding on the embedded default, in ONE process and one run.

Loads the target once on the chosen forward and weight format (default: native, --dtype auto = the GGUF's own
int4 model), measures the machine's copy bandwidth and GEMM rate, then decodes the same prompts (the first
--limit AIME 2024 problems, chat template, up to --max-new-tokens ending at the natural EOS) with target-only
decoding and with every configuration of the sweep, at each batch size. Target-only runs first and last (the
VM's speed drifts; both are reported). Sampled runs write different text (other lengths, other EOS), so each
speculative run is paired with target-only decoding of exactly its own output (``generate(forced=...)``: every
round still pays the target step, the sampling transform and verification), timed right after it: ``speedup`` is
that paired ratio; ``speedup_free`` the ratio to the free-running target-only runs. Every row: tokens, tok/s,
both speedups, acceptance length overall and per output-position bucket, the 3-gram repeat rate.

    python scripts/speedup_study.py --json results/speedup_study.json --markdown results/speedup_study.md
    python scripts/speedup_study.py --configs "ngram:L=3" "eagle:L=2" "eagle:L=2:tts=5" "eagle:L=3:gbv=2"

A configuration is ``DRAFT[:L=N][:tts=S[s]][:win=W][:gbv=K][:verify=RULE]`` (``tts=5s``: inline updates;
``win``: the TTS student's context window).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_CONFIGS = [
    "ngram:L=1", "ngram:L=2", "ngram:L=3", "ngram:L=5", "ngram:L=7",
    "eagle:L=1", "eagle:L=2", "eagle:L=3", "eagle:L=4",
    "eagle:L=2:tts=2", "eagle:L=2:tts=5", "eagle:L=2:tts=10",
    "eagle:L=2:gbv=2", "eagle:L=3:gbv=2",
]


def parse_config(text: str) -> dict:
    parts = text.split(":")
    out = {"draft": parts[0], "L": 3, "tts": None, "gbv": None, "verify": "chain", "label": text}
    for part in parts[1:]:
        key, _, value = part.partition("=")
        if key == "L":
            out["L"] = int(value)
        elif key == "tts":  # tts=S (background updates) or tts=Ss (inline updates at the boundary)
            out["tts_sync"] = value.endswith("s")
            out["tts"] = int(value.rstrip("s"))
        elif key == "win":  # the TTS student's context window (committed tokens it attends to)
            out["window"] = int(value)
        elif key == "gbv":
            out["gbv"] = int(value)
            out["verify"] = "gbv"
        elif key == "verify":
            out["verify"] = value
        else:
            raise SystemExit(f"unknown configuration field {key!r} in {text!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--forward", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()

    import torch

    from specadapt.bench.forward import measure_machine
    from specadapt.cli.engine_args import _tokenize, _warm_up, load_target_and_draft
    from specadapt.datasets import load_prompts
    from specadapt.engine import NoDraft, SpeculativeEngine, build_draft
    from specadapt.engine.metrics import acceptance_by_position, acceptance_length, ngram_repeat_rate
    from specadapt.engine.tts_bridge import EngineTTS
    from specadapt.sampling import SamplingParams
    from specadapt.tts import TTSConfig

    sampling = SamplingParams(args.temperature, args.top_p)
    target, _ = load_target_and_draft("smollm2-135m", "ngram", sampling, args.seed, args.dtype, "cpu",
                                      forward=args.forward)
    machine = measure_machine()
    prompts = [_tokenize(target.tokenizer, p.text) for p in load_prompts("aime24", None, args.limit)]
    seeds = [args.seed + i for i in range(len(prompts))]
    print(f"machine {machine['name']}: copy {machine['copy_gbps']:.1f} GB/s, fp32 GEMM "
          f"{machine['gemm_fp32_gflops']:.0f} GFLOP/s; target {target.forward_name} {target.weight_format}", flush=True)

    def run(engine, batch, forced=None):
        start = time.perf_counter()
        results = engine.generate(prompts, args.max_new_tokens, batch_size=batch, seeds=seeds, forced=forced)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output_ids) for r in results)
        rounds = [rd for r in results for rd in r.rounds]
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "outputs": [r.output_ids for r in results],
                "acceptance_length": acceptance_length(rounds),
                "acceptance_by_position": acceptance_by_position(rounds, (0, 256, 512, 1024, 2048)),
                "eos": sum(r.finished_by_eos for r in results),
                "repeat_rate": sum(ngram_repeat_rate(r.output_ids) or 0 for r in results) / len(results)}

    rows = []
    baselines = {}
    _warm_up(target, NoDraft())
    for batch in args.batches:
        baselines[batch] = [run(SpeculativeEngine(target, NoDraft(), sampling, 0, seed=args.seed), batch)]
        print(f"target-only batch {batch}: {baselines[batch][0]['tokens_per_s']:.1f} tok/s", flush=True)
    for text in args.configs:
        cfg = parse_config(text)
        for batch in args.batches:
            draft = build_draft(cfg["draft"], target, sampling, args.seed)
            tts = None
            if cfg["tts"]:
                tts_cfg = TTSConfig(stride=cfg["tts"], **({"context_window": cfg["window"]} if "window" in cfg else {}))
                tts = EngineTTS(draft, tts_cfg, sampling, max_requests=batch,
                                asynchronous=not cfg.get("tts_sync", False))
            engine = SpeculativeEngine(target, draft, sampling, cfg["L"], cfg["verify"], seed=args.seed,
                                       num_paths=cfg["gbv"] or 1, tts=tts)
            _warm_up(target, draft)
            row = run(engine, batch)
            if tts is not None:
                row["tts"] = tts.summary()
                tts.close()
            paired = run(SpeculativeEngine(target, NoDraft(), sampling, 0, seed=args.seed), batch,
                         forced=row["outputs"])
            row.update(config=text, batch=batch, paired_target_only_tokens_per_s=paired["tokens_per_s"],
                       speedup=paired["seconds"] / row["seconds"])
            rows.append(row)
            print(f"{text} batch {batch}: {row['tokens_per_s']:.1f} tok/s (paired target-only "
                  f"{row['paired_target_only_tokens_per_s']:.1f}: {row['speedup']:.2f}x), acceptance length "
                  f"{row['acceptance_length']:.2f}" + (f", TTS {row['tts']['updates']} updates, "
                                                        f"{row['tts']['train_seconds']:.1f} s training" if tts else ""),
                  flush=True)
    for batch in args.batches:  # target-only again: the VM's speed drifts
        baselines[batch].append(run(SpeculativeEngine(target, NoDraft(), sampling, 0, seed=args.seed), batch))
    for row in rows:
        base = sum(b["tokens_per_s"] for b in baselines[row["batch"]]) / 2
        row["speedup_free"] = row["tokens_per_s"] / base
        row.pop("outputs")
    for batch in args.batches:
        for b in baselines[batch]:
            b.pop("outputs")
    report = {"machine": machine, "target": {"forward": target.forward_name, "format": target.weight_format},
              "args": vars(args), "baselines": baselines, "rows": rows, "torch_threads": torch.get_num_threads()}
    lines = [f"Machine: {machine['name']}, {machine['threads']} threads, copy {machine['copy_gbps']:.1f} GB/s, "
             f"fp32 GEMM {machine['gemm_fp32_gflops']:.0f} GFLOP/s; target {target.forward_name} "
             f"{target.weight_format}, T={args.temperature}, top-p {args.top_p}, {args.limit} AIME 2024 prompts, "
             f"up to {args.max_new_tokens} tokens (natural EOS).", ""]
    for batch in args.batches:
        b0, b1 = baselines[batch]
        lines.append(f"Target-only, batch {batch}: {b0['tokens_per_s']:.1f} / {b1['tokens_per_s']:.1f} tok/s "
                     f"(first / last run), {b0['tokens']} / {b1['tokens']} tokens.")
    lines += ["", "| config | batch | tokens | EOS | tok/s | paired target-only tok/s | speedup | vs free target-only | "
              "acc. len | [0,256) | [256,512) | [512,1024) | [1024,2048) | repeat |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        buckets = {b["start"]: b["acceptance_length"] for b in r["acceptance_by_position"]}
        cells = " | ".join("-" if buckets.get(s) is None else f"{buckets[s]:.2f}" for s in (0, 256, 512, 1024))
        lines.append(f"| {r['config']} | {r['batch']} | {r['tokens']} | {r['eos']} | {r['tokens_per_s']:.1f} | "
                     f"{r['paired_target_only_tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['speedup_free']:.2f} | "
                     f"{r['acceptance_length']:.2f} | {cells} | {r['repeat_rate']:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
