"""Triton compiles inside a timed region.

A Triton kernel is compiled (or read back from Triton's disk cache and loaded) the first time
it runs with a new specialization of its arguments; inside a timed step that is the
compiler's time, not the kernel's. The benchmarks warm up first, then count what still
compiles during each timed run, and report it beside the run's times: a row whose count is
not 0 timed some JIT.

On a CPU (the torch paths, or Triton's interpreter) nothing compiles and the count stays 0.
"""

from __future__ import annotations

import time

import triton


class TritonCompiles:
    """Counts Triton JIT compiles while entered, through Triton's ``jit_cache_hook`` (called
    before a compile) and ``jit_post_compile_hook`` (after) knobs; hooks already set there
    are still called, and restored on exit.

    Attributes
    ----------
    count : compiles finished while entered
    seconds : their wall time (each from its cache hook to its post-compile hook)
    kernels : the compiled kernels' names, in order

    Example
    -------
    >>> with TritonCompiles() as jit:
    ...     run_timed_steps()
    >>> jit.count, jit.seconds
    """

    def __init__(self) -> None:
        self.count, self.seconds, self.kernels = 0, 0.0, []
        self._started: float | None = None
        self._saved = None

    def __enter__(self) -> "TritonCompiles":
        rt = triton.knobs.runtime
        before, after = self._saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)

        def cache_hook(**kw):
            self._started = time.perf_counter()
            return before(**kw) if before is not None else None  # True would skip the compile

        def post_compile_hook(**kw):
            if self._started is not None:
                self.seconds += time.perf_counter() - self._started
                self._started = None
            self.count += 1
            self.kernels.append(kw["fn"].name)
            return after(**kw) if after is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = cache_hook, post_compile_hook
        return self

    def __exit__(self, *exc) -> None:
        rt = triton.knobs.runtime
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._saved
