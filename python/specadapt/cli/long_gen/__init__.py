"""The long-generation benchmark client behind ``scripts/bench_long_gen.py`` (docs/bench_long_gen.md).

One job per module: :mod:`.options` (defaults, errors, flag checks), :mod:`.client` (the HTTP backend: requests to
an OpenAI-compatible or SGLang server, speculative counters, Prometheus samples), :mod:`.embedded` (the embedded
engine, built as ``specadapt generate`` builds it), :mod:`.report` (running a backend, the summary, the printed
table, the JSON file) and :mod:`.plot` (the figure; matplotlib is imported only there, when a figure is drawn).
Nothing is imported here, so the script's ``--help`` stays fast.
"""
