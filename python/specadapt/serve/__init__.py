"""``specadapt serve``: the embedded engine behind an OpenAI-compatible HTTP API (an adapter layer over the engine).

:mod:`.scheduler` (continuous batching on an engine thread), :mod:`.app` (FastAPI endpoints, SSE streaming),
:mod:`.protocol` (request bodies, errors), :mod:`.text` (incremental detokenization, stop strings),
:mod:`.metrics` (Prometheus). The command is :mod:`specadapt.cli.serve`; docs/serve.md describes the API.
"""
