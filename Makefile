# The two commands a user needs: `make demo` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
TINY_TARGET := .cache/tiny-target

.PHONY: install demo test lint bench clean

$(INSTALLED): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(INSTALLED)

demo: $(INSTALLED)
	$(PY) scripts/demo.py

test: $(INSTALLED) lint
	$(PY) -m pytest

lint: $(INSTALLED)
	$(PY) -m ruff check .

bench: $(INSTALLED)
	$(PY) bench/extract_throughput.py
	$(PY) bench/dag_parse.py

clean:
	rm -rf demo-work bench-work .pytest_cache .ruff_cache
