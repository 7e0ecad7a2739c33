"""The oracle bound of retrieval drafting: the longest prefix of the true continuation that
occurs anywhere in the corpora a request may search (evaluation only).

With the index of the reversed text (:mod:`agspec_gpu.kernels.suffix_match`) one batched
search answers it for every prefix at once, by matching statistics: the prefix
``t[:l]`` occurs followed by a token iff the longest match of the query ``t[:l]`` has length
``l``. So each row becomes ``k`` queries (``t[:1] .. t[:k]``) and the answer ``a`` is the
longest run of full-length matches. A prefix that occurs only at the end of a document (or
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


def _stages(k: int) -> list[tuple[int, int]]:
    """Prefix-length stages ``[e0, e1)``: 4, 12, then the rest, cut at ``k``."""
    cuts = [0] + [c for c in (4, 12) if c < k] + [k]
    return list(zip(cuts[:-1], cuts[1:]))


def _full_prefixes(arena: IndexArena, patterns: torch.Tensor, plen: torch.Tensor,
                   base_desc: MatchDescriptors, rows: torch.Tensor, e0: int, e1: int
                   ) -> torch.Tensor:
    """``int64 [r]``: ``e0`` plus the run of prefixes ``t[:e + 1]``, ``e0 <= e < e1``, that
    occur followed by a token (rows whose prefixes below ``e0`` all do)."""
    dev = patterns.device
    r, k = patterns.shape[0], e1
    e = torch.arange(e0, e1, device=dev)
    # query (row, e) = patterns[row, :e + 1], right-aligned in k columns
    src = (e[:, None] - (k - 1) + torch.arange(k, device=dev)[None, :]).clamp(min=0)
    queries = patterns.clamp(min=0)[:, src].to(torch.int32).reshape(-1, k)
    lengths = torch.where(e[None, :] < plen[:, None], e[None, :] + 1, 0)
    desc = _repeat_rows(_select_rows(base_desc, rows), e.numel())
    ms = match_lengths_torch(arena.tokens, arena.sa, desc, queries,
                             lengths.reshape(-1).to(torch.int32),
                             max_depth=arena.config.max_depth)
    full = (ms.view(r, -1) >= e[None, :] + 1) & (e[None, :] < plen[:, None])
    return e0 + torch.cumprod(full.to(torch.int64), 1).sum(1)


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
    # most answers are short: the prefixes are tried in stages, a row going on to the next
    # stage only while every prefix so far was found
    best = torch.zeros(R, dtype=torch.int64, device=dev)
    rows = torch.arange(R, device=dev)
    for e0, e1 in _stages(k):
        rows = rows[(best[rows] == e0) & (plen[rows] > e0)]
        if rows.numel() == 0:
            break
        best[rows] = _full_prefixes(arena, patterns[rows], plen[rows], base_desc, rows, e0, e1)
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
