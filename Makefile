# kvsim: `make run` sets everything up and runs the default scenario;
# `make test` sets everything up, runs the whole test suite and builds the docs site strictly.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: setup run test docs lint clean

$(VENV)/.installed: pyproject.toml scripts/install_torch.sh
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PIP) install -q --upgrade pip
	PIP="$(PIP)" PY="$(PY)" bash scripts/install_torch.sh
	$(PIP) install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/kvsim model fetch
	$(VENV)/bin/kvsim sim scenario=table1-qwen32b-16k

# the fetch's run record (a Hydra run directory) goes beside the model cache, not outputs/
test: setup
	KVSIM_OUTPUT_ROOT=.cache/runs $(VENV)/bin/kvsim model fetch
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --quiet --strict --site-dir .cache/site
	$(PY) -m pytest -q --durations=40

# the documentation site, served with live reload (http://127.0.0.1:8000)
docs: setup
	$(VENV)/bin/mkdocs serve

lint: setup
	$(VENV)/bin/ruff check kvsim tests

clean:
	rm -rf $(VENV) outputs multirun results .pytest_cache
