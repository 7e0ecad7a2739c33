"""A built-in workload: agent-like sessions made from a git repository's history.

It needs no outside data, so the whole pipeline runs on any clone. Each non-merge commit
that modifies existing text files becomes one session shaped like a mini-swe-agent run:

1. ``system``: a short fixed agent prompt (:data:`SYSTEM_PROMPT`);
2. ``user``: the commit subject, as the task;
3. for each modified file, an ``assistant`` turn ``THOUGHT: ...`` + a ```` ```bash ````
   block running ``cat -n PATH``, then a ``tool`` turn with the file at the parent commit,
   rendered exactly as GNU ``cat -n`` prints it;
4. a final ``assistant`` turn with ``git diff PARENT COMMIT -- FILES`` verbatim inside a
   ```` ```diff ```` fence.

The final turn is the interesting one for a drafter: its context lines and removed lines
are copies of the ``cat -n`` output it has just seen.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agspec_gpu.checks import is_int
from agspec_gpu.trajectories import Message, Session

AGENT = "git-history"
SYSTEM_PROMPT = (
    "You are a software engineer working in a git repository through a bash shell.\n"
    "Read the files you need with one bash command per reply, in a ```bash block after a "
    "THOUGHT: line.\nWhen you know the change, reply with the complete unified diff in a "
    "```diff block."
)
_SEP = "\x1f"  # git log field separator: cannot occur in hashes or a one-line subject
_MAX_ARGS = 512  # paths per git call


class GitError(ValueError):
    """The path is not a git repository, or git failed."""


@dataclass(frozen=True, slots=True)
class _Commit:
    sha: str
    parent: str
    subject: str


def cat_n(text: str) -> str:
    """Renders ``text`` exactly as GNU ``cat -n`` prints it.

    Each line gets its 1-based number right-aligned in 6 columns and a TAB; a final line
    without a newline is numbered too, and an empty text gives ``""``.
    """
    lines = text.split("\n")
    tail = lines.pop()  # "" when the text ends with a newline (or is empty)
    out = [f"{i:6d}\t{line}\n" for i, line in enumerate(lines, 1)]
    if tail:
        out.append(f"{len(lines) + 1:6d}\t{tail}")
    return "".join(out)


def sessions_from_git(repo: str | Path = ".", *, max_commits: int = 200,
                      max_file_bytes: int = 200_000) -> list[Session]:
    """Builds sessions from the newest non-merge commits of a repository.

    Args:
        repo: any path inside a git work tree (or a bare repository).
        max_commits: how many of the newest non-merge commits reachable from ``HEAD`` are
            examined; each gives at most one session.
        max_file_bytes: files larger than this at the parent commit are left out.

    Returns:
        Sessions, newest commit first. Root commits, and commits with no modified text
        file left after the filters (binary, too large, not UTF-8), give none. A repository
        without commits gives ``[]``.

    Raises:
        ValueError: ``repo`` is not a path, or a limit not an int >= 0.
        GitError: ``repo`` is not a git repository, or git is missing or fails.
    """
    if not isinstance(repo, (str, os.PathLike)):
        raise ValueError(f"repo: expected a path, got {type(repo).__name__}")
    for arg, value in (("max_commits", max_commits), ("max_file_bytes", max_file_bytes)):
        if not is_int(value) or value < 0:
            raise ValueError(f"{arg}: expected an int >= 0, got {value!r}")
    repo = Path(repo)
    if not repo.is_dir():
        raise GitError(f"{repo}: not a directory")
    probe = _git(repo, "rev-parse", "--absolute-git-dir", check=False)
    if probe.returncode != 0:
        raise GitError(f"{repo}: not a git repository "
                       f"({probe.stderr.decode(errors='replace').strip()})")
    if _git(repo, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode != 0:
        return []  # no commits yet
    top = _git(repo, "rev-parse", "--show-toplevel", check=False)
    if top.returncode == 0 and top.stdout.strip():
        # git prints paths relative to the top level; run every command from there so
        # pathspecs mean the same thing (repo may be a subdirectory).
        repo = Path(os.fsdecode(top.stdout.removesuffix(b"\n")))
    name = repo.resolve().name
    sessions = []
    for commit in _commits(repo, max_commits):
        session = _session(repo, name, commit, max_file_bytes)
        if session is not None:
            sessions.append(session)
    return sessions


def _git(repo: Path, *args: str, check: bool = True,
         input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    # Literal pathspecs: file names are data, never glob patterns. No pager, no colour,
    # no external diff drivers, so the output is git's own plain text.
    cmd = ["git", "--no-pager", "--literal-pathspecs", "-c", "color.ui=false",
           "-C", str(repo), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, input=input)
    except FileNotFoundError:
        raise GitError("git executable not found on PATH") from None
    except OSError as e:  # (callers pass at most _MAX_ARGS paths: not an argument list)
        raise GitError(f"{repo}: git {' '.join(args[:2])} failed: {e}") from None
    if check and proc.returncode != 0:
        raise GitError(f"{repo}: git {' '.join(args[:2])} failed: "
                       f"{proc.stderr.decode(errors='replace').strip()}")
    return proc


def _commits(repo: Path, max_commits: int) -> list[_Commit]:
    if max_commits == 0:
        return []
    # NUL-terminated records: a subject may hold any other line break (\r, \f, U+2028)
    out = _git(repo, "log", "-z", "--no-merges", f"--max-count={max_commits}",
               f"--format=%H{_SEP}%P{_SEP}%s", "HEAD").stdout.decode("utf-8", "replace")
    commits = []
    for record in out.split("\0"):
        if not record:
            continue
        sha, parents, subject = record.split(_SEP, 2)
        if parents:  # a root commit has no parent to read files from
            commits.append(_Commit(sha, parents.split()[0], subject))
    return commits


def _modified_text_files(repo: Path, c: _Commit) -> list[str]:
    """Paths modified (not added, deleted or renamed) by ``c`` whose diff is not binary."""
    out = _git(repo, "diff", "--numstat", "-z", "--no-renames", "--diff-filter=M",
               c.parent, c.sha).stdout
    paths = []
    for entry in out.split(b"\0"):
        if not entry:
            continue
        added, deleted, path = entry.split(b"\t", 2)
        if added == b"-" and deleted == b"-":  # git's marker for a binary diff
            continue
        try:
            name = path.decode("utf-8")
        except UnicodeDecodeError:
            continue
        paths.append(name)
    return paths


def _batches(paths: list[str]) -> list[list[str]]:
    """``paths`` in order, at most :data:`_MAX_ARGS` to a git call (a tree-wide commit's
    paths would exceed the OS's argument list)."""
    return [paths[i:i + _MAX_ARGS] for i in range(0, len(paths), _MAX_ARGS)]


def _parent_blobs(repo: Path, c: _Commit, paths: list[str],
                  max_file_bytes: int) -> dict[str, str]:
    """Text of each path at ``c.parent``, skipping large, binary and non-UTF-8 files."""
    blobs = {}
    for part in _batches(paths):
        for entry in _git(repo, "ls-tree", "-l", "-z", c.parent, "--", *part).stdout.split(b"\0"):
            if entry:
                info, path = entry.split(b"\t", 1)
                mode, kind, sha, size = info.split()
                # Regular files only: a symlink's blob is its target, a submodule has none.
                if kind == b"blob" and mode != b"120000" and int(size) <= max_file_bytes:
                    blobs[path.decode("utf-8")] = sha
    wanted = [p for p in paths if p in blobs]
    if not wanted:
        return {}
    # by object id: a path's own text never reaches cat-file's line-based input (which
    # would strip a name's trailing \r or split one at a \n)
    batch = b"".join(blobs[p] + b"\n" for p in wanted)
    out = _git(repo, "cat-file", "--batch", input=batch).stdout
    texts, pos = {}, 0
    for p in wanted:
        # Each object is "<sha> <type> <size>\n<content>\n".
        header_end = out.index(b"\n", pos)
        header = out[pos:header_end].split()
        if len(header) != 3 or header[1] != b"blob":
            raise GitError(f"{repo}: git cat-file --batch: unexpected header {header!r} "
                           f"for {p!r} at {c.parent}")
        size = int(header[2])
        data = out[header_end + 1: header_end + 1 + size]
        pos = header_end + 1 + size + 1
        if b"\0" in data:
            continue
        try:
            texts[p] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def _session(repo: Path, name: str, c: _Commit, max_file_bytes: int) -> Session | None:
    paths = _modified_text_files(repo, c)
    texts = _parent_blobs(repo, c, paths, max_file_bytes) if paths else {}
    files = [p for p in paths if p in texts]
    if not files:
        return None
    try:  # (git orders a diff's files by path, as the numstat listed them: the batches'
        # diffs concatenated are the one diff)
        diff = "".join(_git(repo, "diff", "--no-color", "--no-ext-diff", c.parent, c.sha, "--",
                            *part).stdout.decode("utf-8") for part in _batches(files))
    except UnicodeDecodeError:
        return None
    if not diff:
        return None
    fenced = diff if diff.endswith("\n") else diff + "\n"  # git diff always ends in one
    messages = [Message("system", SYSTEM_PROMPT), Message("user", c.subject)]
    for path in files:
        messages.append(Message(
            "assistant",
            f"THOUGHT: I need to read `{path}` before changing it.\n\n"
            f"```bash\ncat -n {shlex.quote(path)}\n```"))
        messages.append(Message("tool", cat_n(texts[path])))
    messages.append(Message(
        "assistant",
        f"THOUGHT: I have read the code; this diff makes the change.\n\n```diff\n{fenced}```"))
    return Session(id=f"{AGENT}/{name}/{c.sha[:12]}", agent=AGENT, model="", source=
                   f"{name}@{c.sha}", messages=tuple(messages),
                   meta={"commit": c.sha, "parent": c.parent, "files": files})
