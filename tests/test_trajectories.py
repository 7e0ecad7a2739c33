"""Tests for agspec_gpu.trajectories: every supported format, errors, and the real dev set."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from agspec_gpu.trajectories import (
    Message,
    Session,
    TrajectoryError,
    load_paths,
    load_sessions,
    render_tool_calls,
)

DEV = Path("/work/shared/data/trajectories/dev")
LONG = "x" * 210  # an assistant reply long enough for aider's 200-char session filter


def write_jsonl(path: Path, records: list, *, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def roles(session: Session) -> list[str]:
    return [m.role for m in session.messages]


def contents(session: Session) -> list[str]:
    return [m.content for m in session.messages]


# ----------------------------------------------------------------------------- rendering


def test_render_tool_calls_matches_dataset_convention():
    args = '{"command": "ls -la"}'
    assert render_tool_calls("Look first:", [("bash", args)]) == (
        'Look first:\n\n<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}'
        "</tool_call>")
    # Empty text: no separator; several calls: one line each.
    assert render_tool_calls("", [("a", "{}"), ("b", '{"x": 1}')]) == (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    assert render_tool_calls("plain", []) == "plain"


def test_message_rejects_unknown_role():
    with pytest.raises(ValueError, match="role"):
        Message("robot", "hi")


def test_session_is_hashable_despite_meta_dict():
    s = Session("i", "a", "m", "src", (Message("user", "hi"),), {"k": [1]})
    assert hash(s) == hash(Session("i", "a", "m", "src", (Message("user", "hi"),), {"k": [2]}))


# ----------------------------------------------------------------------------- (a) normalized


NORMALIZED = {
    "id": "swe-agent/m/x-1", "source": "o/r:p@c", "agent": "swe-agent", "agent_version": "1.1.0",
    "model": "m", "meta": {"instance_id": "x-1"},
    "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "text": "Look:", "tool_calls": [{"name": "bash", "arguments": "{}"}],
         "content": 'Look:\n\n<tool_call>{"name": "bash", "arguments": {}}</tool_call>'},
        {"role": "tool", "orig_role": "user", "content": "OBSERVATION:\nok\r\n"},
    ],
}


@pytest.mark.parametrize("gz", [False, True])
def test_normalized_jsonl_keeps_content_unchanged(tmp_path, gz):
    path = write_jsonl(tmp_path / ("d.jsonl.gz" if gz else "d.jsonl"),
                       [NORMALIZED, dict(NORMALIZED, id="second")], gz=gz)
    sessions = load_sessions(path)
    assert [s.id for s in sessions] == ["swe-agent/m/x-1", "second"]
    s = sessions[0]
    assert (s.agent, s.model, s.source) == ("swe-agent", "m", "o/r:p@c")
    assert s.meta == {"instance_id": "x-1", "agent_version": "1.1.0"}
    assert roles(s) == ["system", "user", "assistant", "tool"]
    assert contents(s) == [m["content"] for m in NORMALIZED["messages"]]
    assert len(load_sessions(path, limit=1)) == 1


# ----------------------------------------------------------------------------- (d) OpenAI chat


CHAT = {"messages": [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Fix it."},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "bash", "arguments": "{\"command\": \"cat a.py\"}"}},
        {"id": "c2", "type": "function",
         "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "print(1)\n"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "a.py"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "submit", "arguments": "{}"}}]},
    {"role": "user", "content": "Thanks."},
]}


@pytest.mark.parametrize("gz", [False, True])
def test_openai_chat_jsonl_renders_tool_calls(tmp_path, gz):
    path = write_jsonl(tmp_path / ("chat.jsonl.gz" if gz else "chat.jsonl"), [CHAT], gz=gz)
    (s,) = load_sessions(path)
    assert roles(s) == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert s.messages[2].content == (
        "Let me look.\n\n"
        '<tool_call>{"name": "bash", "arguments": {"command": "cat a.py"}}</tool_call>\n'
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
    assert s.messages[4].content == "a.py"
    assert s.messages[5].content == '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'
    assert s.agent == "chat" and s.id == f"{path.name}:1"


# ----------------------------------------------------------------------------- (b) SWE-agent


def swe_agent_traj() -> dict:
    call = {"index": 1, "id": "toolu_1", "type": "function", "function": {
        "arguments": "{\"command\": \"view\", \"path\": \"/testbed/a.py\"}",
        "name": "str_replace_editor"}}
    return {
        "trajectory": [{"query": "redundant copies"}],
        "history": [
            {"role": "system", "content": "You are a helpful assistant.", "agent": "main"},
            {"role": "user", "content": [{"type": "text", "text": "<pr_description>\nbug"},
                                         {"type": "text", "text": "\n</pr_description>"}]},
            {"role": "assistant", "content": "Let me view it:", "thought": "Let me view it:",
             "action": "str_replace_editor view /testbed/a.py", "tool_calls": [call],
             "message_type": "action"},
            {"role": "tool", "content": [{"type": "text", "text": "OBSERVATION:\n     1\tx = 1"}],
             "tool_call_ids": ["toolu_1"]},
            {"role": "assistant", "content": "", "thought": "", "tool_calls": [
                {"index": 0, "function": {"arguments": "{\"command\": \"ls\"}", "name": "bash"}}]},
            {"role": "user", "content": "OBSERVATION:\nExited (autosubmitted)"},
            {"role": "assistant", "content": "Exit due to context window"},
        ],
        "info": {"exit_status": "submitted", "swe_agent_version": "1.1.0"},
        "replay_config": json.dumps({"agent": {"model": {"name": "claude-x"}},
                                     "problem_statement": {"id": "astropy__astropy-1"}}),
    }


def test_swe_agent_traj_uses_history_and_relabels_observations(tmp_path):
    path = tmp_path / "astropy__astropy-1.traj"
    path.write_text(json.dumps(swe_agent_traj(), indent=2))
    (s,) = load_sessions(path)
    assert (s.id, s.agent, s.model) == ("swe-agent/claude-x/astropy__astropy-1", "swe-agent",
                                        "claude-x")
    assert s.meta["exit_status"] == "submitted"
    assert roles(s) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert contents(s) == [
        "You are a helpful assistant.",
        "<pr_description>\nbug\n</pr_description>",
        'Let me view it:\n\n<tool_call>{"name": "str_replace_editor", "arguments": '
        '{"command": "view", "path": "/testbed/a.py"}}</tool_call>',
        "OBSERVATION:\n     1\tx = 1",
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>',
        "OBSERVATION:\nExited (autosubmitted)",
        "Exit due to context window",
    ]


# ----------------------------------------------------------------------------- (c) mini-swe-agent


def mini_traj() -> dict:
    return {
        "info": {"exit_status": "Submitted", "mini_version": "1.15.0",
                 "config": {"model": {"model_name": "@google/gemini-x"}}},
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "<pr_description>\nbug\n</pr_description>"},
            {"role": "assistant", "content": "THOUGHT: look.\n\n```bash\nls -la\n```"},
            {"role": "user", "content": "<returncode>0</returncode>\n<output>\na.py\n</output>"},
            {"role": "assistant", "content": "THOUGHT: done.\n\n```bash\necho COMPLETE\n```",
             "extra": {"response": {}}},
        ],
        "trajectory_format": "mini-swe-agent-1",
        "instance_id": "django__django-1",
    }


@pytest.mark.parametrize("gz", [False, True])
def test_mini_swe_agent_traj_json(tmp_path, gz):
    path = tmp_path / ("django__django-1.traj.json" + (".gz" if gz else ""))
    data = json.dumps(mini_traj()).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    (s,) = load_sessions(path)
    assert (s.id, s.agent, s.model) == ("mini-swe-agent/google/gemini-x/django__django-1",
                                        "mini-swe-agent", "google/gemini-x")
    assert s.meta["model_raw"] == "@google/gemini-x"
    assert roles(s) == ["system", "user", "assistant", "tool", "assistant"]
    assert contents(s) == [m["content"] for m in mini_traj()["messages"]]


# ----------------------------------------------------------------------------- (e) aider


AIDER_LF = (
    "\n# aider chat started at 2025-01-01 10:00:00\n\n"
    "> Aider v0.85.1  \n> Main model: gpt-4o with diff edit format  \n\n"
    "#### hi  \n\nToo short to keep.\n\n"
    "# aider chat started at 2025-01-02 11:00:00\n\n"
    "> Main model: gpt-4.1 with whole edit format  \n> Git repo: .git  \n>  \n\n"
    "#### first line  \n#### second line   \n\n"
    f"Reply paragraph one.\n\n{LONG}\n> quoted? no: console\n\n"
    "#### again  \n\n#### and again  \n"
    "> Applied edit to a.py  \n"
)


def test_aider_history_split_roles_and_filter(tmp_path):
    path = tmp_path / "proj" / ".aider.chat.history.md"
    path.parent.mkdir()
    path.write_text(AIDER_LF)
    (s,) = load_sessions(path)  # session 1 has < 200 assistant chars and is dropped
    assert (s.id, s.agent, s.model) == ("aider/proj/002", "aider", "gpt-4.1")
    assert s.meta == {"session_started": "2025-01-02 11:00:00", "session_index": 2,
                      "edit_format": "whole"}
    assert [(m.role, m.content) for m in s.messages] == [
        ("tool", "Main model: gpt-4.1 with whole edit format\nGit repo: .git\n "),
        ("user", "first line\nsecond line "),  # one two-space break removed per line
        ("assistant", f"Reply paragraph one.\n\n{LONG}"),
        ("tool", "quoted? no: console"),
        ("user", "again"),  # a blank line ends a user message
        ("user", "and again"),
        ("tool", "Applied edit to a.py"),
    ]


def test_aider_history_with_a_byte_order_mark(tmp_path):
    # saved by a Windows editor: the first header was not found at position 0, and the
    # first session was lost, the second renumbered 001
    path = tmp_path / "proj" / ".aider.chat.history.md"
    path.parent.mkdir()
    path.write_bytes(b"\xef\xbb\xbf" + AIDER_LF.lstrip("\n").encode())
    plain = tmp_path / "plain" / "proj" / ".aider.chat.history.md"
    plain.parent.mkdir(parents=True)
    plain.write_text(AIDER_LF.lstrip("\n"))
    assert [(s.id, s.messages) for s in load_sessions(path)] == [
        (s.id, s.messages) for s in load_sessions(plain)] and load_sessions(path)[0].id == \
        "aider/proj/002"


def test_aider_history_crlf_keeps_carriage_returns(tmp_path):
    # The dataset splits on "\n" only: a Windows log keeps "\r", so the two-space break
    # before it is not removed, and a trailing blank "\r" line stays in the assistant text.
    text = (f"# aider chat started at 2025-08-06 12:06:30\r\n\r\n#### Make a plan.  \r\n\r\n"
            f"Plan:\r\n\r\n{LONG}\r\n\r\n> Tokens: 1.6k sent.  \r\n")
    path = tmp_path / ".aider.chat.history.md"
    path.write_bytes(text.encode())
    (s,) = load_sessions(path)
    assert [(m.role, m.content) for m in s.messages] == [
        ("user", "Make a plan.  \r"),
        ("assistant", f"Plan:\r\n\r\n{LONG}\r\n\r"),
        ("tool", "Tokens: 1.6k sent.  \r"),
    ]
    assert s.meta["session_started"] == "2025-08-06 12:06:30"


# Session 2 of AFI-Protocol/afi-core's .aider.chat.history.md (MIT), without aider's trailing
# two-space markdown breaks, which _afi_markdown() puts back.
AFI_SESSION_002 = """
# aider chat started at 2025-07-15 14:53:34

> /opt/homebrew/bin/aider .aider.conf.json
> Using gpt-4o model with API key from environment.
> Skipping /Users/secretservice/AFI_Modular_Repos/afi-core/.aider.conf.json that matches gitignore spec.
> Aider v0.85.1
> Main model: gpt-4o with diff edit format
> Weak model: gpt-4o-mini
> Git repo: .git with 16 files
> Repo-map: using 4096 tokens, auto refresh

#### chmod +x ~/AFI_Modular_Repos/*.sh

To make the shell script files in the `~/AFI_Modular_Repos/` directory executable, you can use the following command:

```bash
chmod +x ~/AFI_Modular_Repos/*.sh
```

This command will change the permissions of all `.sh` files in the specified directory to be executable.

> Tokens: 3.2k sent, 66 received. Cost: $0.0086 message, $0.0086 session.
> chmod +x ~/AFI_Modular_Repos/*.sh
> Run shell command? (Y)es/(N)o/(D)on't ask again [Yes]: y
> Running chmod +x ~/AFI_Modular_Repos/*.sh

#### sync-afi
#### aider-afi

Please add the following files to the chat if you want to make changes related to the `sync-afi` and `aider-afi` commands:

1. `init_repo.sh` - This file is likely to contain shell scripts related to repository initialization, which might be relevant for syncing or aiding AFI repositories.

Once you add the file, I can help you make the necessary changes.

> Tokens: 3.2k sent, 79 received. Cost: $0.0089 message, $0.02 session.
> init_repo.sh
> Add file to the chat? (Y)es/(N)o/(D)on't ask again [Yes]: y

To implement the `sync-afi` and `aider-afi` commands, we need to create new shell scripts for these commands. Let's create two new files: `sync-afi.sh` and `aider-afi.sh`.

Here are the *SEARCH/REPLACE* blocks to create these files:

sync-afi.sh
```bash
<<<<<<< SEARCH
=======
#!/bin/bash
# Script to sync AFI repositories

echo "Syncing AFI repositories..."
# Add your sync logic here
>>>>>>> REPLACE
```

aider-afi.sh
```bash
<<<<<<< SEARCH
=======
#!/bin/bash
# Script to aid AFI operations

echo "Aiding AFI operations..."
# Add your aiding logic here
>>>>>>> REPLACE
```

After creating these files, you can make them executable with the following command:

```bash
chmod +x sync-afi.sh aider-afi.sh
```

> Tokens: 3.4k sent, 184 received. Cost: $0.01 message, $0.03 session.
> sync-afi.sh
> Create new file? (Y)es/(N)o [Yes]: y
> aider-afi.sh
> Create new file? (Y)es/(N)o [Yes]: y
> Applied edit to aider-afi.sh
> Applied edit to sync-afi.sh
> Commit dde0244 feat: add sync-afi and aider-afi shell scripts for AFI operations
> chmod +x sync-afi.sh aider-afi.sh
> Run shell command? (Y)es/(N)o/(D)on't ask again [Yes]: y
> Running chmod +x sync-afi.sh aider-afi.sh
> You can use /undo to undo and discard each aider commit."""


def _afi_markdown() -> str:
    lines = AFI_SESSION_002.split("\n")
    body = "\n".join(line + "  " if line.startswith(("> ", "#### ")) else line for line in lines)
    session_1 = ("# aider chat started at 2025-07-15 11:38:37\n\n> Aider v0.85.1  \n\n"
                 "#### short  \n\nPlease add the file.\n\n")
    return "\n" + session_1 + body.lstrip("\n") + "\n"


@pytest.mark.skipif(not (DEV / "aider__chat_history.jsonl.gz").exists(), reason="no dev set")
def test_aider_matches_normalized_dataset_record(tmp_path):
    path = tmp_path / "afi-core" / ".aider.chat.history.md"
    path.parent.mkdir()
    path.write_text(_afi_markdown())
    (s,) = load_sessions(path)
    (ref,) = load_sessions(DEV / "aider__chat_history.jsonl.gz", limit=1)
    assert ref.id == "aider/AFI-Protocol/afi-core/002"
    assert s.id == "aider/afi-core/002" and s.model == ref.model == "gpt-4o"
    assert s.messages == ref.messages


# ----------------------------------------------------------------------------- errors


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n{not json\n")
    with pytest.raises(TrajectoryError, match=r"bad\.jsonl:3: invalid JSON"):
        load_sessions(path)
    assert len(load_sessions(path, limit=2)) == 2  # lazily read: line 3 never parsed


def test_bad_json_line_in_gzip(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join([json.dumps(NORMALIZED).encode()] * 2)
                                   + b"\n[1, 2\n"))
    with pytest.raises(TrajectoryError, match=r"bad\.jsonl\.gz:3: invalid JSON"):
        load_sessions(path)


def test_corrupt_gzip(tmp_path):
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(TrajectoryError, match=r"broken\.jsonl\.gz"):
        load_sessions(path)


@pytest.mark.parametrize("record,match", [
    ({"id": "x"}, r"m\.jsonl:2: missing key 'messages'"),
    ({"messages": [{"content": "hi"}]}, r"m\.jsonl:2: message 0: missing key 'role'"),
    ({"messages": [{"role": "user"}]}, r"m\.jsonl:2: message 0: missing key 'content'"),
    ({"agent": "a", "messages": [{"content": "hi"}]}, r"m\.jsonl:2: message 0: missing key 'role'"),
    ({"agent": "a", "messages": [{"role": "user"}]}, r"m\.jsonl:2: message 0: .*'content'"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, r"m\.jsonl:2: .*unknown role 'wizard'"),
    ([1, 2], r"m\.jsonl:2: expected a JSON object"),
    # a null id or agent became the string "None": unrelated sessions one task
    ({"id": None, "agent": "a", "messages": []}, r"m\.jsonl:2: 'id' must be a string"),
    ({"agent": None, "messages": []}, r"m\.jsonl:2: 'agent' must be a string, got NoneType"),
    ({"id": True, "messages": []}, r"m\.jsonl:2: 'id' must be a string, got bool"),
    ({"messages": [], "meta": {"instance_id": {"a": 1}}},
     r"m\.jsonl:2: meta: 'instance_id' must be a string, got dict"),
])
def test_jsonl_missing_keys(tmp_path, record, match):
    path = write_jsonl(tmp_path / "m.jsonl", [CHAT, record])
    with pytest.raises(TrajectoryError, match=match):
        load_sessions(path)



@pytest.mark.parametrize("field, value", [("id", None), ("agent", ["x"]),
                                          ("instance_id", {"a": 1})])
def test_chat_json_names_are_strings_as_in_jsonl(tmp_path, field, value):
    """A chat ``.json`` file took any id: null became the string "None" (two unrelated
    files one session and one task), a list its repr. The ``.jsonl`` check applies."""
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": CHAT["messages"], field: value}))
    with pytest.raises(TrajectoryError, match=f"chat\\.json: '{field}' must be a string"):
        load_sessions(path)


def test_load_arguments_are_named(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [CHAT])
    for call, match in ((lambda: load_sessions(5), "path: expected a file or directory"),
                        (lambda: load_paths([path, 5]), r"paths\[1\]: expected a file"),
                        (lambda: load_sessions(path, limit="2"), "limit: expected an int"),
                        (lambda: load_paths(path, limit=-1), "limit: expected an int")):
        with pytest.raises(ValueError, match=match):
            call()
    assert len(load_paths(path, limit=1)) == 1
    # a null instance_id is as none: the task is the session's (it loaded before)
    nulls = write_jsonl(tmp_path / "n.jsonl", [{**CHAT, "id": "s1",
                                                 "meta": {"instance_id": None}}])
    assert load_sessions(nulls)[0].task_id == "s1"
    chat = tmp_path / "c.json"
    chat.write_text(json.dumps({"messages": CHAT["messages"], "instance_id": None}))
    assert load_sessions(chat)[0].task_id == "c"

def test_swe_agent_errors(tmp_path):
    bad = tmp_path / "bad.traj"
    bad.write_text('{\n  "history": [\n    {"role": "user",, }\n  ]\n}\n')
    with pytest.raises(TrajectoryError, match=r"bad\.traj:3: invalid JSON"):
        load_sessions(bad)
    missing = tmp_path / "missing.traj"
    missing.write_text(json.dumps({"trajectory": []}))
    with pytest.raises(TrajectoryError, match=r"missing\.traj: missing key 'history'"):
        load_sessions(missing)
    norole = tmp_path / "norole.traj"
    data = swe_agent_traj()
    del data["history"][2]["role"]
    norole.write_text(json.dumps(data))
    with pytest.raises(TrajectoryError,
                       match=r"norole\.traj: history: message 2: missing key 'role'"):
        load_sessions(norole)


def test_mini_errors(tmp_path):
    bad = tmp_path / "bad.traj.json"
    bad.write_text('{"messages": [\n{"role": "user"\n"content": "x"}]}')
    with pytest.raises(TrajectoryError, match=r"bad\.traj\.json:3: invalid JSON"):
        load_sessions(bad)
    data = mini_traj()
    del data["messages"][3]["role"]
    norole = tmp_path / "norole.traj.json"
    norole.write_text(json.dumps(data))
    with pytest.raises(TrajectoryError,
                       match=r"norole\.traj\.json: messages: message 3: missing key 'role'"):
        load_sessions(norole)
    nomsg = tmp_path / "nomsg.traj.json"
    nomsg.write_text(json.dumps({"info": {}}))
    with pytest.raises(TrajectoryError, match=r"nomsg\.traj\.json: missing key"):
        load_sessions(nomsg)


def test_aider_and_path_errors(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nnothing here\n")
    with pytest.raises(TrajectoryError, match=r"notes\.md:1: not an aider chat history"):
        load_sessions(notes)
    bad_utf8 = tmp_path / ".aider.chat.history.md"
    bad_utf8.write_bytes(b"# aider chat started at x\n\nok\n\xff\xfe\n")
    with pytest.raises(TrajectoryError, match=r"\.aider\.chat\.history\.md:4: invalid UTF-8"):
        load_sessions(bad_utf8)
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(TrajectoryError, match=r"data\.csv: unsupported"):
        load_sessions(other)
    with pytest.raises(TrajectoryError, match=r"nope\.jsonl: no such file"):
        load_sessions(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="limit"):
        load_sessions(notes, limit=-1)


def test_more_malformed_inputs_are_named(tmp_path):
    """Found by an audit that raised tracebacks or loaded nothing silently: corrupt deflate
    data in a gzip file, JSON nested too deeply, a chat ``.json`` whose 'meta' is no object,
    a lone surrogate in a message (no tokenizer reads it), an empty file and a directory
    without trajectory files each raise TrajectoryError naming the file."""
    rec = json.dumps(CHAT).encode() + b"\n"
    corrupt = bytearray(gzip.compress(rec * 20))
    for i in range(20, 40):  # inside the deflate stream: zlib.error, not a header error
        corrupt[i] ^= 0xFF
    (tmp_path / "corrupt.jsonl.gz").write_bytes(bytes(corrupt))
    (tmp_path / "deep.traj.json").write_text("[" * 100_000)
    (tmp_path / "meta.json").write_text(json.dumps({**CHAT, "meta": [1, 2]}))
    surrogate = {**NORMALIZED, "messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": "ab\ud800"}]}
    (tmp_path / "lone.jsonl").write_text(json.dumps(surrogate) + "\n")  # JSON's \ud800 escape
    chat = {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "content": [{"type": "text", "text": "\udfff"}]}]}
    (tmp_path / "lone_chat.jsonl").write_text(json.dumps(chat) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "empty.jsonl.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("x")
    cases = [("corrupt.jsonl.gz", r"corrupt\.jsonl\.gz: cannot read"),
             ("deep.traj.json", r"deep\.traj\.json: invalid JSON \(nested too deeply\)"),
             ("meta.json", r"meta\.json: 'meta' must be an object, got list"),
             ("lone.jsonl", r"lone\.jsonl:1: message 1: '\\ud800' at character 2 has no UTF-8"),
             ("lone_chat.jsonl", r"lone_chat\.jsonl:1: message 1: .* no UTF-8 form"),
             ("empty.jsonl", r"empty\.jsonl: no records"),
             ("empty.jsonl.gz", r"empty\.jsonl\.gz: no records"),
             ("nothing", r"nothing: no trajectory files")]
    for name, match in cases:
        with pytest.raises(TrajectoryError, match=match):
            load_sessions(tmp_path / name)
    with pytest.raises(TrajectoryError, match="nothing: no trajectory files"):
        load_paths([tmp_path / "nothing", tmp_path / "corrupt.jsonl.gz"], limit=1)


# ----------------------------------------------------------------------------- directories


def test_directory_of_mixed_files(tmp_path):
    write_jsonl(tmp_path / "a_chat.jsonl", [CHAT, CHAT])
    sub = tmp_path / "b_trajs" / "x"
    sub.mkdir(parents=True)
    (sub / "x.traj").write_text(json.dumps(swe_agent_traj()))
    (sub / "x.traj.json").write_text(json.dumps(mini_traj()))
    (sub / "x.config.yaml").write_text("ignored: true\n")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / ".aider.chat.history.md").write_text(AIDER_LF)
    (tmp_path / "README.md").write_text("# not a trajectory\n")  # skipped in directory scans
    write_jsonl(tmp_path / "d_norm.jsonl.gz", [NORMALIZED], gz=True)
    sessions = load_sessions(tmp_path)
    assert [s.agent for s in sessions] == ["chat", "chat", "swe-agent", "mini-swe-agent",
                                           "aider", "swe-agent"]
    assert [s.agent for s in load_sessions(tmp_path, limit=3)] == ["chat", "chat", "swe-agent"]
    both = load_paths([tmp_path / "d_norm.jsonl.gz", str(tmp_path / "a_chat.jsonl")], limit=2)
    assert [s.agent for s in both] == ["swe-agent", "chat"]
    assert len(load_paths(tmp_path / "a_chat.jsonl")) == 2  # a single path is not iterated


# ----------------------------------------------------------------------------- real dev set


@pytest.mark.skipif(not DEV.is_dir(), reason="dev trajectories not available")
@pytest.mark.parametrize("name", sorted(p.name for p in DEV.glob("*.jsonl.gz"))
                         if DEV.is_dir() else [])
def test_real_dev_files(name):
    path = DEV / name
    sessions = load_sessions(path, limit=2)
    assert len(sessions) == 2
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        raw = [json.loads(next(fh)) for _ in range(2)]
    for s, rec in zip(sessions, raw):
        assert s.id == rec["id"] and s.agent == rec["agent"] and s.model == rec["model"]
        assert {m.role for m in s.messages} <= {"system", "user", "assistant", "tool"}
        assert "assistant" in roles(s)
        assert s.messages[0].role in ("system", "tool")  # aider logs open with console output
        for m, r in zip(s.messages, rec["messages"], strict=True):
            assert (m.role, m.content) == (r["role"], r["content"])
            if r.get("tool_calls"):
                assert m.role == "assistant" and "<tool_call>" in m.content
                calls = [(c["name"], c["arguments"]) for c in r["tool_calls"]]
                assert m.content == render_tool_calls(r["text"], calls)
