"""Test configuration.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any
kernel module is imported: on a machine without a GPU every Triton kernel runs in the
interpreter and is compared with its torch implementation.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny tensors dominate these tests: with OpenMP threads on a small shared machine one
# small op can take milliseconds of spin-waiting, single-threaded it takes microseconds.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _sync_debug_mode_reset():
    """A GPU test that fails inside ``set_sync_debug_mode("error")`` would leave it on for
    every later test in its process (the first H100 run lost five tests that way)."""
    yield
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
