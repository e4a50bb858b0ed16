#!/usr/bin/env python
"""Target-only decoding speed of each forward / weight format in ONE process, on exactly the same text.

The first format decodes the prompts freely (sampling, natural EOS or the length cap); every other format then
decodes exactly that text (``generate(forced=...)``: each round still runs the target step, the sampling
transform and verification), so the tokens/s ratios compare the same work. Prints the machine's copy bandwidth,
tokens/s per format and the ratio to the transformers float32 path.

    python scripts/target_only_formats.py --formats native:int4 native:int8 native:float32 hf:float32 \
        --limit 3 --max-new-tokens 256 --json results/target_only_formats.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["native:int4", "native:int8", "native:float32", "hf:float32"],
                    help="FORWARD:DTYPE entries; the first one samples the text the others replay")
    ap.add_argument("--limit", type=int, default=3, help="AIME 2024 prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    specs = []
    for entry in args.formats:
        forward, sep, dtype = entry.partition(":")
        if not sep or forward not in ("native", "hf"):
            raise SystemExit(f"--formats: entries are FORWARD:DTYPE with FORWARD native or hf, got {entry!r}")
        specs.append((forward, dtype))

    import torch

    from specadapt.bench.forward import measure_machine
    from specadapt.cli.engine_args import _tokenize, _warm_up, load_target_and_draft
    from specadapt.datasets import load_prompts
    from specadapt.engine import NoDraft, SpeculativeEngine
    from specadapt.sampling import SamplingParams

    sampling = SamplingParams(1.0, 0.95)
    machine = measure_machine()
    print(f"machine {machine['name']}: {machine['threads']} threads, copy {machine['copy_gbps']:.1f} GB/s, "
          f"torch {torch.__version__}", flush=True)
    rows, forced, prompts = [], None, None
    for forward, dtype in specs:
        target, _ = load_target_and_draft("smollm2-135m", "ngram", sampling, args.seed, dtype, "cpu", forward=forward)
        if prompts is None:
            prompts = [_tokenize(target.tokenizer, p.text) for p in load_prompts("aime24", None, args.limit)]
        _warm_up(target, NoDraft())
        engine = SpeculativeEngine(target, NoDraft(), sampling, 0, seed=args.seed)
        start = time.perf_counter()
        results = engine.generate(prompts, args.max_new_tokens, batch_size=args.batch_size,
                                  seeds=[args.seed + i for i in range(len(prompts))], forced=forced)
        seconds = time.perf_counter() - start
        if forced is None:
            forced = [r.output_ids for r in results]
        tokens = sum(len(r.output_ids) for r in results)
        rows.append({"forward": target.forward_name, "format": target.weight_format, "tokens": tokens,
                     "seconds": seconds, "tokens_per_s": tokens / seconds})
        print(f"{target.forward_name} {target.weight_format}: {tokens} tokens, {tokens / seconds:.1f} tok/s", flush=True)
        del target, engine
    reference = next((r for r in rows if r["forward"] == "hf" and r["format"] == "float32"), None)
    for r in rows:
        r["vs_hf_float32"] = r["tokens_per_s"] / reference["tokens_per_s"] if reference else None
        if reference:
            print(f"{r['forward']} {r['format']}: {r['vs_hf_float32']:.1f}x transformers float32")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
