"""Workspace capture from shell commands: the commands in an assistant message (``bash``
tool calls, fenced blocks) and the read pipelines among them (``cat``, ``nl``, ``sed -n``,
``head``/``tail``, ``grep``, piped into one another), whose output lines map back to file
lines. Conventions: :mod:`agspec_gpu.capture`."""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, replace

from agspec_gpu.capture_text import (_GREP_SEPARATOR, _GUTTER_PARSERS, _NL_BLANK, _READ_ERROR,
                                     CapturedFile, _join_lines, _normalise, _runs, _Segment)


# --------------------------------------------------------------------------------------------
# Extracting the agent's command
# --------------------------------------------------------------------------------------------

_FENCE_LINE = re.compile(r"```([\w+#.\-]*)[ \t]*")
_SHELL_LANGS = ("bash", "sh", "shell", "console", "")
_TOOL_CALL_OPEN = "<tool_call>"


_MAX_TOOL_CALLS = 64  # tool calls read per message (agents make a few)


def _tool_calls(message: str) -> list[tuple[str, dict]]:
    """``(name, arguments)`` of every ``<tool_call>{"name":..,"arguments":{..}}</tool_call>``."""
    calls = []
    decoder = json.JSONDecoder()
    pos = message.find(_TOOL_CALL_OPEN)
    # (each call that does not parse costs a count over the message up to it, in its
    # JSONDecodeError: the first _MAX_TOOL_CALLS openers are read, so a message of many
    # costs linear time, not quadratic)
    for _ in range(_MAX_TOOL_CALLS):
        if pos < 0:
            break
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
        isolated: each output line is a separate hit (a grep without context lines, a
            ``sed -n '/A/p'``), so without line numbers two lines are never known to be
            adjacent.
        block_end: a ``sed -n '/A/,/B/p'`` range's end pattern ``B`` (a Python regex): the
            range prints a block from each line matching ``A`` to the next matching ``B``,
            so a block ends after a line (not its first) that ``B`` matches, and the next
            line opens another block of the file, not adjacent to it.
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
    block_end: re.Pattern[str] | None = None


_SED_RANGE = re.compile(r"(\d+)(?:,(\d+|\$))?p")
_SED_RELATIVE = re.compile(r"(\d+),\+(\d+)p")
_SED_PATTERN = re.compile(r"/((?:[^/\\]|\\.)*)/(?:,(?:/((?:[^/\\]|\\.)*)/|(\d+)|(\$)))?p")
_INT = re.compile(r"\d+")
# (from a whitespace run's start only: each start inside a long run scanned it again)
_STDERR_REDIRECT = re.compile(r"(?<!\s)\s+2>\s*(?:&1|/dev/null)")
# (its one word may be quoted: ``cd '/repo'``, ``cd "my dir"``; see :func:`_cd_dir`)
_CD_PREFIX = re.compile(r"""\Acd[ \t]+((?:'[^'\n]*'|"[^"\n]*"|[^\s;&|'"])+)[ \t]*(?:&&|;)\s*""")
# a shell glob or brace expansion in an operand: it may name several files (or none)
_GLOB = re.compile(r"[*?\[]")
_BRACE_COMMA = re.compile(r"\{[^{}]*,")  # (each scan stops at the next brace: linear)


def _names_many(path: str) -> bool:
    """Whether ``path`` holds a glob or a brace expansion (``{a,b}``, ``{a,{b}}``): it may
    name several files, or none."""
    if _GLOB.search(path):
        return True
    m = _BRACE_COMMA.search(path)
    return m is not None and "}" in path[m.end():]

# grep: short options that take an argument, options that make the output not file lines.
_GREP_ARG_FLAGS = set("ABCefmdD")
_GREP_REJECT_FLAGS = set("rRlLcoqHZzbfuUT")
_GREP_OK_FLAGS = set("nABCeEFGPiIwxyvhas")
_GREP_REJECT_LONG = ("--recursive", "--files-with", "--count", "--only-matching",
                     "--with-filename", "--null", "--byte-offset", "--file", "--color",
                     "--colour")


# a read command longer than this is parsed as no read: shlex builds each word a character
# at a time (quadratic in a long word: a real 706 KB command took 6.6 s)
_MAX_READ_COMMAND = 16384


def _split_pipeline(command: str) -> tuple[str | None, list[list[str]]] | None:
    """``(cd_dir, [argv per stage])`` of a single read pipeline, or None.

    Only ``[cd DIR && ]stage | stage ...`` is accepted: a command list runs several commands
    whose outputs mix, so it is not a file view.
    """
    command = _normalise(command).replace("\\\n", " ").strip()
    if not command or "\n" in command or len(command) > _MAX_READ_COMMAND:
        return None
    cd_dir = None
    m = _CD_PREFIX.match(command)
    if m is not None:
        cd_dir, command = _cd_dir(m), command[m.end():]
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


def _cd_dir(m: re.Match[str]) -> str:
    """The directory a :data:`_CD_PREFIX` match goes to, unquoted (``'/repo'`` is
    ``/repo``); ``$`` for one the command does not spell (``~``, ``-``, a ``$VAR`` or a
    backquote in it)."""
    try:
        words = shlex.split(m.group(1))
    except ValueError:
        return "$"
    if len(words) != 1 or not words[0] or words[0][0] in "~-" or not _spelled(words[0]):
        return "$"
    return words[0]


def _spelled(path: str) -> bool:
    """Whether the shell reads ``path`` as written: no ``$`` expansion or backquote (an
    operand ``$F`` names whatever F holds; captured under ``$F``, two files would share
    one name)."""
    return "$" not in path and "`" not in path


def _join_path(cd_dir: str | None, path: str) -> str:
    """``path`` as the command named it after a leading ``cd cd_dir`` (None: no ``cd``;
    ``$``: a directory the command does not spell, so a relative path keeps its name)."""
    if cd_dir and cd_dir != "$" and not path.startswith("/"):
        return posixpath.normpath(posixpath.join(cd_dir, path))
    return posixpath.normpath(path)


def _sed_window(script: str) -> tuple[int | None, bool] | None:
    """``(start, known)`` of a ``sed -n`` print script by line numbers; ``(None, False)``
    for a pattern script (:func:`_sed_pattern` says what its output is)."""
    m = _SED_RANGE.fullmatch(script)
    if m is not None:
        return int(m.group(1)), True
    m = _SED_RELATIVE.fullmatch(script)
    if m is not None:
        return int(m.group(1)), True
    if _SED_PATTERN.fullmatch(script):
        return None, False
    return None


def _sed_pattern(stream: _Stream, script: str) -> _Stream | None:
    """``stream`` after ``sed -n SCRIPT`` with a pattern address (None: not understood).

    ``/A/p`` prints each matching line: separate hits. ``/A/,/B/p`` prints a block from
    each line matching ``A`` to the next line matching ``B``: blocks end where ``B``
    matches (:attr:`_Stream.block_end`), so ``B`` must translate to a Python regex.
    ``/A/,$p`` prints one block, to the end. ``/A/,Np``'s blocks depend on line numbers
    the output does not show."""
    m = _SED_PATTERN.fullmatch(script)
    _, end, end_line, to_last = m.groups()
    if end_line is not None:
        return None
    if end is None and not to_last:
        return replace(stream, start=None, contiguous=False, full=False, limit=None,
                       isolated=True)
    block_end = None if to_last else _python_regex(end)
    if end is not None and (not end or block_end is None):  # (// is the last regex used)
        return None
    if stream.isolated or not stream.contiguous or stream.block_end is not None:
        return None  # a range over hits (or blocks) would join lines that lie apart
    return replace(stream, start=None, full=False, limit=None, block_end=block_end)


_BRE_CLASSES = {"[:alpha:]": "a-zA-Z", "[:digit:]": "0-9", "[:alnum:]": "a-zA-Z0-9",
                "[:upper:]": "A-Z", "[:lower:]": "a-z", "[:space:]": " \\t\\n\\r\\f\\v",
                "[:blank:]": " \\t", "[:punct:]": "!-/:-@\\[-`{-~"}


_MAX_SEARCHED_LINE = 4096  # a range's end pattern is searched on lines up to this long


def _python_regex(bre: str) -> re.Pattern[str] | None:
    """GNU sed's basic regex ``bre`` as a Python pattern, or None where unsure: ``\\(``,
    ``\\)``, ``\\{``, ``\\}``, ``\\|``, ``\\+``, ``\\?`` are operators and their plain
    forms literals; bracket expressions with only the common POSIX classes. At most one
    repetition (``*``, ``\\+``, ``\\?``, ``\\{``): Python's backtracking search of two
    takes time cubic in a line (``a*a*b``: 8 s on 4,000 characters), of a repeated group
    exponential (``\\(a\\+\\)\\+b``: seconds on 129), and the pattern is the agent's, the
    line the tool's; one takes at most quadratic time in a line of up to
    :data:`_MAX_SEARCHED_LINE` characters."""
    out, i = [], 0
    repeats = 0
    while i < len(bre):
        ch = bre[i]
        if ch == "\\":
            nxt = bre[i + 1:i + 2]
            if nxt and nxt in "(){}|+?":
                repeats += nxt in "{+?"
                out.append(nxt)
            elif nxt and nxt in ".*[]^$/\\":
                out.append("\\" + nxt)
            elif nxt and nxt in "wWsSbBnt":
                out.append("\\" + nxt)
            else:
                return None
            i += 2
        elif ch == "[":
            j = i + 1 + (bre[i + 1:i + 2] == "^")
            j += bre[j:j + 1] == "]"  # a leading ] is a member
            body = []
            while j < len(bre) and bre[j] != "]":
                cls = next((c for c in _BRE_CLASSES if bre.startswith(c, j)), None)
                if cls is not None:
                    body.append(_BRE_CLASSES[cls])
                    j += len(cls)
                elif bre.startswith("[:", j) or bre.startswith("[=", j) or \
                        bre.startswith("[.", j):
                    return None
                else:
                    body.append("\\" + bre[j] if bre[j] in "\\[" else bre[j])
                    j += 1
            if j >= len(bre):
                return None
            negate = "^" if bre[i + 1:i + 2] == "^" else ""
            lead = "\\]" if bre[i + 1 + len(negate):i + 2 + len(negate)] == "]" else ""
            out.append(f"[{negate}{lead}{''.join(body)}]")
            i = j + 1
        elif ch == "*" and (not out or out[-1] in ("^", "(", "|")):
            out.append("\\*")  # a leading * is a literal in a BRE
            i += 1
        elif ch == "^":  # an anchor only where a match can begin
            out.append("^" if not out or out[-1] in ("(", "|") else "\\^")
            i += 1
        elif ch == "$":  # and only where it can end
            out.append("$" if i + 1 == len(bre) or bre.startswith(("\\)", "\\|"), i + 1)
                       else "\\$")
            i += 1
        elif ch in "(){}|+?":
            out.append("\\" + ch)
            i += 1
        else:
            repeats += ch == "*"
            out.append(ch)
            i += 1
    if repeats > 1:
        return None
    try:
        return re.compile("".join(out))
    except re.error:
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
    """The stream produced by the first stage, when it reads exactly one file operand (a
    glob among them: :func:`_read_pipeline` refuses it)."""
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
        stream = _Stream(_join_path(cd_dir, parsed[1][0]), "sed-n", start=window[0], full=False)
        return stream if window[1] else _sed_pattern(stream, parsed[0])
    if name in ("head", "tail"):
        parsed = _head_tail_args(argv)
        if parsed is None or len(parsed[1]) != 1:
            return None
        count, files = parsed
        path = _join_path(cd_dir, files[0])
        if name == "head":
            return _Stream(path, "head", full=False, limit=int(count))
        start = max(int(count[1:]), 1) if count.startswith("+") else None  # +0: from line 1
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
        if window is None and stream.gutter in ("tab", "grep") and all(
                _SED_RANGE.fullmatch(part.strip()) for part in parsed[0].split(";")):
            # Several ranges (`nl -ba F | sed -n '1,5p;40,50p'`): the gutter numbers still
            # place every line, and a jump in them separates the runs. (Plain nl's skip
            # blank lines: two ranges' lines may be numbered n and n + 1 yet lie apart.)
            return replace(stream, start=None, contiguous=False, full=False, limit=None)
        if window is None:
            return None
        offset, known = window
        if not known:
            return _sed_pattern(stream, parsed[0])
        if stream.block_end is not None:  # a window of a range's blocks: its first line
            return None                   # may be inside one
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
        if stream.block_end is not None:  # the last lines of a range's blocks: the first
            return None                   # may be inside one
        if count.startswith("+") and stream.contiguous and stream.start is not None:
            skip = max(int(count[1:]), 1) - 1
            return replace(stream, start=stream.start + skip, full=stream.full and skip == 0,
                           limit=None)
        return replace(stream, start=None, full=False, limit=None)
    if name == "grep":
        parsed = _grep_args(argv)
        if parsed is None or parsed[2] or stream.outer_grep:
            return None
        numbered, context, _ = parsed
        if stream.block_end is not None:  # hits among a range's blocks: each stands alone
            if context:  # (context lines and `--` would cross the blocks' ends unseen)
                return None
            stream = replace(stream, block_end=None)
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
    if stream is not None and (_names_many(stream.path) or not _spelled(stream.path)):
        return None
    for argv in stages[1:]:
        if stream is None:
            return None
        stream = _filter(stream, argv)
    return stream


_OUTER_GREP = re.compile(r"\d+[:-]")


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
    block_start = True  # (block_end: the next line opens a block)
    for ln in lines:
        if stream.block_end is not None and stream.gutter is None:
            items.append((None, ln))
            if len(ln) > _MAX_SEARCHED_LINE:  # (the search's time grows with it)
                return None
            if not block_start and stream.block_end.search(ln):
                items.append(None)  # the range ended: the next line is another block's
                block_start = True
            else:
                block_start = False
            continue
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
            if stream.isolated and stream.gutter == "nl":
                items.append(None)  # hits numbered n and n + 1 may have blank lines between
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
