"""Baselines for the batched longest-suffix match (shared by benchmarks and tests).

:func:`unfold_match` is the implementation someone writes first with torch: for each pattern
length ``l`` from long to short, compare every corpus window (``unfold``) with the last ``l``
tokens of every unresolved query row, batched over rows; a row is resolved at the first
(longest) ``l`` with a hit. It needs no index, is exact, and costs ``O(B * n * l)`` per
length tried, which is what the suffix-array index is measured against.

The semantics are those of :meth:`agspec_gpu.index.SuffixIndex.match` (and of
``tests/index_reference.match_reference``): a match must be followed by a non-separator
token, and positions are continuation positions (index of the token after the match), the
largest first, ``-1`` padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BaselineMatch", "unfold_match"]


@dataclass
class BaselineMatch:
    """Result of a baseline match (``B`` rows, ``P`` positions).

    Attributes:
        length: ``int32 [B]`` longest match length (0 if none).
        count: ``int64 [B]`` occurrences of that suffix followed by a token.
        positions: ``int64 [B, P]`` continuation positions, largest first, -1 padded.
    """

    length: torch.Tensor
    count: torch.Tensor
    positions: torch.Tensor


def unfold_match(corpus: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor, *,
                 max_depth: int, max_positions: int, chunk_elems: int = 1 << 25
                 ) -> BaselineMatch:
    """Longest suffix match of every query row by brute-force window comparison.

    Parameters
    ----------
    corpus : ``int32 [n]``; negative values are separators.
    queries : ``int32 [B, L]``, right-aligned (row ``b`` is ``queries[b, L - lengths[b]:]``,
        tokens ``>= 0``).
    lengths : ``int32 [B]``.
    max_depth : longest pattern length tried.
    max_positions : ``P``.
    chunk_elems : bound on the ``[rows, windows, l]`` comparison tensor (memory only).

    Returns
    -------
    BaselineMatch on the corpus's device.

    Example::

        m = unfold_match(tokens, queries, lengths, max_depth=64, max_positions=8)
    """
    dev = corpus.device
    B, L = queries.shape
    n = corpus.numel()
    P = max_positions
    qlen = torch.clamp(lengths.to(torch.int64), max=max_depth)
    length = torch.zeros(B, dtype=torch.int32, device=dev)
    count = torch.zeros(B, dtype=torch.int64, device=dev)
    positions = torch.full((B, P), -1, dtype=torch.int64, device=dev)
    active = qlen > 0
    if queries.dtype != corpus.dtype:
        queries = queries.to(corpus.dtype)
    # a match of length l at s needs a continuation token at s + l < n
    for l in range(min(max_depth, L, n - 1), 0, -1):
        rows = torch.nonzero(active & (qlen >= l)).flatten()
        if rows.numel() == 0:
            continue
        R, m = rows.numel(), n - l
        pat = queries[rows, L - l:]                  # [R, l]
        win = corpus.unfold(0, l, 1)[:m]             # [m, l], window s is corpus[s:s + l]
        cont_ok = corpus[l:] >= 0                    # [m]
        hit = torch.empty(R, m, dtype=torch.bool, device=dev)
        step = max(1, chunk_elems // (R * l))
        for c0 in range(0, m, step):
            c1 = min(m, c0 + step)
            hit[:, c0:c1] = (win[None, c0:c1] == pat[:, None, :]).all(dim=-1) & cont_ok[c0:c1]
        cnt = hit.sum(dim=1)
        found = cnt > 0
        rf = rows[found]
        length[rf] = l
        count[rf] = cnt[found]
        if P > 0 and rf.numel():
            s = torch.arange(m, device=dev)
            cand = torch.where(hit[found], s[None, :], -1)           # [F, m]
            top = torch.topk(cand, min(P, m), dim=1).values           # largest s first
            positions[rf, :top.shape[1]] = torch.where(top >= 0, top + l, -1)
        active[rf] = False
    return BaselineMatch(length, count, positions)
