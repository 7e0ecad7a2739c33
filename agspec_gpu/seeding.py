"""Counter-based uniforms for seeded requests: one number per (seed, sequence position).

A seeded request (``SamplingParams(seed=...)``) draws the token at sequence position ``t``
with the uniform ``seeded_uniforms(seed, t)``, a pure function of the two: no generator
state, so its output depends on its context and seed alone, whatever batch it runs in, and
a speculative step (which samples positions ``t, t + 1, ...`` down the tree, one per
level) draws what plain decoding draws at each position. Pure integer tensor ops: the same
numbers on a CPU and a GPU, and nothing to capture or advance in a CUDA graph.

The hash is Wellons' ``lowbias32`` (bias ~0.17 of the best known 32-bit two-round mix):
the seed's two 32-bit halves are mixed apart, the position twice into the low half's, then
the high half's once over that. The stream's state is the seed's 64 bits (a bijection of
them), so two seeds never share a stream: folding the halves into one 32-bit state first
gave 2**32 streams, and pairs of seeds above 2**32 with equal ones (30064783417 and
7865844771372150842: the same uniform at every position), even odds of such a pair among
~77,000 random 63-bit seeds. Products are split in 16-bit halves, so no int64 product
overflows on any backend.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)`` (int64), no product past 2**48."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of ``x`` in ``[0, 2**32)`` (int64)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniforms(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``float64`` uniforms in ``(0, 1)``, one per element: a hash of ``seed`` (int64, in
    ``[0, 2**63)``) and ``position`` (int64, ``>= 0``; only its low 32 bits count),
    broadcast together. 32 bits of resolution: ``(h + 0.5) / 2**32``. Distinct seeds
    give distinct streams (their ``(low, high)`` states differ)."""
    seed, position = seed.long(), position.long()
    low, high = _mix32(seed & _M32), _mix32((seed >> 32) & _M32)
    # two rounds on the position: after one, positions a few low bits apart (t, t + 1)
    # drew measurably dependent uniforms across seeds (a 2-D chi-square of z = +44 over
    # 4M seeds at t = 1001, 1002); the second round removes it
    h = _mix32(_mix32(low ^ (position & _M32)))
    h = _mix32(h ^ high)
    return (h.double() + 0.5) / 4294967296.0
