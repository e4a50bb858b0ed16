"""The long-generation benchmark's figure (``--plot``): acceptance length vs output position when the run has
per-position data, else per request. matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path


def acceptance_buckets(report: dict, context: bool = False) -> list[dict]:
    """A report's acceptance buckets ``[{start, end, rounds, acceptance_length}]``: by output position
    (``summary.acceptance_by_position``), or with ``context`` by absolute context position
    (``sessions.acceptance_by_context_position`` of ``specadapt generate --session N``).

    Raises:
        ValueError: ``context`` with a report that has no session buckets.
    """
    if not context:
        return report["summary"]["acceptance_by_position"]
    sessions = report.get("sessions") or {}
    if "acceptance_by_context_position" not in sessions:
        raise ValueError("context-position buckets need a report of `specadapt generate --session N`")
    return sessions["acceptance_by_context_position"]


def setting_label(report: dict, fallback: str = "?") -> str:
    """A report's setting in words: its draft (a head file by its name, not its path), ``+ TTS S=<stride>`` and
    ``(LoRA)`` where it trained one; ``fallback`` when the report names no draft."""
    c = report.get("config", {})
    name = c.get("draft", fallback)
    if name.startswith("eagle:"):
        name = "eagle (" + Path(name[len("eagle:"):]).stem + ")"
    if c.get("tts"):
        name += f" + TTS S={c.get('tts_stride')}"
        if c.get("tts_params") == "lora":
            name += " (LoRA)"
    return name


def acceptance_curve(report: dict, context: bool = False) -> tuple[list[float], list[float]]:
    """Acceptance length vs output position of a report (``specadapt generate --json`` or this benchmark's).

    Args:
        context: use the long sessions' buckets by absolute context position instead (:func:`acceptance_buckets`).

    Returns:
        ``(xs, ys)``: the middle of each bucket that has rounds and a known acceptance length (an open last bucket
        ``[start, None)`` counts as ``[start, 2 start)``), and that bucket's acceptance length (tokens per round).

    Raises:
        ValueError: ``context`` with a report that has no session buckets.
    """
    buckets = acceptance_buckets(report, context)
    xs, ys = [], []
    for b in buckets:
        if b["rounds"] and b["acceptance_length"] is not None:
            end = b["end"] if b["end"] is not None else b["start"] * 2
            xs.append((b["start"] + end) / 2)
            ys.append(b["acceptance_length"])
    return xs, ys


def plot(report: dict, path: str) -> str:
    """Write the figure; returns the title used.

    With per-position data (embedded backend, or a server returning ``spec_round_emitted``): acceptance length vs
    output position (bucket middles: :func:`acceptance_curve`, as ``scripts/plot_acceptance.py`` draws it).
    Otherwise per-request acceptance length vs output length, or — without any
    speculative metrics — latency vs output length; the title says which.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, s = report["config"], report["summary"]
    where = f"{c['dataset']}, T={c['temperature']}, {s['requests']} requests"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_pos = s.get("acceptance_by_position")
    if by_pos and any(b["rounds"] for b in by_pos):
        xs, ys = acceptance_curve(report)
        label = f"{c.get('draft')}{' + TTS' if c.get('tts') else ''}" if c.get("draft") else c.get("endpoint")
        ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("output position (tokens)")
        ax.set_ylabel("acceptance length (tokens / round)")
        ax.legend(fontsize=8)
        title = f"acceptance length vs output position ({where})"
    else:
        pairs = [(r["output_tokens"], r["acceptance_length"]) for r in report["requests"]
                 if r["acceptance_length"] is not None]
        if pairs:
            ax.scatter([p[0] for p in pairs], [p[1] for p in pairs])
            ax.set_ylabel("acceptance length (tokens / round)")
            title = ("per-request acceptance length vs output length\n"
                     f"(the server gives no per-position data; {where})")
        else:
            ax.scatter([r["output_tokens"] for r in report["requests"]], [r["latency_s"] for r in report["requests"]])
            ax.set_ylabel("latency (s)")
            title = f"latency vs output length\n(the server gives no speculative metrics; {where})"
        ax.set_xlabel("output length (tokens)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return title

