"""The index arena's host table of corpus descriptors: what ``set`` stores is what
``gather`` reads, through every growth (rows, level width, both at once)."""

import random

from agspec_gpu.descriptor_table import DescriptorTable


def expected(fields: dict, ids: list[int]) -> tuple[list[int], list[int], int, int]:
    """``gather``'s result from plain Python: the stored fields of ``ids`` in order."""
    i64, indptr, lens, W, tail = [], [0], [], 0, 0
    bases, keys = [], []
    for c in ids:
        tok_base, n, t, levels = fields[c]
        i64.append(tok_base)
        bases += [lv[0] for lv in levels]
        keys += [lv[2] for lv in levels]
        lens += [lv[1] for lv in levels]
        indptr.append(indptr[-1] + len(levels))
        W, tail = max(W, len(levels)), max(tail, n - t)
    ns = [fields[c][1] for c in ids]
    tails = [fields[c][2] for c in ids]
    return i64 + bases + keys, ns + tails + indptr + lens, W, tail


def check(t: DescriptorTable, fields: dict) -> None:
    ids = sorted(fields)
    i64, i32, W, tail = t.gather(ids)
    want = expected(fields, ids)
    assert i64.tolist() == want[0] and i32.tolist() == want[1] and (W, tail) == want[2:]


def test_a_new_wide_corpus_in_a_full_table_keeps_every_row():
    """A new corpus whose levels are wider than the table, when no row is free: the table
    grows in both directions at once (it grew rows at its old width and lost every row)."""
    t = DescriptorTable(rows=1, levels=1)
    t.set(0, 0, 5, 0, [(0, 5, 1)])
    t.set(1, 10, 7, 0, [(10, 3, 1), (13, 2, 2)])
    check(t, {0: (0, 5, 0, [(0, 5, 1)]), 1: (10, 7, 0, [(10, 3, 1), (13, 2, 2)])})


def test_random_sets_drops_and_adds_match_a_dict():
    rng = random.Random(0)
    t, fields, next_id = DescriptorTable(rows=1, levels=1), {}, 0
    for _ in range(400):
        op = rng.random()
        if op < 0.45 or not fields:
            cid = next_id if rng.random() < 0.6 or not fields else rng.choice(sorted(fields))
            next_id += cid == next_id
            levels = [(rng.randrange(1000), rng.randrange(1, 50), rng.randrange(3))
                      for _ in range(rng.randrange(0, 7))]
            n = rng.randrange(0, 200)
            fields[cid] = (rng.randrange(10 ** 6), n, rng.randrange(0, n + 1), levels)
            t.set(cid, *fields[cid][:3], levels)
        elif op < 0.7:
            cid = rng.choice(sorted(fields))
            t.drop(cid)
            del fields[cid]
        else:
            cids = rng.sample(sorted(fields), rng.randint(1, len(fields)))
            counts = [rng.randrange(5) for _ in cids]
            t.add_tokens(cids, counts)
            for c, k in zip(cids, counts):
                b, n, tail, lv = fields[c]
                fields[c] = (b, n + k, tail, lv)
        if fields:
            check(t, fields)
    assert t.version > 0

