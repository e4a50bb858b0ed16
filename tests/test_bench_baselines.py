"""bench-kernels' external baselines (flashinfer, SGLang Triton) on CPU: argument building, skipping, JSON field.

The real kernels need a GPU; here fake baseline functions with the real signatures record what they are given.
"""

import json
import subprocess
import sys

import pytest
import torch

from specadapt import kernels
from specadapt.bench import baselines as bl
from specadapt.bench import kernels as bk
from specadapt.sglang import baselines as sgl
from specadapt.cli import main

CPU = torch.device("cpu")
B, L, V = 3, 4, 50


def _inputs(op="chain"):
    return bk.make_inputs(bk.Case(op, B, L, V), CPU, seed=1)


# Fakes with the signatures of flashinfer 0.7.2 / SGLang 0.5.23 (keyword-only block_verification).
def fake_flashinfer(draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num=None,
                    maybe_output_emitted_draft_token_num=None, deterministic=True, generator=None, seed=None,
                    offset=None):
    fake_flashinfer.calls.append(dict(draft_probs=draft_probs, draft_token_ids=draft_token_ids,
                                      target_probs=target_probs, acc=maybe_output_accepted_token_num,
                                      emitted=maybe_output_emitted_draft_token_num, deterministic=deterministic))
    return torch.full((draft_token_ids.shape[0], draft_token_ids.shape[1] + 1), -1, dtype=torch.int32)


def fake_flashinfer_old(draft_probs, draft_token_ids, uniform_samples, target_probs,
                        maybe_output_accepted_token_num=None, maybe_output_emitted_draft_token_num=None,
                        deterministic=True):
    return None


def fake_sglang(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
                threshold_single, threshold_acc, deterministic, *, block_verification=False):
    fake_sglang.calls.append(dict(locals()))


def fake_sglang_no_block(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                         retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                         draft_probs, threshold_single, threshold_acc, deterministic):
    return None


@pytest.fixture(autouse=True)
def _reset_calls():
    fake_flashinfer.calls = []
    fake_sglang.calls = []


def test_flashinfer_arguments_from_our_chain_inputs():
    inputs = _inputs()
    cand, p, q, _, _ = inputs
    kw = bl.flashinfer_chain_kwargs("chain", fake_flashinfer, inputs)
    assert set(kw) == {"draft_probs", "draft_token_ids", "target_probs", "maybe_output_accepted_token_num",
                       "maybe_output_emitted_draft_token_num", "deterministic"}
    assert kw["draft_probs"].shape == (B, L, V) and kw["draft_probs"].dtype == torch.float32
    assert kw["target_probs"].shape == (B, L + 1, V) and kw["target_probs"].dtype == torch.float32
    assert kw["draft_token_ids"].shape == (B, L) and kw["draft_token_ids"].dtype == torch.int32
    assert torch.equal(kw["draft_token_ids"].long(), cand[:, 1:])  # the drafts, without the root slot
    torch.testing.assert_close(kw["draft_probs"], q.float())
    torch.testing.assert_close(kw["target_probs"], p.float())
    for name in ("maybe_output_accepted_token_num", "maybe_output_emitted_draft_token_num"):
        assert kw[name].shape == (B,) and kw[name].dtype == torch.int32 and not kw[name].any()
    with pytest.raises(ValueError, match="chain"):
        bl.flashinfer_chain_kwargs("block", fake_flashinfer, inputs)


def test_flashinfer_old_signature_gets_our_coins():
    inputs = _inputs()
    _, _, _, u, uf = inputs
    kw = bl.flashinfer_chain_kwargs("chain", fake_flashinfer_old, inputs)
    assert kw["uniform_samples"].shape == (B, L + 1) and kw["uniform_samples"].dtype == torch.float32
    torch.testing.assert_close(kw["uniform_samples"][:, :L], u.float())
    torch.testing.assert_close(kw["uniform_samples"][:, L], uf.float())
    assert "uniform_samples" not in bl.flashinfer_chain_kwargs("chain", fake_flashinfer, inputs)


@pytest.mark.parametrize("op", ["chain", "block"])
def test_sglang_arguments_from_our_inputs(op):
    inputs = _inputs(op)
    cand, p, q, u, uf = inputs
    kw = sgl.triton_chain_kwargs(op, fake_sglang, inputs)
    fake_sglang(**kw)  # every argument is accepted by the real signature
    got = fake_sglang.calls[0]
    S = L + 1
    assert got["predicts"].shape == (B * S,) and got["predicts"].dtype == torch.int32
    assert got["accept_index"].shape == (B, S) and got["accept_index"].dtype == torch.int32
    assert got["accept_token_num"].shape == (B,) and got["accept_token_num"].dtype == torch.int32
    assert got["candidates"].dtype == torch.int64 and torch.equal(got["candidates"], cand)
    assert torch.equal(got["retrive_index"], torch.arange(B * S).view(B, S))
    assert torch.equal(got["retrive_next_token"][0], torch.tensor([1, 2, 3, 4, -1]))
    assert got["retrive_next_token"].shape == (B, S) and got["retrive_next_token"].dtype == torch.int64
    assert (got["retrive_next_sibling"] == -1).all() and got["retrive_next_sibling"].shape == (B, S)
    assert got["uniform_samples"].shape == (B, S) and got["uniform_samples"].dtype == torch.float32
    torch.testing.assert_close(got["uniform_samples"][:, :L], u.float())
    assert got["uniform_samples_for_final_sampling"].shape == (B,)
    assert got["uniform_samples_for_final_sampling"].dtype == torch.float32
    assert got["target_probs"].shape == (B, S, V) and got["target_probs"].dtype == torch.float32
    assert got["draft_probs"].shape == (B, L, V) and got["draft_probs"].dtype == torch.float32
    assert got["block_verification"] is (op == "block")


def test_sglang_block_needs_the_switch():
    with pytest.raises(ValueError, match="block_verification"):
        sgl.triton_chain_kwargs("block", fake_sglang_no_block, _inputs("block"))
    assert "block_verification" not in sgl.triton_chain_kwargs("chain", fake_sglang_no_block, _inputs())
    with pytest.raises(ValueError):
        sgl.triton_chain_kwargs("gbv", fake_sglang, _inputs())


def test_prepared_call_passes_the_built_arguments():
    base = bl.Baseline("fi", ("chain",), lambda: (fake_flashinfer, "fake"), bl.flashinfer_chain_kwargs)
    call = bl.LoadedBaseline(base, fake_flashinfer, "fake").prepare("chain", _inputs())
    assert fake_flashinfer.calls == []  # building does not call
    out = call()
    assert out.shape == (B, L + 1) and len(fake_flashinfer.calls) == 1


def _missing():
    raise ImportError("No module named 'nothere'")


def test_not_importable_is_skipped_with_its_reason():
    registry = {
        "gone": bl.Baseline("gone", ("chain",), _missing, bl.flashinfer_chain_kwargs, devices=("cpu",)),
        "ok": bl.Baseline("ok", ("chain",), lambda: (fake_flashinfer, "fake 1.0"), bl.flashinfer_chain_kwargs,
                          devices=("cpu",)),
        "gpu": bl.Baseline("gpu", ("chain",), lambda: (fake_flashinfer, "x"), bl.flashinfer_chain_kwargs),
    }
    loaded, skipped = bl.resolve(CPU, registry)
    assert list(loaded) == ["ok"] and loaded["ok"].version == "fake 1.0"
    assert skipped["gone"] == "ImportError: No module named 'nothere'"
    assert "needs cuda" in skipped["gpu"] and "cpu" in skipped["gpu"]
    line = bl.status_line(loaded, skipped)
    assert "\n" not in line
    assert "found ok (fake 1.0)" in line and "gone (ImportError: No module named 'nothere')" in line


def test_real_baselines_are_never_used_on_cpu():
    loaded, skipped = bl.resolve(CPU)
    assert loaded == {}
    assert set(skipped) == {"flashinfer_chain", "sglang_triton"}
    assert all("needs cuda" in why for why in skipped.values())


def test_sglang_loader_reason_names_the_env_var(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, sgl.SGLANG_MODULE, None)  # import raises ImportError
    monkeypatch.delenv(sgl.SGLANG_FILE_ENV, raising=False)
    with pytest.raises(ImportError, match=sgl.SGLANG_FILE_ENV):
        sgl.load_triton_chain()
    monkeypatch.setenv(sgl.SGLANG_FILE_ENV, str(tmp_path / "absent.py"))
    with pytest.raises(ImportError, match="no such file"):
        sgl.load_triton_chain()
    f = tmp_path / "reject_sampling.py"
    f.write_text("def chain_speculative_sampling_triton(*a, **k):\n    return 'from file'\n")
    monkeypatch.setenv(sgl.SGLANG_FILE_ENV, str(f))
    fn, ver = sgl.load_triton_chain()
    assert fn() == "from file" and str(f) in ver


def test_flashinfer_loader_raises_import_error_when_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", None)
    with pytest.raises(ImportError):
        bl._load_flashinfer()


def test_importing_the_bench_does_not_import_the_baselines():
    code = ("import sys, specadapt, specadapt.cli, specadapt.bench.kernels, specadapt.bench.baselines; "
            "print(sorted(m for m in ('flashinfer', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


needs_cpu_ops = pytest.mark.skipif(not kernels.has_op_for("block_verify", CPU), reason="specadapt._C not built")


@pytest.fixture
def fake_registry(monkeypatch):
    """A CPU-capable fake baseline for chain and block, and the real ones (skipped on CPU)."""
    fake = bl.Baseline("fake_sglang", ("chain", "block"), lambda: (fake_sglang, "fake 0"), sgl.triton_chain_kwargs,
                       devices=("cpu",))
    monkeypatch.setattr(bl, "BASELINES", {**bl.BASELINES, "fake_sglang": fake})
    monkeypatch.setattr(bk, "copy_bandwidth_gbps", lambda device: 10.0)
    return fake


@needs_cpu_ops
def test_json_case_gains_baselines_field(fake_registry):
    cases = [bk.Case("chain", 2, 3, 64), bk.Case("block", 2, 3, 64), bk.Case("gbv", 2, 3, 64, 2)]
    report = bk.run_benchmark(cases, CPU, repeats=2, with_reference=False, progress=False)
    json.dumps(report)  # serialisable
    by_op = {c["op"]: c for c in report["cases"]}
    for op in ("chain", "block"):
        entry = by_op[op]["baselines"]
        assert set(entry) == {"fake_sglang"}
        assert entry["fake_sglang"]["median_ms"] > 0
        assert entry["fake_sglang"]["speedup"] == pytest.approx(entry["fake_sglang"]["median_ms"]
                                                                / by_op[op]["median_ms"])
    assert "baselines" not in by_op["gbv"]  # no baseline compares with gbv
    # the fake was called (warm-up + repeats) per compared case, with block_verification for block only
    flags = [c["block_verification"] for c in fake_sglang.calls]
    assert flags == [False] * 3 + [True] * 3
    for c in report["cases"]:  # the required fields are unchanged
        for key in ("op", "device", "B", "L", "V", "K", "median_ms", "gbps", "bandwidth_fraction",
                    "speedup_vs_reference"):
            assert key in c
    status = report["baseline_status"]
    assert status["found"] == {"fake_sglang": "fake 0"}
    assert set(status["skipped"]) == {"flashinfer_chain", "sglang_triton"}


@needs_cpu_ops
def test_no_baselines_flag_and_failing_baseline(fake_registry, monkeypatch):
    report = bk.run_benchmark([bk.Case("chain", 1, 2, 32)], CPU, repeats=1, with_reference=False, progress=False,
                              with_baselines=False)
    assert "baselines" not in report["cases"][0] and fake_sglang.calls == []
    assert all(why.startswith("disabled") for why in report["baseline_status"]["skipped"].values())

    def broken(**kw):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(bl, "BASELINES", {"bad": bl.Baseline("bad", ("chain",), lambda: (broken, None),
                                                             bl.flashinfer_chain_kwargs, devices=("cpu",))})
    report = bk.run_benchmark([bk.Case("chain", 1, 2, 32)], CPU, repeats=1, with_reference=False, progress=False)
    assert report["cases"][0]["baselines"]["bad"] == {"median_ms": None, "speedup": None,
                                                      "error": "RuntimeError: kernel exploded"}


@needs_cpu_ops
def test_cli_prints_status_and_writes_field(fake_registry, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bk, "QUICK_CASES", [bk.Case("chain", 1, 2, 32), bk.Case("gbv", 1, 2, 32, 2)])
    out = tmp_path / "b.json"
    assert main(["bench-kernels", "--quick", "--ops", "chain", "--repeats", "1", "--no-reference",
                 "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln.startswith("baselines:")]
    assert len(lines) == 1 and "found fake_sglang" in lines[0] and "flashinfer_chain (needs cuda" in lines[0]
    assert "fake_sglang" in text.splitlines()[-2]  # the chain row shows the baseline
    data = json.loads(out.read_text())
    assert [c["op"] for c in data["cases"]] == ["chain"] and "fake_sglang" in data["cases"][0]["baselines"]


def test_bench_baselines_module_never_touches_sglang():
    """The sglang-facing baseline code lives under specadapt/sglang (issue 17): the bench module neither imports
    sglang nor names its modules."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(bl))
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0]
    assert not [m for m in imported if m.split(".")[0] in ("sglang", "triton")]
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert not [v for v in strings if v.startswith("sglang.")]
    assert bl.BASELINES["sglang_triton"].load is sgl.load_triton_chain
