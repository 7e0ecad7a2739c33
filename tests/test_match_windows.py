"""The match-windows kernel (``kernels/match_windows.py``) against its torch path and against
the definition, on real token text and adversarial layouts; and its sm_90 compile."""

import random

import pytest
import torch

from agspec_gpu.kernels.match_windows import (PAD_ID, _match_windows_kernel, match_windows,
                                              match_windows_torch)
from agspec_gpu.tokenizer import load_tokenizer
from kernel_compile import compile_all_for_sm90

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def definition(tokens, src, tok_base, num_tokens, positions, K):
    """The windows, one entry at a time."""
    R, P = positions.shape
    win = [[[PAD_ID] * K for _ in range(P)] for _ in range(R)]
    wsrc = [[[-1] * K for _ in range(P)] for _ in range(R)]
    for r in range(R):
        for i in range(P):
            c = int(positions[r, i])
            for j in range(K):
                if c >= 0 and c + j < int(num_tokens[r]):
                    win[r][i][j] = int(tokens[int(tok_base[r]) + c + j])
                    wsrc[r][i][j] = int(src[int(tok_base[r]) + c + j])
    return win, wsrc


def arena(corpora: list[list[int]]):
    """One buffer holding ``corpora`` back to back with gaps (as the arena does)."""
    tokens, src, bases = [], [], []
    for i, c in enumerate(corpora):
        tokens += [7] * 3  # a gap another corpus owns: never read
        src += [9] * 3
        bases.append(len(tokens))
        tokens += c
        src += [(i + t) % 5 - 1 for t in range(len(c))]
    tokens += [7] * 4
    src += [9] * 4
    return (torch.tensor(tokens, dtype=torch.int32, device=DEV),
            torch.tensor(src, dtype=torch.int8, device=DEV), bases)


def check(corpora, rows, positions, K):
    """``rows[r]``: the corpus of row ``r``; ``positions [R, P]``."""
    tokens, src, bases = arena(corpora)
    tok_base = torch.tensor([bases[c] for c in rows], dtype=torch.int64, device=DEV)
    num = torch.tensor([len(corpora[c]) for c in rows], dtype=torch.int32, device=DEV)
    pos = torch.tensor(positions, dtype=torch.int64, device=DEV).view(len(rows),
                                                                      -1 if rows else 1)
    want = definition(tokens.cpu(), src.cpu(), tok_base.cpu(), num.cpu(), pos.cpu(), K)
    for use_triton in (False, True):
        win, wsrc = match_windows(tokens, src, tok_base, num, pos, K, use_triton=use_triton)
        assert win.dtype == torch.int32 and wsrc.dtype == torch.int8
        assert tuple(win.shape) == tuple(wsrc.shape) == (len(rows), pos.shape[1], K)
        assert (win.tolist(), wsrc.tolist()) == want, use_triton


def test_real_text_windows():
    tok = load_tokenizer("cl100k")
    corpora = [tok.encode("def f(x):\n    return x + 1\n" * 3),
               tok.encode("$ git diff src/loss.py\n-    return a\n+    return b\n"),
               tok.encode("x")]
    rng = random.Random(0)
    for K in (1, 3, 8, 32):
        for P in (1, 4, 8):
            rows = [rng.randrange(3) for _ in range(5)]
            pos = [rng.choice([-1, 0, len(corpora[c]) - 1, len(corpora[c]) - 2,
                               rng.randrange(len(corpora[c]))]) for c in rows for _ in range(P)]
            check(corpora, rows, pos, K)


@pytest.mark.parametrize("K", [0, 1, 5])
def test_empty_and_length_one(K):
    check([[4]], [], [], K)  # no rows
    check([[4]], [0], [0], K)  # a one-token corpus
    check([[4]], [0], [-1], K)  # no position
    check([[4], []], [1, 0], [0, 0], K)  # an empty corpus: nothing is inside it


def test_repeated_periodic_and_separator_tokens():
    periodic = [1, 2, 3] * 12
    repeated = [5] * 20
    separators = [1, -1, 2, -3, 3, 4]  # separators are read as they are
    P, K = 6, 16
    rows = [0, 1, 2, 0]
    pos = [0, 3, 33, 35, 36, -1,
           0, 1, 18, 19, -1, -1,
           0, 1, 2, 5, -1, 4,
           30, 31, 32, 33, 34, 35]
    check([periodic, repeated, separators], rows, pos, K)
    assert len(pos) == len(rows) * P


def test_torch_and_triton_agree_on_random_layouts():
    rng = random.Random(1)
    for _ in range(20):
        corpora = [[rng.randrange(-2, 50) for _ in range(rng.randrange(0, 40))]
                   for _ in range(rng.randrange(1, 4))]
        R, P, K = rng.randrange(0, 6), rng.randrange(1, 9), rng.randrange(0, 12)
        rows = [rng.randrange(len(corpora)) for _ in range(R)]
        pos = [rng.randrange(-1, len(corpora[c]) + 2) for c in rows for _ in range(P)]
        tokens, src, bases = arena(corpora)
        tok_base = torch.tensor([bases[c] for c in rows], dtype=torch.int64, device=DEV)
        num = torch.tensor([len(corpora[c]) for c in rows], dtype=torch.int32, device=DEV)
        p = torch.tensor(pos, dtype=torch.int64, device=DEV).view(R, P)
        a = match_windows_torch(tokens, src, tok_base, num, p, K)
        b = match_windows(tokens, src, tok_base, num, p, K, use_triton=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_rejects_bad_inputs():
    tokens, src, bases = arena([[1, 2, 3]])
    base = torch.tensor([bases[0]], dtype=torch.int64, device=DEV)
    num = torch.tensor([3], dtype=torch.int32, device=DEV)
    pos = torch.zeros(1, 2, dtype=torch.int64, device=DEV)
    good = dict(tokens=tokens, src=src, tok_base=base, num_tokens=num, positions=pos, K=4)
    for name, bad in (("tokens", tokens.long()), ("src", src[:-1]), ("tok_base", base.int()),
                      ("num_tokens", num.repeat(2)), ("positions", pos.int()),
                      ("positions", pos[0]), ("K", -1), ("K", 2.0),
                      ("tokens", tokens.view(-1, 1)[::2, 0])):
        with pytest.raises(ValueError, match=name):
            match_windows(**{**good, name: bad}, use_triton=True)


def test_kernel_compiles_for_sm90():
    sig = dict(tokens_ptr="*i32", src_ptr="*i8", tok_base_ptr="*i64", num_tokens_ptr="*i32",
               pos_ptr="*i64", win_ptr="*i32", win_src_ptr="*i8", P="i32", K="i32",
               BLOCK_P="constexpr", BLOCK_K="constexpr")
    compile_all_for_sm90([(_match_windows_kernel, sig, dict(BLOCK_P=8, BLOCK_K=32)),
                          (_match_windows_kernel, sig, dict(BLOCK_P=1, BLOCK_K=1))])
