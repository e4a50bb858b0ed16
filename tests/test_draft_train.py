"""Draft-head training (issue 15): the prompt split, the data shards, the unrolled EAGLE-3 objective."""

from __future__ import annotations

import torch
import pytest

from specadapt.draft_train.split import evaluation_prompt_ids, training_prompts
from specadapt.draft_train.unroll import StepStats, full_teacher, unrolled_forward, unrolled_loss
from specadapt.engine.eagle import EagleHead
from tests.helpers.models import tiny_llama


def _head(vocab=40, hidden=32, draft_vocab=None, seed=1):
    target = tiny_llama(vocab=vocab, hidden=hidden, layers=3, seed=0)
    torch.manual_seed(seed)
    head = EagleHead(target.config, (1, 2, 3), draft_vocab).attach(target)
    for p in head.parameters():  # a trained-looking head: not the near-identity init
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else None
    return target, head


def _incremental(head, tokens, features, steps, i):
    """What the drafting loop computes after committed position i: feed the real pairs 0..i, then draft
    ``steps - 1`` more tokens feeding the head's own outputs with the *real* next tokens (teacher forcing)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=head.config)
    out = head(tokens[1 : i + 2][None], features[: i + 1][None], position_ids=torch.arange(i + 1)[None], cache=cache,
               use_cache=True)
    g = out.hidden[:, -1:]
    outs = [g[0, 0]]
    for s in range(2, steps + 1):
        out = head(tokens[i + s : i + s + 1][None], g, position_ids=torch.tensor([[i + s - 1]]), cache=cache,
                   use_cache=True)
        g = out.hidden[:, -1:]
        outs.append(g[0, 0])
    return outs


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_unrolled_forward_equals_step_by_step_drafting(steps):
    _, head = _head()
    head.double()  # float64: the two computation orders agree to rounding whatever the thread count
    T = 19
    g = torch.Generator().manual_seed(steps)
    tokens = torch.randint(0, 40, (T,), generator=g)
    features = torch.randn(T, 3 * 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        out = unrolled_forward(head, tokens, features, steps)
        assert [h.shape[0] for h in out.hidden] == [T - 1 - s for s in range(1, steps + 1)]
        late = unrolled_forward(head, tokens, features, steps, first_query=5)
        assert late.first == [0] + [5] * (steps - 1)
        for i in (0, 1, 5, 7, T - 2 - steps):
            ref = _incremental(head, tokens, features, steps, i)
            for s in range(steps):
                torch.testing.assert_close(out.hidden[s][i], ref[s], atol=1e-9, rtol=1e-9)
                if i >= late.first[s]:
                    torch.testing.assert_close(late.hidden[s][i - late.first[s]], ref[s], atol=1e-9, rtol=1e-9)
        none = unrolled_forward(head, tokens, features, steps, first_query=T)
        assert [h.shape[0] for h in none.hidden[1:]] == [0] * (steps - 1)


def test_unrolled_forward_rejects_bad_input():
    _, head = _head()
    with pytest.raises(ValueError, match="steps"):
        unrolled_forward(head, torch.zeros(10, dtype=torch.int64), torch.zeros(10, 96), 0)
    with pytest.raises(ValueError, match="too short"):
        unrolled_forward(head, torch.zeros(4, dtype=torch.int64), torch.zeros(4, 96), 3)
    with pytest.raises(ValueError, match="features"):
        unrolled_forward(head, torch.zeros(10, dtype=torch.int64), torch.zeros(9, 96), 2)


def test_unrolled_loss_teacher_and_acceptance():
    """The loss is the forward KL to the renormalised teacher; a head that equals the teacher gets KL 0 and
    acceptance = the teacher's mass on the draft vocabulary."""
    target, head = _head(draft_vocab=torch.arange(0, 40, 2))
    T = 16
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 40, (T,), generator=g)
    features = torch.randn(T, 96, generator=g)
    final = torch.randn(T, 32, generator=g)
    _, norm, w = head.shared
    full = target.get_output_embeddings().weight
    stats = [StepStats() for _ in range(2)]
    loss = unrolled_loss(head, tokens, features, final, 2, [1.0, 0.5], first_query=3, teacher=full_teacher(final, full, chunk=5),
                         stats=stats)
    out = unrolled_forward(head, tokens, features, 2)
    assert out.first == [0, 0]
    expect = 0.0
    for s, wt in ((1, 1.0), (2, 0.5)):
        gs = out.hidden[s - 1][3:]
        n = out.hidden[s - 1].shape[0]
        p = torch.softmax(final[3 + s : n + s] @ w.T, -1)
        logq = torch.log_softmax(norm(gs) @ w.T, -1)
        expect = expect + wt * (p * (p.log() - logq)).sum(-1).mean()
        pf = torch.softmax(final[3 + s : n + s] @ full.T, -1)[:, ::2]
        acc = torch.minimum(pf, logq.exp()).sum()
        assert stats[s - 1].count == n - 3
        assert stats[s - 1].acceptance == pytest.approx(float(acc.detach()), rel=1e-5)
        top1 = (torch.softmax(final[3 + s : n + s] @ full.T, -1).argmax(-1) == 2 * logq.argmax(-1)).sum()
        assert stats[s - 1].top1 == float(top1)
    torch.testing.assert_close(loss, expect / 1.5)
    loss.backward()
    assert head.fuse.weight.grad is not None and head.fuse.weight.grad.abs().sum() > 0
    assert unrolled_loss(head, tokens, features, final, 2, [1.0, 0.5], first_query=T) is None
    with pytest.raises(ValueError, match="step_weights"):
        unrolled_loss(head, tokens, features, final, 2, [1.0])
    with pytest.raises(ValueError, match="teacher"):
        unrolled_loss(head, tokens, features, final, 2, [1.0, 0.5], stats=stats)
    # total variation: 1 - sum_x min(p, q) with p renormalised on the draft vocabulary
    head.zero_grad()
    tvd = unrolled_loss(head, tokens, features, final, 2, [1.0, 0.5], first_query=3, divergence="tvd")
    out = unrolled_forward(head, tokens, features, 2)
    expect = 0.0
    for s, wt in ((1, 1.0), (2, 0.5)):
        n = out.hidden[s - 1].shape[0]
        p = torch.softmax(final[3 + s : n + s] @ w.T, -1)
        q = torch.softmax(norm(out.hidden[s - 1][3:]) @ w.T, -1)
        expect = expect + wt * (1 - torch.minimum(p, q).sum(-1).mean())
    torch.testing.assert_close(tvd, expect / 1.5)
    tvd.backward()
    assert head.layer.mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="divergence"):
        unrolled_loss(head, tokens, features, final, 2, [1.0, 0.5], divergence="rkl")


def test_split_keeps_evaluation_prompts_out_of_training():
    train = training_prompts()
    keys = {p.key for p in train}
    assert len(keys) == len(train) == 400 + 134
    assert not keys & evaluation_prompt_ids()
    assert not any(k.startswith("aime24") for k in keys)
    from specadapt.datasets import load_prompts

    eval_texts = {p.text for p in load_prompts("aime24")} | {p.text for p in load_prompts("math500")[:100]}
    eval_texts |= {p.text for p in load_prompts("livecodebench")[:32]}
    assert not eval_texts & {p.text for p in train}


# ---- data generation ---------------------------------------------------------------------------------------
from specadapt.draft_train.data import GenerationConfig, generate_shards, iter_sequences, shard_paths  # noqa: E402
from specadapt.engine.eagle import default_feature_layers  # noqa: E402


def _tiny_target(model_dir, forward):
    from specadapt.engine.models import attach_forward, load_model

    target = load_model(str(model_dir))
    attach_forward(target, forward, "float32")
    return target


def _generate(target, out, **kw):
    config = GenerationConfig(**{"max_new_tokens": 12, "min_tokens": 40, "batch_size": 3, "shard_sequences": 2,
                                 "max_samples_per_prompt": 4, **kw})
    layers = default_feature_layers(target.model.config.num_hidden_layers)
    return generate_shards(target, training_prompts()[:4], out, config, layers, progress=False)


@pytest.mark.parametrize("forward", ["native", "hf"])
def test_generated_sequences_carry_the_target_forward(tiny_model_dir, tmp_path, forward):
    """Each stored row is the target's hidden states of that position (a fresh full forward), answers end at
    EOS or the length limit, and the last row (no forward consumed the last token) is zero."""
    target = _tiny_target(tiny_model_dir, forward)
    summary = _generate(target, tmp_path / "d")
    assert summary["total_generated_tokens"] >= 40
    seqs = list(iter_sequences(tmp_path / "d"))
    assert len(seqs) == summary["sequences"] and len(shard_paths(tmp_path / "d")) == summary["shards"]
    layers = default_feature_layers(target.model.config.num_hidden_layers)
    eos = target.eos_token_ids()
    for s in seqs:
        answer = s.tokens[s.prompt_len :].tolist()
        assert 1 <= len(answer) <= 12
        assert len(answer) == 12 or answer[-1] in eos
        assert not any(t in eos for t in answer[:-1])
        with torch.no_grad():
            hs = target.model(input_ids=s.tokens[None], output_hidden_states=True).hidden_states
        features = torch.cat([hs[i][0] for i in layers], dim=-1)
        n = s.tokens.numel() - 1
        torch.testing.assert_close(s.features[:n].float(), features[:n], atol=0.02, rtol=0.01)
        torch.testing.assert_close(s.final[:n].float(), hs[-1][0][:n], atol=0.02, rtol=0.01)
        assert s.features[n].abs().sum() == 0 and s.final[n].abs().sum() == 0


def test_generation_resumes_and_a_job_does_not_depend_on_its_batch(tiny_model_dir, tmp_path):
    target = _tiny_target(tiny_model_dir, "native")
    first = _generate(target, tmp_path / "d", min_tokens=20)
    again = _generate(target, tmp_path / "d", min_tokens=60)
    seqs = list(iter_sequences(tmp_path / "d"))
    jobs = [s.job for s in seqs]
    assert len(jobs) == len(set(jobs)) == first["sequences"] + again["sequences"]
    assert again["total_generated_tokens"] >= 60 and again["sequences"] > 0
    assert sorted(jobs)[0] == (0, 0) and all(j[1] == 0 for j in jobs[:4])  # sample-major order
    single = _generate(target, tmp_path / "single", min_tokens=60, batch_size=1)
    assert single["total_generated_tokens"] >= 60
    by_job = {s.job: s.tokens for s in iter_sequences(tmp_path / "single")}
    common = [s for s in seqs if s.job in by_job]
    assert len(common) >= 3
    for s in common:
        assert torch.equal(s.tokens, by_job[s.job]), s.job


def test_generation_refuses_another_configuration(tiny_model_dir, tmp_path):
    target = _tiny_target(tiny_model_dir, "native")
    _generate(target, tmp_path / "d", min_tokens=5)
    with pytest.raises(ValueError, match="top_p"):
        _generate(target, tmp_path / "d", min_tokens=5, top_p=0.5)
    with pytest.raises(ValueError, match="prompts must not be empty"):
        generate_shards(target, [], tmp_path / "e", GenerationConfig(), (1, 1, 2))


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("batch_size", 0), ("top_p", 1.5),
                                         ("temperature", -1.0), ("shard_sequences", 0)])
def test_generation_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value})


# ---- vocabulary ----------------------------------------------------------------------------------------------
from specadapt.draft_train.vocab import answer_token_counts, coverage, top_vocabulary  # noqa: E402


def test_vocabulary_is_the_most_frequent_answer_tokens():
    from types import SimpleNamespace

    seqs = [SimpleNamespace(tokens=torch.tensor([9, 9, 1, 1, 1, 2, 2, 3]), prompt_len=2),
            SimpleNamespace(tokens=torch.tensor([5, 4, 4, 2]), prompt_len=1)]
    counts = answer_token_counts(seqs, 10)
    assert counts.tolist() == [0, 3, 3, 1, 2, 0, 0, 0, 0, 0]  # prompts (the 9s, the first 5) not counted
    assert top_vocabulary(counts, 3).tolist() == [1, 2, 4]
    assert top_vocabulary(counts, 3, always=[8]).tolist() == [1, 2, 8]
    assert top_vocabulary(counts, 5).tolist() == [0, 1, 2, 3, 4]  # ties among zeros: lower ids first
    assert coverage(torch.tensor([1, 2, 7, 7]), torch.tensor([1, 2])) == 0.5
    with pytest.raises(ValueError, match="draft vocabulary size"):
        top_vocabulary(counts, 11)


# ---- training ------------------------------------------------------------------------------------------------
from specadapt.draft_train.train import TrainConfig, evaluate_head, split_by_prompt, train_head  # noqa: E402


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from tests.helpers.models import WORDS, save_tiny_model_dir

    model_dir = save_tiny_model_dir(tmp_path_factory.mktemp("tiny_model_train"), WORDS)
    target = _tiny_target(model_dir, "native")
    out = tmp_path_factory.mktemp("data")
    _generate(target, out, min_tokens=400, max_new_tokens=40, batch_size=4, shard_sequences=8)
    return target, list(iter_sequences(out))


def test_split_by_prompt_never_shares_a_prompt(tiny_data):
    _, seqs = tiny_data
    train, val = split_by_prompt(seqs, 0.25, seed=0)
    assert train and val and len(train) + len(val) == len(seqs)
    assert not {s.job[0] for s in train} & {s.job[0] for s in val}
    with pytest.raises(ValueError, match="fraction"):
        split_by_prompt(seqs, 1.0)


def _fresh_head(target, seed=0):
    torch.manual_seed(seed)
    layers = default_feature_layers(target.model.config.num_hidden_layers)
    return EagleHead(target.model.config, layers, None).attach(target.model)


def test_training_with_total_variation_raises_validation_acceptance(tiny_data):
    target, seqs = tiny_data
    train, val = split_by_prompt(seqs, 0.25, seed=0)
    full = target.model.get_output_embeddings().weight
    config = TrainConfig(steps=3, epochs=6, batch=2, lr=3e-3, warmup=2, eval_every=5, patience=100, seed=0,
                         divergence="tvd")
    log = train_head(_fresh_head(target), train, val, full, config, progress=False)
    assert log["best"]["acceptance"][0] > log["validation_before"]["acceptance"][0] + 0.05
    with pytest.raises(ValueError, match="divergence"):
        TrainConfig(divergence="js")


def test_bf16_autocast_loss_is_the_float32_loss_within_bf16_rounding():
    """Under a bf16 autocast (TrainConfig.precision="bf16") the head's products run in bf16 but the teacher, the
    step's logits and the attention softmax stay float32: the loss and its gradient agree with float32's to bf16
    rounding, and the teacher side is unchanged (a head equal to nothing in particular, random weights)."""
    target, head = _head(draft_vocab=torch.arange(0, 40, 2))
    head.float()
    T = 24
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 40, (T,), generator=g)
    features = torch.randn(T, 96, generator=g)
    final = torch.randn(T, 32, generator=g)
    for divergence in ("fkl", "tvd"):
        head.zero_grad()
        ref = unrolled_loss(head, tokens, features, final, 3, [1.0, 0.5, 0.25], first_query=2, divergence=divergence)
        ref.backward()
        ref_grad = head.layer.mlp.down_proj.weight.grad.clone()
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = unrolled_loss(head, tokens, features, final, 3, [1.0, 0.5, 0.25], first_query=2,
                                divergence=divergence)
        assert low.dtype == torch.float32
        low.backward()
        assert float(low) == pytest.approx(float(ref), rel=0.03)
        assert float(low) != float(ref)  # the products did run in bf16
        cos = torch.nn.functional.cosine_similarity(head.layer.mlp.down_proj.weight.grad.flatten(), ref_grad.flatten(), 0)
        assert float(cos) > 0.95


def test_bf16_training_raises_validation_acceptance(tiny_data):
    target, seqs = tiny_data
    train, val = split_by_prompt(seqs, 0.25, seed=0)
    full = target.model.get_output_embeddings().weight
    config = TrainConfig(steps=3, epochs=6, batch=2, lr=3e-3, warmup=2, eval_every=5, patience=100, seed=0,
                         divergence="tvd", precision="bf16")
    head = _fresh_head(target)
    log = train_head(head, train, val, full, config, progress=False)
    assert log["best"]["acceptance"][0] > log["validation_before"]["acceptance"][0] + 0.05
    assert head.fuse.weight.dtype == torch.float32  # parameters stay float32
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp16")


def test_training_raises_validation_acceptance_and_resumes(tiny_data, tmp_path):
    target, seqs = tiny_data
    train, val = split_by_prompt(seqs, 0.25, seed=0)
    full = target.model.get_output_embeddings().weight
    config = TrainConfig(steps=3, epochs=6, batch=2, lr=3e-3, warmup=2, eval_every=5, patience=100, seed=0)
    head = _fresh_head(target)
    log = train_head(head, train, val, full, config, checkpoint=tmp_path / "ck.pt", progress=False)
    before, best = log["validation_before"], log["best"]
    assert best["acceptance"][0] > before["acceptance"][0] + 0.05
    assert best["loss"] < before["loss"]
    assert len(best["acceptance"]) == 3 and all(0 <= a <= 1 for a in best["acceptance"])
    # the head ends with the best weights
    from specadapt.draft_train.unroll import full_teacher

    teachers = [full_teacher(s.final, full) for s in val]
    again = evaluate_head(head, val, 3, teachers, config.step_weights)
    assert again["acceptance"] == pytest.approx(best["acceptance"], rel=1e-6)
    # resuming a finished run does no more steps; another configuration is refused
    resumed = train_head(_fresh_head(target, seed=5), train, val, full, config, checkpoint=tmp_path / "ck.pt",
                         progress=False)
    assert resumed["steps"] == log["steps"]
    assert resumed["best"]["acceptance"] == pytest.approx(best["acceptance"], rel=1e-6)
    with pytest.raises(ValueError, match="teachers"):
        train_head(_fresh_head(target), train, val, full, config, progress=False, teachers=teachers[:-1])
    with pytest.raises(ValueError, match="another configuration"):
        train_head(_fresh_head(target), train, val, full, TrainConfig(steps=2), checkpoint=tmp_path / "ck.pt",
                   progress=False)


def test_interrupted_training_resumes_where_it_stopped(tiny_data, tmp_path):
    """A run stopped by max_minutes and resumed ends where an uninterrupted run ends, bit for bit."""
    target, seqs = tiny_data
    train, val = split_by_prompt(seqs, 0.25, seed=0)
    full = target.model.get_output_embeddings().weight
    config = TrainConfig(steps=2, epochs=2, batch=2, lr=3e-3, warmup=2, eval_every=3, patience=100, seed=1)
    part = _fresh_head(target)
    short = TrainConfig(**{**config.__dict__, "max_minutes": 1e-9})
    first = train_head(part, train, val, full, short, checkpoint=tmp_path / "ck.pt", progress=False)
    assert first["stopped"] == "max_minutes" and first["steps"] == 1
    rest = train_head(_fresh_head(target, seed=9), train, val, full, config, checkpoint=tmp_path / "ck.pt",
                      progress=False)
    assert rest["stopped"] == "epochs"  # resumed with a larger max_minutes: a stopping rule, not the run's identity
    fresh = train_head(_fresh_head(target), train, val, full, config, progress=False)
    assert rest["steps"] == fresh["steps"]
    assert rest["best"]["acceptance"] == pytest.approx(fresh["best"]["acceptance"], abs=1e-6)


def test_step_score_is_the_expected_accepted_chain_length():
    from specadapt.draft_train.train import step_score

    assert step_score({"acceptance": [0.5, 0.5, 0.5]}) == pytest.approx(0.5 + 0.25 + 0.125)
    # step 1 dominates: a better first step beats a better third step of the same size
    assert step_score({"acceptance": [0.4, 0.3, 0.2]}) > step_score({"acceptance": [0.3, 0.3, 0.3]})
    with pytest.raises(ValueError, match="acceptance"):
        step_score({"acceptance": []})


@pytest.mark.parametrize("field,value", [("steps", 0), ("batch", 0), ("step_decay", 0.0), ("lr", 0.0)])
def test_train_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


# ---- the two scripts, end to end on a tiny model --------------------------------------------------------------
def _script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scripts_generate_train_and_write_a_loadable_head(tiny_model_dir, tmp_path, capsys):
    import json

    from specadapt.engine.eagle import load_eagle_head, save_eagle_head
    from specadapt.engine.models import load_model

    gen, train = _script("gen_draft_data"), _script("train_draft")
    data = tmp_path / "data"
    assert gen.main(["--target", str(tiny_model_dir), "--out", str(data), "--min-tokens", "150",
                     "--max-new-tokens", "24", "--batch-size", "4", "--limit-prompts", "6"]) == 0
    out, log = tmp_path / "head.safetensors", tmp_path / "log.json"
    assert train.main(["--target", str(tiny_model_dir), "--data", str(data), "--draft-vocab", "20", "--epochs", "1",
                       "--batch", "2", "--eval-every", "2", "--val-fraction", "0.3", "--compare", "none",
                       "--checkpoint", str(tmp_path / "ck.pt"), "--out", str(out), "--log", str(log)]) == 0
    info = json.loads(log.read_text())
    # warm start from the head just written: validation before training is that head's best (bfloat16-rounded)
    assert train.main(["--target", str(tiny_model_dir), "--data", str(data), "--draft-vocab", "20", "--epochs", "1",
                       "--batch", "2", "--eval-every", "2", "--val-fraction", "0.3", "--compare", "none",
                       "--init-from", str(out), "--checkpoint", str(tmp_path / "ck2.pt"),
                       "--out", str(tmp_path / "head2.safetensors"), "--log", str(tmp_path / "log2.json")]) == 0
    warm = json.loads((tmp_path / "log2.json").read_text())
    assert warm["init_from"] == str(out)
    assert warm["training"]["validation_before"]["loss"] == pytest.approx(info["training"]["best"]["loss"], rel=0.02)
    assert warm["training"]["validation_before"]["loss"] != pytest.approx(info["training"]["validation_before"]["loss"],
                                                                          rel=0.02)
    assert info["draft_vocab"] == 20 and info["data"]["generated_tokens"] >= 150
    assert info["compared_head"] is None
    assert len(info["training"]["best"]["acceptance"]) == 3
    head = load_eagle_head(out, load_model(str(tiny_model_dir)).model)
    assert head.draft_vocab.numel() == 20 and 2 in head.draft_vocab.tolist()  # EOS always in the vocabulary
    # bad input: one-line errors, exit 2
    # --draft-vocab init keeps the starting head's vocabulary (here: a 12-token one, not the data's top 20)
    small = load_eagle_head(out, load_model(str(tiny_model_dir)).model, dtype=torch.float32)
    small.draft_vocab = small.draft_vocab[:12].clone()
    save_eagle_head(small, tmp_path / "small.safetensors")
    assert train.main(["--target", str(tiny_model_dir), "--data", str(data), "--draft-vocab", "init", "--epochs", "1",
                       "--batch", "2", "--eval-every", "2", "--val-fraction", "0.3", "--compare", "none",
                       "--init-from", str(tmp_path / "small.safetensors"), "--checkpoint", str(tmp_path / "ck3.pt"),
                       "--out", str(tmp_path / "head3.safetensors"), "--log", str(tmp_path / "log3.json")]) == 0
    kept = load_eagle_head(tmp_path / "head3.safetensors", load_model(str(tiny_model_dir)).model)
    assert kept.draft_vocab.tolist() == small.draft_vocab.tolist()
    assert json.loads((tmp_path / "log3.json").read_text())["draft_vocab"] == 12
    assert train.main(["--data", str(data), "--draft-vocab", "init"]) == 2
    assert "--init-from" in capsys.readouterr().err
    assert train.main(["--data", str(data), "--draft-vocab", "lots"]) == 2
    assert "--draft-vocab" in capsys.readouterr().err
    # bad input: one-line errors, exit 2
    assert gen.main(["--target", str(tiny_model_dir), "--out", str(data), "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert gen.main(["--target", str(tiny_model_dir), "--out", str(data), "--min-tokens", "150",
                     "--max-new-tokens", "25", "--limit-prompts", "6"]) == 2
    assert "--out" in capsys.readouterr().err
    assert train.main(["--data", str(tmp_path / "nothing")]) == 2
    assert "no generated data" in capsys.readouterr().err
    assert train.main(["--data", str(data), "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err


def test_the_packaged_head_is_replaced_only_by_a_better_one(tiny_model_dir, tmp_path, monkeypatch):
    """Without --out the script writes the packaged file only when the new head beats the compared one on
    validation; a worse head goes to runs/eagle_candidate.safetensors."""
    import json

    import specadapt.engine.eagle as eagle_module

    gen, train = _script("gen_draft_data"), _script("train_draft")
    data = tmp_path / "data"
    assert gen.main(["--target", str(tiny_model_dir), "--out", str(data), "--min-tokens", "150",
                     "--max-new-tokens", "24", "--batch-size", "4", "--limit-prompts", "6"]) == 0
    common = ["--target", str(tiny_model_dir), "--data", str(data), "--draft-vocab", "20", "--epochs", "3",
              "--batch", "2", "--eval-every", "2", "--val-fraction", "0.3", "--lr", "3e-3"]
    good = tmp_path / "good.safetensors"
    assert train.main(common + ["--compare", "none", "--out", str(good), "--checkpoint", str(tmp_path / "a.pt"),
                                "--log", str(tmp_path / "a.json")]) == 0
    packaged = tmp_path / "package" / "head.safetensors"
    monkeypatch.setattr(eagle_module, "eagle_default_path", lambda *target: packaged)
    monkeypatch.setattr(train, "ROOT", tmp_path)
    assert train.main(common + ["--lr", "1e-9", "--compare", str(good), "--checkpoint", str(tmp_path / "b.pt"),
                                "--log", str(tmp_path / "b.json")]) == 0
    assert not packaged.exists() and (tmp_path / "runs" / "eagle_candidate.safetensors").is_file()
    log = json.loads((tmp_path / "b.json").read_text())
    assert log["compared_head"]["score"] > log["training"]["best"]["score"]
    assert train.main(common + ["--init-from", str(good), "--lr", "1e-9", "--compare", "none",
                                "--checkpoint", str(tmp_path / "c.pt"), "--log", str(tmp_path / "c.json")]) == 0
    assert packaged.is_file()  # nothing compared: the packaged path is written


def test_vocab_study_and_two_data_directories_with_a_narrow_head(tmp_path, monkeypatch):
    """--vocab-study builds its heads at --intermediate-size; --data takes two directories whose shared prompts are
    one prompt of the validation split (the keys are merged), and the head file keeps its width."""
    import json

    from tests.helpers.models import WORDS, save_tiny_model_dir
    from specadapt.engine.eagle import load_eagle_head
    from specadapt.engine.models import load_model

    # the vocabulary study times a step at 512 cached positions: a model with room past them
    tiny_model_dir = save_tiny_model_dir(tmp_path / "model", WORDS, max_positions=1024)
    gen, train = _script("gen_draft_data"), _script("train_draft")
    first, second = tmp_path / "d1", tmp_path / "d2"
    for out, seed in ((first, "0"), (second, "1")):
        assert gen.main(["--target", str(tiny_model_dir), "--out", str(out), "--min-tokens", "80", "--seed", seed,
                         "--max-new-tokens", "16", "--batch-size", "4", "--limit-prompts", "4"]) == 0
    monkeypatch.setattr(train, "VOCAB_SIZES", (8, 16))  # the tiny vocabulary has 24 tokens
    log = tmp_path / "study.json"
    assert train.main(["--target", str(tiny_model_dir), "--data", str(first), "--vocab-study", "--intermediate-size",
                       "32", "--log", str(log), "--val-fraction", "0.3"]) == 0
    assert json.loads(log.read_text())["vocab_study"]["sizes"]
    out = tmp_path / "narrow.safetensors"
    assert train.main(["--target", str(tiny_model_dir), "--data", str(first), str(second), "--draft-vocab", "20",
                       "--epochs", "1", "--batch", "2", "--val-fraction", "0.3", "--intermediate-size", "32",
                       "--compare", "none", "--out", str(out), "--checkpoint", str(tmp_path / "n.pt"),
                       "--log", str(tmp_path / "n.json")]) == 0
    info = json.loads((tmp_path / "n.json").read_text())
    assert info["data"]["directory"] == [str(first), str(second)]
    assert all(isinstance(k, str) and ":" in k for k in info["data"]["validation_prompts"])
    assert load_eagle_head(out, load_model(str(tiny_model_dir)).model).config.intermediate_size == 32
