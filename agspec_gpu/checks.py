"""Argument checks that several public entry points share: each raises ValueError naming
the argument, before the caller's call changes anything."""

from __future__ import annotations

from numbers import Integral
from typing import Any


def check_int_fields(obj: Any, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Each attribute of ``obj`` in ``names`` is an int (a bool is not; None where it is in
    ``optional``); a config's ``__post_init__`` calls this before comparing them."""
    for name in names:
        v = getattr(obj, name)
        if v is None and name in optional:
            continue
        if not isinstance(v, Integral) or isinstance(v, bool):
            raise ValueError(f"{name}: expected an int{' or None' if name in optional else ''}"
                             f", got {v!r}")


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
