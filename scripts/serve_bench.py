#!/usr/bin/env python
"""The server's overhead: ``specadapt serve`` against ``specadapt generate``'s engine on the same prompts, in ONE
process and one run, with and without speculation.

For each draft (default ``eagle`` and ``none`` = target-only) the engine is built once, exactly as both commands
build it; then for each output length (``--max-tokens``: short and long, ending at the natural EOS) and each
concurrency C:

- ``generate``: ``engine.generate(prompts, max_tokens, batch_size=C, seeds=...)`` (static batches of C);
- ``serve``: the same engine behind the real HTTP server (uvicorn on loopback, continuous batching, at most C
  requests decoded together), C client threads each sending its next request when the previous one ends
  (``/v1/completions`` with the chat-templated token ids, the same per-request seeds).

Both decode the same text (per-request seeds: a request's output depends on its prompt, seed and settings only);
the script checks it and reports any request whose tokens differ. Figures: output tokens/s over the wall clock,
p50 / p90 request latency (generate: from a request's join to its last token; serve: from sending to the answer),
the serve / generate throughput ratio, and the machine (CPU, copy bandwidth, GEMM rate) measured in the run.

    python scripts/serve_bench.py --json results/serve_bench.json --markdown results/serve_bench.md
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]


def _engine(draft: str, temperature: float, max_batch: int):
    from specadapt.cli import build_parser
    from specadapt.cli.engine_args import build_engine, validate_engine_args

    args = build_parser().parse_args(["serve", "--draft", draft, "--temperature", str(temperature), "--no-progress"])
    validate_engine_args(args)
    return args, build_engine(args, max_batch)


def _run_generate(engine, prompts, max_tokens, concurrency, seeds):
    start = time.perf_counter()
    results = engine.generate(prompts, max_tokens, batch_size=concurrency, seeds=seeds)
    wall = time.perf_counter() - start
    return [r.output_ids for r in results], [r.seconds for r in results], wall


def _stream_completion(http, url: str, body: dict) -> list[int]:
    """One streamed completion (server-sent events); returns the token ids of its last chunk."""
    token_ids = None
    with http.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: "):]).get("choices") or [{}]
                token_ids = choices[0].get("token_ids", token_ids)
    return token_ids


def _run_serve(built, model_name, prompts, max_tokens, concurrency, seeds, stream=False, stream_interval=4):
    import httpx

    from specadapt.serve.app import ServerState, create_app, start_http_thread
    from specadapt.serve.metrics import ServerMetrics
    from specadapt.serve.scheduler import Scheduler
    metrics = ServerMetrics(built.engine)
    state = ServerState(Scheduler(built.engine, concurrency, len(prompts), metrics), built.target.tokenizer,
                        model_name, built.target.context_length, built.target.vocab_size, metrics, stream_interval)
    server, thread, port = start_http_thread(create_app(state, start_engine=False), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    outputs, latencies = [None] * len(prompts), [0.0] * len(prompts)
    todo = list(range(len(prompts)))
    lock = threading.Lock()

    def client():
        with httpx.Client(timeout=3600) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                t0 = time.perf_counter()
                body = {"prompt": prompts[i], "max_tokens": max_tokens, "seed": seeds[i], "return_token_ids": True}
                if stream:
                    outputs[i] = _stream_completion(http, url, body)
                    latencies[i] = time.perf_counter() - t0
                    continue
                reply = http.post(url + "/v1/completions", json=body)
                latencies[i] = time.perf_counter() - t0
                reply.raise_for_status()
                outputs[i] = reply.json()["choices"][0]["token_ids"]

    def drive():  # the clients, then stop the engine loop
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for c in threads:
            c.start()
        for c in threads:
            c.join()
        state.scheduler.stop(timeout=0)

    start = time.perf_counter()
    driver = threading.Thread(target=drive)
    driver.start()
    state.scheduler.run()  # the engine on this thread, as `specadapt serve` runs it (see specadapt.serve.scheduler)
    driver.join()
    wall = time.perf_counter() - start
    server.should_exit = True
    thread.join(30)
    return outputs, latencies, wall


def _row(kind, draft, max_tokens, concurrency, outputs, latencies, wall):
    tokens = sum(len(o) for o in outputs)
    return {"mode": kind, "draft": draft, "max_tokens": max_tokens, "concurrency": concurrency,
            "requests": len(outputs), "output_tokens": tokens, "mean_output_tokens": tokens / len(outputs),
            "wall_s": wall, "tok_per_s": tokens / wall, "latency_p50_s": _quantile(latencies, 0.5),
            "latency_p90_s": _quantile(latencies, 0.9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", default=["eagle", "none"], help="drafts (none = no speculation)")
    ap.add_argument("--max-tokens", nargs="+", type=int, default=[128, 2048], help="output lengths (natural EOS)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per cell (at least the concurrency)")
    ap.add_argument("--long-requests", type=int, default=4,
                    help="requests per cell at the longest --max-tokens below concurrency 16 (time)")
    ap.add_argument("--dataset", default="math500")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--stream", action="store_true", help="the server's requests stream (server-sent events)")
    ap.add_argument("--stream-interval", type=int, default=4, help="the server's --stream-interval (tokens)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()

    import torch

    from specadapt.bench.forward import measure_machine
    from specadapt.cli.engine_args import _tokenize
    from specadapt.datasets import load_prompts

    torch.set_num_threads(2)
    machine = measure_machine()
    print(f"machine: {machine['name']}, {machine['threads']} threads, copy {machine['copy_gbps']:.1f} GB/s, "
          f"fp32 GEMM {machine['gemm_fp32_gflops']:.0f} GFLOP/s, torch {machine['torch']}", flush=True)
    texts = [p.text for p in load_prompts(args.dataset, None, args.requests)]
    rows, mismatches = [], []
    for draft in args.drafts:
        eargs, built = _engine(draft, args.temperature, max(args.concurrency))
        prompts = [_tokenize(built.target.tokenizer, t) for t in texts]
        for max_tokens in args.max_tokens:
            for c in args.concurrency:
                n = args.requests
                if max_tokens == max(args.max_tokens) and c < 16:
                    n = max(c, min(args.long_requests, n))
                n = max(n, c)
                seeds = list(range(n))
                g_out, g_lat, g_wall = _run_generate(built.engine, prompts[:n], max_tokens, c, seeds)
                s_out, s_lat, s_wall = _run_serve(built, eargs.model, prompts[:n], max_tokens, c, seeds, args.stream,
                                                  args.stream_interval)
                g = _row("generate", draft, max_tokens, c, g_out, g_lat, g_wall)
                s = _row("serve-stream" if args.stream else "serve", draft, max_tokens, c, s_out, s_lat, s_wall)
                s["serve_over_generate"] = s["tok_per_s"] / g["tok_per_s"]
                s["identical_outputs"] = g_out == s_out
                if g_out != s_out:
                    mismatches.append((draft, max_tokens, c, [i for i in range(n) if g_out[i] != s_out[i]]))
                rows += [g, s]
                print(f"{draft:>6} max {max_tokens:>5} c{c:<3} n{n:<3} generate {g['tok_per_s']:7.1f} tok/s "
                      f"p50 {g['latency_p50_s']:6.2f}s p90 {g['latency_p90_s']:6.2f}s | serve "
                      f"{s['tok_per_s']:7.1f} tok/s p50 {s['latency_p50_s']:6.2f}s p90 {s['latency_p90_s']:6.2f}s "
                      f"| ratio {s['serve_over_generate']:.2f} | same text {s['identical_outputs']} "
                      f"| mean out {g['mean_output_tokens']:.0f}", flush=True)
        built.close()
    report = {"machine": machine, "dataset": args.dataset, "temperature": args.temperature, "stream": args.stream,
              "stream_interval": args.stream_interval,
              "rows": rows,
              "mismatches": mismatches}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        lines = [f"Machine: {machine['name']}, {machine['threads']} threads, copy {machine['copy_gbps']:.1f} GB/s, "
                 f"fp32 GEMM {machine['gemm_fp32_gflops']:.0f} GFLOP/s; {args.dataset}, T = {args.temperature}"
                 f"{f'; the server streams, a chunk every {args.stream_interval} tokens' if args.stream else ''}.",
                 "", "| draft | max tokens | C | requests | mean out | generate tok/s | serve tok/s | serve/generate "
                 "| generate p50 / p90 s | serve p50 / p90 s | same text |", "|" + "---|" * 11]
        for g, s in zip(rows[::2], rows[1::2]):
            lines.append(f"| {g['draft']} | {g['max_tokens']} | {g['concurrency']} | {g['requests']} | "
                         f"{g['mean_output_tokens']:.0f} | {g['tok_per_s']:.1f} | {s['tok_per_s']:.1f} | "
                         f"{s['serve_over_generate']:.2f} | {g['latency_p50_s']:.2f} / {g['latency_p90_s']:.2f} | "
                         f"{s['latency_p50_s']:.2f} / {s['latency_p90_s']:.2f} | {s['identical_outputs']} |")
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    print(f"mismatching requests: {mismatches or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
