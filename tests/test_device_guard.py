"""The device guard (``host.device_guard``): every public call of ``SpecDecoder`` and
``Drafter`` that does device work runs with its model's GPU current (Triton launches on the
current device, CUDA graphs are captured there) and gives the caller's back.

Without a GPU the guard's two C++ calls (``torch.cuda.device``'s enter and exit) are faked
here to record which device each call makes current; on a CPU object the guard switches
nothing. ``tests/test_gpu.py`` runs a decoder on ``cuda:1`` with ``cuda:0`` current.
"""

import functools
from types import SimpleNamespace

import pytest
import torch

from agspec_gpu import DecoderConfig, Drafter, SpecDecoder
from agspec_gpu.host import cuda_index, device_guard, serialized
from agspec_gpu.runners.hf import HFRunner, greedy_generate
from agspec_gpu.tokenizer import load_tokenizer
from tiny_models import tiny_model

pytest.importorskip("transformers")

# every wrapper device_guard makes runs this code: how a test tells a guarded method
_GUARDED = device_guard(lambda self: None).__code__
_SERIALIZED = serialized(lambda self: None).__code__  # (the decoder's lock, outermost)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A fake current device (``state.current``, 0 at first) behind the guard's C++ calls,
    and every call as ``("enter" | "exit", index)`` in ``state.calls``."""
    state = SimpleNamespace(current=0, calls=[])

    def exchange(kind):
        def call(index):
            state.calls.append((kind, index))
            previous, state.current = state.current, index
            return previous
        return call

    monkeypatch.setattr(torch._C, "_cuda_exchangeDevice", exchange("enter"), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_maybeExchangeDevice", exchange("exit"),
                        raising=False)
    return state


class _On:
    """An object of the guard's contract: ``_cuda_index`` and guarded methods."""

    def __init__(self, index: int) -> None:
        self._cuda_index = index

    @device_guard
    def call(self, fn=None, *args, **kwargs):
        return fn(*args, **kwargs) if fn is not None else None


def test_guard_makes_the_objects_device_current_and_gives_the_callers_back(fake_cuda):
    """Inside a call its object's device is current, after it the caller's again: on
    return, on an error, and around nested calls (another device's object, the same
    object re-entered as a callback would)."""
    seen = []
    on1, on2 = _On(1), _On(2)
    assert on1.call(lambda: fake_cuda.current) == 1 and fake_cuda.current == 0
    assert fake_cuda.calls == [("enter", 1), ("exit", 0)]

    def nested():
        seen.append(fake_cuda.current)
        on2.call(lambda: seen.append(fake_cuda.current))
        seen.append(fake_cuda.current)
        on1.call(lambda: seen.append(fake_cuda.current))  # re-entered: still device 1
        seen.append(fake_cuda.current)

    on1.call(nested)
    assert seen == [1, 2, 1, 1, 1] and fake_cuda.current == 0
    with pytest.raises(ZeroDivisionError):
        on1.call(on2.call, lambda: 1 / 0)
    assert fake_cuda.current == 0
    enters = [i for kind, i in fake_cuda.calls if kind == "enter"]
    assert len(enters) == len(fake_cuda.calls) // 2  # every enter has its exit
    # arguments and results pass through; the wrapped method keeps its name
    assert on1.call(lambda a, b=0: a + b, 2, b=3) == 5
    assert _On.call.__name__ == "call" and _On.call.__code__ is _GUARDED


def test_guard_on_a_cpu_object_switches_nothing(fake_cuda):
    on_cpu = _On(cuda_index(torch.device("cpu")))
    assert on_cpu.call(lambda: fake_cuda.current) == 0
    with pytest.raises(ZeroDivisionError):
        on_cpu.call(lambda: 1 / 0)
    assert fake_cuda.calls == []


def test_cuda_index_is_the_tensors_device(monkeypatch):
    """A GPU's index (an unindexed ``"cuda"``: the current one, as a tensor made there
    would say); -1 for any other device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_index(torch.device("cuda", 1)) == 1 and cuda_index("cuda:0") == 0
    assert cuda_index("cuda") == 3
    assert cuda_index("cpu") == -1 and cuda_index(torch.device("meta")) == -1


# SpecDecoder's and Drafter's public methods that touch no device (host bookkeeping only)
_HOST_ONLY = {SpecDecoder: {"submit", "session_stats"}, Drafter: {"forget", "has_session"}}


@pytest.mark.parametrize("cls", [SpecDecoder, Drafter])
def test_every_public_method_is_guarded_or_host_only(cls):
    """A public method added later takes the guard or joins the host-only list: a call
    that launches a Triton kernel from another device's current would fail (or worse) on
    a multi-GPU machine only."""
    public = {n: f for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}
    public = {n: f.__wrapped__ if f.__code__ is _SERIALIZED else f for n, f in public.items()}
    unguarded = {n for n, f in public.items() if f.__code__ is not _GUARDED}
    assert unguarded == _HOST_ONLY[cls]


@functools.cache
def _model():
    return tiny_model("llama", "sdpa", 100277)


def test_decoder_calls_run_on_the_models_device(fake_cuda):
    """A decoder (and its drafter) whose device is GPU 1 while GPU 0 is current: every
    public call makes 1 current and gives 0 back, ``on_tokens`` runs on 1 and may call the
    decoder again, and the output is still plain greedy decoding (the switches are the
    only change; the CPU tensors stay where they are)."""
    tok = load_tokenizer("cl100k")
    dec = SpecDecoder(_model(), tok, DecoderConfig(max_batch=2))
    assert dec._cuda_index == dec.drafter._cuda_index == -1 and fake_cuda.calls == []
    dec._cuda_index = dec.drafter._cuda_index = 1  # as a decoder built on cuda:1 would be

    def run(call):
        """``call()``'s result; it made device 1 current and gave 0 back."""
        fake_cuda.calls.clear()
        out = call()
        assert fake_cuda.calls[0] == ("enter", 1) and fake_cuda.calls[-1] == ("exit", 0)
        assert fake_cuda.current == 0
        return out

    prompt = tok.encode("def add(a, b):\n    return a + b\n\n" * 3)
    a = run(lambda: dec.open_session("t", "coder", prompt))
    b = run(lambda: dec.open_session("t", "coder", prompt[:20]))
    run(lambda: dec.append(b, tok.encode("\n")))
    run(lambda: dec.add_workspace_file(a, "add.py", "def add(a, b):\n    return a + b\n"))
    ctx_b = prompt[:20] + tok.encode("\n")
    seen = []

    def on_tokens(sid, toks):
        seen.append(fake_cuda.current)
        dec.add_workspace_file(sid, f"{sid}.txt", tok.decode(toks))  # a re-entrant call
        seen.append(fake_cuda.current)

    out = run(lambda: dec.generate([a, b], max_new_tokens=6, eos_id=None,
                                   on_tokens=on_tokens))
    assert seen and set(seen) == {1}
    assert out == [greedy_generate(_model(), prompt, 6, eos_id=None),
                   greedy_generate(_model(), ctx_b, 6, eos_id=None)]
    ctx = [prompt + out[0], ctx_b + out[1]]
    # the user's own loop
    runner = HFRunner(_model())
    runner.prefill([c[:-1] for c in ctx])
    draft = run(lambda: dec.propose([a, b]))
    run(lambda: dec.tree_inputs([a, b], draft))
    roots = run(lambda: dec.root_ids([a, b]))
    res = run(lambda: dec.commit([a, b], draft, runner.verify_padded(draft, roots)))
    for c, row, n in zip(ctx, res.output_ids.tolist(), res.num_output.tolist()):
        assert row[:n] == greedy_generate(_model(), c, n, eos_id=None)
        c += row[:n]
    # continuous batching: submit is host bookkeeping, step and cancel are guarded
    fake_cuda.calls.clear()
    dec.submit(a, max_new_tokens=3, eos_id=None)
    dec.submit(b, max_new_tokens=3, eos_id=None)
    assert fake_cuda.calls == []
    run(dec.step)
    run(lambda: dec.cancel(b))
    while dec.running:
        run(dec.step)
    for sid in (a, b):
        run(lambda: dec.close_session(sid))
    run(lambda: dec.close_tenant("t"))
