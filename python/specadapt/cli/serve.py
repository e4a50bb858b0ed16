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

SERVE_DEFAULTS = dict(host="127.0.0.1", port=8000, max_batch_size=8, max_queue=64, shutdown_timeout=30.0,
                      stream_interval=4)


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
    srv.add_argument("--stream-interval", type=int, default=d["stream_interval"],
                     help="tokens between the chunks of a streamed response (1: a chunk every round; larger costs "
                          "less CPU beside decoding, docs/serve.md)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model id of /v1/models and of requests' 'model'; None: the --model value")
    srv.add_argument("--default-max-tokens", type=int, default=None,
                     help="max_tokens of requests that do not set it; None: the rest of the model's context (as "
                          "OpenAI / vLLM), which on a CPU can mean minutes for one forgotten request")
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
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name must not be empty")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise UsageError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.stream_interval < 1:
        raise UsageError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.tts and args.tts_scope == "request" and args.tts_params != "lora":
        raise UsageError("--tts-scope request needs --tts-params lora")


def check_address(host: str, port: int) -> None:
    """Bind ``host:port`` once before the model loads, so a bad address fails at once (one line, exit 2).

    Raises:
        UsageError: the address cannot be resolved or bound.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"--host: cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(f"--host / --port: cannot listen on {host}:{port}: {exc.strerror}") from None


def build_server(args, start_engine: bool = True):
    """Load the engine from the flags and make the app (``start_engine``: its lifespan runs the engine loop on a
    thread of its own). Returns ``(app, state, built)``.

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
                        metrics=metrics, stream_interval=args.stream_interval,
                        default_max_tokens=args.default_max_tokens)
    return create_app(state, start_engine, on_shutdown=built.close), state, built


def run(args) -> int:
    import signal

    from ..serve.app import start_http_thread

    validate(args)
    check_address(args.host, args.port)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        _silence_gguf_progress()
    app, state, built = build_server(args, start_engine=False)
    target, scheduler = built.target, state.scheduler
    # The engine loop runs here, on the thread that loaded and warmed up the model (see specadapt.serve.scheduler:
    # torch kernels on a second thread ran 3x slower); the HTTP server runs on a thread of its own.
    try:
        server, web, port = start_http_thread(app, args.host, args.port, log_level="info",
                                              timeout_graceful_shutdown=args.shutdown_timeout + 5)
    except RuntimeError:
        built.close()
        raise UsageError(f"--host / --port: cannot serve on {args.host}:{args.port} (see the log above)") from None
    print(f"specadapt serve: http://{args.host}:{port}/v1 -- {state.model_name} ({target.forward_name} forward, "
          f"{target.weight_format}), draft {args.draft}, verify {args.verify}, L = {args.num_draft_tokens}, "
          f"max batch {args.max_batch_size}, queue {args.max_queue}", flush=True)

    def on_signal(sig, frame):
        if scheduler.draining:  # a second Ctrl-C: end what is left now
            logger.warning("signal %s again: ending the in-flight requests", sig)
            scheduler.stop(timeout=0)
            return
        logger.warning("signal %s: draining (no new requests; in-flight ones have %.0f s)", sig, args.shutdown_timeout)
        scheduler.drain(args.shutdown_timeout)
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        scheduler.run()
    finally:
        server.should_exit = True
        web.join(args.shutdown_timeout + 10)
        built.close()
    return 0
