"""The hybrid draft (``--draft eagle+suffix``): per round and per request, the suffix draft where the text repeats,
the EAGLE head elsewhere (SuffixDecoding's hybrid with a model draft, Oliaro et al., arXiv 2411.04975, §4.3).

A round (:meth:`HybridDraft.propose`):

1. the :class:`~specadapt.engine.suffix.SuffixDraft` speculates for every row (a dictionary walk: no model work);
2. a row whose suffix match is at least ``min_match`` tokens long and that drafts at least ``min_tokens`` tokens
   takes the suffix draft (up to the round's ``max_tokens``: a repeat of earlier text is worth a long chain);
3. every other row drafts with the model (the EAGLE head) for at most ``model_tokens`` tokens (1 by default: on the
   coder's code sessions 1 paid 1.53x against 1.41x for 2, docs/suffix.md); rows that took the suffix draft ask
   the head for nothing, so the head does no work for them this round (its catch-up on their
   verified tokens is queued, as on a round without drafts).

Exactness: the choice of a row's drafter depends on the committed history only (the suffix match), never on the
target's coins, and each row's ``q`` rows are exactly the rows its tokens were drawn from (one-hot for the suffix
draft, the head's sampling distribution for the model), so chain / block verification of the merged proposal is
the verification of one of two valid drafts per row, and the output's law is the target's (tested by exact
enumeration and chi-square in tests/test_hybrid.py).

Not supported: several paths (GBV: the suffix draft proposes one deterministic path) and adaptive verification
(its estimator is fitted on one feature per draft family; the two families' features are not on one scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafts import Draft, DraftProposal, empty_proposal
from .suffix import SuffixDraft

__all__ = ["HybridConfig", "HybridDraft"]


@dataclass(frozen=True)
class HybridConfig:
    """Settings of the hybrid draft.

    Attributes:
        min_match: suffix match length (tokens, >= 1) from which a row takes the suffix draft.
        min_tokens: fewest suffix drafts (>= 1) for a row to take the suffix draft.
        model_tokens: the model draft's chain length (>= 1) on the other rows.

    Raises:
        ValueError: naming the field, for a value out of range.
    """

    min_match: int = 4
    min_tokens: int = 2
    model_tokens: int = 1

    def __post_init__(self) -> None:
        for name in ("min_match", "min_tokens", "model_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _shared(name: str):
    """An engine-set attribute (``row_seeds``, ``history_counts``, ...) held by both drafts of the hybrid."""

    def get(self):
        return getattr(self.model, name)

    def set_(self, value):
        setattr(self.model, name, value)
        setattr(self.suffix, name, value)

    return property(get, set_)


class HybridDraft(Draft):
    """``--draft eagle+suffix``: the suffix draft on rows where it matches, the model draft elsewhere.

    Args:
        model: the model draft (an :class:`~specadapt.engine.eagle_draft.EagleDraft`; any :class:`Draft` whose
            state survives rounds it drafts nothing in, i.e. that queues what it did not see, works).
        suffix: the :class:`SuffixDraft`.
        config: :class:`HybridConfig`.
        name: label in reports.

    Attributes:
        last_choice: ``[B] bool`` the rows that took the suffix draft in the last round.
        suffix_rounds / model_rounds: row-rounds drafted by each so far (reported in ``draft_stats``).
    """

    supports_paths = False
    context_capacity = _shared("context_capacity")
    row_seeds = _shared("row_seeds")
    history_counts = _shared("history_counts")
    probe_window = _shared("probe_window")
    catch_up_rows = _shared("catch_up_rows")
    row_sampling = _shared("row_sampling")

    def __init__(self, model: Draft, suffix: SuffixDraft, config: HybridConfig | None = None,
                 name: str = "eagle+suffix") -> None:
        self.model = model
        self.suffix = suffix
        self.config = config or HybridConfig()
        self.name = name
        self.sampling = getattr(model, "sampling", None)
        self.needs_target_hidden = bool(model.needs_target_hidden)
        if hasattr(model, "feature_layers"):
            self.feature_layers = model.feature_layers
        self.last_choice = torch.zeros(0, dtype=torch.bool)
        self.suffix_rounds = 0
        self.model_rounds = 0

    # ---- lifecycle: both drafts see every row ------------------------------------------------------------------
    def start(self, histories):
        self.suffix.start(histories)
        self.model.start(histories)

    def join(self, histories, features=None):
        self.suffix.join(histories)
        self.model.join(histories, features)

    def select(self, rows):
        self.suffix.select(rows)
        self.model.select(rows)

    def target_features(self, hidden_states):
        return self.model.target_features(hidden_states)

    def observe_target(self, features):
        self.model.observe_target(features)

    def plain_round(self, histories, vocab_size, features=None):
        self.model.plain_round(histories, vocab_size, features)

    def commit(self, accept_len):
        self.model.commit(accept_len)

    def tts_student(self):
        return self.model.tts_student()

    # ---- drafting ------------------------------------------------------------------------------------------------
    def propose(self, histories, max_tokens, vocab_size, draft_filter=None) -> DraftProposal:
        """Merge the two drafts' proposals row by row (see the module docstring).

        Args / returns: as :meth:`Draft.propose`; ``probs`` is ``[B, L, V] float32`` with one-hot rows where a
        row took the suffix draft. ``confidence`` is ``None`` (no adaptive verification with the hybrid).
        """
        max_tokens = max_tokens.to(torch.int64)
        batch = len(histories)
        cfg = self.config
        text = self.suffix.propose(histories, max_tokens, vocab_size)
        use_suffix = ((self.suffix.last_match >= cfg.min_match) & (text.num_tokens >= cfg.min_tokens)
                      & (max_tokens > 0))
        model_max = torch.where(use_suffix, torch.zeros_like(max_tokens), torch.clamp(max_tokens, max=cfg.model_tokens))
        learned = self.model.propose(histories, model_max, vocab_size, draft_filter=draft_filter)
        num = torch.where(use_suffix, text.num_tokens, learned.num_tokens)
        width = int(num.max()) if batch else 0
        out = empty_proposal(batch, width, vocab_size)
        out.num_tokens = num
        for source, rows in ((text, use_suffix), (learned, ~use_suffix)):
            k = min(width, source.tokens.shape[1])
            if k and bool(rows.any()):
                out.tokens[rows, :k] = source.tokens[rows, :k]
                out.probs[rows, :k] = source.probs[rows, :k]
        live = torch.arange(width)[None, :] < num[:, None]  # columns past a row's count stay token 0, q = 0
        out.tokens = torch.where(live, out.tokens, torch.zeros_like(out.tokens))
        out.probs = out.probs * live[:, :, None]
        self.last_choice = use_suffix
        drafting = max_tokens > 0
        self.suffix_rounds += int((use_suffix & drafting).sum())
        self.model_rounds += int((~use_suffix & drafting).sum())
        return out
