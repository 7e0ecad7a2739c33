"""Host-side block arithmetic the launchers share.

In Triton 3.x ``triton.next_power_of_2`` and ``triton.cdiv`` are constexpr functions: called
from host code, each goes through Triton's JIT wrapper (an import and two comprehensions per
call, ~3-6 us on this project's CPUs), a cost a launcher paid up to four times per launch,
on every step. These are the plain-Python equivalents (equal for every int ``>= 0``;
``tests/test_launch_overhead.py``).
"""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``triton.next_power_of_2``: 0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0`` (``triton.cdiv``)."""
    return -(-a // b)
