"""Long sessions (``generate --session S``, specadapt.cli.sessions): every answer ends at EOS or its limit, the next
problem is a new user turn of the same conversation, until the context is nearly full."""

from __future__ import annotations

import json

import pytest

from specadapt.cli.sessions import (CODE_FOLLOW_UPS, CONTEXT_EDGES, context_position_rounds, load_follow_ups,
                                    run_sessions, turn_prompt)
from specadapt.datasets import Prompt
from specadapt.engine import NgramDraft, NoDraft, SpeculativeEngine
from specadapt.engine.loop import RequestResult, RoundRecord
from specadapt.engine.metrics import acceptance_by_position
from tests.helpers.cli import run_generate
from tests.helpers.engine import GREEDY
from tests.helpers.models import WORDS, loaded, tiny_llama

USER, ASSISTANT, GEN = 1, 2, 3


def _tokenize(messages):
    """A stand-in chat template: a role token, then the content's ids; the generation prompt token last."""
    ids = []
    for message in messages:
        ids.append(USER if message["role"] == "user" else ASSISTANT)
        ids += [int(x) for x in message["content"].split()]
    return ids + [GEN]


def _decode(ids):
    return " ".join(str(i) for i in ids)


PROBLEMS = [Prompt(f"p{i}", " ".join(str(4 + (5 * i + 3 * j) % 24) for j in range(6))) for i in range(5)]


def _run(engine, forced=None, sessions=2, batch_size=2, max_new=12, context=120, reserve=30, follow_ups=()):
    return run_sessions(engine, _tokenize, _decode, PROBLEMS, sessions, batch_size, max_new, context, reserve,
                        seed=3, forced=forced, follow_ups=follow_ups)


def test_turns_continue_the_conversation_until_the_context_is_nearly_full():
    target = loaded(tiny_llama(seed=0))
    turns = _run(SpeculativeEngine(target, NgramDraft(), GREEDY, 3, "chain"))
    by_session = {s: sorted((t for t in turns if t.session == s), key=lambda t: t.turn) for s in (0, 1)}
    for s, chain in by_session.items():
        assert len(chain) >= 2
        messages = []
        for t in chain:
            # turn t of session s asks problem s + 2t, after the whole conversation so far
            assert t.prompt is PROBLEMS[(s + 2 * t.turn) % len(PROBLEMS)]
            messages = messages + [{"role": "user", "content": t.prompt.text}]
            assert t.prompt_ids == _tokenize(messages)
            assert len(t.prompt_ids) <= 120 - 30 or t.turn == 0  # a turn is asked only with `reserve` room
            assert 1 <= len(t.result.output_ids) <= min(12, 120 - len(t.prompt_ids))
            messages = messages + [{"role": "assistant", "content": _decode(t.result.output_ids)}]
        # the session stopped because the next prompt would leave less than `reserve` tokens
        following = _tokenize(messages + [{"role": "user", "content": PROBLEMS[(s + 2 * len(chain)) % 5].text}])
        assert 120 - len(following) < 30


def test_speculative_sessions_equal_target_only_sessions_in_greedy_decoding():
    target = loaded(tiny_llama(seed=1))
    spec = _run(SpeculativeEngine(target, NgramDraft(), GREEDY, 4, "block"), batch_size=1)
    base = _run(SpeculativeEngine(target, NoDraft(), GREEDY, 0, "chain"), batch_size=2)
    key = lambda t: (t.session, t.turn)  # noqa: E731
    assert [(key(t), t.prompt_ids, t.result.output_ids) for t in sorted(spec, key=key)] == \
           [(key(t), t.prompt_ids, t.result.output_ids) for t in sorted(base, key=key)]
    forced = {key(t): t.result.output_ids for t in spec}
    paired = _run(SpeculativeEngine(target, NoDraft(), GREEDY, 0, "chain"), forced=forced)
    assert sorted((key(t), t.prompt_ids, t.result.output_ids) for t in paired) == \
           sorted((key(t), t.prompt_ids, t.result.output_ids) for t in spec)


def test_turn_prompt_asks_each_problems_follow_ups_before_the_next_problem():
    fu = ("9 9", "8 8 8")
    asked = [turn_prompt(PROBLEMS, fu, 2, 1, t) for t in range(7)]
    assert [p.id for p, _ in asked] == ["p1", "p1+f1", "p1+f2", "p3", "p3+f1", "p3+f2", "p0"]
    assert [i for _, i in asked] == [1, 1, 1, 3, 3, 3, 5]
    assert asked[1][0].text == "9 9" and asked[2][0].text == "8 8 8" and asked[3][0] is PROBLEMS[3]
    assert [turn_prompt(PROBLEMS, (), 2, 0, t)[0] for t in range(3)] == [PROBLEMS[0], PROBLEMS[2], PROBLEMS[4]]


def test_follow_up_sessions_follow_the_plan_and_stay_exact():
    target = loaded(tiny_llama(seed=2))
    fu = ("7 7 7", "6 6")
    turns = _run(SpeculativeEngine(target, NgramDraft(), GREEDY, 3, "chain"), follow_ups=fu, context=160)
    for s in (0, 1):
        chain = sorted((t for t in turns if t.session == s), key=lambda t: t.turn)
        assert len(chain) >= 3
        messages = []
        for t in chain:
            want, _ = turn_prompt(PROBLEMS, fu, 2, s, t.turn)
            assert t.prompt.text == want.text and t.prompt.id == want.id
            messages = messages + [{"role": "user", "content": want.text}]
            assert t.prompt_ids == _tokenize(messages)  # the follow-up sees the whole conversation, answers included
            messages = messages + [{"role": "assistant", "content": _decode(t.result.output_ids)}]
    base = _run(SpeculativeEngine(target, NoDraft(), GREEDY, 0, "chain"), follow_ups=fu, context=160)
    key = lambda t: (t.session, t.turn)  # noqa: E731
    assert sorted((key(t), t.result.output_ids) for t in base) == sorted((key(t), t.result.output_ids) for t in turns)


def test_load_follow_ups(tmp_path):
    assert load_follow_ups("code") == CODE_FOLLOW_UPS and len(CODE_FOLLOW_UPS) == 3
    tests_turn = load_follow_ups("code-tests")  # the demo's session: the one turn that re-emits the program
    assert tests_turn == (CODE_FOLLOW_UPS[1],) and "unit tests" in tests_turn[0] and "complete program" in tests_turn[0]
    assert load_follow_ups(None) == () and load_follow_ups("none") == ()
    (tmp_path / "f.txt").write_text("first one\n\n  second  \n")
    assert load_follow_ups(str(tmp_path / "f.txt")) == ("first one", "second")
    (tmp_path / "f.json").write_text(json.dumps(["a", "b c"]))
    assert load_follow_ups(str(tmp_path / "f.json")) == ("a", "b c")
    for bad, text in (("bad.json", "{}"), ("empty.txt", "\n\n"), ("broken.json", "[")):
        (tmp_path / bad).write_text(text)
        with pytest.raises(ValueError, match="--follow-ups"):
            load_follow_ups(str(tmp_path / bad))
    with pytest.raises(ValueError, match="--follow-ups.*code"):
        load_follow_ups("no-such-set")


def test_context_position_rounds_shift_by_the_prompt():
    from specadapt.cli.sessions import SessionTurn

    turn = SessionTurn(0, 0, PROBLEMS[0], [5] * 600, RequestResult(0, 600, rounds=[RoundRecord(0, 3, 2, 3),
                                                                                   RoundRecord(3, 3, 0, 1)]))
    shifted = context_position_rounds([turn])
    assert [r.position for r in shifted] == [600, 603]
    buckets = acceptance_by_position(shifted, CONTEXT_EDGES)
    assert [b["rounds"] for b in buckets] == [0, 2, 0, 0, 0, 0]  # both in [512, 1024)


@pytest.mark.parametrize("argument, value", [("sessions", 0), ("batch_size", 0), ("max_new_tokens", 0),
                                             ("reserve", 0)])
def test_bad_arguments_are_named(argument, value):
    args = dict(sessions=1, batch_size=1, max_new_tokens=4, reserve=8)
    args[argument] = value
    with pytest.raises(ValueError, match=argument):
        run_sessions(None, _tokenize, _decode, PROBLEMS, args["sessions"], args["batch_size"],
                     args["max_new_tokens"], 64, args["reserve"])


_generate = run_generate


def test_generate_session_end_to_end(capsys, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is the sum of two and {w}"}) + "\n" for w in WORDS[:3]))
    out = tmp_path / "sessions.json"
    code, stdout, err = _generate(capsys, "--model", str(tiny_model_dir), "--dataset", str(data), "--draft", "ngram",
                                  "--session", "2", "--session-reserve", "200", "--max-new-tokens", "24",
                                  "--batch-size", "2", "--baseline", "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    sessions = report["sessions"]
    assert sessions["sessions"] == 2 and all(n >= 2 for n in sessions["turns"])
    assert len(report["requests"]) == sum(sessions["turns"])
    assert all(tokens <= 512 for tokens in sessions["context_tokens"])
    assert sum(b["rounds"] for b in sessions["acceptance_by_context_position"]) == report["summary"]["rounds"]
    assert report["summary"]["baseline_output_tokens"] == report["summary"]["output_tokens"]  # paired
    assert "acceptance length by context position" in stdout
    assert sessions["follow_ups"] == []


def test_generate_code_session_with_follow_ups(capsys, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"write a function that adds {w}"}) + "\n" for w in WORDS[:2]))
    out = tmp_path / "sessions.json"
    code, _, err = _generate(capsys, "--model", str(tiny_model_dir), "--dataset", str(data), "--draft", "ngram",
                             "--session", "1", "--follow-ups", "code", "--session-reserve", "64",
                             "--session-context", "400",
                             "--max-new-tokens", "16", "--json", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["sessions"]["follow_ups"] == list(CODE_FOLLOW_UPS)
    ids = [r["id"] for r in report["requests"]]
    assert len(ids) >= 2 and ids[1].endswith("+f1")  # the first follow-up comes right after the first problem
    assert max(report["sessions"]["context_tokens"]) <= 400  # --session-context caps the conversation


@pytest.mark.parametrize("argv, flag", [(["--session", "-1"], "--session"),
                                        (["--session", "1", "--session-reserve", "0"], "--session-reserve"),
                                        (["--session", "1", "--ignore-eos"], "--ignore-eos"),
                                        (["--follow-ups", "code"], "--session"),
                                        (["--session", "1", "--session-context", "-1"], "--session-context"),
                                        (["--session", "1", "--session-context", "4"], "--session-context"),
                                        (["--session", "1", "--follow-ups", "nope"], "--follow-ups")])
def test_generate_session_bad_flags(capsys, tiny_model_dir, argv, flag):
    code, _, err = _generate(capsys, "--model", str(tiny_model_dir), *argv)
    assert code == 2 and flag in err
