"""Workspace capture, the text layer: the :class:`CapturedFile` record, line-number gutters,
line helpers and the tool-output envelopes (mini-swe-agent, SWE-agent) around a command's
own output. Shared by :mod:`agspec_gpu.capture_shell` and :mod:`agspec_gpu.capture`."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CapturedFile:
    """One file text recovered from an agent transcript.

    Attributes:
        path: the file path as the agent named it (joined to a leading ``cd DIR`` when the
            command had one and the path was relative), or None when unknown.
        text: the file text without line-number gutters, ``\\n`` line ends, ending in ``\\n``.
        first_line: 1-based file line of the first line of ``text`` when this is a fragment
            whose position is known; None for whole files and for fragments of unknown position.
        is_fragment: True when ``text`` is only part of the file.
        kind: the recogniser that produced it (``"cat"``, ``"cat-n"``, ``"nl"``, ``"sed-n"``,
            ``"head"``, ``"tail"``, ``"grep"``, ``"grep-n"``, ``"swe-view"``, ``"swe-edit"``,
            ``"swe-open"``, ``"openhands-view"``, ``"aider-fence"``, ``"aider-new"``,
            ``"heredoc"``, ``"create"``).
    """

    path: str | None
    text: str
    first_line: int | None
    is_fragment: bool
    kind: str



# --------------------------------------------------------------------------------------------
# Line-number gutters
# --------------------------------------------------------------------------------------------

# `cat -n`, `nl -ba` and the SWE-agent/OpenHands editor `view`: the number right-aligned in a
# 6-wide field, then a TAB. Wider numbers simply push the TAB right (checked in _tab_row).
_TAB_ROW = re.compile(r"( *)(\d+)\t(.*)", re.S)
# SWE-agent's abbreviated view of a large file uses a space instead of the TAB.
_SPACE_ROW = re.compile(r"( *)(\d+) (.*)", re.S)
# `grep -n` on one file: `N:hit` for matches, `N-context` for -A/-B/-C context lines.
_GREP_ROW = re.compile(r"(\d+)[:-](.*)", re.S)
# SWE-agent 0.x `open`/`goto`/`scroll_*` windows.
_COLON_ROW = re.compile(r"(\d+):(.*)", re.S)
# OpenHands agentskills `open_file` windows.
_PIPE_ROW = re.compile(r"(\d+)\|(.*)", re.S)
# `nl` without `-ba` prints blank lines unnumbered, as the 6-wide field plus separator.
_NL_BLANK = " " * 7
_GREP_SEPARATOR = "--"
_GUTTER_WIDTH = 6


def _tab_row(line: str, pattern: re.Pattern[str] = _TAB_ROW) -> tuple[int, str] | None:
    """Parses one right-aligned-number row, checking the field width exactly."""
    m = pattern.fullmatch(line)
    if m is None:
        return None
    pad, digits = m.group(1), m.group(2)
    if len(pad) + len(digits) != max(_GUTTER_WIDTH, len(digits)) or \
            len(digits) > _MAX_LINE_DIGITS:
        return None
    return int(digits), m.group(3)


def _simple_row(line: str, pattern: re.Pattern[str]) -> tuple[int, str] | None:
    m = pattern.fullmatch(line)
    return None if m is None or len(m.group(1)) > _MAX_LINE_DIGITS else \
        (int(m.group(1)), m.group(2))


_MAX_LINE_DIGITS = 18  # a longer number is no line number (and past int()'s digit limit)


_GUTTER_PARSERS = {
    "tab": _tab_row,
    "space": lambda line: _tab_row(line, _SPACE_ROW),
    "grep": lambda line: _simple_row(line, _GREP_ROW),
    "colon": lambda line: _simple_row(line, _COLON_ROW),
    "pipe": lambda line: _simple_row(line, _PIPE_ROW),
}


def _parse_rows(lines: list[str], gutter: str) -> list[tuple[int, str]] | None:
    """Every line parsed with one gutter, or None if any line does not carry it."""
    parse = _GUTTER_PARSERS[gutter]
    rows = []
    for line in lines:
        row = parse(line)
        if row is None:
            return None
        rows.append(row)
    return rows


def strip_line_gutters(text: str) -> str | None:
    """Removes line-number gutters from a whole gutter-formatted text.

    Recognised gutters, tried in this order: ``cat -n``/``nl -ba``/editor ``view`` (number
    right-aligned in 6 columns, then TAB), the same with a space (SWE-agent abbreviated view),
    ``N|`` (OpenHands), ``N:`` (SWE-agent ``open``), and ``N:``/``N-`` (``grep -n``, ``--``
    group separators dropped). Every line must carry the gutter and the numbers must increase
    strictly; otherwise the text is not gutter-formatted and None is returned.

    Returns:
        The text with gutters removed, ``\\n`` line ends, ending in ``\\n``; None when ``text``
        is empty or not gutter-formatted.
    """
    lines = _split_lines(_normalise(text))
    for gutter in ("tab", "space", "pipe", "colon", "grep"):
        body = [ln for ln in lines if not (gutter == "grep" and ln == _GREP_SEPARATOR)]
        rows = _parse_rows(body, gutter) if body else None
        if rows and all(a[0] < b[0] for a, b in zip(rows, rows[1:])):
            return _join_lines([t for _, t in rows])
    return None


# --------------------------------------------------------------------------------------------
# Small text helpers
# --------------------------------------------------------------------------------------------


def _normalise(text: str) -> str:
    return text.replace("\r\n", "\n")


def _split_lines(text: str) -> list[str]:
    """Lines of ``text`` without their ends; a final newline does not open an empty line."""
    if not text:
        return []
    return text[:-1].split("\n") if text.endswith("\n") else text.split("\n")


def _join_lines(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _whole_lines(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


# --------------------------------------------------------------------------------------------
# Tool-output envelopes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    """A piece of the command's real output; ``cut_*`` marks a truncation at that end."""

    lines: tuple[str, ...]
    cut_start: bool = False
    cut_end: bool = False

    def whole_lines(self) -> list[str]:
        """The lines that are surely complete: the cut ends are dropped."""
        lo = 1 if self.cut_start else 0
        hi = len(self.lines) - (1 if self.cut_end else 0)
        return list(self.lines[lo:hi])


_OBSERVATION_PREFIX = "OBSERVATION:\n"
_MINI_RETURNCODE = re.compile(r"\A<returncode>(-?\d+)</returncode>\n")
_MINI_OUTPUT = re.compile(r"\A<output>\n(.*)</output>\s*\Z", re.S)
# mini-swe-agent's long outputs: <output_head>\n...\n</output_head>, an elision block, then
# <output_tail>\n...\n</output_tail> at the end. The head ends at the elision block, not at
# the first </output_head> (a file may mention it); searched from a literal prefix: linear
_HEAD_OPEN, _TAIL_CLOSE = "<output_head>\n", "\n</output_tail>"
_ELISION = re.compile(r"\n</output_head>\n<elided_chars>\n\d+ characters elided\n"
                      r"</elided_chars>\n<output_tail>\n")


def _mini_cut(text: str) -> tuple[str, str] | None:
    """``(head, tail)`` of mini-swe-agent's cut output, or None: the head from the first
    ``<output_head>`` line to the elision block, the tail from there to a final
    ``</output_tail>`` line (only whitespace after it)."""
    start = text.find(_HEAD_OPEN)
    if start < 0:
        return None
    gap = _ELISION.search(text, start + len(_HEAD_OPEN) - 1)  # (an empty head: one newline)
    body = text.rstrip()
    if gap is None or not body.endswith(_TAIL_CLOSE) or \
            gap.end() > len(body) - len(_TAIL_CLOSE) + 1:
        return None
    return text[start + len(_HEAD_OPEN):max(gap.start(), start + len(_HEAD_OPEN))], \
        text[gap.end():len(body) - len(_TAIL_CLOSE)]


# SWE-agent's clip marker, its one-line note after it ends the output (a file that mentions
# the marker had been captured up to there): see _clipped_at
_SWE_CLIPPED = "<response clipped><NOTE>"
_SWE_NO_OUTPUT = "Your last command ran successfully and did not produce any output."
# mini-swe-agent's message for a command it killed: what it printed is partial, or none
_MINI_TIMEOUT = re.compile(r"\AThe last command <command>.*?</command> timed out", re.S)
# First-line error messages of the read commands (no return code in SWE-agent outputs).
_READ_ERROR = re.compile(r"\A(?:cat|nl|sed|head|tail|grep|bash|/bin/sh|sh): ")


def _clipped_at(text: str) -> int:
    """Where SWE-agent's clip marker starts in ``text``, or -1: its last
    ``<response clipped><NOTE>``, when only the note's one line (up to ``</NOTE>``) and
    blanks follow it."""
    at = text.rfind(_SWE_CLIPPED)
    if at < 0:
        return -1
    note = text[at + len(_SWE_CLIPPED):].rstrip()
    return at if note.endswith("</NOTE>") and "\n" not in note else -1


def _unwrap_output(output: str) -> list[_Segment] | None:
    """The command's own output, as segments, or None when the command failed.

    Handles the mini-swe-agent ``<returncode>``/``<output>`` wrapper (and its truncated
    ``<output_head>``/``<output_tail>`` form, and its message for a command that timed
    out: None), SWE-agent's ``OBSERVATION:`` prefix and its
    ``<response clipped>`` marker, and bare outputs.
    """
    text = _normalise(output)
    if text.startswith(_OBSERVATION_PREFIX):
        text = text[len(_OBSERVATION_PREFIX):]
    if _MINI_TIMEOUT.match(text):
        return None
    m = _MINI_RETURNCODE.match(text)
    if m is not None:
        if int(m.group(1)) != 0:
            return None
        rest = text[m.end():]
        whole = _MINI_OUTPUT.match(rest)  # (a cut output starts <warning>: a file that
        if whole is not None:               # mentions <output_head> had been dropped)
            return [_Segment(tuple(_split_lines(whole.group(1))))]
        cut = _mini_cut(rest)
        if cut is None:
            return None
        head, tail = cut
        return [
            _Segment(tuple(_split_lines(head)), cut_end=True),
            _Segment(tuple(_split_lines(tail)), cut_start=True),
        ]
    if text.strip() == _SWE_NO_OUTPUT:
        return []
    clip = _clipped_at(text)
    if clip >= 0:
        return [_Segment(tuple(_split_lines(text[:clip])), cut_end=True)]
    return [_Segment(tuple(_split_lines(text)))]


def _runs(items: list[tuple[int | None, str] | None], numbers_are_lines: bool
          ) -> list[tuple[int | None, list[str]]]:
    """Contiguous runs of ``(number, text)`` items; None items are group separators."""
    runs: list[tuple[int | None, list[str]]] = []
    prev: int | None = None
    new_run = True
    for item in items:
        if item is None:
            new_run = True
            continue
        num, text = item
        if not new_run and num is not None and prev is not None and num != prev + 1:
            new_run = True
        if new_run:
            runs.append((num if numbers_are_lines else None, []))
            new_run = False
        runs[-1][1].append(text)
        if num is not None:
            prev = num
    return runs
