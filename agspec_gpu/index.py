"""Device-resident token corpora with log-structured, depth-bounded indexes of the reversed text.

An :class:`IndexArena` keeps many corpora (one per session, tenant workspace, ...) in two
shared device buffers, so that one batched query serves every request of a decode step:

* ``tokens`` (``int32``): each corpus owns a contiguous segment; documents inside a corpus
  are separated by negative sentinels, which never equal a query token.
* ``sa`` (``int32``): each corpus owns a few *levels*, oldest first: suffix arrays of the
  reversed text over contiguous ranges of continuation positions (each position sorted by the
  ``max_depth`` tokens before it; :func:`~agspec_gpu.kernels.suffix_array.context_array`).
  Positions past the last level form the *tail*, which the match kernel scans directly. A
  position's key is final as soon as it is appended, so when the tail holds ``tail_tokens``
  positions they become a new level, and levels of comparable size merge (a binary counter):
  appending a decode step's tokens or a 5,000-token file never rebuilds a large level.

:class:`SuffixIndex` is the single-corpus view with the public contract
(``build`` / ``append`` / ``match``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from agspec_gpu.checks import check_float_fields, check_int_fields, is_int
from agspec_gpu.descriptor_table import DescriptorTable
from agspec_gpu.host import HostWriter, canonical_device, to_device
from agspec_gpu.kernels.arena_append import arena_append
from agspec_gpu.kernels.suffix_match import (KEY_SEQ_SHIFT, MatchDescriptors, MatchResult,
                                             prefix_keys, suffix_match)
from agspec_gpu.kernels.suffix_array import MAX_BLOCK, context_array, num_context_positions

__all__ = ["IndexConfig", "IndexArena", "SuffixIndex", "MatchResult"]


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Index parameters.

    Attributes:
        max_depth: longest match length searched (tokens); levels sort by ``max_depth``
            context tokens.
        tail_tokens: positions the tail may hold before they become a level.
        merge_ratio: the newest level merges into the one before while that one is at most
            ``merge_ratio`` times larger.
    """

    max_depth: int = 64
    tail_tokens: int = 256
    merge_ratio: float = 2.0

    def __post_init__(self) -> None:
        check_int_fields(self, ("max_depth", "tail_tokens"))
        check_float_fields(self, ("merge_ratio",))
        if not 1 <= self.max_depth <= 4096:
            raise ValueError(f"max_depth must be in [1, 4096], got {self.max_depth}")
        # (the CPU match path reads rows x tail_tokens every step: 10**8 took 2.6 GB)
        if not 1 <= self.tail_tokens <= 1 << 20:
            raise ValueError(f"tail_tokens must be in [1, 2**20], got {self.tail_tokens}")
        if self.merge_ratio < 1.0:
            raise ValueError(f"merge_ratio must be >= 1, got {self.merge_ratio}")


@dataclass(slots=True)
class _Level:
    sa_base: int  # offset of this level's entries in the arena's sa buffer
    sa_len: int
    pos_lo: int  # indexed positions are in [pos_lo, pos_hi) of the corpus
    pos_hi: int
    seq: int = 0  # increases with sa_base across the buffer (the order of sa_key)


@dataclass(slots=True)
class _Corpus:
    tok_base: int
    tok_cap: int
    n: int = 0
    levels: list[_Level] = field(default_factory=list)
    # ascending positions of its separators (negative tokens), kept on the host: a level's
    # size is counted from them (num_context_positions), not read back from the device
    seps: list[int] = field(default_factory=list)

    @property
    def tail_start(self) -> int:
        return self.levels[-1].pos_hi if self.levels else 0


class IndexArena:
    """Many growable corpora with suffix indexes in shared device buffers.

    Args:
        config: index parameters.
        device: where the buffers live.
        initial_tokens: initial capacity of each buffer (grows by doubling).

    Corpora are addressed by integer ids from :meth:`new_corpus`. Space a corpus leaves (freed,
    relocated, merged away) is zeroed at once, so no text outlives its corpus, and reclaimed by
    compaction: in place when an allocation reaches the end of a buffer, and into smaller
    buffers when :meth:`free` leaves a buffer over twice its live data, so closing corpora
    returns their memory (the buffers then hold 1.5x the live data).
    """

    def __init__(self, config: IndexConfig | None = None, device: torch.device | str = "cpu",
                 initial_tokens: int = 1 << 12) -> None:
        self.config = config or IndexConfig()
        self.device = canonical_device(device)
        self.tokens = torch.zeros(max(initial_tokens, 16), dtype=torch.int32, device=self.device)
        self.sa = torch.zeros(max(initial_tokens, 16), dtype=torch.int32, device=self.device)
        # int8 tag per token (which tier / emission form it came from), moved with tokens
        self.src = torch.zeros(max(initial_tokens, 16), dtype=torch.int8, device=self.device)
        # on the CPU, int64 search keys of every sa entry (prefix_keys; _KEY_FREE past the
        # live levels), non-decreasing over the buffer (at max_depth 1, by the first
        # token's code only: a level is sorted by one token, and queries of one token
        # search only those codes): the torch match path's search hints. Kept in step
        # with sa by every allocation, move and compaction.
        self.sa_key = None if self.device.type == "cuda" else \
            torch.full_like(self.sa, _KEY_FREE, dtype=torch.int64)
        self._next_seq = 0
        self._corpora: dict[int, _Corpus] = {}
        self._next_id = 0
        self._tok_top = 0
        self._sa_top = 0
        self._tok_garbage = 0
        self._sa_garbage = 0
        self._doc_ends: dict[int, tuple[int, torch.Tensor]] = {}  # cid -> (n, ends)
        self._writer = HostWriter(1 << 18, self.device)  # append_rows' starts and counts
        self._work: torch.Tensor | None = None  # the level-build kernel's scratch (CUDA)
        # a deferred append_rows: (cids, its counts in _counts, columns, ticket) until settle()
        self._unsettled: tuple[list[int], torch.Tensor, int, int] | None = None
        self._counts = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._tickets = 0
        # every live corpus's descriptor fields, kept in step with _corpora by _sync
        self._table = DescriptorTable()

    # ---------------------------------------------------------------- lifecycle
    def new_corpus(self, capacity: int = 256) -> int:
        """Allocates an empty corpus and returns its id."""
        self.settle()  # an allocation may move every corpus: their lengths first
        cid = self._next_id
        self._next_id += 1
        cap = max(int(capacity), 16)
        self._corpora[cid] = _Corpus(tok_base=self._alloc_tokens(cap), tok_cap=cap)
        self._sync(cid)
        return cid

    def add_prebuilt(self, tokens: torch.Tensor, sa: torch.Tensor, indexed_end: int,
                     src: int = 0) -> int:
        """Adds a corpus with its index built offline (one level over ``[0, indexed_end)``).

        The caller vouches that ``sa`` is ``build_context_array(tokens, 0, indexed_end,
        max_depth)`` for this arena's ``max_depth`` (the global tier checks a checksum).
        """
        _check_tokens(tokens, "tokens", self.device)
        _check_corpus_size(0, tokens.numel())
        cid = self.new_corpus(max(tokens.numel(), 16))
        c = self._corpora[cid]
        self.tokens[c.tok_base:c.tok_base + tokens.numel()] = tokens
        self.src[c.tok_base:c.tok_base + tokens.numel()] = src
        c.n = tokens.numel()
        c.seps = _separators(tokens)
        base = self._alloc_sa(sa.numel())
        c = self._corpora[cid]
        self.sa[base:base + sa.numel()] = sa.to(self.device, torch.int32)
        c.levels.append(self._new_level(c, base, sa.numel(), 0, indexed_end))
        self._sync(cid)
        return cid

    def free(self, cid: int) -> None:
        """Releases a corpus: its text is zeroed now; its memory returns to the device once
        the buffers hold over twice the live data (see the class docstring)."""
        c = self._get(cid)
        self._tok_garbage += c.tok_cap
        self._sa_garbage += sum(lv.sa_len for lv in c.levels)
        self.tokens[c.tok_base:c.tok_base + c.tok_cap] = 0
        self.src[c.tok_base:c.tok_base + c.tok_cap] = 0
        for lv in c.levels:  # positions, and on the CPU the keys: two tokens of each
            self.sa[lv.sa_base:lv.sa_base + lv.sa_len] = 0
            if self.sa_key is not None:  # (the level's lowest key: the buffer stays sorted)
                self.sa_key[lv.sa_base:lv.sa_base + lv.sa_len] = lv.seq << KEY_SEQ_SHIFT
        del self._corpora[cid]
        self._table.drop(cid)
        self._doc_ends.pop(cid, None)
        live_tok, live_sa = self._live()
        if self.tokens.numel() > 2 * live_tok + 16 or self.sa.numel() > 2 * live_sa + 16:
            self._compact(shrink=True)

    def __contains__(self, cid: int) -> bool:
        return cid in self._corpora

    def num_tokens(self, cid: int) -> int:
        return self._get(cid).n

    def capacity(self, cid: int) -> int:
        """Token slots the corpus reserves (its tokens and their room to grow)."""
        return self._get(cid).tok_cap

    def corpus_tokens(self, cid: int) -> torch.Tensor:
        """``int32 [n]`` view of a corpus (valid until the next append/free)."""
        c = self._get(cid)
        return self.tokens[c.tok_base:c.tok_base + c.n]

    def nbytes(self, cid: int | None = None) -> int:
        """Bytes of the index layout, of one corpus or of the arena's buffers: 4 + 1 per
        token slot (tokens, source tags) and 4 per suffix-array entry, what an arena on a
        GPU holds. On the CPU, ``sa_key`` (the torch path's search keys) adds 8 per
        suffix-array entry."""
        if cid is None:
            return self.tokens.numel() * 5 + self.sa.numel() * 4
        c = self._get(cid)
        return 5 * c.tok_cap + 4 * sum(lv.sa_len for lv in c.levels)

    def doc_ends(self, cid: int) -> torch.Tensor:
        """``int64 [m]``: the positions ``c`` that end a document, a token at ``c - 1`` and a
        separator or the corpus end at ``c`` (the continuations the index leaves out; for the
        oracle, evaluation only; from the recorded separators, one copy per corpus length)."""
        c = self._get(cid)
        hit = self._doc_ends.get(cid)
        if hit is None or hit[0] != c.n:
            prev = [-2, *c.seps]  # a separator ends a document unless one precedes it
            ends = [s for p, s in zip(prev, c.seps) if s >= 1 and p != s - 1]
            if c.n and prev[-1] != c.n - 1:
                ends.append(c.n)
            hit = self._doc_ends[cid] = (
                c.n, torch.tensor(ends, dtype=torch.int64, device=self.device))
        return hit[1]

    def separators(self, cid: int) -> list[int]:
        """Ascending positions of the separators (negative tokens) of corpus ``cid``: the
        host's record, no read of the device."""
        return list(self._get(cid).seps)

    def num_levels(self, cid: int) -> int:
        return len(self._get(cid).levels)

    # ---------------------------------------------------------------- appends
    def append(self, cid: int, tokens: torch.Tensor, src: int | torch.Tensor = 0, *,
               separators: Sequence[int] | None = None) -> None:
        """Appends ``int32 [m]`` tokens (negative = separator) to corpus ``cid``.

        ``src`` tags the tokens (tier / emission form) for per-source statistics: one tag,
        or ``int8 [m]`` a tag per token (on the arena's device; a rebuild re-appends many
        documents' parts at once).
        ``separators``: the ascending positions in ``tokens`` of its negative values, when
        the caller knows them (``()``: token ids only); None: found in ``tokens``, a read of
        the device on a GPU. Nothing else is read back: a level is built once the tail holds
        ``tail_tokens`` positions, and its size is counted from the recorded separators.
        """
        c = self._get(cid)
        tokens = _check_tokens(tokens, "tokens", self.device)
        m = tokens.numel()
        if isinstance(src, torch.Tensor) and (src.dtype != torch.int8 or src.shape != (m,) or
                                              src.device != self.src.device):
            raise ValueError(f"src: expected one tag or int8 [{m}] on {self.src.device}, got "
                             f"{src.dtype} {list(src.shape)} on {src.device}")
        check_source_tag(src)  # (before any token is written)
        if m == 0:
            return
        _check_corpus_size(c.n, m)
        seps = _separators(tokens) if separators is None else list(separators)
        if c.n + m > c.tok_cap:
            self._relocate(cid, max(2 * c.tok_cap, c.n + m))
            c = self._corpora[cid]
        start = c.tok_base + c.n
        self.tokens[start:start + m] = tokens
        self.src[start:start + m] = src
        c.seps += [c.n + i for i in seps]
        c.n += m
        self._table.add_tokens([cid], [m])
        self._maybe_index(cid)

    def append_rows(self, cids: Sequence[int], tokens: torch.Tensor,
                    counts: Sequence[int] | torch.Tensor, src: int = 0,
                    totals: torch.Tensor | None = None) -> None:
        """Appends row ``i``'s first ``counts[i]`` tokens of ``tokens [len(cids), M]`` (int32)
        to corpus ``cids[i]``, for every row at once: the same corpora as :meth:`append` per
        row, in one launch (``kernels/arena_append.py``) instead of a few copies per row (a
        decode step's commit appends to every request's session corpus). ``counts`` are
        host ints; the corpora must be distinct; the appended tokens are ids, no separators
        (a model's output: a level's size is counted from the separators :meth:`append`
        records; on a CPU a level build checks that count). Nothing is read back from the
        device, level builds included.

        ``counts`` may instead be an integer tensor ``[len(cids)]`` on the arena's device
        (values in ``[0, M]``, the caller's contract): the append is *deferred*. The tokens
        are written in the same one launch (room for ``M`` per corpus made first), but the
        corpora's lengths on the host, and the level builds they make due, wait for
        :meth:`settle`, which takes the counts as host ints once the caller has read them
        (a loop that queues its commit before it waits for the step's results). Until then
        only the device knows the lengths (``totals``); every other call of the arena
        settles first, reading the counts back.

        ``totals``: ``int32 [len(cids)]`` lengths a caller mirrors on the device (any
        stride), grown by the counts in the same launch."""
        self.settle()
        if tokens.dim() != 2 or tokens.shape[0] != len(cids) or len(counts) != len(cids):
            raise ValueError(f"tokens: expected [{len(cids)}, M] with {len(cids)} counts, got "
                             f"{tuple(tokens.shape)} and {len(counts)} counts")
        if len(set(cids)) != len(cids):
            raise ValueError("cids: each corpus at most once per call")
        _check_tokens(tokens.reshape(-1), "tokens", self.device)
        check_source_tag(src)
        M = tokens.shape[1]
        deferred = isinstance(counts, torch.Tensor)
        if deferred:
            if counts.dim() != 1 or counts.device != self.device or \
                    counts.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"counts: expected an int32/int64 [{len(cids)}] tensor on "
                                 f"{self.device}, got {counts.dtype} {tuple(counts.shape)} on "
                                 f"{counts.device}")
            room = [M] * len(cids)  # the most each corpus may grow by
        else:
            if any(not is_int(m) or not 0 <= m <= M
                   for m in counts):
                raise ValueError(f"counts: each an int in [0, {M}], got {list(counts)}")
            room = counts = [int(m) for m in counts]
        corpora = [self._get(cid) for cid in cids]  # relocation and compaction keep them
        for c, m in zip(corpora, room):
            _check_corpus_size(c.n, m)
        for cid, c, m in zip(cids, corpora, room):  # grow first: relocation moves corpora
            if c.n + m > c.tok_cap:
                self._relocate(cid, max(2 * c.tok_cap, c.n + m))
        if deferred or any(counts):  # where each row's run starts, its length: one launch
            at = ([c.tok_base + c.n for c in corpora], torch.int64)
            if deferred:  # the counts copied: the caller's buffer may be reused
                if self._counts.numel() < len(cids):
                    self._counts = torch.zeros(2 * len(cids), dtype=torch.int64,
                                               device=self.device)
                (starts,), num = self._writer.write(at), self._counts[:len(cids)]
                num.copy_(counts)
            else:
                starts, num = self._writer.write(at, (counts, torch.int64))
            arena_append(self.tokens, self.src, tokens.contiguous(), starts, num, code=src,
                         totals=totals)
        if deferred:
            self._tickets += 1
            self._unsettled = (list(cids), num, M, self._tickets)
        else:
            self._appended(list(cids), counts)

    def settle(self, counts: Sequence[int] | None = None, *, cut: Sequence[bool] = ()
               ) -> None:
        """Completes a deferred :meth:`append_rows` (nothing when none waits): ``counts``
        are its device counts as host ints, read back here when None. The corpora then hold
        their rows, and each whose tail reached ``tail_tokens`` builds its level.

        ``cut[i]``: corpus ``i`` keeps fewer tokens than the device wrote (a request that
        ended inside its step); the positions past ``counts[i]`` it was given room for are
        zeroed (no text outlives its corpus's end). The caller's device mirror of the
        lengths (``totals``) then no longer holds."""
        if self._unsettled is None:
            return
        cids, dev_counts, M, _ = self._unsettled
        if counts is None:
            if any(cut):
                raise ValueError("cut: needs the counts each corpus keeps")
            counts = dev_counts.tolist()
        elif len(counts) != len(cids) or any(not 0 <= m <= M for m in counts):
            raise ValueError(f"counts: expected {len(cids)} counts in [0, {M}] (the "
                             f"deferred append's), got {list(counts)}")
        if cut and len(cut) != len(cids):
            raise ValueError(f"cut: expected {len(cids)} flags (the deferred append's "
                             f"corpora), got {len(cut)}")
        self._unsettled = None
        for cid, m, c in zip(cids, counts, cut):
            if c:
                at = self._corpora[cid].tok_base + self._corpora[cid].n + m
                self.tokens[at:at + M - m] = 0
                self.src[at:at + M - m] = 0
        self._appended(cids, counts)

    def may_build(self, cids: Sequence[int], m: int) -> bool:
        """Whether appending up to ``m`` tokens to any of corpora ``cids`` (a deferred
        append's, its lengths not yet settled) could make a level build due."""
        tail = self.config.tail_tokens
        return any((c := self._corpora[cid]).n + m - c.tail_start >= tail for cid in cids)

    @property
    def unsettled(self) -> int | None:
        """The ticket of the deferred append that waits for :meth:`settle` (they count up
        from 1), or None."""
        return None if self._unsettled is None else self._unsettled[3]

    def _appended(self, cids: list[int], counts: Sequence[int]) -> None:
        """The host's side of an append of ``counts[i]`` ids to each corpus ``cids[i]``,
        written to the device already: lengths, then the level builds that became due."""
        tail = self.config.tail_tokens
        corpora = [self._corpora[cid] for cid in cids]
        for c, m in zip(corpora, counts):  # every corpus holds its rows before any level
            c.n += m                        # build: a build may compact the token arena
        self._table.add_tokens(cids, counts)
        for cid, c, m in zip(cids, corpora, counts):
            if m and c.n - c.tail_start >= tail:
                self._maybe_index(cid)

    def _maybe_index(self, cid: int) -> None:
        """Indexes the tail of ``cid`` as a new level once it holds ``tail_tokens``
        positions; the new level absorbs each older level that is at most ``merge_ratio``
        times larger than it (newest first, the merged size growing as it goes). The
        merges are decided before anything is built (a merge's size is the sum of its
        parts), so a flush builds one level, over the merged range, instead of the tail
        and then each merge in turn."""
        c = self._corpora[cid]
        lo = c.tail_start
        if c.n - lo < self.config.tail_tokens:
            return
        keep = len(c.levels)
        while keep and c.levels[keep - 1].pos_hi - c.levels[keep - 1].pos_lo <= \
                self.config.merge_ratio * (c.n - lo):
            keep -= 1
            lo = c.levels[keep].pos_lo
        for lv in c.levels[keep:]:
            self._sa_garbage += lv.sa_len
        del c.levels[keep:]
        try:
            self._add_level(cid, lo, c.n)
        finally:  # a build that raised leaves the merged range in the tail (built at the
            self._sync(cid)  # next flush): the table lists no level it dropped

    def _add_level(self, cid: int, lo: int, hi: int) -> None:
        num = num_context_positions(self._corpora[cid].seps, lo, hi)
        base = self._alloc_sa(num)
        c = self._corpora[cid]  # _alloc_sa may compact (move the corpus)
        if self._work is None and self.device.type == "cuda":
            self._work = torch.empty(2 * MAX_BLOCK, dtype=torch.int64, device=self.device)
        # one launch on a GPU for a level of up to MAX_BLOCK positions, written in place
        try:
            context_array(self.tokens[c.tok_base:c.tok_base + c.n], lo, hi,
                          self.config.max_depth, num_selected=num,
                          out=self.sa[base:base + num], work=self._work)
        except BaseException:  # (a wrong count, on a CPU): the entries go back, unwritten
            self.sa[base:base + num] = 0
            self._sa_top = base
            raise
        c.levels.append(self._new_level(c, base, num, lo, hi))

    def _new_level(self, c: _Corpus, base: int, m: int, lo: int, hi: int) -> _Level:
        """The level whose entries were just written at ``sa[base:base + m]`` (the top of
        the buffer), with the next sequence number and its search keys."""
        lv = _Level(base, m, lo, hi, self._next_seq)
        self._next_seq += 1
        if self.sa_key is not None:
            self.sa_key[base:base + m] = prefix_keys(self.tokens, c.tok_base,
                                                     self.sa[base:base + m], lv.seq)
        return lv

    # ---------------------------------------------------------------- memory
    def _alloc_tokens(self, size: int) -> int:
        if self._tok_top + size > self.tokens.numel():
            self._compact()
            if self._tok_top + size > self.tokens.numel():
                self.tokens = _grown(self.tokens, self._tok_top, self._tok_top + size)
                self.src = _grown(self.src, self._tok_top, self._tok_top + size)
        base = self._tok_top
        self._tok_top += size
        return base

    def _alloc_sa(self, size: int) -> int:
        if self._sa_top + size > self.sa.numel() or self._next_seq >= _MAX_SEQ:
            self._compact(renumber=self._next_seq >= _MAX_SEQ)
            if self._sa_top + size > self.sa.numel():
                self.sa = _grown(self.sa, self._sa_top, self._sa_top + size)
                if self.sa_key is not None:
                    self.sa_key = _grown(self.sa_key, self._sa_top, self.sa.numel(), _KEY_FREE)
        base = self._sa_top
        self._sa_top += size
        return base

    def _relocate(self, cid: int, new_cap: int) -> None:
        c = self._corpora[cid]
        old = self.tokens[c.tok_base:c.tok_base + c.n].clone()
        old_src = self.src[c.tok_base:c.tok_base + c.n].clone()
        self.tokens[c.tok_base:c.tok_base + c.n] = 0  # no stale copy of the text
        self.src[c.tok_base:c.tok_base + c.n] = 0
        self._tok_garbage += c.tok_cap
        c.tok_cap = 0  # not live while we allocate (compaction may run)
        base = self._alloc_tokens(new_cap)
        c = self._corpora[cid]
        self.tokens[base:base + c.n] = old
        self.src[base:base + c.n] = old_src
        c.tok_base, c.tok_cap = base, new_cap
        self._sync(cid)

    def _live(self) -> tuple[int, int]:
        """(token slots, suffix-array entries) held by live corpora."""
        return (sum(c.tok_cap for c in self._corpora.values()),
                sum(lv.sa_len for c in self._corpora.values() for lv in c.levels))

    def _compact(self, shrink: bool = False, renumber: bool = False) -> None:
        """Rewrites live segments contiguously (oldest offset first): in place, or with
        ``shrink`` into new buffers of 1.5x the live data. Space past the live data is zero.
        Levels get sequence numbers 0, 1, ... in buffer order (also alone, ``renumber``)."""
        if not (shrink or renumber) and self._tok_garbage + self._sa_garbage == 0:
            return
        if shrink:
            live_tok, live_sa = self._live()
            tokens = torch.zeros(max(16, live_tok * 3 // 2), dtype=torch.int32,
                                 device=self.device)
            sa = torch.zeros(max(16, live_sa * 3 // 2), dtype=torch.int32, device=self.device)
            src = torch.zeros_like(tokens, dtype=torch.int8)
            sa_key = None if self.sa_key is None else \
                torch.full_like(sa, _KEY_FREE, dtype=torch.int64)
        else:
            tokens, sa, src, sa_key = self.tokens, self.sa, self.src, self.sa_key
        tt = st = 0
        for c in sorted(self._corpora.values(), key=lambda c: c.tok_base):
            for old, new in ((self.tokens, tokens), (self.src, src)):
                _move(old, c.tok_base, new, tt, c.n)
                new[tt + c.n:tt + c.tok_cap] = 0
            c.tok_base = tt
            tt += c.tok_cap
        levels = sorted((lv for c in self._corpora.values() for lv in c.levels),
                        key=lambda lv: lv.sa_base)
        for seq, lv in enumerate(levels):
            _move(self.sa, lv.sa_base, sa, st, lv.sa_len)
            if sa_key is not None:
                _move(self.sa_key, lv.sa_base, sa_key, st, lv.sa_len)
                if seq != lv.seq:
                    sa_key[st:st + lv.sa_len] += (seq - lv.seq) << KEY_SEQ_SHIFT
            lv.sa_base, lv.seq = st, seq
            st += lv.sa_len
        self._next_seq = len(levels)
        if not shrink:  # what lay past the live data is garbage now
            tokens[tt:self._tok_top] = 0
            src[tt:self._tok_top] = 0
            sa[st:self._sa_top] = 0
            if sa_key is not None:
                sa_key[st:self._sa_top] = _KEY_FREE
        self.tokens, self.sa, self.src, self.sa_key = tokens, sa, src, sa_key
        self._tok_top, self._sa_top = tt, st
        self._tok_garbage = self._sa_garbage = 0
        for cid in self._corpora:  # every base and sequence number may have moved
            self._sync(cid)

    # ---------------------------------------------------------------- queries
    def descriptor_fields(self, corpus_ids: Sequence[int]
                          ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The descriptors of rows ``corpus_ids`` on the host, packed as
        :meth:`MatchDescriptors.packed` takes them: ``(int64 fields, int32 fields, max
        levels, max tail)`` (gathered from the descriptor table; the int32 fields in an
        int64 array, converted where they are copied)."""
        self.settle()
        try:
            return self._table.gather(corpus_ids)
        except KeyError as e:
            raise KeyError(f"corpus id {e.args[0]} is unknown or freed") from None

    @property
    def descriptor_version(self) -> int:
        """Counts the changes to any corpus's descriptor fields (an append: one, whatever its
        rows; each level build, move or free: one more): descriptors gathered at a version
        are current while it stands."""
        return self._table.version

    def descriptors(self, corpus_ids: Sequence[int]) -> MatchDescriptors:
        """Per-row corpus descriptors for :func:`suffix_match`, two new device tensors the
        caller may keep (a propose stages :meth:`descriptor_fields` itself)."""
        i64, i32, max_levels, max_tail = self.descriptor_fields(corpus_ids)
        return MatchDescriptors.packed(to_device(i64, torch.int64, self.device),
                                       to_device(i32, torch.int32, self.device),
                                       len(corpus_ids), max_levels, max_tail)

    def _sync(self, cid: int) -> None:
        """The descriptor table's row of ``cid`` from its corpus (after any change but a
        plain append, which adds to the row's ``n`` itself)."""
        c = self._corpora[cid]
        self._table.set(cid, c.tok_base, c.n, c.tail_start,
                        [(lv.sa_base, lv.sa_len, lv.seq << KEY_SEQ_SHIFT) for lv in c.levels])

    def match(self, queries: torch.Tensor, lengths: torch.Tensor, corpus_ids: list[int],
              max_positions: int = 8, use_triton: bool | None = None, *,
              max_scan: int | None = None) -> MatchResult:
        """Longest suffix match of every query row against its corpus (one batched call).

        Args:
            queries: ``int32 [B, L]``, right-aligned: row ``b``'s query is
                ``queries[b, L - lengths[b]:]``; tokens must be ``>= 0``.
            lengths: ``int32 [B]``, ``0 <= lengths[b] <= L``.
            corpus_ids: ``B`` corpus ids (rows may share a corpus).
            max_positions: ``P``, continuation positions returned per row.
            max_scan: entries of each level's range read for them (None: all).

        Returns:
            :class:`MatchResult` (see :mod:`agspec_gpu.kernels.suffix_match`).
        """
        queries = _check_2d(queries, "queries", self.device)
        lengths = _check_lengths(lengths, queries, self.device)
        if len(corpus_ids) != queries.shape[0]:
            raise ValueError(f"corpus_ids: expected {queries.shape[0]} ids, got {len(corpus_ids)}")
        if max_positions < 0:
            raise ValueError(f"max_positions must be >= 0, got {max_positions}")
        desc = self.descriptors(list(corpus_ids))
        return suffix_match(self.tokens, self.sa, desc, queries, lengths,
                            max_depth=self.config.max_depth, max_positions=max_positions,
                            max_scan=max_scan, use_triton=use_triton, sa_key=self.sa_key)

    def _get(self, cid: int) -> _Corpus:
        self.settle()  # (a deferred append's lengths, read back: a sync)
        try:
            return self._corpora[cid]
        except KeyError:
            raise KeyError(f"corpus id {cid} is unknown or freed") from None


class SuffixIndex:
    """One corpus with its suffix index: the public contract of the data plane.

    Example::

        idx = SuffixIndex.build(tokens, max_depth=64)  # int32 [n], negative = separator
        idx.append(more)                               # as if built over the concatenation
        m = idx.match(queries, lengths, max_positions=8)
    """

    def __init__(self, config: IndexConfig | None = None, device: torch.device | str = "cpu",
                 capacity: int = 1024) -> None:
        self.arena = IndexArena(config, device, initial_tokens=capacity)
        self.cid = self.arena.new_corpus(capacity)

    @classmethod
    def build(cls, tokens: torch.Tensor, max_depth: int = 64, tail_tokens: int = 256
              ) -> "SuffixIndex":
        """Indexes ``tokens`` (``int32 [n]``, cpu or cuda; negative values are separators)."""
        if not isinstance(tokens, torch.Tensor):
            raise ValueError("tokens must be a torch.Tensor")
        _check_tokens(tokens, "tokens", tokens.device)
        idx = cls(IndexConfig(max_depth=max_depth, tail_tokens=tail_tokens), tokens.device,
                  capacity=max(tokens.numel(), 16))
        idx.append(tokens)
        return idx

    @property
    def max_depth(self) -> int:
        return self.arena.config.max_depth

    @property
    def num_tokens(self) -> int:
        return self.arena.num_tokens(self.cid)

    @property
    def tokens(self) -> torch.Tensor:
        return self.arena.corpus_tokens(self.cid)

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes(self.cid)

    def append(self, tokens: torch.Tensor) -> None:
        """Continues the corpus (start with a separator to begin a new document)."""
        self.arena.append(self.cid, tokens)

    def match(self, queries: torch.Tensor, lengths: torch.Tensor, max_positions: int = 8,
              use_triton: bool | None = None, *, max_scan: int | None = None) -> MatchResult:
        """See :meth:`IndexArena.match`; every row queries this corpus."""
        if not isinstance(queries, torch.Tensor) or queries.dim() != 2:
            raise ValueError("queries must be a 2-D int32 tensor [B, L]")
        return self.arena.match(queries, lengths, [self.cid] * queries.shape[0],
                                max_positions, use_triton, max_scan=max_scan)


# -------------------------------------------------------------------- validation helpers
def check_source_tag(src, name: str = "src") -> None:
    """One source tag (an int8 the arena stores per token), else ValueError naming
    ``name``; a tensor of them is checked by its dtype where it is appended."""
    if not isinstance(src, torch.Tensor) and (not is_int(src) or not -128 <= src <= 127):
        raise ValueError(f"{name}: expected a tag in [-128, 127] or an int8 tensor, got "
                         f"{src!r}")


def _check_tokens(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device.type != device.type:
        raise ValueError(f"{name} is on {t.device}, the index is on {device}")
    return t


def _check_2d(q: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [B, L]")
    if q.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {q.dtype}")
    if q.device.type != device.type:
        raise ValueError(f"{name} is on {q.device}, the index is on {device}")
    return q.contiguous()


def _check_lengths(lengths: torch.Tensor, queries: torch.Tensor, device: torch.device
                   ) -> torch.Tensor:
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        raise ValueError("lengths must be a 1-D int32 tensor [B]")
    if lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32, got {lengths.dtype}")
    if lengths.shape[0] != queries.shape[0]:
        raise ValueError(f"lengths has {lengths.shape[0]} rows, queries has {queries.shape[0]}")
    if lengths.device.type != device.type:
        raise ValueError(f"lengths is on {lengths.device}, the index is on {device}")
    B, L = queries.shape
    if B and bool(((lengths < 0) | (lengths > L)).any()):
        raise ValueError(f"lengths must be in [0, L={L}]")
    if B and L:
        used = torch.arange(L, device=queries.device)[None, :] >= (L - lengths.long())[:, None]
        if bool((used & (queries < 0)).any()):
            raise ValueError("queries must not contain negative tokens in the used suffix")
    return lengths.contiguous()


# a corpus's positions, lengths and suffix-array entries are int32 (the match kernel's
# descriptors, ``sa``): a corpus holds at most this many tokens
MAX_CORPUS_TOKENS = (1 << 31) - 1


def _check_corpus_size(n: int, m: int) -> None:
    """Raises ValueError naming ``tokens`` when ``m`` more tokens would take a corpus of
    ``n`` past :data:`MAX_CORPUS_TOKENS` (its int32 positions would wrap silently)."""
    if n + m > MAX_CORPUS_TOKENS:
        raise ValueError(f"tokens: {m} more tokens would take a corpus of {n} past "
                         f"{MAX_CORPUS_TOKENS} (int32 positions)")


def _separators(tokens: torch.Tensor) -> list[int]:
    """Ascending positions of the negative values of ``tokens`` (a read, on a GPU)."""
    return torch.nonzero(tokens < 0, as_tuple=True)[0].tolist()


def _move(src: torch.Tensor, at: int, dst: torch.Tensor, to: int, n: int) -> None:
    """``dst[to:to + n] = src[at:at + n]``, also when the two ranges overlap in one buffer."""
    if n == 0 or (src is dst and at == to):
        return
    seg = src[at:at + n]
    dst[to:to + n] = seg.clone() if src is dst and abs(at - to) < n else seg


def _grown(buf: torch.Tensor, used: int, need: int, fill: int = 0) -> torch.Tensor:
    new = torch.full((max(need, 2 * buf.numel()),), fill, dtype=buf.dtype, device=buf.device)
    new[:used] = buf[:used]
    return new


_KEY_FREE = torch.iinfo(torch.int64).max  # sa_key past the live levels: above every key
_MAX_SEQ = 1 << (63 - KEY_SEQ_SHIFT)  # level sequence numbers fit below the sign bit
