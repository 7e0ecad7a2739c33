"""Compile Triton kernels for sm_90 without a GPU: catches what only the compiler rejects.

Under ``TRITON_INTERPRET=1`` (set by ``conftest.py`` on machines without CUDA) ``@triton.jit``
returns an ``InterpretedFunction``, which ``triton.compile`` cannot take (triton 3.6:
``'InterpretedFunction' object has no attribute 'cache_key'``), and the variable is read when
the module is imported. So the kernels' modules are re-imported in one child process without
the variable and compiled there; where a kernel is already a real ``JITFunction`` (a GPU
machine) it is compiled in process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import triton

_CHILD = """
import importlib, sys
import triton
from triton.backends.compiler import GPUTarget
for module, name, signature, constexprs in eval(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, (name, sorted(compiled.asm))
"""

KernelSpec = tuple[object, dict[str, str], dict[str, object]]


def compile_all_for_sm90(specs: list[KernelSpec]) -> None:
    """Compiles every ``(kernel, signature, constexprs)`` to a cubin for sm_90 (one child)."""
    interpreted = []
    for kernel, signature, constexprs in specs:
        if isinstance(kernel, triton.runtime.jit.JITFunction):
            source = triton.compiler.ASTSource(fn=kernel, signature=signature,
                                               constexprs=constexprs)
            triton.compile(source, target=triton.backends.compiler.GPUTarget("cuda", 90, 32))
        else:  # InterpretedFunction wraps the Python function as .fn
            interpreted.append((kernel.fn.__module__, kernel.fn.__name__, signature, constexprs))
    if not interpreted:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _CHILD, repr(interpreted)], env=env,
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        names = [name for _, name, _, _ in interpreted]
        raise AssertionError(f"sm_90 compile of {names} failed:\n{result.stderr[-6000:]}")


def compile_for_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object]) -> None:
    """Compiles ``kernel`` to a cubin for sm_90; raises AssertionError with the compiler log.

    ``signature`` maps every argument name to a Triton type (``"*i32"``, ``"i64"``,
    ``"constexpr"``, ...); ``constexprs`` gives the values of the ``constexpr`` ones.
    """
    compile_all_for_sm90([(kernel, signature, constexprs)])
