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
                            desc.max_levels, desc.max_tail,
                            None if desc.level_key is None else desc.level_key[lv])


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
                             max_depth=arena.config.max_depth, sa_key=arena.sa_key)
    full = (ms.view(r, -1) >= e[None, :] + 1) & (e[None, :] < plen[:, None])
    return e0 + torch.cumprod(full.to(torch.int64), 1).sum(1)


def _ends_document(arena: IndexArena, corpus_ids: list[int], rows: list[torch.Tensor],
                   patterns: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """``bool [r]``: whether ``patterns[i, :l[i]]`` (``int64 [r, k]``, ``1 <= l[i] <= k``) are
    the last ``l[i]`` tokens of a document (before a separator or the corpus end) of one of
    the corpora checked for row ``i``: corpus ``corpus_ids[j]`` for the rows ``rows[j]``
    (``int64``). One pass over all (row, document) pairs, first by the last token."""
    dev = patterns.device
    r, k = patterns.shape
    hit = torch.zeros(r, dtype=torch.int64, device=dev)
    if r == 0 or not corpus_ids:
        return hit > 0
    tok_base = arena.descriptors(list(corpus_ids)).tok_base
    parts = [(rs, arena.doc_ends(cid), tok_base[j]) for j, (cid, rs) in
             enumerate(zip(corpus_ids, rows))]
    rr = torch.cat([rs.repeat_interleave(e.numel()) for rs, e, _ in parts])
    cc = torch.cat([e.repeat(rs.numel()) for rs, e, _ in parts])
    base = torch.cat([b.expand(rs.numel() * e.numel()) for rs, e, b in parts])
    # a document's last token must be t[l - 1] (one gather), then the whole window
    last = torch.take(arena.tokens, base + cc - 1).to(torch.int64)
    keep = torch.nonzero(last == patterns[rr, l[rr] - 1], as_tuple=True)[0]
    rr, cc, base = rr[keep], cc[keep], base[keep]
    ll = l[rr][:, None]
    i = torch.arange(k, device=dev)[None, :]
    pos = cc[:, None] - ll + i  # tokens c - l .. c - 1 against t[:l]
    use = i < ll
    ok_pos = pos >= 0
    toks = torch.take(arena.tokens, torch.where(use & ok_pos, base[:, None] + pos, 0))
    same = ((toks.to(torch.int64) == patterns[rr]) & ok_pos | ~use).all(dim=1)
    return hit.index_add_(0, rr, same.to(torch.int64)) > 0


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
        rows = [torch.tensor(rs, device=dev) for rs in by_cid.values()]
        best += _ends_document(arena, list(by_cid), rows, patterns, best + 1).to(torch.int64)
    return best


# --------------------------------------------------------------- a whole message at once

_CHUNK = 4096  # query rows per match call (bounds the search's [rows * 15, k] temporaries)
_DOC_CHUNK = 256  # positions per document-end check (a workspace holds thousands of documents)


def _runs(ok: torch.Tensor) -> torch.Tensor:
    """``int64 [n]``: the number of leading True of each row of ``ok`` (``bool [n, k]``)."""
    return torch.cumprod(ok.to(torch.int64), 1).sum(1)


def _followed_runs(arena: IndexArena, corpus_ids: list[int], message: torch.Tensor, k: int
                   ) -> torch.Tensor:
    """``int64 [n]``: per position ``p``, the longest ``l <= min(k, n - p)`` such that
    ``message[p:p + l]`` occurs in a corpus followed by a token.

    By matching statistics: with ``S[e]`` the longest suffix of ``message[:e]`` that occurs
    followed by a token (the drafter's match length: one search per end ``e`` and corpus,
    the corpora in order, an end that one matches in full skipping the rest),
    ``message[p:p + l]`` occurs so iff ``S[p + l] >= l``, and these ``l`` run from 1."""
    dev = message.device
    n = message.numel()
    padded = torch.cat([message.new_zeros(k), message]).to(torch.int32)
    queries = padded.unfold(0, k, 1)[1:n + 1]  # row e - 1: message[e - k:e], right-aligned
    lengths = torch.arange(1, n + 1, device=dev).clamp(max=k).to(torch.int32)
    S = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    full = lengths.to(torch.int64)  # no match is longer than its query
    # corpus by corpus: an end already matched in full by an earlier corpus is not searched
    for cid in corpus_ids:
        desc = arena.descriptors([cid])
        todo = torch.nonzero(S[1:] < full, as_tuple=True)[0]
        for i in range(0, todo.numel(), _CHUNK):
            t = todo[i:i + _CHUNK]
            ms = match_lengths_torch(arena.tokens, arena.sa,
                                     _select_rows(desc, torch.zeros_like(t)),
                                     queries[t].contiguous(), lengths[t],
                                     max_depth=arena.config.max_depth, sa_key=arena.sa_key)
            S[t + 1] = torch.maximum(S[t + 1], ms)
    p = torch.arange(n, device=dev)[:, None]
    l = torch.arange(1, k + 1, device=dev)[None, :]
    return _runs((p + l <= n) & (S[(p + l).clamp(max=n)] >= l))


def _emitted_runs(lead_in: torch.Tensor, message: torch.Tensor, k: int) -> torch.Tensor:
    """``int64 [n]``: per position ``p``, the longest ``l <= min(k, n - p)`` such that
    ``message[p:p + l]`` occurs in ``Y[:q]``, ``Y = lead_in ++ message`` and ``q`` the index
    of ``message[p]`` in ``Y``: in the text before it, the copy ending by ``q``.

    Exact, from the first occurrence of every ``l``-gram of ``Y``: dense ranks of the
    ``l``-grams grown one token at a time (one sort per ``l``) until no run is open."""
    dev = message.device
    Y = torch.cat([lead_in, message]).to(torch.int64)
    N, n = Y.numel(), message.numel()
    q = torch.arange(lead_in.numel(), N, device=dev)
    run = torch.zeros(n, dtype=torch.int64, device=dev)
    tok_rank = torch.unique(Y, return_inverse=True)[1]
    rank, idx = tok_rank, torch.arange(N, device=dev)
    for l in range(1, k + 1):
        # rank[i]: dense rank of Y[i:i + l] (i <= N - l); first[r]: the first i of rank r
        first = torch.full((N,), N, dtype=torch.int64, device=dev).scatter_reduce_(
            0, rank, idx[:rank.numel()], reduce="amin")
        ok = (q + l <= N) & (run == l - 1) & \
            (first[rank[q.clamp(max=rank.numel() - 1)]] + l <= q)
        if not bool(ok.any()):  # evaluation only: one host read per length
            break
        run += ok.to(torch.int64)
        if l < k:
            rank = torch.unique(rank[:N - l] * N + tok_rank[l:], return_inverse=True)[1]
    return run


def message_prefix_lengths(arena: IndexArena, corpus_ids: list[int], lead_in: torch.Tensor,
                           message: torch.Tensor, k: int) -> torch.Tensor:
    """The oracle of a whole message at once: ``int64 [n]``, per position ``p`` of ``message``
    (``[n]`` tokens the session emits next), the longest prefix of at most
    ``min(k, max_depth, n - p)`` tokens of ``message[p:]`` that occurs

    * in one of the corpora ``corpus_ids`` as they are now (followed by a token, or ending a
      document), or
    * in ``lead_in ++ message[:p]``, ending by ``p``: the text emitted before ``p``.
      ``lead_in`` holds the last ``k`` (or all, when fewer) tokens of the session's own
      corpus, itself one of ``corpus_ids``.

    That is :func:`longest_prefix` over the same corpora at every position ``p``, the session
    corpus grown by ``message[:p]`` and no other text joining them; at the cost of at most
    one search per token and corpus instead of several per step and corpus.
    """
    dev = arena.device
    k = min(k, arena.config.max_depth)
    message = message.to(dev, torch.int64)
    n = message.numel()
    if n == 0 or k <= 0:
        return torch.zeros(n, dtype=torch.int64, device=dev)
    best = torch.maximum(_followed_runs(arena, corpus_ids, message, k),
                         _emitted_runs(lead_in.to(dev, torch.int64), message, k))
    # message[p:p + best + 1] may still end a document (never longer: see longest_prefix)
    plen = (n - torch.arange(n, device=dev)).clamp(max=k)
    todo = torch.nonzero(best < plen, as_tuple=True)[0]
    windows = torch.cat([message, message.new_full((k,), -1)]).unfold(0, k, 1)
    for i in range(0, todo.numel(), _DOC_CHUNK):  # (position, document) pairs: bounded
        t = todo[i:i + _DOC_CHUNK]
        hit = _ends_document(arena, corpus_ids, [torch.arange(t.numel(), device=dev)]
                             * len(corpus_ids), windows[t], best[t] + 1)
        best[t] += hit.to(torch.int64)
    return best
