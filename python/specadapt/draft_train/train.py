"""The EAGLE-3 training recipe at this scale: unrolled multi-step training with a forward KL to the target,
a held-out validation split by prompt, early stopping, checkpoints to resume from, a seed.

One optimizer step averages :func:`~.unroll.unrolled_loss` over ``batch`` sequences; the learning rate warms up
linearly and decays on a cosine to ``min_lr_ratio`` of its peak over the planned steps. Every ``eval_every``
steps the head is evaluated on the validation sequences (teacher-forced acceptance and top-1 agreement per
unrolled step, :class:`~.unroll.StepStats`); the best evaluation's weights are kept, and training stops after
``patience`` evaluations without improvement of :func:`step_score` (the expected accepted drafts of a chain),
at ``max_minutes``, or after
``epochs``. A checkpoint (weights, optimizer, schedule, position, best weights, history) is written at every
evaluation; :func:`train_head` resumes from it.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .unroll import DIVERGENCES, StepStats, full_teacher, unrolled_loss

logger = logging.getLogger(__name__)

#: :attr:`TrainConfig.precision` values.
PRECISIONS = ("fp32", "bf16")

__all__ = ["PRECISIONS", "TrainConfig", "split_by_prompt", "evaluate_head", "train_head", "step_score"]


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of :func:`train_head` (see the module docstring).

    Raises:
        ValueError: naming the field, for a value out of range.
    """

    steps: int = 3  # unrolled drafting steps
    step_decay: float = 0.8  # loss weight of unrolled step s is step_decay ** (s - 1)
    epochs: int = 4
    batch: int = 4  # sequences per optimizer step
    lr: float = 1e-3
    warmup: int = 40
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    eval_every: int = 100
    patience: int = 3
    max_minutes: float = 110.0
    seed: int = 0
    divergence: str = "fkl"  # training loss per step: "fkl" forward KL, "tvd" total variation (unroll.DIVERGENCES)
    # the training forward / backward's matrix products: "fp32", or "bf16" (CPU autocast; the parameters, the
    # optimizer, the teacher, the draft logits and every validation figure stay float32). On an AMX Xeon a
    # training step ran 1.2-1.4x faster in bf16 (scripts/train_draft.py --precision auto picks it there)
    precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("steps", "epochs", "batch", "eval_every", "patience"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must lie in (0, 1], got {self.step_decay}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0 or not 0 <= self.min_lr_ratio <= 1 or self.max_minutes <= 0:
            raise ValueError("warmup must be >= 0, min_lr_ratio in [0, 1], max_minutes > 0")

    @property
    def step_weights(self) -> list[float]:
        return [self.step_decay ** s for s in range(self.steps)]


def split_by_prompt(sequences: list, fraction: float, seed: int = 0) -> tuple[list, list]:
    """``(train, validation)``: every sample of a prompt lands on the same side (no prompt is in both), about
    ``fraction`` of the prompts in validation (at least one).

    Raises:
        ValueError: ``fraction`` outside (0, 1) or fewer than two prompts.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must lie in (0, 1), got {fraction}")
    prompts = sorted({s.job[0] for s in sequences})
    if len(prompts) < 2:
        raise ValueError("a validation split needs sequences of at least two prompts")
    rng = random.Random(seed)
    held = set(rng.sample(prompts, max(1, round(fraction * len(prompts)))))
    return [s for s in sequences if s.job[0] not in held], [s for s in sequences if s.job[0] in held]


def evaluate_head(head, sequences: list, steps: int, teachers: list, step_weights: list[float]) -> dict:
    """Teacher-forced validation figures of ``head`` over ``sequences`` (answer positions only).

    Args:
        teachers: :func:`~.unroll.full_teacher` of each sequence's ``final`` (computed once by the caller).

    Returns:
        ``{"loss", "acceptance": [k], "top1": [k], "queries": [k]}``: mean KL, mean ``sum_x min(p, q)`` and
        top-1 agreement per unrolled step.
    """
    was_training = head.training
    head.eval()
    stats = [StepStats() for _ in range(steps)]
    loss_sum, loss_count = 0.0, 0
    with torch.no_grad():
        for seq, teacher in zip(sequences, teachers):
            if seq.tokens.numel() < steps + 2:
                continue
            loss = unrolled_loss(head, seq.tokens, seq.features, seq.final, steps, step_weights,
                                 first_query=seq.prompt_len - 1, teacher=teacher, stats=stats)
            if loss is not None:
                loss_sum += float(loss)
                loss_count += 1
    head.train(was_training)
    return {"loss": loss_sum / max(loss_count, 1), "acceptance": [s.acceptance / max(s.count, 1) for s in stats],
            "top1": [s.top1 / max(s.count, 1) for s in stats], "queries": [s.count for s in stats]}


def step_score(result: dict) -> float:
    """The figure early stopping and model selection maximise: the expected number of accepted drafts of a
    ``k``-token chain, ``sum_{s=1..k} prod_{m<=s} a_m``, from an :func:`evaluate_head` result's per-step
    teacher-forced acceptances ``a_1 .. a_k`` taken as independent (Leviathan et al. 2023, eq. 1 with a
    per-position rate). It weighs step 1 the most, as drafting does: a later draft counts only if every
    earlier one was accepted.

    Raises:
        ValueError: no acceptance in ``result``.
    """
    acceptance = list(result.get("acceptance") or [])
    if not acceptance:
        raise ValueError("result holds no per-step acceptance")
    score, survive = 0.0, 1.0
    for a in acceptance:
        survive *= float(a)
        score += survive
    return score


@dataclass
class _State:
    step: int = 0
    epoch: int = 0
    offset: int = 0  # sequences of the current epoch's order already used
    best_score: float = -1.0
    evals_since_best: int = 0
    seconds: float = 0.0
    history: list = field(default_factory=list)


def train_head(head, train: list, validation: list, full_head_weight: torch.Tensor, config: TrainConfig,
               checkpoint: str | Path | None = None, progress: bool = True, teachers: list | None = None) -> dict:
    """Train ``head`` in place (ending with the best validation weights loaded) and return the training log.

    Args:
        head: an attached :class:`~specadapt.engine.eagle.EagleHead` with float32 parameters.
        train / validation: :class:`~.data.Sequence` lists (see :func:`split_by_prompt`).
        full_head_weight: ``[V, h]`` the target's LM head (the validation acceptance uses the full ``p``).
        config: :class:`TrainConfig`.
        checkpoint: a file to write at every evaluation and to resume from when it exists.
        progress: a tqdm bar over optimizer steps.
        teachers: :func:`~.unroll.full_teacher` of each validation sequence, when the caller has them already
            (computed here otherwise).

    Returns:
        ``{"config", "steps", "epochs", "seconds", "stopped", "validation_before", "history", "best"}``.

    Raises:
        ValueError: empty ``train`` or ``validation``.
    """
    from tqdm import tqdm

    if not train or not validation:
        raise ValueError("train and validation must both hold sequences")
    weights = config.step_weights
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    if teachers is None:
        teachers = [full_teacher(s.final, full_head_weight) for s in validation]
    elif len(teachers) != len(validation):
        raise ValueError(f"teachers has {len(teachers)} entries for {len(validation)} validation sequences")
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    per_epoch = math.ceil(len(train) / config.batch)
    total = config.epochs * per_epoch

    def lr_at(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        t = min(1.0, (step - config.warmup) / max(1, total - config.warmup))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    state = _State()
    best = copy.deepcopy(head.state_dict())
    before = None
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        stopping = ("max_minutes", "patience", "eval_every")  # stopping rules may change on resume
        if {k: v for k, v in saved["config"].items() if k not in stopping} != \
                {k: v for k, v in asdict(config).items() if k not in stopping}:
            raise ValueError(f"checkpoint {ckpt} was written with another configuration; use a new --checkpoint")
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        state = _State(**saved["state"])
        best = saved["best"]
        before = saved["before"]
        logger.info("resumed from %s at step %d (epoch %d)", ckpt, state.step, state.epoch)
    if before is None:
        before = evaluate_head(head, validation, config.steps, teachers, weights)
        logger.info("before training: %s", before)

    def save() -> None:
        if ckpt is None:
            return
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"config": asdict(config), "head": head.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "state": asdict(state), "best": best, "before": before}, tmp)
        tmp.replace(ckpt)

    def evaluate() -> bool:
        """Evaluate, keep the best weights; True when training should stop early."""
        result = evaluate_head(head, validation, config.steps, teachers, weights)
        score = step_score(result)
        result.update(step=state.step, epoch=state.epoch, seconds=state.seconds, score=score)
        state.history.append(result)
        nonlocal best
        if score > state.best_score:
            state.best_score, state.evals_since_best = score, 0
            best = copy.deepcopy(head.state_dict())
        else:
            state.evals_since_best += 1
        logger.info("step %d: validation acceptance %s (best score %.4f)", state.step,
                    [round(a, 4) for a in result["acceptance"]], state.best_score)
        save()
        return state.evals_since_best >= config.patience

    stopped = "epochs"
    bar = tqdm(total=total, initial=state.step, unit="step", desc="training the draft head", disable=not progress)
    start = time.time() - state.seconds
    head.train()
    done = False
    while state.epoch < config.epochs and not done:
        order = list(range(len(train)))
        random.Random(config.seed * 1000 + state.epoch).shuffle(order)
        while state.offset < len(order):
            batch = [train[i] for i in order[state.offset : state.offset + config.batch]]
            state.offset += len(batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                losses = [unrolled_loss(head, s.tokens, s.features, s.final, config.steps, weights,
                                        first_query=s.prompt_len - 1, divergence=config.divergence)
                          for s in batch if s.tokens.numel() >= config.steps + 2]
            losses = [x for x in losses if x is not None]
            if not losses:
                continue
            loss = torch.stack(losses).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            state.step += 1
            state.seconds = time.time() - start
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", epoch=state.epoch)
            if state.step % config.eval_every == 0 and evaluate():
                stopped, done = "early stopping", True
                break
            if state.seconds / 60 > config.max_minutes:
                stopped, done = "max_minutes", True
                evaluate()
                break
        else:
            state.epoch += 1
            state.offset = 0
    if stopped == "epochs" and (not state.history or state.history[-1]["step"] != state.step):
        evaluate()
    bar.close()
    head.load_state_dict(best)
    return {"config": asdict(config), "steps": state.step, "epochs": state.epoch + state.offset / max(len(train), 1),
            "seconds": state.seconds, "stopped": stopped, "validation_before": before, "history": state.history,
            "best": max(state.history, key=lambda r: r["score"])}
