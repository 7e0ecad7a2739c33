"""Emission forms: exact strings, the diff forms against the real `diff -u`, JSON escapes."""

import json
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agspec_gpu.forms import (
    DEFAULT_FORMS,
    DEFAULT_INDENT_UNIT,
    EmissionForm,
    detect_indent_unit,
    render_form,
    render_forms,
)

F = EmissionForm
CODE = 'def f(x):\n    if x:\n        return "a\\b"\n\n    return\t1\n'


def test_form_values_and_default_set():
    assert [f.value for f in F] == ["raw", "diff+", "diff ", "diff-", "json", "indent+",
                                    "indent-"]
    assert DEFAULT_FORMS == tuple(F)


def test_exact_renderings():
    forms = render_forms(CODE)
    assert forms == {
        F.RAW: CODE,
        F.DIFF_ADD: '+def f(x):\n+    if x:\n+        return "a\\b"\n+\n+    return\t1\n',
        F.DIFF_CTX: ' def f(x):\n     if x:\n         return "a\\b"\n \n     return\t1\n',
        F.DIFF_DEL: '-def f(x):\n-    if x:\n-        return "a\\b"\n-\n-    return\t1\n',
        F.JSON: 'def f(x):\\n    if x:\\n        return \\"a\\\\b\\"\\n\\n    return\\t1\\n',
        F.INDENT_IN: '    def f(x):\n        if x:\n            return "a\\b"\n\n'
                     '        return\t1\n',
        F.INDENT_OUT: 'def f(x):\nif x:\n    return "a\\b"\n\nreturn\t1\n',
    }


def test_no_final_newline_is_kept_as_is():
    assert render_form("a\n\nb", F.DIFF_ADD) == "+a\n+\n+b"
    assert render_form("a\n", F.DIFF_DEL) == "-a\n"


def test_lines_split_at_newline_only():
    text = "a\x0cb\u2028c\rd\n"  # splitlines() would split these; diff does not
    assert render_form(text, F.DIFF_ADD) == "+" + text


# ------------------------------------------------------------------ diff forms vs diff -u


def _hunk_body(old: str, new: str, tmp_path) -> list[str]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text(old, newline="")
    b.write_text(new, newline="")
    proc = subprocess.run(["diff", "-U", "100000", str(a), str(b)], capture_output=True,
                          check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.decode("utf-8").split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("@@")) + 1
    return lines[start:-1]  # drop the headers and the split's trailing ""


DIFF_TEXTS = [
    CODE,
    "x = 1\n\n\n  \ny = [\n\t'+', '-',\n]\n",
    "+plus\n-minus\n \n@@ not a hunk\n",
    "unicod\u00e9 \u2713\n",
]


@pytest.mark.skipif(shutil.which("diff") is None, reason="diff binary not installed")
@pytest.mark.parametrize("text", DIFF_TEXTS)
def test_diff_forms_match_diff_u(text, tmp_path):
    def lines(rendered: str) -> list[str]:
        return rendered.split("\n")[:-1]

    assert _hunk_body(text, "", tmp_path) == lines(render_form(text, F.DIFF_DEL))
    assert _hunk_body("", text, tmp_path) == lines(render_form(text, F.DIFF_ADD))
    context = _hunk_body(text + "old\n", text + "new\n", tmp_path)
    assert context[-2:] == ["-old", "+new"]
    assert context[:-2] == lines(render_form(text, F.DIFF_CTX))


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_diff_forms_round_trip(text):
    for form, prefix in ((F.DIFF_ADD, "+"), (F.DIFF_CTX, " "), (F.DIFF_DEL, "-")):
        rendered = render_form(text, form)
        if not text:
            assert rendered == ""
            continue
        body = rendered[:-1] if text.endswith("\n") else rendered
        lines = body.split("\n")
        assert all(ln.startswith(prefix) for ln in lines)
        assert "\n".join(ln[1:] for ln in lines) + ("\n" if text.endswith("\n") else "") == text


# ------------------------------------------------------------------ JSON


@pytest.mark.parametrize("text, body", [
    ('say "hi"\n', 'say \\"hi\\"\\n'),
    ("C:\\tmp\\new", "C:\\\\tmp\\\\new"),
    ("\tindent\r\n", "\\tindent\\r\\n"),
    ("\u2713 ok \u00e9", "\\u2713 ok \\u00e9"),       # ensure_ascii, as in the SWE-agent data
    ("\U0001F600", "\\ud83d\\ude00"),
    ("\x00\x1f", "\\u0000\\u001f"),
    ("a/b", "a/b"),                                   # json.dumps does not escape '/'
])
def test_json_body_escapes(text, body):
    assert render_form(text, F.JSON) == body


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_json_body_is_what_a_tool_call_argument_holds(text):
    body = render_form(text, F.JSON)
    assert json.loads('"' + body + '"') == text
    call = json.dumps({"command": "create", "file_text": text})
    assert '"file_text": "' + body + '"' in call


# ------------------------------------------------------------------ indentation


@pytest.mark.parametrize("text, unit", [
    (CODE, "    "),
    ("function f() {\n  if (x) {\n    y();\n  }\n}\n", "  "),
    ("func f() {\n\tif x {\n\t\ty()\n\t}\n}\n", "\t"),
    ("no indentation here\n", DEFAULT_INDENT_UNIT),
    ("", DEFAULT_INDENT_UNIT),
    ("def f(a,\n      b):\n    return (a +\n            b)\n\ndef g():\n    pass\n", "    "),
    # a fragment starting inside a block: its depth is no step (a grep hit, a sed window)
    ("            for inline in admin.inlines:\n", DEFAULT_INDENT_UNIT),
    ("        query = Query(self.model)\n        query.add_filter(x)\n", DEFAULT_INDENT_UNIT),
    ("        if x:\n            y()\n        z()\n", "    "),
    ("      if x:\n        y()\n", "  "),
    # arguments aligned under a bracket are no unit, however often they step (17 spaces
    # had won on such a fragment)
    ("    result = compute(alpha,\n                     beta)\n    other = compute(a,\n"
     "                     b)\n    if x:\n        y()\n", "    "),
])
def test_detect_indent_unit(text, unit):
    assert detect_indent_unit(text) == unit


def test_indent_with_tabs():
    text = "func f() {\n\tif x {\n\t\ty()\n\t}\n}\n"
    assert render_form(text, F.INDENT_IN) == "\tfunc f() {\n\t\tif x {\n\t\t\ty()\n\t\t}\n\t}\n"
    assert render_form(text, F.INDENT_OUT) == "func f() {\nif x {\n\ty()\n}\n}\n"


def test_indent_in_leaves_blank_lines_and_out_leaves_shallow_lines():
    text = "a:\n  b\n\n   \n c\n"
    assert render_form(text, F.INDENT_IN, indent_unit="  ") == "  a:\n    b\n\n   \n   c\n"
    assert render_form(text, F.INDENT_OUT, indent_unit="  ") == "a:\nb\n\n \n c\n"


def test_explicit_indent_unit_overrides_detection():
    assert render_form("x\n    y\n", F.INDENT_IN, indent_unit="\t") == "\tx\n\t    y\n"


@pytest.mark.parametrize("unit", ["", "ab", " x", 4])
def test_bad_indent_unit(unit):
    with pytest.raises(ValueError, match="indent_unit"):
        render_form("x\n", F.INDENT_IN, indent_unit=unit)


# ------------------------------------------------------------------ render_forms contract


def test_empty_and_duplicate_forms_are_omitted():
    assert render_forms("") == {}
    forms = render_forms("flat\ntext\n")
    assert F.INDENT_OUT not in forms            # equals raw: nothing has an indent to remove
    assert F.RAW in forms and F.INDENT_IN in forms
    assert F.JSON not in render_forms("plain")  # JSON body equal to the raw text


def test_subset_of_forms_and_string_values():
    assert render_forms("a\n", [F.DIFF_ADD, "json"]) == {F.DIFF_ADD: "+a\n", F.JSON: "a\\n"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="text"):
        render_forms(b"x")
    with pytest.raises(ValueError, match="form"):
        render_form("x", "patch")
    with pytest.raises(ValueError, match="forms"):
        render_forms("x", "raw")
