"""The per-step host helpers: grouped copies into graph buffers, host lists to the device
(``to_device``; ``host.HostWriter``'s pinned ring), and the step's reads back to the host
(``host.HostReader``)."""

import numpy as np
import pytest
import torch

from agspec_gpu.host import HostReader, HostWriter, copy_grouped, to_device
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
    before = [b.clone() for b in bufs]  # a bad pair after good ones: nothing copied
    with pytest.raises(ValueError, match="copy_grouped"):
        copy_grouped([bufs[5][:3], bufs[0][:2]], [srcs[5], srcs[0]])
    with pytest.raises(ValueError, match="dsts, srcs"):
        copy_grouped([bufs[0][:3]], [srcs[0], srcs[1]])
    assert all(torch.equal(b, a) for b, a in zip(bufs, before))
    for bad in (64.0, True, "64"):
        with pytest.raises(ValueError, match="nbytes"):
            HostWriter(bad, "cpu")
        with pytest.raises(ValueError, match="numel"):
            HostReader(bad, "cpu")


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


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_reader_start_then_wait_is_a_read(device):
    """``start`` then ``wait`` returns what ``read`` does; work queued between them (on a
    GPU behind the copy) does not change the values read; a start drops an earlier one not
    waited for (a step that failed between them), and a wait with no start is named."""
    ts = [t.to(device) for t in _reads()]
    want = [t.tolist() for t in _reads()]
    reader = HostReader(8, device)
    reader.start(*ts)
    other = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    other.add_(1)  # another tensor written between the halves
    assert reader.wait() == want
    reader.start(ts[0])
    reader.start(ts[1], ts[2])  # the first start is dropped
    assert reader.wait() == [want[1], want[2]]
    with pytest.raises(RuntimeError, match="no start"):
        reader.wait()
    reader.start()
    assert reader.wait() == []
    with pytest.raises(ValueError, match="tensors: on meta"):
        reader.start(torch.zeros(1, device="meta"))
    with pytest.raises(RuntimeError, match="no start"):  # a failed start leaves none
        reader.wait()


def test_reader_names_a_tensor_on_another_device():
    reader = HostReader(4, "cpu")
    assert reader.read(torch.arange(3)) == [[0, 1, 2]]
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="tensors: on meta"):
        reader.read(meta)
    with pytest.raises(ValueError, match="numel"):
        HostReader(-1, "cpu")


DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
_GROUPS = [([3, -1, 2**40], torch.int64), ([7], torch.int32), ([], torch.int64),
           ([1, 2, 3], torch.int32), ([0.5, -2.0], torch.float32), ([True, False], torch.bool),
           ([2**31 - 1], torch.int32), (range(5), torch.int64)]


@pytest.mark.parametrize("device", DEVICES)
def test_writer_writes_what_to_device_writes(device):
    """``HostWriter.write``: each group's values in its dtype, as ``to_device`` gives them,
    whatever the mix of dtypes, odd lengths (int32 then int64: alignment), empty and
    length-1 groups; one copy per write (none on a CPU: the views are the ring's)."""
    w = HostWriter(1 << 12, device)
    for k in range(1, len(_GROUPS) + 1):
        groups = _GROUPS[:k][::-1] if k % 2 else _GROUPS[:k]
        count = CountOps()
        with count.mode:
            got = w.write(*groups)
        assert count.ops == (["copy_"] if device == "cuda" else [])
        for t, (values, dtype) in zip(got, groups):
            want = to_device(values, dtype, device)
            assert t.dtype == dtype and t.device == want.device and torch.equal(t, want)
    assert w.write() == [] and w.nbytes == 1 << 12


@pytest.mark.parametrize("device", DEVICES)
def test_writer_ring_wraps_grows_and_views_live_until_reused(device):
    """The ring's two halves: writes follow one another in a half until one does not fit,
    which starts the other half; coming back to a half reuses its bytes (the documented
    lifetime of a view); a write larger than a half grows the ring, earlier views intact
    (they hold the old buffer)."""
    w = HostWriter(64, device)
    a, = w.write(([1, 2, 3], torch.int32))        # bytes [0, 12), then [12, 16) alignment
    b, = w.write(([4, 5], torch.int64))           # [16, 32): the first half is full
    doubled = a * 2  # a kernel that reads the view before the ring comes round
    c, = w.write(([6, 7, 8], torch.int64))        # the second half: [32, 56)
    d, = w.write(([9, 10], torch.int64))          # not in [56, 64): the first half again
    assert [a.tolist(), b.tolist(), c.tolist(), d.tolist()] == \
        [[9, 0, 10], [4, 5], [6, 7, 8], [9, 10]]  # a's bytes were reused
    assert doubled.tolist() == [2, 4, 6] and w.nbytes == 64
    big, = w.write((list(range(20)), torch.int64))  # 160 bytes > a half: a new ring
    assert big.tolist() == list(range(20)) and w.nbytes == 640
    e, = w.write(([11], torch.int32))
    assert e.tolist() == [11] and big.tolist() == list(range(20))
    assert [b.tolist(), c.tolist(), d.tolist()] == [[4, 5], [6, 7, 8], [9, 10]]


@pytest.mark.parametrize("device", DEVICES)
def test_writer_copy_to_fills_a_callers_tensor(device):
    """``HostWriter.copy_to``: the values in ``dst``'s dtype (an int64 list into an int32
    graph input), empty included; a wrong shape, a strided view, another device or a dtype
    it cannot stage named; nothing written then."""
    w = HostWriter(64, device)
    dst = torch.zeros(6, dtype=torch.int32, device=device)
    for values in ([5, 4, 3, 2, 1, 0], range(6), [7] * 6):
        w.copy_to(dst, values)
        assert dst.tolist() == list(values)
    w.copy_to(dst[:0], [])
    with pytest.raises(ValueError, match="dst: expected a contiguous 1-D tensor of 5"):
        w.copy_to(dst, [1] * 5)
    with pytest.raises(ValueError, match="dst: expected a contiguous 1-D"):
        w.copy_to(dst[::2], [1, 2, 3])
    with pytest.raises(ValueError, match="dst: expected a contiguous 1-D"):
        w.copy_to(dst.view(2, 3), [1] * 6)
    with pytest.raises(ValueError, match="no staging for torch.bfloat16"):
        w.copy_to(torch.zeros(2, dtype=torch.bfloat16, device=device), [1, 2])
    assert dst.tolist() == [7] * 6
    if device == "cuda":
        with pytest.raises(ValueError, match="dst: on cpu, the writer writes cuda:"):
            w.copy_to(torch.zeros(6, dtype=torch.int32), [1] * 6)
    with pytest.raises(ValueError, match="nbytes must be an int >= 32"):
        HostWriter(8, device)


@pytest.mark.parametrize("device", DEVICES)
def test_ring_and_reader_grown_in_inference_mode_take_writes_outside_it(device):
    """A ring (or a reader's buffer) that grows inside ``torch.inference_mode`` (a graphed
    verification step's page allocation) stays a normal tensor: the next write outside
    inference mode (a drafter's propose) would raise on an inference tensor."""
    w = HostWriter(64, device)
    r = HostReader(2, device)
    with torch.inference_mode():
        big, = w.write((list(range(40)), torch.int64))  # grows the ring
        assert r.read(torch.arange(9, device=device)) == [list(range(9))]  # grows the buffer
    assert big.tolist() == list(range(40)) and w.nbytes > 64
    assert not w._host.is_inference() and not w._dev.is_inference()
    assert r._buf is None or not r._buf.is_inference()
    v, = w.write(([3, 4], torch.int32))
    v.add_(1)  # an in-place write outside inference mode, as a step's kernels make
    assert v.tolist() == [4, 5]
    assert r.read(torch.arange(3, device=device)) == [[0, 1, 2]]


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_writer_on_cuda_waits_only_when_the_ring_comes_round():
    """On a GPU: no write synchronizes the stream before the ring comes round
    (``set_sync_debug_mode("error")`` raises on a sync), a kernel queued behind a long one
    reads the values of its own write, not the next one's, and after many rounds every
    value is still right."""
    w = HostWriter(1 << 16, "cuda")
    x = torch.zeros(1 << 24, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = []
        for k in range(64):
            x.mul_(1.0)  # a slow kernel ahead of the copy
            v, = w.write(([k] * 32, torch.int64))
            outs.append(v + 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [o.tolist() for o in outs] == [[k] * 32 for k in range(64)]
    for k in range(4096):  # 256 bytes a write: a half every 128 writes
        v, = w.write(([k] * 32, torch.int64))
        outs.append(v + 0)
    assert [o[0].item() for o in outs[64:]] == list(range(4096))
