"""The embedded backend of the long-generation benchmark: the prompts decoded by the engine of this package, built
by the same functions as ``specadapt generate``, every round recorded (acceptance length by output position)."""

from __future__ import annotations

import shlex
import sys
import time

from .options import PROG, ArgumentError


def _generate_argv(args, edges: str) -> list[str]:
    argv = [
        "generate", "--model", args.model or "smollm2-135m", "--draft", args.draft, "--dataset", args.dataset,
        "--limit", str(args.limit), "--max-new-tokens", str(args.max_tokens), "--temperature", str(args.temperature),
        "--top-p", str(args.top_p), "--num-draft-tokens", str(args.num_draft_tokens), "--verify", args.verify,
        "--batch-size", str(args.concurrency), "--seed", str(0 if args.seed is None else args.seed),
        "--dtype", args.dtype, "--device", args.device, "--bucket-edges", edges,
    ]
    if args.prompt_field:
        argv += ["--prompt-field", args.prompt_field]
    if args.tts:
        argv.append("--tts")
    if args.ignore_eos:
        argv.append("--ignore-eos")
    if args.no_progress:
        argv.append("--no-progress")
    try:
        argv += shlex.split(args.generate_args)
    except ValueError as exc:
        raise ArgumentError(f"--generate-args: {exc}") from None
    return argv


def run_embedded(args, prompts) -> tuple[list[dict], float, dict, list[dict], float | None]:
    """Decode every prompt with the embedded engine, built exactly as ``specadapt generate`` builds it.

    Returns:
        per-request records (in prompt order; ``latency_s`` = seconds from the start of the request's batch to its
        last token), the wall-clock seconds of decoding, extra config entries, the summary acceptance length by
        output-position bucket (``[{"start", "end", "rounds", "acceptance_length"}]``) and the acceptance length
        over all rounds (mean tokens emitted per round: tau + 1 except where EOS or --max-tokens cut a round, as
        ``specadapt generate`` reports it).

    Raises:
        ArgumentError: any flag ``specadapt generate`` rejects (message names it).
    """
    import torch
    from tqdm import tqdm

    from specadapt.cli import build_parser as specadapt_parser
    from specadapt.cli import engine_args as eng
    from specadapt.cli import generate as gen
    from specadapt.cli.common import UsageError
    from specadapt.engine import SpeculativeEngine
    from specadapt.engine.metrics import acceptance_by_position, acceptance_length
    from specadapt.sampling import SamplingParams

    parser = specadapt_parser()
    parser.prog = f"{PROG} (--generate-args)"
    g = parser.parse_args(_generate_argv(args, args.bucket_edges))
    try:
        edges = gen._validate(g)
    except UsageError as exc:
        raise ArgumentError(str(exc)) from None
    if g.log_drafts or g.baseline:
        raise ArgumentError("--generate-args: --log-drafts and --baseline are for `specadapt generate`, not here")
    if g.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        eng._silence_gguf_progress()
    if g.device.startswith("cuda") and not torch.cuda.is_available():
        raise ArgumentError(f"--device {g.device}: CUDA is not available on this machine")
    sampling = SamplingParams(g.temperature, g.top_p, g.top_k)
    target, draft = eng.load_target_and_draft(g.model, g.draft, sampling, g.seed, g.dtype, g.device, error=ArgumentError)

    token_ids = [eng._tokenize(target.tokenizer, p.text) for p in prompts]
    context = target.context_length or 10**9
    limits = []
    for prompt, ids in zip(prompts, token_ids):
        if len(ids) >= context:
            raise ArgumentError(f"--dataset: prompt {prompt.id!r} has {len(ids)} tokens, longer than the model's "
                                f"context ({context})")
        if g.max_new_tokens > context - len(ids):
            print(f"{PROG}: warning: prompt {prompt.id}: --max-tokens cut to {context - len(ids)} to fit the context",
                  file=sys.stderr)
        limits.append(min(g.max_new_tokens, context - len(ids)))

    torch.manual_seed(g.seed)
    eng._warm_up(target, draft)
    adaptive = eng._adaptive(g, target, draft, g.batch_size) if g.adaptive_verification else None
    tts = None
    if g.tts:
        from specadapt.engine.tts_bridge import EngineTTS

        tts = EngineTTS(draft, eng.tts_config(g), sampling, asynchronous=False if g.tts_sync else None,
                        max_requests=g.batch_size)
    try:
        engine = SpeculativeEngine(
            target, draft, sampling, g.num_draft_tokens, g.verify, seed=g.seed, verify_impl=g.verify_impl,
            num_paths=eng.num_paths_of(g), adaptive=adaptive, tts=tts, ignore_eos=g.ignore_eos,
        )
    except ValueError as exc:
        raise ArgumentError(f"--verify: {exc}") from None

    results = []
    tokens = [0]
    bar = tqdm(total=len(prompts), desc=f"embedded {g.draft}{' + TTS' if tts else ''}", unit="req",
               disable=args.no_progress)

    def on_tokens(n: int) -> None:
        tokens[0] += n
        bar.set_postfix_str(f"{tokens[0]} tok", refresh=False)
        bar.update(0)

    start = time.perf_counter()
    try:
        # The engine decodes batch_size requests at a time; handing it one batch per call is the same schedule
        # and lets the bar count finished requests.
        for lo in range(0, len(prompts), g.batch_size):
            hi = min(lo + g.batch_size, len(prompts))
            results += engine.generate(token_ids[lo:hi], limits[lo:hi], batch_size=g.batch_size, on_tokens=on_tokens)
            bar.update(hi - lo)
        wall = time.perf_counter() - start
    finally:
        bar.close()
        if tts is not None:
            tts.close()

    records = []
    for prompt, res in zip(prompts, results):
        n = len(res.output_ids)
        records.append({
            "id": prompt.id,
            "prompt_tokens": res.prompt_tokens,
            "output_tokens": n,
            "latency_s": res.seconds,
            "acceptance_length": acceptance_length(res.rounds),
            "acceptance_source": "engine rounds" if res.rounds else None,
            "spec_verify_ct": len(res.rounds),
            "server_accept_length": None,
            "finish_reason": "stop" if res.finished_by_eos else "length",
            "rounds": len(res.rounds),
            "acceptance_by_position": acceptance_by_position(res.rounds, edges),
            "text": target.tokenizer.decode(res.output_ids, skip_special_tokens=True),
        })
    all_rounds = [r for res in results for r in res.rounds]
    extra = {"model": g.model, "seed": g.seed, "num_paths": eng.num_paths_of(g), "verify_impl": g.verify_impl,
             "torch_version": torch.__version__, "torch_threads": torch.get_num_threads()}
    if tts is not None:
        extra["tts_stats"] = tts.summary()
        extra["tts_stride"] = g.tts_stride
    if adaptive is not None:
        extra.update(av_pruned_drafts=adaptive.pruned, av_verified_drafts=adaptive.verified)
    return records, wall, extra, acceptance_by_position(all_rounds, edges), acceptance_length(all_rounds)

