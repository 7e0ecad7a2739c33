"""The oracle bound of retrieval drafting: the longest prefix of the true continuation that
occurs anywhere in the corpora a request may search (evaluation only).

For every (row, corpus): in each suffix-array level the suffix sharing the longest prefix
with the continuation sits next to the continuation's insertion point, so the answer is the
longer common prefix with its two neighbours; tail positions are compared directly.
"""

from __future__ import annotations

import torch

from agspec_gpu.index import IndexArena
from agspec_gpu.kernels.suffix_match import _bound, _window


def _lcp(tokens, base, n, start, pat, k):
    vals = _window(tokens, base, n, start, k)
    eq = (vals == pat[:, :k]).to(torch.int64)
    return torch.cumprod(eq, dim=1).sum(dim=1)


def longest_prefix(arena: IndexArena, patterns: torch.Tensor, corpus_ids: list[int]
                   ) -> torch.Tensor:
    """``int64 [R]``: longest prefix of ``patterns[r]`` (``int32 [R, k]``, PAD < 0 ends it)
    occurring anywhere in corpus ``corpus_ids[r]`` (a separator never matches).

    Exact up to ``max_depth + 1`` tokens, the depth the levels are sorted by; longer
    patterns are cut there (the replay caps drafts at ``k <= max_depth + 1``).
    """
    dev = arena.device
    patterns = patterns[:, :arena.config.max_depth + 1]
    R, k = patterns.shape
    best = torch.zeros(R, dtype=torch.int64, device=dev)
    if R == 0 or k == 0:
        return best
    desc = arena.descriptors(list(corpus_ids))
    pat = torch.cat([patterns.to(torch.int64), torch.full((R, 1), -1, device=dev,
                                                           dtype=torch.int64)], 1)
    plen = torch.cumprod((patterns >= 0).to(torch.int64), 1).sum(1)
    base_row, n_row = desc.tok_base, desc.num_tokens.to(torch.int64)
    lv_ptr = desc.level_indptr.to(torch.int64)
    prow = torch.repeat_interleave(torch.arange(R, device=dev), lv_ptr[1:] - lv_ptr[:-1])
    if prow.numel():
        p_base, p_len = desc.level_sa_base, desc.level_sa_len.to(torch.int64)
        pb, pn, pp, pl = base_row[prow], n_row[prow], pat[prow], plen[prow]
        idx = _bound(arena.tokens, arena.sa, pb, pn, p_base, p_len, pp, pl, False)
        for nb in (idx - 1, idx):
            ok = (nb >= 0) & (nb < p_len)
            s = torch.take(arena.sa, (p_base + nb.clamp(min=0)).clamp(max=arena.sa.numel() - 1))
            lcp = torch.where(ok, torch.minimum(_lcp(arena.tokens, pb, pn, s.long(), pp, k), pl), 0)
            best.scatter_reduce_(0, prow, lcp, reduce="amax")
    T = desc.max_tail
    if T:
        tail = desc.tail_start.to(torch.int64)
        s_all = tail[:, None] + torch.arange(T, device=dev)[None, :]
        inside = s_all < n_row[:, None]
        first = torch.take(arena.tokens, torch.where(inside, base_row[:, None] + s_all, 0))
        kr, kt = torch.nonzero(inside & (first.long() == pat[:, :1]) & (plen[:, None] > 0),
                               as_tuple=True)
        if kr.numel():
            lcp = torch.minimum(_lcp(arena.tokens, base_row[kr], n_row[kr], s_all[kr, kt],
                                     pat[kr], k), plen[kr])
            best.scatter_reduce_(0, kr, lcp, reduce="amax")
    return best
