"""Workspace capture: file text recovered from what coding agents read and write.

Agents see files through tool outputs (``cat``, ``nl -ba``, ``sed -n``, ``grep -n``, editor
``view`` commands) and write files through heredocs, editor ``create`` calls and whole-file
listings. This module turns those texts back into plain file text, so that the workspace tier
can hold each file once, gutter-free, and render it in the forms an agent emits.

The capture is three modules: :mod:`agspec_gpu.capture_text` (the record, gutters, output
envelopes), :mod:`agspec_gpu.capture_shell` (the agent's shell commands and read pipelines) and
this one (editor views, file windows, aider listings, files the agent writes, and the two entry
points). Everything here is pure text: no tokenizer, no tensors. Each `CapturedFile.text` is
meant to be tokenized as a whole by the caller.

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

import re
from typing import Callable, Iterator

from agspec_gpu.capture_shell import (_CD_PREFIX, _SHELL_LANGS, _TOOL_CALL_OPEN,
                                      _capture_stream, _cd_dir, _join_path, _read_pipeline,
                                      _shell_commands, _spelled, _tool_calls)
from agspec_gpu.capture_text import (_OBSERVATION_PREFIX, _PIPE_ROW, _SPACE_ROW, _clipped_at,
                                     CapturedFile, _join_lines, _normalise, _parse_rows, _runs,
                                     _split_lines, _tab_row, _unwrap_output, _whole_lines,
                                     strip_line_gutters)
from agspec_gpu.checks import check_text

__all__ = [
    "CapturedFile",
    "capture_tool_output",
    "capture_agent_writes",
    "strip_line_gutters",
]


# --------------------------------------------------------------------------------------------
# Editor views (SWE-agent / OpenHands str_replace_editor, SWE-agent open, OpenHands open_file)
# --------------------------------------------------------------------------------------------

_VIEW_HEADER = re.compile(r"Here's the result of running `cat -n` on (\S.*?):\n")
_EDIT_HEADER = re.compile(
    r"The file (\S.*?) has been edited\. Here's the result of running `cat -n` on a snippet "
    r"of (\S.*?):\n")
# (an insert's footer goes on: "... as expected (correct indentation, ...).")
_EDIT_FOOTER = "Review the changes and make sure they are as expected"
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


def _first_line_end(text: str) -> int:
    """Where a header on ``text``'s first line can end: after its newline, or 0 for a first
    line past :data:`_MAX_HEADER_LINE` characters (the headers' lazy path groups take time
    quadratic in the line they scan)."""
    end = text.find("\n", 0, _MAX_HEADER_LINE + 1)
    return 0 if end < 0 else end + 1


def _capture_editor_view(command: str | None, text: str) -> list[CapturedFile] | None:
    """Captures editor ``view``/edit-snippet outputs; None when ``text`` is not one."""
    head = _first_line_end(text)
    edit = _EDIT_HEADER.match(text, 0, head)
    if edit is not None:
        body = text[edit.end():].rsplit(_EDIT_FOOTER, 1)[0]  # (the tool's: the last)
        rows = _editor_rows(_split_lines(body), to_end=False)
        if not rows:
            return []
        # (group 2 is the path again, or "the edited file" after an insert)
        return [CapturedFile(edit.group(1), _join_lines([t for _, t in rows]), rows[0][0], True,
                             "swe-edit")]
    view = _VIEW_HEADER.match(text, 0, head)
    if view is not None:
        args = _editor_view_args(command) or {}
        body, clipped = text[view.end():], False
        clip = _clipped_at(body)
        if clip >= 0:
            body, clipped = body[:clip], True
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
        body = text[abbreviated.end():].rsplit(_ABBREVIATED_END, 1)[0]
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
    header = _FILE_HEADER.match(text, 0, _first_line_end(text))
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
            # creates the file, or appends to it when it exists (aider's rule): its REPLACE
            # part is the file's text at an unknown position.
            if include_new and len(body) >= 3 and body[1].strip() == _DIVIDER \
                    and body[-1].strip() == _REPLACE and _DIVIDER not in \
                    [b.strip() for b in body[2:-1]]:
                out.append(CapturedFile(path, _join_lines(body[2:-1]), None, True, "aider-new"))
            continue
        if any(b.strip() in (_SEARCH, _REPLACE) for b in body):
            continue
        out.append(CapturedFile(path, _join_lines(body), None, False, "aider-fence"))
    return [c for c in out if c.text]


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------

# What parsing untrusted text may raise past the recognisers' own checks: nesting past the
# recursion limit (a tool call's JSON, an agent's sed regex), a number past int()'s digit
# limit or a repeat count past the regex engine's, a pattern that does not compile.
_PARSE_ERRORS = (RecursionError, OverflowError, ValueError, re.error)


def _storable(capture: Callable[[], list[CapturedFile]]) -> list[CapturedFile]:
    """``capture()``'s files that the workspace tier takes (text and path with a UTF-8
    form: a JSON escape decodes to a lone surrogate; ``first_line`` >= 1: a view numbered
    from 0); nothing when it raises one of :data:`_PARSE_ERRORS`: a capture never fails
    the append or open_session it serves."""
    try:
        files = capture()
    except _PARSE_ERRORS:
        return []
    return [f for f in files if (f.first_line is None or f.first_line >= 1)
            and _has_utf8(f.text) and (f.path is None or _has_utf8(f.path))]


def _has_utf8(text: str) -> bool:
    """Whether the workspace tier's :func:`~agspec_gpu.checks.check_text` takes ``text``."""
    try:
        check_text(text, "text")
    except ValueError:
        return False
    return True


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
    return _storable(lambda: _capture_tool_output(command, output))


def _capture_tool_output(command: str | None, output: str) -> list[CapturedFile]:
    text = _normalise(output)
    if text.startswith(_OBSERVATION_PREFIX):
        text = text[len(_OBSERVATION_PREFIX):]
    for recognise in (lambda t: _capture_editor_view(command, t), _capture_file_window):
        captured = recognise(text)
        if captured is not None:
            return captured
    commands = _shell_commands(command) if command else []
    # (with several tool calls the output may be another call's: an editor's, say)
    if len(commands) == 1 and len(_tool_calls(command)) <= 1:
        stream = _read_pipeline(commands[0])
        if stream is not None:
            segments = _unwrap_output(output)
            return [] if segments is None else _capture_stream(stream, segments)
    return _capture_aider(text, include_new=False)


# a simple command's heredoc header: ``cat`` or ``tee`` at its start, its first ``<<`` and the
# delimiter (a word goes on to a blank or an operator: <<END-X is not END's)
_HEREDOC = re.compile(
    r"""[ \t]*(?P<cmd>cat|tee(?:[ \t]+-a)?)\b(?P<mid>[^\n]*?)<<(?P<dash>-?)[ \t]*"""
    r"""(?P<q>['"]?)(?P<tag>[A-Za-z_][\w]*)(?P=q)(?=[ \t&<>)]|$)(?P<rest>[^\n]*)""")
# where a simple command ends on a header's line (``&`` of ``2>&1`` or ``&>`` redirects): a
# redirect past it is another command's (``cat <<EOF | python3 > out.txt``)
_COMMAND_END = re.compile(r"\|\|?|&&|;|(?<![<>])&(?!>)")
_REDIRECT_TARGET = re.compile(r"(?<![\d&>])(>>?)[ \t]*(['\"]?)([^\s'\";&|<>]+)\2")
# longer lines hold no header we read (heredocs, editor views, file windows: the editors'
# header searches are quadratic in a line)
_MAX_HEADER_LINE = 4096
# an unquoted heredoc body: bash removes these escapes and expands the rest
_BODY_ESCAPE = re.compile(r"\\([$`\\\n])|(\$[A-Za-z0-9_{(\[?$#@*!-]|`)")


def _heredoc_header(script: str, pos: int) -> tuple[re.Match[str], int] | None:
    """The first heredoc header of ``script`` at or after ``pos`` (a :data:`_HEREDOC` match
    of one simple command of its line) and where its body starts, or None. Only the lines
    holding ``<<`` are split into commands, and each command is matched once from its
    start: time linear in the script."""
    while True:
        at = script.find("<<", pos)
        if at < 0:
            return None
        line_start = script.rfind("\n", 0, at) + 1
        line_end = script.find("\n", at)
        if line_end < 0:
            return None
        if line_end - line_start <= _MAX_HEADER_LINE:
            for command in _COMMAND_END.split(script[max(line_start, pos):line_end]):
                m = _HEREDOC.match(command) if "<<" in command else None
                if m is not None:
                    return m, line_end + 1
        pos = line_end + 1


def _expand_body(body: str) -> str | None:
    """An unquoted heredoc's body as bash writes it (``\\$``, ``\\` ``, ``\\\\`` unescaped,
    ``\\<newline>`` joined), or None when it expands something (``$name``, ``${``, ``$(``,
    a backquote...): its text depends on what ran."""
    out, pos = [], 0
    for m in _BODY_ESCAPE.finditer(body):
        if m.group(2) is not None:
            return None
        out += [body[pos:m.start()], "" if m.group(1) == "\n" else m.group(1)]
        pos = m.end()
    return "".join(out) + body[pos:]


def _heredoc_writes(script: str, cd_dir: str | None = None) -> list[CapturedFile]:
    """Files written by ``cat > FILE <<EOF`` / ``cat <<EOF > FILE`` / ``tee FILE <<EOF``
    (after a leading ``cd cd_dir``).

    A quoted delimiter (``<<'EOF'``) keeps the body literal; an unquoted one lets bash
    unescape ``\\$``, ``\\` ``, ``\\\\`` and line continuations, done here too, and expand
    ``$VAR``, ``$(...)`` and backquotes, which cannot be reproduced: such a body is not
    captured. The body ends at a line that is exactly the delimiter (after leading tabs
    for ``<<-``). An append (``>>`` or ``tee -a``) is captured as a fragment of unknown
    position.
    """
    out = []
    header = _heredoc_header(script, 0)
    while header is not None:
        m, body_start = header
        tag = m.group("tag")
        indent = "\t*" if m.group("dash") else ""  # <<- strips leading TABs, terminator too
        end = re.compile("^" + indent + re.escape(tag) + "$", re.M).search(script, body_start)
        if end is None:
            return out
        body = _split_lines(script[body_start:end.start()])
        if m.group("dash"):
            body = [ln.lstrip("\t") for ln in body]
        text = _join_lines(body)
        if not m.group("q"):
            text = _expand_body(text)
        path, append = _heredoc_target(m)
        if path is not None and _spelled(path) and text is not None:
            out.append(CapturedFile(_join_path(cd_dir, path), text, None, append, "heredoc"))
        header = _heredoc_header(script, end.end())
    return out


def _heredoc_target(m: re.Match[str]) -> tuple[str | None, bool]:
    """``(path, append)`` of the file a :data:`_HEREDOC` header's ``cat`` or ``tee`` writes,
    or ``(None, False)`` when it writes none (its output goes to the terminal or down a
    pipe)."""
    around = m.group("mid") + " " + m.group("rest")
    if m.group("cmd").startswith("tee"):
        words = [w for w in m.group("mid").split() if not w.startswith("-")]
        if len(words) != 1 or re.search(r"[<>|&;]", m.group("mid")):
            return None, False
        flags = set(m.group("cmd").split()[1:] + m.group("mid").split())
        return words[0].strip("'\""), bool(flags & {"-a", "--append"})
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
    return _storable(lambda: _capture_agent_writes(message))


def _capture_agent_writes(message: str) -> list[CapturedFile]:
    out: list[CapturedFile] = []
    for name, args in _tool_calls(message):
        if name == "str_replace_editor" and args.get("command") == "create" \
                and isinstance(args.get("path"), str) and isinstance(args.get("file_text"), str):
            out.append(CapturedFile(args["path"], _whole_lines(_normalise(args["file_text"])),
                                    None, False, "create"))
    for script in _shell_commands(message):
        cd = _CD_PREFIX.match(script.lstrip())
        out.extend(_heredoc_writes(script, None if cd is None else _cd_dir(cd)))
    if _TOOL_CALL_OPEN not in message:
        out.extend(_capture_aider(_normalise(message), include_new=True))
    return [c for c in out if c.text]
