"""Tests for agspec_gpu.gitlog: sessions built from a tiny git repository's history."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agspec_gpu.gitlog import SYSTEM_PROMPT, GitError, cat_n, sessions_from_git

A_V1 = "def greet(name):\n    return 'hello ' + name\n\n\nprint(greet('x'))\n"
A_V2 = "def greet(name):\n    return f'Hello, {name}!'\n\n\nprint(greet('x'))\n"
NOTES_V1 = "line one\n\tindented\r\nno newline at end"
NOTES_V2 = "line one\n\tindented\r\nnow with a newline\n"


@pytest.fixture(autouse=True)
def isolated_git(monkeypatch, tmp_path):
    # The user's and the system's git config must not change git's output in these tests.
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))


def git(repo: Path, *args: str) -> str:
    # Decoded by hand: text=True would turn the CRLF in a diff into "\n".
    return subprocess.run(["git", "-C", str(repo), *args], check=True,
                          capture_output=True).stdout.decode()


def commit(repo: Path, message: str, files: dict[str, str | bytes]) -> str:
    for name, data in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    """Root commit, a symlink, a code change (+ binary, symlink, new file), a notes change
    (+ large file), and a binary-only change, newest last."""
    repo = tmp_path / "demo"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.name", "Test")
    git(repo, "config", "user.email", "test@example.com")
    git(repo, "config", "commit.gpgsign", "false")
    commit(repo, "Initial import", {"src/a.py": A_V1, "notes.txt": NOTES_V1,
                                    "big.txt": "y" * 600 + "\n", "img.bin": b"\x00\x01\x02"})
    (repo / "link").symlink_to("notes.txt")
    git(repo, "add", "link")
    git(repo, "commit", "-q", "-m", "Add a symlink")
    (repo / "link").unlink()
    (repo / "link").symlink_to("big.txt")  # a modified symlink is not a text file to read
    commit(repo, "Capitalize the greeting", {"src/a.py": A_V2, "img.bin": b"\x00\x09",
                                             "src/new.py": "x = 1\n"})
    commit(repo, "Finish the notes", {"notes.txt": NOTES_V2, "big.txt": "z" * 600 + "\n"})
    commit(repo, "Swap the image", {"img.bin": b"\x00\x07\x07"})
    return repo


def real_cat_n(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cat_input"
    path.write_bytes(text.encode())
    return subprocess.run(["cat", "-n", str(path)], check=True, capture_output=True).stdout.decode()


@pytest.mark.parametrize("text", ["", "a", "a\n", "a\n\nb", "\n\n", "x\r\ny\n", NOTES_V1,
                                  "\n".join(map(str, range(12))) + "\n"])
def test_cat_n_matches_gnu_cat(tmp_path, text):
    assert cat_n(text) == real_cat_n(tmp_path, text)


def test_sessions_from_git(repo, tmp_path):
    sessions = sessions_from_git(repo, max_file_bytes=500)
    # Newest first; the binary-only, symlink-only and root commits give no session.
    assert [s.messages[1].content for s in sessions] == ["Finish the notes",
                                                          "Capitalize the greeting"]
    log = git(repo, "log", "--format=%H").split()
    notes, code = sessions
    assert notes.meta == {"commit": log[1], "parent": log[2], "files": ["notes.txt"]}
    assert code.meta == {"commit": log[2], "parent": log[3], "files": ["src/a.py"]}
    assert git(repo, "diff", "--name-only", log[3], log[2]).split() == [
        "img.bin", "link", "src/a.py", "src/new.py"]
    assert code.id == f"git-history/demo/{log[2][:12]}" and code.agent == "git-history"

    assert [m.role for m in code.messages] == ["system", "user", "assistant", "tool",
                                               "assistant"]
    assert code.messages[0].content == SYSTEM_PROMPT
    assert code.messages[2].content == (
        "THOUGHT: I need to read `src/a.py` before changing it.\n\n"
        "```bash\ncat -n src/a.py\n```")
    assert code.messages[3].content == real_cat_n(tmp_path, A_V1)
    assert code.messages[3].content.startswith("     1\tdef greet(name):\n     2\t    return")
    diff = git(repo, "diff", log[3], log[2], "--", "src/a.py")
    assert code.messages[4].content == (
        "THOUGHT: I have read the code; this diff makes the change.\n\n"
        f"```diff\n{diff}```")
    assert "-    return 'hello ' + name\n+    return f'Hello, {name}!'\n" in diff

    # big.txt (601 bytes) is over max_file_bytes; the CRLF line and the missing final
    # newline survive exactly.
    assert notes.messages[3].content == real_cat_n(tmp_path, NOTES_V1)
    assert notes.messages[3].content.endswith("\r\n     3\tno newline at end")
    assert notes.messages[-1].content.endswith(
        git(repo, "diff", log[2], log[1], "--", "notes.txt") + "```")
    assert "\\ No newline at end of file" in notes.messages[-1].content

    with_big = sessions_from_git(repo)[0]
    assert with_big.meta["files"] == ["big.txt", "notes.txt"]
    assert [m.role for m in with_big.messages] == ["system", "user"] + \
        ["assistant", "tool"] * 2 + ["assistant"]


def test_max_commits_and_subdirectory(repo):
    assert sessions_from_git(repo, max_commits=1) == []  # newest commit is binary-only
    assert len(sessions_from_git(repo, max_commits=2, max_file_bytes=500)) == 1
    from_sub = sessions_from_git(repo / "src", max_file_bytes=500)
    assert [s.meta["files"] for s in from_sub] == [["notes.txt"], ["src/a.py"]]


def test_errors_and_empty_repo(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(GitError, match=r"plain: not a git repository"):
        sessions_from_git(plain)
    with pytest.raises(ValueError, match="not a directory"):
        sessions_from_git(tmp_path / "missing")
    with pytest.raises(ValueError, match="max_commits"):
        sessions_from_git(plain, max_commits=-1)
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert sessions_from_git(empty) == []
    for kw in ({"max_commits": "5"}, {"max_commits": 2.5}, {"max_commits": True},
               {"max_file_bytes": None}):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}: expected an int >= 0"):
            sessions_from_git(plain, **kw)
    for bad in (5, None):
        with pytest.raises(ValueError, match="^repo: expected a path"):
            sessions_from_git(bad)


def _new_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q")
    git(path, "config", "user.name", "Test")
    git(path, "config", "user.email", "test@example.com")
    git(path, "config", "commit.gpgsign", "false")
    return path


def test_any_subject_file_name_and_repository_path(tmp_path):
    # a subject with line breaks other than \n (str.splitlines splits at them), a file name
    # ending in \r (cat-file's line input strips it), a work tree whose path ends in a space
    repo = _new_repo(tmp_path / "work tree ")
    names = ["Icon\r", "a.txt", " lead"]
    commit(repo, "init", {n: "1\n" for n in names})
    for subject in ("cr\rin subject", "line\u2028separator", "form\x0cfeed"):
        commit(repo, subject, {n: f"{subject}\n" for n in names})
    sessions = sessions_from_git(repo / ".")
    assert [s.messages[1].content for s in sessions] == [
        "form\x0cfeed", "line\u2028separator", "cr\rin subject"]
    assert all(sorted(s.meta["files"]) == sorted(names) for s in sessions)
    assert [m.content for m in sessions[-1].messages if m.role == "tool"] == [cat_n("1\n")] * 3


def test_a_commit_of_more_files_than_one_git_call_takes(tmp_path, monkeypatch):
    import agspec_gpu.gitlog as gitlog

    repo = _new_repo(tmp_path / "wide")
    names = [f"d/f{i:02d}.txt" for i in range(7)]
    commit(repo, "init", {n: f"{n}\n" for n in names})
    commit(repo, "touch every file", {n: f"{n} changed\n" for n in names})
    whole = sessions_from_git(repo)
    monkeypatch.setattr(gitlog, "_MAX_ARGS", 3)  # 7 paths: git calls of 3, 3 and 1
    assert sessions_from_git(repo) == whole
    assert whole[0].meta["files"] == names and whole[0].messages[-1].content.count("+++") == 7
