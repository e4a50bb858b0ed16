#!/usr/bin/env python
"""Train the EAGLE-style draft head of the embedded default target (SmolLM2-135M-Instruct) on CPU.

The EAGLE-3 recipe at this scale (docs/draft_training.md): the target's own sampled answers
(scripts/gen_draft_data.py, T = 1.0, top-p 0.95, up to 2,048 new tokens), the head unrolled for --steps drafting
steps over each sequence (each step reads the head's own previous output, as drafting does;
specadapt.draft_train.unroll), forward KL to the target's distribution on the draft vocabulary, a validation
split by prompt, early stopping, checkpoints, a seed.

    python scripts/gen_draft_data.py --out runs/draft_data          # ~1M tokens
    python scripts/train_draft.py --data runs/draft_data             # writes the packaged head + its log
    python scripts/train_draft.py --data runs/draft_data --vocab-study   # coverage vs draft-step cost only

Interrupted runs resume from --checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from specadapt.draft_train.train import TrainConfig  # noqa: E402

logger = logging.getLogger("train_draft")
VOCAB_SIZES = (8192, 16384, 32768)


def parse_args(argv=None):
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model (embedded default or HF directory)")
    p.add_argument("--data", nargs="+", default=[str(ROOT / "runs" / "draft_data")],
                   help="one or more directories of gen_draft_data.py (same target and feature layers); a prompt in "
                        "several of them is one prompt for the validation split")
    p.add_argument("--draft-vocab", default="16384",
                   help="draft vocabulary size (the most frequent answer tokens), or 'init': the --init-from head's own "
                        "vocabulary (a warm start that keeps it starts exactly where that head is)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width of the head's decoder layer (default: the target's; 2816 for qwen2.5-coder-1.5b "
                        "keeps the head's file under 64 MB and its step near 0.05 of the target's)")
    p.add_argument("--steps", type=int, default=d.steps, help="unrolled drafting steps")
    p.add_argument("--step-decay", type=float, default=d.step_decay, help="loss weight of step s: decay^(s-1)")
    p.add_argument("--divergence", choices=["fkl", "tvd"], default=d.divergence,
                   help="training loss per unrolled step: forward KL (EAGLE-3) or total variation, i.e. 1 - the "
                        "acceptance rate (DistillSpec)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="matrix products of the training step: bf16 autocast (parameters, optimizer, teacher and "
                        "validation stay float32) or fp32; auto = bf16 where the CPU has AMX (a step 1.2-1.4x "
                        "faster than fp32 there), else fp32")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="optimizer steps between validations")
    p.add_argument("--patience", type=int, default=d.patience, help="validations without improvement before stopping")
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="training wall-time limit")
    p.add_argument("--val-fraction", type=float, default=0.04, help="fraction of the prompts held out")
    p.add_argument("--max-sequences", type=int, default=None, help="use only the first N sequences (tests)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint", default=str(ROOT / "runs" / "train_draft_checkpoint.pt"))
    p.add_argument("--out", default=None,
                   help="head file (default: the packaged eagle_smollm2_135m.safetensors, replaced only when the new "
                        "head beats the compared one on validation; otherwise runs/eagle_candidate.safetensors)")
    p.add_argument("--log", default=str(ROOT / "runs" / "train_draft_log.json"))
    p.add_argument("--compare", default=None,
                   help="an existing head evaluated on the same validation split (default: the packaged head; "
                        "'none' skips it)")
    p.add_argument("--init-from", default=None,
                   help="start from this head file's weights (fuse, input_proj, layer; its draft vocabulary only with "
                        "--draft-vocab init) instead of a random initialisation")
    p.add_argument("--vocab-study", action="store_true", help="only measure coverage vs draft-step cost per size")
    return p.parse_args(argv)


def _vocab_study(target, native, train, validation, eos, keys, width=None) -> dict:
    """Coverage of 8K / 16K / 32K draft vocabularies on held-out answers and on the evaluation prompts' text,
    beside the native draft step's time with each (batch 1, 512 positions of context). ``width``: the head
    layer's MLP width (``--intermediate-size``)."""
    import torch

    from specadapt.bench.forward import _native_cache, cpu_name, median_seconds
    from specadapt.datasets import load_prompts
    from specadapt.draft_train.data import chat_prompt_ids
    from specadapt.draft_train.split import EVAL_LIVECODEBENCH, EVAL_MATH500
    from specadapt.draft_train.vocab import answer_token_counts, coverage, top_vocabulary
    from specadapt.engine.eagle import EagleHead, default_feature_layers
    from specadapt.engine.native.eagle import NativeEagleHead

    counts = answer_token_counts(train, target.vocab_size)
    tok = target.tokenizer
    answers = {"validation answers (math)": [], "validation answers (code)": []}
    for s in validation:
        key = "validation answers (code)" if keys[s.job[0]].startswith("livecodebench") else "validation answers (math)"
        answers[key].append(s.tokens[s.prompt_len :])
    texts = {"AIME 2024 problems": [p.text for p in load_prompts("aime24")],
             f"LiveCodeBench [0, {EVAL_LIVECODEBENCH}) problems": [p.text for p in load_prompts("livecodebench")[:EVAL_LIVECODEBENCH]],
             f"MATH-500 [0, {EVAL_MATH500}) problems": [p.text for p in load_prompts("math500")[:EVAL_MATH500]]}
    sets = {k: torch.cat(v) for k, v in answers.items() if v}
    sets.update({k: torch.tensor([t for x in v for t in chat_prompt_ids(tok, x, 10**6)]) for k, v in texts.items()})
    layers = default_feature_layers(int(target.model.config.num_hidden_layers))
    cache = _native_cache(native, 1, 512, 1)
    ids, one = torch.ones(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    start = cache.lengths.clone()

    def target_step():
        cache.forward(ids, one)
        cache.truncate(start)

    target_ms = median_seconds(target_step, 20) * 1e3
    out = {"machine": cpu_name(), "target_step_ms": target_ms, "format": native.dtype_name, "sizes": {}}
    for size in VOCAB_SIZES + (target.vocab_size,):
        vocab = top_vocabulary(counts, size, always=eos)
        # attach reads the shared rows from `native` only for a skeleton target
        head = EagleHead(target.model.config, layers, vocab, intermediate_size=width).attach(target.model, native)
        nh = NativeEagleHead(head, native)
        hcache = _native_cache(nh, 1, 512, 1)
        feats = torch.randn(1, 1, native.hidden_size)
        hstart = hcache.lengths.clone()

        def draft_step():
            hcache.forward(ids, one, return_outputs=True, features=feats)
            hcache.truncate(hstart)

        ms = median_seconds(draft_step, 20) * 1e3
        row = {"draft_step_ms": ms, "draft_over_target": ms / target_ms,
               "coverage": {k: coverage(v, vocab) for k, v in sets.items()}}
        out["sizes"][str(size)] = row
        logger.info("draft vocabulary %d: step %.2f ms (%.3f of the target's), coverage %s", size, ms, ms / target_ms,
                    {k: round(c, 4) for k, c in row["coverage"].items()})
    return out


def _packaged_path(default_path, target: str):
    """The packaged head file of ``target``, also before its first training (``None`` for a target with no
    planned head)."""
    from specadapt.engine import eagle

    try:
        return default_path(target)
    except ValueError:
        return eagle._data_dir() / eagle.EAGLE_HEADS[target] if target in eagle.EAGLE_HEADS else None


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    precision = args.precision
    if precision == "auto":
        from specadapt.bench.forward import cpu_flags

        precision = "bf16" if "amx_bf16" in cpu_flags() else "fp32"
    try:
        config = TrainConfig(steps=args.steps, step_decay=args.step_decay, epochs=args.epochs, batch=args.batch,
                             lr=args.lr, warmup=args.warmup, eval_every=args.eval_every, patience=args.patience,
                             max_minutes=args.max_minutes, seed=args.seed,
                             divergence=args.divergence, precision=precision)
    except ValueError as exc:
        print(f"train_draft.py: error: {exc}", file=sys.stderr)
        return 2
    if args.draft_vocab == "init":
        if not args.init_from:
            print("train_draft.py: error: --draft-vocab init needs --init-from", file=sys.stderr)
            return 2
    elif not args.draft_vocab.isdigit() or int(args.draft_vocab) < 1:
        print(f"train_draft.py: error: --draft-vocab must be a positive size or 'init', got {args.draft_vocab!r}",
              file=sys.stderr)
        return 2
    import torch

    from specadapt.bench.forward import cpu_name
    from specadapt.draft_train.data import iter_sequences, read_manifest, shard_paths
    from specadapt.draft_train.train import evaluate_head, split_by_prompt, train_head
    from specadapt.draft_train.unroll import full_teacher
    from specadapt.draft_train.vocab import answer_token_counts, coverage, top_vocabulary
    from specadapt.engine.eagle import (EagleHead, default_feature_layers, eagle_default_path, load_eagle_head,
                                       save_eagle_head)
    from specadapt.engine.models import attach_forward, file_blocks_for, load_model

    manifests = []
    for directory in args.data:
        manifest = read_manifest(directory)
        if manifest is None or not shard_paths(directory):
            print(f"train_draft.py: error: --data {directory} holds no generated data (run scripts/gen_draft_data.py)",
                  file=sys.stderr)
            return 2
        manifests.append(manifest)
    for directory, other in zip(args.data[1:], manifests[1:]):
        for key in ("target", "weight_format", "feature_layers"):
            if other["identity"].get(key) != manifests[0]["identity"].get(key):
                print(f"train_draft.py: error: --data {directory} was generated with another {key} "
                      f"({other['identity'].get(key)!r} != {manifests[0]['identity'].get(key)!r})", file=sys.stderr)
                return 2
    manifest = manifests[0]
    keys: list[str] = []  # prompt keys of every directory; a sequence's job[0] indexes this list
    key_index: dict[str, int] = {}
    remaps = []
    for m in manifests:
        remap = []
        for key in m["identity"]["prompts"]:
            if key not in key_index:
                key_index[key] = len(keys)
                keys.append(key)
            remap.append(key_index[key])
        remaps.append(remap)
    torch.manual_seed(args.seed)
    t0 = time.time()
    # a K-quant GGUF target (qwen2.5-coder-1.5b) is loaded on its own blocks: the head shares its embedding and LM
    # head from the native model (de-quantised rows), as the engine runs it
    file_blocks = file_blocks_for(args.target, "native", "auto")
    target = load_model(args.target, dtype=torch.float32, file_blocks=file_blocks)
    native = None
    if target.skeleton:
        attach_forward(target, "native", "gguf")
        native = target.native
    target.model.requires_grad_(False)
    sequences = []
    for directory, remap in zip(args.data, remaps):
        for s in iter_sequences(directory):
            s.job = (remap[s.job[0]], s.job[1])
            sequences.append(s)
            if args.max_sequences and len(sequences) >= args.max_sequences:
                break
        if args.max_sequences and len(sequences) >= args.max_sequences:
            break
    train, validation = split_by_prompt(sequences, args.val_fraction, seed=args.seed)
    generated = sum(int(s.tokens.numel()) - s.prompt_len for s in sequences)
    logger.info("%d sequences (%d generated tokens) from %s: %d train, %d validation (%d of %d prompts held out); "
                "loaded in %.0f s", len(sequences), generated, args.data, len(train), len(validation),
                len({s.job[0] for s in validation}), len({s.job[0] for s in sequences}), time.time() - t0)
    eos = sorted(target.eos_token_ids())
    if args.vocab_study:
        if native is None:
            attach_forward(target, "auto", "auto")
        study = _vocab_study(target, target.native, train, validation, eos, keys, args.intermediate_size)
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text(json.dumps({"vocab_study": study}, indent=1))
        print(json.dumps(study, indent=1))
        return 0
    start = load_eagle_head(args.init_from, target.model, dtype=torch.float32, native=native) if args.init_from else None
    if args.draft_vocab == "init":
        vocab = start.draft_vocab.clone()
    else:
        vocab = top_vocabulary(answer_token_counts(train, target.vocab_size), int(args.draft_vocab), always=eos)
    val_answers = torch.cat([s.tokens[s.prompt_len :] for s in validation])
    layers = default_feature_layers(int(target.model.config.num_hidden_layers))
    if manifest["identity"]["feature_layers"] != list(layers):
        print(f"train_draft.py: error: --data was generated for feature layers {manifest['identity']['feature_layers']},"
              f" the head reads {list(layers)}", file=sys.stderr)
        return 2
    width = args.intermediate_size
    if width is None and start is not None:
        width = int(start.config.intermediate_size)
    try:
        head = EagleHead(target.model.config, layers, vocab, intermediate_size=width).attach(target.model, native)
    except ValueError as exc:
        print(f"train_draft.py: error: --intermediate-size: {exc}", file=sys.stderr)
        return 2
    if start is not None:
        if tuple(start.feature_layers) != tuple(layers):
            print(f"train_draft.py: error: --init-from {args.init_from} reads feature layers {start.feature_layers}",
                  file=sys.stderr)
            return 2
        weights = {k: v for k, v in start.state_dict().items() if k != "draft_vocab"}
        missing = head.load_state_dict(weights, strict=False)
        assert missing.missing_keys == ["draft_vocab"] and not missing.unexpected_keys, missing
        logger.info("initialised from %s", args.init_from)
    if native is not None:
        full_weight = native.lm_head.dequantize().float()  # [V, h]: the teacher's full-vocabulary normaliser
    else:
        full_weight = target.model.get_output_embeddings().weight.detach()
    packaged = _packaged_path(eagle_default_path, args.target)
    compare_path = Path(args.compare) if args.compare else packaged
    compare = None
    teachers = [full_teacher(s.final, full_weight) for s in validation]  # once: the comparison and training
    if args.compare != "none" and compare_path is not None and compare_path.is_file():
        old = load_eagle_head(compare_path, target.model, dtype=torch.float32, native=native)
        compare = {"file": str(compare_path), "draft_vocab": int(old.draft_vocab.numel()),
                   "draft_vocab_coverage_validation": coverage(val_answers, old.draft_vocab),
                   "validation": evaluate_head(old, validation, config.steps, teachers, config.step_weights)}
        logger.info("compared head %s: validation %s", compare_path.name, compare["validation"])
        del old
    log = train_head(head, train, validation, full_weight, config, checkpoint=args.checkpoint, teachers=teachers)
    head.to(torch.bfloat16)
    if not args.out and packaged is None:
        print(f"train_draft.py: error: --out is needed: no head is shipped for {args.target!r}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else packaged
    if compare is not None:
        from specadapt.draft_train.train import step_score

        old_score = step_score(compare["validation"])
        new_score = step_score(log["best"])
        compare["score"] = old_score
        if not args.out and new_score <= old_score:
            out = ROOT / "runs" / "eagle_candidate.safetensors"
            logger.warning("the new head's validation score %.4f does not beat the packaged head's %.4f: the "
                           "packaged head is kept, the new one written to %s", new_score, old_score, out)
    info = {
        "target": args.target, "machine": cpu_name(), "threads": torch.get_num_threads(),
        "data": {"directory": [str(d) for d in args.data], "generation": [m["config"] for m in manifests],
                 "sequences": len(sequences),
                 "generated_tokens": generated, "train_sequences": len(train), "validation_sequences": len(validation),
                 "validation_prompts": sorted(keys[j] for j in {s.job[0] for s in validation})},
        "draft_vocab": int(vocab.numel()), "init_from": args.init_from, "draft_vocab_coverage_validation": coverage(val_answers, vocab),
        "loss": f"{'forward KL' if config.divergence == 'fkl' else 'total variation'} on the draft vocabulary, "
                f"{config.steps} unrolled steps, weights {config.step_weights}",
        "training": log, "compared_head": compare, "seconds_total": time.time() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_eagle_head(head, out, {"training": {k: v for k, v in info.items() if k != "training"} | {
        "best": log["best"], "steps": log["steps"], "seconds": log["seconds"], "stopped": log["stopped"]}})
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    Path(args.log).write_text(json.dumps(info, indent=1))
    logger.info("wrote %s (%.1f MB) and %s; best validation acceptance per step %s", out, out.stat().st_size / 1e6,
                args.log, [round(a, 4) for a in log["best"]["acceptance"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
