"""Benchmark prompts: the bundled AIME 2024, MATH-500 and LiveCodeBench files, or any .jsonl file.

Bundled files are copies of public benchmark data (attribution and licenses in ``specadapt/data/SOURCES.md``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["BUNDLED_DATASETS", "Prompt", "DatasetError", "load_prompts"]

# name -> (file inside specadapt/data, field holding the prompt text)
BUNDLED_DATASETS = {
    "aime24": ("aime24.jsonl", "prompt"),
    "math500": ("math500.jsonl", "problem"),
    "livecodebench": ("livecodebench_v5_2408_2410.jsonl", "prompt"),
}


class DatasetError(ValueError):
    """A dataset that cannot be found or read; the message names the file or field."""


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``id`` (a record field when present, else the line index) and its text."""

    id: str
    text: str


def load_prompts(dataset: str, prompt_field: str | None = None, limit: int | None = None) -> list[Prompt]:
    """Read prompts from a bundled dataset name or a ``.jsonl`` path.

    Args:
        dataset: ``aime24`` | ``math500`` | ``livecodebench`` or a path to a JSON-lines file.
        prompt_field: the field holding the prompt (default: the dataset's own, ``prompt`` for files).
        limit: keep the first ``limit`` prompts (``None`` for all).

    Raises:
        DatasetError: unknown name, missing file, malformed JSON, missing or non-string field, no prompts.
    """
    if dataset in BUNDLED_DATASETS:
        filename, default_field = BUNDLED_DATASETS[dataset]
        text = resources.files("specadapt.data").joinpath(filename).read_text(encoding="utf-8")
        source = f"bundled {dataset}"
    else:
        path = Path(dataset).expanduser()
        if not path.suffix == ".jsonl" and not path.exists():
            raise DatasetError(
                f"unknown dataset {dataset!r}: use one of {sorted(BUNDLED_DATASETS)} or a .jsonl file"
            )
        if not path.is_file():
            raise DatasetError(f"dataset file {str(path)!r} does not exist")
        text = path.read_text(encoding="utf-8")
        default_field, source = "prompt", str(path)
    field = prompt_field or default_field
    prompts: list[Prompt] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{source}: line {line_no} is not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or field not in record:
            raise DatasetError(f"{source}: line {line_no} has no field {field!r} (set --prompt-field)")
        if not isinstance(record[field], str):
            raise DatasetError(f"{source}: line {line_no} field {field!r} is not a string")
        rid = record.get("id", record.get("unique_id", record.get("question_id", len(prompts))))
        prompts.append(Prompt(id=str(rid), text=record[field]))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DatasetError(f"{source}: no prompts found")
    return prompts
