"""Compile Triton kernels for sm_90 without a GPU: catches what only the compiler rejects,
and register spills (``ptxas -v``), a slowdown only a GPU would otherwise show.

Under ``TRITON_INTERPRET=1`` (set by ``conftest.py`` on machines without CUDA) ``@triton.jit``
returns an ``InterpretedFunction``, which ``triton.compile`` cannot take (triton 3.6:
``'InterpretedFunction' object has no attribute 'cache_key'``), and the variable is read when
the module is imported. So the kernels' modules are re-imported in one child process without
the variable and compiled there; where a kernel is already a real ``JITFunction`` (a GPU
machine) it is compiled in process.

And how many compiles a kernel's launches would need on a GPU (:func:`num_compiles`): the
per-step kernels must not compile again when only the batch's sizes change.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import triton

_CHILD = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, sys.argv[2])
from kernel_compile import ptxas_usage
out = []
for module, name, signature, constexprs, options in eval(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in compiled.asm, (name, sorted(compiled.asm))
    out.append(dict(name=name, constexprs=constexprs, **options,
                    **ptxas_usage(compiled.asm["ptx"])))
print(json.dumps(out))
"""

# (kernel, signature, constexprs) or (kernel, signature, constexprs, options): options as the
# launcher passes them (``num_warps``), which set the registers a thread holds
KernelSpec = tuple


def ptxas_usage(ptx: str) -> dict[str, int]:
    """``{"registers", "spill_bytes"}`` of a kernel's PTX as ``ptxas -v`` reports them for
    sm_90a (the ``ptxas`` in the Triton wheel; Triton runs it with ``-v`` too, but keeps
    the log only when asked to dump it); and what can make a kernel's fp32 differ from torch's
    by a unit: ``"fma_f32"``, the PTX's fused multiply-adds (a contracted ``a * b + c``
    rounds once where torch rounds twice), ``"div_full_f32"``, its divisions that are not
    IEEE-rounded (Triton's ``/`` on fp32; ``tl.math.div_rn`` is)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True,
                             check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if regs is None:
        raise AssertionError(f"no register count in the ptxas log:\n{log}")
    return {"registers": int(regs.group(1)), "spill_bytes": max(spills, default=0),
            "fma_f32": ptx.count("fma.rn.f32"), "div_full_f32": ptx.count("div.full.f32")}


def compile_all_for_sm90(specs: list[KernelSpec], *, max_spill_bytes: int | None = 0
                         ) -> list[dict]:
    """Compiles every ``(kernel, signature, constexprs)`` to a cubin for sm_90 (one child)
    and returns each one's ``{"name", "registers", "spill_bytes"}``; with
    ``max_spill_bytes`` (default 0: none), a kernel that spills more registers to local
    memory than that fails: on a GPU the spills are memory traffic on every use, a slowdown
    no CPU test would see otherwise."""
    usage, interpreted = [], []
    for kernel, signature, constexprs, *more in specs:
        options = dict(more[0]) if more else {}
        if isinstance(kernel, triton.runtime.jit.JITFunction):
            source = triton.compiler.ASTSource(fn=kernel, signature=signature,
                                               constexprs=constexprs)
            compiled = triton.compile(source, options=options,
                                      target=triton.backends.compiler.GPUTarget("cuda", 90, 32))
            usage.append(dict(name=kernel.fn.__name__, constexprs=constexprs, **options,
                              **ptxas_usage(compiled.asm["ptx"])))
        else:  # InterpretedFunction wraps the Python function as .fn
            interpreted.append((kernel.fn.__module__, kernel.fn.__name__, signature, constexprs,
                                options))
    if interpreted:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        result = subprocess.run([sys.executable, "-c", _CHILD, repr(interpreted),
                                 os.path.dirname(os.path.abspath(__file__))], env=env,
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            names = [spec[1] for spec in interpreted]
            raise AssertionError(f"sm_90 compile of {names} failed:\n{result.stderr[-6000:]}")
        usage += json.loads(result.stdout.strip().splitlines()[-1])
    if max_spill_bytes is not None:
        spilling = [u for u in usage if u["spill_bytes"] > max_spill_bytes]
        assert not spilling, f"register spills over {max_spill_bytes} bytes: {spilling}"
    return usage


def compile_for_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object],
                     options: dict | None = None, *, max_spill_bytes: int | None = 0) -> dict:
    """Compiles ``kernel`` to a cubin for sm_90; raises AssertionError with the compiler log
    (or when it spills, see :func:`compile_all_for_sm90`). Returns its register usage.

    ``signature`` maps every argument name to a Triton type (``"*i32"``, ``"i64"``,
    ``"constexpr"``, ...); ``constexprs`` gives the values of the ``constexpr`` ones.
    """
    return compile_all_for_sm90([(kernel, signature, constexprs, options or {})],
                                max_spill_bytes=max_spill_bytes)[0]


# ------------------------------------------------------------------ compiles per launch shape
# Triton compiles a kernel once per *specialization* of its arguments: besides the
# constexprs, every int argument not marked ``do_not_specialize`` is classed as 1 (then folded
# in as a constant), divisible by 16, or neither, and every pointer not marked
# ``do_not_specialize_on_alignment`` as 16-byte aligned or not; each class is a compile of its
# own. An int that follows the batch (its size, its widths, its row counts), or a pointer into
# a staging ring whose lists start anywhere, would compile the kernel again in the middle of
# a serving run whenever the batch crosses a class (0.1-1.2 s per compile for sm_90 on the
# development machine, against 5-30 ms steps). The checks below run a kernel's launches
# (interpreted on a CPU) and say which specializations they would compile.

def _int_params(kernel) -> tuple[list[str], set[str], set[str], set[str]]:
    """``(argument names, constexpr names, do_not_specialize names,
    do_not_specialize_on_alignment names)`` of a ``JITFunction`` or (under
    ``TRITON_INTERPRET=1``) an ``InterpretedFunction``."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = [p.name for p in params]
    constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
    if isinstance(kernel, triton.runtime.jit.JITFunction):
        dns = {p.name for p in kernel.params if p.do_not_specialize}
        dnsoa = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
    else:
        dns, dnsoa = ({names[d] if isinstance(d, int) else d
                       for d in kernel.kwargs.get(key) or ()}
                      for key in ("do_not_specialize", "do_not_specialize_on_alignment"))
    return names, constexprs, dns, dnsoa


def specialization(kernel, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """``(constexprs and launch options, int arguments' classes and pointer arguments'
    alignments)`` of one launch of ``kernel``: two launches with equal results share one
    compiled kernel."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    names, constexprs, dns, dnsoa = _int_params(kernel)
    bound = dict(zip(names, args)) | kwargs
    consts = tuple(sorted((n, v) for n, v in bound.items()
                          if n in constexprs or n not in names))  # num_warps, ...
    classes = tuple(
        (n, native_specialize_impl(BaseBackend, v, False, n not in dns, n not in dnsoa))
        for n, v in bound.items()
        if n in names and n not in constexprs and (
            isinstance(v, torch.Tensor) or (isinstance(v, int) and not isinstance(v, bool))))
    return consts, classes


@contextmanager
def recorded_specializations(*kernels) -> Iterator[dict[str, list[tuple[tuple, tuple]]]]:
    """While open, the :func:`specialization` of every launch of ``kernels``, by kernel
    name (recorded by pre-run hooks, Triton's own, removed on exit)."""
    seen: dict[str, list] = {k.fn.__name__: [] for k in kernels}
    hooks = []
    for kernel in kernels:
        def hook(*args, _kernel=kernel, **kwargs):
            seen[_kernel.fn.__name__].append(specialization(_kernel, args, kwargs))

        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    try:
        yield seen
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def num_compiles(kernel, specs: Sequence[tuple[tuple, tuple]]) -> int:
    """How many compiles of ``kernel`` the launches ``specs`` need (one per constexpr
    config, asserted: no int argument that follows the batch is specialized)."""
    assert specs, f"{kernel.fn.__name__} was not launched"
    by_consts: dict[tuple, set[tuple]] = {}
    for consts, ints in specs:
        by_consts.setdefault(consts, set()).add(ints)
    split = {c: s for c, s in by_consts.items() if len(s) > 1}
    assert not split, (f"{kernel.fn.__name__}: one config compiled per int class or pointer "
                       f"alignment (mark the ints do_not_specialize, the pointers "
                       f"do_not_specialize_on_alignment): {split}")
    return len(by_consts)


def assert_one_compile_per_config(kernel, launches: Sequence[Callable[[], object]]) -> int:
    """Runs each of ``launches`` (the same kernel over batches of other sizes) and returns
    :func:`num_compiles` of their launches."""
    with recorded_specializations(kernel) as seen:
        for launch in launches:
            launch()
    return num_compiles(kernel, seen[kernel.fn.__name__])


class NoLaunch:
    """Stands in for a Triton kernel that a test says must not launch (its launcher runs the
    torch path at that size): ``monkeypatch.setattr(module, "_name_kernel", NoLaunch())``."""

    def __getitem__(self, grid):
        raise AssertionError("the kernel was launched")
