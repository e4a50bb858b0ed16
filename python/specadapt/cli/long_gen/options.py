"""Defaults, the two error kinds (exit codes 2 and 1) and the flag checks of the long-generation benchmark."""

from __future__ import annotations

PROG = "bench_long_gen"
DEFAULT_BUCKET_EDGES = "0,256,512,768,1024,1536,2048,3072,4096,6144,8192"
DEFAULT_CONCURRENCY = {"openai": 8, "embedded": 3}
BODY_EXCERPT = 300
# Where SGLang (and look-alikes) put per-request speculative counters in a response, searched in this order.
SPEC_KEYS = ("spec_verify_ct", "spec_accept_length", "spec_accept_histogram", "spec_accept_rate",
             "spec_accept_token_num", "spec_draft_token_num", "spec_round_emitted")


class BenchError(Exception):
    """A failure of the run that is not a bad argument (server unreachable, error response): exit code 1."""


class ArgumentError(Exception):
    """Bad user input; the message names the flag: exit code 2."""


def validate(args) -> None:
    """Check the flags that do not need the backend; fills defaults that depend on ``--backend``.

    Raises:
        ArgumentError: the message names the offending flag.
    """
    if args.limit < 0:
        raise ArgumentError(f"--limit must be >= 0 (0 = all prompts), got {args.limit}")
    if args.max_tokens < 1:
        raise ArgumentError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise ArgumentError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ArgumentError(f"--top-p must lie in (0, 1], got {args.top_p}")
    try:
        edges = [int(x) for x in args.bucket_edges.split(",")]
    except ValueError:
        raise ArgumentError(f"--bucket-edges must be comma-separated integers, got {args.bucket_edges!r}") from None
    if edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ArgumentError(f"--bucket-edges must start at 0 and increase strictly, got {args.bucket_edges!r}")
    if args.concurrency is None:
        args.concurrency = DEFAULT_CONCURRENCY[args.backend]
    if args.concurrency < 1:
        raise ArgumentError(f"--concurrency must be >= 1, got {args.concurrency}")
    if not args.timeout > 0:
        raise ArgumentError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.backend == "openai":
        if not args.base_url:
            raise ArgumentError("--base-url is required with --backend openai (e.g. http://127.0.0.1:30000)")
        url = args.base_url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
            raise ArgumentError(f"--base-url must be an http:// or https:// URL, got {args.base_url!r}")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        args.base_url = url
        if args.tokenizer and args.api != "generate":
            raise ArgumentError("--tokenizer is for --api generate (the chat endpoint applies the server's template)")
    else:
        for flag, value in (("--base-url", args.base_url), ("--tokenizer", args.tokenizer),
                            ("--scrape-metrics", args.scrape_metrics), ("--api-key", args.api_key)):
            if value:
                raise ArgumentError(f"{flag} is for --backend openai, not embedded")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ArgumentError("--plot needs matplotlib (pip install 'specadapt[plot]')") from None

