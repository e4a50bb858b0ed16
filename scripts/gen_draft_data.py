#!/usr/bin/env python
"""Generate the EAGLE head's training data: the target's own sampled answers to the training prompts with the
features the head reads, in resumable shards (specadapt.draft_train.data; the split in docs/draft_training.md).

    python scripts/gen_draft_data.py --out runs/draft_data --min-tokens 1000000

Re-running with the same --out resumes; a different configuration is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from specadapt.draft_train.data import GenerationConfig, generate_shards  # noqa: E402
from specadapt.draft_train.split import PROMPT_SETS, training_prompts  # noqa: E402


def parse_args(argv=None):
    d = GenerationConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model (embedded default or HF directory)")
    p.add_argument("--dtype", default="auto", help="target weight format on the native forward (auto = the engine default)")
    p.add_argument("--out", default=str(ROOT / "runs" / "draft_data"), help="data directory (resumed if it exists)")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens, help="generated tokens to reach")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--max-samples-per-prompt", type=int, default=d.max_samples_per_prompt)
    p.add_argument("--shard-sequences", type=int, default=d.shard_sequences)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="all",
                   help="training prompt set: MATH-500 [100, 500) and LiveCodeBench [32, 166) (all), or one of them")
    p.add_argument("--limit-prompts", type=int, default=None, help="use only the first N training prompts (tests)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  batch_size=args.batch_size, min_tokens=args.min_tokens,
                                  max_samples_per_prompt=args.max_samples_per_prompt,
                                  shard_sequences=args.shard_sequences, seed=args.seed)
    except ValueError as exc:
        print(f"gen_draft_data.py: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from specadapt.engine.eagle import default_feature_layers
    from specadapt.engine.models import ModelLoadError, attach_forward, file_blocks_for, load_model

    try:
        # a K-quant GGUF target (the Qwen2.5-Coder presets) runs on the file's own blocks, loaded without float32
        file_blocks = file_blocks_for(args.target, "native", args.dtype)
        target = load_model(args.target, dtype=torch.float32, file_blocks=file_blocks)
        fmt = attach_forward(target, "native", "gguf" if file_blocks else args.dtype)
    except (ModelLoadError, ValueError) as exc:
        print(f"gen_draft_data.py: error: --target / --dtype: {exc}", file=sys.stderr)
        return 2
    prompts = training_prompts(args.prompts)[: args.limit_prompts]
    layers = default_feature_layers(int(target.model.config.num_hidden_layers))
    logging.info("target %s (%s forward, %s), %d training prompts, feature layers %s, %d threads on %s",
                 args.target, target.forward_name, fmt, len(prompts), layers, torch.get_num_threads(),
                 platform.processor() or platform.machine())
    try:
        summary = generate_shards(target, prompts, args.out, config, layers)
    except ValueError as exc:  # a directory of another configuration
        print(f"gen_draft_data.py: error: --out: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
