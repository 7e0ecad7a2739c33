"""Workspace capture: file text recovered from what coding agents read and write.

Agents see files through tool outputs (``cat``, ``nl -ba``, ``sed -n``, ``grep -n``, editor
``view`` commands) and write files through heredocs, editor ``create`` calls and whole-file
listings. This module turns those texts back into plain file text, so that the workspace tier
can hold each file once, gutter-free, and render it in the forms an agent emits.

Everything here is pure text: no tokenizer, no tensors. Each `CapturedFile.text` is meant to be
tokenized as a whole by the caller.

Conventions for every capture:

* ``\\r\\n`` is normalised to ``\\n`` (terminal-backed tools such as SWE-agent print CRLF);
* a captured text is a sequence of whole lines and always ends with ``\\n`` (some tools strip
  the final newline of their output, which says nothing about the file);
* lines cut by an output truncation (mini-swe-agent ``<output_head>``, SWE-agent
  ``<response clipped>``) are dropped, so a fragment never starts or ends mid-line;
* ``first_line`` is the 1-based file line of the first captured line when it is known, for
  fragments only; whole files have ``first_line=None``;
* a command the recognisers do not fully understand captures nothing: a wrong file text in the
  workspace costs more than a missing one.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, replace
from typing import Iterator

__all__ = [
    "CapturedFile",
    "capture_tool_output",
    "capture_agent_writes",
    "strip_line_gutters",
]


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
    if len(pad) + len(digits) != max(_GUTTER_WIDTH, len(digits)):
        return None
    return int(digits), m.group(3)


def _simple_row(line: str, pattern: re.Pattern[str]) -> tuple[int, str] | None:
    m = pattern.fullmatch(line)
    return None if m is None else (int(m.group(1)), m.group(2))


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
_MINI_HEAD = re.compile(r"<output_head>\n(.*?)\n</output_head>", re.S)
_MINI_TAIL = re.compile(r"<output_tail>\n(.*)\n</output_tail>\s*\Z", re.S)
_SWE_CLIPPED = "<response clipped>"
_SWE_NO_OUTPUT = "Your last command ran successfully and did not produce any output."
# First-line error messages of the read commands (no return code in SWE-agent outputs).
_READ_ERROR = re.compile(r"\A(?:cat|nl|sed|head|tail|grep|bash|/bin/sh|sh): ")


def _unwrap_output(output: str) -> list[_Segment] | None:
    """The command's own output, as segments, or None when the command failed.

    Handles the mini-swe-agent ``<returncode>``/``<output>`` wrapper (and its truncated
    ``<output_head>``/``<output_tail>`` form), SWE-agent's ``OBSERVATION:`` prefix and its
    ``<response clipped>`` marker, and bare outputs.
    """
    text = _normalise(output)
    if text.startswith(_OBSERVATION_PREFIX):
        text = text[len(_OBSERVATION_PREFIX):]
    m = _MINI_RETURNCODE.match(text)
    if m is not None:
        if int(m.group(1)) != 0:
            return None
        rest = text[m.end():]
        whole = _MINI_OUTPUT.match(rest)
        if whole is not None and "<output_head>" not in rest:
            return [_Segment(tuple(_split_lines(whole.group(1))))]
        head, tail = _MINI_HEAD.search(rest), _MINI_TAIL.search(rest)
        if head is None or tail is None:
            return None
        return [
            _Segment(tuple(_split_lines(head.group(1))), cut_end=True),
            _Segment(tuple(_split_lines(tail.group(1))), cut_start=True),
        ]
    if text.strip() == _SWE_NO_OUTPUT:
        return []
    if _SWE_CLIPPED in text:
        return [_Segment(tuple(_split_lines(text.split(_SWE_CLIPPED, 1)[0])), cut_end=True)]
    return [_Segment(tuple(_split_lines(text)))]


# --------------------------------------------------------------------------------------------
# Extracting the agent's command
# --------------------------------------------------------------------------------------------

_FENCE_LINE = re.compile(r"```([\w+#.\-]*)[ \t]*")
_SHELL_LANGS = ("bash", "sh", "shell", "console", "")
_TOOL_CALL_OPEN = "<tool_call>"


def _tool_calls(message: str) -> list[tuple[str, dict]]:
    """``(name, arguments)`` of every ``<tool_call>{"name":..,"arguments":{..}}</tool_call>``."""
    calls = []
    decoder = json.JSONDecoder()
    pos = message.find(_TOOL_CALL_OPEN)
    while pos >= 0:
        start = pos + len(_TOOL_CALL_OPEN)
        while start < len(message) and message[start].isspace():
            start += 1
        try:
            obj, end = decoder.raw_decode(message, start)
        except json.JSONDecodeError:
            obj, end = None, start
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments")
            if isinstance(args, str):  # some APIs double-encode the arguments
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = None
            if isinstance(args, dict):
                calls.append((obj["name"], args))
        pos = message.find(_TOOL_CALL_OPEN, end)
    return calls


def _shell_commands(message: str) -> list[str]:
    """Shell commands in an assistant message.

    ``bash`` tool calls when there are any; else the ```bash fenced blocks; else fenced blocks
    tagged ``sh``/``shell``/``console`` or untagged (SWE-agent's text action format).
    """
    calls = [a["command"] for n, a in _tool_calls(message)
             if n == "bash" and isinstance(a.get("command"), str)]
    if calls:
        return calls
    if _TOOL_CALL_OPEN in message:
        return []
    blocks = _fenced_blocks(_normalise(message))
    # mini-swe-agent runs only ```bash blocks; untagged fences in its thoughts quote outputs.
    tagged = [body for lang, body in blocks if lang == "bash"]
    return tagged or [body for lang, body in blocks if lang in _SHELL_LANGS]


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every ``` fenced block, pairing each opener with its closer.

    Pairing matters: a regex for shell fences alone would take the closer of a preceding
    ```python block for an opener.
    """
    blocks = []
    lang, body = None, []
    for line in text.split("\n"):
        m = _FENCE_LINE.fullmatch(line)
        if lang is None:
            if m is not None:
                lang, body = m.group(1), []
        elif m is not None and not m.group(1):
            blocks.append((lang, _join_lines(body)))
            lang = None
        else:
            body.append(line)
    return blocks


# --------------------------------------------------------------------------------------------
# Shell read pipelines
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stream:
    """What the lines of a read pipeline's output are, relative to the file.

    Attributes:
        path: the file read.
        kind: the recogniser name (from the source command).
        gutter: "tab" (cat -n / nl -ba: numbers are file lines), "nl" (plain nl: numbers
            skip blank lines), "grep" (grep -n: numbers are file lines) or None (raw lines).
        outer_grep: lines carry an extra ``N:``/``N-`` prefix from a later ``grep -n``.
        start: file line of the first stream line, when the stream is contiguous and known.
        contiguous: the lines are consecutive file lines.
        full: the stream is the whole file.
        limit: line limit of a ``head`` applied to a full stream: fewer lines means whole file.
        isolated: each output line is a separate grep hit (no context lines were asked for),
            so without line numbers two lines are never known to be adjacent.
    """

    path: str
    kind: str
    gutter: str | None = None
    outer_grep: bool = False
    start: int | None = 1
    contiguous: bool = True
    full: bool = True
    limit: int | None = None
    isolated: bool = False


_SED_RANGE = re.compile(r"(\d+)(?:,(\d+|\$))?p")
_SED_RELATIVE = re.compile(r"(\d+),\+(\d+)p")
_SED_PATTERN = re.compile(r"/(?:[^/\\]|\\.)*/(?:,(?:/(?:[^/\\]|\\.)*/|\d+|\$))?p")
_INT = re.compile(r"\d+")
_STDERR_REDIRECT = re.compile(r"\s+2>\s*(?:&1|/dev/null)")
_CD_PREFIX = re.compile(r"\Acd\s+(\S+)\s*(?:&&|;)\s*")

# grep: short options that take an argument, options that make the output not file lines.
_GREP_ARG_FLAGS = set("ABCefmdD")
_GREP_REJECT_FLAGS = set("rRlLcoqHZzbfuUT")
_GREP_OK_FLAGS = set("nABCeEFGPiIwxyvhas")
_GREP_REJECT_LONG = ("--recursive", "--files-with", "--count", "--only-matching",
                     "--with-filename", "--null", "--byte-offset", "--file")


def _split_pipeline(command: str) -> tuple[str | None, list[list[str]]] | None:
    """``(cd_dir, [argv per stage])`` of a single read pipeline, or None.

    Only ``[cd DIR && ]stage | stage ...`` is accepted: a command list runs several commands
    whose outputs mix, so it is not a file view.
    """
    command = _normalise(command).replace("\\\n", " ").strip()
    if not command or "\n" in command:
        return None
    cd_dir = None
    m = _CD_PREFIX.match(command)
    if m is not None:
        cd_dir, command = m.group(1), command[m.end():]
    command = _STDERR_REDIRECT.sub("", command)
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars="|&;<>()")
        lexer.whitespace_split = True
        lexer.commenters = ""
        tokens = list(lexer)
    except ValueError:
        return None
    stages: list[list[str]] = [[]]
    for tok in tokens:
        if tok == "|":
            stages.append([])
        elif tok and set(tok) <= set("|&;<>()"):
            return None  # lists, redirections, subshells: not a plain read
        else:
            stages[-1].append(tok)
    if any(not s for s in stages):
        return None
    return cd_dir, stages


def _join_path(cd_dir: str | None, path: str) -> str:
    if cd_dir and cd_dir.startswith("/") and not path.startswith("/"):
        return posixpath.normpath(posixpath.join(cd_dir, path))
    return posixpath.normpath(path)


def _sed_window(script: str) -> tuple[int | None, bool] | None:
    """``(start, known)`` of a ``sed -n`` print script: start line, or None if by pattern."""
    m = _SED_RANGE.fullmatch(script)
    if m is not None:
        return int(m.group(1)), True
    m = _SED_RELATIVE.fullmatch(script)
    if m is not None:
        return int(m.group(1)), True
    if _SED_PATTERN.fullmatch(script):
        return None, False
    return None


def _sed_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(script, files)`` of ``sed -n SCRIPT [FILE]`` / ``sed -n -e SCRIPT [FILE]``."""
    quiet, script, files = False, None, []
    it = iter(argv[1:])
    for arg in it:
        if arg in ("-n", "--quiet", "--silent"):
            quiet = True
        elif arg == "-e" and script is None:
            script = next(it, None)
        elif arg == "-ne" and script is None:
            quiet, script = True, next(it, None)
        elif arg.startswith("-"):
            return None
        elif script is None:
            script = arg
        else:
            files.append(arg)
    if not quiet or script is None:
        return None
    return script.strip().rstrip(";"), files


def _head_tail_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(count, files)`` of ``head``/``tail`` with ``-n N``, ``-nN``, ``-N``, ``--lines=N``."""
    count, files = "10", []
    it = iter(argv[1:])
    for arg in it:
        if arg == "-n":
            count = next(it, "")
        elif arg.startswith("--lines="):
            count = arg[len("--lines="):]
        elif arg.startswith("-n"):
            count = arg[2:]
        elif arg.startswith("-") and _INT.fullmatch(arg[1:]):
            count = arg[1:]
        elif arg.startswith("-"):
            return None
        else:
            files.append(arg)
    if not (_INT.fullmatch(count) or (argv[0] == "tail" and count.startswith("+")
                                      and _INT.fullmatch(count[1:]))):
        return None
    return count, files


def _grep_args(argv: list[str]) -> tuple[bool, bool, list[str]] | None:
    """``(numbered, has_context, files)`` of a grep whose output lines are file lines."""
    numbered = context = explicit_pattern = False
    operands: list[str] = []
    i, only_operands = 1, False
    while i < len(argv):
        arg = argv[i]
        i += 1
        if only_operands or not arg.startswith("-") or arg == "-":
            operands.append(arg)
        elif arg == "--":
            only_operands = True
        elif arg.startswith("--"):
            name = arg.split("=", 1)[0]
            if name.startswith(_GREP_REJECT_LONG):
                return None
            if name in ("--line-number",):
                numbered = True
            elif name in ("--context", "--after-context", "--before-context"):
                context = True
                i += "=" not in arg
            elif name in ("--regexp",):
                explicit_pattern = True
                i += "=" not in arg
        elif _INT.fullmatch(arg[1:]):
            context = True  # -5 means -C 5
        else:
            for j, flag in enumerate(arg[1:], start=1):
                if flag.isdigit():
                    context = True  # -n5 means -n -C 5
                    continue
                if flag in _GREP_REJECT_FLAGS or flag not in _GREP_OK_FLAGS:
                    return None
                numbered |= flag == "n"
                context |= flag in "ABC"
                if flag in _GREP_ARG_FLAGS:
                    explicit_pattern |= flag == "e"
                    if j == len(arg) - 1:
                        i += 1  # the argument is the next token
                    break
    files = operands if explicit_pattern else operands[1:]
    return numbered, context, files


def _source(argv: list[str], cd_dir: str | None) -> _Stream | None:
    """The stream produced by the first stage, when it reads exactly one file."""
    name = argv[0]
    if name == "cat":
        flags = [a for a in argv[1:] if a.startswith("-")]
        files = [a for a in argv[1:] if not a.startswith("-")]
        if len(files) != 1 or any(f not in ("-n", "--number") for f in flags):
            return None
        numbered = bool(flags)
        return _Stream(_join_path(cd_dir, files[0]), "cat-n" if numbered else "cat",
                       gutter="tab" if numbered else None)
    if name == "nl":
        flags = [a for a in argv[1:] if a.startswith("-")]
        files = [a for a in argv[1:] if not a.startswith("-") and a != "a"]
        if len(files) != 1:
            return None
        every = flags in (["-ba"], ["-b"]) and ("a" in argv or "-ba" in argv)
        if flags and not every:
            return None
        return _Stream(_join_path(cd_dir, files[0]), "nl", gutter="tab" if every else "nl")
    if name == "sed":
        parsed = _sed_args(argv)
        if parsed is None or len(parsed[1]) != 1:
            return None
        window = _sed_window(parsed[0])
        if window is None:
            return None
        start, _ = window
        return _Stream(_join_path(cd_dir, parsed[1][0]), "sed-n", start=start, full=False)
    if name in ("head", "tail"):
        parsed = _head_tail_args(argv)
        if parsed is None or len(parsed[1]) != 1:
            return None
        count, files = parsed
        path = _join_path(cd_dir, files[0])
        if name == "head":
            return _Stream(path, "head", full=False, limit=int(count))
        start = int(count[1:]) if count.startswith("+") else None
        return _Stream(path, "tail", start=start, full=start == 1)
    if name == "grep":
        parsed = _grep_args(argv)
        if parsed is None or len(parsed[2]) != 1:
            return None
        numbered, context, files = parsed
        return _Stream(_join_path(cd_dir, files[0]), "grep-n" if numbered else "grep",
                       gutter="grep" if numbered else None, start=None,
                       contiguous=False, full=False, isolated=not context)
    return None


def _filter(stream: _Stream, argv: list[str]) -> _Stream | None:
    """The stream after one more pipeline stage reading stdin, or None if not understood."""
    name = argv[0]
    if name == "sed":
        parsed = _sed_args(argv)
        if parsed is None or parsed[1]:
            return None
        window = _sed_window(parsed[0])
        if window is None and stream.gutter is not None and all(
                _SED_RANGE.fullmatch(part.strip()) for part in parsed[0].split(";")):
            # Several ranges (`nl -ba F | sed -n '1,5p;40,50p'`): the gutter numbers still
            # place every line, and a jump in them separates the runs.
            return replace(stream, start=None, contiguous=False, full=False, limit=None)
        if window is None:
            return None
        offset, known = window
        start = None
        if known and stream.contiguous and stream.start is not None and offset is not None:
            start = stream.start + offset - 1
        return replace(stream, start=start, full=False, limit=None)
    if name in ("head", "tail"):
        parsed = _head_tail_args(argv)
        if parsed is None or parsed[1]:
            return None
        count = parsed[0]
        if name == "head":
            limit = int(count) if stream.full else None
            return replace(stream, full=False, limit=limit)
        if count.startswith("+") and stream.contiguous and stream.start is not None:
            skip = int(count[1:]) - 1
            return replace(stream, start=stream.start + skip, full=stream.full and skip == 0,
                           limit=None)
        return replace(stream, start=None, full=False, limit=None)
    if name == "grep":
        parsed = _grep_args(argv)
        if parsed is None or parsed[2] or stream.outer_grep:
            return None
        numbered, context, _ = parsed
        isolated = stream.isolated or not context
        if numbered and stream.gutter is None:
            if not (stream.contiguous and stream.start == 1):
                return None
            return replace(stream, gutter="grep", start=None, contiguous=False, full=False,
                           limit=None, isolated=isolated)
        return replace(stream, outer_grep=numbered, start=None, contiguous=False, full=False,
                       limit=None, isolated=isolated)
    return None


def _read_pipeline(command: str) -> _Stream | None:
    split = _split_pipeline(command)
    if split is None:
        return None
    cd_dir, stages = split
    stream = _source(stages[0], cd_dir)
    for argv in stages[1:]:
        if stream is None:
            return None
        stream = _filter(stream, argv)
    return stream


_OUTER_GREP = re.compile(r"\d+[:-]")


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


def _stream_items(stream: _Stream, lines: list[str]) -> list[tuple[int | None, str] | None] | None:
    """``(number, text)`` per output line (None for a group break), or None if malformed."""
    if stream.outer_grep:
        stripped = []
        for ln in lines:
            m = _OUTER_GREP.match(ln)
            if ln != _GREP_SEPARATOR and m is None:
                return None
            stripped.append(ln if m is None else ln[m.end():])
        lines = stripped
    # Only a grep stage (which makes the stream non-contiguous) prints `--` group separators.
    grouped = not stream.contiguous
    items: list[tuple[int | None, str] | None] = []
    for ln in lines:
        if grouped and ln == _GREP_SEPARATOR:
            items.append(None)
        elif stream.gutter is None:
            items.append((None, ln))
            if stream.isolated:
                items.append(None)
        elif stream.gutter == "nl" and ln.strip() == "" and len(ln) <= len(_NL_BLANK):
            items.append((None, ""))  # plain nl leaves blank lines unnumbered
        else:
            row = _GUTTER_PARSERS["tab" if stream.gutter == "nl" else stream.gutter](ln)
            if row is None:
                return None
            items.append(row)
    return items


def _capture_stream(stream: _Stream, segments: list[_Segment]) -> list[CapturedFile]:
    """The captures of a read pipeline's output segments: one per contiguous run of lines."""
    truncated = len(segments) > 1 or any(s.cut_start or s.cut_end for s in segments)
    out: list[CapturedFile] = []
    for seg_index, seg in enumerate(segments):
        lines = seg.whole_lines()
        if not lines:
            continue
        if seg_index == 0 and not seg.cut_start and _READ_ERROR.match(lines[0]):
            return []
        items = _stream_items(stream, lines)
        if items is None:
            return []
        runs = _runs(items, numbers_are_lines=stream.gutter in ("tab", "grep"))
        complete = stream.full or (stream.limit is not None and len(lines) < stream.limit)
        whole = complete and not truncated and len(runs) == 1
        for num, texts in runs:
            first = num
            if first is None and stream.gutter is None and stream.contiguous and seg_index == 0:
                first = stream.start
            if stream.gutter == "nl":
                first = None  # plain nl numbers skip blank lines: not file lines
            out.append(CapturedFile(stream.path, _join_lines(texts), None if whole else first,
                                    not whole, stream.kind))
    return out


# --------------------------------------------------------------------------------------------
# Editor views (SWE-agent / OpenHands str_replace_editor, SWE-agent open, OpenHands open_file)
# --------------------------------------------------------------------------------------------

_VIEW_HEADER = re.compile(r"Here's the result of running `cat -n` on (\S.*?):\n")
_EDIT_HEADER = re.compile(
    r"The file (\S.*?) has been edited\. Here's the result of running `cat -n` on a snippet "
    r"of (\S.*?):\n")
_EDIT_FOOTER = "Review the changes and make sure they are as expected."
_ABBREVIATED = re.compile(r"\A<NOTE>This file is too large to display entirely\..*?</NOTE>\n",
                          re.S)
_ABBREVIATED_END = "<IMPORTANT><NOTE>The above file has been abbreviated."
_BARE_NUMBER = re.compile(r" *\d+")
_ELIDING = re.compile(r"\.\.\. eliding lines \d+-\d+ \.\.\.")
_FILE_HEADER = re.compile(r"\[File: (\S.*?) \((\d+) lines total\)\]\n")
_MORE_ABOVE = re.compile(r"\((?:\d+ more lines above|this is the beginning of the file)\)")
_MORE_BELOW = re.compile(r"\((\d+) more lines below\)")


def _editor_view_args(command: str | None) -> dict | None:
    if not command:
        return None
    for name, args in _tool_calls(command):
        if name == "str_replace_editor" and args.get("command") == "view":
            return args
    return None


def _editor_rows(lines: list[str], to_end: bool) -> list[tuple[int, str]] | None:
    """Rows of an editor view body.

    The editor numbers ``content.split("\\n")``, so a file ending in a newline shows one more,
    empty row; and the tool strips the output's trailing whitespace, which leaves that row as
    a bare number. A bare number on the last line is read as an empty row, and when the view
    runs to the end of the file (``to_end``) a final empty row is that artifact and dropped.
    """
    if lines and _BARE_NUMBER.fullmatch(lines[-1]):
        lines = lines[:-1] + [lines[-1] + "\t"]
    rows = _parse_rows(lines, "tab")
    if rows and to_end and rows[-1][1] == "":
        rows = rows[:-1]
    return rows


def _capture_editor_view(command: str | None, text: str) -> list[CapturedFile] | None:
    """Captures editor ``view``/edit-snippet outputs; None when ``text`` is not one."""
    edit = _EDIT_HEADER.match(text)
    if edit is not None:
        body = text[edit.end():].split(_EDIT_FOOTER, 1)[0]
        rows = _editor_rows(_split_lines(body), to_end=False)
        if not rows:
            return []
        return [CapturedFile(edit.group(2), _join_lines([t for _, t in rows]), rows[0][0], True,
                             "swe-edit")]
    view = _VIEW_HEADER.match(text)
    if view is not None:
        args = _editor_view_args(command) or {}
        body, clipped = text[view.end():], False
        if _SWE_CLIPPED in body:
            body, clipped = body.split(_SWE_CLIPPED, 1)[0], True
        lines = _split_lines(body)
        if clipped:
            lines = lines[:-1]
        view_range = args.get("view_range")
        to_end = not clipped and (view_range is None or (
            isinstance(view_range, list) and view_range[1:] == [-1]))
        rows = _editor_rows(lines, to_end)
        if not rows:
            return []
        whole = rows[0][0] == 1 and to_end
        return [CapturedFile(view.group(1), _join_lines([t for _, t in rows]),
                             None if whole else rows[0][0], not whole, "swe-view")]
    abbreviated = _ABBREVIATED.match(text)
    if abbreviated is not None:
        path = (_editor_view_args(command) or {}).get("path")
        body = text[abbreviated.end():].split(_ABBREVIATED_END, 1)[0]
        items: list[tuple[int | None, str] | None] = []
        for ln in _split_lines(body):
            row = _tab_row(ln, _SPACE_ROW)
            if row is None:
                return []
            # `   232 ... eliding lines 232-240 ...` stands for the hidden lines: a gap.
            items.append(None if _ELIDING.fullmatch(row[1]) else row)
        return [CapturedFile(path if isinstance(path, str) else None, _join_lines(texts), num,
                             True, "swe-view") for num, texts in _runs(items, True)]
    return None


def _capture_file_window(text: str) -> list[CapturedFile] | None:
    """SWE-agent 0.x ``open`` (``N:line``) and OpenHands ``open_file`` (``N|line``) windows."""
    header = _FILE_HEADER.match(text)
    if header is None:
        return None
    lines = _split_lines(text[header.end():])
    above = bool(lines) and bool(_MORE_ABOVE.fullmatch(lines[0]))
    if above:
        lines = lines[1:]
    gutter = "pipe" if lines and _PIPE_ROW.fullmatch(lines[0]) else "colon"
    rows, below = [], False
    for ln in lines:
        row = _parse_rows([ln], gutter)
        if row is None:
            below = bool(_MORE_BELOW.fullmatch(ln))
            break
        rows.append(row[0])
    if not rows:
        return []
    total = int(header.group(2))
    whole = rows[0][0] == 1 and not below and rows[-1][0] >= total
    kind = "openhands-view" if gutter == "pipe" else "swe-open"
    return [CapturedFile(header.group(1), _join_lines([t for _, t in rows]),
                         None if whole else rows[0][0], not whole, kind)]


# --------------------------------------------------------------------------------------------
# aider fenced file listings
# --------------------------------------------------------------------------------------------

# aider names the file on its own line, then fences the content with ``` (optionally with a
# language), ```` or one of its HTML-like fences when the content itself holds ```.
_AIDER_FENCES = {"```": "```", "````": "````", "<source>": "</source>", "<code>": "</code>",
                 "<pre>": "</pre>", "<codeblock>": "</codeblock>",
                 "<sourcecode>": "</sourcecode>"}
_PATH_LINE = re.compile(r"[\w.\-/\\]*[\w\-]\.[\w\-]+|[\w.\-]*/[\w.\-/]*[\w\-]")
_FENCE_OPEN = re.compile(r"(`{3,4})[\w+#.\-]*|(<(?:source|code|pre|codeblock|sourcecode)>)")
_SEARCH, _DIVIDER, _REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"


def _aider_listings(text: str) -> Iterator[tuple[str, list[str]]]:
    """``(path, body lines)`` of every ``path`` line followed by a fenced block.

    Every fenced block is paired with its closer, listing or not, so that the closer of an
    earlier block is never taken for an opener.
    """
    lines = _split_lines(text)
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.fullmatch(lines[i].strip())
        if m is None:
            i += 1
            continue
        closer = _AIDER_FENCES[m.group(1) or m.group(2)]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == closer), None)
        if end is None:
            return
        path = lines[i - 1].strip() if i > 0 else ""
        shell = m.group(1) is not None and m.group(0).lstrip("`") in _SHELL_LANGS[:-1]
        # A shell block after a file name is a command, not that file's listing.
        if _PATH_LINE.fullmatch(path) and not (shell and not path.endswith(".sh")):
            yield path.replace("\\", "/"), lines[i + 1:end]
        i = end + 1


def _capture_aider(text: str, *, include_new: bool) -> list[CapturedFile]:
    out = []
    for path, body in _aider_listings(text):
        if body and body[0].strip() == _SEARCH:
            # A SEARCH/REPLACE block is an edit, not a listing; with an empty SEARCH it
            # creates the file, so its REPLACE part is the whole new file.
            if include_new and len(body) >= 3 and body[1].strip() == _DIVIDER \
                    and body[-1].strip() == _REPLACE and _DIVIDER not in \
                    [b.strip() for b in body[2:-1]]:
                out.append(CapturedFile(path, _join_lines(body[2:-1]), None, False, "aider-new"))
            continue
        if any(b.strip() in (_SEARCH, _REPLACE) for b in body):
            continue
        out.append(CapturedFile(path, _join_lines(body), None, False, "aider-fence"))
    return [c for c in out if c.text]


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def capture_tool_output(command: str | None, output: str) -> list[CapturedFile]:
    """Recovers the file text an agent saw in one tool output.

    Args:
        command: the agent's previous assistant message (holding the command it ran: a fenced
            ``bash`` block, or ``<tool_call>{...}</tool_call>`` lines), or None if unknown.
            Shell reads are only recognised from a command; editor views, ``[File: ...]``
            windows and aider listings are recognised from the output alone.
        output: the tool message text, in any of the supported envelopes (mini-swe-agent
            ``<returncode>``/``<output>``, SWE-agent ``OBSERVATION:``, bare).

    Returns:
        The captured files and fragments, in output order; empty when the output is not a
        file view (test runs, listings, errors, failed commands).
    """
    if not isinstance(output, str):
        raise ValueError(f"output must be a str, got {type(output).__name__}")
    if command is not None and not isinstance(command, str):
        raise ValueError(f"command must be a str or None, got {type(command).__name__}")
    text = _normalise(output)
    if text.startswith(_OBSERVATION_PREFIX):
        text = text[len(_OBSERVATION_PREFIX):]
    for recognise in (lambda t: _capture_editor_view(command, t), _capture_file_window):
        captured = recognise(text)
        if captured is not None:
            return captured
    commands = _shell_commands(command) if command else []
    if len(commands) == 1:
        stream = _read_pipeline(commands[0])
        if stream is not None:
            segments = _unwrap_output(output)
            return [] if segments is None else _capture_stream(stream, segments)
    return _capture_aider(text, include_new=False)


_HEREDOC = re.compile(
    r"""(?:^|&&|;|\|\|)[ \t]*(?P<cmd>cat|tee(?:\s+-a)?)\b(?P<mid>[^\n]*?)<<(?P<dash>-?)[ \t]*"""
    r"""(?P<q>['"]?)(?P<tag>[A-Za-z_][\w]*)(?P=q)(?P<rest>[^\n]*)\n""", re.M)
_REDIRECT_TARGET = re.compile(r"(?<![\d&>])(>>?)[ \t]*(['\"]?)([^\s'\";&|<>]+)\2")


def _heredoc_writes(script: str) -> list[CapturedFile]:
    """Files written by ``cat > FILE <<EOF`` / ``cat <<EOF > FILE`` / ``tee FILE <<EOF``.

    The body is taken literally: an unquoted delimiter would let the shell expand ``$VAR``
    inside the body, which cannot be reproduced here and is rare in agent-written files.
    An append (``>>`` or ``tee -a``) is captured as a fragment of unknown position.
    """
    out = []
    pos = 0
    while True:
        m = _HEREDOC.search(script, pos)
        if m is None:
            return out
        body_start = m.end()
        tag = m.group("tag")
        indent = "\t*" if m.group("dash") else ""  # <<- strips leading TABs, terminator too
        end_re = re.compile("^" + indent + re.escape(tag) + "[ \t]*$", re.M)
        end = end_re.search(script, body_start)
        if end is None:
            return out
        pos = end.end()
        body = _split_lines(script[body_start:end.start()])
        if m.group("dash"):
            body = [ln.lstrip("\t") for ln in body]
        path, append = _heredoc_target(m)
        if path is not None:
            out.append(CapturedFile(posixpath.normpath(path), _join_lines(body), None,
                                    append, "heredoc"))


def _heredoc_target(m: re.Match[str]) -> tuple[str | None, bool]:
    around = m.group("mid") + " " + m.group("rest")
    if m.group("cmd").startswith("tee"):
        words = [w for w in m.group("mid").split() if not w.startswith("-")]
        if len(words) != 1 or re.search(r"[<>|&;]", m.group("mid")):
            return None, False
        return words[0].strip("'\""), "-a" in m.group("cmd")
    target = _REDIRECT_TARGET.search(around)
    if target is None:
        return None, False
    return target.group(3), target.group(1) == ">>"


def capture_agent_writes(message: str) -> list[CapturedFile]:
    """Files an agent writes itself in one assistant message.

    Recognised: bash heredocs (``cat > FILE << 'EOF'``, ``cat <<EOF > FILE``, ``tee FILE``,
    ``>>`` appends as fragments) inside fenced shell blocks or ``bash`` tool calls;
    ``str_replace_editor create`` tool calls with ``file_text`` (the JSON arguments are
    parsed); aider whole-file listings (a path line, then a fenced block) and aider
    SEARCH/REPLACE blocks with an empty SEARCH (new files).

    Returns:
        The written files in message order; empty when the message writes none.
    """
    if not isinstance(message, str):
        raise ValueError(f"message must be a str, got {type(message).__name__}")
    out: list[CapturedFile] = []
    for name, args in _tool_calls(message):
        if name == "str_replace_editor" and args.get("command") == "create" \
                and isinstance(args.get("path"), str) and isinstance(args.get("file_text"), str):
            out.append(CapturedFile(args["path"], _whole_lines(_normalise(args["file_text"])),
                                    None, False, "create"))
    for script in _shell_commands(message):
        out.extend(_heredoc_writes(script))
    if _TOOL_CALL_OPEN not in message:
        out.extend(_capture_aider(_normalise(message), include_new=True))
    return [c for c in out if c.text]
