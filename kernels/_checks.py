"""Argument checks the kernels' launchers share: a clear error naming the argument."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensors(*specs: tuple[str, torch.Tensor, torch.dtype, Sequence[int]],
                  contiguous: bool = False) -> None:
    """Raises ValueError for the first ``(name, tensor, dtype, shape)`` whose tensor has
    another dtype or shape (or is not contiguous, with ``contiguous``)."""
    for name, t, dt, shape in specs:
        if t.dtype != dt or tuple(t.shape) != tuple(shape) or \
                (contiguous and not t.is_contiguous()):
            raise ValueError(f"{name}: expected {'contiguous ' if contiguous else ''}{dt} "
                             f"{list(shape)}, got {t.dtype} {list(t.shape)}")


def check_devices(*named: tuple[str, torch.Tensor]) -> None:
    """Raises ValueError naming the first of ``(name, tensor)`` that is not on the first
    one's device."""
    (ref_name, ref), *rest = named
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(f"{name}: on {t.device}, {ref_name} on {ref.device}")
