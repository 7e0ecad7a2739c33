"""The oracle bound of retrieval drafting: the longest prefix of the true continuation that
occurs anywhere in the corpora a request may search (evaluation only).

With the index of the reversed text (:mod:`agspec_gpu.kernels.suffix_match`) the question
"does ``t[:l]`` occur" is one query, by matching statistics: the prefix ``t[:l]`` occurs
followed by a token iff the longest match of the query ``t[:l]`` has length ``l``. That is
monotone in ``l``, so the answer ``a`` is searched per row, a few lengths per round as the
queries of one batched match: ``1 .. 4`` first (most answers are short), then 8 lengths
spread up to the pattern's length (a fully found pattern ends there), then the bracket left:
at most 15 queries and 3 rounds for a 32-token pattern (trying every length took 32). A prefix that occurs only at the end of a document (or
of the corpus) is not followed by a token; then ``t[:a + 1]`` (never longer: ``t[:a + 2]``
would make ``t[:a + 1]`` followed by a token) is checked against the documents' last tokens.
"""

from __future__ import annotations

import torch

from agspec_gpu.index import IndexArena
from agspec_gpu.kernels.suffix_match import MatchDescriptors, match_lengths_torch


def _repeat_rows(desc: MatchDescriptors, k: int) -> MatchDescriptors:
    """The descriptors with every row repeated ``k`` times (row ``r`` -> ``r*k .. r*k+k-1``)."""
    rows = torch.arange(desc.tok_base.numel(), device=desc.tok_base.device).repeat_interleave(k)
    return _select_rows(desc, rows)


def _select_rows(desc: MatchDescriptors, rows: torch.Tensor) -> MatchDescriptors:
    """The descriptors of ``rows`` (``int64 [r]``, repeats allowed), in that order."""
    per_row = torch.diff(desc.level_indptr.to(torch.int64))
    counts = per_row[rows]
    first = (desc.level_indptr[:-1].to(torch.int64))[rows]
    start = torch.cumsum(counts, 0) - counts
    lv = torch.repeat_interleave(first - start, counts) + torch.arange(int(counts.sum()),
                                                                      device=per_row.device)
    indptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
    return MatchDescriptors(desc.tok_base[rows], desc.num_tokens[rows], desc.tail_start[rows],
                            indptr, desc.level_sa_base[lv], desc.level_sa_len[lv],
                            desc.max_levels, desc.max_tail)


_FIRST = 4  # prefix lengths tried first: most answers are short
_FANOUT = 8  # prefix lengths tried per later round


def _pivots(lo: torch.Tensor, hi: torch.Tensor, first: bool) -> torch.Tensor:
    """``int64 [r, F]``: prefix lengths to try in ``(lo, hi]``, ascending, 0 where unused.

    The first round tries ``1 .. _FIRST``; later ones ``_FANOUT`` lengths evenly spread up to
    ``hi`` (so a row whose whole pattern occurs ends in that round), or every length when the
    bracket is that narrow."""
    if first:
        piv = lo[:, None] + torch.arange(1, _FIRST + 1, device=lo.device)[None, :]
    else:
        f = torch.arange(1, _FANOUT + 1, device=lo.device)[None, :]
        width = (hi - lo)[:, None]
        piv = lo[:, None] + (width * f + _FANOUT - 1) // _FANOUT
        # narrow brackets repeat lengths: keep the first of each
        piv = torch.where(piv > torch.cat([lo[:, None], piv[:, :-1]], 1), piv, 0)
    return torch.where(piv <= hi[:, None], piv, 0)


def _occurs(arena: IndexArena, patterns: torch.Tensor, base_desc: MatchDescriptors,
            rows: torch.Tensor, piv: torch.Tensor) -> torch.Tensor:
    """``bool [r, F]``: whether ``t[:piv]`` of pattern row ``rows[i]`` occurs followed by a
    token (False where ``piv`` is 0): the longest match of the query ``t[:piv]`` is ``piv``."""
    dev = patterns.device
    r, F = piv.shape
    k = patterns.shape[1]
    # query (i, f) = patterns[rows[i], :piv[i, f]], right-aligned in k columns
    src = (piv[:, :, None] - k + torch.arange(k, device=dev)[None, None, :]).clamp(min=0)
    queries = patterns[rows].clamp(min=0).gather(1, src.view(r, F * k)).to(torch.int32)
    desc = _repeat_rows(_select_rows(base_desc, rows), F)
    ms = match_lengths_torch(arena.tokens, arena.sa, desc, queries.view(r * F, k),
                             piv.reshape(-1).to(torch.int32), max_depth=arena.config.max_depth)
    return (ms.view(r, F) >= piv) & (piv > 0)


def longest_prefix(arena: IndexArena, patterns: torch.Tensor, corpus_ids: list[int]
                   ) -> torch.Tensor:
    """``int64 [R]``: longest prefix of ``patterns[r]`` (``int32 [R, k]``, PAD < 0 ends it)
    occurring anywhere in corpus ``corpus_ids[r]`` (a separator never matches).

    Exact up to ``max_depth`` tokens, the depth the levels are sorted by; longer patterns are
    cut there (the replay caps drafts at ``k <= max_depth``).
    """
    dev = arena.device
    max_depth = arena.config.max_depth
    patterns = patterns[:, :max_depth].to(dev, torch.int64)
    R, k = patterns.shape
    if R == 0 or k == 0:
        return torch.zeros(R, dtype=torch.int64, device=dev)
    plen = torch.cumprod((patterns >= 0).to(torch.int64), 1).sum(1)
    base_desc = arena.descriptors(list(corpus_ids))
    # "t[:l] occurs followed by a token" is monotone in l: a search over l per row, a few
    # lengths per round (one batched match), keeping t[:best] found and the answer <= hi
    best = torch.zeros(R, dtype=torch.int64, device=dev)
    hi = plen.clone()
    rows = torch.nonzero(plen > 0, as_tuple=True)[0]
    first = True
    while rows.numel():
        lo_r, hi_r = best[rows], hi[rows]
        piv = _pivots(lo_r, hi_r, first)
        ok = _occurs(arena, patterns, base_desc, rows, piv)
        best[rows] = torch.where(ok, piv, lo_r[:, None]).max(dim=1).values
        hi[rows] = torch.where((piv > 0) & ~ok, piv - 1, hi_r[:, None]).min(dim=1).values
        rows = rows[best[rows] < hi[rows]]
        first = False
    # t[:best + 1] may still occur right before a separator or the corpus end
    todo = torch.nonzero(best < plen, as_tuple=True)[0]
    if todo.numel():
        by_cid: dict[int, list[int]] = {}  # evaluation only: host reads are fine here
        for r in todo.tolist():
            by_cid.setdefault(corpus_ids[r], []).append(r)
        parts = [(torch.tensor(rs, device=dev), arena.doc_ends(cid)) for cid, rs in by_cid.items()]
        rr = torch.cat([rs.repeat_interleave(c.numel()) for rs, c in parts])
        cc = torch.cat([c.repeat(rs.numel()) for rs, c in parts])
        # a document's last token must be t[best] (one gather), then the whole window
        last = torch.take(arena.tokens, base_desc.tok_base[rr] + cc - 1).to(torch.int64)
        keep = torch.nonzero(last == patterns[rr, best[rr]], as_tuple=True)[0]
        rr, cc = rr[keep], cc[keep]
        if rr.numel():
            base = base_desc.tok_base[rr]
            l = best[rr] + 1  # compare tokens c - l .. c - 1 with t[:l]
            i = torch.arange(k, device=dev)[None, :]
            pos = cc[:, None] - l[:, None] + i
            use = i < l[:, None]
            ok_pos = pos >= 0
            toks = torch.take(arena.tokens, torch.where(use & ok_pos, base[:, None] + pos, 0))
            hit = ((toks.to(torch.int64) == patterns[rr]) & ok_pos | ~use).all(dim=1)
            best.scatter_reduce_(0, rr, torch.where(hit, l, 0), reduce="amax")
    return best
