"""Emission forms: a file's text as an agent would write it back.

Agents read a file in one form and write it in another: as unified-diff lines, inside a
JSON-encoded tool-call argument, or re-indented when moving code between blocks. The workspace
tier stores each rendering as its own document (forms never mix within a document) and the
caller tokenizes each one as whole text.

Everything here works on ``\\n``-separated text (what `agspec_gpu.capture` produces). Lines are
split at ``\\n`` only, as ``diff`` does, never at the other separators `str.splitlines` knows.
"""

from __future__ import annotations

import json
from collections import Counter
from enum import Enum
from typing import Iterable

__all__ = [
    "EmissionForm",
    "DEFAULT_FORMS",
    "DEFAULT_INDENT_UNIT",
    "detect_indent_unit",
    "render_form",
    "render_forms",
]


class EmissionForm(str, Enum):
    """The forms a file is rendered in; the value is a short stable name."""

    RAW = "raw"
    DIFF_ADD = "diff+"
    DIFF_CTX = "diff "
    DIFF_DEL = "diff-"
    JSON = "json"
    INDENT_IN = "indent+"
    INDENT_OUT = "indent-"


DEFAULT_FORMS: tuple[EmissionForm, ...] = tuple(EmissionForm)
DEFAULT_INDENT_UNIT = "    "
# a step deeper than this is a continuation line aligned under a bracket, not a unit (a
# fragment of aligned call arguments had taken 17 or 23 spaces as its unit)
_MAX_INDENT_STEP = 8

# The line prefix `diff -u` prints for added, context and removed lines. GNU diff prints an
# empty context line as a lone space (unless --suppress-blank-empty), so every line, empty or
# not, simply gets its prefix.
_DIFF_PREFIX = {
    EmissionForm.DIFF_ADD: "+",
    EmissionForm.DIFF_CTX: " ",
    EmissionForm.DIFF_DEL: "-",
}


def _lines(text: str) -> tuple[list[str], bool]:
    """``(lines, ends_with_newline)``, splitting at ``\\n`` only."""
    if text.endswith("\n"):
        return text[:-1].split("\n"), True
    return text.split("\n"), False


def _unlines(lines: list[str], newline_at_end: bool) -> str:
    return "\n".join(lines) + ("\n" if newline_at_end else "")


def _leading(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def detect_indent_unit(text: str) -> str:
    """The indentation unit ``text`` uses: one TAB, or a run of spaces.

    TAB when more indented lines start with a TAB than with a space. Otherwise the most common
    positive increase of leading spaces between consecutive non-blank lines (ties go to the
    smaller step; a step past 8 spaces is a continuation line aligned to a bracket, no
    unit).
    The first non-blank line is the baseline, not a step from column 0: a fragment (a grep
    hit, a ``sed -n`` window) often starts inside a block, and its depth is not the unit.
    `DEFAULT_INDENT_UNIT` (4 spaces) when the text has no indentation step.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    lines = [ln for ln in _lines(text)[0] if ln.strip()]
    tabbed = sum(ln.startswith("\t") for ln in lines)
    spaced = sum(ln.startswith(" ") for ln in lines)
    if tabbed > spaced:
        return "\t"
    steps: Counter[int] = Counter()
    prev: int | None = None  # (the first line's indentation is no step)
    for ln in lines:
        lead = _leading(ln)
        if "\t" in lead:
            continue
        if prev is not None and 0 < len(lead) - prev <= _MAX_INDENT_STEP:
            steps[len(lead) - prev] += 1
        prev = len(lead)
    if not steps:
        return DEFAULT_INDENT_UNIT
    best = max(steps.items(), key=lambda kv: (kv[1], -kv[0]))[0]
    return " " * best


def _check_unit(indent_unit: str) -> None:
    if not isinstance(indent_unit, str) or not indent_unit or indent_unit.strip(" \t"):
        raise ValueError(f"indent_unit must be a non-empty run of spaces or tabs, "
                         f"got {indent_unit!r}")


def render_form(text: str, form: EmissionForm, *, indent_unit: str | None = None) -> str:
    """``text`` rendered in one emission form.

    * ``RAW``: ``text`` unchanged.
    * ``DIFF_ADD`` / ``DIFF_CTX`` / ``DIFF_DEL``: every line prefixed with ``+`` / `` `` /
      ``-`` exactly as ``diff -u`` prints hunk lines (an empty line becomes ``+``, `` ``,
      ``-``); the text's final newline is kept or not as it was; no
      ``\\ No newline at end of file`` marker is added (agents do not write it).
    * ``JSON``: the body of ``json.dumps(text)`` without its quotes: ``\\n``, ``\\"``,
      ``\\\\``, ``\\t`` escapes and, as ``json.dumps`` does by default, ``\\uXXXX`` for
      non-ASCII. ensure_ascii=True is deliberate: every one of the 2,194 SWE-agent/Claude
      tool-call arguments in the dev trajectories re-encodes byte-exactly with
      ``json.dumps`` defaults; 192 of them hold ``\\uXXXX`` escapes and none holds a raw
      non-ASCII character.
    * ``INDENT_IN``: one ``indent_unit`` prepended to every line that is not blank
      (``textwrap.indent`` semantics: whitespace-only lines are left alone).
    * ``INDENT_OUT``: one ``indent_unit`` removed from every line that starts with it; other
      lines unchanged.

    Args:
        text: the file text.
        form: the form to render.
        indent_unit: the indentation unit for the indent forms; detected from ``text`` with
            `detect_indent_unit` when None.

    Raises:
        ValueError: ``text`` is not a str, ``form`` is not an `EmissionForm` value, or
            ``indent_unit`` is not a non-empty run of spaces/tabs.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    try:
        form = EmissionForm(form)
    except ValueError:
        raise ValueError(f"form must be an EmissionForm, got {form!r}") from None
    if indent_unit is not None:
        _check_unit(indent_unit)
    if form is EmissionForm.RAW:
        return text
    if form is EmissionForm.JSON:
        return json.dumps(text)[1:-1]
    if not text:
        return ""
    lines, newline_at_end = _lines(text)
    if form in _DIFF_PREFIX:
        prefix = _DIFF_PREFIX[form]
        return _unlines([prefix + ln for ln in lines], newline_at_end)
    unit = detect_indent_unit(text) if indent_unit is None else indent_unit
    if form is EmissionForm.INDENT_IN:
        return _unlines([unit + ln if ln.strip() else ln for ln in lines], newline_at_end)
    return _unlines([ln[len(unit):] if ln.startswith(unit) else ln for ln in lines],
                    newline_at_end)


def render_forms(text: str, forms: Iterable[EmissionForm] = DEFAULT_FORMS, *,
                 indent_unit: str | None = None) -> dict[EmissionForm, str]:
    """``text`` rendered in each of ``forms``, one separate string per form.

    A form whose rendering is empty, or equal to the raw text (other than ``RAW`` itself), is
    left out: it would only duplicate a document. So an empty ``text`` gives ``{}``, and a
    text with no indented line has no ``INDENT_OUT`` entry. The indentation unit is detected
    once for all forms when ``indent_unit`` is None.

    Raises:
        ValueError: as `render_form`, or ``forms`` is not an iterable of forms.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if isinstance(forms, (str, bytes)) or not isinstance(forms, Iterable):
        raise ValueError(f"forms must be an iterable of EmissionForm, got {forms!r}")
    wanted = list(forms)
    if indent_unit is None and any(
            f in (EmissionForm.INDENT_IN, EmissionForm.INDENT_OUT) for f in wanted):
        indent_unit = detect_indent_unit(text)
    out: dict[EmissionForm, str] = {}
    for form in wanted:
        rendered = render_form(text, form, indent_unit=indent_unit)
        form = EmissionForm(form)
        if rendered and (form is EmissionForm.RAW or rendered != text):
            out[form] = rendered
    return out
