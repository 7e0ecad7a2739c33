"""Host-side helpers the launchers (and their callers) share: block arithmetic, casts.

In Triton 3.x ``triton.next_power_of_2`` and ``triton.cdiv`` are constexpr functions: called
from host code, each goes through Triton's JIT wrapper (an import and two comprehensions per
call, ~3-6 us on this project's CPUs), a cost a launcher paid up to four times per launch,
on every step. These are the plain-Python equivalents (equal for every int ``>= 0``;
``tests/test_launch_overhead.py``). A ``.to()`` that converts nothing still costs ~1.5-2 us
of host time; :func:`cast` skips it.
"""

from __future__ import annotations

import torch


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``triton.next_power_of_2``: 0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0`` (``triton.cdiv``)."""
    return -(-a // b)


def cast(x: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None
         ) -> torch.Tensor:
    """``x.to(device, dtype)`` (``device`` None: ``x``'s), and ``x`` itself, without a call,
    when it already is."""
    if x.dtype == dtype and (device is None or x.device == device):
        return x
    return x.to(x.device if device is None else device, dtype)


# the float dtypes the layer kernels compute in (float32 inside): a float64 tensor runs the
# torch path, which computes in float64
KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def slot_or_spare(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``slots`` with each one outside ``[0, num_slots)`` sent to ``num_slots``: the spare
    entry a torch path appends past a state, so that a row its kernel skips writes there
    (an index clamped into the state would race a kept row's write to the same slot)."""
    return torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)
