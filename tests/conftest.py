"""Shared pytest setup."""

import os

# Triton picks interpreter vs compiler when `@triton.jit` decorates a kernel, i.e. when a kernel module is
# first imported. Setting this here, before any test module is collected, makes every Triton kernel run on
# CPU tensors through the interpreter, whichever test happens to import a kernel module first.
# setdefault: a GPU run can still export TRITON_INTERPRET=0 to test the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
