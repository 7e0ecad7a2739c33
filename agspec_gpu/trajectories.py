"""Coding-agent sessions, loaded from the trajectory formats agents write.

Every format becomes the same :class:`Session`: an ordered tuple of :class:`Message` with
roles ``system`` / ``user`` / ``assistant`` / ``tool``, whose ``content`` is exactly the text
a drafter sees (context) or must predict (assistant turns). The conventions follow
``data/trajectories/README.md`` so that a raw trajectory and its normalized record load to
the same messages:

- structured tool calls are rendered into the assistant text as ``TEXT`` + ``"\\n\\n"`` (only
  when ``TEXT`` is non-empty) + one line per call,
  ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``, with ``ARGS`` verbatim;
- in agent logs that send observations back as ``user`` messages (SWE-agent, mini-swe-agent),
  every ``user`` message after the first (the task) becomes ``tool``;
- aider markdown logs are split into sessions at ``# aider chat started at``.

Supported inputs (:func:`load_sessions` picks by file name, then by content):

========================================  ====================================================
``*.jsonl`` / ``*.jsonl.gz``               one session per line: the normalized dataset format
                                           (has ``agent``; content kept unchanged) or OpenAI
                                           chat lines ``{"messages": [...]}``
``*.traj`` (``.gz``)                       SWE-agent JSON, its ``history`` list
``*.traj.json`` / ``*.json`` (``.gz``)     mini-swe-agent JSON (``messages``), or any JSON
                                           object with ``history`` / ``messages``
``*.md`` (``.aider.chat.history.md``)      aider chat history
========================================  ====================================================
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Sequence

from agspec_gpu.checks import check_text, is_int

ROLES = frozenset({"system", "user", "assistant", "tool"})
# Roles of other chat APIs that mean the same thing as one of ours.
_ROLE_ALIASES = {"developer": "system", "function": "tool"}
# The dataset keeps an aider session only when its assistant text totals this many chars.
AIDER_MIN_ASSISTANT_CHARS = 200
_AIDER_HEADER = re.compile(r"^# aider chat started at", re.MULTILINE)
_AIDER_MODEL = re.compile(r"^(?:Main model|Model): (\S+) with (\S+) edit format")
# File names a directory scan picks up; an explicit file may be any .json / .md too.
_DIR_SUFFIXES = (".jsonl", ".jsonl.gz", ".traj", ".traj.gz", ".traj.json", ".traj.json.gz",
                 "aider.chat.history.md")


class TrajectoryError(ValueError):
    """Malformed trajectory input; the message starts with ``FILE[:LINE]:``."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a session.

    Attributes:
        role: ``"system"``, ``"user"``, ``"assistant"`` or ``"tool"``.
        content: the exact text; for assistant messages with structured tool calls, the
            rendered text (see the module docstring).
    """

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message.role must be one of {sorted(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"Message.content must be str, got {type(self.content).__name__}")


@dataclass(frozen=True, slots=True)
class Session:
    """One agent session: the full ordered message history.

    Attributes:
        id: unique name, e.g. ``"swe-agent/claude-sonnet-4-20250514/sympy__sympy-24539"``.
        agent: agent format (``"mini-swe-agent"``, ``"swe-agent"``, ``"aider"``, ...).
        model: model name as the log states it (``""`` when unknown).
        source: where it came from (path, or ``owner/repo:path@commit``).
        messages: the messages, in order.
        meta: small extras (instance id, exit status, ...); not hashed.
    """

    id: str
    agent: str
    model: str
    source: str
    messages: tuple[Message, ...]
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def task_id(self) -> str:
        """The task the session works on: ``meta["instance_id"]`` (a SWE-bench instance,
        which several agents' sessions share), else the session's own id."""
        return str(self.meta.get("instance_id") or self.id)


def render_tool_calls(text: str, calls: Sequence[tuple[str, str]]) -> str:
    """Renders an assistant turn with structured tool calls as the dataset does.

    Args:
        text: the model's plain text (may be empty).
        calls: ``(name, arguments)`` pairs; ``arguments`` is the raw JSON string.

    Returns:
        ``text`` if there are no calls, else ``text + "\\n\\n"`` (omitted for empty text)
        followed by one ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` line per
        call, joined by ``"\\n"``.
    """
    lines = [f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {args}}}</tool_call>'
             for name, args in calls]
    if not lines:
        return text
    return (text + "\n\n" if text else "") + "\n".join(lines)


def load_sessions(path: str | Path, *, limit: int | None = None) -> list[Session]:
    """Loads the sessions of one trajectory file, or of every supported file in a directory.

    Args:
        path: a file (format detected from its name, then its content) or a directory
            (searched recursively; files sorted by path).
        limit: return at most this many sessions; JSONL files are read only as far as needed.

    Raises:
        TrajectoryError: unreadable, malformed or unsupported input; the message names the
            file and, for line-based formats, the line.
    """
    _check_limit(limit)
    return list(itertools.islice(_iter_path(_path(path, "path")), limit))


def load_paths(paths: Iterable[str | Path] | str | Path, *,
               limit: int | None = None) -> list[Session]:
    """Loads several files/directories in order (see :func:`load_sessions`)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    _check_limit(limit)
    paths = [_path(p, f"paths[{i}]") for i, p in enumerate(paths)]
    chained = itertools.chain.from_iterable(_iter_path(p) for p in paths)
    return list(itertools.islice(chained, limit))


def _check_limit(limit: Any) -> None:
    if limit is not None and (not is_int(limit) or limit < 0):
        raise ValueError(f"limit: expected an int >= 0 or None, got {limit!r}")


def _path(path: Any, name: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name}: expected a file or directory path, got "
                         f"{type(path).__name__}")
    return Path(path)


# ----------------------------------------------------------------------------- dispatch


def trajectory_files(directory: Path) -> list[Path]:
    """The trajectory files a directory holds (recursively, sorted by path): what
    :func:`load_sessions` reads of it."""
    return sorted(p for p in Path(directory).rglob("*")
                  if p.is_file() and p.name.lower().endswith(_DIR_SUFFIXES))


def _iter_path(path: Path) -> Iterator[Session]:
    if path.is_dir():
        files = trajectory_files(path)
        if not files:
            raise TrajectoryError(f"{path}: no trajectory files (*{', *'.join(_DIR_SUFFIXES)})")
        for f in files:
            yield from _iter_file(f)
    elif path.is_file():
        yield from _iter_file(path)
    else:
        raise TrajectoryError(f"{path}: no such file or directory")


def _iter_file(path: Path) -> Iterator[Session]:
    name = path.name.lower()
    base = name[:-3] if name.endswith(".gz") else name
    if base.endswith(".jsonl"):
        yield from _iter_jsonl(path)
    elif base.endswith(".md"):
        yield from _aider_sessions(path, _read_text(path))
    elif base.endswith((".traj", ".json")):
        yield from _json_sessions(path, base)
    else:
        raise TrajectoryError(
            f"{path}: unsupported trajectory file (expected .jsonl[.gz], .traj, .traj.json, "
            f".json or .aider.chat.history.md)")


def _open_binary(path: Path) -> BinaryIO:
    try:
        return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")
    except OSError as e:
        raise TrajectoryError(f"{path}: cannot open ({e})") from None


def _read_text(path: Path) -> str:
    try:
        with _open_binary(path) as fh:
            data = fh.read()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise TrajectoryError(f"{path}: cannot read ({e})") from None
    try:
        return data.decode("utf-8-sig")  # (a byte-order mark, as an editor on Windows saves)
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TrajectoryError(f"{path}:{line}: invalid UTF-8 ({e.reason})") from None


# ----------------------------------------------------------------------------- messages


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, None, or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type", "text") != "text":
                continue  # image and other non-text parts carry no text to predict
            else:
                raise TrajectoryError(f"{where}: content part without 'text': {part!r:.80}")
        return "".join(parts)
    raise TrajectoryError(f"{where}: 'content' must be a string or a list of text parts, "
                          f"got {type(content).__name__}")


def _utf8(text: str, where: str) -> str:
    """``text``, which UTF-8 can encode (JSON's ``"\\ud800"`` decodes to a lone surrogate,
    which no tokenizer reads)."""
    try:
        return check_text(text, where)
    except ValueError as e:
        raise TrajectoryError(str(e)) from None


def _tool_call(call: Any, where: str) -> tuple[str, str]:
    """``(name, arguments)`` of an OpenAI (``{"function": {...}}``) or flat tool call."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise TrajectoryError(f"{where}: tool call without a 'name': {call!r:.80}")
    args = fn.get("arguments", "")
    # Arguments are normally the raw JSON string from the API; re-serialize only if a
    # writer already decoded them.
    return fn["name"], args if isinstance(args, str) else json.dumps(args)


def _convert_messages(raw: Any, where: str, *, relabel_observations: bool) -> tuple[Message, ...]:
    """Converts a list of chat-API messages.

    Args:
        raw: the list of message dicts (``role``, ``content``, optional ``tool_calls``).
        where: ``FILE:LINE`` or ``FILE: key`` prefix for errors.
        relabel_observations: every ``user`` message after the first becomes ``tool``.
    """
    if not isinstance(raw, list):
        raise TrajectoryError(f"{where}: 'messages' must be a list, got {type(raw).__name__}")
    out: list[Message] = []
    seen_user = False
    for i, m in enumerate(raw):
        at = f"{where}: message {i}"
        if not isinstance(m, dict):
            raise TrajectoryError(f"{at}: must be an object, got {type(m).__name__}")
        if "role" not in m:
            raise TrajectoryError(f"{at}: missing key 'role'")
        if not isinstance(m["role"], str):
            raise TrajectoryError(f"{at}: 'role' must be a string, got {m['role']!r}")
        role = _ROLE_ALIASES.get(m["role"], m["role"])
        if role not in ROLES:
            raise TrajectoryError(f"{at}: unknown role {m['role']!r}")
        calls = m.get("tool_calls") or []
        if "content" not in m and not calls:
            raise TrajectoryError(f"{at}: missing key 'content'")
        if not isinstance(calls, list):
            raise TrajectoryError(f"{at}: 'tool_calls' must be a list")
        content = _text(m.get("content"), at)
        if calls:
            content = render_tool_calls(content, [_tool_call(c, at) for c in calls])
        content = _utf8(content, at)
        if role == "user" and relabel_observations:
            role, seen_user = ("tool" if seen_user else "user"), True
        out.append(Message(role, content))
    return tuple(out)


# ----------------------------------------------------------------------------- JSONL


def _iter_jsonl(path: Path) -> Iterator[Session]:
    fh = _open_binary(path)
    read_any = False
    try:
        with fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                read_any = True
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                    raise TrajectoryError(f"{path}:{lineno}: invalid JSON ({e})") from None
                yield _jsonl_session(rec, path, lineno)
    except (OSError, EOFError, zlib.error) as e:  # truncated or corrupt gzip stream
        raise TrajectoryError(f"{path}: cannot read ({e})") from None
    if not read_any:
        raise TrajectoryError(f"{path}: no records (an empty file)")


def _jsonl_session(rec: Any, path: Path, lineno: int) -> Session:
    where = f"{path}:{lineno}"
    if not isinstance(rec, dict):
        raise TrajectoryError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "messages" not in rec:
        raise TrajectoryError(f"{where}: missing key 'messages'")
    meta = _meta(rec, where)
    if "agent" in rec:
        # Normalized dataset record: content is already rendered; keep it byte for byte.
        raw = rec["messages"]
        if not isinstance(raw, list):
            raise TrajectoryError(f"{where}: 'messages' must be a list")
        msgs = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                key = "role" if not isinstance(m, dict) or "role" not in m else "content"
                raise TrajectoryError(f"{where}: message {i}: missing key {key!r}")
            if not isinstance(m["role"], str) or m["role"] not in ROLES:
                raise TrajectoryError(f"{where}: message {i}: unknown role {m['role']!r}")
            if not isinstance(m["content"], str):
                raise TrajectoryError(f"{where}: message {i}: 'content' must be a string, "
                                      f"got {type(m['content']).__name__}")
            msgs.append(Message(m["role"], _utf8(m["content"], f"{where}: message {i}")))
        if "agent_version" in rec:
            meta.setdefault("agent_version", rec["agent_version"])
        messages = tuple(msgs)
    else:
        messages = _convert_messages(rec["messages"], where, relabel_observations=False)
    _check_names(rec, ("id", "agent"), where)
    agent = str(rec.get("agent", "chat"))
    return Session(id=str(rec.get("id", f"{path.name}:{lineno}")), agent=agent,
                   model=str(rec.get("model") or ""), source=str(rec.get("source", where)),
                   messages=messages, meta=meta)


# ----------------------------------------------------------------------------- JSON


def _json_sessions(path: Path, base: str) -> Iterator[Session]:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrajectoryError(
            f"{path}:{e.lineno}: invalid JSON ({e.msg}, line {e.lineno} column {e.colno})"
        ) from None
    except RecursionError:
        raise TrajectoryError(f"{path}: invalid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise TrajectoryError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if "history" in data:
        yield _swe_agent_session(data, path)
    elif "messages" in data:
        yield _mini_or_chat_session(data, path, base)
    else:
        raise TrajectoryError(f"{path}: missing key 'history' (SWE-agent) or 'messages' "
                              f"(mini-swe-agent / chat)")


def _meta(obj: dict, where: str) -> dict:
    """A copy of ``obj["meta"]`` (an object, or absent)."""
    meta = obj.get("meta") or {}
    if not isinstance(meta, dict):
        raise TrajectoryError(f"{where}: 'meta' must be an object, got {type(meta).__name__}")
    _check_names(meta, ("instance_id",), f"{where}: meta")
    return dict(meta)


def _check_names(obj: dict, keys: tuple[str, ...], where: str) -> None:
    """Raises TrajectoryError unless each of ``keys`` present in ``obj`` is a string or an
    int: a null id would become the string "None" (unrelated sessions one task), a list
    its repr. A null ``instance_id`` is as none (the task falls back to the session)."""
    for key in keys:
        value = obj.get(key, "")
        if value is None and key == "instance_id":
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TrajectoryError(f"{where}: {key!r} must be a string, got "
                                  f"{type(value).__name__}")


def _dig(obj: Any, *keys: str) -> Any:
    for k in keys:
        obj = obj.get(k) if isinstance(obj, dict) else None
    return obj


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".json", ".traj"):
        name = name.removesuffix(suffix)
    return name


def _swe_agent_session(data: dict, path: Path) -> Session:
    messages = _convert_messages(data["history"], f"{path}: history", relabel_observations=True)
    config = data.get("replay_config")
    if isinstance(config, str):  # SWE-agent stores its replay config as a JSON string
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            config = None
    model = str(_dig(config, "agent", "model", "name") or "")
    instance = str(_dig(config, "problem_statement", "id") or _stem(path))
    info = data.get("info") if isinstance(data.get("info"), dict) else {}
    meta = {"instance_id": instance, "exit_status": info.get("exit_status")}
    if info.get("swe_agent_version"):
        meta["agent_version"] = info["swe_agent_version"]
    return Session(id=f"swe-agent/{model}/{instance}", agent="swe-agent", model=model,
                   source=str(path), messages=messages, meta=meta)


def _mini_or_chat_session(data: dict, path: Path, base: str) -> Session:
    info = data.get("info") if isinstance(data.get("info"), dict) else {}
    is_mini = (base.endswith(".traj.json") or "mini_version" in info
               or str(data.get("trajectory_format", "")).startswith("mini-swe-agent"))
    messages = _convert_messages(data["messages"], f"{path}: messages",
                                 relabel_observations=is_mini)
    _check_names(data, ("id", "agent", "instance_id"), str(path))
    instance = str(data.get("instance_id") or _stem(path))
    if not is_mini:
        return Session(id=str(data.get("id", instance)), agent=str(data.get("agent", "chat")),
                       model=str(data.get("model") or ""), source=str(path),
                       messages=messages, meta=_meta(data, str(path)))
    model_raw = str(_dig(info, "config", "model", "model_name") or "")
    model = model_raw.lstrip("@")  # some configs prefix the provider with '@'
    meta = {"instance_id": instance, "exit_status": info.get("exit_status")}
    if model_raw != model:
        meta["model_raw"] = model_raw
    if info.get("mini_version"):
        meta["agent_version"] = info["mini_version"]
    return Session(id=f"mini-swe-agent/{model}/{instance}", agent="mini-swe-agent",
                   model=model, source=str(path), messages=messages, meta=meta)


# ----------------------------------------------------------------------------- aider


def _aider_sessions(path: Path, text: str) -> Iterator[Session]:
    """Sessions of an aider ``.aider.chat.history.md`` log.

    Mirrors the dataset's conversion. Lines are split on ``"\\n"`` only (a CRLF log keeps its
    ``"\\r"``). ``#### `` lines are user input and ``> `` lines console output (``tool``),
    each with the prefix and one trailing two-space markdown line break removed; every
    other line is assistant text, verbatim. Consecutive lines of one role form a message. A
    blank line continues an assistant message but ends a user/tool one (so two user inputs
    separated by a blank line stay two messages); trailing ``"\\n"`` of assistant text is
    dropped. Sessions with fewer than ``AIDER_MIN_ASSISTANT_CHARS`` assistant chars are
    skipped. The session number is the chunk index of the split (0 = text before the
    first header).
    """
    chunks = _AIDER_HEADER.split(text)
    if len(chunks) == 1:
        raise TrajectoryError(f"{path}:1: not an aider chat history "
                              f"(no '# aider chat started at' header)")
    owner = path.resolve().parent.name or path.name
    for index, chunk in enumerate(chunks[1:], start=1):
        header, _, body = chunk.partition("\n")
        messages = _aider_messages(body.split("\n"))
        if sum(len(m.content) for m in messages if m.role == "assistant") \
                < AIDER_MIN_ASSISTANT_CHARS:
            continue
        model, edit_format = _aider_model(messages)
        yield Session(id=f"aider/{owner}/{index:03d}", agent="aider", model=model,
                      source=str(path), messages=messages,
                      meta={"session_started": header.strip(), "session_index": index,
                            "edit_format": edit_format})


def _aider_model(messages: tuple[Message, ...]) -> tuple[str, str | None]:
    """``(model, edit_format)`` from aider's startup banner, e.g. ``Main model: gpt-4o with
    diff edit format``; ``("", None)`` if the session has none."""
    for m in messages:
        if m.role == "tool":
            for line in m.content.split("\n"):
                found = _AIDER_MODEL.match(line)
                if found:
                    return found.group(1), found.group(2)
    return "", None


def _aider_messages(lines: list[str]) -> tuple[Message, ...]:
    out: list[Message] = []
    role: str | None = None
    buf: list[str] = []

    def flush() -> None:
        content = "\n".join(buf)
        if role == "assistant":
            content = content.rstrip("\n")
        if role is not None and content:
            out.append(Message(role, content))
        buf.clear()

    for line in lines:
        if line.startswith(("#### ", "> ")):
            new_role = "user" if line.startswith("#### ") else "tool"
            line = line[5 if new_role == "user" else 2:].removesuffix("  ")
        elif not line.strip():
            if role == "assistant":
                buf.append(line)
            else:
                flush()
                role = None
            continue
        else:
            new_role = "assistant"
        if new_role != role:
            flush()
            role = new_role
        buf.append(line)
    flush()
    return tuple(out)
