#!/usr/bin/env python
"""Cost of the suffix draft's round (``--draft suffix``) against the target's decode step, in the same run.

Builds B histories from LiveCodeBench prompts tokenized with the target's tokenizer (each history a prompt
followed by the prompt again, so the draft matches long repeats as in a code session that re-emits its code),
grows each history one token a round for ``--rounds`` rounds (the next token of the repeated text, as an accepted
draft would), and times :meth:`SuffixDraft.propose` for the whole batch each round; then times the target's
1-token decode step for the same batch on the native forward at the histories' context, and the machine's read rate
(so the step is set against its weight floor). Prints both medians and their ratio (the issue's goal: a round's
draft <= 3% of a target step at batch 8).

    python scripts/bench_suffix.py --model qwen2.5-coder-1.5b --batch 8 --rounds 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="target (as specadapt generate --model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200, help="timed draft rounds")
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="L, the draft cap")
    ap.add_argument("--target-steps", type=int, default=10, help="timed target decode steps")
    ap.add_argument("--global-tokens", type=int, default=16384, help="--suffix-global-tokens")
    args = ap.parse_args(argv)
    for name in ("batch", "rounds", "num_draft_tokens", "target_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    import torch

    from specadapt.bench.forward import cpu_name, measure_machine
    from specadapt.datasets import load_prompts
    from specadapt.engine.models import attach_forward, file_blocks_for, load_model
    from specadapt.engine.native.cache import SlotKVCache
    from specadapt.engine.suffix import SuffixConfig, SuffixDraft

    target = load_model(args.model, file_blocks=file_blocks_for(args.model))
    attach_forward(target, "native", "auto")
    tok = target.tokenizer
    data = str(Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "livecodebench_v5_2408_2410.jsonl")
    texts = [p.text for p in load_prompts(data if os.path.exists(data) else "livecodebench", None,
                                          args.batch + 1)]
    sources = [tok(t)["input_ids"] for t in texts]
    draft = SuffixDraft(SuffixConfig(global_tokens=args.global_tokens))
    # one earlier request's output in the global index, as a server would hold
    draft.start([sources[-1][:8]])
    draft.propose([list(sources[-1])], torch.zeros(1, dtype=torch.int64), 1)
    draft.select(torch.zeros(0, dtype=torch.int64))
    histories = [list(s) for s in sources[:args.batch]]
    draft.start([list(h) for h in histories])
    cap = torch.full((args.batch,), args.num_draft_tokens, dtype=torch.int64)
    vocab = int(target.vocab_size)
    times, drafted = [], 0
    for step in range(args.rounds):
        start = time.perf_counter()
        proposal = draft.propose(histories, cap, vocab)
        times.append(time.perf_counter() - start)
        drafted += int(proposal.num_tokens.sum())
        for r, h in enumerate(histories):
            h.append(sources[r][step % len(sources[r])])
    draft_ms = 1e3 * statistics.median(times)
    context = max(len(h) for h in histories)
    kv = SlotKVCache(target.native, args.batch, context + args.target_steps + 2)
    kv.forward(torch.randint(vocab, (args.batch, context)), torch.full((args.batch,), context), logits_to_keep=1)
    steps = []
    for _ in range(args.target_steps):
        start = time.perf_counter()
        kv.forward(torch.randint(vocab, (args.batch, 1)), torch.ones(args.batch, dtype=torch.int64))
        steps.append(time.perf_counter() - start)
    step_ms = 1e3 * statistics.median(steps)
    machine = measure_machine("cpu")
    floor_ms = target.native.weight_bytes / (machine["read_gbps"] * 1e9) * 1e3
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"target {args.model}, batch {args.batch}, context ~{context} tokens; read {machine['read_gbps']:.1f} GB/s: "
          f"weight floor {floor_ms:.1f} ms a step")
    print(f"suffix draft round: median {draft_ms:.3f} ms over {args.rounds} rounds ({drafted / args.rounds:.1f} "
          f"drafts a round over the batch); target 1-token step: median {step_ms:.1f} ms ({step_ms / floor_ms:.2f}x the "
          f"floor); draft / step = "
          f"{draft_ms / step_ms:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
