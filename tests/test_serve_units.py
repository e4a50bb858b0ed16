"""Units of ``specadapt serve`` without HTTP: incremental detokenization with stop strings (multi-byte characters
split across tokens, stop strings split across tokens, the streaming hold-back) and the scheduler's queue bound,
drain deadline and refusal after shutdown."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specadapt import kernels
from specadapt.engine import NoDraft, SpeculativeEngine
from specadapt.sampling import SamplingParams
from specadapt.serve.metrics import ServerMetrics, position_bucket
from specadapt.serve.scheduler import Job, QueueFullError, Scheduler, ShuttingDownError
from specadapt.serve.text import IncrementalText


class ByteTokenizer:
    """Token i is the i-th byte string of ``pieces``; decoding joins the bytes as UTF-8 (U+FFFD for a partial
    character), like byte-level BPE tokenizers."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_multibyte_characters_are_released_only_when_complete():
    euro = "€".encode()  # 3 bytes
    tok = ByteTokenizer([b"a", euro[:1], euro[1:2], euro[2:], b" b"])
    text = IncrementalText(tok)
    deltas = []
    for t in [0, 1, 2, 3, 4]:
        text.add([t])
        deltas.append(text.take_delta())
    assert deltas == ["a", "", "", "€", " b"] and text.text == "a€ b"


def test_a_stop_string_split_across_tokens_ends_the_text_before_it():
    tok = ByteTokenizer([b"x = 1", b"\n", b"EN", b"D", b" more"])
    text = IncrementalText(tok, stop=("END",))
    text.add([0, 1, 2])
    assert not text.stopped and text.take_delta() == "x = 1\n"  # "EN" is held back: it may start "END"
    text.add([3, 4])
    assert text.stopped and text.text == "x = 1\n" and text.num_tokens == 4  # the token completing it counts
    assert text.take_delta() == ""


def test_held_back_text_is_released_when_no_stop_string_follows():
    tok = ByteTokenizer([b"EN", b"d", b"!"])
    text = IncrementalText(tok, stop=("END",))
    text.add([0])
    assert text.take_delta() == ""
    text.add([1])
    assert text.take_delta() == "E"  # the last len("END") - 1 = 2 characters stay held back
    text.add([2])
    text.finish()
    assert text.take_delta() == "Nd!" and not text.stopped


def test_position_buckets():
    assert [position_bucket(p) for p in (0, 511, 512, 4095, 8192, 10**6)] == [
        "0-512", "0-512", "512-1024", "2048-4096", "8192+", "8192+"]


@pytest.fixture
def engine():
    if not kernels.has_op_for("native_llama_forward", torch.device("cpu")):
        pytest.skip("specadapt._C built without the native kernels")
    from tests.helpers.engine import native_target

    return SpeculativeEngine(native_target("float32", vocab=40), NoDraft(), SamplingParams(0.0), 0)


def _job(prompt, n, events, done=None):
    def sink(event):
        events.append(event)
        if event.finished and done is not None:
            done.set()

    return Job(prompt=prompt, max_tokens=n, sink=sink, ignore_eos=True)


def test_the_queue_bound_counts_waiting_beyond_the_batch(engine):
    sched = Scheduler(engine, max_batch_size=2, max_queue=1, metrics=ServerMetrics(engine))
    events = []
    for _ in range(3):  # not started: 2 places in the batch + 1 in the queue
        sched.submit(_job([1, 2, 3], 4, events))
    with pytest.raises(QueueFullError, match="--max-queue 1"):
        sched.submit(_job([1, 2, 3], 4, events))
    sched.start()
    sched.stop()
    assert sum(e.finished for e in events) == 3 and {e.finish_reason for e in events if e.finished} == {"error"}


def test_drain_lets_requests_run_until_the_deadline_then_ends_them_with_an_error(engine):
    """Rounds are slowed to >= 50 ms so the timing is deterministic: after drain(2 s) a request needing 10 more
    rounds (~0.5 s) finishes normally, one needing ~400 (~20 s) ends with the shutdown error, new ones are refused."""
    step = engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    sched = Scheduler(engine, max_batch_size=3, max_queue=4)
    sched.start()
    events = {name: [] for name in ("short", "middle", "long")}
    done = {name: threading.Event() for name in events}
    sched.submit(_job([1, 2, 3], 5, events["short"], done["short"]))
    sched.submit(_job([6, 7], 15, events["middle"], done["middle"]))
    sched.submit(_job([4, 5], 400, events["long"], done["long"]))  # prompt + output within the 512 positions
    assert done["short"].wait(30)
    sched.drain(2.0)
    with pytest.raises(ShuttingDownError):
        sched.submit(_job([1], 3, []))
    assert done["middle"].wait(30) and done["long"].wait(30)
    assert events["short"][-1].finish_reason == "length" and sum(len(e.tokens) for e in events["short"]) == 5
    assert events["middle"][-1].finish_reason == "length" and sum(len(e.tokens) for e in events["middle"]) == 15
    last = events["long"][-1]
    assert last.finish_reason == "error" and "shut down" in last.error
    assert 0 < sum(len(e.tokens) for e in events["long"]) < 400
    sched.stop()
    assert sched.idle


@pytest.mark.parametrize("argv,flag", [(["--max-batch-size", "0"], "--max-batch-size"),
                                       (["--max-queue", "-1"], "--max-queue"),
                                       (["--port", "70000"], "--port"),
                                       (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
                                       (["--temperature", "-1"], "--temperature"),
                                       (["--draft", "none", "--tts"], "--tts")])
def test_bad_serve_flags_are_one_line_exit_2(capsys, argv, flag):
    from specadapt.cli import main

    try:
        code = main(["serve", *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and flag in lines[0], err


@pytest.mark.parametrize("interval", [1, 5])
def test_a_streamed_job_gets_an_event_every_stream_interval_tokens(engine, interval):
    sched = Scheduler(engine, max_batch_size=2, max_queue=0)
    events, done = [], threading.Event()
    job = _job([1, 2, 3], 23, events, done)
    job.stream_interval = interval
    sched.start()
    sched.submit(job)
    assert done.wait(30)
    sched.stop()
    sizes = [len(e.tokens) for e in events]
    assert sum(sizes) == 23 and events[-1].finished and not any(e.finished for e in events[:-1])
    assert all(n >= interval for n in sizes[:-1])  # target-only: one token a round, so exactly the interval
    assert len(events) == (23 if interval == 1 else 5)


def test_bad_draft_and_address_fail_before_the_model_loads(capsys):
    import socket
    import time as clock

    from specadapt.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv, flag in ((["--draft", "bogus"], "--draft"), (["--host", "999.1.1.1"], "--host"),
                           (["--port", str(port)], "--port"), (["--served-model-name", " "], "--served-model-name")):
            start = clock.perf_counter()
            try:
                code = main(["serve", "--no-progress", *argv])
            except SystemExit as exc:
                code = exc.code
            err = capsys.readouterr().err
            assert code == 2 and flag in err and "Traceback" not in err, err
            assert clock.perf_counter() - start < 5  # no model was loaded
