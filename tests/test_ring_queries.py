"""The ring-queries kernel (``kernels/ring_queries.py``) against its torch path and the
definition; and its sm_90 compile."""

import random

import pytest
import torch

from agspec_gpu.kernels.ring_queries import _ring_queries_kernel, ring_queries
from agspec_gpu.tokenizer import load_tokenizer
from kernel_compile import assert_one_compile_per_config, compile_all_for_sm90

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check(slots, tier, recent, recent_len, match_cap):
    args = tuple(t.to(DEV) for t in (
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(tier, dtype=torch.int64).view(len(slots), -1 if slots else 1),
        torch.tensor(recent, dtype=torch.int32).view(len(recent_len), -1),
        torch.tensor(recent_len, dtype=torch.int32), torch.tensor(match_cap, dtype=torch.int32)))
    B, R = args[1].shape
    want_q = [recent[s] for s in slots for _ in range(R)]
    want_l = [min(recent_len[s], match_cap[s]) if t >= 0 else 0
              for s, row in zip(slots, args[1].tolist()) for t in row]
    for use_triton in (False, True):
        q, ql = ring_queries(*args, use_triton=use_triton)
        assert q.dtype == ql.dtype == torch.int32 and q.shape == (B * R, args[2].shape[1])
        assert q.tolist() == want_q and ql.tolist() == want_l, use_triton


def test_real_tokens_padding_rows_and_caps():
    tok = load_tokenizer("cl100k")
    D = 12
    rows = [tok.encode("def f(x):\n    return x + 1\n")[-D:],
            tok.encode("$ ls -la\n")[-D:], [5] * D]  # repeated tokens
    recent = [r + [0] * (D - len(r)) for r in rows]
    # slot 2 is the spare slot of padding rows; tier -1 rows get an empty query
    check([1, 0, 2], [[0, 1, -1], [0, -1, -1], [3, 2, 1]], recent,
          [len(rows[0]), len(rows[1]), D], [3, 99, 0])


@pytest.mark.parametrize("B,R,D", [(0, 1, 4), (1, 1, 1), (3, 4, 17), (8, 2, 32)])
def test_random_shapes(B, R, D):
    rng = random.Random(B * 100 + R * 10 + D)
    S = max(B, 1) + 1
    recent = [[rng.randrange(100) for _ in range(D)] for _ in range(S)]
    slots = rng.sample(range(S), B)
    tier = [[rng.choice([-1, 0, 1, 2, 3]) for _ in range(R)] for _ in range(B)]
    check(slots, tier, recent, [rng.randint(0, D) for _ in range(S)],
          [rng.randint(0, D + 3) for _ in range(S)])


def test_rejects_bad_inputs():
    good = dict(slots=torch.tensor([0]), tier=torch.zeros(1, 2, dtype=torch.int64),
                recent=torch.zeros(3, 4, dtype=torch.int32),
                recent_len=torch.zeros(3, dtype=torch.int32),
                match_cap=torch.zeros(3, dtype=torch.int32))
    for name, bad in (("slots", torch.tensor([0, 1])), ("tier", torch.zeros(1, 2)),
                      ("recent", torch.zeros(3, 4)),
                      ("recent_len", torch.zeros(2, dtype=torch.int32)),
                      ("match_cap", torch.zeros(3, dtype=torch.int64)), ("tier", torch.zeros(2))):
        with pytest.raises(ValueError, match=name):
            ring_queries(**{**good, name: bad}, use_triton=True)


def test_one_compile_for_every_batch_and_corpus_count():
    """A request's corpus count (1 to 5 rows) is not specialized: the match's queries of
    any batch reuse one compiled kernel."""
    def launch(B, R):
        z = lambda *shape, dt=torch.int32: torch.zeros(*shape, dtype=dt, device=DEV)  # noqa
        return lambda: ring_queries(z(B, dt=torch.int64), z(B, R, dt=torch.int64),
                                    z(B + 1, 32), z(B + 1), z(B + 1), use_triton=True)

    assert assert_one_compile_per_config(
        _ring_queries_kernel, [launch(B, R) for B, R in ((1, 1), (2, 3), (16, 4), (64, 5))]) == 1


def test_kernel_compiles_for_sm90():
    sig = dict(slots_ptr="*i64", tier_ptr="*i64", recent_ptr="*i32", recent_len_ptr="*i32",
               match_cap_ptr="*i32", queries_ptr="*i32", qlen_ptr="*i32", R="i32", D="i32",
               BLOCK_D="constexpr")
    compile_all_for_sm90([(_ring_queries_kernel, sig, dict(BLOCK_D=64)),
                          (_ring_queries_kernel, sig, dict(BLOCK_D=1))])
