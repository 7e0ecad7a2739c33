"""Calls of one ``SpecDecoder`` from several threads run one at a time (``host.serialized``):
a server's request threads submit and cancel while its loop thread steps, and the output is
still plain greedy decoding (tiny random Llama, real cl100k tokenizer, CPU)."""

import sys
import threading

import pytest

from agspec_gpu import SpecDecoder
from agspec_gpu.host import serialized
from test_decoder import VARIANTS, greedy, model, prompts
from test_step_api import decoder, run_until_idle

pytest.importorskip("transformers")

VARIANT = VARIANTS[0]
_SERIALIZED = serialized(lambda self: None).__code__


def test_every_public_call_takes_the_lock():
    """A public method or property added later takes the lock too: one that reads the
    scheduler while another thread's step changes it would see a batch half made."""
    public = {n: f for n, f in vars(SpecDecoder).items() if not n.startswith("_")}
    calls = {n: f.fget if isinstance(f, property) else f for n, f in public.items()
             if callable(f) or isinstance(f, property)}
    assert {"step", "submit", "running", "stats", "generate"} <= set(calls)
    assert {n for n, f in calls.items() if f.__code__ is not _SERIALIZED} == set()


def test_a_submit_from_another_thread_waits_for_the_running_step():
    """Thread A's ``step`` is held inside its model forward; thread B's ``submit``,
    ``queued`` and ``stats`` wait for it (they had run inside A's step, on a batch half
    made), then every request decodes as plain greedy decoding."""
    dec = decoder("hf")
    ps = prompts()[:3]
    sids = [dec.open_session("t", prompt_ids=p) for p in ps]
    dec.submit(sids[0], max_new_tokens=12)
    outs = dec.step()  # (its prefill: the next step is a speculative one, the model in it)
    inside, release, done = threading.Event(), threading.Event(), threading.Event()
    errors, seen = [], []

    def hold(module, args):
        if not inside.is_set():
            inside.set()
            release.wait(30)

    def step():
        try:
            outs.extend(dec.step())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    def requests():
        try:
            dec.submit(sids[1], max_new_tokens=10)
            dec.submit(sids[2], max_new_tokens=8)
            seen.append((dec.queued, dec.running, dec.stats["steps"]))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        done.set()

    handle = model(VARIANT).register_forward_pre_hook(hold)
    try:
        a = threading.Thread(target=step)
        a.start()
        assert inside.wait(30)
        b = threading.Thread(target=requests)
        b.start()
        assert not done.wait(0.5)  # B waits while A's step runs
        release.set()
        a.join(30)
        b.join(30)
    finally:
        release.set()
        handle.remove()
    assert errors == [] and done.is_set() and not a.is_alive()
    steps = dec.stats["steps"]
    assert seen == [(sids[1:], [] if outs[-1].finished else sids[:1], steps)]
    tokens = {s: [] for s in sids}
    for o in outs:
        tokens[o.session_id] += o.token_ids
    for sid, more in run_until_idle(dec).items():
        tokens[sid] += more
    for sid, p, n in zip(sids, ps, (12, 10, 8)):
        assert tokens[sid] == greedy(VARIANT, p, n)


def test_threads_submitting_beside_a_stepping_loop_get_greedy_output():
    """Three request threads submit two requests each while a loop thread steps until they
    are done; each finished request equals plain greedy decoding."""
    dec = decoder("paged", max_batch=3, max_sessions=8)
    ps = prompts()[:6]
    sids = [dec.open_session("t", prompt_ids=p) for p in ps]
    limits = [6, 9, 5, 11, 7, 8]
    tokens: dict[str, list[int]] = {s: [] for s in sids}
    finished: dict[str, str] = {}
    errors = []
    pending = [len(sids)]
    lock = threading.Lock()

    def client(my: list[int]):
        try:
            for i in my:
                dec.submit(sids[i], max_new_tokens=limits[i])
                with lock:
                    pending[0] -= 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def loop():
        try:
            while True:
                with lock:
                    left = pending[0]
                if not left and not dec.running and not dec.queued:
                    return
                for o in dec.step():
                    tokens[o.session_id] += o.token_ids
                    if o.finished:
                        finished[o.session_id] = o.finish_reason
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=([i, i + 3],)) for i in range(3)]
    threads.append(threading.Thread(target=loop))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads switch every few bytecodes: races show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert set(finished) == set(sids)
    for sid, p, n in zip(sids, ps, limits):
        assert tokens[sid] == greedy(VARIANT, p, n)
        assert finished[sid] == ("length" if len(tokens[sid]) == n else "eos")


def test_outputs_name_their_request_so_a_cancelled_ones_are_told_apart():
    """A loop thread that handed on a step's outputs after a request thread had cancelled
    the session's request and submitted a new one streamed the old request's tokens as
    the new one's (outputs named the session only). Each output names its request now."""
    dec = decoder("hf")
    p = prompts()[1]
    sid = dec.open_session("t", prompt_ids=p)
    first = dec.submit(sid, max_new_tokens=12)
    held = dec.step() + dec.step()  # the loop thread has these, not handed on yet
    dec.cancel(sid)  # meanwhile, another thread: the client went away; a new request
    second = dec.submit(sid, max_new_tokens=5)
    assert first != second
    assert [o.request_id for o in held] == [first, first]
    streamed = [t for o in held if o.request_id == second for t in o.token_ids]
    for _ in range(10):
        for o in dec.step():
            assert o.request_id == second
            streamed += o.token_ids
    ctx = dec._sessions[sid].context
    assert streamed == ctx[len(ctx) - 5:] == \
        greedy(VARIANT, list(p) + [t for o in held for t in o.token_ids], 5)


def test_a_cancel_naming_an_ended_request_leaves_the_sessions_next_one():
    """``cancel(sid, request_id)`` ends that request only: a client that went away after
    its request ended (another thread already submitted the session's next one) had
    cancelled the new request."""
    dec = decoder("hf")
    p = prompts()[3]
    sid = dec.open_session("t", prompt_ids=p)
    first = dec.submit(sid, max_new_tokens=3, eos_id=None)
    while dec.running or dec.queued:
        dec.step()
    second = dec.submit(sid, max_new_tokens=6, eos_id=None)
    dec.cancel(sid, request_id=first)  # ended: a no-op
    assert dec.queued == [sid]
    out = dec.step()  # (joins) ...
    dec.cancel(sid, request_id=first)
    assert dec.running == [sid] and [o.request_id for o in out] == [second]
    for bad in (True, 1.0, "1"):
        with pytest.raises(ValueError, match="request_id"):
            dec.cancel(sid, request_id=bad)
    assert dec.running == [sid]
    dec.cancel(sid, request_id=second)
    assert dec.running == [] and dec.session_stats(sid).finish_reason == "cancelled"
    third = dec.submit(sid, max_new_tokens=2, eos_id=None)
    dec.cancel(sid, request_id=second)  # queued: the named one is gone, this one stays
    assert dec.queued == [sid]
    dec.cancel(sid)  # whatever request it has
    assert dec.queued == [] and third > second > first
