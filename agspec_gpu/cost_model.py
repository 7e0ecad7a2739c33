"""Verification cost model: time of one target forward pass versus tokens in the batch.

The batch-level draft budget and the replay's modelled speedup both read it. The default
points are for an 8B-parameter bf16 model on an H200 (memory-bound and flat up to a few
hundred tokens, then compute-bound and linear); `bench/bench_e2e.py` measures the real
curve of a model on a GPU and saves it in this format, so the budget steers by a measured
map wherever one exists.
"""

from __future__ import annotations

import bisect
import math
import json
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path

import numpy as np

from agspec_gpu.checks import is_int

_DEFAULT_POINTS = ((1, 6.5), (16, 6.6), (64, 7.0), (128, 7.8), (256, 9.5), (512, 13.0),
                   (1024, 21.0), (2048, 38.0))


@dataclass(frozen=True, slots=True)
class CostModel:
    """Piecewise-linear step time in ms over ``(num_tokens, ms)`` points, or a staircase.

    Above the last point the last segment is extrapolated; below the first point the time is
    the first point's (a forward over fewer tokens than the smallest measured is no cheaper
    than it: a measured curve that starts at ``B`` tokens, one per request, says nothing of
    fewer, and its first segment may be a jump, e.g. from a CUDA-graph decode step to an
    eager verification step, that must not be extrapolated down to zero).

    ``steps``: each point is the right edge of a padded bucket, and every count after the
    previous point costs what the point does (a CUDA-graph verification step pads its rows
    to the bucket's: ``VerifyGraphs``). Interpolated instead, the curve would price the
    tokens just past an edge as nearly free where they pay the whole next bucket, and a
    batch budget would buy them; as a staircase, it fills a bucket before it opens the
    next. ``requests``: the batch the points were measured at (``B``: a point is ``B + n``
    tokens). A graph bucket's edges are draft counts ``n``, the same at any batch, so a
    staircase with ``requests`` prices ``b`` requests and ``n`` draft tokens at ``B + n``
    (:meth:`step_ms` with ``num_requests``, :meth:`table_base` for the batch budget).
    """

    points: tuple[tuple[int, float], ...] = _DEFAULT_POINTS
    source: str = "default: 8B bf16 on H200 (documented estimate, not a measurement)"
    steps: bool = False
    requests: int | None = None

    def __post_init__(self) -> None:
        try:
            points = [tuple(p) for p in self.points]
        except TypeError:
            raise ValueError(f"points: expected (num_tokens, ms) pairs, got {self.points!r}") \
                from None
        if len(points) < 2 or any(len(p) != 2 for p in points):
            raise ValueError("points: need at least two (num_tokens, ms) points")
        for i, (n, ms) in enumerate(points):
            if not is_int(n):
                raise ValueError(f"points[{i}]: num_tokens must be an int, got {n!r}")
            if isinstance(ms, bool) or not isinstance(ms, Real):
                raise ValueError(f"points[{i}]: ms must be a number, got {ms!r}")
        # (plain ints and floats: a numpy int would not write as JSON)
        object.__setattr__(self, "points", tuple((int(n), float(ms)) for n, ms in points))
        xs = [p[0] for p in self.points]
        if xs != sorted(xs) or len(set(xs)) != len(xs) or xs[0] < 1:
            raise ValueError("points: num_tokens must be distinct, ascending and >= 1")
        if not all(0 < p[1] < math.inf for p in self.points):  # (also rejects NaN)
            raise ValueError("points: times must be positive and finite")
        if not isinstance(self.steps, bool):
            raise ValueError(f"steps: expected a bool, got {self.steps!r}")
        if self.requests is not None and (not is_int(self.requests) or self.requests < 0):
            raise ValueError(f"requests: expected an int >= 0 or None, got {self.requests!r}")
        if self.requests is not None:
            object.__setattr__(self, "requests", int(self.requests))
        if not isinstance(self.source, str):
            raise ValueError(f"source: expected a str, got {self.source!r}")

    @classmethod
    def default(cls) -> "CostModel":
        return cls()

    def table_base(self) -> int | None:
        """Where the batch budget reads a step of ``n`` draft tokens: at ``requests + n``
        for a staircase measured at ``requests`` requests; None: at ``b + n`` (``b``: the
        step's requests)."""
        return self.requests if self.steps else None

    def step_ms(self, num_tokens: float, num_requests: int | None = None) -> float:
        """Time of one forward pass over ``num_tokens`` tokens (whole batch); with
        ``num_requests`` (the step's roots, ``num_tokens`` counting them) a staircase with
        ``requests`` prices its draft tokens at ``requests + num_tokens - num_requests``."""
        base = self.table_base()
        if base is not None and num_requests is not None:
            num_tokens = base + num_tokens - num_requests
        xs = [p[0] for p in self.points]
        if num_tokens <= xs[0]:
            return self.points[0][1]
        if self.steps and num_tokens <= xs[-1]:  # the first edge at or past it
            return self.points[bisect.bisect_left(xs, num_tokens)][1]
        i = min(max(bisect.bisect_left(xs, num_tokens), 1), len(xs) - 1)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return max(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), 1e-6)

    def to_json(self) -> dict:
        return {"points": [list(p) for p in self.points], "source": self.source,
                "steps": self.steps, "requests": self.requests}

    @classmethod
    def from_json(cls, obj: dict | str | Path) -> "CostModel":
        """From ``{"points": [[num_tokens, ms], ...], "source": ..., "steps": ...}`` (no
        ``steps``: interpolated) or a file of it; ValueError naming the file (or ``cost
        model``) for anything else."""
        where = f"cost model {obj}" if isinstance(obj, (str, Path)) else "cost model"
        try:
            if isinstance(obj, (str, Path)):
                obj = json.loads(Path(obj).read_text())
            points = tuple((a, b) for a, b in obj["points"])  # checked as they are
            return cls(points, str(obj.get("source", "")), obj.get("steps", False),
                       obj.get("requests"))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                AttributeError, OverflowError) as exc:
            raise ValueError(f"{where}: expected {{\"points\": [[num_tokens, ms], ...]}} "
                             f"({type(exc).__name__}: {exc})") from None


def _curves_by_batch(obj: dict, key: str, parse, skip=()) -> dict[int, CostModel]:
    """``obj[key]``'s curves by batch size (``{"16": ...}``), each ``parse(value, batch)``,
    but those of the batches in ``skip``; ValueError naming ``key[batch]``, a key that is
    not an int and one batch given twice (``"4"`` and ``"04"``)."""
    out: dict[int, CostModel | None] = {}
    for k, v in (obj.get(key) or {}).items():
        try:
            b = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: batch size {k!r} is not an int") from None
        if b in out:
            raise ValueError(f"{key}: batch size {b} given twice")
        try:
            out[b] = None if b in skip else parse(v, b)
        except ValueError as exc:
            raise ValueError(f"{key}[{k!r}]: {str(exc).removeprefix('cost model: ')}") from None
    return {b: c for b, c in out.items() if c is not None}


@dataclass(frozen=True, slots=True)
class BatchCostModels:
    """Cost curves measured at several batch sizes, to price steps whose batch varies.

    A step of ``b`` requests is priced by the curve measured at the smallest batch ``S >=
    b`` (the largest measured where none is): measured at the CUDA-graph batch sizes, that
    is the bucket the step runs in, padded to ``S`` requests (a run's drain, its last
    requests, runs in smaller buckets than its full steps, and costs less). A staircase
    curve prices ``b`` requests and ``n`` draft tokens at ``S + n``, as its bucket pads them.

    ``curves``: ``((S, CostModel), ...)``, ``S`` distinct and ascending, at least one.
    """

    curves: tuple[tuple[int, CostModel], ...]

    def __post_init__(self) -> None:
        sizes = [s for s, _ in self.curves]
        if all(is_int(s) for s in sizes):  # (numpy ints stored back as int)
            sizes = [int(s) for s in sizes]
            object.__setattr__(self, "curves", tuple(zip(sizes, (c for _, c in self.curves))))
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1 or \
                any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
            raise ValueError(f"curves: expected ((batch_size, CostModel), ...) with distinct "
                             f"ascending batch sizes >= 1, got sizes {sizes}")
        if not all(isinstance(c, CostModel) for _, c in self.curves):
            raise ValueError("curves: every curve must be a CostModel")

    def size_for(self, num_requests: int | None) -> int:
        """The smallest measured batch ``>= num_requests`` (the largest where none is, or
        for None)."""
        sizes = [s for s, _ in self.curves]
        if num_requests is None:
            return sizes[-1]
        return sizes[min(bisect.bisect_left(sizes, num_requests), len(sizes) - 1)]

    def curve_for(self, num_requests: int | None) -> CostModel:
        """The curve of :meth:`size_for`'s batch."""
        return dict(self.curves)[self.size_for(num_requests)]

    def step_ms(self, num_tokens: float, num_requests: int | None = None) -> float:
        """:meth:`CostModel.step_ms` of the step's curve (:meth:`curve_for`)."""
        return self.curve_for(num_requests).step_ms(num_tokens, num_requests=num_requests)

    def to_json(self) -> dict:
        """What :meth:`from_json` reads back: the smallest batch's curve at the top level (a
        reader of one curve takes it), every curve's points under ``by_batch_size`` (the
        form of the calibration files before ``curves``) and each whole curve (its source,
        staircase and requests too) under ``curves``."""
        return {**self.curves[0][1].to_json(),
                "by_batch_size": {str(b): [list(p) for p in c.points] for b, c in self.curves},
                "curves": {str(b): c.to_json() for b, c in self.curves}}

    @classmethod
    def from_json(cls, obj: dict | str | Path, batch_sizes=()) -> "BatchCostModels":
        """A saved calibration (``bench/bench_e2e.py``'s ``cost-<model>-<gpu>-<date>.json``,
        :meth:`to_json`'s form, or a dict of it): a curve per batch size it measured, and
        one at each of ``batch_sizes`` that it did not measure: the curve measured at the
        smallest batch ``>=`` it (the largest where none is), as :meth:`size_for` prices a
        step of that batch (a file that measured no batch: its top-level curve). Each
        curve as :meth:`to_json` wrote it (``curves``); in files from before that field,
        the points of ``by_batch_size`` with the file's source, and as a staircase priced
        from its own batch where the file says it was measured through the verification
        graphs (``steps``, or before that field ``verify_cuda_graphs``). A file of one curve
        (:meth:`CostModel.from_json`'s form) is that curve at its ``requests`` (1 if None).
        ValueError naming the file for anything else."""
        where = f"cost model {obj}" if isinstance(obj, (str, Path)) else "cost model"
        try:
            if isinstance(obj, (str, Path)):
                obj = json.loads(Path(obj).read_text())
            steps = obj.get("steps", obj.get("verify_cuda_graphs", False))  # checked below
            whole = _curves_by_batch(obj, "curves", lambda v, b: CostModel.from_json(v))
            by_batch = _curves_by_batch(obj, "by_batch_size", lambda v, b: CostModel.from_json(
                {"points": v, "source": f"{obj.get('source', '')} (by_batch_size[{b}])",
                 "steps": steps,
                 "requests": b if steps else None}), skip=whole)
            measured = {b: whole[b] if b in whole else by_batch[b]
                        for b in sorted(set(whole) | set(by_batch))}
            wanted = {int(b) for b in batch_sizes} - set(measured)
            if not measured:
                top = CostModel.from_json(obj)
                return cls(tuple((b, top) for b in sorted(wanted)) or
                           ((top.requests or 1, top),))
            found = cls(tuple(measured.items()))
            return cls(tuple(sorted({**measured,
                                     **{b: found.curve_for(b) for b in wanted}}.items())))
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as exc:
            raise ValueError(f"{where}: expected a calibration JSON ({type(exc).__name__}: "
                             f"{exc})") from None
        except ValueError as exc:  # a curve's own (CostModel.from_json names no file)
            raise ValueError(f"{where}: {str(exc).removeprefix('cost model: ')}") from None


@dataclass(slots=True)
class StepTokenCounts:
    """Batched steps counted by the tokens their forward verifies (rows + drafted tokens).

    A run's modelled verification time is ``sum over n of counts[n] * cost(n)``: priced step
    by step, because a drafter whose drafts follow the batch's fill (the batch budget) is
    not scored right by one mean-batch figure. The replay and the end-to-end benchmark
    both keep one per lane, so their modelled speedups are the same computation.
    """

    counts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    # steps counted with their requests: {(num_tokens, num_requests): steps}, for a
    # staircase that prices draft tokens (CostModel.table_base)
    by_requests: dict[tuple[int, int], int] = field(default_factory=dict)

    def add(self, num_tokens: int, num_requests: int | None = None) -> None:
        """Counts one step that verifies ``num_tokens`` tokens (>= 0), ``num_requests`` of
        them its roots when the caller knows them."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_requests is not None and not 0 <= num_requests <= num_tokens:
            raise ValueError(f"num_requests must be in [0, num_tokens={num_tokens}], got "
                             f"{num_requests}")
        self._grow(num_tokens + 1)
        self.counts[num_tokens] += 1
        if num_requests is not None:
            key = (num_tokens, num_requests)
            self.by_requests[key] = self.by_requests.get(key, 0) + 1

    def merge(self, other: "StepTokenCounts") -> None:
        self._grow(other.counts.size)
        self.counts[:other.counts.size] += other.counts
        for key, n in other.by_requests.items():
            self.by_requests[key] = self.by_requests.get(key, 0) + n

    @property
    def num_steps(self) -> int:
        return int(self.counts.sum())

    def modelled_ms(self, cost_model: CostModel | BatchCostModels) -> float:
        """``sum over steps of cost_model.step_ms(tokens of the step)`` (with the step's
        requests where it was counted with them: a staircase's draft-token pricing, and
        :class:`BatchCostModels`' choice of curve)."""
        counts = self.counts.copy()
        total = 0.0
        for (t, r), k in self.by_requests.items():
            counts[t] -= k
            total += k * cost_model.step_ms(t, num_requests=r)
        n = np.nonzero(counts)[0]
        return total + float(sum(int(counts[i]) * cost_model.step_ms(int(i)) for i in n))

    def _grow(self, size: int) -> None:
        if size > self.counts.size:
            self.counts = np.pad(self.counts, (0, size - self.counts.size))


def curve_at(path: str | Path | None, batch_size: int) -> CostModel:
    """The curve that prices steps of ``batch_size`` requests in the calibration file
    ``path`` (one curve, or a calibration of several batch sizes:
    :meth:`BatchCostModels.from_json`'s choice), or the built-in estimate when ``path`` is
    None: what a replay at one batch size steers and prices by."""
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    if path is None:
        return CostModel.default()
    return BatchCostModels.from_json(path, [batch_size]).curve_for(batch_size)
