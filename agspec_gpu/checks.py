"""Argument checks that several public entry points share: each raises ValueError naming
the argument, before the caller's call changes anything."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclasses normalize in __post_init__


def is_int(v: Any) -> bool:
    """Whether ``v`` is an integer (numpy's too) and not a bool."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def check_int_fields(obj: Any, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Each attribute of ``obj`` in ``names`` is an int (a bool is not; None where it is in
    ``optional``); a config's ``__post_init__`` calls this before comparing them. Other
    integral types (``numpy.int64``, ...) are stored back as ``int``: the kernels' launchers
    and buffer sizes take Python ints only."""
    for name in names:
        v = getattr(obj, name)
        if v is None and name in optional:
            continue
        if not is_int(v):
            raise ValueError(f"{name}: expected an int{' or None' if name in optional else ''}"
                             f", got {v!r}")
        if type(v) is not int:
            _set(obj, name, int(v))


def check_float_fields(obj: Any, names: tuple[str, ...], infinite: tuple[str, ...] = ()
                       ) -> None:
    """Each attribute of ``obj`` in ``names`` is a finite real number (a bool is not; +inf
    too where it is in ``infinite``: "no bound"), stored back as ``float``; ranges are the
    caller's to check."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, Real) or isinstance(v, bool) or not (
                math.isfinite(v) or (name in infinite and v == math.inf)):
            raise ValueError(f"{name}: expected a finite number"
                             f"{' or inf' if name in infinite else ''}, got {v!r}")
        if type(v) is not float:
            _set(obj, name, float(v))


def check_at_most(obj: Any, caps: Mapping[str, float]) -> None:
    """Each attribute of ``obj`` named in ``caps`` (already type-checked; None passes) is at
    most its cap: a size past it would allocate without bound or wrap an int32 in a kernel,
    failing far from the field."""
    for name, cap in caps.items():
        v = getattr(obj, name)
        if v is not None and v > cap:
            raise ValueError(f"{name} must be <= {cap:g}, got {v!r}")


def check_bool_fields(obj: Any, names: tuple[str, ...]) -> None:
    """Each attribute of ``obj`` in ``names`` is a bool (``numpy.bool_`` stored back as
    one): a truthy string such as ``"no"`` must not switch a feature on."""
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, np.bool_):
            _set(obj, name, bool(v))
        elif not isinstance(v, bool):
            raise ValueError(f"{name}: expected a bool, got {v!r}")


def check_instance_field(obj: Any, name: str, cls: type) -> None:
    """The attribute ``name`` of ``obj`` is a ``cls``."""
    v = getattr(obj, name)
    if not isinstance(v, cls):
        raise ValueError(f"{name}: expected a {cls.__name__}, got {type(v).__name__}")


def check_tuple_field(obj: Any, name: str, cls: type | tuple[type, ...],
                      length: int | None = None, convert: Any = None) -> None:
    """The attribute ``name`` of ``obj`` is a sequence (not a str; a 1-D numpy array too) of
    ``cls`` items (a bool is not an int here; ``length`` items where given), stored back as
    a tuple (of ``convert(item)`` where given)."""
    v = getattr(obj, name)
    if isinstance(v, np.ndarray) and v.ndim == 1:  # its items as numpy scalars
        v = list(v)
    kinds = cls if isinstance(cls, tuple) else (cls,)
    what = " or ".join("int" if k is Integral else k.__name__ for k in kinds)
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) \
            or (length is not None and len(v) != length) \
            or not all(isinstance(x, cls) and not (isinstance(x, bool) and bool not in kinds)
                       for x in v):
        raise ValueError(f"{name}: expected a tuple of {length or ''}{' ' if length else ''}"
                         f"{what}, got {v!r}")
    if convert is not None:
        _set(obj, name, tuple(convert(x) for x in v))
    elif type(v) is not tuple:
        _set(obj, name, tuple(v))


def check_text(text: Any, name: str) -> str:
    """``text`` if it is a ``str`` that UTF-8 can encode; else ValueError naming ``name``.

    A lone surrogate (``json.loads('"\\ud800"')``, a ``surrogateescape``-decoded byte) has
    no UTF-8 form: no tokenizer reads it and no digest hashes it, so the caller's text is
    refused before anything is changed.
    """
    if not isinstance(text, str):
        raise ValueError(f"{name}: expected a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: {text[e.start]!r} at character {e.start} has no UTF-8 "
                         f"form (a lone surrogate); decode such bytes with "
                         f"errors='replace'") from None
    return text


def check_int_tensor(t: Any, name: str, shape: Sequence[int | str | None]) -> None:
    """``t`` is an integer tensor (not bool) of ``len(shape)`` dimensions, each the size
    ``shape`` gives (an int; a str names a size not checked here, None any); else
    ValueError naming ``name``. Host metadata only: no device read."""
    ok = isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or
                                              t.dtype == torch.bool)
    if not ok or t.dim() != len(shape) or \
            any(isinstance(w, int) and got != w for got, w in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else \
            type(t).__name__
        raise ValueError(f"{name}: expected an integer tensor {want}, got {got}")


def check_token_ids(ids: Any, name: str, vocab_size: int) -> list[int]:
    """``ids`` (a sequence of ints or a 1-D integer tensor) as a list of ints, each in
    ``[0, vocab_size)``; else ValueError naming ``name``. An unordered container (a set, a
    dict's keys) is refused: it has no token order to keep."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{name}: expected integer token ids, got {ids.dtype}")
        if ids.layout != torch.strided or ids.is_meta:
            raise ValueError(f"{name}: expected a dense tensor holding data, got a "
                             f"{'meta' if ids.is_meta else ids.layout} tensor")
        ids = ids.tolist()
    what = (f"{name}: expected token ids (a list of int or a 1-D integer tensor), got "
            f"{type(ids).__name__}")
    if isinstance(ids, (str, bytes, Set, Mapping)) or not isinstance(ids, Iterable):
        raise ValueError(what)
    try:
        ids = list(ids)
    except TypeError:  # (an iterable type whose instance is not: a 0-d numpy array)
        raise ValueError(what) from None
    odd = [t for t in ids if not is_int(t)]
    if odd:
        raise ValueError(f"{name}: expected integer token ids, got {odd[0]!r}")
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                         f"[0, {vocab_size})")
    return ids
