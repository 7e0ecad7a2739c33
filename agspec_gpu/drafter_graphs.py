"""The drafter's tree step as CUDA graphs: ~150 small kernels replayed in one launch.

After the batched match, :class:`~agspec_gpu.drafter.Drafter` turns each request's candidate
windows into a draft tree (trie, calibrated probabilities, best-first order, the batch
budget): about 150 kernels of microseconds each, whose launches cost the host more than the
GPU spends on them (3-4 ms per step on an H200 for the whole propose). Its shapes depend
only on the batch size ``B`` and the candidate count ``C``, so :class:`TreeGraphs` pads a
step to a bucket ``S >= B`` (padding requests have no candidates: no nodes, no budget
share) and replays a graph captured per ``(S, C)`` on first use. The real request count
reaches the batch budget as a device scalar, so padding does not change it.

Inputs are copied into each bucket's static buffers before a replay; outputs are cloned out
of the graph's, so a draft outlives the next step. The drafter state the step reads (per-slot
scale, cap, mode, calibration tables, the cost table) is updated in place between steps, at
fixed addresses. Without graphs (CPU, or a failed capture) the same padded step runs eagerly,
which the tests compare with the unpadded step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agspec_gpu.cuda_graph import capture
from agspec_gpu.draft_batch import PAD_ID

# (slots int64 [S], W int32 [S, C, K], S int32 [S, C, K], Wt float32 [S, C], best int32 [S],
#  num_requests int64 []) -> output tensors with S rows
TreeFn = Callable[..., tuple[torch.Tensor, ...]]


class TreeGraphs:
    """The padded tree step per ``(S, C)`` bucket; CUDA graphs when ``use_graphs``.

    Parameters
    ----------
    fn : the tree step (``Drafter._tree_tensors``), shape-static given ``(S, C)``
    max_batch : the drafter's ``max_batch`` (the largest bucket)
    device : where the buffers live
    use_graphs : capture (default: on CUDA); on a capture failure :attr:`graph_error` says
        why and steps run eagerly, unpadded.
    """

    def __init__(self, fn: TreeFn, max_batch: int, device: torch.device, *,
                 use_graphs: bool | None = None, warmup: int = 2) -> None:
        self.fn, self.device, self.warmup = fn, device, warmup
        self.sizes = sorted({1 << k for k in range(max_batch.bit_length())
                             if (1 << k) <= max_batch} | {max_batch})
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.graph_error: str | None = None
        self._buckets: dict[tuple[int, int, int], dict] = {}
        self._pool = None

    def prepare(self, candidates: list[int], K: int) -> None:
        """Captures every batch bucket for these candidate counts now (a drafter does this
        when it is built, so no step pays for a capture); other shapes are captured on first
        use."""
        if not self.use_graphs:
            return
        for C in candidates:
            for S in self.sizes:
                buf = self._buckets.get((S, C, K)) or self._prepare((S, C, K))
                if not self._captured(buf):
                    return

    def bucket(self, B: int) -> int:
        S = next((s for s in self.sizes if s >= B), None)
        if S is None:
            raise ValueError(f"{B} requests exceed max_batch={self.sizes[-1]}")
        return S

    def run(self, slots: torch.Tensor, W: torch.Tensor, S_: torch.Tensor, Wt: torch.Tensor,
            best: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tree step of ``B = W.shape[0]`` requests through its bucket: outputs with
        ``B`` rows (clones)."""
        B, C, K = W.shape
        if self.graph_error is not None:  # capture failed once: eager, unpadded
            return self.fn(slots, W, S_, Wt, best, B)
        key = (self.bucket(B), C, K)
        buf = self._buckets.get(key) or self._prepare(key)
        S = key[0]
        buf["slots"][:B].copy_(slots)
        buf["slots"][B:].zero_()  # padding reads slot 0's state, writes nothing
        buf["W"][:B].copy_(W)
        buf["W"][B:].fill_(PAD_ID)
        buf["S"][:B].copy_(S_)
        buf["S"][B:].fill_(-1)
        buf["Wt"][:B].copy_(Wt)
        buf["Wt"][B:].zero_()
        buf["best"][:B].copy_(best)
        buf["best"][B:].zero_()
        buf["num_requests"].fill_(B)
        if self.use_graphs:
            if not self._captured(buf):
                return self.fn(slots, W, S_, Wt, best, B)
            buf["graph"].replay()
            out = buf["out"]
        else:
            out = self._call(buf)
        assert out[0].shape[0] == S
        return tuple(o[:B].clone() for o in out)

    def _prepare(self, key: tuple[int, int, int]) -> dict:
        S, C, K = key
        dev = self.device
        buf = {"slots": torch.zeros(S, dtype=torch.int64, device=dev),
               "W": torch.full((S, C, K), PAD_ID, dtype=torch.int32, device=dev),
               "S": torch.full((S, C, K), -1, dtype=torch.int32, device=dev),
               "Wt": torch.zeros(S, C, dtype=torch.float32, device=dev),
               "best": torch.zeros(S, dtype=torch.int32, device=dev),
               "num_requests": torch.zeros((), dtype=torch.int64, device=dev)}
        self._buckets[key] = buf
        return buf

    def _call(self, buf: dict) -> tuple[torch.Tensor, ...]:
        return self.fn(buf["slots"], buf["W"], buf["S"], buf["Wt"], buf["best"],
                       buf["num_requests"])

    def _captured(self, buf: dict) -> bool:
        """Captures ``buf``'s graph if it has none; False (and every step eager from then
        on) when capture fails."""
        if "graph" in buf:
            return True
        if self.graph_error is not None:
            return False
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            buf["graph"], buf["out"] = capture(lambda: self._call(buf), self.device,
                                               self.warmup, self._pool)
            return True
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager
            self.graph_error = f"{type(exc).__name__}: {exc}"
            self._buckets.clear()
            return False
