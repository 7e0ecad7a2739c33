"""Counting what a step launches, on the CPU: the ops the torch dispatcher sees (views,
allocations and no-op conversions aside), with the parts that are one kernel or one CUDA
graph replay on a GPU counted as their launches."""

from __future__ import annotations

from collections.abc import Callable


class CountOps:
    """``with count.mode:`` appends each kernel-launching op's name to ``count.ops``."""

    FREE = {"view", "_unsafe_view", "expand", "permute", "select", "slice", "as_strided",
            "unsqueeze", "squeeze", "t", "transpose", "detach", "detach_", "alias", "reshape",
            "_reshape_alias", "empty", "empty_strided", "lift_fresh", "scalar_tensor",
            "to"}  # `to` that converts dispatches `_to_copy`, which counts

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.ops: list[str] = []
        self.paused = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if not outer.paused and name not in outer.FREE:
                    outer.ops.append(name)
                return func(*args, **(kwargs or {}))

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
