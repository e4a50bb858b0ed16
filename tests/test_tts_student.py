"""The one Test-Time Speculation student protocol, example type and collate (specadapt.tts.student / example):
every engine draft kind and every SGLang student implements the protocol; collate pads examples into the loss
inputs; distillation_loss is tts_loss over them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.engine import make_head
from specadapt.engine import ModelDraft, NgramDraft
from specadapt.engine.drafts import NoDraft, self_draft
from specadapt.engine.eagle_draft import EagleDraft
from specadapt.engine.tts_students import EagleDraftStudent, EngineStudent, ModelDraftStudent
from specadapt.sampling import SamplingParams
from specadapt.sglang.students import SGLangStudent
from specadapt.tts import Student, TTSConfig, TTSExample, TTSUpdater, collate, distillation_loss, top_k_rows, tts_loss

_PROTOCOL = ("module", "draft_vocab", "trainable", "shared", "refresh", "example_logits")


def _check_student(student) -> None:
    assert isinstance(student, Student)
    for name in _PROTOCOL:
        assert hasattr(student, name), name
    assert isinstance(student.module, nn.Module)
    assert student.draft_vocab is None or student.draft_vocab.dtype == torch.int64
    assert any(student.trainable(n, p) for n, p in student.module.named_parameters())
    list(student.shared())


def test_every_engine_draft_kind_says_whether_it_is_a_student(tiny_target):
    params = SamplingParams(0.9)
    assert NoDraft().tts_student() is None and NgramDraft().tts_student() is None
    model = ModelDraft(self_draft(tiny_target, 1), params, 5, "self:1").tts_student()
    eagle = EagleDraft(make_head(tiny_target.model), params, 5).tts_student()
    assert isinstance(model, ModelDraftStudent) and isinstance(eagle, EagleDraftStudent)
    for student in (model, eagle):
        _check_student(student)
        assert isinstance(student, EngineStudent) and student.trainable_prefixes
    assert model.draft_vocab is None and eagle.draft_vocab.shape[0] <= tiny_target.model.config.vocab_size
    assert not isinstance(NgramDraft(), Student)


def test_engine_student_example_logits_cover_the_supervised_positions(tiny_target):
    params = SamplingParams(0.9)
    for draft in (ModelDraft(self_draft(tiny_target, 1), params, 5, "self:1"),
                  EagleDraft(make_head(tiny_target.model), params, 5)):
        student = draft.tts_student()
        draft.start([[1, 2, 3, 4], [5, 6]])
        if isinstance(draft, EagleDraft):  # the head's context is its recent (feature, token) pairs
            width = draft.head.fuse.in_features
            draft.recent_features = [torch.randn(3, width), torch.randn(2, width)]
            draft.recent_tokens = [torch.tensor([2, 3, 4]), torch.tensor([5, 6])]
        examples = [TTSExample(teacher=torch.zeros(c, 1), weights=torch.ones(c),
                               context=student.context(r, h, 8), drafts=torch.tensor([7, 8, 9][:c]))
                    for r, (h, c) in enumerate((([1, 2, 3, 4], 3), ([5, 6], 2)))]
        with torch.no_grad():
            logits = student.example_logits(student.module, examples)
            alone = student.logits_one(student.module, examples[1].context, examples[1].drafts)
        assert logits.shape[:2] == (2, 3) and logits.dtype == torch.float32
        torch.testing.assert_close(logits[1, :2], alone.float(), atol=1e-4, rtol=1e-4)


def test_sglang_students_implement_the_protocol():
    from tests.test_sglang_adapter import _student as eagle3_student
    from tests.test_sglang_dflash_tts import _student as dflash_student
    from tests.helpers.sglang import _hf, _sglang_layout
    from specadapt.sglang.students import build_student

    dense_draft = _sglang_layout(_hf("llama"), "llama")
    students = [eagle3_student()[1], dflash_student()[1], build_student(dense_draft, dense_draft.config)]
    for student in students:
        _check_student(student)
        assert isinstance(student, SGLangStudent) and isinstance(student.uses_features, bool)
        assert student.vocab_size > 0
    assert [s.uses_features for s in students] == [True, True, False]


def test_collate_pads_densifies_and_moves():
    g = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(3, 6, generator=g), -1)
    q = torch.softmax(torch.randn(3, 6, generator=g), -1)
    values, index = top_k_rows(rows[:2], 2)
    dense = TTSExample(teacher=rows, weights=torch.tensor([1.0, 0.5, 0.0]), proximal=q)
    cut = TTSExample(teacher=values, weights=torch.tensor([1.0, 0.5]), teacher_index=index, vocab=6)
    out = collate([dense, cut])
    assert out.teacher.shape == (2, 3, 6) and out.weights.shape == (2, 3) and out.proximal.shape == (2, 3, 6)
    assert torch.equal(out.teacher[0], rows) and torch.equal(out.proximal[0], q)
    assert torch.equal(out.teacher[1, :2], cut.teacher_rows()) and out.teacher[1, 2].abs().sum() == 0
    assert torch.equal(out.teacher[1, :2].gt(0).sum(-1), torch.tensor([2, 2]))
    assert out.proximal[1].abs().sum() == 0  # no proximal rows: zeros
    assert out.weights.tolist() == [[1.0, 0.5, 0.0], [1.0, 0.5, 0.0]]
    wide = collate([cut], width=5, device="cpu")
    assert wide.teacher.shape == (1, 5, 6) and wide.proximal is None and wide.weights[0, 2:].abs().sum() == 0
    assert cut.nbytes < dense.nbytes and cut.proximal_rows() is None
    with pytest.raises(ValueError, match="width"):
        collate([dense], width=2)
    with pytest.raises(ValueError, match="at least one"):
        collate([])


class _LinearStudent(Student):
    """A toy student: logits = tokens' one-hot rows through a linear map (``C`` positions per example)."""

    draft_vocab = None

    def __init__(self, vocab: int) -> None:
        self.module = nn.Linear(vocab, vocab)

    def trainable(self, name, param):
        return True

    def refresh(self):
        pass

    def example_logits(self, module, examples):
        width = max(ex.tokens.shape[0] for ex in examples)
        ids = torch.zeros(len(examples), width, dtype=torch.int64)
        for i, ex in enumerate(examples):
            ids[i, : ex.tokens.shape[0]] = ex.tokens
        return module(nn.functional.one_hot(ids, module.in_features).float())


def test_distillation_loss_is_tts_loss_over_the_collated_examples():
    g = torch.Generator().manual_seed(1)
    student = _LinearStudent(5)
    assert isinstance(student, Student) and list(student.shared()) == []  # the protocol's default
    examples = [TTSExample(teacher=torch.softmax(torch.randn(c, 5, generator=g), -1),
                           weights=torch.rand(c, generator=g),
                           proximal=torch.softmax(torch.randn(c, 5, generator=g), -1), tokens=torch.arange(c))
                for c in (3, 1)]
    got = distillation_loss(student, student.module, examples, 0.7, 0.4)
    batch = collate(examples)
    logits = student.example_logits(student.module, examples)
    want = tts_loss(logits, batch.teacher, batch.weights, 0.7, batch.proximal, 0.4)
    assert torch.equal(got, want)
    no_prox = [TTSExample(teacher=ex.teacher, weights=ex.weights, tokens=ex.tokens) for ex in examples]
    assert torch.equal(distillation_loss(student, student.module, no_prox, 0.7, 0.4),
                       tts_loss(student.example_logits(student.module, no_prox), batch.teacher, batch.weights, 0.7))


def test_updater_stream_accessors_on_cpu():
    up = TTSUpdater(nn.Linear(2, 2), lambda n, p: True, lambda m, ex: m.weight.sum(), TTSConfig(), asynchronous=False)
    assert up.stream is None and not up.on_cuda
    up.close()
