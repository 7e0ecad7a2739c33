"""Test configuration.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any
kernel module is imported: on a machine without a GPU every Triton kernel runs in the
interpreter and is compared with its torch implementation.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny tensors dominate these tests: with OpenMP threads on a small shared machine one
# small op can take milliseconds of spin-waiting, single-threaded it takes microseconds.
torch.set_num_threads(1)
