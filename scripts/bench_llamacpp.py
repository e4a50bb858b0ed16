#!/usr/bin/env python
"""llama.cpp as the side-by-side anchor for specadapt: the same GGUF files, threads and prompts through
llama.cpp's own tools and through ``specadapt generate``, one table and one JSON file (docs/llamacpp.md).

Example::

    python scripts/bench_llamacpp.py --target /models/qwen1.5b.gguf --draft-model /models/qwen0.5b.gguf \\
        --dataset livecodebench --limit 4 --max-new-tokens 256 --threads 2 --json results/llamacpp.json

llama.cpp is the source vendored in the ``llama-cpp-python==0.3.36`` sdist (``vendor/llama.cpp``): the script
downloads the sdist with pip (``pip download --no-deps --no-binary :all:``), unpacks it and builds the CPU tools
it runs with cmake (``-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release``, only the needed targets,
``cmake --build -j N``) into ``~/.cache/specadapt/llama.cpp-0.3.36/build``; the build is reused while its
binaries exist (``--rebuild`` forces a fresh one). No llama.cpp code lives in this repository.

Jobs, run one at a time (``--skip`` drops parts by name):

- ``bench``: ``llama-bench`` on the target: tg64, pp512 and pp2 / pp4 / pp8, so the cost of one forward over q
  tokens relative to a 1-token forward (``q * tg64 / ppq``) is visible;
- ``completion``: ``llama-completion`` target-only on each prompt (``--temperature``, default 0; ``-n`` new tokens, non-interactive);
  its printed eval (decode) and prompt-eval tok/s;
- ``speculative``: ``llama-speculative-simple`` with the draft model (``--num-draft`` drafts): its
  decoded tok/s, prompt (encode) tok/s and acceptance;
- ``ngram``: ``llama-speculative-simple --spec-type T`` for llama.cpp's model-free n-gram drafts
  (``ngram-simple``, ``ngram-map-k``, ``ngram-mod``, ``ngram-cache``; the ones the vendored source knows);
- ``specadapt``: ``specadapt generate --temperature T --batch-size 1 --baseline`` per ``--specadapt-drafts``
  entry; its summary's decode / target-only decode / prefill tok/s and acceptance length.

``--lockstep R`` replaces all of that with a paired comparison of target-only decoding alone: R rounds, each
running, for every prompt, ``llama-completion`` and ``specadapt generate --draft none`` on that one prompt back to
back (the order flips every pair, ABBA, so a drift of the host's memory rate within a round cancels); each
pair gives one ratio (specadapt decode tok/s / llama.cpp decode tok/s), and the table gives their median and range.
The machine's read rate here moved 31 -> 49 GB/s within five minutes, so only such paired ratios are comparable.

Prompts come from a specadapt dataset with the target's chat template applied as ``specadapt generate`` applies
it (the tokenizer of the GGUF file, one user turn, generation prompt); llama.cpp reads the templated text from a
file (``-f``) and tokenizes it with special tokens parsed.

Exit codes: 0 all jobs ran; 1 a job failed (the table and JSON still hold the rest) or the build failed
(the message names the log); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger("bench_llamacpp")

LLAMA_CPP_PYTHON = "0.3.36"
DEFAULT_CACHE = Path("~/.cache/specadapt").expanduser() / f"llama.cpp-{LLAMA_CPP_PYTHON}"
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
               # nothing is downloaded by the tools run here; these keep the configure step off optional deps
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
BINARIES = ("llama-bench", "llama-completion", "llama-speculative-simple")
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
PARTS = ("bench", "completion", "speculative", "ngram", "specadapt")
BENCH_PROMPTS = (2, 4, 8, 512)
BENCH_GEN = 64
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
MODEL_DRAFT = "model"  # --specadapt-drafts entry meaning the --draft-model file
REPO = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """A failure the script reports as one line (exit code 1)."""


class UsageError(ValueError):
    """A bad flag value (exit code 2)."""


# ---------------------------------------------------------------------------------------------- llama.cpp build


@dataclass
class LlamaCpp:
    """The built llama.cpp: source and build folders, the binaries by name, the n-gram types the source knows."""

    source: Path
    build: Path
    binaries: dict
    ngram_types: list
    version: dict


def check_toolchain() -> dict:
    """cmake and a C++ compiler on PATH; ``{"cmake": path, "cxx": path}``.

    Raises:
        BenchError: one of them is missing (naming the Debian packages that provide it).
    """
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BenchError("cmake is not on PATH: install it (apt-get install cmake, or pip install cmake)")
    cxx = next((p for p in (os.environ.get("CXX"), "c++", "g++", "clang++") if p and shutil.which(p)), None)
    if cxx is None:
        raise BenchError("no C++ compiler on PATH (c++ / g++ / clang++; set CXX): install build-essential")
    return {"cmake": cmake, "cxx": shutil.which(cxx)}


def configure_command(source: Path, build: Path) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS]


def build_command(build: Path, targets, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "-j", str(jobs), "--target", *targets]


def fetch_source(cache: Path) -> Path:
    """``vendor/llama.cpp`` of the llama-cpp-python sdist under ``cache/src`` (downloaded and unpacked once)."""
    root = cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    source = root / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    sdist_dir = cache / "sdist"
    tarballs = sorted(sdist_dir.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    if not tarballs:
        sdist_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdist_dir)]
        logger.info("downloading the llama-cpp-python %s sdist: %s", LLAMA_CPP_PYTHON, shlex.join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        tarballs = sorted(sdist_dir.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
        if proc.returncode != 0 or not tarballs:
            raise BenchError(f"pip download of llama-cpp-python=={LLAMA_CPP_PYTHON} failed: "
                             f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    logger.info("unpacking %s", tarballs[0])
    with tarfile.open(tarballs[0]) as tar:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(cache / "src", **kwargs)
    if not (source / "CMakeLists.txt").is_file():
        raise BenchError(f"{tarballs[0]} has no vendor/llama.cpp/CMakeLists.txt")
    return source


def ngram_types_in(source: Path) -> list[str]:
    """The n-gram speculation types of :data:`NGRAM_TYPES` that ``common/speculative.cpp`` names (the values of
    ``--spec-type``), in that order; empty for a source without them."""
    path = source / "common" / "speculative.cpp"
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    known = set(re.findall(r'\{\s*"([a-z0-9-]+)"\s*,\s*COMMON_SPECULATIVE_TYPE_', text))
    return [t for t in NGRAM_TYPES if t in known]


def source_version(source: Path) -> dict:
    """llama.cpp's commit (the vendored checkout's git HEAD when it carries one) and the sdist version."""
    out = {"llama_cpp_python": LLAMA_CPP_PYTHON, "commit": None, "commit_date": None, "commit_subject": None}
    if (source / ".git").exists() and shutil.which("git"):
        proc = subprocess.run(["git", "-C", str(source), "log", "-1", "--format=%H%n%cI%n%s"],
                              capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.count("\n") >= 2:
            out["commit"], out["commit_date"], out["commit_subject"] = proc.stdout.splitlines()[:3]
    return out


def ensure_build(cache: Path, rebuild: bool = False, jobs: int = 2) -> LlamaCpp:
    """Download, unpack and build llama.cpp's tools into ``cache/build`` unless its binaries are there already.

    Raises:
        BenchError: no cmake / compiler, a failed download, configure or build (naming ``cache/build.log``).
    """
    source = fetch_source(cache)
    build = cache / "build"
    bins = {name: build / "bin" / name for name in BINARIES}
    if rebuild and build.exists():
        shutil.rmtree(build)
    if not all(p.is_file() for p in bins.values()):
        check_toolchain()
        log_path = cache / "build.log"
        logger.info("building llama.cpp (%s) into %s, -j %d: several minutes; log %s", ", ".join(BINARIES),
                    build, jobs, log_path)
        start = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            for cmd in (configure_command(source, build), build_command(build, BINARIES, jobs)):
                log.write(f"$ {shlex.join(cmd)}\n")
                log.flush()
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
                if rc != 0:
                    raise BenchError(f"llama.cpp build failed ({cmd[1]} {'configure' if cmd[1] == '-S' else 'build'}"
                                     f" exited {rc}): see {log_path}")
        missing = [n for n, p in bins.items() if not p.is_file()]
        if missing:
            raise BenchError(f"llama.cpp build finished without {', '.join(missing)}: see {log_path}")
        logger.info("llama.cpp built in %.0f s", time.perf_counter() - start)
    return LlamaCpp(source, build, {n: str(p) for n, p in bins.items()}, ngram_types_in(source),
                    source_version(source))


# ----------------------------------------------------------------------------------------------------- parsers

_NUM = r"([0-9.]+|inf|nan|-nan)"
_PROMPT_EVAL = re.compile(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens \(\s*{_NUM} ms per token,\s*{_NUM} "
                          r"tokens per second\)")
_EVAL = re.compile(rf"(?<!prompt )\beval time =\s*{_NUM} ms /\s*(\d+) runs\s*\(\s*{_NUM} ms per token,\s*{_NUM} "
                   r"tokens per second\)")
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s")
# "0.09.484.690 I n_draft   = 4": an optional timestamp and log-level letter before the counter
_COUNTER = re.compile(r"^(?:\S+\s+)?(?:[A-Z]\s+)?(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)
_ACCEPT = re.compile(rf"^(?:\S+\s+)?(?:[A-Z]\s+)?accept\s*=\s*{_NUM}%", re.M)


def _num(text: str) -> float | None:
    value = float(text.replace("-nan", "nan"))
    return None if math.isnan(value) or math.isinf(value) else value


def parse_completion(text: str) -> dict:
    """llama.cpp's perf lines (``llama_perf_context_print``): prompt eval and eval (decode) counts, ms and tok/s.
    The last occurrence counts (a tool prints them once, at exit).

    Raises:
        ValueError: no eval line in ``text``.
    """
    prompt = _PROMPT_EVAL.findall(text)
    evals = _EVAL.findall(text)
    if not evals:
        raise ValueError("no 'eval time = ... tokens per second' line in llama.cpp's output")
    out = {"prompt_tokens": None, "prompt_ms": None, "prompt_tokens_per_s": None}
    if prompt:
        ms, n, _, tps = prompt[-1]
        out.update(prompt_tokens=int(n), prompt_ms=_num(ms), prompt_tokens_per_s=_num(tps))
    ms, n, _, tps = evals[-1]
    out.update(eval_runs=int(n), eval_ms=_num(ms), decode_tokens_per_s=_num(tps))
    return out


def parse_speculative(text: str) -> dict:
    """``llama-speculative-simple``'s summary: encoded / decoded tokens, seconds and t/s, the draft counters and
    the acceptance. ``acceptance_length`` = tokens per target verification = n_predict / (n_predict - n_accept)
    (every round yields its accepted drafts plus one target token), comparable to specadapt's.

    Raises:
        ValueError: no ``decoded ... t/s`` line.
    """
    decoded = _DECODED.findall(text)
    if not decoded:
        raise ValueError("no 'decoded N tokens in S seconds, speed: X t/s' line in llama-speculative-simple's output")
    n, sec, tps = decoded[-1]
    out = {"decoded_tokens": int(n), "decode_seconds": _num(sec), "decode_tokens_per_s": _num(tps),
           "prompt_tokens": None, "prompt_seconds": None, "prompt_tokens_per_s": None}
    encoded = _ENCODED.findall(text)
    if encoded:
        n, sec, tps = encoded[-1]
        out.update(prompt_tokens=int(n), prompt_seconds=_num(sec), prompt_tokens_per_s=_num(tps))
    counters = {k: int(v) for k, v in _COUNTER.findall(text)}
    out.update({k: counters.get(k) for k in ("n_draft", "n_predict", "n_drafted", "n_accept")})
    accept = _ACCEPT.findall(text)
    out["accept_rate"] = (_num(accept[-1]) / 100 if accept and _num(accept[-1]) is not None else None)
    if out["n_predict"] is None:  # this build prints no n_predict: every decoded token is a predicted one
        out["n_predict"] = out["decoded_tokens"]
    n_predict, n_accept = out["n_predict"], out["n_accept"]
    out["rounds"] = n_predict - n_accept if n_predict is not None and n_accept is not None else None
    out["acceptance_length"] = n_predict / out["rounds"] if out["rounds"] else None
    return out


def parse_bench(text: str) -> list[dict]:
    """``llama-bench -o json`` (a JSON array on stdout): one entry per test, named ``ppN`` / ``tgN`` /
    ``ppN+tgM``, with its mean and standard deviation of tok/s.

    Raises:
        ValueError: no JSON array in ``text``.
    """
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no JSON array in llama-bench's output")
    try:
        entries = json.loads(text[start:end + 1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench's JSON does not parse ({exc.msg})") from None
    tests = []
    for e in entries:
        n_prompt, n_gen = int(e.get("n_prompt", 0)), int(e.get("n_gen", 0))
        name = "+".join(x for x in (f"pp{n_prompt}" if n_prompt else "", f"tg{n_gen}" if n_gen else "") if x)
        tests.append({"test": name, "n_prompt": n_prompt, "n_gen": n_gen, "tokens_per_s": e.get("avg_ts"),
                      "stddev_tokens_per_s": e.get("stddev_ts"), "threads": e.get("n_threads"),
                      "build_commit": e.get("build_commit"), "build_number": e.get("build_number"),
                      "cpu_info": e.get("cpu_info"), "model_type": e.get("model_type"),
                      "model_size": e.get("model_size"), "repetitions": len(e.get("samples_ts") or []) or None})
    return tests


def forward_cost(tests: list[dict], gen: int = BENCH_GEN) -> dict:
    """Cost of one forward over q tokens relative to a 1-token decode forward, ``q * tg / ppq``, for every
    ``ppq`` test with q < 64 (``{"2": 1.04, ...}``); empty without the tg test."""
    by = {t["test"]: t["tokens_per_s"] for t in tests}
    tg = by.get(f"tg{gen}")
    if not tg:
        return {}
    return {str(t["n_prompt"]): t["n_prompt"] * tg / t["tokens_per_s"] for t in tests
            if t["n_gen"] == 0 and 0 < t["n_prompt"] < 64 and t["tokens_per_s"]}


def first_key(summary: dict, keys) -> tuple[float | None, str | None]:
    """The first of ``keys`` present with a value in ``summary``: ``(value, key)``, or ``(None, None)``."""
    for key in keys:
        if summary.get(key) is not None:
            return summary[key], key
    return None, None


# specadapt's report: the split decode / prefill keys where present, else today's end-to-end tokens_per_s
SPECADAPT_DECODE_KEYS = ("decode_tokens_per_s", "tokens_per_s")
SPECADAPT_BASELINE_KEYS = ("baseline_decode_tokens_per_s", "baseline_tokens_per_s")
SPECADAPT_PREFILL_KEYS = ("prefill_tokens_per_s",)


# ------------------------------------------------------------------------------------------------------- plan


@dataclass
class Job:
    """One command of the run: ``part`` (one of :data:`PARTS`), the table ``setting``, the argv, extra env."""

    part: str
    setting: str
    argv: list
    prompt_id: str | None = None
    env: dict = field(default_factory=dict)
    json_out: str | None = None  # specadapt: its --json file


def bench_command(binaries: dict, model: str, threads: int, repetitions: int) -> list[str]:
    return [binaries["llama-bench"], "-m", model, "-t", str(threads), "-p", ",".join(map(str, BENCH_PROMPTS)),
            "-n", str(BENCH_GEN), "-r", str(repetitions), "-o", "json"]


def _common(model: str, prompt_file: str, max_new: int, threads: int, ctx: int, ignore_eos: bool,
            temperature: float = 0.0) -> list[str]:
    """Arguments every llama.cpp job shares; T > 0 samples with llama.cpp's default chain (seed 0) and
    ``--top-k 0 --top-p 1 --min-p 0``, i.e. the plain softmax at T, the distribution specadapt samples."""
    sampling = ["--temp", format(temperature, "g"), "--seed", "0"]
    if temperature > 0:
        sampling += ["--top-k", "0", "--top-p", "1", "--min-p", "0"]
    return (["-m", model, "-f", prompt_file, "-n", str(max_new), "-t", str(threads), "-c", str(ctx)] + sampling
            + (["--ignore-eos"] if ignore_eos else []))


def completion_command(binaries: dict, model: str, prompt_file: str, max_new: int, threads: int, ctx: int,
                       ignore_eos: bool = False, extra=(), temperature: float = 0.0) -> list[str]:
    """Target-only, non-interactive (``-no-cnv``: the prompt file already holds the chat template)."""
    return ([binaries["llama-completion"]]
            + _common(model, prompt_file, max_new, threads, ctx, ignore_eos, temperature)
            + ["-no-cnv", "--no-display-prompt"] + list(extra))


def speculative_command(binaries: dict, model: str, prompt_file: str, max_new: int, threads: int, ctx: int,
                        draft: str | None = None, spec_type: str | None = None, num_draft: int = 4,
                        ignore_eos: bool = False, extra=(), temperature: float = 0.0) -> list[str]:
    """``llama-speculative-simple`` with a draft model (``-md``, ``--spec-draft-n-max``) or a model-free
    ``--spec-type``."""
    cmd = [binaries["llama-speculative-simple"]] + _common(model, prompt_file, max_new, threads, ctx, ignore_eos,
                                                           temperature)
    if draft is not None:
        # this llama.cpp infers the type from the draft file's metadata and otherwise runs none ("failed to
        # initialize speculative decoding"): name the plain draft-model type
        cmd += ["-md", draft, "-td", str(threads), "--spec-draft-n-max", str(num_draft)]
        if spec_type is None:
            spec_type = "draft-simple"
    if spec_type is not None:
        cmd += ["--spec-type", spec_type]
    return cmd + list(extra)


def specadapt_executable() -> list[str]:
    """The venv's ``specadapt`` console script next to this interpreter, else ``python -m specadapt``."""
    script = Path(sys.executable).with_name("specadapt")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "specadapt"]


def specadapt_command(target: str, draft: str, dataset: str, prompt_field: str | None, limit: int, max_new: int,
                      json_out: str, num_draft: int | None = None, ignore_eos: bool = False,
                      extra=(), temperature: float = 0.0, baseline: bool = True, threads: int | None = None) -> list[str]:
    """``specadapt generate`` at ``temperature`` (greedy by default), batch 1, with (``baseline``) its paired target-only baseline; ``extra`` comes last (so it
    overrides). ``num_draft`` sets ``--num-draft-tokens`` (given for model drafts, to match llama.cpp's); ``threads``
    its ``--threads`` (llama.cpp's ``-t``)."""
    cmd = specadapt_executable() + ["generate", "--model", target, "--draft", draft, "--dataset", dataset]
    if prompt_field:
        cmd += ["--prompt-field", prompt_field]
    cmd += ["--limit", str(limit), "--max-new-tokens", str(max_new), "--temperature", format(temperature, "g"),
            "--batch-size", "1", "--json", json_out, "--no-progress"] + (["--baseline"] if baseline else [])
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if temperature > 0:
        cmd += ["--top-p", "1", "--top-k", "0", "--min-p", "0"]  # the plain softmax at T, as llama.cpp's jobs
    if num_draft is not None:
        cmd += ["--num-draft-tokens", str(num_draft)]
    if ignore_eos:
        cmd += ["--ignore-eos"]
    return cmd + list(extra)


def specadapt_draft_value(entry: str, draft_model: str | None) -> str:
    """A ``--specadapt-drafts`` entry as ``--draft`` value: ``model`` is the ``--draft-model`` file."""
    if entry == MODEL_DRAFT:
        if draft_model is None:
            raise UsageError("--specadapt-drafts 'model' needs --draft-model")
        return draft_model
    return entry


def plan_jobs(args, binaries: dict, prompt_files: list[tuple[str, str]], ngram_types, ctx: int,
              dataset: str, prompt_field: str | None, tmpdir: str) -> list[Job]:
    """Every job of the run in order (``prompt_files``: ``(prompt id, file)`` pairs)."""
    skip = set(args.skip)
    extra = shlex.split(args.llama_args or "")
    jobs: list[Job] = []
    common = dict(max_new=args.max_new_tokens, threads=args.threads, ctx=ctx, ignore_eos=args.ignore_eos,
                  extra=extra, temperature=args.temperature)
    if "bench" not in skip:
        jobs.append(Job("bench", "llama-bench", bench_command(binaries, args.target, args.threads,
                                                              args.repetitions)))
    if "completion" not in skip:
        for pid, path in prompt_files:
            jobs.append(Job("completion", "llama.cpp target-only", completion_command(
                binaries, args.target, path, **common), prompt_id=pid))
    if "speculative" not in skip and args.draft_model:
        for pid, path in prompt_files:
            jobs.append(Job("speculative", f"llama.cpp draft {Path(args.draft_model).name} n={args.num_draft}",
                            speculative_command(binaries, args.target, path, draft=args.draft_model,
                                                num_draft=args.num_draft, **common), prompt_id=pid))
    if "ngram" not in skip:
        for spec_type in ngram_types:
            for pid, path in prompt_files:
                jobs.append(Job("ngram", f"llama.cpp {spec_type}", speculative_command(
                    binaries, args.target, path, spec_type=spec_type, **common), prompt_id=pid))
    if "specadapt" not in skip:
        sa_extra = shlex.split(args.specadapt_args or "")
        threads_env = {k: str(args.threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        for i, entry in enumerate(args.specadapt_drafts):
            draft = specadapt_draft_value(entry, args.draft_model)
            out = str(Path(tmpdir) / f"specadapt_{i}.json")
            is_model = entry == MODEL_DRAFT or Path(draft).suffix == ".gguf" or Path(draft).is_dir()
            label = f"specadapt {Path(draft).name if is_model else draft}" + (
                f" n={args.num_draft}" if is_model else "")
            jobs.append(Job("specadapt", label, specadapt_command(
                args.target, draft, dataset, prompt_field, args.limit, args.max_new_tokens, out,
                num_draft=args.num_draft if is_model else None, ignore_eos=args.ignore_eos, extra=sa_extra,
                temperature=args.temperature, threads=args.threads),
                env=threads_env, json_out=out))
    return jobs


# ------------------------------------------------------------------------------------------------- prompts


def resolve_dataset(dataset: str) -> tuple[str, str | None]:
    """A ``--dataset`` as ``(value for load_prompts / specadapt --dataset, --prompt-field)``: a bundled name
    whose file is not installed in the package (the LiveCodeBench file lives in ``../shared/data``) becomes that
    file's path with the dataset's prompt field; anything else is passed as given."""
    from importlib import resources

    from specadapt.datasets import BUNDLED_DATASETS

    if dataset not in BUNDLED_DATASETS:
        return dataset, None
    filename, prompt_field = BUNDLED_DATASETS[dataset]
    if resources.files("specadapt.data").joinpath(filename).is_file():
        return dataset, None
    for folder in (REPO / "python" / "specadapt" / "data", REPO.parent / "shared" / "data", REPO / "shared" / "data"):
        if (folder / filename).is_file():
            return str(folder / filename), prompt_field
    raise UsageError(f"--dataset {dataset}: {filename} is neither installed in specadapt.data nor in ../shared/data")


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def template_prompt(tokenizer, text: str) -> tuple[str, int]:
    """The prompt text after the chat template as ``specadapt generate`` applies it (one user turn plus the
    generation prompt; plain text without a template) and its token count under that tokenizer."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return templated, len(ids)
    return text, len(tokenizer(text)["input_ids"])


def prompt_file_text(text: str) -> str:
    """What to write into the ``-f`` file so llama.cpp reads exactly ``text``: its ``-f`` drops one trailing
    newline (the Qwen template ends with ``assistant\n``), so one is added."""
    return text + "\n"


def context_size(prompt_tokens, max_new: int, requested: int = 0) -> int:
    """``-c`` for llama.cpp: ``requested`` when set, else the longest prompt + new tokens + 64 slack, rounded up to
    a multiple of 256."""
    if requested:
        return requested
    need = max(prompt_tokens, default=0) + max_new + 64
    return -(-need // 256) * 256


# ------------------------------------------------------------------------------------------------- machine


def machine_info(threads: int) -> dict:
    model = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"^Model name:\s*(.+)$", out, re.M)
        model = m.group(1).strip() if m else None
    except OSError:
        pass
    flags = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
        flags = set(m.group(1).split()) if m else set()
    except OSError:
        pass
    isa = {f: f in flags for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                                     "avx512_bf16", "amx_tile")}
    return {"cpu_model": model or platform.processor() or None, "isa": isa, "cores": os.cpu_count(),
            "threads": threads, "platform": platform.platform(), "python": platform.python_version()}


def machine_limits() -> dict:
    """The machine's copy and read rates (GB/s) now, measured as ``specadapt bench-forward`` does (256 MB of
    float32; the job's threads), so decode rates can be set against the weight floor of the same run."""
    from specadapt.bench.forward import measure_machine

    m = measure_machine()
    return {"copy_gbps": m["copy_gbps"], "read_gbps": m["read_gbps"]}


def weight_floor_line(rows, limits: dict) -> str:
    """One line: the target file's bytes at the run's lower read rate (the floor of a decode step), and each
    target-only row's ms per token as a multiple of it."""
    read = min(limits["start"]["read_gbps"], limits["end"]["read_gbps"])
    floor_ms = limits["target_bytes"] / (read * 1e9) * 1e3
    parts = [f"{r.setting} {1e3 / r.decode_tokens_per_s:.1f} ms ({1e3 / r.decode_tokens_per_s / floor_ms:.2f}x)"
             for r in rows if r.decode_tokens_per_s and ("target-only" in r.setting or r.part == "bench")]
    return (f"machine: read {limits['start']['read_gbps']:.1f} / {limits['end']['read_gbps']:.1f} GB/s (start / end),"
            f" copy {limits['start']['copy_gbps']:.1f} / {limits['end']['copy_gbps']:.1f}; the target file's "
            f"{limits['target_bytes'] / 1e6:.0f} MB at {read:.1f} GB/s = {floor_ms:.1f} ms a token; "
            + "; ".join(parts))


# ------------------------------------------------------------------------------------------------- results


@dataclass
class Row:
    setting: str
    part: str
    decode_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    acceptance_length: float | None = None
    accept_rate: float | None = None
    ratio: float | None = None
    note: str = ""


def _aggregate(parsed: list[dict], tokens_key: str, seconds_key: str, seconds_scale: float, rate_key: str):
    """Total tokens / total time over prompts (a token-weighted rate); the mean of per-prompt rates when the
    counts are missing."""
    pairs = [(p.get(tokens_key), p.get(seconds_key)) for p in parsed]
    if pairs and all(n is not None and s for n, s in pairs):
        return sum(n for n, _ in pairs) / (sum(s for _, s in pairs) * seconds_scale)
    rates = [p.get(rate_key) for p in parsed if p.get(rate_key) is not None]
    return sum(rates) / len(rates) if rates else None


def completion_row(setting: str, parsed: list[dict]) -> Row:
    return Row(setting, "completion",
               decode_tokens_per_s=_aggregate(parsed, "eval_runs", "eval_ms", 1e-3, "decode_tokens_per_s"),
               prompt_tokens_per_s=_aggregate(parsed, "prompt_tokens", "prompt_ms", 1e-3, "prompt_tokens_per_s"),
               acceptance_length=1.0 if parsed else None)


def speculative_row(setting: str, part: str, parsed: list[dict]) -> Row:
    n_predict = sum(p["n_predict"] or 0 for p in parsed)
    rounds = sum(p["rounds"] or 0 for p in parsed)
    drafted = sum(p["n_drafted"] or 0 for p in parsed)
    accepted = sum(p["n_accept"] or 0 for p in parsed)
    return Row(setting, part,
               decode_tokens_per_s=_aggregate(parsed, "decoded_tokens", "decode_seconds", 1, "decode_tokens_per_s"),
               prompt_tokens_per_s=_aggregate(parsed, "prompt_tokens", "prompt_seconds", 1, "prompt_tokens_per_s"),
               acceptance_length=n_predict / rounds if rounds else None,
               accept_rate=accepted / drafted if drafted else None)


def bench_rows(tests: list[dict]) -> list[Row]:
    rows = []
    for t in tests:
        sd = t.get("stddev_tokens_per_s")
        note = f"± {sd:.2f}" if sd is not None else ""
        if t["n_gen"] and not t["n_prompt"]:
            rows.append(Row(f"llama-bench {t['test']}", "bench", decode_tokens_per_s=t["tokens_per_s"], note=note))
        else:
            rows.append(Row(f"llama-bench {t['test']}", "bench", prompt_tokens_per_s=t["tokens_per_s"], note=note))
    return rows


def specadapt_rows(setting: str, summary: dict) -> tuple[list[Row], dict]:
    """The speculative row and its paired target-only row from ``specadapt generate``'s summary, and which
    summary keys gave the numbers (``tokens_per_s`` — output tokens over the whole run, prefill included — is the
    fallback where the split decode keys are missing)."""
    decode, dkey = first_key(summary, SPECADAPT_DECODE_KEYS)
    base, bkey = first_key(summary, SPECADAPT_BASELINE_KEYS)
    prefill, pkey = first_key(summary, SPECADAPT_PREFILL_KEYS)
    base_prefill, bpkey = first_key(summary, ("baseline_prefill_tokens_per_s",))
    note = "" if dkey == SPECADAPT_DECODE_KEYS[0] else "tok/s incl. prefill"
    rows = [Row(setting, "specadapt", decode_tokens_per_s=decode, prompt_tokens_per_s=prefill,
                acceptance_length=summary.get("acceptance_length"), note=note)]
    if base is not None:
        rows.append(Row(f"{setting}: target-only (paired)", "specadapt", decode_tokens_per_s=base,
                        prompt_tokens_per_s=base_prefill, acceptance_length=1.0,
                        note="" if bkey == SPECADAPT_BASELINE_KEYS[0] else "tok/s incl. prefill"))
    return rows, {"decode": dkey, "baseline_decode": bkey, "prefill": pkey, "baseline_prefill": bpkey}


def reference_decode(rows: list[Row]) -> tuple[float | None, str | None]:
    """The ratio column's denominator: llama.cpp target-only completion decode, else llama-bench tg64."""
    for part, setting in (("completion", None), ("bench", f"llama-bench tg{BENCH_GEN}")):
        for r in rows:
            if r.part == part and (setting is None or r.setting == setting) and r.decode_tokens_per_s:
                return r.decode_tokens_per_s, r.setting
    return None, None


def with_ratios(rows: list[Row]) -> tuple[list[Row], float | None, str | None]:
    ref, ref_setting = reference_decode(rows)
    for r in rows:
        r.ratio = r.decode_tokens_per_s / ref if ref and r.decode_tokens_per_s is not None else None
    return rows, ref, ref_setting


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row], reference: str | None, cost: dict) -> str:
    width = max([len("setting")] + [len(r.setting) for r in rows])
    header = (f"{'setting':<{width}} {'decode tok/s':>12} {'prompt tok/s':>12} {'vs llama.cpp':>12} {'acc.len':>8} "
              f"{'accept':>7}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}x"
        accept = "-" if r.accept_rate is None else f"{100 * r.accept_rate:.1f}%"
        lines.append(f"{r.setting:<{width}} {_cell(r.decode_tokens_per_s, '.2f'):>12} "
                     f"{_cell(r.prompt_tokens_per_s, '.2f'):>12} {ratio:>12} {_cell(r.acceptance_length, '.2f'):>8} "
                     f"{accept:>7}  {r.note}".rstrip())
    lines.append("")
    lines.append(f"vs llama.cpp: decode tok/s / {reference} decode tok/s" if reference
                 else "vs llama.cpp: no llama.cpp target-only decode ran")
    if cost:
        lines.append("q-token forward / 1-token forward (llama-bench, q x tg64 / ppq): "
                     + "  ".join(f"q={q} {c:.2f}x" for q, c in cost.items()))
    return "\n".join(lines)


def build_document(config: dict, machine: dict, llama: dict, prompts: list, commands: list, raw: dict,
                   rows: list[Row], reference: float | None, reference_setting: str | None, cost: dict,
                   errors: list, warnings: list = ()) -> dict:
    return {"config": config, "machine": machine, "llama_cpp": llama, "prompts": prompts, "commands": commands,
            "raw": raw, "rows": [asdict(r) for r in rows],
            "reference": {"setting": reference_setting, "decode_tokens_per_s": reference},
            "forward_cost_vs_1_token": cost, "errors": errors, "warnings": list(warnings)}


# --------------------------------------------------------------------------------------------------- run


def run_job(job: Job, log_path: Path, timeout: float | None) -> tuple[int, str, float]:
    """Run one job to completion with stdin closed; stdout+stderr to ``log_path`` and returned."""
    env = dict(os.environ, **job.env)
    start = time.perf_counter()
    try:
        proc = subprocess.run(job.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", env=env, timeout=timeout)
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, output = 124, out + f"\n[bench_llamacpp] timed out after {timeout} s\n"
    except OSError as exc:
        rc, output = 127, f"[bench_llamacpp] cannot run {job.argv[0]}: {exc}\n"
    seconds = time.perf_counter() - start
    log_path.write_text(f"$ {shlex.join(job.argv)}\n{output}", encoding="utf-8")
    return rc, output, seconds


def parse_job(job: Job, output: str):
    if job.part == "bench":
        return parse_bench(output)
    if job.part == "completion":
        return parse_completion(output)
    if job.part in ("speculative", "ngram"):
        return parse_speculative(output)
    data = json.loads(Path(job.json_out).read_text(encoding="utf-8"))
    return {"summary": data.get("summary", {}), "config": {k: data.get("config", {}).get(k) for k in (
        "model", "draft", "num_draft_tokens", "forward_used", "weight_format", "kv_dtype_used", "torch_threads",
        "verify")},
        "requests": [{k: r.get(k) for k in ("id", "prompt_tokens", "output_tokens", "rounds", "acceptance_length",
                                            "tokens_per_s", "finished_by_eos")} for r in data.get("requests", [])]}


def prompt_token_mismatch(job: Job, result, prompt_info: list[dict]) -> str | None:
    """A message when llama.cpp tokenized a prompt file into another count than specadapt's tokenizer did (the
    two would then not decode the same prompt); ``None`` when they agree or the count is unknown."""
    if job.part not in ("completion", "speculative", "ngram") or not isinstance(result, dict):
        return None
    expected = next((p["tokens"] for p in prompt_info if p["id"] == job.prompt_id), None)
    got = result.get("prompt_tokens")
    if expected is None or got is None or got == expected:
        return None
    return (f"prompt {job.prompt_id}: llama.cpp counted {got} prompt tokens, specadapt's tokenizer {expected} "
            "(the chat-templated text is not tokenized alike)")


def collect_rows(jobs: list[Job], parsed: list) -> tuple[list[Row], dict]:
    """Table rows in job order (one per setting; per-prompt results aggregated) and the ``keys_used`` of each
    specadapt setting."""
    rows: list[Row] = []
    keys: dict = {}
    seen = []
    for job in jobs:
        if (job.part, job.setting) not in seen:
            seen.append((job.part, job.setting))
    for part, setting in seen:
        results = [p for j, p in zip(jobs, parsed) if j.part == part and j.setting == setting and p is not None]
        if not results:
            rows.append(Row(setting, part, note="failed"))
            continue
        if part == "bench":
            rows += bench_rows(results[0])
        elif part == "completion":
            rows.append(completion_row(setting, results))
        elif part in ("speculative", "ngram"):
            rows.append(speculative_row(setting, part, results))
        else:
            new, keys[setting] = specadapt_rows(setting, results[0]["summary"])
            rows += new
    return rows, keys


# ------------------------------------------------------------------------------------------------- lockstep


def lockstep_order(rounds: int, n_prompts: int) -> list[tuple[int, int, str]]:
    """The lock-step jobs as ``(round, prompt index, engine)``, ``engine`` in ``("llama.cpp", "specadapt")``:
    every (round, prompt) pair back to back, the first engine alternating pair by pair (ABBA)."""
    order = []
    k = 0
    for r in range(rounds):
        for i in range(n_prompts):
            pair = ("llama.cpp", "specadapt") if k % 2 == 0 else ("specadapt", "llama.cpp")
            order += [(r, i, e) for e in pair]
            k += 1
    return order


def one_prompt_dataset(path: Path, prompt_id: str, text: str) -> str:
    """A one-line .jsonl (field ``prompt``) holding ``text``, for ``specadapt generate --dataset``."""
    path.write_text(json.dumps({"id": prompt_id, "prompt": text}) + "\n", encoding="utf-8")
    return str(path)


def lockstep_pairs(results: list[tuple[int, int, str, float | None]]) -> list[dict]:
    """Pairs ``{round, prompt, llama_cpp, specadapt, ratio}`` from ``(round, prompt, engine, decode tok/s)``
    results; a pair with a failed job has ratio ``None``."""
    table: dict = {}
    for r, i, engine, rate in results:
        table.setdefault((r, i), {"round": r, "prompt": i, "llama_cpp": None, "specadapt": None})
        table[(r, i)]["llama_cpp" if engine == "llama.cpp" else "specadapt"] = rate
    pairs = []
    for key in sorted(table):
        row = table[key]
        row["ratio"] = (row["specadapt"] / row["llama_cpp"]) if row["specadapt"] and row["llama_cpp"] else None
        pairs.append(row)
    return pairs


def lockstep_summary(pairs: list[dict]) -> dict:
    """Median, geometric mean, min and max of the pairs' ratios, and how many pairs gave one."""
    ratios = sorted(p["ratio"] for p in pairs if p["ratio"] is not None)
    if not ratios:
        return {"pairs": 0, "median": None, "geomean": None, "min": None, "max": None}
    n = len(ratios)
    median = ratios[n // 2] if n % 2 else 0.5 * (ratios[n // 2 - 1] + ratios[n // 2])
    geomean = math.exp(sum(math.log(x) for x in ratios) / n)
    return {"pairs": n, "median": median, "geomean": geomean, "min": ratios[0], "max": ratios[-1]}


def run_lockstep(args, llama, prompts, prompt_files, ctx: int, run_dir: Path) -> int:
    """``--lockstep``: paired target-only decode, llama.cpp against specadapt, prompt by prompt (see the module
    docstring); prints the pairs and their summary, writes ``--json``."""
    threads_env = {k: str(args.threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    extra = shlex.split(args.llama_args or "")
    sa_extra = shlex.split(args.specadapt_args or "")
    limits = {"start": machine_limits()}
    order = lockstep_order(args.lockstep, len(prompts))
    results, commands, errors = [], [], []
    for n, (r, i, engine) in enumerate(order, start=1):
        pid, path = prompt_files[i]
        if engine == "llama.cpp":
            job = Job("completion", "llama.cpp target-only", completion_command(
                llama.binaries, args.target, path, max_new=args.max_new_tokens, threads=args.threads, ctx=ctx,
                ignore_eos=args.ignore_eos, extra=extra, temperature=args.temperature), prompt_id=pid)
        else:
            data = one_prompt_dataset(run_dir / f"prompt_{i}.jsonl", pid, prompts[i].text)
            out = str(run_dir / f"lockstep_{n:03d}.json")
            job = Job("specadapt", "specadapt target-only", specadapt_command(
                args.target, "none", data, "prompt", 1, args.max_new_tokens, out, ignore_eos=args.ignore_eos,
                extra=sa_extra, temperature=args.temperature, baseline=False, threads=args.threads), env=threads_env,
                json_out=out)
        logger.info("[%d/%d] round %d prompt %s: %s", n, len(order), r + 1, pid, engine)
        rc, output, seconds = run_job(job, run_dir / f"lockstep_{n:03d}-{job.part}.log", args.timeout)
        rate = None
        if rc == 0:
            try:
                parsed = parse_job(job, output)
                rate = (completion_row(job.setting, [parsed]).decode_tokens_per_s if engine == "llama.cpp"
                        else first_key(parsed["summary"], SPECADAPT_DECODE_KEYS)[0])
            except (ValueError, OSError, KeyError) as exc:
                errors.append({"job": n, "error": f"output not understood ({exc})"})
        else:
            errors.append({"job": n, "error": f"exited {rc}: " + " | ".join(output.strip().splitlines()[-3:])})
        results.append((r, i, engine, rate))
        commands.append({"job": n, "round": r, "prompt_id": pid, "engine": engine, "command": shlex.join(job.argv),
                         "returncode": rc, "seconds": seconds, "decode_tokens_per_s": rate})
    limits["end"] = machine_limits()
    pairs = lockstep_pairs(results)
    summary = lockstep_summary(pairs)
    print()
    print(f"lock-step target-only decode: {Path(args.target).name}, dataset {args.dataset} x{len(prompts)}, "
          f"{args.lockstep} round(s), new tokens {args.max_new_tokens}, threads {args.threads}, T={args.temperature:g}")
    print("| round | prompt | llama.cpp tok/s | specadapt tok/s | ratio |\n|---|---|---|---|---|")
    for p in pairs:
        print(f"| {p['round'] + 1} | {prompt_files[p['prompt']][0]} | {_cell(p['llama_cpp'], '.2f')} | "
              f"{_cell(p['specadapt'], '.2f')} | {_cell(p['ratio'], '.3f')} |")
    if summary["pairs"]:
        print(f"specadapt / llama.cpp over {summary['pairs']} pairs: median {summary['median']:.3f}x, geometric "
              f"mean {summary['geomean']:.3f}x, range {summary['min']:.3f}-{summary['max']:.3f}x")
    print(f"machine: read {limits['start']['read_gbps']:.1f} / {limits['end']['read_gbps']:.1f} GB/s (start / end)")
    if args.json:
        doc = {"mode": "lockstep", "config": {k: v for k, v in vars(args).items() if k != "log_level"},
               "machine": dict(machine_info(args.threads), limits=limits), "llama_cpp": dict(llama.version),
               "pairs": pairs, "summary": summary, "commands": commands, "errors": errors}
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    if errors:
        print(f"{len(errors)} job(s) failed: " + "; ".join(str(e) for e in errors), file=sys.stderr)
        return 1
    return 0


def resolve_model(value: str | None, flag: str) -> str | None:
    """A ``--target`` / ``--draft-model`` value: an existing path, or a preset name through
    ``specadapt.engine.presets.preset_path`` where that module exists."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.exists():
        return str(path)
    try:
        from specadapt.engine.presets import preset_path
    except ImportError:
        raise UsageError(f"{flag} {value!r}: no such file, and this specadapt has no presets "
                         "(specadapt.engine.presets): pass a .gguf path") from None
    try:
        resolved = Path(preset_path(value))
    except Exception as exc:  # the presets module's own error names the problem
        raise UsageError(f"{flag} {value!r}: {exc}") from None
    if not resolved.exists():
        raise UsageError(f"{flag} {value!r}: preset file {resolved} does not exist")
    return str(resolved)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="target .gguf file or preset name")
    p.add_argument("--draft-model", default=DEFAULT_DRAFT,
                   help="draft .gguf file or preset name (llama-speculative-simple -md, and 'model' in "
                        "--specadapt-drafts); 'none' for no draft-model jobs")
    p.add_argument("--dataset", default="livecodebench", help="aime24 | math500 | livecodebench | a .jsonl file")
    p.add_argument("--prompt-field", default=None, help="JSON field of the prompt (default: the dataset's own)")
    p.add_argument("--limit", type=int, default=4, help="prompts")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per prompt (llama.cpp -n)")
    p.add_argument("--threads", type=int, default=2, help="threads of every job (llama.cpp -t, OMP_NUM_THREADS)")
    p.add_argument("--num-draft", type=int, default=4,
                   help="draft tokens per round for model drafts (llama.cpp --spec-draft-n-max, specadapt "
                        "--num-draft-tokens)")
    p.add_argument("--repetitions", type=int, default=3, help="llama-bench -r")
    p.add_argument("--ctx-size", type=int, default=0, help="llama.cpp -c (0: longest prompt + new tokens + slack)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every job (0: greedy; > 0: plain softmax at T, seed 0)")
    p.add_argument("--ignore-eos", action="store_true", help="decode every prompt to --max-new-tokens (all jobs)")
    p.add_argument("--skip", nargs="*", default=[], choices=PARTS, metavar="PART",
                   help=f"parts not to run: {' '.join(PARTS)}")
    p.add_argument("--specadapt-drafts", nargs="+", default=["ngram", MODEL_DRAFT],
                   help="specadapt --draft values, one specadapt run each ('model' = the --draft-model file)")
    p.add_argument("--specadapt-args", default="",
                   help="extra args appended to every specadapt generate (last wins), e.g. "
                        "--specadapt-args='--draft ngram' (use '=' so the value may start with --)")
    p.add_argument("--llama-args", default="", help="extra args appended to llama-completion / speculative-simple")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="sdist, source, build and run logs")
    p.add_argument("--rebuild", action="store_true", help="delete the build folder and build again")
    p.add_argument("--build-jobs", type=int, default=2, help="cmake --build -j")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp and exit")
    p.add_argument("--lockstep", type=int, default=0, metavar="R",
                   help="paired target-only decode only: R rounds of llama-completion and specadapt on each prompt "
                        "back to back, ABBA order; prints each pair's ratio and their median (0: the full run)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for flag in ("limit", "max_new_tokens", "threads", "num_draft", "repetitions", "build_jobs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.lockstep < 0:
        p.error(f"--lockstep must be >= 0, got {args.lockstep}")
    if args.draft_model in ("none", ""):
        args.draft_model = None
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cache = Path(args.cache_dir).expanduser()
    try:
        llama = ensure_build(cache, args.rebuild, args.build_jobs)
        if args.build_only:
            print(json.dumps({"build": str(llama.build), "binaries": llama.binaries,
                              "ngram_types": llama.ngram_types, **llama.version}, indent=2))
            return 0
        args.target = resolve_model(args.target, "--target")
        args.draft_model = resolve_model(args.draft_model, "--draft-model")
        dataset, prompt_field = resolve_dataset(args.dataset)
        prompt_field = args.prompt_field or prompt_field
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from specadapt.datasets import DatasetError, load_prompts

    try:
        prompts = load_prompts(dataset, prompt_field, args.limit)
    except DatasetError as exc:
        print(f"error: --dataset: {exc}", file=sys.stderr)
        return 2
    logger.info("templating %d prompt(s) with the tokenizer of %s", len(prompts), args.target)
    tokenizer = load_tokenizer(args.target)
    run_dir = cache / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    prompt_files, prompt_info = [], []
    for i, prompt in enumerate(prompts):
        text, n_tokens = template_prompt(tokenizer, prompt.text)
        path = run_dir / f"prompt_{i}.txt"
        path.write_text(prompt_file_text(text), encoding="utf-8")
        prompt_files.append((prompt.id, str(path)))
        prompt_info.append({"id": prompt.id, "file": str(path), "chars": len(text), "tokens": n_tokens})
    ctx = context_size([p["tokens"] for p in prompt_info], args.max_new_tokens, args.ctx_size)
    if args.lockstep:
        return run_lockstep(args, llama, prompts, prompt_files, ctx, run_dir)
    with tempfile.TemporaryDirectory(prefix="bench_llamacpp_") as tmpdir:
        try:
            jobs = plan_jobs(args, llama.binaries, prompt_files, llama.ngram_types, ctx, dataset, prompt_field,
                             tmpdir)
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        parsed, commands, errors, warnings = [], [], [], []
        limits = {"start": machine_limits()}
        for n, job in enumerate(jobs, start=1):
            where = f" prompt {job.prompt_id}" if job.prompt_id is not None else ""
            logger.info("[%d/%d] %s%s", n, len(jobs), job.setting, where)
            log_path = run_dir / f"{n:02d}-{job.part}.log"
            rc, output, seconds = run_job(job, log_path, args.timeout)
            result = error = None
            if rc == 0:
                try:
                    result = parse_job(job, output)
                except (ValueError, OSError, KeyError) as exc:
                    error = f"output not understood ({exc})"
            else:
                tail = " | ".join(output.strip().splitlines()[-3:])
                error = f"exited {rc}: {tail}"
            if error:
                logger.error("[%d/%d] %s failed: %s (log %s)", n, len(jobs), job.setting, error, log_path)
                errors.append({"job": n, "setting": job.setting, "prompt_id": job.prompt_id, "error": error,
                               "log": str(log_path)})
            else:
                logger.info("[%d/%d] done in %.1f s", n, len(jobs), seconds)
                mismatch = prompt_token_mismatch(job, result, prompt_info)
                if mismatch:
                    logger.warning("[%d/%d] %s", n, len(jobs), mismatch)
                    warnings.append({"job": n, "setting": job.setting, "warning": mismatch})
            parsed.append(result)
            commands.append({"job": n, "part": job.part, "setting": job.setting, "prompt_id": job.prompt_id,
                             "argv": job.argv, "command": shlex.join(job.argv), "env": job.env, "returncode": rc,
                             "seconds": seconds, "log": str(log_path)})
    rows, keys = collect_rows(jobs, parsed)
    rows, reference, ref_setting = with_ratios(rows)
    limits["end"] = machine_limits()
    limits["target_bytes"] = os.path.getsize(args.target)
    bench = next((p for j, p in zip(jobs, parsed) if j.part == "bench" and p), [])
    cost = forward_cost(bench)
    print()
    print(f"target {Path(args.target).name}  draft {Path(args.draft_model).name if args.draft_model else '-'}  "
          f"dataset {args.dataset} x{len(prompts)}  new tokens {args.max_new_tokens}  threads {args.threads}  "
          f"T={args.temperature:g}  llama.cpp {(llama.version.get('commit') or 'unknown commit')[:10]} "
          f"(llama-cpp-python {LLAMA_CPP_PYTHON})")
    print(format_table(rows, ref_setting, cost))
    print(weight_floor_line(rows, limits))
    raw = {"per_job": [{"job": i + 1, "part": j.part, "setting": j.setting, "prompt_id": j.prompt_id, "result": p}
                       for i, (j, p) in enumerate(zip(jobs, parsed))], "specadapt_keys_used": keys}
    config = {k: v for k, v in vars(args).items() if k not in ("log_level",)}
    config.update(dataset_resolved=dataset, prompt_field_resolved=prompt_field, ctx_size_used=ctx,
                  run_dir=str(run_dir))
    llama_doc = dict(llama.version, source=str(llama.source), build=str(llama.build), binaries=llama.binaries,
                     cmake_flags=CMAKE_FLAGS, ngram_types=llama.ngram_types,
                     build_commit=(bench[0].get("build_commit") if bench else None),
                     build_number=(bench[0].get("build_number") if bench else None))
    doc = build_document(config, dict(machine_info(args.threads), limits=limits), llama_doc, prompt_info, commands, raw, rows,
                         reference, ref_setting, cost, errors, warnings)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    if errors:
        print(f"{len(errors)} job(s) failed: " + "; ".join(f"{e['setting']} ({e['log']})" for e in errors),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
