"""Measuring verification cost on a runner: the curves the batch budget steers by.

:func:`calibrate_cost_model` times one batch size's verification steps (plan + forward +
argmax) over draft counts ``0, 1, 2, 4, ...``. Measured at several batch sizes (the
verification graphs' buckets: ``SpecDecoder.calibrate_cost_model``, ``bench/bench_e2e.py``)
the curves make a :class:`~agspec_gpu.cost_model.BatchCostModels`, which
``DecoderConfig(cost_model=...)`` takes: a step steers by the curve of the bucket it runs in.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from agspec_gpu.checks import is_int
from agspec_gpu.cost_model import BatchCostModels, CostModel
from agspec_gpu.cuda_graph import batch_buckets
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.host import synchronize
from agspec_gpu.kv_cache import KVCacheFull
from agspec_gpu.runners.graphs import DecodeGraphs
from agspec_gpu.runners.verify_graphs import VerifyGraphs
from agspec_gpu.tree import TreeMetadata


class SpanTimer:
    """Elapsed seconds of a span: CUDA events on a GPU (read after a sync), else wall."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.device = device.type == "cuda", device
        if self.cuda:
            self._ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def start(self) -> None:
        if self.cuda:
            self._ev[0].record(torch.cuda.current_stream(self.device))
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._ev[1].record(torch.cuda.current_stream(self.device))
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        """After a device sync."""
        return self._ev[0].elapsed_time(self._ev[1]) / 1e3 if self.cuda else self._t1 - self._t0


def calibrate_cost_model(runner, batch_size: int, context_tokens: int, *,
                         max_draft_tokens: int = 2048, repeats: int = 5, warmup: int = 2,
                         graphs: DecodeGraphs | None = None,
                         verify_graphs: VerifyGraphs | None = None, seed: int = 0,
                         source: str = "") -> CostModel:
    """Measures verification time versus tokens per step on ``runner``.

    ``batch_size`` requests with ``context_tokens`` tokens of KV each verify their roots
    plus ``n`` draft tokens in total (``n = 0``, the powers of two up to
    ``max_draft_tokens`` and, with ``verify_graphs``, their buckets' edges: the top one,
    ``S * max_nodes``, need not be a power of two; spread evenly over the requests as
    chains); a point is
    ``(batch_size + n, median ms)`` of plan + forward + argmax, raised to the previous
    point's time where noise made it lower. ``n = 0`` is a plain decode step, through
    ``graphs`` when given, as the loop runs it (else as a step with empty drafts, as a
    ``SpecDecoder`` runs one); a step goes through ``verify_graphs`` when given and its
    drafts fit them (chains of at most ``max_nodes``), as the loop runs it, else eagerly.
    The KV contents are whatever the pages hold: timing does not depend on them.

    With ``verify_graphs`` the model is a staircase (``CostModel.steps``, ``requests =
    batch_size``): their buckets hold ``S + 1 + 8 * 2**j`` rows for ``S`` requests, a step
    of ``b <= S`` requests and ``n`` draft tokens needs ``S + n + 1`` of them (its padding
    requests' and the sink's rows included), so the bucket edges are draft counts, ``n = 8
    * 2**j`` (the points from 8 up), whatever ``b``: the model prices a step of ``b``
    requests and ``n`` tokens at the edge at or past ``batch_size + n``, and the batch
    budget reads it there (``CostModel.table_base``). Draft counts past the graphs' largest
    bucket run eagerly, unpadded: the staircase prices them at the next point, a bound.

    Returns
    -------
    :class:`CostModel` over those points (the form ``Drafter``'s batch budget consumes).

    Raises
    ------
    KVCacheFull: the pool's free pages or sequence rows cannot hold the widest step
        (:func:`calibration_pages`), before anything is measured.
    """
    _check_counts(batch_size=batch_size, context_tokens=context_tokens,
                  max_draft_tokens=max_draft_tokens, repeats=repeats)
    if not is_int(warmup) or warmup < 0:
        raise ValueError(f"warmup: expected an int >= 0, got {warmup!r}")
    cache, dev = runner.kv_cache, runner.device
    B = batch_size
    # the graphs' bucket edges in draft tokens: 8 * 2**j (powers of two) and the top one,
    # S * max_nodes, which is not one unless S and max_nodes are (the staircase would
    # price the top bucket's first tokens at the bucket below)
    S = next((s for s in verify_graphs.sizes if s >= B), None) if verify_graphs else None
    edges = [q - S - 1 for q in verify_graphs.buckets[S]] if S is not None else []
    ns = _draft_counts(cache, B, context_tokens, max_draft_tokens, edges)
    check_calibration_fits(cache, [(B, context_tokens, max_draft_tokens)])
    # ids no caller's sequence (a str session id, an int) can be
    ids = [("__calibrate", b) for b in range(B)]
    cache.allocate_many(ids, [context_tokens] * B)
    points = []
    try:
        prefix = [context_tokens - 1] * B  # the root sits at the last context slot
        prefix_t = torch.tensor(prefix, dtype=torch.int32)
        roots = torch.zeros(B, dtype=torch.int32, device=dev)
        g = torch.Generator().manual_seed(seed)
        timer = SpanTimer(dev)
        with torch.inference_mode():
            for n in ns:
                per = [n // B + (1 if b < n % B else 0) for b in range(B)]
                N = max(1, max(per))  # width 1 at n = 0: a decode step as a loop pads it
                tok = torch.full((B, N), PAD_ID, dtype=torch.int32)
                par = torch.full((B, N), PAD_ID, dtype=torch.int32)
                for b, k in enumerate(per):
                    tok[b, :k] = torch.randint(0, min(runner.shape.vocab_size, 100_000), (k,),
                                               generator=g, dtype=torch.int32)
                    par[b, :k] = torch.arange(-1, k - 1, dtype=torch.int32)
                draft = DraftBatch(tok.to(dev), par.to(dev),
                                   torch.tensor(per, dtype=torch.int32, device=dev))
                # capacity = the step's real rows, as the loop's MetadataPool hands out
                out = TreeMetadata.empty(B, N + 1, cache.max_pages_per_seq, cache.page_size,
                                         dev, max_total_q=-(-(B + n) // 8) * 8,
                                         with_prefix=True)
                fits = verify_graphs is not None and N <= verify_graphs.max_nodes \
                    and B <= verify_graphs.sizes[-1]
                times = []
                for i in range(warmup + repeats):
                    synchronize(dev)
                    timer.start()
                    if n == 0 and graphs is not None:
                        logits = graphs.decode(ids, roots, prefix)
                    elif fits and (n or graphs is None):
                        _, logits = verify_graphs.verify(ids, draft, roots, prefix, per)
                    else:
                        meta = runner.plan(ids, draft, roots, prefix_t, prefix_lens_host=prefix,
                                           num_draft_host=per, out=out)
                        logits = runner.forward(meta)
                    logits.argmax(dim=-1)
                    timer.stop()
                    synchronize(dev)
                    if i >= warmup:
                        times.append(timer.seconds())
                ms = 1e3 * float(np.median(times))
                # verifying more tokens is never cheaper: timing noise must not give the
                # curve a falling stretch, which the budget would extrapolate to free tokens
                points.append((B + n, max(ms, points[-1][1]) if points else ms))
    finally:
        for sid in ids:
            cache.free(sid)
    return CostModel(tuple(points), source or f"measured: {B} requests x {context_tokens} "
                     f"tokens of KV, plan + forward + argmax, median of {repeats}",
                     steps=verify_graphs is not None, requests=B)


def _check_counts(**counts) -> None:
    """ValueError naming the first of ``counts`` that is not an int >= 1."""
    for name, v in counts.items():
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")


def _draft_counts(cache, batch_size: int, context_tokens: int, max_draft_tokens: int,
                  edges: Sequence[int] = ()) -> list[int]:
    """The draft counts a calibration measures: 0, the powers of two and ``edges`` up to
    ``max_draft_tokens`` whose share per request fits a sequence beside its context."""
    room = cache.max_pages_per_seq * cache.page_size - context_tokens
    powers = [1 << i for i in range(max(max_draft_tokens, 1).bit_length())]
    ns = [0] + sorted({n for n in powers + [int(e) for e in edges]
                       if 1 <= n <= max_draft_tokens and -(-n // batch_size) < room})
    if len(ns) < 2:
        raise ValueError(f"context_tokens: {context_tokens} tokens of KV per request leave no "
                         f"room for a draft token in a sequence of at most "
                         f"{cache.max_pages_per_seq * cache.page_size}")
    return ns


def calibration_pages(cache, batch_size: int, context_tokens: int, max_draft_tokens: int
                      ) -> int:
    """KV pages a calibration of ``batch_size`` requests needs at its widest step: each
    request holds its context and its share of the largest draft count measured (the
    root at the context's last slot)."""
    share = _draft_share(cache, batch_size, context_tokens, max_draft_tokens)
    return batch_size * -(-(context_tokens + share) // cache.page_size)


def _draft_share(cache, batch_size: int, context_tokens: int, max_draft_tokens: int) -> int:
    """Draft tokens per request at a calibration's widest step (at least 1: a decode step
    is padded to one node column)."""
    ns = _draft_counts(cache, batch_size, context_tokens, max_draft_tokens)
    return max(1, -(-ns[-1] // batch_size))


def check_calibration_fits(cache, steps: Sequence[tuple[int, int, int]]) -> None:
    """KVCacheFull, naming the arguments, unless the pool's free pages and sequence rows
    hold each ``(batch_size, context_tokens, max_draft_tokens)`` calibration."""
    for b, ctx, most in steps:
        need = calibration_pages(cache, b, ctx, most)
        if need > cache.num_free_pages or b > cache.num_free_rows:
            share = _draft_share(cache, b, ctx, most)
            raise KVCacheFull(
                f"context_tokens: calibrating {b} requests x {ctx} tokens of KV, each with up "
                f"to {share} draft tokens (max_draft_tokens={most}), needs {need} pages of "
                f"{cache.page_size} tokens and {b} sequence rows; the pool has "
                f"{cache.num_free_pages} pages and {cache.num_free_rows} rows free (a "
                f"smaller context_tokens or max_draft_tokens, or a larger KV pool, fits)")


def check_calibration_args(context_tokens, batch_sizes, max_batch: int, max_draft_tokens,
                           repeats) -> list[int]:
    """The arguments of a calibration at several batch sizes, checked (ValueError naming
    the argument); returns the batch sizes (default: the graph buckets up to
    ``max_batch``)."""
    _check_counts(context_tokens=context_tokens)
    sizes = batch_buckets(max_batch) if batch_sizes is None else list(batch_sizes)
    if any(not is_int(b) or not 1 <= b <= max_batch
           for b in sizes):
        raise ValueError(f"batch_sizes: expected ints in [1, {max_batch}], got {sizes}")
    if sorted(set(sizes)) != sizes or not sizes:
        raise ValueError(f"batch_sizes: expected distinct ascending sizes, got {sizes}")
    if max_draft_tokens is not None:  # (None: each batch's most)
        _check_counts(max_draft_tokens=max_draft_tokens)
    _check_counts(repeats=repeats)
    return [int(b) for b in sizes]


def calibrate_batch_costs(runner, batch_sizes: Sequence[int], context_tokens: int, *,
                          max_draft_tokens: int | None = None, max_nodes: int | None = None,
                          repeats: int = 5, graphs: DecodeGraphs | None = None,
                          verify_graphs: VerifyGraphs | None = None,
                          source: str = "measured") -> BatchCostModels:
    """:func:`calibrate_cost_model` at each of ``batch_sizes`` (ascending), ``batch_size``
    requests of ``context_tokens`` tokens of KV each verifying up to ``max_draft_tokens``
    draft tokens (None: ``batch_size * max_nodes``, the most a step of that bucket
    verifies). ``source`` begins each curve's description (what was measured, where). Every
    batch size's widest step is checked to fit the KV pool before any is measured
    (KVCacheFull); a bad argument raises ValueError naming it, before anything runs."""
    if max_draft_tokens is None and max_nodes is None:
        raise ValueError("max_draft_tokens, max_nodes: one is required")
    sizes = list(batch_sizes)
    most_b = max((b for b in sizes if is_int(b)), default=1)
    check_calibration_args(context_tokens, sizes, most_b, max_draft_tokens, repeats)
    if max_draft_tokens is None:
        _check_counts(max_nodes=max_nodes)
    most = [int(max_draft_tokens if max_draft_tokens is not None else b * max_nodes)
            for b in batch_sizes]
    check_calibration_fits(runner.kv_cache, [(int(b), int(context_tokens), m)
                                             for b, m in zip(batch_sizes, most)])
    curves = []
    for b, m in zip(batch_sizes, most):
        curves.append((int(b), calibrate_cost_model(
            runner, int(b), int(context_tokens), max_draft_tokens=m,
            repeats=int(repeats), graphs=graphs, verify_graphs=verify_graphs,
            source=f"{source}, {b} requests x {context_tokens} tokens of KV, plan + forward "
                   f"+ argmax, median of {repeats}")))
    return BatchCostModels(tuple(curves))
