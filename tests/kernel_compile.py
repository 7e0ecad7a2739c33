"""Compile Triton kernels for sm_90 without a GPU: catches what only the compiler rejects,
and register spills (``ptxas -v``), a slowdown only a GPU would otherwise show.

Under ``TRITON_INTERPRET=1`` (set by ``conftest.py`` on machines without CUDA) ``@triton.jit``
returns an ``InterpretedFunction``, which ``triton.compile`` cannot take (triton 3.6:
``'InterpretedFunction' object has no attribute 'cache_key'``), and the variable is read when
the module is imported. So the kernels' modules are re-imported in one child process without
the variable and compiled there; where a kernel is already a real ``JITFunction`` (a GPU
machine) it is compiled in process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

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
    the log only when asked to dump it)."""
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
    return {"registers": int(regs.group(1)), "spill_bytes": max(spills, default=0)}


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
