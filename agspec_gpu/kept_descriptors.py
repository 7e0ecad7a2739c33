"""A running batch's match descriptors, kept on the device between its steps.

A propose matches every (request, corpus) row of its grid, and the match kernel reads each
row's corpus descriptors (:class:`~agspec_gpu.kernels.suffix_match.MatchDescriptors`:
token base, length, tail start, level ranges). Gathered from the arena's host table,
staged and packed every step, they cost a propose ~40 us of host time at B = 1 on the
development machine. Yet between two level builds of its corpora a running batch changes
one field only: the session corpora's lengths, by the counts its own commit appends. So
the descriptors stay in device buffers, current at one descriptor version of the arena
(:attr:`~agspec_gpu.index.IndexArena.descriptor_version`, which counts every change): a
propose gathers only when its grid changed or the version moved by anything but the
batch's own appends, and a commit's append adds its counts to the session rows on the
device in its own launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agspec_gpu.host import HostWriter
from agspec_gpu.index import IndexArena
from agspec_gpu.kernels.suffix_match import MatchDescriptors


class KeptDescriptors:
    """The descriptors of one grid (the drafter's last), in buffers that grow by doubling.

    Parameters
    ----------
    device : where the buffers live (the arena's device)
    slack : the most tokens a deferred commit appends to a session corpus before the
        arena settles (:meth:`IndexArena.append_rows`): its tail may outgrow
        ``tail_tokens - 1`` by that much while the kept descriptors serve a propose
    """

    def __init__(self, device: torch.device, slack: int = 0) -> None:
        self.slack = slack
        self._i64 = torch.empty(0, dtype=torch.int64, device=device)
        self._i32 = torch.empty(0, dtype=torch.int32, device=device)
        self.key: tuple | None = None  # the grid the descriptors describe
        self.version = -1  # the arena's descriptor version they are current at
        self.desc: MatchDescriptors | None = None
        self._session_lengths: torch.Tensor | None = None  # int32 [B], stride Rs

    def get(self, arena: IndexArena, writer: HostWriter, key: tuple, rows_cid: Sequence[int],
            Rs: int) -> MatchDescriptors:
        """The descriptors of grid ``key``: rows ``rows_cid``, ``Rs`` per request, its
        session corpus first. Kept ones while current; else gathered and copied through
        ``writer`` (one copy per dtype). ``max_tail``, which bounds the torch path's tail
        scan (the kernel does not read it), is the gather's or ``tail_tokens - 1``,
        whichever is larger: a session corpus's tail stays below ``tail_tokens`` until a
        build, which moves the version (below ``tail_tokens + slack`` while a deferred
        commit waits for it)."""
        if key == self.key and self.version == arena.descriptor_version:
            return self.desc
        i64, i32, max_levels, max_tail = arena.descriptor_fields(rows_cid)
        if self._i64.numel() < len(i64) or self._i32.numel() < len(i32):
            dev = self._i64.device
            self._i64 = torch.empty(2 * len(i64), dtype=torch.int64, device=dev)
            self._i32 = torch.empty(2 * len(i32), dtype=torch.int32, device=dev)
        d64, d32 = self._i64[:len(i64)], self._i32[:len(i32)]
        writer.copy_to(d64, i64)
        writer.copy_to(d32, i32)
        self.desc = MatchDescriptors.packed(d64, d32, len(rows_cid), max_levels,
                                            max(max_tail,
                                                arena.config.tail_tokens - 1 + self.slack))
        self.key, self.version = key, arena.descriptor_version
        self._session_lengths = self.desc.num_tokens.view(-1, Rs)[:, 0]  # a view, made once
        return self.desc

    def lengths(self, arena: IndexArena, key: tuple) -> torch.Tensor | None:
        """The kept session rows' lengths (``int32 [B]``, a strided view), for the append of
        grid ``key``'s commit to grow in its launch (``arena_append``'s ``totals``), when
        the descriptors are that grid's and current; else None (nothing to keep)."""
        if key != self.key or self.version != arena.descriptor_version:
            return None
        return self._session_lengths

    def appended(self, arena: IndexArena, key: tuple, version: int) -> None:
        """After grid ``key``'s commit appended to its requests' session corpora, the
        arena at descriptor version ``version`` before it, through an append that grew
        :meth:`lengths` by its counts: the descriptors stay current, or, where anything
        else changed a corpus (a build, a move), they are dropped. The padding rows (tier
        -1, no query) keep their lengths: they match nothing."""
        if key != self.key:
            return
        if self.version != version or arena.descriptor_version != version + 1:
            self.key = self.desc = self._session_lengths = None
            return
        self.version = version + 1
