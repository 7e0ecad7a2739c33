"""Counting what a step launches, on the CPU: the ops the torch dispatcher sees (views,
allocations and no-op conversions aside), with the parts that are one kernel or one CUDA
graph replay on a GPU counted as their launches."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CountOps:
    """``with count.mode:`` appends each kernel-launching op's name to ``count.ops``, and
    the name of each op whose output is new memory (an allocation: no input's storage)
    to ``count.allocs``."""

    FREE = {"view", "_unsafe_view", "expand", "permute", "select", "slice", "as_strided",
            "unsqueeze", "squeeze", "t", "transpose", "detach", "detach_", "alias", "reshape",
            "_reshape_alias", "empty", "empty_strided", "lift_fresh", "scalar_tensor",
            "to"}  # `to` that converts dispatches `_to_copy`, which counts

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.ops: list[str] = []
        self.allocs: list[str] = []
        self.paused = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if not outer.paused and name not in outer.FREE:
                    outer.ops.append(name)
                out = func(*args, **(kwargs or {}))
                if not outer.paused:
                    outer.allocs.extend([name] * _new_storages(out, (args, kwargs)))
                return out

        self.mode = Mode()

    def pause(self, fn: Callable) -> Callable:
        """``fn`` with counting off: what runs inside a graph or a single kernel."""
        def run(*a, **k):
            self.paused += 1
            try:
                return fn(*a, **k)
            finally:
                self.paused -= 1
        return run

    def launches(self, fn: Callable, name: str, n: int = 1) -> Callable:
        """``fn`` counted as ``n`` launches named ``name`` (a Triton launcher, a graph
        replay), whatever its torch path runs."""
        paused = self.pause(fn)

        def run(*a, **k):
            if not self.paused:
                self.ops.extend([name] * n)
            return paused(*a, **k)
        return run


def _storages(x, into: set[int]) -> set[int]:
    if isinstance(x, torch.Tensor):
        into.add(x.untyped_storage().data_ptr())
    elif isinstance(x, (list, tuple)):
        for y in x:
            _storages(y, into)
    elif isinstance(x, dict):
        _storages(list(x.values()), into)
    return into


def _new_storages(out, inputs) -> int:
    """Output tensors of nonzero size whose storage no input shares."""
    seen = _storages(inputs, set())
    outs = out if isinstance(out, (list, tuple)) else [out]
    return sum(1 for o in outs if isinstance(o, torch.Tensor) and
               o.untyped_storage().nbytes() > 0 and o.untyped_storage().data_ptr() not in seen)
