"""Test configuration.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any
kernel module is imported: on a machine without a GPU every Triton kernel runs in the
interpreter and is compared with its torch implementation.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
