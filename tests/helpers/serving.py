"""Helpers of the ``specadapt serve`` tests: a real server (uvicorn) on a free loopback port in a thread, built
exactly as the command builds it, and target-only greedy decoding to compare its outputs with."""

from __future__ import annotations

import socket
import time

import httpx

from specadapt.cli import build_parser
from specadapt.cli.serve import build_server, validate
from specadapt.serve.app import start_http_thread
from specadapt.engine import NoDraft, SpeculativeEngine
from specadapt.sampling import SamplingParams

GREEDY = SamplingParams(0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """``specadapt serve ARGV`` on 127.0.0.1 in a background thread (stop with :meth:`close`).

    Attributes:
        url: ``http://127.0.0.1:PORT``; state: the app's ``ServerState``; built: the engine's ``BuiltEngine``.
    """

    def __init__(self, argv: list[str]) -> None:
        args = build_parser().parse_args(["serve", "--port", "0", "--no-progress"] + argv)
        validate(args)
        self.app, self.state, self.built = build_server(args)  # its lifespan runs the engine loop on a thread
        self.server, self.thread, port = start_http_thread(self.app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples as ``{name{labels}: value}`` (the exposition's own text before the value)."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll ``/metrics`` until no request runs or waits; returns the last samples."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["specadapt_num_running_requests"] == 0 and m["specadapt_num_waiting_requests"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout} s: {m}")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def target_only_greedy(target, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy target-only decoding of ``prompt`` by the engine (EOS ends it)."""
    return SpeculativeEngine(target, NoDraft(), GREEDY, 0).generate([prompt], max_tokens)[0].output_ids
