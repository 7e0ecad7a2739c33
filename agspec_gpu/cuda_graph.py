"""Capturing a step as a CUDA graph: the warm-up and capture every graphed step shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any], device: torch.device, warmup: int, pool) -> tuple:
    """``(graph, out)``: ``fn()`` run ``warmup`` times on a side stream (as capture requires:
    lazy initialisations, allocator pools), then captured into a ``torch.cuda.CUDAGraph``
    drawing on memory ``pool``; ``out`` is what the captured call returned, rewritten by
    every replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def capture_error(exc: BaseException) -> str:
    """What a failed capture reports: ``exc`` and the errors it was raised while handling.
    A failure inside ``torch.cuda.graph`` makes its exit end the capture too, which raises
    an error of its own (the capture was invalidated): the first cause is the one to read."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- while handling: ".join(parts)
