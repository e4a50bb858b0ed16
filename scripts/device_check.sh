#!/usr/bin/env bash
# GPU check for a session lent a GPU machine (one H200, no internet, torch + nvcc + triton + cupy installed).
# Builds the CUDA extension, runs the CUDA tests (cross-implementation equality, chi-square, TTS CUDA-graph
# safety, the native forward's PyTorch path on CUDA: greedy speculative == target-only, TTS publishes) and the
# kernel benchmark, and writes logs and JSON under $OUT. Budget: under 8 minutes.
#   device run:  bash scripts/device_check.sh
set -uo pipefail
OUT=${OUT:-results/device}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
{
  date; nvidia-smi || true; nvcc --version || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1

# Build in place against the machine's torch (no downloads): the package's own deps are not needed here.
timeout 300 python -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/summary.txt"
python -c "import torch, specadapt.kernels as k; print('cuda ops:', k.has_op_for('block_verify', torch.device('cuda')))" \
  >> "$OUT/summary.txt" 2>&1

timeout 200 python -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda_jit.py tests/test_kernels.py tests/test_tts_cuda.py \
  tests/test_native_cuda.py \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/pytest_cuda.log" >> "$OUT/summary.txt"

timeout 150 python -m specadapt bench-kernels --device cuda --ops chain,block --repeats 20 --reference-repeats 1 \
  --no-progress --json "$OUT/bench_cuda.json" > "$OUT/bench_cuda.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/summary.txt"

# GBV (CUB-sorted ranking per depth) and the CuPy/NVRTC JIT of the same headers, on the quick subset.
timeout 60 python -m specadapt bench-kernels --device cuda --quick --ops gbv --repeats 10 --no-baselines \
  --no-progress --json "$OUT/bench_cuda_gbv.json" > "$OUT/bench_cuda_gbv.log" 2>&1
echo "bench gbv rc=$?" | tee -a "$OUT/summary.txt"
timeout 60 python -m specadapt bench-kernels --device cuda --quick --impl cupy --no-reference --no-baselines \
  --no-progress --json "$OUT/bench_cuda_cupy.json" > "$OUT/bench_cuda_cupy.log" 2>&1
echo "bench cupy rc=$?" | tee -a "$OUT/summary.txt"
cat "$OUT/summary.txt"
