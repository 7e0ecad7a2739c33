"""A corpus of documents with ids, on one corpus of an :class:`~agspec_gpu.index.IndexArena`.

Documents are int32 token sequences (one or more *parts*, each with its own source tag,
e.g. the emission forms of one file), each part preceded by a negative separator so no match
crosses documents. Documents can be removed by id; the store holds a token budget that
either refuses an addition with a clear error or evicts least-recently-used documents, as
the caller chooses. Removal rebuilds the corpus from the remaining documents (the index of
an appended corpus cannot forget text in place); eviction frees down to a low-water mark so
rebuilds stay rare. A rebuild that raises drops every document (as an eviction would) and
leaves an empty, usable store.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from agspec_gpu.index import IndexArena, check_source_tag

SEP = -1


class BudgetExceeded(ValueError):
    """Adding a document would exceed the corpus's token budget."""


@dataclass(slots=True)
class _Part:
    start: int
    end: int
    src: int


class DocumentCorpus:
    """Documents by id in one arena corpus, with a token budget.

    Args:
        arena: the arena that holds the tokens and the index.
        budget_tokens: most tokens held (separators included); None for no limit.
        evict: ``"error"`` (raise :class:`BudgetExceeded`, nothing changes) or ``"lru"``
            (evict least-recently-used documents, never the one just added).
        low_water: after an eviction the corpus holds at most ``low_water * budget_tokens``
            (plus the newest document when it alone is larger).
    """

    def __init__(self, arena: IndexArena, budget_tokens: int | None = None,
                 evict: str = "error", low_water: float = 1.0) -> None:
        if evict not in ("error", "lru"):
            raise ValueError(f"evict must be 'error' or 'lru', got {evict!r}")
        if budget_tokens is not None and budget_tokens < 1:
            raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
        if not 0.0 < low_water <= 1.0:
            raise ValueError(f"low_water must be in (0, 1], got {low_water}")
        self.arena = arena
        self.budget_tokens = budget_tokens
        self.evict = evict
        self.low_water = low_water
        self.cid = arena.new_corpus(1 << 10)
        self._docs: OrderedDict[Hashable, list[_Part]] = OrderedDict()

    def __contains__(self, doc_id: Hashable) -> bool:
        return doc_id in self._docs

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def num_tokens(self) -> int:
        return self.arena.num_tokens(self.cid)

    @property
    def num_slots(self) -> int:
        """Token slots reserved: :attr:`num_tokens` and the room to grow."""
        return self.arena.capacity(self.cid)

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes(self.cid)

    def doc_ids(self) -> list[Hashable]:
        """Document ids, least recently used first."""
        return list(self._docs)

    def touch(self, doc_id: Hashable) -> bool:
        """Marks a document as used; False if it is not here."""
        if doc_id not in self._docs:
            return False
        self._docs.move_to_end(doc_id)
        return True

    def add(self, doc_id: Hashable, parts: Sequence[tuple[Sequence[int] | torch.Tensor, int]],
            *, token_ids_only: bool = False) -> int:
        """Adds a document made of ``(tokens, src)`` parts; returns the tokens added.

        ``token_ids_only``: the caller vouches that no part holds a separator (a negative
        value; a session's text, say), so none is searched for: a part on a GPU is otherwise
        read back to find them (one on the CPU is checked, which costs nothing there).

        Raises:
            ValueError: ``doc_id`` is already present; with ``token_ids_only``, a part on the
                CPU holds a negative value (the corpus is unchanged).
            BudgetExceeded: over budget with ``evict="error"`` (the corpus is unchanged).
        """
        if doc_id in self._docs:
            raise ValueError(f"doc_id {doc_id!r} is already in the corpus")
        tensors = [(torch.as_tensor(t, dtype=torch.int32), src) for t, src in parts]
        for i, (t, src) in enumerate(tensors):  # all checked before any part is written
            if t.dim() != 1:
                raise ValueError(f"parts[{i}]: expected 1-D tokens, got {list(t.shape)}")
            check_source_tag(src, f"parts[{i}]: src")
        size = sum(1 + t.numel() for t, _ in tensors)
        if self.budget_tokens is not None and self.evict == "error" and \
                self.num_tokens + size > self.budget_tokens:
            raise BudgetExceeded(f"doc_id {doc_id!r}: {size} tokens would exceed the budget of "
                                 f"{self.budget_tokens} ({self.num_tokens} held)")
        sep = torch.tensor([SEP], dtype=torch.int32, device=self.arena.device)
        placed = []
        if token_ids_only and any(t.device.type == "cpu" and bool((t < 0).any())
                                  for t, _ in tensors):
            raise ValueError(f"parts: doc_id {doc_id!r} is added with token_ids_only, but a "
                             f"part holds a negative value (a separator)")
        for t, src in tensors:
            start = self.num_tokens
            # the part's separators, its own first and any in its text, found where the text
            # is on the host (else the arena reads them)
            seps = [0] if token_ids_only else \
                [0, *(torch.nonzero(t < 0, as_tuple=True)[0] + 1).tolist()] \
                if t.device.type == "cpu" else None
            self.arena.append(self.cid, torch.cat([sep, t.to(self.arena.device)]), src,
                              separators=seps)
            placed.append(_Part(start, start + 1 + t.numel(), src))
        self._docs[doc_id] = placed
        if self.budget_tokens is not None and self.num_tokens > self.budget_tokens:
            self._evict_lru()
        return size

    def remove(self, doc_id: Hashable) -> None:
        """Removes a document by id (rebuilds the corpus without it)."""
        if doc_id not in self._docs:
            raise KeyError(f"doc_id {doc_id!r} is not in the corpus")
        del self._docs[doc_id]
        self._rebuild()

    def free(self) -> None:
        """Releases the corpus and its device memory."""
        self.arena.free(self.cid)
        self._docs.clear()

    def _evict_lru(self) -> None:
        target = int(self.low_water * self.budget_tokens)
        total = self.num_tokens
        while len(self._docs) > 1 and total > target:
            _, parts = self._docs.popitem(last=False)
            total -= sum(p.end - p.start for p in parts)
        self._rebuild()

    def _rebuild(self) -> None:
        """Rewrites the corpus with the kept documents only.

        The old corpus is freed first (its space can be reused in place, so a rebuild never
        holds two copies of the documents). Should the rebuild raise (an allocation, say),
        the store is left empty and usable, its documents dropped as if evicted, and the
        error re-raised: no document then describes text its corpus lacks.
        """
        old = self.arena.corpus_tokens(self.cid).clone()
        old_seps = self.arena.separators(self.cid)
        parts = [p for doc in self._docs.values() for p in doc]
        # every kept part in one append, its separators and a source tag per token: one
        # index build for them all, not a tail's worth of builds per part
        spans, seps, start = [], [], 0
        for p in parts:
            seps += [i - p.start + start for i in
                     old_seps[bisect_left(old_seps, p.start):bisect_left(old_seps, p.end)]]
            spans.append((start, start + p.end - p.start))
            start += p.end - p.start
        try:
            self.arena.free(self.cid)  # (may raise past its removal: a compaction)
            self.cid = self.arena.new_corpus(max(1 << 10, 2 * start))
            if parts:
                tokens = torch.cat([old[p.start:p.end] for p in parts])
                src = torch.repeat_interleave(
                    torch.tensor([p.src for p in parts], dtype=torch.int8),
                    torch.tensor([p.end - p.start for p in parts])).to(tokens.device)
                self.arena.append(self.cid, tokens, src, separators=seps)
        except BaseException:
            self._drop_all()
            raise
        for p, (s, e) in zip(parts, spans):
            p.start, p.end = s, e

    def _drop_all(self) -> None:
        """After a failed rebuild: no documents, and a live (empty) corpus when one can be
        had (the partly written one is freed first)."""
        self._docs.clear()
        try:
            if self.cid in self.arena:
                self.arena.free(self.cid)
        finally:
            if self.cid not in self.arena:
                self.cid = self.arena.new_corpus(1 << 10)
