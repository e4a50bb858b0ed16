"""Acceptance statistics of speculative decoding runs.

Terms (specs/verification.md): a round emits ``tau + 1`` tokens; the *acceptance length* is that number
averaged over rounds; rounds are bucketed by the output index of the first token they emit.
"""

from __future__ import annotations

from .loop import RoundRecord

__all__ = ["acceptance_length", "acceptance_by_position", "accept_rate_by_draft_position", "ngram_repeat_rate"]

DEFAULT_BUCKET_EDGES = (0, 512, 1024, 2048, 4096, 8192)


def acceptance_length(rounds: list[RoundRecord]) -> float | None:
    """Mean ``tau + 1`` over rounds (``None`` when there are no rounds)."""
    if not rounds:
        return None
    return sum(r.accepted + 1 for r in rounds) / len(rounds)


def acceptance_by_position(rounds: list[RoundRecord], edges=DEFAULT_BUCKET_EDGES) -> list[dict]:
    """Acceptance length per output-position bucket ``[edges[i], edges[i+1])``; the last bucket is open.

    Returns:
        ``[{"start", "end", "rounds", "acceptance_length"}]`` (``end`` is ``None`` for the open bucket,
        ``acceptance_length`` is ``None`` for an empty bucket).
    """
    edges = list(edges)
    buckets = []
    for i, start in enumerate(edges):
        end = edges[i + 1] if i + 1 < len(edges) else None
        inside = [r for r in rounds if r.position >= start and (end is None or r.position < end)]
        buckets.append(
            {"start": start, "end": end, "rounds": len(inside), "acceptance_length": acceptance_length(inside)}
        )
    return buckets


def accept_rate_by_draft_position(rounds: list[RoundRecord], num_draft_tokens: int) -> list[float | None]:
    """For draft position ``k = 1..L``: P(draft k accepted | draft k was verified).

    A draft at position ``k`` counts as accepted when ``tau >= k``. Position ``k`` is verified in every round
    that drafted at least ``k`` tokens. ``None`` where no round verified that position.
    """
    rates: list[float | None] = []
    for k in range(1, num_draft_tokens + 1):
        verified = [r for r in rounds if r.num_drafted >= k]
        rates.append(sum(r.accepted >= k for r in verified) / len(verified) if verified else None)
    return rates


def ngram_repeat_rate(tokens: list[int], n: int = 3) -> float | None:
    """Fraction of output positions predicted by an ``n``-gram lookup of the earlier output.

    Position ``i`` (``i >= n``) counts when the ``n`` tokens before it occurred earlier in the output and the
    latest such occurrence was followed by the same token as position ``i``. ``None`` for outputs of at most
    ``n`` tokens. High values mean the text loops, which inflates every acceptance figure.
    """
    if len(tokens) <= n:
        return None
    last_follower: dict[tuple[int, ...], int] = {}
    hits = 0
    for i in range(n, len(tokens)):
        key = tuple(tokens[i - n : i])
        if last_follower.get(key) == tokens[i]:
            hits += 1
        last_follower[key] = tokens[i]
    return hits / (len(tokens) - n)

