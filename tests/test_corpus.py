"""DocumentCorpus: documents by id with a token budget, on an index arena."""

import pytest
import torch

from agspec_gpu.corpus import BudgetExceeded, DocumentCorpus
from agspec_gpu.index import IndexArena, IndexConfig


def _arena():
    return IndexArena(IndexConfig(max_depth=8, tail_tokens=4))


def _longest(corpus, query):
    q = torch.tensor([query], dtype=torch.int32)
    m = corpus.arena.match(q, torch.tensor([len(query)], dtype=torch.int32), [corpus.cid], 4)
    return int(m.length[0]), [p for p in m.positions[0].tolist() if p >= 0]


def test_add_remove_by_id_and_no_match_across_documents():
    c = DocumentCorpus(_arena())
    c.add("a", [([1, 2, 3, 4], 0)])
    c.add("b", [([5, 6, 7], 0), ([1, 2, 9], 3)])  # two parts (e.g. two forms)
    assert len(c) == 2 and "a" in c and c.num_tokens == 5 + 4 + 4
    assert _longest(c, [1, 2, 3]) == (3, [4])
    # "4 5" only exists across the a|b boundary: a separator stops it
    assert _longest(c, [4, 5])[0] == 1
    c.remove("a")
    assert "a" not in c and len(c) == 1
    assert _longest(c, [2, 3])[0] == 0  # document a's text is gone
    assert _longest(c, [1, 2]) == (2, [7])  # "1 2 9" of document b's second part
    assert c.arena.src[c.arena._corpora[c.cid].tok_base + 5] == 3  # tags move with tokens
    with pytest.raises(KeyError, match="'a'"):
        c.remove("a")
    with pytest.raises(ValueError, match="'b'"):
        c.add("b", [([1], 0)])


def test_hard_budget_raises_and_leaves_the_corpus_unchanged():
    c = DocumentCorpus(_arena(), budget_tokens=10, evict="error")
    c.add("a", [([1, 2, 3, 4], 0)])
    before = c.arena.corpus_tokens(c.cid).tolist()
    with pytest.raises(BudgetExceeded, match="budget of 10"):
        c.add("b", [([5, 6, 7, 8, 9, 10], 0)])
    assert c.doc_ids() == ["a"] and c.arena.corpus_tokens(c.cid).tolist() == before


def test_lru_eviction_keeps_recent_documents_and_the_newest():
    c = DocumentCorpus(_arena(), budget_tokens=12, evict="lru", low_water=1.0)
    c.add("a", [([1, 1, 1], 0)])
    c.add("b", [([2, 2, 2], 0)])
    c.add("c", [([3, 3, 3], 0)])
    assert c.touch("a") and not c.touch("zzz")
    c.add("d", [([4, 4, 4], 0)])  # 16 > 12: evicts b (least recently used), keeps a, c, d
    assert c.doc_ids() == ["c", "a", "d"] and c.num_tokens == 12
    assert _longest(c, [2, 2])[0] == 0 and _longest(c, [4, 4])[0] == 2
    big = DocumentCorpus(_arena(), budget_tokens=4, evict="lru")
    big.add("x", [([7] * 9, 0)])  # larger than the budget alone: kept
    assert big.doc_ids() == ["x"]


def test_nbytes_and_free():
    arena = _arena()
    c = DocumentCorpus(arena)
    c.add("a", [(list(range(100)), 0)])
    assert c.nbytes >= 101 * 4 and c.nbytes <= 16 * 2 * 1024
    cid = c.cid
    c.free()
    with pytest.raises(KeyError):
        arena.num_tokens(cid)


@pytest.mark.parametrize("kwargs", [{"evict": "never"}, {"budget_tokens": 0},
                                    {"low_water": 0.0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DocumentCorpus(_arena(), **kwargs)
