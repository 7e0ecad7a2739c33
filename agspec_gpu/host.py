"""Host values to the device on the per-step path, without synchronizing the stream.

``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``, which waits for
every kernel queued on the stream before it returns: one such call in a step makes the host
wait for the GPU, so the next launches cannot overlap the running ones. A non-blocking copy
from pageable memory does not wait (the runtime stages the host buffer before it returns, so
the buffer may be freed at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``"cuda"`` becomes ``cuda:<current device>``.

    A tensor's ``.device`` always carries the index, so comparing it with an unindexed
    ``torch.device("cuda")`` would call the same GPU two devices.
    """
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


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


def copy_grouped(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (same dtype and shape), one multi-tensor copy per
    dtype where a loop of ``copy_`` launches a kernel per pair, each a few microseconds of
    host time in a step: on a GPU ``torch._foreach_copy_`` copies a list of same-dtype,
    same-device, contiguous tensors in one fused kernel. Pairs that are not (a strided view,
    another device) are copied one by one, as ``_foreach_copy_`` would do them anyway."""
    groups: dict[tuple, tuple[list, list]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.dtype != src.dtype or dst.shape != src.shape:
            raise ValueError(f"copy_grouped: {src.dtype} {list(src.shape)} into "
                             f"{dst.dtype} {list(dst.shape)}")
        if dst.device != src.device or not (dst.is_contiguous() and src.is_contiguous()):
            dst.copy_(src)
            continue
        d, s = groups.setdefault((dst.dtype, dst.device), ([], []))
        d.append(dst)
        s.append(src)
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
    many tensors it takes. On a CPU the tensors are host memory already and are read in
    place.

    Parameters
    ----------
    numel : the most elements one :meth:`read` takes (all its tensors together); a larger
        read grows the buffer
    device : where the tensors it reads live
    dtype : the buffer's dtype (a tensor of another is converted on its device first)
    """

    def __init__(self, numel: int, device: torch.device | str,
                 dtype: torch.dtype = torch.int32) -> None:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        self.device = canonical_device(device)
        self.dtype = dtype
        cuda = self.device.type == "cuda"
        self._buf = torch.empty(numel, dtype=dtype, pin_memory=cuda) if cuda else None
        self._np = self._buf.numpy() if cuda else None
        self._event = torch.cuda.Event() if cuda else None

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """Each of ``tensors`` (on :attr:`device`, or on the CPU: read in place) as nested
        host lists, like ``tolist()``, after one wait for the stream."""
        on_device = [t for t in tensors if t.device.type != "cpu"]
        for t in on_device:
            if t.device != self.device:
                raise ValueError(f"tensors: on {t.device}, the reader reads {self.device}")
        if not on_device:
            return [t.tolist() for t in tensors]
        total = sum(t.numel() for t in on_device)
        if total > self._buf.numel():  # larger than sized for: grows, once
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
        self._event.synchronize()
        return [v.tolist() for v in views]
