"""The per-step host helpers: grouped copies into graph buffers, host lists to the device,
and the step's reads back to the host (``host.HostReader``)."""

import numpy as np
import pytest
import torch

from agspec_gpu.host import HostReader, copy_grouped, to_device
from op_count import CountOps

CUDA = torch.cuda.is_available()


def test_copy_grouped_copies_each_pair_in_one_launch_per_dtype():
    """The graphs' input copies: every pair copied (mixed dtypes and shapes), one op per
    dtype for contiguous pairs, strided views apart (a GPU's fused copy takes dense tensors
    only), and a dtype or shape mismatch named."""
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 99, (3,), generator=g), torch.randint(0, 99, (2, 5), generator=g),
            torch.randint(0, 99, (4,), generator=g, dtype=torch.int32),
            torch.randint(0, 99, (2, 3), generator=g, dtype=torch.int32),
            torch.rand(7, generator=g), torch.randint(0, 99, (3, 8), generator=g)[:, :2]]
    bufs = [torch.zeros(6 + x.shape[0], *x.shape[1:], dtype=x.dtype) for x in srcs]
    count = CountOps()
    with count.mode:
        copy_grouped([b[:x.shape[0]] for b, x in zip(bufs, srcs)], srcs)
    assert sorted(count.ops) == ["_foreach_copy_", "_foreach_copy_", "copy_", "copy_"]
    for b, x in zip(bufs, srcs):
        assert torch.equal(b[:x.shape[0]], x) and not b[x.shape[0]:].any()
    with pytest.raises(ValueError, match="copy_grouped"):
        copy_grouped([bufs[0][:3]], [srcs[0].int()])
    with pytest.raises(ValueError, match="copy_grouped"):
        copy_grouped([bufs[0][:2]], [srcs[0]])


def test_to_device_equals_torch_tensor_and_copies():
    """``host.to_device`` (through numpy since session 20): the same values and dtype as
    ``torch.tensor`` for lists, ranges, numpy arrays and empty input; a copy, never a view
    of the caller's array; an out-of-range value is an error, not a wrapped number."""
    for values in ([3, -1, 2**31 - 1], range(5), [], [True, False], np.arange(4) * 7):
        for dtype in (torch.int64, torch.int32, torch.float32, torch.bool, torch.bfloat16):
            got = to_device(values, dtype, "cpu")
            want = torch.tensor(list(values), dtype=dtype)
            assert got.dtype == dtype and torch.equal(got, want), (values, dtype)
    arr = np.arange(3)
    t = to_device(arr, torch.int64, "cpu")
    arr[0] = 99
    assert t.tolist() == [0, 1, 2]
    with pytest.raises((OverflowError, RuntimeError)):
        to_device([2**40], torch.int32, "cpu")


def _reads():
    """Tensors of the shapes a step reads: counts, rows, scalars, empty, one element."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-1, 1 << 20, (5,), generator=g, dtype=torch.int32),
            torch.randint(-1, 1 << 20, (3, 7), generator=g, dtype=torch.int32),
            torch.tensor(4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
            torch.zeros(2, 0, dtype=torch.int32), torch.tensor([9], dtype=torch.int32),
            torch.randint(-1, 1 << 20, (4,), generator=g)]  # int64: converted


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_reader_reads_what_tolist_reads(device):
    """``HostReader.read`` equals ``tolist()`` for every shape (empty, 0-d, length 1, a
    converted int64), alone and together, across reads that reuse its buffer, after a
    read larger than it was sized for, and with CPU tensors among the device's."""
    ts = [t.to(device) for t in _reads()]
    want = [t.tolist() for t in _reads()]
    reader = HostReader(16, device)
    for t, w in zip(ts, want):
        assert reader.read(t) == [w]
    assert reader.read(*ts) == want  # 5 + 21 + 1 + 0 + 0 + 1 + 4 elements: grows
    assert reader.read(ts[0], _reads()[1], ts[2]) == [want[0], want[1], want[2]]
    assert reader.read() == []
    if device == "cuda":  # a value written by the last kernel on the stream, not a stale one
        x = torch.zeros(1 << 22, dtype=torch.int32, device=device)
        for k in range(3):
            x.add_(1)
            assert reader.read(x[-3:]) == [[k + 1] * 3]


def test_reader_names_a_tensor_on_another_device():
    reader = HostReader(4, "cpu")
    assert reader.read(torch.arange(3)) == [[0, 1, 2]]
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="tensors: on meta"):
        reader.read(meta)
    with pytest.raises(ValueError, match="numel"):
        HostReader(-1, "cpu")
