"""Host values to the device on the per-step path, without synchronizing the stream.

``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``, which waits for
every kernel queued on the stream before it returns: one such call in a step makes the host
wait for the GPU, so the next launches cannot overlap the running ones. A non-blocking copy
from pageable memory (:func:`to_device`) does not wait for the stream in practice, but CUDA
promises no more than "might be synchronous with respect to the host" for it (the driver
stages pageable bytes through pinned memory of its own, and may wait for the stream to do
so), and it allocates a host and a device tensor per call. :class:`HostWriter` is the step
path's form: one page-locked staging buffer made once, one copy per write however many
lists it carries, the device values views of a buffer made once too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from agspec_gpu.checks import is_int


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``"cuda"`` becomes ``cuda:<current device>``.

    A tensor's ``.device`` always carries the index, so comparing it with an unindexed
    ``torch.device("cuda")`` would call the same GPU two devices.
    """
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def cuda_index(device: torch.device | str) -> int:
    """``device``'s CUDA index (``"cuda"``: the current device's), or -1 for any other
    device: the ``_cuda_index`` that :func:`device_guard` reads, and what
    ``torch.cuda.device`` takes (-1: no switch)."""
    d = canonical_device(device)
    return d.index if d.type == "cuda" else -1


def device_guard(method: Callable) -> Callable:
    """Runs ``method`` with its object's CUDA device current: ``self._cuda_index``
    (:func:`cuda_index` of the device its tensors live on; -1 on a CPU: no switch).

    Triton launches a kernel on the current device's current stream, and a CUDA graph is
    captured on the current device, so a model on ``cuda:1`` while ``cuda:0`` is current
    would launch its kernels on the wrong device; each public call that does device work
    takes this guard once (not each launch). The device the caller had current is restored
    on return, or on an error. The previous index lives in the call's own frame, so calls
    nest (a ``generate`` callback's call of another public method, the decoder's calls of
    its drafter) and threads (each has its own current device) keep theirs.

    Host cost per call, on the development machine's slow cores: on a CPU 0.18 us (0.27 us
    with a keyword argument), the wrapper's frame and argument packing; on a GPU ~0.07 us
    more plus the work of the two C++ calls ``torch.cuda.device`` makes on enter and exit
    (an int unpack and a ``cudaGetDevice`` each), called directly rather than through
    their Python wrappers (~0.1 us less). Each switches only when the index differs from
    the current one, which is cheaper than asking ``torch.cuda.current_device()`` first
    (its lazy-init check alone is three Python calls, ~0.5 us).
    """

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        index = self._cuda_index
        if index < 0:
            return method(self, *args, **kwargs)
        previous = torch._C._cuda_exchangeDevice(index)
        try:
            return method(self, *args, **kwargs)
        finally:
            torch._C._cuda_maybeExchangeDevice(previous)

    return guarded


def serialized(method: Callable) -> Callable:
    """Runs ``method`` holding its object's ``_lock`` (a ``threading.RLock``): public calls
    from several threads run one at a time, each whole, so a server's request threads may
    ``submit`` and ``cancel`` while its loop thread steps; the thread that holds it may
    re-enter (a ``generate`` callback's call of another public method). An uncontended
    acquire and release cost ~0.2 us."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def synchronize(device: torch.device) -> None:
    """Waits for ``device``'s queued work (a no-op on CPU); for timers and end-of-step reads."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16,
                 torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
                 torch.float64: np.float64, torch.float32: np.float32}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (host numbers) as a new 1-D ``dtype`` CPU tensor, through a numpy copy:
    ``torch.tensor`` of a list converts element by element (174 us for 1,400 ints on the
    development machine, 52 us through numpy), and the per-step path hands over lists of
    that size (the match descriptors of 64 requests)."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (host numbers) as a 1-D ``dtype`` tensor on ``device``
    (:func:`host_tensor`); no stream sync."""
    return host_tensor(values, dtype).to(device, non_blocking=True)


_ALIGN = 16  # bytes: every list of a write starts at a multiple (the widest dtype's size,
# and the alignment Triton specializes pointers on: a kernel fed a view compiles once)


class HostWriter:
    """Host lists to the device through page-locked staging, on a ring made once.

    :meth:`write` packs several lists (each its own dtype) into the pinned ring, copies them
    to the device ring in one non-blocking copy and returns views of it; :meth:`copy_to`
    stages a list and copies it into a device tensor of the caller's (a graph's input). No
    tensor is allocated per call and nothing waits for the stream: the ring is two halves,
    filled in turn, and before the host writes over a half it waits for the copies made
    from it the last time round, which a half of writes ago (many steps, each with its host
    reads) have long finished.

    The returned views are for the kernels the caller launches next on the current stream
    (every write of a writer goes on one stream): a later write reuses their bytes once
    the ring comes round, ordered after those kernels by the stream. Never keep them:
    values that outlive the call (a cached tensor, a user's result) take :func:`to_device`.
    On a CPU the views are of the host ring itself (no copy), with the same lifetime, so the
    CPU tests check the same contract.

    Parameters
    ----------
    nbytes : the ring's size (two halves); a write larger than a half grows the ring to
        four times the write (the larger size stays; views of the old ring stay valid)
    device : where the values go
    """

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        if not is_int(nbytes) or nbytes < 2 * _ALIGN:
            raise ValueError(f"nbytes must be an int >= {2 * _ALIGN}, got {nbytes!r}")
        self.device = canonical_device(device)
        self._cuda = self.device.type == "cuda"
        # each half's last use: recorded when the writes leave it, waited for on return (a
        # CUDA event never recorded is waited for as done)
        self._left = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else None
        self._alloc(nbytes)

    @property
    def nbytes(self) -> int:
        return self._host.numel()

    def _alloc(self, nbytes: int) -> None:
        nbytes = -(-nbytes // (2 * _ALIGN)) * 2 * _ALIGN
        # normal tensors even when the ring grows inside inference mode (an inference
        # tensor takes no in-place write outside it: the next write would raise)
        with torch.inference_mode(False):
            self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
            self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device) \
                if self._cuda else self._host
        # the ring as each dtype (numpy host, torch host, torch device): one slice per list
        self._typed: dict[torch.dtype, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}
        self._half, self._at, self._end = 0, 0, nbytes // 2  # the half written, its end

    def _views(self, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        v = self._typed.get(dtype)
        if v is None:
            v = self._typed[dtype] = (self._host.numpy().view(_NUMPY_DTYPES[dtype]),
                                      self._host.view(dtype), self._dev.view(dtype))
        return v

    def _turn(self, nbytes: int) -> int:
        """Where ``nbytes`` that do not fit in this half go: the start of the other half
        (once its last copies finished), or of a larger ring."""
        half = self.nbytes // 2
        if nbytes > half:  # a new ring: the old one's bytes stay with their views
            self._alloc(4 * nbytes)
            return 0
        if self._cuda:
            self._left[self._half].record(torch.cuda.current_stream(self.device))
        self._half ^= 1
        if self._cuda:
            self._left[self._half].synchronize()
        self._end = (self._half + 1) * half
        return self._half * half

    def _stage(self, groups) -> tuple[int, int, list]:
        """Packs ``(values, dtype)`` groups into the pinned ring; ``(start byte, end byte,
        [(start element, numel, the ring's views as the dtype)])``."""
        offsets, size = [], 0
        for values, dtype in groups:
            if dtype not in _NUMPY_DTYPES:
                raise ValueError(f"HostWriter: no staging for {dtype}")
            offsets.append(size)
            size += -(-len(values) * dtype.itemsize // _ALIGN) * _ALIGN
        at = self._at if self._at + size <= self._end else self._turn(size)
        self._at = at + size
        spans = []
        for off, (values, dtype) in zip(offsets, groups):
            views = self._views(dtype)
            start, n = (at + off) // dtype.itemsize, len(values)
            if n:
                views[0][start:start + n] = values
            spans.append((start, n, views))
        return at, at + size, spans

    def write(self, *groups: tuple[Sequence, torch.dtype]) -> list[torch.Tensor]:
        """Each ``(values, dtype)`` group as a 1-D ``dtype`` tensor on :attr:`device` (a view
        of the ring: see the class's lifetime), all in one host-to-device copy."""
        at, end, spans = self._stage(groups)
        if self._cuda and end > at:
            self._dev[at:end].copy_(self._host[at:end], non_blocking=True)
        return [views[2][start:start + n] for start, n, views in spans]

    def copy_to(self, dst: torch.Tensor, values: Sequence) -> None:
        """``dst`` (1-D, contiguous, on :attr:`device`) takes ``values`` in its dtype,
        copied from the pinned ring without a stream sync."""
        if dst.dim() != 1 or not dst.is_contiguous() or dst.numel() != len(values):
            raise ValueError(f"dst: expected a contiguous 1-D tensor of {len(values)} "
                             f"elements, got {list(dst.shape)}")
        if dst.device != self.device:
            raise ValueError(f"dst: on {dst.device}, the writer writes {self.device}")
        _, _, ((start, n, views),) = self._stage([(values, dst.dtype)])
        dst.copy_(views[1][start:start + n], non_blocking=self._cuda)


def copy_grouped(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (same dtype and shape), one multi-tensor copy per
    dtype where a loop of ``copy_`` launches a kernel per pair, each a few microseconds of
    host time in a step: on a GPU ``torch._foreach_copy_`` copies a list of same-dtype,
    same-device, contiguous tensors in one fused kernel. Pairs that are not (a strided view,
    another device) are copied one by one, as ``_foreach_copy_`` would do them anyway.
    Every pair is checked before anything is copied."""
    if len(dsts) != len(srcs):
        raise ValueError(f"dsts, srcs: {len(dsts)} and {len(srcs)} tensors, expected pairs")
    groups: dict[tuple, tuple[list, list]] = {}
    singles = []
    for dst, src in zip(dsts, srcs):
        if dst.dtype != src.dtype or dst.shape != src.shape:
            raise ValueError(f"copy_grouped: {src.dtype} {list(src.shape)} into "
                             f"{dst.dtype} {list(dst.shape)}")
        if dst.device != src.device or not (dst.is_contiguous() and src.is_contiguous()):
            singles.append((dst, src))
            continue
        d, s = groups.setdefault((dst.dtype, dst.device), ([], []))
        d.append(dst)
        s.append(src)
    for dst, src in singles:
        dst.copy_(src)
    for d, s in groups.values():
        if len(d) == 1:
            d[0].copy_(s[0])
        else:
            torch._foreach_copy_(d, s)


class HostReader:
    """A step's small device results read to the host through one buffer made once.

    ``tensor.tolist()`` (or ``.cpu()``) of a CUDA tensor allocates a pageable host tensor
    and copies into it synchronously, the driver staging the bytes through its own pinned
    buffer. A serving step reads twice (the draft sizes, then the accepted tokens): the
    reader copies them, non-blocking, into a page-locked buffer sized when the loop is built
    and waits on one event: no host tensor allocated per read, one wait per read however
    many tensors it takes. :meth:`start` and :meth:`wait` split a read, so that work which
    needs no host value (the KV commit) queues behind the copy before the host waits. On a
    CPU the tensors are host memory already and are read in place.

    Parameters
    ----------
    numel : the most elements one :meth:`read` takes (all its tensors together); a larger
        read grows the buffer
    device : where the tensors it reads live
    dtype : the buffer's dtype (a tensor of another is converted on its device first)
    """

    def __init__(self, numel: int, device: torch.device | str,
                 dtype: torch.dtype = torch.int32) -> None:
        if not is_int(numel) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        self.device = canonical_device(device)
        self.dtype = dtype
        cuda = self.device.type == "cuda"
        with torch.inference_mode(False):
            self._buf = torch.empty(numel, dtype=dtype, pin_memory=cuda) if cuda else None
        self._np = self._buf.numpy() if cuda else None
        self._event = torch.cuda.Event() if cuda else None
        self._started: list | None = None  # the started read's views, until its wait

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """Each of ``tensors`` (on :attr:`device`, or on the CPU: read in place) as nested
        host lists, like ``tolist()``, after one wait for the stream: :meth:`start` then
        :meth:`wait`."""
        self.start(*tensors)
        return self.wait()

    def start(self, *tensors: torch.Tensor) -> None:
        """Queues the copies of ``tensors`` behind the stream's work, without waiting:
        the host may launch more work (which must not write ``tensors``: on a CPU they
        are read in place, at :meth:`wait`) before :meth:`wait` returns the values. One
        read at a time: a start drops an earlier one not waited for (a step that failed
        between the two)."""
        self._started = None
        on_device = [t for t in tensors if t.device.type != "cpu"]
        for t in on_device:
            if t.device != self.device:
                raise ValueError(f"tensors: on {t.device}, the reader reads {self.device}")
        if not on_device:
            self._started = list(tensors)
            return
        total = sum(t.numel() for t in on_device)
        if total > self._buf.numel():  # larger than sized for: grows, once
            with torch.inference_mode(False):  # (a normal tensor, as the writer's ring)
                self._buf = torch.empty(total, dtype=self.dtype, pin_memory=True)
            self._np = self._buf.numpy()
        views, at = [], 0
        for t in tensors:
            if t.device.type == "cpu":
                views.append(t)
                continue
            n = t.numel()
            self._buf[at:at + n].view(t.shape).copy_(t.to(self.dtype), non_blocking=True)
            views.append(self._np[at:at + n].reshape(t.shape))
            at += n
        self._event.record(torch.cuda.current_stream(self.device))
        self._started = views

    def wait(self) -> list[list]:
        """The values of the last :meth:`start`'s tensors as nested host lists, after one
        wait for its copies."""
        views, self._started = self._started, None
        if views is None:
            raise RuntimeError("HostReader.wait: no start() to wait for")
        if self._event is not None:
            self._event.synchronize()
        return [v.tolist() for v in views]
