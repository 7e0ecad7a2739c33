"""The drafter's steps as CUDA graphs: their small kernels replayed in one launch each.

A drafter step is many kernels of microseconds each, whose launches cost the host more than
the GPU spends on them (3-4 ms per propose on an H200 when every kernel was launched from
Python). Two parts have shapes that depend only on the batch size ``B`` and a few static
widths, so :class:`StepGraphs` pads a step to a bucket ``S >= B`` and replays a graph
captured per bucket (8 kernels for a propose, 6 for a commit, most of them Triton kernels
that each replaced dozens of torch ops: ``tests/test_drafter.py`` counts them):

* propose, after the batched match and its windows: the choice of the rows that supply
  candidates, the trie, calibrated probabilities, best-first order, the batch budget;
* commit, before the corpora: controller scale, copy mode, tier weights, calibration counts
  and the recent-token ring.

Padding rows carry inputs that make them inert (no candidates, no nodes, no accepted tokens)
and address the drafter's spare state slot (``max_sessions``), so they never write a real
session's state; the real request count reaches the batch budget as a device scalar, so
padding does not change it.

Planning and running are split, as FlashInfer's wrappers split them: :meth:`StepGraphs.plan`
finds a batch size's bucket for the step's input shapes once (the caller keeps the
:class:`StepPlan` while its shapes stay), :meth:`StepGraphs.run` then only copies. Inputs
are copied into each bucket's static buffers before a replay (or written there in place by
their producer: a plan's ``staged`` views); outputs are cloned out of the graph's, so a
result outlives the next step (a loop that is done with a step's result before the next one
skips the clones). The drafter state a step reads and writes is updated in place, at fixed
addresses; buffers that move (the corpus arena grows and compacts) are read before the
graph, so they are never baked into one. Without graphs (CPU, or a failed capture) the same
padded step runs eagerly, which the tests compare with the unpadded step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from agspec_gpu.cuda_graph import batch_buckets, capture, capture_error

# fn(**inputs with S rows, num_requests=int64 []) -> output tensors with S rows
StepFn = Callable[..., tuple[torch.Tensor, ...]]

# a bucket's captured outputs: a key no input name (a str) can take (the drafter's commit
# has an input named "out")
GRAPH_OUTPUTS = ("graph outputs",)
_BOOKKEEPING = ("num_requests", "clean_from", "last_b", "graph")  # a bucket's str keys


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A step's bucket for one batch size and input shapes (:meth:`StepGraphs.plan`).

    Attributes:
        num_requests: ``B``, the rows of every input.
        bucket_size: ``S >= B``, the rows the step runs (padding from ``B`` on).
        buf: the bucket's buffers (inputs by name, graph and bookkeeping).
        staged: per staged input, the first ``B`` rows of its buffer: write it there.
        names: every input of the step, in order.
        copies: per dtype, the other inputs' first ``B`` rows and their names: one
            multi-tensor copy each per step.
    """

    num_requests: int
    bucket_size: int
    buf: dict
    staged: dict[str, torch.Tensor]
    names: tuple[str, ...]
    copies: tuple[tuple[list[torch.Tensor], tuple[str, ...]], ...]


class StepGraphs:
    """A step padded to batch buckets; CUDA graphs when ``use_graphs``.

    Parameters
    ----------
    fn : the step, shape-static given its inputs' shapes; called with the inputs by name and
        ``num_requests`` (the real batch size: an int unpadded, an ``int64 []`` tensor padded)
    max_batch : the largest batch (the largest bucket)
    device : where the buffers live
    pads : per input name, the value of its padding rows (the padding slot for slot
        indices, -1 for absent tokens, 0 for counts and weights)
    state : the tensors the step updates in place: capturing runs the step (warm-up), so
        they are saved before and restored after, and a capture never commits anything
    use_graphs : capture (default: on CUDA); on a capture failure :attr:`graph_error` says
        why and steps run eagerly, unpadded.
    """

    def __init__(self, fn: StepFn, max_batch: int, device: torch.device,
                 pads: Mapping[str, int | float], *, state: Sequence[torch.Tensor] = (),
                 use_graphs: bool | None = None, warmup: int = 2) -> None:
        clash = sorted(set(pads) & set(_BOOKKEEPING))
        if clash:
            raise ValueError(f"pads: input names {clash} are a bucket's own keys")
        self.fn, self.device, self.pads, self.warmup = fn, device, dict(pads), warmup
        self.state = list(state)
        self.sizes = batch_buckets(max_batch)
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.graph_error: str | None = None
        self._buckets: dict[tuple, dict] = {}
        self._pool = self._stream = None  # the graphs' memory pool and capture stream

    def bucket(self, B: int) -> int:
        S = next((s for s in self.sizes if s >= B), None)
        if S is None:
            raise ValueError(f"{B} requests exceed max_batch={self.sizes[-1]}")
        return S

    def prepare(self, examples: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Captures every batch bucket for inputs shaped like each of ``examples`` (one row
        each: only trailing shapes and dtypes count) now, so that no step pays for a capture;
        other shapes are captured on first use."""
        if not self.use_graphs:
            return
        for ex in examples:
            for S in self.sizes:
                if not self._captured(self._buffers(S, ex)):
                    return

    def plan(self, B: int, like: Mapping[str, torch.Tensor], staged: tuple[str, ...] = ()
             ) -> StepPlan:
        """What :meth:`run` needs for steps of ``B`` requests whose inputs are shaped like
        ``like`` (every input of the step, any number of rows; only trailing shapes and
        dtypes count): the bucket's buffers, the views the ``staged`` inputs are written to
        in place (a producer writes there: the drafter's match writes its outputs), and the
        other inputs' destination rows grouped by dtype. A caller keeps a plan for as long as
        its steps keep those shapes (the drafter: per batch size and width), so a step
        neither looks its bucket up nor builds its key."""
        buf = self._buffers(self.bucket(B), like)
        for name in staged:
            if name not in like:
                raise ValueError(f"staged: {name!r} is not an input of the step")
        names = tuple(n for n in like if n not in staged)
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for name in names:
            dsts, at = by_dtype.setdefault(buf[name].dtype, ([], []))
            dsts.append(buf[name][:B])
            at.append(name)
        return StepPlan(B, self.bucket(B), buf, {name: buf[name][:B] for name in staged},
                        tuple(like), tuple((d, tuple(n)) for d, n in by_dtype.values()))

    def write_columns(self, plan: StepPlan, name: str, src: torch.Tensor) -> None:
        """The staged input ``name`` (``[B, W]``) takes ``src [B, A]``'s first ``min(A, W)``
        columns (converted to its dtype) and its pad value after them. The pad is written
        only over the columns an earlier write to the bucket filled (the bucket remembers
        how wide its last write was; its padding rows :meth:`run` resets): a loop whose
        widths stay the same writes one copy a step, not a copy and a fill."""
        dst, key = plan.staged[name], ("written", name)
        A, W = src.shape[1], dst.shape[1]
        if A >= W:
            dst.copy_(src[:, :W])
            plan.buf[key] = W
            return
        dst[:, :A].copy_(src)
        if plan.buf.get(key, 0) > A:
            dst[:, A:plan.buf[key]].fill_(self.pads[name])
        plan.buf[key] = A

    def run(self, plan: StepPlan, inputs: Mapping[str, torch.Tensor], clone: bool = True
            ) -> tuple[torch.Tensor, ...]:
        """The step of ``plan.num_requests = B`` requests through its bucket: ``inputs``
        holds every input the plan does not stage, with ``B`` rows and the plan's trailing
        shapes and dtypes (the staged ones were written to ``plan.staged``). Outputs with
        ``B`` rows, clones; ``clone=False``: views of the graph's buffers, valid until the
        next replay of any bucket (their graphs share one memory pool)."""
        B, buf = plan.num_requests, plan.buf
        if self.graph_error is not None:  # capture failed once: eager, unpadded
            return self.fn(**inputs, **plan.staged, num_requests=B)
        # the other inputs into the bucket's buffers: one copy launch per dtype, not per
        # input (checked: a copy would broadcast a wrong shape, or convert a wrong dtype)
        for dsts, names in plan.copies:
            srcs = [inputs[n] for n in names]
            for dst, src, name in zip(dsts, srcs, names):
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise ValueError(f"{name}: expected {dst.dtype} {list(dst.shape)} as "
                                     f"planned, got {src.dtype} {list(src.shape)}")
            torch._foreach_copy_(dsts, srcs)
        if B < buf["clean_from"]:  # rows a larger batch wrote: padding again
            for name in plan.names:
                buf[name][B:buf["clean_from"]].fill_(self.pads[name])
        buf["clean_from"] = B
        if buf["last_b"] != B:
            buf["num_requests"].fill_(B)
            buf["last_b"] = B
        if self.use_graphs:
            if not self._captured(buf):
                return self.fn(**inputs, **plan.staged, num_requests=B)
            buf["graph"].replay()
            if not clone:  # the graph's outputs, B rows: views made once per B
                views = buf.get((GRAPH_OUTPUTS, B))
                if views is None:
                    views = buf[(GRAPH_OUTPUTS, B)] = tuple(o[:B] for o in buf[GRAPH_OUTPUTS])
                return views
            out = buf[GRAPH_OUTPUTS]
        else:
            out = self._call(buf)
        assert out[0].shape[0] == plan.bucket_size
        return tuple(o[:B].clone() if clone else o[:B] for o in out)

    def _buffers(self, S: int, like: Mapping[str, torch.Tensor]) -> dict:
        key = (S,) + tuple((n, tuple(x.shape[1:]), x.dtype) for n, x in like.items())
        buf = self._buckets.get(key)
        if buf is None:
            buf = {n: torch.full((S, *x.shape[1:]), self.pads[n], dtype=x.dtype,
                                 device=self.device) for n, x in like.items()}
            buf["num_requests"] = torch.zeros((), dtype=torch.int64, device=self.device)
            # host bookkeeping: rows from clean_from on hold padding; num_requests holds last_b
            buf["clean_from"], buf["last_b"] = 0, 0
            self._buckets[key] = buf
        return buf

    def _call(self, buf: dict) -> tuple[torch.Tensor, ...]:
        return self.fn(**{n: x for n, x in buf.items() if n in self.pads},
                       num_requests=buf["num_requests"])

    def _captured(self, buf: dict) -> bool:
        """Captures ``buf``'s graph if it has none; False (and every step eager from then
        on) when capture fails."""
        if "graph" in buf:
            return True
        if self.graph_error is not None:
            return False
        saved = [t.clone() for t in self.state]
        try:
            if self._pool is None:  # the buckets share a pool, so one capture stream
                self._pool = torch.cuda.graph_pool_handle()
                self._stream = torch.cuda.Stream(self.device)
            buf["graph"], buf[GRAPH_OUTPUTS] = capture(lambda: self._call(buf), self.device,
                                               self.warmup, self._pool, self._stream)
            return True
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager
            self.graph_error = capture_error(exc)
            self._buckets.clear()
            return False
        finally:
            for t, s in zip(self.state, saved):
                t.copy_(s)
