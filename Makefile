# Two commands set up and run everything: `make serve` and `make test`.
# Each bootstraps .venv idempotently: torch (CPU build pin) first, then mlc with its dev extras, then the
# default model into the model store ($MLC_HOME, default ~/.cache/mlc).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MLC := $(VENV)/bin/mlc-cli
TORCH_SPEC ?= torch==2.13.0
DEFAULT_MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8080
CHROMIUM ?= /usr/bin/chromium
# the browser the web UI tests drive
export MLC_CHROMIUM ?= $(CHROMIUM)
APT_GET ?= $(shell command -v apt-get)
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS ?= 1

.PHONY: setup model browser lint test test-slow serve chat clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch-installed: | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.mlc-installed: pyproject.toml $(VENV)/.torch-installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.mlc-installed

model: setup
	$(MLC) models pull $(DEFAULT_MODEL) --quiet
	@$(PY) -c "from mlc.layers.cpu_kernels import kernel_status; print('CPU kernels:', kernel_status())"

# The web UI tests drive Debian's chromium (Playwright's own browser download needs the internet): installed here as
# root where apt-get is, once; elsewhere those tests are skipped and this says what to run.
browser:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ -n "$(APT_GET)" ] && [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's chromium for the web UI tests"; \
		($(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq chromium >/dev/null) \
		|| echo "note: apt-get could not install chromium; the web UI tests will be skipped"; \
	else echo "note: no $(CHROMIUM): the web UI tests will be skipped; to run them: sudo apt-get install -y chromium"; fi

# ruff, mypy (strict on mlc.engine), the layer contracts (import-linter) and declared = used dependencies (deptry)
lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/deptry src tests

test: lint model browser
	$(PY) -m pytest -q -rs tests

test-slow: model browser
	$(PY) -m pytest -q -rs -m slow tests

serve: model
	$(MLC) serve --model $(DEFAULT_MODEL) --host $(HOST) --port $(PORT)

chat: model
	$(MLC) chat --model $(DEFAULT_MODEL)

clean-venv:
	rm -rf $(VENV)
