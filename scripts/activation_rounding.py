"""The effect of the native forward's 8-bit activation rounding on a GGUF model: next-token distributions of the
native forward over the file's own blocks (``--dtype gguf``) against transformers' float32 forward of the same
weights de-quantised, teacher-forced over the same tokens (every position of the chat-templated prompts and of
their greedy continuations).

Reports the mean and 95th-percentile total-variation distance at T = 1 and the argmax agreement, per prompt and
overall, and writes JSON. The float32 model needs about 4 bytes a parameter (6 GB for the 1.5B coder).

    python scripts/activation_rounding.py --model qwen2.5-coder-1.5b --dataset livecodebench --limit 3 \\
        --new-tokens 128 --json results/activation_rounding_1.5b.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time

import torch
from tqdm import tqdm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a GGUF model spec (preset or .gguf path)")
    p.add_argument("--dataset", default="livecodebench", help="prompts (specadapt dataset name or .jsonl)")
    p.add_argument("--limit", type=int, default=3, help="prompts")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens appended to each prompt")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from specadapt.datasets import load_prompts
    from specadapt.engine import NoDraft, SpeculativeEngine
    from specadapt.engine.models import attach_forward, load_model
    from specadapt.sampling import SamplingParams

    native = load_model(args.model, file_blocks=True)
    attach_forward(native, "native", "gguf")
    prompts = load_prompts(args.dataset, limit=args.limit)
    sequences = []
    engine = SpeculativeEngine(native, NoDraft(), SamplingParams(0.0), 0)
    for prompt in prompts:
        ids = list(native.tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False))
        out = engine.generate([ids], args.new_tokens, batch_size=1)[0].output_ids
        sequences.append((prompt.id, ids, out))
    start = time.perf_counter()
    reference = load_model(args.model)  # transformers' float32 de-quantisation of the same file
    logging.info("float32 model loaded in %.0f s", time.perf_counter() - start)
    rows, all_tv, all_agree = [], [], []
    for pid, ids, out in tqdm(sequences, desc="teacher-forced"):
        seq = torch.tensor([ids + out])
        n = seq.shape[1]
        cache = native.new_cache(1, capacity=n + 1)
        ours = cache.forward(seq, torch.tensor([n]))[0]
        with torch.no_grad():
            theirs = reference.model(input_ids=seq).logits[0].float()
        tv = 0.5 * (torch.softmax(ours, -1) - torch.softmax(theirs, -1)).abs().sum(-1)
        agree = (ours.argmax(-1) == theirs.argmax(-1)).float()
        all_tv.append(tv)
        all_agree.append(agree)
        rows.append({"id": pid, "positions": int(tv.numel()), "mean_tv": tv.mean().item(),
                     "p95_tv": tv.quantile(0.95).item(), "argmax_agreement": agree.mean().item()})
        print(f"{pid}: {tv.numel()} positions, mean TV {tv.mean():.4f}, p95 {tv.quantile(0.95):.4f}, "
              f"argmax agreement {agree.mean():.3f}")
    tv, agree = torch.cat(all_tv), torch.cat(all_agree)
    summary = {"positions": int(tv.numel()), "mean_tv": tv.mean().item(), "p95_tv": tv.quantile(0.95).item(),
               "argmax_agreement": agree.mean().item()}
    print(f"all: {summary}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dataset": args.dataset, "new_tokens": args.new_tokens,
                       "machine": platform.processor() or platform.machine(), "prompts": rows, "summary": summary},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
