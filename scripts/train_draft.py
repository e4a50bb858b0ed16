#!/usr/bin/env python
"""Train the EAGLE-style draft head of the embedded default target (SmolLM2-135M-Instruct) on CPU.

Data: the target's own sampled generations (temperature 1.0, top-p 1, at most --max-new-tokens tokens) for
MATH-500 and LiveCodeBench prompts (never AIME 2024, the evaluation set), generated here with transformers'
``generate`` in bfloat16 (AMX makes bf16 3.5x faster than fp32 on these machines).

Teacher: one more target forward per sequence gives, at every position, the three fused hidden states the head
reads and the target's final (normed) hidden state; the teacher distribution over the draft vocabulary is
``softmax(h_final @ W_head[draft_vocab].T)``.

Loss: forward KL(p || q) to the target's distribution restricted and renormalised to the draft vocabulary,
i.e. soft-label cross-entropy. Why KL and not cross-entropy on the sampled tokens: the sampled token is one
draw from p, so its cross-entropy is an unbiased but far noisier estimate of the same objective; with the full
p available for free from the teacher pass, KL reaches the same optimum with less data, which is what a
one-hour CPU budget needs. Acceptance of speculative sampling is sum_x min(p, q) = 1 - TV(p, q), which KL
bounds through Pinsker.

Two unrolled steps per position (EAGLE-3's training-time test): step 1 reads target features; step 2 reads
the head's own step-1 output in place of them, attending to the step-1 keys of earlier positions and to itself,
exactly as drafting a second token does at inference. Step weights 1 and --step2-weight.

Reproducible: seeded; ``python scripts/train_draft.py`` writes
python/specadapt/data/eagle_smollm2_135m.safetensors (bf16, ~11 MB) and a JSON log beside --log.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from specadapt.datasets import load_prompts  # noqa: E402
from specadapt.engine.eagle import EagleHead, default_feature_layers, eagle_default_path, save_eagle_head  # noqa: E402
from specadapt.engine.models import load_model  # noqa: E402

logger = logging.getLogger("train_draft")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model (embedded default or HF directory)")
    p.add_argument("--math-prompts", type=int, default=192, help="MATH-500 prompts used")
    p.add_argument("--code-prompts", type=int, default=64, help="LiveCodeBench prompts used")
    p.add_argument("--max-new-tokens", type=int, default=384, help="length of each generation (<= 512)")
    p.add_argument("--gen-batch", type=int, default=16, help="generation batch size")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (most frequent tokens)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--step2-weight", type=float, default=0.8, help="loss weight of the second unrolled step")
    p.add_argument("--max-minutes", type=float, default=40.0, help="stop training after this much wall time")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=str(ROOT / "runs" / "train_draft_data.pt"), help="generated data cache")
    p.add_argument("--out", default=str(eagle_default_path()))
    p.add_argument("--log", default=str(ROOT / "runs" / "train_draft_log.json"))
    args = p.parse_args(argv)
    if not 1 <= args.max_new_tokens <= 512:
        p.error("--max-new-tokens must lie in [1, 512] (the head is trained on short generations)")
    return args


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def generate_data(args, target) -> list[dict]:
    """Sampled generations + teacher tensors, cached on disk (bf16)."""
    cache = Path(args.cache)
    if cache.exists():
        data = torch.load(cache)
        if data.get("args") == [args.math_prompts, args.code_prompts, args.max_new_tokens, args.seed]:
            logger.info("using cached generations from %s", cache)
            return data["sequences"]
    model, tok = target.model, target.tokenizer
    texts = [p.text for p in load_prompts("math500")[: args.math_prompts]]
    texts += [p.text for p in load_prompts("livecodebench")[: args.code_prompts]]
    prompts = [chat_ids(tok, t)[-512:] for t in texts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths per batch: less padding
    layers = default_feature_layers(model.config.num_hidden_layers)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    sequences = []
    torch.manual_seed(args.seed)
    bar = tqdm(total=len(prompts), desc="generating (target, T=1.0)", unit="seq")
    for start in range(0, len(order), args.gen_batch):
        idx = order[start : start + args.gen_batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.int64)
        mask = torch.zeros(len(idx), width, dtype=torch.int64)
        for row, i in enumerate(idx):  # left padding for generation
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=args.max_new_tokens, pad_token_id=pad,
            )
        eos = set(target.eos_token_ids())
        for row, i in enumerate(idx):
            gen = out[row, width:].tolist()
            for j, t in enumerate(gen):
                if t in eos:
                    gen = gen[: j + 1]
                    break
            seq = prompts[i] + gen
            with torch.no_grad():
                h = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
            feats = torch.cat([h[k][0] for k in layers], dim=-1).to(torch.bfloat16)
            final = h[-1][0]  # transformers returns the last hidden state after the final norm
            sequences.append(
                {"tokens": torch.tensor(seq), "prompt_len": len(prompts[i]), "features": feats, "final": final.to(torch.bfloat16)}
            )
        bar.update(len(idx))
    bar.close()
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": [args.math_prompts, args.code_prompts, args.max_new_tokens, args.seed], "sequences": sequences}, cache)
    return sequences


def two_step_loss(head: EagleHead, seq: dict, teacher_weight: torch.Tensor, step2_weight: float):
    """Loss and statistics of one sequence: (loss, {step: (sum min(p,q), count, top1 agree)})."""
    tokens = seq["tokens"]
    feats = seq["features"][:-2].float()  # f_i for i = 0..T-3
    T = tokens.shape[0]
    n = T - 2  # step 1 at positions i = 0..T-3 predicts x_{i+2}; step 2 at i = 0..T-4 predicts x_{i+3}
    if n < 2:
        return None, None
    with torch.no_grad():
        teacher_logits = seq["final"][1:].float() @ teacher_weight.T  # p(x_{j+1} | x_<=j) for j = 1..T-1
        teacher = torch.softmax(teacher_logits, dim=-1)
    from transformers import DynamicCache

    cache = DynamicCache(config=head.config)
    pos = torch.arange(n)[None]
    step1 = head(tokens[1 : n + 1][None], feats[None], position_ids=pos, cache=cache, use_cache=True)
    logq1 = torch.log_softmax(step1.logits[0].float(), dim=-1)  # predicts x_{i+2}: teacher row j = i+1 -> index i
    p1 = teacher[:n]
    loss1 = -(p1 * logq1).sum(-1).mean()
    # step 2: query i (position i+1) reads (g_i, x_{i+2}); keys: step-1 keys j <= i and its own
    m = n - 1
    allowed = torch.zeros(m, n + m, dtype=torch.bool)
    allowed[:, :n] = torch.ones(m, n, dtype=torch.bool).tril()
    allowed[torch.arange(m), n + torch.arange(m)] = True
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    step2 = head(tokens[2 : m + 2][None], step1.hidden[:, :m], attention_mask=mask, position_ids=pos[:, :m] + 1, cache=cache, use_cache=True)
    logq2 = torch.log_softmax(step2.logits[0].float(), dim=-1)
    p2 = teacher[1 : m + 1]
    loss2 = -(p2 * logq2).sum(-1).mean()
    with torch.no_grad():
        stats = {}
        for k, (p, lq) in enumerate([(p1, logq1), (p2, logq2)], start=1):
            q = lq.exp()
            stats[k] = (float(torch.minimum(p, q).sum()), p.shape[0], float((p.argmax(-1) == q.argmax(-1)).sum()))
    return loss1 + step2_weight * loss2, stats


def evaluate(head, sequences, teacher_weight, step2_weight) -> dict:
    head.eval()
    totals = {1: [0.0, 0, 0.0], 2: [0.0, 0, 0.0]}
    with torch.no_grad():
        for seq in sequences:
            _, stats = two_step_loss(head, seq, teacher_weight, step2_weight)
            if stats:
                for k, (a, c, t) in stats.items():
                    totals[k][0] += a
                    totals[k][1] += c
                    totals[k][2] += t
    head.train()
    return {f"step{k}": {"acceptance": a / max(c, 1), "top1_agreement": t / max(c, 1)} for k, (a, c, t) in totals.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target = load_model(args.target, dtype=torch.bfloat16)
    target.model.requires_grad_(False)
    sequences = generate_data(args, target)
    gen_seconds = time.time() - t0
    num_tokens = sum(int(s["tokens"].shape[0]) for s in sequences)
    out_tokens = torch.cat([s["tokens"][s["prompt_len"] :] for s in sequences])
    counts = torch.bincount(torch.cat([s["tokens"] for s in sequences]), minlength=target.vocab_size)
    counts[target.tokenizer.eos_token_id or 0] += 1
    draft_vocab = counts.argsort(descending=True)[: args.draft_vocab].sort().values
    coverage = float(torch.isin(out_tokens, draft_vocab).float().mean())
    logger.info("%d sequences, %d tokens (%.0f s); draft vocabulary %d covers %.1f%% of output tokens",
                len(sequences), num_tokens, gen_seconds, args.draft_vocab, 100 * coverage)

    target32 = load_model(args.target, dtype=torch.float32)  # the head trains and runs in fp32
    layers = default_feature_layers(target32.model.config.num_hidden_layers)
    head = EagleHead(target32.model.config, layers, draft_vocab).attach(target32.model)
    teacher_weight = target32.model.get_output_embeddings().weight.detach().index_select(0, draft_vocab)
    random.shuffle(sequences)
    n_val = max(1, int(len(sequences) * args.val_fraction))
    val, train = sequences[:n_val], sequences[n_val:]
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = args.epochs * math.ceil(len(train) / args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / total_steps))
    history = {"val_before": evaluate(head, val, teacher_weight, args.step2_weight)}
    logger.info("before training: %s", history["val_before"])
    start = time.time()
    step, stopped = 0, False
    bar = tqdm(total=total_steps, desc="training EAGLE head", unit="step")
    for epoch in range(args.epochs):
        random.shuffle(train)
        for b in range(0, len(train), args.batch):
            losses = []
            for seq in train[b : b + args.batch]:
                loss, _ = two_step_loss(head, seq, teacher_weight, args.step2_weight)
                if loss is not None:
                    losses.append(loss)
            if not losses:
                continue
            loss = torch.stack(losses).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch)
            if (time.time() - start) / 60 > args.max_minutes:
                stopped = True
                break
        history[f"val_epoch{epoch}"] = evaluate(head, val, teacher_weight, args.step2_weight)
        logger.info("epoch %d: %s", epoch, history[f"val_epoch{epoch}"])
        if stopped:
            logger.info("stopping: --max-minutes %.0f reached", args.max_minutes)
            break
    bar.close()
    train_seconds = time.time() - start
    head.to(torch.bfloat16)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    info = {
        "target": args.target, "sequences": len(sequences), "tokens": num_tokens, "draft_vocab": args.draft_vocab,
        "draft_vocab_coverage": coverage, "loss": "forward KL on the draft vocabulary, 2 unrolled steps",
        "epochs_run": epoch + 1, "steps": step, "seconds_generate": gen_seconds, "seconds_train": train_seconds,
        "seed": args.seed, "validation": history,
    }
    save_eagle_head(head, args.out, {"training": info})
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    Path(args.log).write_text(json.dumps(info, indent=2))
    logger.info("wrote %s (%.1f MB) and %s", args.out, Path(args.out).stat().st_size / 1e6, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
