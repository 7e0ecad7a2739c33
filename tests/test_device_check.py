"""``bench/device_check.sh`` runs once per lent H200, in a budget of minutes: a benchmark
flag renamed or a test id moved here would cost that run. Without a GPU these check what
the script asks for: every benchmark command's arguments parse (its script stops right
after parsing), every test file and test id it names exists, and its inline Python
compiles and imports names that exist."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "bench" / "device_check.sh").read_text()

# the script's shell variables, as its steps expand them (paths need not exist: parsing
# does not open them)
GLOBAL = "--global /tmp/global.agspec --half 1"
EXPAND = [('"${GLOBAL[@]}"', "--global-corpus /tmp/global.agspec --half 1"),
          ("${GLOBAL:+" + GLOBAL + "}", GLOBAL),
          ('"$TRAJ_DIR"', "/tmp/traj"), ("$TRAJ", "/tmp/traj/a.jsonl.gz"),
          ('"$OUT', '"/tmp/out'), ("$DATE", "20261202"), ("$GPU", "h200")]


def _logical_lines() -> list[str]:
    """The script's lines with backslash continuations joined."""
    return SCRIPT.replace("\\\n", " ").splitlines()


def _bench_commands() -> list[tuple[str, list[str]]]:
    """``(script, argv)`` of every ``python3 bench/<name>.py ...`` the script runs."""
    out = []
    for line in _logical_lines():
        m = re.search(r"python3 (bench/\w+\.py)(.*)$", line)
        if m is None or line.lstrip().startswith("#"):
            continue
        args = m.group(2)
        for var, value in EXPAND:
            args = args.replace(var, value)
        assert "$" not in args, f"unexpanded variable in: {line}"
        out.append((m.group(1), shlex.split(args)))
    return out


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("script, argv", _bench_commands(),
                         ids=lambda x: x if isinstance(x, str) else None)
def test_benchmark_arguments_parse(script, argv, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    with pytest.raises(_Parsed):  # a bad flag is SystemExit(2) with argparse's message
        runpy.run_path(str(ROOT / script), run_name="__main__")


def test_e2e_methods_exist(monkeypatch):
    """The e2e steps' ``--methods`` (checked after parsing, when the run is minutes in)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_e2e

    runs = [argv for script, argv in _bench_commands() if script.endswith("bench_e2e.py")]
    assert len(runs) >= 2
    for argv in runs:
        args = bench_e2e.parse_args(argv)
        methods = args.methods or ",".join(bench_e2e.DEFAULT_METHODS)  # None: the default
        assert set(methods.split(",")) <= set(bench_e2e.METHOD_NAMES), methods
        assert all(int(b) >= 1 for b in args.batch_sizes.split(","))


def test_benchmark_commands_found():
    names = {Path(s).stem for s, _ in _bench_commands()}
    assert {"bench_e2e", "bench_drafter_step", "bench_decoder_step", "bench_layer_kernels",
            "bench_verify_kernels", "bench_match"} <= names, names


def test_named_tests_exist():
    """Test files, ``file::test`` ids and ``--deselect`` ids of the script's pytest steps
    (a parametrized id's test function must exist)."""
    named = set(re.findall(r"tests/test_\w+\.py(?:::[\w\[\]\-.]+)?", SCRIPT))
    assert len(named) > 20, named
    for ref in sorted(named):
        path, _, test = ref.partition("::")
        assert (ROOT / path).is_file(), ref
        if test:
            func = test.split("[")[0]
            tree = ast.parse((ROOT / path).read_text())
            assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, ref


def test_every_triton_kernel_is_tested_on_the_gpu():
    """Each ``kernels/`` module with a Triton kernel is imported by a test file that a pytest
    step of the script runs: a kernel added later gets its GPU comparison with the rest."""
    named = {Path(f).name for f in re.findall(r"tests/test_\w+\.py", SCRIPT)}
    tests = {f.name: f.read_text() for f in (ROOT / "tests").glob("test_*.py")}
    modules = [f.stem for f in sorted((ROOT / "kernels").glob("*.py"))
               if "@triton.jit" in f.read_text()]
    assert len(modules) >= 15, modules
    for mod in modules:
        use = re.compile(rf"kernels\.{mod}\b|from agspec_gpu\.kernels import [^\n]*\b{mod}\b")
        importers = {name for name, text in tests.items() if use.search(text)}
        assert importers & named, (mod, sorted(importers))


def test_inline_python_compiles_and_its_imports_exist():
    """The heredoc and ``-c`` programs: valid Python whose ``from agspec_gpu... import``
    names exist (the GPU-only calls themselves run on the device)."""
    programs = re.findall(r"<<'EOF'\n(.*?)\nEOF", SCRIPT, re.S)
    programs += re.findall(r'python3 (?:-P )?-c "(.*?)"', SCRIPT, re.S)
    assert len(programs) >= 3
    for src in programs:
        tree = ast.parse(src.replace("$OUT", "/tmp/out"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("agspec_gpu"):
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(mod, alias.name), f"{node.module}.{alias.name}"


@pytest.mark.parametrize("traj, want", [
    (".whl/a.jsonl.gz\n.whl/b.jsonl.gz\n.whl/c.jsonl.gz", ".whl"),  # ls of carried files
    (".whl/a.jsonl.gz", ".whl"), ("{tmp}", "{tmp}")])  # one file; a folder as it is
def test_the_trajectory_folder_of_the_carried_files(traj, want, tmp_path):
    """``TRAJ_DIR``, the folder ``bench_drafter_step.py --trajectories`` takes, from what
    ``ls .whl/*.jsonl.gz`` prints: one path per line, not one per space."""
    import subprocess

    line = next(ln for ln in _logical_lines() if ln.startswith("TRAJ_DIR="))
    traj, want = traj.format(tmp=tmp_path), want.format(tmp=tmp_path)
    got = subprocess.run(["bash", "-c", line + '; printf %s "$TRAJ_DIR"'],
                         env={"TRAJ": traj.replace("\\n", "\n"), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    assert got == want



@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                                  "NVIDIA A100-SXM4-80GB", ""])
def test_the_files_name_the_gpu_as_the_benchmarks_do(name, tmp_path, monkeypatch):
    """``$GPU``, the tag of the files the script writes, is ``devices.slug`` of the name
    ``nvidia-smi`` gives (the device tool lends H100s and H200s: an H100's run must not be
    saved as an H200's); no name (no nvidia-smi): ``gpu``."""
    import subprocess

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import devices

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n[ -n '{name}' ] && echo '{name}'\n")
    smi.chmod(0o755)
    lines = _logical_lines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("GPU=$(nvidia-smi"))
    assert lines[at + 1] == "GPU=${GPU:-gpu}"
    got = subprocess.run(["bash", "-c", "\n".join(lines[at:at + 2]) + '; printf %s "$GPU"'],
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True,
                         text=True, check=True).stdout
    assert got == (devices.slug(name) if name else "gpu")


@pytest.mark.parametrize("name, gbps", [
    ("NVIDIA H200", 4800.0), ("NVIDIA H200 NVL", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0),
    ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H100 NVL", 3900.0),
    ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100-SXM4-40GB", 1555.0),
    ("NVIDIA L40S", 864.0), ("NVIDIA GeForce RTX 4090", None)])
def test_the_bandwidth_goal_is_a_fraction_of_the_gpu_it_ran_on(name, gbps, monkeypatch):
    """Plain decode's bandwidth fraction (issue 7: >= 70% at B = 1) divides by the peak of
    the GPU that ran it, not the H200's on every GPU; an unknown GPU gets no fraction."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_e2e

    got, note = bench_e2e.peak_bandwidth_gbps(name)
    assert got == gbps and name in note
