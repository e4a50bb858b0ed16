"""``specadapt serve``: the embedded engine as an OpenAI-compatible HTTP server with continuous batching.

Every engine option of ``specadapt generate`` (model, draft, verification, L, adaptive verification, TTS, weight
format, device) plus the server's own: address, batch and queue sizes, graceful-shutdown time. The sampling flags
(``--temperature``, ``--top-p``, ...) are the defaults of requests that do not set them. Endpoints and fields:
docs/serve.md.
"""

from __future__ import annotations

import argparse
import logging

from .common import UsageError
from .engine_args import _silence_gguf_progress, add_engine_arguments, build_engine, validate_engine_args

logger = logging.getLogger(__name__)

SERVE_DEFAULTS = dict(host="127.0.0.1", port=8000, max_batch_size=8, max_queue=64, shutdown_timeout=30.0)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server over the embedded engine (continuous batching)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = SERVE_DEFAULTS
    add_engine_arguments(p)
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default=d["host"], help="address to listen on (127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=d["port"], help="TCP port (0: any free port, printed at start)")
    srv.add_argument("--max-batch-size", type=int, default=d["max_batch_size"],
                     help="requests decoded together at most; others wait in the queue")
    srv.add_argument("--max-queue", type=int, default=d["max_queue"],
                     help="requests waiting for a place at most; beyond, requests get HTTP 503")
    srv.add_argument("--served-model-name", default=None,
                     help="the model id of /v1/models and of requests' 'model' (default: the --model value)")
    srv.add_argument("--shutdown-timeout", type=float, default=d["shutdown_timeout"],
                     help="seconds in-flight requests may run after SIGTERM / Ctrl-C before they end with an error")
    p.add_argument("--no-progress", action="store_true", help="no progress bars while loading")
    p.set_defaults(run=run)


def validate(args) -> None:
    """Check the engine and server flags.

    Raises:
        UsageError: a bad value, naming its flag.
    """
    validate_engine_args(args)
    if args.max_batch_size < 1:
        raise UsageError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must lie in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.tts and args.tts_scope == "request" and args.tts_params != "lora":
        raise UsageError("--tts-scope request needs --tts-params lora")


def build_server(args):
    """Load the engine from the flags and make the app. Returns ``(app, state, built)``.

    Raises:
        UsageError: a model, draft or setting that cannot be loaded.
    """
    import torch

    from ..serve.app import ServerState, create_app
    from ..serve.metrics import ServerMetrics
    from ..serve.scheduler import Scheduler

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    built = build_engine(args, args.max_batch_size)
    metrics = ServerMetrics(built.engine)
    scheduler = Scheduler(built.engine, args.max_batch_size, args.max_queue, metrics)
    state = ServerState(scheduler=scheduler, tokenizer=built.target.tokenizer,
                        model_name=args.served_model_name or args.model,
                        context_length=built.target.context_length or 2**31, vocab_size=built.target.vocab_size,
                        metrics=metrics)
    return create_app(state, on_shutdown=built.close), state, built


def run(args) -> int:
    import uvicorn

    validate(args)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        _silence_gguf_progress()
    app, state, built = build_server(args)
    target = built.target
    print(f"specadapt serve: {args.model} ({target.forward_name} forward, {target.weight_format}), draft "
          f"{args.draft}, verify {args.verify}, L = {args.num_draft_tokens}, max batch {args.max_batch_size}",
          flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = _Server(config, state.scheduler, args.shutdown_timeout)
    server.run()
    return 0


class _Server:
    """uvicorn's server, which on SIGTERM / SIGINT first tells the engine thread to drain (no new requests; the
    in-flight ones have ``shutdown_timeout`` seconds to finish before they end with an error)."""

    def __new__(cls, config, scheduler, shutdown_timeout):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                logger.warning("signal %s: draining (in-flight requests have %.0f s)", sig, shutdown_timeout)
                scheduler.drain(shutdown_timeout)
                super().handle_exit(sig, frame)

        return Server(config)
