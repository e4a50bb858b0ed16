"""Build of specadapt and its extension specadapt._C.

The C++ CPU sources always build. The CUDA sources are added only when torch is a CUDA build and nvcc is
found (CUDA_HOME); set SPECADAPT_NO_CUDA=1 to skip them anyway. Install without build isolation so the
extension compiles against the torch already installed: ``pip install --no-build-isolation -e .``.
"""

import glob
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - build-time guidance
    raise SystemExit(
        "specadapt builds a torch extension: install torch first (pip install torch==2.13.0), then "
        "pip install --no-build-isolation -e ."
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    if os.environ.get("SPECADAPT_NO_CUDA", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _pip_cuda_include_dirs() -> list:
    """Headers of the CUDA libraries installed as pip wheels beside torch (nvidia/*/include: cuSPARSE, cuBLAS,
    ...), which a bare nvcc toolkit may lack but ATen's CUDA headers include."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels that CUDA builds of torch depend on
    except ImportError:
        return []
    return sorted(d for root in nvidia.__path__ for d in glob.glob(os.path.join(root, "*", "include")))


def _cuda_library_dirs() -> list:
    """Where libcudart.so lives when CUDA_HOME was inferred from an nvcc on PATH outside the toolkit
    (e.g. /usr/local/bin/nvcc -> CUDA_HOME=/usr/local, libraries in /usr/local/cuda/lib64)."""
    candidates = [os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "cuda", "lib64")]
    return [d for d in candidates if os.path.exists(os.path.join(d, "libcudart.so"))]


def _extension():
    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # -fno-trapping-math / -fno-signed-zeros let GCC turn the max(x, 0) selects of the verification loops into
    # vector blends (no reassociation: results stay bit-identical to the sequential double arithmetic).
    # No -std flag: BuildExtension picks the standard the installed torch needs (C++17 for 2.13, C++20 for 2.14).
    # -ffp-contract=off: no FMA contraction in the AVX2 / AVX-512 clones of csrc/cpu/simd_sums.cpp either.
    cxx_flags = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-signed-zeros", "-ffp-contract=off"]
    if _want_cuda():
        if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
            # No GPU to detect the architecture from (a build machine): Ampere and Hopper, plus PTX for newer GPUs.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
            print("specadapt: no GPU visible, building the CUDA kernels for TORCH_CUDA_ARCH_LIST=8.0;9.0+PTX")
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        sources = [s for s in sources if not s.endswith("compile_check.cu")]
        return CUDAExtension(
            "specadapt._C",
            sources,
            include_dirs=_pip_cuda_include_dirs(),
            library_dirs=_cuda_library_dirs(),
            # --fmad=false: like -ffp-contract=off on the CPU side, products and differences round as in the
            # float64 reference (the kernels are memory-bound; FMA would only change rounding).
            extra_compile_args={"cxx": cxx_flags + ["-DSPECADAPT_WITH_CUDA"], "nvcc": ["-O3", "--fmad=false"]},
            extra_link_args=["-fopenmp"],
            py_limited_api=True,
        )
    return CppExtension(
        "specadapt._C",
        sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
        py_limited_api=True,
    )


class BuildPyWithCudaHeaders(build_py):
    """Ship the torch-free CUDA headers (csrc/cuda/*.cuh) inside the package as specadapt/cuda_headers, where the
    CuPy JIT path (specadapt.cuda_jit) finds them in non-editable installs."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "specadapt", "cuda_headers")
        self.mkpath(dest)
        for header in sorted(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cuh"))):
            self.copy_file(header, os.path.join(dest, os.path.basename(header)))


setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    package_data={"specadapt": ["data/*.jsonl", "data/*.md", "data/*.safetensors", "data/*.json"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension, "build_py": BuildPyWithCudaHeaders},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
