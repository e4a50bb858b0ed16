#!/usr/bin/env python
"""Long-generation benchmark client: AIME 2024 / MATH-500 / LiveCodeBench prompts against an OpenAI-compatible
server (SGLang's ``launch_server``) or the embedded engine; per-request lengths, latencies and acceptance lengths.

Examples (docs/bench_long_gen.md)::

    # an SGLang server started with speculative decoding, native /generate endpoint (carries spec_verify_ct)
    python scripts/bench_long_gen.py --backend openai --base-url http://127.0.0.1:30000 --api generate \\
        --tokenizer /models/Qwen3-8B --dataset aime24 --max-tokens 8192 --concurrency 16 --ignore-eos \\
        --scrape-metrics --json results/bench/sglang_aime.json --plot results/bench/sglang_aime.png

    # the embedded engine (SmolLM2-135M on CPU), EAGLE head with Test-Time Speculation
    python scripts/bench_long_gen.py --backend embedded --draft eagle --tts --dataset aime24 --limit 3 \\
        --max-tokens 1024 --ignore-eos --json results/bench/embedded.json --plot results/bench/embedded.png

HTTP backend (``--backend openai``), one request per prompt, ``--concurrency`` requests in flight (a thread pool):

- ``--api chat`` posts ``{"model", "messages", "max_tokens", "temperature", "top_p", "stream": false}`` (plus
  ``"ignore_eos": true`` with ``--ignore-eos``, ``"seed"`` with ``--seed`` and SGLang's ``"return_meta_info":
  true`` unless ``--no-meta-info``) to ``/v1/chat/completions`` and reads ``usage.completion_tokens``; speculative
  counters are read from ``choices[0].meta_info``, ``meta_info`` or ``usage`` when the server returns them;
- ``--api generate`` posts ``{"text", "sampling_params": {"max_new_tokens", "temperature", "top_p",
  "ignore_eos"}}`` to SGLang's native ``/generate`` and reads ``meta_info.completion_tokens``,
  ``meta_info.spec_verify_ct`` and (when present) ``meta_info.spec_accept_length`` / ``spec_accept_histogram``.
  The text is the prompt after the chat template of ``--tokenizer`` when given, else the raw prompt.

Acceptance length of a request = ``completion_tokens / spec_verify_ct`` (tokens per verification round, bonus
token included) when ``spec_verify_ct > 0``; else the server's ``spec_accept_length`` if it sent one; else null —
never guessed. Over the requests with a known acceptance length the summary gives ``acceptance_length`` = total
output tokens / total rounds and ``acceptance_length_token_weighted`` = the mean of the requests' acceptance
lengths weighted by their output tokens. ``--scrape-metrics`` reads the server's Prometheus
``/metrics`` before and after the run and keeps the ``sglang:spec_*`` samples (``sglang:spec_accept_length``
is the server's own recent-window gauge, not this run's exact figure).

Embedded backend (``--backend embedded``): the same building blocks as ``specadapt generate``
(``specadapt.cli.generate``: validation, model and draft loading, chat template, warm-up, TTS, the engine)
with ``--concurrency`` as the batch size; every round is recorded, so the summary also carries acceptance length
by output-position bucket (``--bucket-edges``) — the acceptance-vs-position curve of the TTS study.

JSON layout (``--json``)::

    {"config": {...},
     "requests": [{"id", "prompt_tokens", "output_tokens", "latency_s", "tokens_per_s", "acceptance_length",
                   "acceptance_source", "spec_verify_ct", "server_accept_length", "finish_reason", "text",
                   ... embedded only: "rounds", "acceptance_by_position"}],
     "summary": {"requests", "output_tokens", "wall_seconds", "throughput_tok_s", "latency_mean_s",
                 "latency_median_s", "latency_p90_s", "acceptance_length", "acceptance_length_token_weighted",
                 "requests_with_acceptance",
                 "acceptance_by_position" (embedded; null for HTTP), "max_in_flight"},
     "server_metrics": null | {"url", "before", "after", "error"}}

Bad arguments print one line naming the flag and exit with code 2; an unreachable server or an error response
prints one line with the URL (and the HTTP status and a body excerpt) and exits with code 1.

This script is the command line only: the client, the report and the plot live in :mod:`specadapt.cli.long_gen`.
"""

from __future__ import annotations

import argparse
import sys

from specadapt.cli.long_gen.options import (
    DEFAULT_BUCKET_EDGES, DEFAULT_CONCURRENCY, PROG, ArgumentError, BenchError,
)
from specadapt.cli.long_gen.plot import plot  # imports matplotlib only when it draws
from specadapt.cli.long_gen.report import print_report, run, write_json
from specadapt.verification.rules import DEFAULT_RULE, RULE_NAMES


class _OneLineParser(argparse.ArgumentParser):
    """argparse errors as a single line ``bench_long_gen: error: ...`` and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (defaults shown by ``--help``; errors as one line, exit code 2)."""
    p = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=["openai", "embedded"], default="openai",
                   help="an OpenAI-compatible HTTP server (SGLang) or the embedded engine of this repository")
    p.add_argument("--dataset", default="aime24", help="aime24 | math500 | livecodebench | path to a .jsonl file")
    p.add_argument("--prompt-field", default=None, help="JSON field holding the prompt (None: the dataset's own)")
    p.add_argument("--limit", type=int, default=0, help="number of prompts (0 = all)")
    p.add_argument("--max-tokens", type=int, default=4096, help="new tokens per request (max_tokens)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--concurrency", "--batch-size", dest="concurrency", type=int, default=None,
                   help="requests in flight (HTTP thread pool; embedded: batch size). "
                        f"None: {DEFAULT_CONCURRENCY['openai']} for openai, {DEFAULT_CONCURRENCY['embedded']} embedded")
    p.add_argument("--ignore-eos", action="store_true", help="generate every request to --max-tokens")
    p.add_argument("--seed", type=int, default=None,
                   help="embedded: seeds the coins (None: 0); openai chat: sent as 'seed' when given")
    p.add_argument("--model", default=None,
                   help="openai: model name sent in the body (None: the first id of GET /v1/models for --api "
                        "chat); embedded: smollm2-135m (default), a HF model directory or a .gguf file")
    p.add_argument("--json", default=None, metavar="OUT", help="write config, per-request results and summary")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="acceptance length vs output position (embedded) or per request vs output length (HTTP)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p.add_argument("--bucket-edges", default=DEFAULT_BUCKET_EDGES,
                   help="output-position bucket edges of acceptance by position (embedded backend, and servers that "
                        "return per-round counts: spec_round_emitted, as specadapt serve does)")
    http = p.add_argument_group("HTTP backend (--backend openai)")
    http.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:30000 (a trailing /v1 "
                                                       "is dropped)")
    http.add_argument("--api", choices=["chat", "generate"], default="chat",
                      help="/v1/chat/completions or SGLang's native /generate")
    http.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for one response")
    http.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    http.add_argument("--tokenizer", default=None,
                      help="--api generate: apply this tokenizer's chat template to each prompt (a HF directory, "
                           "a .gguf file or smollm2-135m); None: send the raw prompt")
    http.add_argument("--no-meta-info", action="store_true",
                      help="--api chat: do not ask for SGLang's per-request meta_info (return_meta_info)")
    http.add_argument("--scrape-metrics", action="store_true",
                      help="read the server's Prometheus /metrics before and after the run (sglang:spec_* samples)")

    emb = p.add_argument_group("embedded backend (--backend embedded; the building blocks of specadapt generate)")
    emb.add_argument("--draft", default="ngram", help="ngram | eagle | eagle:PATH | self:N | a model path")
    emb.add_argument("--num-draft-tokens", type=int, default=5, help="L, drafts per round")
    emb.add_argument("--verify", default=DEFAULT_RULE, choices=list(RULE_NAMES), help="verification rule")
    emb.add_argument("--tts", action="store_true", help="Test-Time Speculation of the model draft")
    emb.add_argument("--device", default="cpu", help="cpu or cuda")
    emb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    emb.add_argument("--generate-args", default="", metavar="'FLAGS'",
                     help="more `specadapt generate` flags as one string, written with '=': "
                          "--generate-args='--tts-stride 1 --top-k 50'")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns 0, 1 (server failure) or 2 (bad argument); argparse errors exit with 2."""
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except ArgumentError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
