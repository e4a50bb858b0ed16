"""Acceptance statistics, repeat rate, prompt lookup, and bundled datasets."""

import json

import numpy as np
import pytest

from specadapt.datasets import DatasetError, load_prompts
from specadapt.engine.drafts import ngram_lookup
from specadapt.engine.loop import RoundRecord
from specadapt.engine.metrics import (
    acceptance_by_position,
    acceptance_length,
    accept_rate_by_draft_position,
    ngram_repeat_rate,
)


def test_acceptance_length_and_buckets():
    rounds = [RoundRecord(0, 3, 2, 3), RoundRecord(3, 3, 0, 1), RoundRecord(600, 3, 3, 4)]
    assert acceptance_length(rounds) == pytest.approx((3 + 1 + 4) / 3)
    buckets = acceptance_by_position(rounds, (0, 512, 1024))
    assert [b["rounds"] for b in buckets] == [2, 1, 0]
    assert buckets[0]["acceptance_length"] == pytest.approx(2.0)
    assert buckets[1]["acceptance_length"] == pytest.approx(4.0)
    assert buckets[2]["end"] is None and buckets[2]["acceptance_length"] is None
    assert acceptance_length([]) is None


def test_accept_rate_by_draft_position():
    rounds = [RoundRecord(0, 3, 2, 3), RoundRecord(3, 1, 0, 1), RoundRecord(4, 3, 3, 4)]
    rates = accept_rate_by_draft_position(rounds, 4)
    assert rates == [pytest.approx(2 / 3), 1.0, 0.5, None]


def test_repeat_rate():
    assert ngram_repeat_rate([1, 2, 3]) is None
    assert ngram_repeat_rate([1, 2, 3, 4, 5, 6, 7]) == 0.0
    loop = [1, 2, 3, 4] * 10
    # Positions 3.. : the first pass of each 3-gram is new (positions 3), afterwards every position repeats.
    rate = ngram_repeat_rate(loop)
    assert rate == pytest.approx((len(loop) - 3 - 4) / (len(loop) - 3))
    # the latest occurrence decides: 1 2 3 -> 9, then 1 2 3 -> 8, then 1 2 3 -> 8 (hit) but not 9
    assert ngram_repeat_rate([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 8]) == pytest.approx(1 / 9)


def test_ngram_lookup_prefers_longest_and_latest():
    h = np.array([5, 1, 2, 3, 7, 8, 1, 2, 3, 9, 4, 2, 3])
    # suffix (2, 3): 3-gram (4,2,3) absent... (x, 2, 3) -> longest match is n=2 "2 3": latest earlier at index 7
    assert ngram_lookup(h, 3).tolist() == [9, 4, 2]
    h = np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    assert ngram_lookup(h, 2).tolist() == [5, 1]
    assert ngram_lookup(np.array([1, 2, 3]), 4).tolist() == []
    assert ngram_lookup(np.array([7, 7]), 3).tolist() == [7]
    assert ngram_lookup(h, 0).tolist() == []


def test_bundled_datasets():
    assert len(load_prompts("aime24")) == 30
    assert len(load_prompts("math500")) == 500
    assert len(load_prompts("livecodebench")) == 166
    first = load_prompts("aime24", limit=2)
    assert len(first) == 2 and "Aya" in first[0].text


def test_jsonl_file_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"question": "hi"}) + "\n\n" + json.dumps({"question": "there", "id": "b"}) + "\n")
    prompts = load_prompts(str(f), prompt_field="question")
    assert [p.text for p in prompts] == ["hi", "there"] and prompts[1].id == "b"
    with pytest.raises(DatasetError, match="no field 'prompt'"):
        load_prompts(str(f))
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_prompts("aime25")
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DatasetError, match="line 1"):
        load_prompts(str(bad))


def test_acceptance_counts_emitted_tokens_not_tokens_verified_past_eos_or_the_length_cap():
    """Issue 19.1: a round cut by EOS (or max_new_tokens) counts the tokens it committed, not tau + 1."""
    eos_round = RoundRecord(0, 5, 5, 3)  # L = 5, every draft accepted, EOS was the third token
    assert acceptance_length([eos_round]) == 3.0
    assert accept_rate_by_draft_position([eos_round], 5) == [1.0, 1.0, 1.0, None, None]
    cut = RoundRecord(0, 5, 5, 4)  # GBV verifies all L drafts; max_new_tokens keeps 4
    assert acceptance_length([cut, RoundRecord(4, 5, 1, 2)]) == 3.0
    assert accept_rate_by_draft_position([cut, RoundRecord(4, 5, 1, 2)], 5) == [1.0, 0.5, 1.0, 1.0, None]
    assert acceptance_by_position([eos_round], (0,))[0]["acceptance_length"] == 3.0


def _engine_report(target, draft, rule, limit, **kw):
    from types import SimpleNamespace

    from specadapt.cli.report import build_report
    from specadapt.engine import SpeculativeEngine
    from specadapt.sampling import SamplingParams

    engine = SpeculativeEngine(target, draft, SamplingParams(temperature=0.0), 5, rule, **kw)
    results = engine.generate([[3, 1, 4, 1, 5]], limit)
    target.tokenizer.decode = lambda ids, skip_special_tokens=True: " ".join(map(str, ids))
    report = build_report({}, [SimpleNamespace(id="p0")], target.tokenizer, results, 1.0, None, None, (0,), 5)
    return results[0], report


def test_engine_report_and_json_count_tokens_emitted_before_eos_and_the_cap():
    import torch
    from tests.helpers.models import loaded, tiny_llama

    from specadapt.engine import ModelDraft
    from specadapt.engine.drafts import self_draft
    from specadapt.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    model = tiny_llama(seed=0)
    with torch.no_grad():
        seq = [3, 1, 4, 1, 5]
        for _ in range(3):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    free = seq[5:]
    assert free[2] not in free[:2]
    target = loaded(model, eos=free[2])
    draft = ModelDraft(self_draft(target, 2), greedy, 0, "self:2")  # a copy: always accepted
    res, report = _engine_report(target, draft, "chain", 20)
    assert res.output_ids == free and res.finished_by_eos and len(res.rounds) == 1
    assert res.rounds[0].accepted == 5 and res.rounds[0].emitted == 3
    for scope in (report["summary"], report["requests"][0]):
        assert scope["acceptance_length"] == 3.0
        assert scope["accept_rate_by_draft_position"] == [1.0, 1.0, 1.0, None, None]
        assert scope["acceptance_by_position"][0]["acceptance_length"] == 3.0

    target = loaded(tiny_llama(seed=0))
    draft = ModelDraft(self_draft(target, 2), greedy, 0, "self:2")
    res, report = _engine_report(target, draft, "gbv", 4, num_paths=2)
    # GBV drafts no more than the room left (4 tokens: 3 drafts and the bonus token)
    assert len(res.output_ids) == 4 and res.rounds[0].num_drafted == 3 and res.rounds[0].accepted == 3
    assert res.rounds[0].emitted == 4
    assert report["summary"]["acceptance_length"] == 4.0
    assert report["summary"]["accept_rate_by_draft_position"] == [1.0, 1.0, 1.0, None, None]


def test_tokens_past_first_eos_and_the_ignore_eos_share():
    from types import SimpleNamespace

    from specadapt.cli.report import build_report
    from specadapt.engine.metrics import tokens_past_first_eos

    assert tokens_past_first_eos([5, 6, 2, 7, 2, 8], {2}) == 3
    assert tokens_past_first_eos([5, 6, 7], {2}) == 0
    assert tokens_past_first_eos([2], {2, 9}) == 0
    assert tokens_past_first_eos([1, 9, 4], {2, 9}) == 1
    results = [SimpleNamespace(output_ids=ids, prompt_tokens=3, rounds=[], seconds=1.0, finished_by_eos=False)
               for ids in ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10])]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    prompts = [SimpleNamespace(id="a"), SimpleNamespace(id="b")]
    report = build_report({}, prompts, tok, results, 1.0, None, None, (0,), 1, eos_ids={2, 7})
    assert [r["tokens_past_first_eos"] for r in report["requests"]] == [2, 3]
    assert report["summary"]["share_past_first_eos"] == pytest.approx(5 / 10)
    plain = build_report({}, prompts, tok, results, 1.0, None, None, (0,), 1)
    assert plain["summary"]["share_past_first_eos"] is None and "tokens_past_first_eos" not in plain["requests"][0]


def test_the_summary_says_what_batch_actually_ran(capsys):
    """Fewer requests than --batch-size: the summary line names the requests that ran together, not the flag."""
    from tests.helpers.models import loaded, tiny_llama

    from specadapt.cli.report import print_report
    from specadapt.engine import NoDraft

    _, report = _engine_report(loaded(tiny_llama(seed=0)), NoDraft(), "chain", 4)
    base = {"model": "tiny", "draft": "none", "verify": "chain", "num_draft_tokens": 0, "temperature": 0.0,
            "top_p": 1.0}
    report["config"] = dict(base, batch_size=3)
    print_report(report)
    assert "batch=1 (--batch-size 3)" in capsys.readouterr().out
    report["config"] = dict(base, batch_size=1)
    print_report(report)
    out = capsys.readouterr().out
    assert "batch=1 " in out and "--batch-size" not in out
