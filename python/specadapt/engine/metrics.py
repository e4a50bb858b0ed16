"""Acceptance statistics of speculative decoding runs.

Terms (docs/design/specs/verification.md): a round verifies ``tau + 1`` tokens; it *emits* (commits to the output) that many
unless an EOS inside them or the request's ``max_new_tokens`` cuts the round short (``RoundRecord.emitted``). The
*acceptance length* is the number of tokens emitted per round, averaged over rounds: tokens after an EOS or past
the length cap are verified but never output, so they are not counted. Rounds are bucketed by the output index
of the first token they emit.
"""

from __future__ import annotations

from .loop import RoundRecord

__all__ = ["acceptance_length", "acceptance_by_position", "accept_rate_by_draft_position", "ngram_repeat_rate",
           "tokens_past_first_eos"]

DEFAULT_BUCKET_EDGES = (0, 512, 1024, 2048, 4096, 8192)


def acceptance_length(rounds: list[RoundRecord]) -> float | None:
    """Mean tokens emitted per round (``RoundRecord.emitted``; ``None`` when there are no rounds).

    Equal to the mean of ``tau + 1`` except in rounds cut by an EOS or by ``max_new_tokens``: a round that
    accepted every one of L = 5 drafts but committed 3 tokens (EOS third) counts 3, not 6.
    """
    if not rounds:
        return None
    return sum(r.emitted for r in rounds) / len(rounds)


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
    """For draft position ``k = 1..L``: P(draft k accepted | draft k was verified and reached the output).

    Position ``k`` counts in a round that verified at least ``k`` drafts (``num_drafted >= k``) and whose
    output was not cut before slot ``k`` (``emitted >= k``); it counts as accepted when ``tau >= k``. Drafts
    verified past an EOS or past ``max_new_tokens`` are left out: they never reach the output, and a draft
    after an EOS continues text that does not exist (one round accepting all of L = 5 drafts with EOS as the
    third token contributes accepted at positions 1..3 and nothing at 4, 5). A rejected draft ``k`` always
    counts (the round emits its correction at slot ``k``) unless the length cap fell before it. ``None`` where no
    round counts that position.
    """
    rates: list[float | None] = []
    for k in range(1, num_draft_tokens + 1):
        verified = [r for r in rounds if r.num_drafted >= k and r.emitted >= k]
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



def tokens_past_first_eos(tokens: list[int], eos_ids) -> int:
    """Tokens of an output after its first end-of-sequence token (``--ignore-eos`` runs go on past the model's
    natural end; that text is not what the model answers, so figures over it say how much of it they hold).

    Args:
        tokens: the output ids; eos_ids: the model's EOS ids.

    Returns:
        ``len(tokens) - (index of the first EOS + 1)``, or 0 when no EOS occurs.
    """
    eos = set(eos_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return len(tokens) - i - 1
    return 0
