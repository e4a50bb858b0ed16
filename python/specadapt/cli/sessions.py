"""Long sessions (``specadapt generate --session S``): real text over the whole context.

A session is one conversation: each answer ends naturally (EOS, or ``--max-new-tokens``), then the next problem is
appended as a new user turn (the model's chat template) and the model answers again, until the next prompt would
leave fewer than ``reserve`` tokens of the context window. Each turn is one engine request whose prompt is the
whole conversation so far, so the draft sees the long context (the regime of the issue "A draft head worth
adapting"), and no output runs past the model's end of turn (unlike ``--ignore-eos``, whose text past EOS is
degenerate). Session ``s`` of ``S`` takes problems ``s, s + S, s + 2S, ...`` of the dataset (cycling), so the
sessions' problems are disjoint while the dataset lasts.

With follow-ups (``--follow-ups code`` or a file of the user's), each problem's answer is followed by the
follow-up turns in order (for code: explain the solution and re-emit it improved, write unit tests for it, fix a
stated bug), each answered to its natural EOS, before the session's next problem: the model revises and re-emits
its own code, the workload where a draft that learns from the context (TTS, suffix decoding) should shine.

Acceptance is reported by absolute position in the context (:func:`context_position_rounds`) as well as by
position in the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from ..datasets import Prompt
from ..engine.loop import Request, RequestResult, RoundRecord

__all__ = ["CODE_FOLLOW_UPS", "CONTEXT_EDGES", "SessionTurn", "context_position_rounds", "load_follow_ups",
           "run_sessions", "turn_prompt"]

logger = logging.getLogger(__name__)

#: Bucket edges (tokens of context) for acceptance by absolute position: 0-512-1K-2K-4K-8K and beyond.
CONTEXT_EDGES = (0, 512, 1024, 2048, 4096, 8192)

#: The bundled follow-ups of a code session (``--follow-ups code``): each makes the model revise and re-emit the
#: code of its previous answer.
CODE_FOLLOW_UPS = (
    "Explain your solution step by step. Then give an improved version of the complete program, with comments "
    "and checks on the input.",
    "Write unit tests for your improved program with Python's unittest module, covering normal cases and edge "
    "cases, and show the complete program together with the tests.",
    "A user reports a bug: the program crashes when the input is empty or holds a single value. Fix it and show "
    "the complete corrected program.",
)
#: One follow-up that re-emits the answer's code (``--follow-ups code-tests``, ``specadapt demo``'s default on a
#: coder target): the turn where a session repeats the most text.
CODE_TESTS_FOLLOW_UP = (CODE_FOLLOW_UPS[1],)
BUNDLED_FOLLOW_UPS = {"code": CODE_FOLLOW_UPS, "code-tests": CODE_TESTS_FOLLOW_UP}


def load_follow_ups(spec: str | None) -> tuple[str, ...]:
    """The follow-up turns named by ``--follow-ups``: ``None`` / ``""`` / ``none`` (no follow-ups), a bundled
    name (``code``), a ``.json`` file holding a list of strings, or a text file with one follow-up per non-empty
    line.

    Raises:
        ValueError: an unknown name, a missing / unreadable file, or a file without follow-ups (the message names
            ``--follow-ups``).
    """
    import json
    from pathlib import Path

    if spec in (None, "", "none"):
        return ()
    if spec in BUNDLED_FOLLOW_UPS:
        return BUNDLED_FOLLOW_UPS[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"--follow-ups {spec!r}: neither a bundled set ({', '.join(BUNDLED_FOLLOW_UPS)}) nor a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--follow-ups {spec!r}: cannot read the file ({exc})") from None
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--follow-ups {spec!r}: not valid JSON ({exc})") from None
        if not isinstance(items, list) or not all(isinstance(x, str) and x.strip() for x in items):
            raise ValueError(f"--follow-ups {spec!r}: a .json file must hold a list of non-empty strings")
    else:
        items = [line.strip() for line in text.splitlines() if line.strip()]
    if not items:
        raise ValueError(f"--follow-ups {spec!r}: the file holds no follow-up")
    return tuple(x.strip() for x in items)


def turn_prompt(problems: list[Prompt], follow_ups: tuple[str, ...], sessions: int, session: int,
                turn: int) -> tuple[Prompt, int]:
    """The user message of turn ``turn`` of session ``session`` and the index of the dataset problem it belongs
    to: with F follow-ups, turns come in groups of F + 1 (the problem, then each follow-up in order), and group g
    of session s asks problem ``s + sessions * g`` (cycling over ``problems``). A follow-up's id is the problem's
    id with ``+f1``, ``+f2``, ... appended."""
    group, j = divmod(turn, len(follow_ups) + 1)
    index = session + sessions * group
    problem = problems[index % len(problems)]
    if j == 0:
        return problem, index
    return Prompt(f"{problem.id}+f{j}", follow_ups[j - 1]), index


@dataclass
class SessionTurn:
    """One turn of a session: the problem asked, the full conversation prompt (token ids) and the answer.

    Attributes:
        session, turn: indices (0-based).
        prompt: the dataset problem of this turn.
        prompt_ids: the whole conversation up to this turn's generation prompt (chat-templated token ids).
        result: the engine's result for the turn (its ``output_ids`` end at EOS unless the limit cut them).
    """

    session: int
    turn: int
    prompt: Prompt
    prompt_ids: list[int]
    result: RequestResult | None = None

    @property
    def id(self) -> str:
        return f"s{self.session}.t{self.turn}:{self.prompt.id}"


def context_position_rounds(turns: list[SessionTurn]) -> list[RoundRecord]:
    """Every turn's rounds with ``position`` shifted to the absolute context position (prompt length + output
    position), for :func:`specadapt.engine.metrics.acceptance_by_position` with :data:`CONTEXT_EDGES`."""
    out = []
    for turn in turns:
        offset = len(turn.prompt_ids)
        out += [RoundRecord(offset + r.position, r.num_drafted, r.accepted, r.emitted) for r in turn.result.rounds]
    return out


def run_sessions(engine, tokenize: Callable[[list[dict]], list[int]], decode: Callable[[list[int]], str],
                 problems: list[Prompt], sessions: int, batch_size: int, max_new_tokens: int, context: int,
                 reserve: int = 512, seed: int = 0, forced: dict[tuple[int, int], list[int]] | None = None,
                 on_tokens: Callable[[int], None] | None = None,
                 follow_ups: tuple[str, ...] = ()) -> list[SessionTurn]:
    """Run ``sessions`` long sessions on ``engine``, ``batch_size`` of them at a time (continuous batching: a
    session's next turn joins the running batch as soon as its previous answer ends).

    Args:
        engine: a :class:`~specadapt.engine.SpeculativeEngine` (``open_batch`` / ``join`` / ``step``).
        tokenize: chat messages ``[{"role", "content"}]`` -> token ids with the generation prompt added.
        decode: answer token ids -> text (special tokens skipped), appended as the assistant's turn.
        problems: the dataset's prompts (at least one).
        sessions: S >= 1; batch_size >= 1; max_new_tokens >= 1: the limit of one answer.
        context: the model's context window in tokens; a turn is asked only while its prompt leaves at least
            ``reserve`` tokens (and the answer is cut to the room left).
        seed: turn ``t`` of session ``s`` decodes with seed ``seed + 1000 * s + t``.
        forced: target-only engines: ``{(session, turn): token ids}`` to emit instead of sampling (paired
            timing of a speculative run's sessions; the conversation then follows that text).
        on_tokens: called with the number of tokens emitted after every round.
        follow_ups: user turns asked after each problem's answer, in order, before the next problem
            (:func:`turn_prompt`, :func:`load_follow_ups`).

    Returns:
        The turns in the order they finished.

    Raises:
        ValueError: no problems, or ``sessions`` / ``batch_size`` / ``max_new_tokens`` / ``reserve`` out of range
            (the message names the argument).
    """
    if not problems:
        raise ValueError("problems must hold at least one prompt")
    for name, value, low in (("sessions", sessions, 1), ("batch_size", batch_size, 1),
                             ("max_new_tokens", max_new_tokens, 1), ("reserve", reserve, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    messages: dict[int, list[dict]] = {s: [] for s in range(sessions)}
    asked: dict[int, int] = {s: 0 for s in range(sessions)}

    def next_turn(s: int) -> tuple[SessionTurn, Request] | None:
        t = asked[s]
        if forced is not None and (s, t) not in forced:
            return None
        problem, index = turn_prompt(problems, tuple(follow_ups), sessions, s, t)
        if index == len(problems) and t % (len(follow_ups) + 1) == 0:
            logger.warning("sessions: all %d problems asked; later turns repeat them (raise --limit, 0 = all)",
                           len(problems))
        conversation = messages[s] + [{"role": "user", "content": problem.text}]
        ids = tokenize(conversation)
        room = context - len(ids)
        if room < reserve and t > 0:  # the first turn always runs (the caller checked it fits)
            return None
        asked[s] = t + 1
        messages[s] = conversation
        turn = SessionTurn(s, t, problem, ids)
        limit = min(max_new_tokens, max(room, 0))
        extra = {} if forced is None else {"forced": forced[(s, t)], "max_new_tokens": len(forced[(s, t)])}
        request = Request(ids, extra.get("max_new_tokens", limit), seed + 1000 * s + t, forced=extra.get("forced"))
        return turn, request

    done: list[SessionTurn] = []
    running: dict[int, tuple[int, SessionTurn]] = {}  # id(request) -> (session, turn)
    waiting = list(range(sessions))

    def start(s: int) -> Request | None:
        nxt = next_turn(s)
        if nxt is None:
            return None
        turn, request = nxt
        running[id(request)] = (s, turn)
        return request

    engine.open_batch()
    try:
        first = [r for r in (start(waiting.pop(0)) for _ in range(min(batch_size, len(waiting)))) if r is not None]
        engine.join(first)
        while engine.num_active:
            joining = []
            for request, tokens, finished in engine.step():
                if on_tokens is not None and tokens:
                    on_tokens(len(tokens))
                if not finished:
                    continue
                s, turn = running.pop(id(request))
                turn.result = request.result
                done.append(turn)
                messages[s] = messages[s] + [{"role": "assistant", "content": decode(request.result.output_ids)}]
                following = start(s)
                while following is None and waiting:  # this session is full: start a waiting one
                    following = start(waiting.pop(0))
                if following is not None:
                    joining.append(following)
            if joining:
                engine.join(joining)
    finally:
        engine.close_batch()
    return done
