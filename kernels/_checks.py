"""Argument checks the kernels' launchers share: a clear error naming the argument."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def is_py_int(v) -> bool:
    """Whether ``v`` is a Python int and not a bool (a launcher's sizes and bounds: they go
    to kernel arguments and buffer shapes as they are)."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_ints(*specs: tuple[str, object, int, int | None]) -> None:
    """Raises ValueError for the first ``(name, value, lo, hi)`` whose value is not a
    Python int (:func:`is_py_int`) in ``[lo, hi)`` (``hi`` None: no upper bound)."""
    for name, v, lo, hi in specs:
        if not is_py_int(v) or v < lo or (hi is not None and v >= hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
            raise ValueError(f"{name}: expected an int {bound}, got {v!r}")


def check_tensors(*specs: tuple[str, torch.Tensor, torch.dtype, Sequence[int]],
                  contiguous: bool = False) -> None:
    """Raises ValueError for the first ``(name, tensor, dtype, shape)`` whose tensor has
    another dtype or shape (or is not contiguous, with ``contiguous``)."""
    for name, t, dt, shape in specs:
        if t.dtype != dt or tuple(t.shape) != tuple(shape) or \
                (contiguous and not t.is_contiguous()):
            strided = " (not contiguous)" if contiguous and not t.is_contiguous() else ""
            raise ValueError(f"{name}: expected {'contiguous ' if contiguous else ''}{dt} "
                             f"{list(shape)}, got {t.dtype} {list(t.shape)}{strided}")


def check_array(name: str, x: torch.Tensor, dtype: torch.dtype, ndim: int,
                device: torch.device) -> None:
    """Raises ValueError naming ``name`` unless ``x`` is a contiguous ``ndim``-dimensional
    ``dtype`` tensor on ``device`` (a launcher whose shapes are checked afterwards)."""
    if x.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device}, got {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def check_devices(*named: tuple[str, torch.Tensor]) -> None:
    """Raises ValueError naming the first of ``(name, tensor)`` that is not on the first
    one's device."""
    (ref_name, ref), *rest = named
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(f"{name}: on {t.device}, {ref_name} on {ref.device}")


def check_sink_page(sink_page: int | None) -> None:
    """Raises ValueError unless ``sink_page`` is None or a page index (an int >= 0 that
    an int32 page table holds)."""
    if sink_page is not None and not (is_py_int(sink_page) and 0 <= sink_page < 1 << 31):
        raise ValueError(f"sink_page: expected an int in [0, 2**31) or None, got "
                         f"{sink_page!r}")


def check_ndims(*specs: tuple[str, torch.Tensor, int]) -> None:
    """Raises ValueError naming the first ``(name, tensor, ndim)`` whose tensor has another
    number of dims (checked before a launcher unpacks its shape)."""
    for name, t, ndim in specs:
        if not isinstance(t, torch.Tensor) or t.dim() != ndim:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected {ndim} dims, got {shape}")
