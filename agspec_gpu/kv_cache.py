"""Paged KV cache in FlashInfer's NHD layout, with a per-sequence page allocator.

Every layer's cache is ``[num_pages + 1, 2, page_size, num_kv_heads, head_dim]`` (``[:, 0]``
keys, ``[:, 1]`` values): the tensor ``BatchPrefillWithPagedKVCacheWrapper.run(q,
paged_kv_cache)`` takes for ``kv_layout="NHD"``. All layers live in one tensor ``data`` of shape
``[num_layers, num_pages + 1, 2, page_size, num_kv_heads, head_dim]`` so that one kernel can move
KV for every layer (``kernels/kv_compact.py``). The extra last page is a null page: query rows
that are padding (``kv_slot == -1``) write there, so appends need no masking and no sync; it is
never given to a sequence.

A sequence's logical slot ``s`` lives at page ``page_table[row, s // page_size]``, offset
``s % page_size``. Page tables are rows of a device tensor sized for ``max_seqs`` sequences;
they change only when :meth:`allocate_many` adds pages (a step's new entries in one small
host-to-device copy from pinned memory).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from agspec_gpu.host import HostWriter, canonical_device
from agspec_gpu.tree import TreeMetadata


class KVCacheFull(RuntimeError):
    """The page pool (or its sequence rows) cannot hold an allocation; nothing was changed."""


class PagedKVCache:
    """KV pages for ``num_layers`` layers and the allocator that hands them to sequences.

    Parameters
    ----------
    num_layers, num_pages, page_size, num_kv_heads, head_dim : int
    dtype : torch.dtype
    device : torch.device or str
    max_seqs : int
        Sequences that can hold pages at once (rows of the page-table buffer).
    max_pages_per_seq : int, optional
        Width of the page table (default: ``num_pages``).

    Example
    -------
    >>> cache = PagedKVCache(2, num_pages=8, page_size=4, num_kv_heads=1, head_dim=8,
    ...                      dtype=torch.float32, device="cpu")
    >>> cache.allocate("a", 6)            # two pages
    >>> cache.page_table(["a"])[0, :2].tolist()
    [0, 1]
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, *,
                 max_seqs: int = 256, max_pages_per_seq: int | None = None) -> None:
        for name, v in (("num_layers", num_layers), ("num_pages", num_pages),
                        ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("max_seqs", max_seqs)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_pages_per_seq = max_pages_per_seq or num_pages
        self.null_page = num_pages
        self.device = canonical_device(device)
        # data: [L, num_pages + 1, 2, page_size, H_kv, D]
        self.data = torch.zeros(num_layers, num_pages + 1, 2, page_size, num_kv_heads, head_dim,
                                dtype=dtype, device=self.device)
        # page_table buffer: [max_seqs, max_pages_per_seq]; unused entries point at the null page
        self._page_table = torch.full((max_seqs, self.max_pages_per_seq), self.null_page,
                                      dtype=torch.int32, device=self.device)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._pages: dict[Hashable, list[int]] = {}
        self._rows: dict[Hashable, int] = {}
        # the per-step host lists (new page-table entries, a step's rows): pinned staging
        self._writer = HostWriter(1 << 16, self.device)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_rows(self) -> int:
        """Sequence rows (page-table rows) no sequence holds."""
        return len(self._free_rows)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s cache, ``[num_pages + 1, 2, page_size, H_kv, D]`` (a view)."""
        return self.data[i]

    def capacity(self, seq_id: Hashable) -> int:
        """Slots allocated to ``seq_id`` (0 for an unknown sequence)."""
        return len(self._pages.get(seq_id, ())) * self.page_size

    def pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Pages :meth:`allocate` would add for ``seq_id`` to hold ``num_tokens`` slots."""
        return max(-(-num_tokens // self.page_size) - len(self._pages.get(seq_id, ())), 0)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Makes ``seq_id`` hold at least ``num_tokens`` slots (:meth:`allocate_many` of one)."""
        self.allocate_many([seq_id], [num_tokens])

    def allocate_many(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        """Makes each ``seq_ids[i]`` hold at least ``num_tokens[i]`` slots, adding pages as
        needed, for a whole step at once: the new page-table entries go to the device in
        one copy (from pinned memory, no stream sync) and one scatter.

        Creates a sequence on first use. All or nothing: raises :class:`KVCacheFull` when
        the free pages or the sequence rows run out, ValueError when a ``num_tokens``
        exceeds the page-table width or a sequence comes twice, before anything changes.
        """
        if len(num_tokens) != len(seq_ids):
            raise ValueError(f"num_tokens: {len(num_tokens)} counts for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: each sequence at most once per call")
        grow, new_pages, new_rows = [], 0, 0
        for sid, n in zip(seq_ids, num_tokens):
            need = -(-n // self.page_size)
            have = len(self._pages.get(sid, ()))
            if need <= have:
                continue
            if need > self.max_pages_per_seq:
                raise ValueError(f"allocate({sid!r}, {n}): {need} pages exceed "
                                 f"max_pages_per_seq={self.max_pages_per_seq}")
            grow.append((sid, have, need))
            new_pages += need - have
            new_rows += sid not in self._pages
        what = f"allocate({grow[0][0]!r}, ...)" if len(grow) == 1 else \
            f"allocate_many({len(grow)} sequences)"
        if new_pages > len(self._free_pages):
            raise KVCacheFull(f"{what}: {new_pages} pages needed, {len(self._free_pages)} "
                              f"free")
        if new_rows > len(self._free_rows):
            raise KVCacheFull(f"{what}: {new_rows} new sequence rows needed, "
                              f"{len(self._free_rows)} of "
                              f"max_seqs={self._page_table.shape[0]} free")
        # the pages and rows pop() would hand out, in its order; the host takes them only
        # once the device table holds them (a failed write had left pages the host gave a
        # sequence mapped to the null page: its KV written there)
        plan, entries, pages = [], [], []  # flat page-table index -> page
        W, taken_pages, taken_rows = self.max_pages_per_seq, 0, 0
        for sid, have, need in grow:
            row = self._rows.get(sid)
            if row is None:
                taken_rows += 1
                row = self._free_rows[-taken_rows]
            new = [self._free_pages[-(taken_pages + j + 1)] for j in range(need - have)]
            taken_pages += need - have
            plan.append((sid, row, new))
            entries.extend(range(row * W + have, row * W + need))
            pages.extend(new)
        if entries:  # a host list assigned into a device tensor would wait for the stream
            idx, val = self._writer.write((entries, torch.int64), (pages, torch.int32))
            self._page_table.view(-1).index_copy_(0, idx, val)
        del self._free_pages[len(self._free_pages) - taken_pages:]
        del self._free_rows[len(self._free_rows) - taken_rows:]
        for sid, row, new in plan:
            self._rows[sid] = row
            self._pages.setdefault(sid, []).extend(new)

    def free(self, seq_id: Hashable) -> None:
        """Returns every page of ``seq_id`` to the pool."""
        if seq_id not in self._pages:
            raise ValueError(f"free({seq_id!r}): unknown sequence")
        # the host lets go first: a sequence it still listed over a reset row would write
        # its KV to the null page (an interrupt after the reset had done so); a reset that
        # fails returns the row unreset, whose stale entries past a later sequence's pages
        # nothing reads
        pages = self._pages.pop(seq_id)
        row = self._rows.pop(seq_id)
        try:
            self._page_table[row].fill_(self.null_page)
        finally:
            self._free_pages.extend(reversed(pages))
            self._free_rows.append(row)

    def page_table(self, seq_ids: Sequence[Hashable], *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """``int32 [len(seq_ids), max_pages_per_seq]`` the sequences' pages (null-page padded),
        into ``out`` when given (a preallocated buffer of that shape)."""
        missing = [s for s in seq_ids if s not in self._rows]
        if missing:
            raise ValueError(f"page_table: unknown sequences {missing}")
        rows, = self._writer.write(([self._rows[s] for s in seq_ids], torch.int64))
        if out is None:
            return self._page_table.index_select(0, rows)
        return torch.index_select(self._page_table, 0, rows, out=out)

    def slots_of(self, meta: TreeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page, offset)``, ``int64 [Q]`` each: where a step writes the KV of each query
        row of ``meta`` (:func:`~agspec_gpu.kernels.rope_append.rope_append`; padding rows:
        the null page). The same for every layer of a step: compute it once per forward."""
        slots = meta.kv_slots.long()
        slots = torch.where(slots >= 0, slots, self.null_page * self.page_size)
        return slots // self.page_size, slots % self.page_size
