"""Golden cases for workspace capture, modelled on real agent transcripts in the dev set."""

import json

import pytest
import torch

from agspec_gpu.capture import (
    CapturedFile,
    capture_agent_writes,
    capture_tool_output,
    strip_line_gutters,
)


# ---------------------------------------------------------------- helpers (fixture builders)


def mini_cmd(command: str, thought: str = "THOUGHT: Let me look.") -> str:
    """A mini-swe-agent assistant message: THOUGHT then exactly one ```bash block."""
    return f"{thought}\n\n```bash\n{command}\n```"


def mini_out(body: str, rc: int = 0) -> str:
    """mini-swe-agent's observation template: the output verbatim between the tags."""
    return f"<returncode>{rc}</returncode>\n<output>\n{body}</output>"


def swe_call(name: str, **arguments) -> str:
    """A SWE-agent/Claude assistant message as rendered in the dataset's `content`."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"Let me check this.\n\n<tool_call>{call}</tool_call>"


def swe_out(body: str) -> str:
    """SWE-agent observation: `OBSERVATION:` prefix, terminal CRLF line ends."""
    return "OBSERVATION:\n" + body.replace("\n", "\r\n")


def one(captures: list[CapturedFile]) -> CapturedFile:
    assert len(captures) == 1, captures
    return captures[0]


# ---------------------------------------------------------------- mini-swe-agent shell reads


def test_cat_whole_file():
    c = one(capture_tool_output(mini_cmd("cat src/app.py"),
                                mini_out("import os\n\ndef f():\n    return 1\n")))
    assert c == CapturedFile("src/app.py", "import os\n\ndef f():\n    return 1\n", None, False,
                             "cat")


def test_cat_crlf_output_is_normalised():
    out = "<returncode>0</returncode>\r\n<output>\r\na = 1\r\nb = 2\r\n</output>"
    assert one(capture_tool_output(mini_cmd("cat a.py"), out)).text == "a = 1\nb = 2\n"


def test_cat_output_without_final_newline_gets_one():
    assert one(capture_tool_output(mini_cmd("cat a.py"), mini_out("x = 1"))).text == "x = 1\n"


def test_quoted_untagged_fence_in_thought_is_not_the_command():
    thought = "THOUGHT: The error was:\n\n```\nValueError: boom\n```\n\nNow read it."
    c = one(capture_tool_output(mini_cmd("cat a.py", thought), mini_out("x\n")))
    assert c.path == "a.py"
    thought = "THOUGHT: Plan:\n```python\nprint(1)\n```\nthen"
    assert one(capture_tool_output(mini_cmd("cat a.py", thought), mini_out("x\n"))).text == "x\n"


def test_cat_keeps_literal_double_dash_lines():
    assert one(capture_tool_output(mini_cmd("cat a.txt"), mini_out("a\n--\nb\n"))).text \
        == "a\n--\nb\n"


def test_cat_n_strips_six_wide_tab_gutter():
    out = mini_out("     1\timport os\n     2\t\n     3\t\tx = 1\n")
    c = one(capture_tool_output(mini_cmd("cat -n a.py"), out))
    assert (c.text, c.first_line, c.is_fragment, c.kind) == ("import os\n\n\tx = 1\n", None,
                                                             False, "cat-n")


def test_nl_ba_piped_to_sed_is_a_fragment_at_its_numbers():
    out = mini_out("  1450\t            ):\n  1451\t                diffs = x\n  1452\t\n")
    c = one(capture_tool_output(mini_cmd("nl -ba astropy/io/fits/diff.py | sed -n '1450,1452p'"),
                                out))
    assert c == CapturedFile("astropy/io/fits/diff.py",
                             "            ):\n                diffs = x\n\n", 1450, True, "nl")


def test_nl_ba_head_tail_window():
    out = mini_out("".join(f"{n:6}\tline {n}\n" for n in range(201, 204)))
    c = one(capture_tool_output(mini_cmd("nl -ba d.py | head -n 203 | tail -n 3"), out))
    assert (c.first_line, c.text) == (201, "line 201\nline 202\nline 203\n")


def test_nl_ba_piped_to_multi_range_sed():
    out = mini_out("   385\ta\n   386\tb\n   450\tc\n")
    caps = capture_tool_output(mini_cmd("nl -ba w.py | sed -n '385,386p;450,450p'"), out)
    assert [(c.first_line, c.text) for c in caps] == [(385, "a\nb\n"), (450, "c\n")]
    # Without a gutter the two ranges would run together: not captured.
    assert capture_tool_output(mini_cmd("cat w.py | sed -n '1,2p;9,9p'"), mini_out("a\nb\nc\n")) \
        == []


def test_sed_range_fragment():
    out = mini_out("    def _set_col_formats(self):\n        \"\"\"WRITE.\"\"\"\n")
    c = one(capture_tool_output(mini_cmd("sed -n '934,935p' astropy/io/ascii/core.py"), out))
    assert (c.first_line, c.is_fragment, c.kind) == (934, True, "sed-n")
    assert c.text == "    def _set_col_formats(self):\n        \"\"\"WRITE.\"\"\"\n"


def test_sed_pattern_range_has_unknown_position():
    c = one(capture_tool_output(mini_cmd("sed -n '/def f/,/return/p' a.py"),
                                mini_out("def f():\n    return 1\n")))
    assert (c.first_line, c.is_fragment) == (None, True)


def test_head_short_file_is_whole_long_file_is_fragment():
    body = mini_out("a\nb\nc\n")
    assert not one(capture_tool_output(mini_cmd("head -n 50 a.py"), body)).is_fragment
    c = one(capture_tool_output(mini_cmd("head -n 3 a.py"), body))
    assert (c.first_line, c.is_fragment, c.kind) == (1, True, "head")


def test_tail_fragment_position_unknown_unless_plus_form():
    c = one(capture_tool_output(mini_cmd("tail -n 2 a.py"), mini_out("y\nz\n")))
    assert (c.first_line, c.is_fragment, c.kind) == (None, True, "tail")
    c = one(capture_tool_output(mini_cmd("tail -n +5 a.py"), mini_out("y\nz\n")))
    assert c.first_line == 5


def test_grep_n_hits_become_runs_of_adjacent_lines():
    out = mini_out("12:    foo = 1\n13:    bar = 2\n40:baz()\n")
    caps = capture_tool_output(mini_cmd('grep -n "foo\\|bar\\|baz" pkg/m.py'), out)
    assert caps == [CapturedFile("pkg/m.py", "    foo = 1\n    bar = 2\n", 12, True, "grep-n"),
                    CapturedFile("pkg/m.py", "baz()\n", 40, True, "grep-n")]


def test_grep_n_context_groups():
    out = mini_out("11-    ctx\n12:    hit\n13-\n--\n39-a = 1\n40:b = 2\n")
    caps = capture_tool_output(mini_cmd('grep -n -C 1 "hit\\|b =" m.py'), out)
    assert [(c.first_line, c.text) for c in caps] == [(11, "    ctx\n    hit\n\n"),
                                                     (39, "a = 1\nb = 2\n")]


def test_grep_combined_flags():
    out = mini_out("14:def CASCADE(c):\n15-    c.collect()\n")
    c = one(capture_tool_output(mini_cmd('grep -nA1 "def CASCADE" deletion.py'), out))
    assert (c.first_line, c.text) == (14, "def CASCADE(c):\n    c.collect()\n")


def test_plain_grep_hits_are_separate_fragments_of_unknown_position():
    caps = capture_tool_output(mini_cmd('grep "import" m.py'),
                               mini_out("import os\nimport sys\n"))
    assert [(c.text, c.first_line, c.kind) for c in caps] == [("import os\n", None, "grep"),
                                                             ("import sys\n", None, "grep")]


def test_plain_grep_with_context_groups_on_separators():
    caps = capture_tool_output(mini_cmd('grep -A 1 "def" m.py'),
                               mini_out("def a():\n    pass\n--\ndef b():\n    return\n"))
    assert [c.text for c in caps] == ["def a():\n    pass\n", "def b():\n    return\n"]


def test_nl_piped_to_grep_context_keeps_numbers():
    out = mini_out("   864\t        x\n   865\t    def __getattr__(self):\n--\n   900\t    y\n")
    caps = capture_tool_output(mini_cmd('nl -ba sky.py | grep -C 1 "__getattr__\\|y"'), out)
    assert [(c.first_line, c.text) for c in caps] == [
        (864, "        x\n    def __getattr__(self):\n"), (900, "    y\n")]


def test_nl_piped_to_grep_n_double_gutter():
    out = mini_out("262:   262\t    def delete(self):\n263-   263\t        pass\n")
    c = one(capture_tool_output(mini_cmd('nl -ba deletion.py | grep -n "def delete" -A 1'), out))
    assert (c.first_line, c.text) == (262, "    def delete(self):\n        pass\n")


def test_truncated_mini_output_gives_head_and_tail_of_whole_lines():
    out = ("<returncode>0</returncode>\n<warning>\nThe output of your last command was too long."
           "\n</warning><output_head>\nline 1\nline 2\npart\n</output_head>\n<elided_chars>\n"
           "7668 characters elided\n</elided_chars>\n<output_tail>\nial\nline 99\nline 100\n\n"
           "</output_tail>")
    caps = capture_tool_output(mini_cmd("cat big.py"), out)
    assert [(c.text, c.first_line, c.is_fragment) for c in caps] == [
        ("line 1\nline 2\n", 1, True), ("line 99\nline 100\n", None, True)]
    # a head that mentions the markers on their own lines (mini-swe-agent's own template):
    # the head ends at the elision block (the tail had begun at the head's <output_tail>)
    head = "line 1\n</output_head>\n<output_tail>\n{{ output }}\n</output_tail>\nline 9"
    out = out.replace("line 1\nline 2\npart", head)
    caps = capture_tool_output(mini_cmd("cat big.py"), out)
    assert [(c.text, c.first_line, c.is_fragment) for c in caps] == [
        (head.rsplit("\n", 1)[0] + "\n", 1, True), ("line 99\nline 100\n", None, True)]


def test_cd_prefix_joins_relative_path():
    c = one(capture_tool_output(mini_cmd("cd /testbed && cat ./pkg/../pkg/a.py"), mini_out("x\n")))
    assert c.path == "/testbed/pkg/a.py"


# ---------------------------------------------------------------- SWE-agent / OpenHands


def test_swe_bash_cat_with_observation_prefix_and_crlf():
    msg = swe_call("bash", command="cd /testbed && cat setup.cfg")
    c = one(capture_tool_output(msg, swe_out("[metadata]\nname = astropy")))
    assert c == CapturedFile("/testbed/setup.cfg", "[metadata]\nname = astropy\n", None, False,
                             "cat")


def test_swe_grep_n():
    msg = swe_call("bash", command='grep -n "command" /testbed/astropy/io/ascii/qdp.py')
    caps = capture_tool_output(msg, swe_out('31:        Line type: "comment"\n36:    \'command\''))
    assert [(c.path, c.first_line) for c in caps] == [("/testbed/astropy/io/ascii/qdp.py", 31),
                                                     ("/testbed/astropy/io/ascii/qdp.py", 36)]


VIEW_WHOLE = ("Here's the result of running `cat -n` on /testbed/a.py:\n"
              "     1\timport os\n     2\t\n     3\tx = 1\n     4")


def test_swe_view_whole_drops_the_trailing_empty_row():
    msg = swe_call("str_replace_editor", command="view", path="/testbed/a.py")
    c = one(capture_tool_output(msg, swe_out(VIEW_WHOLE)))
    assert c == CapturedFile("/testbed/a.py", "import os\n\nx = 1\n", None, False, "swe-view")


def test_swe_view_recognised_without_command():
    assert not one(capture_tool_output(None, swe_out(VIEW_WHOLE))).is_fragment


def test_swe_view_range_is_a_fragment():
    msg = swe_call("str_replace_editor", command="view", path="/testbed/q.py",
                   view_range=[60, 62])
    out = swe_out("Here's the result of running `cat -n` on /testbed/q.py:\n"
                  "    60\t    ValueError: x\n    61\t    \"\"\"\n    62\t    _re = r\"READ\"")
    c = one(capture_tool_output(msg, out))
    assert (c.first_line, c.is_fragment, c.text) == (
        60, True, '    ValueError: x\n    """\n    _re = r"READ"\n')


def test_swe_view_clipped_drops_the_cut_line():
    out = swe_out("Here's the result of running `cat -n` on /testbed/q.py:\n"
                  "     1\ta\n     2\tb\n     3\tThis file format can conta<response clipped>"
                  "<NOTE>To save on context only part of this file has been shown to you.</NOTE>")
    c = one(capture_tool_output(swe_call("str_replace_editor", command="view",
                                         path="/testbed/q.py"), out))
    assert (c.text, c.first_line, c.is_fragment) == ("a\nb\n", 1, True)



def test_a_file_that_mentions_the_tools_markers_is_captured_whole():
    """The markers a tool appends (SWE-agent's ``<response clipped><NOTE>``, its edit
    footer, the abbreviated view's end) are the last ones in an output: a file mentioning
    ``<response clipped>`` was captured only up to there (this package's own sources in
    the demo: tau 2.533 -> 2.697 with the fix, a helper measured), and mini-swe-agent
    dropped a whole output whose file mentions ``<output_head>`` (its cut form begins
    ``<warning>``)."""
    text = 'import re\nCLIP = "<response clipped><NOTE>"\nHEAD = "<output_head>"\n' \
        'FOOT = "Review the changes and make sure they are as expected"\ny = 2\n'
    numbered = "".join(f"{i:6}\t{line}\n" for i, line in enumerate(text.splitlines(), 1))
    view = swe_call("str_replace_editor", command="view", path="/t/q.py")
    out = swe_out("Here's the result of running `cat -n` on /t/q.py:\n" + numbered)
    assert texts(capture_tool_output(view, out)) == [("/t/q.py", text, None, False)]
    clipped = out + "     6\tcut he<response clipped><NOTE>To save on context only part.</NOTE>"
    assert texts(capture_tool_output(view, clipped)) == [("/t/q.py", text, 1, True)]
    assert texts(capture_tool_output(swe_call("bash", command="cat -n /t/q.py"),
                                     swe_out(numbered))) == [("/t/q.py", text, None, False)]
    assert texts(capture_tool_output(mini_cmd("cat m.py"), mini_out(text))) == [
        ("m.py", text, None, False)]
    edit = swe_out("The file /t/q.py has been edited. Here's the result of running `cat -n` "
                   "on a snippet of /t/q.py:\n" + numbered +
                   "Review the changes and make sure they are as expected. Edit the file again "
                   "if necessary.")
    assert texts(capture_tool_output(swe_call("str_replace_editor", command="str_replace",
                                              path="/t/q.py", old_str="a", new_str="b"),
                                     edit)) == [("/t/q.py", text, 1, True)]

def test_swe_edit_snippet():
    out = swe_out("The file /testbed/q.py has been edited. Here's the result of running `cat -n` "
                  "on a snippet of /testbed/q.py:\n    70\t    x = 1\n    71\t\n"
                  "Review the changes and make sure they are as expected. Edit the file again "
                  "if necessary.")
    c = one(capture_tool_output(swe_call("str_replace_editor", command="str_replace",
                                         path="/testbed/q.py", old_str="a", new_str="b"), out))
    assert c == CapturedFile("/testbed/q.py", "    x = 1\n\n", 70, True, "swe-edit")


def test_swe_abbreviated_view_splits_at_elided_lines():
    out = swe_out("<NOTE>This file is too large to display entirely. Showing abbreviated version."
                  "</NOTE>\n     1 \"\"\"Base.\"\"\"\n     2 \n     3     def f(self):\n"
                  "     4 ... eliding lines 4-9 ...\n    10 \n    11 x = 1\n"
                  "<IMPORTANT><NOTE>The above file has been abbreviated.</NOTE></IMPORTANT>")
    caps = capture_tool_output(swe_call("str_replace_editor", command="view",
                                        path="/testbed/b.py"), out)
    assert [(c.path, c.first_line, c.text, c.is_fragment) for c in caps] == [
        ("/testbed/b.py", 1, '"""Base."""\n\n    def f(self):\n', True),
        ("/testbed/b.py", 10, "\nx = 1\n", True)]


def test_swe_agent_open_window():
    out = ("[File: /repo/src/m.py (120 lines total)]\n(20 more lines above)\n21:    def foo():\n"
           "22:        pass\n23:\n(97 more lines below)\n")
    c = one(capture_tool_output("```\nopen src/m.py 22\n```", out))
    assert c == CapturedFile("/repo/src/m.py", "    def foo():\n        pass\n\n", 21, True,
                             "swe-open")


def test_openhands_open_file_whole():
    out = ("[File: /workspace/test.py (3 lines total)]\n(this is the beginning of the file)\n"
           "1|def hello():\n2|    print(\"Hello\")\n3|\n(this is the end of the file)\n")
    c = one(capture_tool_output(None, out))
    assert c == CapturedFile("/workspace/test.py", 'def hello():\n    print("Hello")\n\n', None,
                             False, "openhands-view")


# ---------------------------------------------------------------- aider listings in context


def test_aider_listing_in_output():
    out = "src/app.py\n```\nimport os\n\nprint(os.name)\n```\n"
    c = one(capture_tool_output(None, out))
    assert c == CapturedFile("src/app.py", "import os\n\nprint(os.name)\n", None, False,
                             "aider-fence")


# ---------------------------------------------------------------- outputs that are not files


@pytest.mark.parametrize("command, output", [
    (mini_cmd("python -m pytest tests/test_a.py -q"),
     mini_out("..F\n=== FAILURES ===\nE   assert 1 == 2\n1 failed, 2 passed in 0.1s\n", rc=1)),
    (mini_cmd("ls -la astropy/io/ascii"),
     mini_out("total 2168\ndrwxrwxrwx 5 root root 4096 Oct 24  2024 .\n")),
    (mini_cmd("cat missing.py"),
     mini_out("cat: missing.py: No such file or directory\n", rc=1)),
    (mini_cmd("cat a.py && cat b.py"), mini_out("a\nb\n")),
    (mini_cmd("cat a.py b.py"), mini_out("a\nb\n")),
    (mini_cmd("grep -rn foo ."), mini_out("./a.py:1:foo\n")),
    (mini_cmd("grep -c foo a.py"), mini_out("3\n")),
    (mini_cmd("sed -n '1452p' diff.py | od -c"), mini_out("0000000   e   l\n")),
    (mini_cmd("grep -n nothing a.py"), mini_out("", rc=1)),
    (None, mini_out("import os\n")),
    (swe_call("bash", command="cat /testbed/nope.py"),
     swe_out("cat: /testbed/nope.py: No such file or directory")),
    (swe_call("bash", command="cd /testbed && cat empty.py"),
     swe_out("Your last command ran successfully and did not produce any output.")),
    (swe_call("bash", command="cd /testbed && python reproduce.py"),
     swe_out("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: x")),
    (swe_call("str_replace_editor", command="view", path="/testbed"),
     swe_out("Here's the files and directories up to 2 levels deep in /testbed, excluding "
             "hidden items:\n/testbed\n/testbed/setup.py")),
    (swe_call("str_replace_editor", command="create", path="/testbed/r.py", file_text="x\n"),
     swe_out("File created successfully at: /testbed/r.py")),
])
def test_non_file_outputs_capture_nothing(command, output):
    assert capture_tool_output(command, output) == []


def test_capture_tool_output_rejects_non_str():
    with pytest.raises(ValueError, match="output"):
        capture_tool_output(None, b"x")
    with pytest.raises(ValueError, match="command"):
        capture_tool_output(3, "x")


# ---------------------------------------------------------------- strip_line_gutters


@pytest.mark.parametrize("text, expected", [
    ("     1\timport os\n     2\t\n     3\tx = 1\n", "import os\n\nx = 1\n"),
    ("     1\ta\r\n     2\tb", "a\nb\n"),
    ("1000000\ta\n1000001\tb\n", "a\nb\n"),            # wider numbers push the TAB right
    ("    10 x = 1\n    11 y = 2\n", "x = 1\ny = 2\n"),  # SWE-agent abbreviated view
    ("1|def f():\n2|    pass\n", "def f():\n    pass\n"),
    ("11-ctx\n12:hit\n--\n40:other\n", "ctx\nhit\nother\n"),
])
def test_strip_line_gutters(text, expected):
    assert strip_line_gutters(text) == expected


@pytest.mark.parametrize("text", [
    "", "import os\n", "  1\tx\n",         # too narrow for the 6-wide field
    "     2\ta\n     1\tb\n",              # numbers must increase
    "     1\ta\nplain\n",                  # every line must carry the gutter
])
def test_strip_line_gutters_rejects(text):
    assert strip_line_gutters(text) is None


# ---------------------------------------------------------------- agent writes


def test_mini_heredoc_quoted_delimiter():
    msg = mini_cmd("cat <<'EOF' > reproduce_issue.py\nfrom x import y\n\nprint(f\"{y}\")\nEOF")
    assert capture_agent_writes(msg) == [CapturedFile(
        "reproduce_issue.py", 'from x import y\n\nprint(f"{y}")\n', None, False, "heredoc")]


@pytest.mark.parametrize("script, path, text, fragment", [
    ("cat > /testbed/t.py << 'EOF'\na = 1\nEOF\n", "/testbed/t.py", "a = 1\n", False),
    ('cat <<"END" >test.sh\necho hi\nEND', "test.sh", "echo hi\n", False),
    ("cd /testbed && cat > t.py <<EOF && python t.py\nx\nEOF", "/testbed/t.py", "x\n", False),
    ("cat >> log.txt <<EOF\nmore\nEOF", "log.txt", "more\n", True),
    ("tee out.cfg <<EOF\n[a]\nEOF", "out.cfg", "[a]\n", False),
    ("tee --append out.cfg <<EOF\n[b]\nEOF", "out.cfg", "[b]\n", True),
    ("tee -a out.cfg <<EOF\n[b]\nEOF", "out.cfg", "[b]\n", True),
    # <<- strips every leading TAB of every body line, as bash does
    ("cat <<-EOF > t.py\n\tif x:\n\t\ty\n\tEOF", "t.py", "if x:\ny\n", False),
])
def test_heredoc_variants(script, path, text, fragment):
    c = one(capture_agent_writes(mini_cmd(script)))
    assert (c.path, c.text, c.is_fragment, c.kind) == (path, text, fragment, "heredoc")


def test_a_delimiter_word_that_goes_on_is_not_cut_short():
    """``<<END-X`` ends at a line ``END-X``, ``<<'E'OF`` at ``EOF``: read as ``END`` or ``E``,
    a body line ``END`` would cut the file short and call it whole. Not understood now."""
    for script in ("cat > a.txt <<END-X\nalpha\nEND\nbeta\nEND-X",
                   "cat > a.txt <<'E'OF\nalpha\nE\nbeta\nEOF"):
        assert capture_agent_writes(mini_cmd(script)) == [], script


def test_nested_heredoc_belongs_to_the_outer_body():
    script = "cat <<'EOF' > setup.sh\ncat <<'INNER' > a.py\nx = 1\nINNER\nEOF"
    c = one(capture_agent_writes(mini_cmd(script)))
    assert (c.path, c.text) == ("setup.sh", "cat <<'INNER' > a.py\nx = 1\nINNER\n")


def test_non_file_heredocs_and_non_shell_fences_write_nothing():
    assert capture_agent_writes(mini_cmd("python - <<'EOF'\nprint(1)\nEOF")) == []
    assert capture_agent_writes(mini_cmd("ed -s a.py <<EOF\n1d\nw\nEOF")) == []
    msg = "THOUGHT: e.g.\n```python\ncat > x.py <<EOF\ny\nEOF\n```\n\n```bash\nls\n```"
    assert capture_agent_writes(msg) == []


def test_swe_create_parses_json_arguments():
    text = 'print("\\u2713 ok")\n\tpath = "C:\\\\tmp"'
    msg = swe_call("str_replace_editor", command="create", path="/testbed/t.py", file_text=text)
    assert '\\"' in msg and "\\\\u2713" in msg  # escaped in the rendered call, as in the data
    c = one(capture_agent_writes(msg))
    assert c == CapturedFile("/testbed/t.py", text + "\n", None, False, "create")


def test_swe_bash_heredoc_tool_call():
    msg = swe_call("bash", command="cat > /testbed/r.py << 'EOF'\nimport sys\nEOF")
    assert one(capture_agent_writes(msg)).text == "import sys\n"


def test_aider_whole_listing_with_source_fence_and_crlf():
    msg = ("backend/settings.py\r\n<source>\r\nimport os\r\n\r\nDB = os.getenv(\"DB\")\r\n"
           "</source>\r\nbackend/__init__.py\r\n<source>\r\n# pkg\r\n</source>\r\n")
    caps = capture_agent_writes(msg)
    assert [(c.path, c.text, c.kind) for c in caps] == [
        ("backend/settings.py", 'import os\n\nDB = os.getenv("DB")\n', "aider-fence"),
        ("backend/__init__.py", "# pkg\n", "aider-fence")]


def test_aider_search_replace_new_file_only():
    """An empty SEARCH creates the file, or appends to it when it exists (aider's rule; a
    dev session appends to an ``/add``-ed file so): its text at an unknown position."""
    new = ("Here:\n\nschemas/v.ts\n```typescript\n<<<<<<< SEARCH\n=======\nimport { z } from "
           "\"zod\";\n>>>>>>> REPLACE\n```\n")
    assert capture_agent_writes(new) == [
        CapturedFile("schemas/v.ts", 'import { z } from "zod";\n', None, True, "aider-new")]
    edit = "a.py\n```python\n<<<<<<< SEARCH\nx = 1\n=======\nx = 2\n>>>>>>> REPLACE\n```\n"
    assert capture_agent_writes(edit) == []


def test_aider_indented_fences_are_paired():
    msg = ("- step:\n  ```\n  npm i\n  ```\n\ndist/index.js\n```javascript\n<<<<<<< SEARCH\n"
           "=======\nexport * from './a.js';\n>>>>>>> REPLACE\n```\n")
    assert [c.path for c in capture_agent_writes(msg)] == ["dist/index.js"]


def test_capture_agent_writes_rejects_non_str():
    with pytest.raises(ValueError, match="message"):
        capture_agent_writes(None)


# --------------------------------------------------------------------------------------------
# Cases from an audit of the capture on the dev sessions (each captured wrong text there, or
# could): what bash and sed print, not what the command line looks like
# --------------------------------------------------------------------------------------------

def texts(captures: list[CapturedFile]) -> list[tuple]:
    return [(c.path, c.text, c.first_line, c.is_fragment) for c in captures]


@pytest.mark.parametrize("script, blocks", [
    # each line matching the start opens a block that runs to the next end match
    ("/def f/,/return/p", ["def f(a):\n    return a\n", "def f(b):\n    x = 1\n    return b\n"]),
    # BRE operators: \( \) \| group and alternate; a plain + is a literal
    (r"/def \(f\|g\)/,/^    return/p",
     ["def f(a):\n    return a\n", "def f(b):\n    x = 1\n    return b\n"]),
    # the end pattern is not tried on a block's first line
    ("/def/,/def/p", ["def f(a):\n    return a\ndef f(b):\n"]),
])
def test_sed_pattern_ranges_are_one_fragment_per_block(script, blocks):
    out = {"/def f/,/return/p": "def f(a):\n    return a\ndef f(b):\n    x = 1\n    return b\n",
           r"/def \(f\|g\)/,/^    return/p":
               "def f(a):\n    return a\ndef f(b):\n    x = 1\n    return b\n",
           "/def/,/def/p": "def f(a):\n    return a\ndef f(b):\n"}[script]
    got = capture_tool_output(mini_cmd(f"sed -n '{script}' m.py"), mini_out(out))
    assert texts(got) == [("m.py", b, None, True) for b in blocks]
    # the same through a pipe
    piped = capture_tool_output(mini_cmd(f"cat m.py | sed -n '{script}'"), mini_out(out))
    assert texts(piped) == texts(got)


@pytest.mark.parametrize("command, out, want", [
    # hits among a range's blocks stand alone (y = 2 lies between them in the file)
    ("sed -n '/def/,/return/p' f.py | grep foo", "    x = 1  # foo\n    z = 3  # foo\n",
     ["    x = 1  # foo\n", "    z = 3  # foo\n"]),
    # context lines and grep's `--` would cross the blocks' ends unseen: nothing
    ("sed -n '/def/,/return/p' f.py | grep -A1 foo",
     "    x = 1  # foo\n    y = 2\n--\n    z = 3  # foo\n    q = 4\n", []),
    # a range over separate hits would join them
    ("grep foo f.py | sed -n '/def/,/return/p'", "def a():  # foo\n    return 1  # foo\n", []),
    # the last lines of the blocks: the first may be inside one
    ("sed -n '/def/,/return/p' f.py | tail -n 3", "    return 1\ndef b():\n    return 2\n",
     []),
    # plain nl numbers skip blank lines: hits numbered 1 and 2 may lie apart
    ("nl f.py | grep foo", "     1\ta = 1  # foo\n     2\tb = 2  # foo\n",
     ["a = 1  # foo\n", "b = 2  # foo\n"]),
    ("nl f.py | sed -n '1p;5p'", "     1\ta\n     2\tb\n", []),
])
def test_stages_after_a_range_or_plain_nl_never_join_lines_that_lie_apart(command, out,
                                                                          want):
    got = capture_tool_output(mini_cmd(command), mini_out(out))
    assert [c.text for c in got] == want and all(c.is_fragment for c in got)


def test_numbered_sed_pattern_blocks_are_placed_by_their_numbers():
    out = "     1\tdef f(a):\n     2\t    return a\n     7\tdef f(b):\n     8\t    return b\n"
    got = capture_tool_output(mini_cmd("nl -ba m.py | sed -n '/def f/,/return/p'"),
                              mini_out(out))
    assert texts(got) == [("m.py", "def f(a):\n    return a\n", 1, True),
                          ("m.py", "def f(b):\n    return b\n", 7, True)]


def test_sed_patterns_it_cannot_split_capture_nothing_or_single_lines():
    body = mini_out("import os\nimport re\n")
    # /A/p prints matching lines: separate hits, never one contiguous fragment
    assert texts(capture_tool_output(mini_cmd("sed -n '/^import/p' m.py"), body)) == [
        ("m.py", "import os\n", None, True), ("m.py", "import re\n", None, True)]
    # /A/,$p is one block to the end of the file
    assert texts(capture_tool_output(mini_cmd("sed -n '/^import/,$p' m.py"), body)) == [
        ("m.py", "import os\nimport re\n", None, True)]
    # a numeric end, the empty regex (the last one used) and word anchors: not understood
    for script in ("/^import/,5p", "/^import/,//p", r"/import/,/\<re\>/p"):
        assert capture_tool_output(mini_cmd(f"sed -n '{script}' m.py"), body) == []


@pytest.mark.parametrize("command", [
    'grep "x" pkg/*/s.py', "cat src/*.py", "head -n 5 a?.py", "nl -ba src/[ab].py",
    "sed -n '1,5p' src/*.py", "cat src/{a,b}.py", "tail -n 3 'src/*.py'",
    "cat src/{a,{b}}.py"])
def test_glob_operands_are_not_one_file(command):
    """A glob or brace operand may name several files: their lines are no one file's."""
    assert capture_tool_output(mini_cmd(command),
                               mini_out("pkg/a/s.py:    x = 1\npkg/b/s.py:    x = 2\n")) == []


@pytest.mark.parametrize("body, text", [
    ('x = "a\\\\\\\\.py"\n', 'x = "a\\\\.py"\n'),     # \\ -> \ (four backslashes become two)
    ("cost: \\$5 and `x`\n", None),                  # a backquote runs a command
    ("price \\$5\n", "price $5\n"),                  # \$ is a literal $
    ("a \\\nb\n", "a b\n"),                          # \<newline> joins the lines
    ("$(head -n 3 old.py)\ntail\n", None),           # command substitution: unknown text
    ("home=$HOME\n", None), ("x=${y}\n", None), ("n=$1\n", None),
    ("cost 5$ and $ alone\n", "cost 5$ and $ alone\n"),  # a $ before nothing expandable
    ("re = r'\\d+\\.'\n", "re = r'\\d+\\.'\n"),        # other backslashes stay
])
def test_unquoted_heredoc_bodies_are_what_bash_writes(body, text):
    got = capture_agent_writes(mini_cmd(f"cat <<EOF > f.py\n{body}EOF"))
    assert texts(got) == ([] if text is None else [("f.py", text, None, False)])
    # a quoted delimiter keeps the body literal
    assert texts(capture_agent_writes(mini_cmd(f"cat <<'EOF' > f.py\n{body}EOF"))) == [
        ("f.py", body, None, False)]


def test_heredoc_ends_only_at_its_exact_delimiter_line():
    script = "cat > a.txt <<'EOF'\nx\nEOF \n  EOF\ny\nEOF\n"
    assert texts(capture_agent_writes(mini_cmd(script))) == [
        ("a.txt", "x\nEOF \n  EOF\ny\n", None, False)]


def test_heredoc_header_search_is_linear_in_a_long_line():
    """A long line of ``; cat`` without a heredoc took seconds (a quadratic regex search);
    a header on a line past 4,096 characters is not read."""
    import time
    t0 = time.perf_counter()
    assert capture_agent_writes(mini_cmd("true" + "; cat x" * 10_000 + "\n")) == []
    assert capture_agent_writes(mini_cmd("true" + "; cat x" * 10_000 + " <<EOF > f\na\nEOF")) \
        == []
    assert time.perf_counter() - t0 < 1.0
    # headers after a long line, and two heredocs on two lines, are still found
    two = "true" + "; x" * 3000 + "\ncat > a <<'A'\n1\nA\ncat > b <<'B'\n2\nB\n"
    assert texts(capture_agent_writes(mini_cmd(two))) == [
        ("a", "1\n", None, False), ("b", "2\n", None, False)]



def test_heredoc_headers_cost_linear_time_in_many_long_lines():
    """Each line under 4,096 characters was searched from every ``;`` in it (quadratic in
    the line: 400 KB of 4 KB lines of ``; cat x`` took 2 s); each command of a line is
    matched once from its start now. A header after another command on its line is
    found, one after a pipe too (cat reads the heredoc, not the pipe)."""
    import time
    lines = "\n".join(["; cat x" * 580 + " <<"] * 100)
    t0 = time.perf_counter()
    assert capture_agent_writes(mini_cmd(lines)) == []
    assert time.perf_counter() - t0 < 0.5
    for script in ("cat a; cat > f <<'E'\nx\nE", "echo | cat > f <<'E'\nx\nE",
                   "true && tee f <<'E'\nx\nE"):
        assert texts(capture_agent_writes(mini_cmd(script))) == [
            ("f", "x\n", None, False)], script

def test_relative_cd_and_heredocs_after_cd_name_the_file_there():
    assert one(capture_tool_output(mini_cmd("cd astropy && cat io/x.py"),
                                   mini_out("a\n"))).path == "astropy/io/x.py"
    assert one(capture_agent_writes(mini_cmd("cd /testbed && cat > t.py <<'EOF'\nx\nEOF"))
               ).path == "/testbed/t.py"
    for cd in ("~/src", "-", "$HOME"):  # directories not known from the command
        assert one(capture_tool_output(mini_cmd(f"cd {cd} && cat io/x.py"),
                                       mini_out("a\n"))).path == "io/x.py"



def test_a_quoted_cd_is_unquoted_and_unspelled_names_are_not_captured():
    """``cd '/repo'`` goes to ``/repo`` (the quotes had stayed in the name); an operand or
    a directory with ``$`` or a backquote names what the shell expands it to: ``cat $F``
    is not captured (under ``$F`` two files would share a name), a relative path after
    ``cd /r/$X`` keeps its own name, as after ``cd ~``."""
    for cd, path in (("'/repo'", "/repo/a.py"), ('"/my dir"', "/my dir/a.py"),
                     ("/r/$X", "a.py"), ("`pwd`", "a.py"), ("'$X'", "a.py")):
        assert one(capture_tool_output(mini_cmd(f"cd {cd} && cat a.py"),
                                       mini_out("x\n"))).path == path, cd
        assert one(capture_agent_writes(mini_cmd(f"cd {cd} && cat > a.py <<'E'\nx\nE"))
                   ).path == path, cd
    for operand in ("$F", '"$F/a.py"', "`ls`", "${D}/a.py"):
        assert capture_tool_output(mini_cmd(f"cat {operand}"), mini_out("x\n")) == []
        assert capture_agent_writes(mini_cmd(f"cat > {operand} <<'E'\nx\nE")) == []


def test_a_redirect_past_the_heredocs_command_is_another_commands():
    """``cat <<EOF | python3 > out.txt`` writes the script's output to out.txt, not the
    heredoc (it had been captured as out.txt's text); ``cat a | python3 <<EOF > o`` is
    python's heredoc. A redirect of the same command is kept, whatever follows it."""
    for script in ("cat <<EOF | python3 > out.txt\nx\nEOF",
                   "cat <<EOF || echo no > out.txt\nx\nEOF",
                   "cat <<EOF; echo > out.txt\nx\nEOF",
                   "cat a.py | python3 <<EOF > out.txt\nx\nEOF"):
        assert capture_agent_writes(mini_cmd(script)) == [], script
    for script in ("cat <<EOF > f.txt 2>&1 | tee log\nx\nEOF",
                   "cat <<EOF 2>&1 > f.txt && python3 f.txt\nx\nEOF"):
        assert texts(capture_agent_writes(mini_cmd(script))) == [
            ("f.txt", "x\n", None, False)], script

def test_swe_agent_insert_snippets_are_captured_at_their_lines():
    head = ("The file /t/a.py has been edited. Here's the result of running `cat -n` on a "
            "snippet of the edited file:\n     3\tx\n     4\ty\n")
    for footer in ("Review the changes and make sure they are as expected (correct indentation, "
                   "no duplicate lines, etc). Edit the file again if necessary.",
                   "Review the changes and make sure they are as expected. Edit the file again "
                   "if necessary."):
        assert texts(capture_tool_output(None, head + footer)) == [
            ("/t/a.py", "x\ny\n", 3, True)]


def test_outputs_that_are_not_the_command_s_file_capture_nothing():
    # mini-swe-agent's message for a command it killed
    timeout = ("The last command <command>cat big.log</command> timed out and has been killed."
               "\nThe output of the command was:\n<output>\npartial\n</output>\n")
    assert capture_tool_output(mini_cmd("cat big.log"), timeout) == []
    # several tool calls: the output may be another call's
    calls = "".join("<tool_call>" + json.dumps({"name": n, "arguments": a}) + "</tool_call>\n"
                    for n, a in (("bash", {"command": "cat /a.py"}),
                                 ("str_replace_editor", {"command": "create", "path": "/b",
                                                         "file_text": "x"})))
    assert capture_tool_output(calls, "OBSERVATION:\nFile created successfully at: /b") == []
    # grep's colour codes
    assert capture_tool_output(mini_cmd("grep --color=always foo a.py"),
                               mini_out("\x1b[01;31mfoo\x1b[m\n")) == []


def test_tail_from_line_zero_is_the_whole_file():
    assert texts(capture_tool_output(mini_cmd("tail -n +0 a.py"), mini_out("a\nb\n"))) == [
        ("a.py", "a\nb\n", None, False)]
    assert texts(capture_tool_output(mini_cmd("cat a.py | tail -n +0"), mini_out("a\nb\n"))) \
        == [("a.py", "a\nb\n", None, False)]


# ---------------------------------------------------------------- untrusted text
BIG = "1" * 4301  # past int()'s digit limit (CPython: ValueError)


@pytest.mark.parametrize("fn,args", [
    (capture_agent_writes, ("<tool_call>" + "[" * 100_000,)),  # JSON past the recursion limit
    (capture_tool_output, ("<tool_call>" + "[" * 100_000, "x")),
    (capture_agent_writes, ('<tool_call>{"name":"bash","arguments":"' + "[" * 100_000 + '"}'
                            '</tool_call>',)),
    (capture_tool_output, (mini_cmd(f"sed -n '{BIG}p' a.py"), mini_out("x\n"))),
    (capture_tool_output, (mini_cmd(f"head -n {BIG} a.py"), mini_out("x\n"))),
    (capture_tool_output, (mini_cmd("cat -n a.py"), mini_out(BIG + "\tx\n"))),
    (capture_tool_output, (mini_cmd("grep -n x a.py"), mini_out(BIG + ":x\n"))),
    (capture_tool_output, (mini_cmd("cat a.py"), f"<returncode>{BIG}</returncode>\n<output>\n"
                                                 f"x\n</output>")),
    (capture_tool_output, (None, f"[File: a.py ({BIG} lines total)]\n1:x\n")),
    (capture_tool_output, (mini_cmd(r"sed -n '/x/,/a\{9999999999\}/p' a.py"),
                           mini_out("x\ny\n"))),  # a repeat count the regex engine refuses
    (capture_tool_output, (mini_cmd("sed -n '/x/,/" + r"\(" * 2000 + "a" + r"\)" * 2000 +
                                    "/p' a.py"), mini_out("x\ny\n"))),
])
def test_text_past_the_parsers_limits_captures_nothing(fn, args):
    """Nesting past the recursion limit, numbers past int()'s digit limit, a repeat count
    past the regex engine's: nothing captured, nothing raised (it raised inside the append
    or open_session that the capture serves)."""
    assert fn(*args) == []


def test_captures_the_workspace_refuses_are_dropped():
    """A view numbered from 0 (first_line 0) and a file text a JSON escape made a lone
    surrogate: the workspace tier refuses both (ValueError), after open_session had opened
    its session or append had taken its tokens; they are not captured now."""
    view0 = "Here's the result of running `cat -n` on a.py:\n     0\tx = 1\n     1\ty = 2\n"
    assert capture_tool_output(None, view0) == []
    assert capture_tool_output(mini_cmd("grep -n x a.py"), mini_out("0:x\n")) == []
    msg = ('<tool_call>{"name": "str_replace_editor", "arguments": {"command": "create", '
           '"path": "/repo/a.py", "file_text": "x = \'\\ud800\'\\n"}}</tool_call>')
    assert capture_agent_writes(msg) == []
    assert strip_line_gutters(BIG + "\tx\n") is None
    # the same texts through the decoder: nothing raised, nothing half done
    from agspec_gpu import SpecDecoder
    from agspec_gpu.tokenizer import load_tokenizer
    from tiny_models import tiny_model
    tok = load_tokenizer("cl100k")
    dec = SpecDecoder(tiny_model("llama", "sdpa", tok.vocab_size), tok)
    sid = dec.open_session("t", "default", tok.encode("hello"), text=view0)
    for t in tok.encode(msg):  # the model writes the message with the escape, a token a step
        draft = dec.propose([sid])
        logits = torch.zeros(1, 1 + draft.max_nodes, tok.vocab_size)
        logits[..., t] = 1.0
        dec.commit([sid], draft, logits, max_new_tokens=1)
    before = dec.session_stats(sid).context_len
    assert dec.append(sid, tok.encode("File created."), text="File created.") == []
    assert dec.session_stats(sid).context_len == before + len(tok.encode("File created."))


def test_a_range_end_pattern_that_could_backtrack_captures_nothing():
    """The end pattern of ``sed -n '/A/,/B/p'`` is the agent's and is searched on the tool's
    lines: two repetitions or a repeated group could take Python's backtracking search
    cubic or exponential time (``\\(a\\+\\)\\+b`` took seconds on a line of 129 ``a``), so
    such a pattern captures nothing, nor does a line past 4,096 characters; one repetition
    captures as before."""
    import time
    body = mini_out("x\n" + "a" * 200 + "\n")
    for end in (r"\(a\+\)\+b", "a*a*b", r"a\{2,\}a*b"):
        t0 = time.perf_counter()
        assert capture_tool_output(mini_cmd(f"sed -n '/x/,/{end}/p' a.py"), body) == []
        assert time.perf_counter() - t0 < 1.0, end
    one_repeat = mini_cmd("sed -n '/def f/,/^ *return/p' a.py")
    c = one(capture_tool_output(one_repeat, mini_out("def f():\n    return 1\n")))
    assert c.text == "def f():\n    return 1\n"
    long_line = mini_out("def f():\n" + "x" * 5000 + "\n    return 1\n")
    assert capture_tool_output(one_repeat, long_line) == []


_EDITED = "x has been edited. Here's the result of running `cat -n` on a snippet of y"


@pytest.mark.parametrize("fn,args", [
    # an edit header's lazy path groups over a long first line (6.3 s before)
    (capture_tool_output, (None, "The file " + _EDITED * 4000)),
    # mini-swe-agent openers without their closers (3.5 s / 21 s before)
    (capture_tool_output, (mini_cmd("cat a.py"), "<returncode>0</returncode>\n" +
                           "<output_head>\n" * 20_000)),
    (capture_tool_output, (mini_cmd("cat a.py"), "<returncode>0</returncode>\n<output_head>"
                           "\nx\n</output_head>\n" + "<output_tail>\n" * 20_000)),
    # a glob's braces and a whitespace run in a read command, a long word (shlex)
    (capture_tool_output, (mini_cmd("cat " + "{" * 16_000), mini_out("x\n"))),
    (capture_tool_output, (mini_cmd("cat" + " " * 16_000 + "a.py"), mini_out("x\n"))),
    (capture_tool_output, (mini_cmd("cat " + "a" * 300_000), mini_out("x\n"))),
    # tool-call openers that do not parse (2.4 s before)
    (capture_agent_writes, ("<tool_call> \n" * 25_000,)),
])
def test_long_untrusted_text_is_parsed_in_linear_time(fn, args):
    """Inputs a helper's fuzz found taking time quadratic in their length (seconds at a few
    hundred KB, inside the serialized append of a serving loop): well under a second now."""
    import time
    t0 = time.perf_counter()
    fn(*args)
    assert time.perf_counter() - t0 < 1.0
