# The two commands of the README. Each sets itself up on a fresh machine (python3 + PyPI).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/mha-onnx
OUT := out
PRESET ?= base

.PHONY: run test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	@mkdir -p $(OUT)
	$(CLI) export --preset $(PRESET) -o $(OUT)/$(PRESET).onnx --force
	$(CLI) inspect $(OUT)/$(PRESET).onnx

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mha_onnx tests tools

clean:
	rm -rf $(OUT) .pytest_cache
