"""Shared pytest setup."""

import os
import sys

import pytest
from hypothesis import settings

# Triton picks interpreter vs compiler when `@triton.jit` decorates a kernel, i.e. when a kernel module is
# first imported. Setting this here, before any test module is collected, makes every Triton kernel run on
# CPU tensors through the interpreter, whichever test happens to import a kernel module first.
# setdefault: a GPU run can still export TRITON_INTERPRET=0 to test the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` (and so CI) runs the property tests on a fixed sequence of examples, so that a run cannot turn red
# on an example no earlier run drew; plain `pytest` keeps exploring new random examples, which is where a
# counterexample should be found and then pinned as a regression test.
settings.register_profile("ci", derandomize=True)



@pytest.fixture
def tiny_loaded():
    """Factory: a tiny random-weight Llama in memory, as a LoadedModel (see tests/runtimes/llm/tiny.py)."""
    from tests.runtimes.llm.tiny import TinySpec, loaded_tiny

    def make(seed: int = 0, **spec: object):
        return loaded_tiny(TinySpec(**spec), seed)

    return make


@pytest.fixture(autouse=True)
def _no_flush_to_zero_after_a_test():
    """An engine stepping on the test's thread turns on flush-to-zero there (ModelRunner._flush_denormals), which
    would leak into later tests: Hypothesis then refuses to draw floats (no subnormals can exist). Turned off after
    each test, where torch is loaded at all."""
    yield
    if (torch := sys.modules.get("torch")) is not None:
        torch.set_flush_denormal(False)
