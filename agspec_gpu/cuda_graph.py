"""Capturing a step as a CUDA graph: the warm-up and capture every graphed step shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes steps are padded to (a graph per bucket): powers of two up to
    ``max_batch``, and ``max_batch``. The verification graphs, the drafter's step graphs
    and the cost curves a batch budget steers by share them."""
    return sorted({1 << k for k in range(max_batch.bit_length())} | {max_batch})


def capture(fn: Callable[[], Any], device: torch.device, warmup: int, pool,
            stream: torch.cuda.Stream | None = None) -> tuple:
    """``(graph, out)``: ``fn()`` run ``warmup`` times on a side stream (as capture requires:
    lazy initialisations, allocator pools), then captured into a ``torch.cuda.CUDAGraph``
    drawing on memory ``pool``; ``out`` is what the captured call returned, rewritten by
    every replay.

    Everything runs on ``device`` whatever device is current: Triton launches on the
    current device and ``torch.cuda.graph`` synchronizes it, so ``device`` is made current.
    ``stream``: the capture stream, on ``device``; graphs that share a pool reuse each
    other's memory only when captured on one stream (the allocator's free blocks are per
    stream), so an owner of several graphs passes one stream of its own. None: the stream
    ``torch.cuda.graph`` makes once per process, on the device current at the first
    capture; when that is another GPU's, the warm-up's side stream (a capture on another
    device's stream would switch devices), without that reuse."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        shared = torch.cuda.graph.default_capture_stream
        if stream is None and shared is not None and shared.device != device:
            stream = side
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
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
