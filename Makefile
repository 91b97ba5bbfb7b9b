# Two entry points: `make demo` and `make test`. Both create/reuse .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned for the local environment: an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test venv clean

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
test: $(STAMP)
	export TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) && \
	$(PY) -m pytest -q tests --ignore=tests/interpreter && \
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/interpreter

clean:
	rm -rf $(VENV) build *.egg-info
