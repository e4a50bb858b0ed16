"""The draft head's training data: the target's own sampled generations with the hidden states the head reads.

Each sequence is a chat-templated training prompt followed by the target's sampled answer (temperature and
top-p of :class:`GenerationConfig`, ending at the model's EOS or after ``max_new_tokens``). At every position
``t`` the target's forward that consumed token ``x_t`` gives the head's features ``f_t`` (the low / middle /
high hidden states, ``[3h]``) and the final normed hidden state ``h_t`` (``[h]``), from which the teacher
distribution ``p(x_{t+1} | x_<=t) = softmax(h_t @ W_head.T)`` is recomputed at training time (storing ``h`` costs
576 numbers per token, a distribution 49,152). Features and hidden states come from the same forward the engine
drafts with (the native forward in the run's weight format), so training sees what inference feeds the head.

Generation runs target-only decoding on the engine's slot cache with continuous batching: a row that finishes
is refilled with the next pending job at once (the prompt's prefill is its own forward, the decode steps of all
rows one packed forward). Jobs are ``(prompt, sample)`` pairs, sample-major (every prompt's first sample before
any second one), each with its own random stream, so a job's text does not depend on the batch it ran in.

Shards (``shard_NNNNN.safetensors`` in the output directory) hold ``shard_sequences`` finished sequences:
``tokens [N] int32``, ``offsets [S+1] int64`` (sequence ``s`` is ``tokens[offsets[s]:offsets[s+1]]``),
``prompt_lens [S] int32``, ``jobs [S, 2] int64`` (prompt index, sample), ``features [N, 3h] bfloat16``,
``final [N, h] bfloat16`` (rows aligned with ``tokens``; a sequence's last row is zero: no forward consumed its
last token). ``manifest.json`` holds the configuration; a second run with the same directory resumes (jobs in
finished shards are skipped) and refuses a different configuration.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..sampling import SamplingParams, logits_to_probs, sample_from_probs
from .split import TrainPrompt

logger = logging.getLogger(__name__)

__all__ = ["GenerationConfig", "Sequence", "chat_prompt_ids", "generate_shards", "iter_sequences", "read_manifest",
           "shard_paths", "job_seed"]

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class GenerationConfig:
    """How the training data is generated.

    Raises:
        ValueError: naming the field, for a value out of range.
    """

    max_new_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 0.95
    batch_size: int = 16
    min_tokens: int = 1_000_000  # generated (answer) tokens to reach; jobs stop being started after that
    max_samples_per_prompt: int = 16
    max_prompt_tokens: int = 2048  # longer prompts keep their last this many tokens
    shard_sequences: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "min_tokens", "max_samples_per_prompt", "max_prompt_tokens",
                     "shard_sequences"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p)  # raises naming temperature / top_p

    def identity(self) -> dict:
        """The fields that decide the sequences' text (a resumed run must match them)."""
        keep = ("max_new_tokens", "temperature", "top_p", "max_prompt_tokens", "seed")
        return {k: v for k, v in asdict(self).items() if k in keep}


@dataclass
class Sequence:
    """One training sequence read back from a shard (see the module docstring for the tensors)."""

    tokens: torch.Tensor  # [T] int64
    prompt_len: int
    features: torch.Tensor  # [T, 3h] bfloat16
    final: torch.Tensor  # [T, h] bfloat16
    job: tuple[int, int]


def job_seed(seed: int, prompt: int, sample: int) -> int:
    """The random stream of one job: a fixed mix of the run's seed, the prompt index and the sample index."""
    return (int(seed) * 1_000_003 + int(sample) * 7_919 + int(prompt) * 104_729) % (2**63 - 1)


def chat_prompt_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    """Token ids of ``text`` as one user turn with the generation prompt (the model's chat template), keeping
    the last ``max_tokens``."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)[-max_tokens:]


def shard_paths(out_dir: str | Path) -> list[Path]:
    """The finished shards of a data directory, in order."""
    return sorted(Path(out_dir).glob("shard_*.safetensors"))


def read_manifest(out_dir: str | Path) -> dict | None:
    path = Path(out_dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def iter_sequences(out_dir: str | Path, shards: list[Path] | None = None):
    """Yield every :class:`Sequence` of a data directory (or of the given shards), shard by shard."""
    from safetensors.torch import load_file

    for path in shards if shards is not None else shard_paths(out_dir):
        t = load_file(str(path))
        offsets = t["offsets"].tolist()
        for s in range(len(offsets) - 1):
            a, b = offsets[s], offsets[s + 1]
            yield Sequence(tokens=t["tokens"][a:b].long(), prompt_len=int(t["prompt_lens"][s]),
                           features=t["features"][a:b], final=t["final"][a:b],
                           job=(int(t["jobs"][s, 0]), int(t["jobs"][s, 1])))


def _done_jobs(out_dir: Path) -> tuple[set[tuple[int, int]], int, int]:
    """Jobs in finished shards, their generated tokens, and the number of shards."""
    from safetensors import safe_open

    done, generated = set(), 0
    shards = shard_paths(out_dir)
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            jobs = f.get_tensor("jobs").tolist()
            offsets = f.get_tensor("offsets")
            prompt_lens = f.get_tensor("prompt_lens")
        done.update((int(a), int(b)) for a, b in jobs)
        generated += int((offsets[1:] - offsets[:-1] - prompt_lens).sum())
    return done, generated, len(shards)


def _write_shard(out_dir: Path, index: int, finished: list[dict]) -> Path:
    from safetensors.torch import save_file

    lengths = [int(s["tokens"].numel()) for s in finished]
    offsets = torch.zeros(len(finished) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    tensors = {
        "tokens": torch.cat([s["tokens"] for s in finished]).to(torch.int32),
        "offsets": offsets,
        "prompt_lens": torch.tensor([s["prompt_len"] for s in finished], dtype=torch.int32),
        "jobs": torch.tensor([s["job"] for s in finished], dtype=torch.int64),
        "features": torch.cat([s["features"] for s in finished]).contiguous(),
        "final": torch.cat([s["final"] for s in finished]).contiguous(),
    }
    path = out_dir / f"shard_{index:05d}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)  # a shard exists whole or not at all
    return path


class _Row:
    """One running job of the batch."""

    def __init__(self, job, prompt_ids, generator):
        self.job = job
        self.prompt = prompt_ids
        self.tokens: list[int] = list(prompt_ids)
        self.features: list[torch.Tensor] = []  # bfloat16 [n, 3h] chunks, one row per consumed token
        self.final: list[torch.Tensor] = []
        self.generator = generator

    def finished(self) -> dict:
        width3 = self.features[0].shape[1]
        width = self.final[0].shape[1]
        features = torch.cat(self.features + [torch.zeros(1, width3, dtype=torch.bfloat16)])
        final = torch.cat(self.final + [torch.zeros(1, width, dtype=torch.bfloat16)])
        tokens = torch.tensor(self.tokens, dtype=torch.int64)
        assert features.shape[0] == tokens.numel() == final.shape[0]
        return {"tokens": tokens, "prompt_len": len(self.prompt), "job": list(self.job), "features": features,
                "final": final}


def generate_shards(target, prompts: list[TrainPrompt], out_dir: str | Path, config: GenerationConfig,
                    feature_layers: tuple[int, int, int], progress: bool = True) -> dict:
    """Generate (or resume generating) training sequences into ``out_dir``.

    Args:
        target: a :class:`~specadapt.engine.models.LoadedModel`; the native forward when attached (the engine's
            fastest), else transformers' over the ragged cache.
        prompts: training prompts (never evaluation ones: see :mod:`.split`).
        out_dir: the data directory (created; resumed when it holds a manifest).
        config: :class:`GenerationConfig`.
        feature_layers: the head's three ``hidden_states`` indices.
        progress: show a tqdm bar of generated tokens.

    Returns:
        A summary: ``{"sequences", "generated_tokens", "shards", "seconds", "tokens_per_second"}`` of this call.

    Raises:
        ValueError: ``prompts`` empty, or ``out_dir`` holding data generated with another configuration, target,
            weight format or feature layers (the message names the differing field).
    """
    import time

    from tqdm import tqdm

    if not prompts:
        raise ValueError("prompts must not be empty")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_layers = int(target.model.config.num_hidden_layers)
    identity = {**config.identity(), "target": target.name, "weight_format": target.weight_format,
                "feature_layers": list(feature_layers), "prompts": [p.key for p in prompts]}
    old = read_manifest(out_dir)
    if old is not None:
        for key, value in identity.items():
            if old.get("identity", {}).get(key) != value:
                raise ValueError(f"{out_dir} holds data generated with another {key} "
                                 f"({old.get('identity', {}).get(key)!r} != {value!r}); use a new directory")
    (out_dir / MANIFEST).write_text(json.dumps({"identity": identity, "config": asdict(config)}, indent=1))
    done, generated, num_shards = _done_jobs(out_dir)
    tok = target.tokenizer
    eos = target.eos_token_ids()
    params = SamplingParams(temperature=config.temperature, top_p=config.top_p)
    prompt_ids = [chat_prompt_ids(tok, p.text, config.max_prompt_tokens) for p in prompts]
    jobs = ((p, s) for s in range(config.max_samples_per_prompt) for p in range(len(prompts)) if (p, s) not in done)
    capture = tuple(feature_layers) + (num_layers,)
    capacity = max(len(p) for p in prompt_ids) + config.max_new_tokens + 16
    batch = config.batch_size
    cache = target.new_cache(batch, capacity=capacity, capture=capture)
    rows: list[_Row | None] = [None] * batch
    finished: list[dict] = []
    start, started_tokens, new_tokens, new_sequences = time.time(), generated, 0, 0
    bar = tqdm(total=config.min_tokens, initial=min(generated, config.min_tokens), unit="tok",
               desc="generating draft training data", disable=not progress)

    def sample(logits: torch.Tensor, which: list[int]) -> list[int]:
        """One token per row of ``logits [R, V]`` (rows of the batch ``which``), each with its job's stream."""
        probs = logits_to_probs(logits.float(), params)
        coins = torch.cat([torch.rand(1, generator=rows[r].generator, dtype=torch.float64) for r in which])
        return sample_from_probs(probs, coins).tolist()

    def take(row: int, features: torch.Tensor, final: torch.Tensor, token: int) -> bool:
        """Record a forward's outputs for ``row`` and its sampled next token; True when the row finished."""
        r = rows[row]
        r.features.append(features.to(torch.bfloat16))
        r.final.append(final.to(torch.bfloat16))
        r.tokens.append(token)
        return token in eos or len(r.tokens) - len(r.prompt) >= config.max_new_tokens

    def finish(row: int) -> None:
        nonlocal num_shards, new_tokens, new_sequences
        r = rows[row]
        finished.append(r.finished())
        count = len(r.tokens) - len(r.prompt)
        new_tokens += count
        new_sequences += 1
        bar.update(count)
        rows[row] = None
        if len(finished) >= config.shard_sequences:
            _write_shard(out_dir, num_shards, finished)
            num_shards += 1
            finished.clear()

    with torch.no_grad():
        while True:
            for row in range(batch):  # refill free rows: one prefill forward each
                if rows[row] is not None or started_tokens + new_tokens >= config.min_tokens:
                    continue
                job = next(jobs, None)
                if job is None:
                    break
                ids = prompt_ids[job[0]]
                rows[row] = _Row(job, ids, torch.Generator().manual_seed(job_seed(config.seed, *job)))
                lengths = cache.lengths.clone()
                lengths[row] = 0
                cache.truncate(lengths)
                width = len(ids)
                chunk = torch.zeros(batch, width, dtype=torch.int64)
                chunk[row] = torch.tensor(ids)
                valid = torch.zeros(batch, dtype=torch.int64)
                valid[row] = width
                out = cache.forward(chunk, valid, logits_to_keep=1, return_outputs=True, output_hidden_states=True)
                hs = out.hidden_states
                features = torch.cat([hs[i][row] for i in feature_layers], dim=-1)
                token = sample(out.logits[row, -1:], [row])[0]
                if take(row, features, hs[num_layers][row], token):
                    finish(row)
            active = [r for r in range(batch) if rows[r] is not None]
            if not active:
                break
            last = torch.tensor([rows[r].tokens[-1] if rows[r] is not None else 0 for r in range(batch)])
            valid = torch.tensor([1 if rows[r] is not None else 0 for r in range(batch)], dtype=torch.int64)
            out = cache.forward(last[:, None], valid, return_outputs=True, output_hidden_states=True)
            hs = out.hidden_states
            features = torch.cat([hs[i][:, 0] for i in feature_layers], dim=-1)
            tokens = sample(out.logits[torch.tensor(active), 0], active)
            for k, r in enumerate(active):
                if take(r, features[r : r + 1], hs[num_layers][r, 0:1], tokens[k]):
                    finish(r)
    if finished:
        _write_shard(out_dir, num_shards, finished)
        num_shards += 1
    bar.close()
    seconds = time.time() - start
    return {"sequences": new_sequences, "generated_tokens": new_tokens, "total_generated_tokens": started_tokens + new_tokens,
            "shards": num_shards, "seconds": seconds, "tokens_per_second": new_tokens / max(seconds, 1e-9)}
