"""VerifyGraphs' padded steps equal the unpadded verification forward (CPU, torch backend).

The padding a CUDA graph needs (requests of one row on the null page, a sink request over the
rest of the bucket's rows) must not change a real request's logits or the KV it writes. On a
GPU the same metadata is replayed through a captured graph (tests/test_gpu.py); here it runs
eagerly through the torch backend, which consumes the same FlashInfer-layout metadata.
"""

import os

import numpy as np
import pytest
import torch

from agspec_gpu import DraftBatch
from agspec_gpu.runners.paged import PagedLlamaRunner
from agspec_gpu.runners.verify_graphs import VerifyGraphs, row_buckets
from test_attention import RecordingWrapper
from test_paged_runner import tiny_model
from tree_reference import random_trees


def test_row_buckets():
    assert row_buckets(1, 8) == [10]  # 1 * 9 + 1 = 10 rows at most
    assert row_buckets(1, 64) == [10, 18, 34, 66]
    b = row_buckets(16, 64)
    assert b[0] == 25 and b[-1] == 16 * 65 + 1 and b == sorted(set(b))


def _runner(split: bool = True):
    return PagedLlamaRunner.from_hf_model(tiny_model("llama"), num_pages=96, page_size=4,
                                          max_seqs=8, split_attention=split)


def _draft(trees, width):
    """Ragged trees as a DraftBatch of ``width`` columns (PAD_ID past each tree)."""
    d = DraftBatch.from_lists(trees)
    pad = width - d.token_ids.shape[1]
    tok = torch.nn.functional.pad(d.token_ids, (0, pad), value=-1)
    par = torch.nn.functional.pad(d.parents, (0, pad), value=-1)
    return DraftBatch(tok, par, d.num_draft_tokens)


@pytest.mark.parametrize("seed,split", [(0, True), (1, True), (2, True), (0, False)])
def test_padded_step_equals_unpadded(seed, split):
    rng = np.random.default_rng(seed)
    runner = _runner(split)
    vg = VerifyGraphs(runner, [1, 4], max_nodes=6)
    assert vg.split == split
    assert not vg.uses_graphs and vg.graph_error is None  # CPU: eager, same metadata
    ids = ["a", "b", "c"]
    prompts = [rng.integers(0, 1000, n).tolist() for n in (9, 23, 5)]
    roots = runner.prefill(ids, prompts).argmax(-1).to(torch.int32)
    lens = [len(p) for p in prompts]
    # buckets S = 4 (one or two padding requests), 1, 4, ...: steps of 2 requests after 3
    # in bucket 4 re-pad the row the larger step wrote ("c"'s pages must get no padding
    # KV), and after full trees (the largest bucket's rows) the node columns they wrote stay
    for step, b in enumerate([3, 1, 2, 3, 3, 2, 1]):
        sizes = [int(rng.integers(0, 7)) for _ in range(b)]
        if step == 4:
            sizes = [6] * b
        trees = random_trees(rng, sizes, "random", vocab=1000)
        draft = _draft(trees, max(sizes + [1]))
        n = sum(sizes)
        sids, r, pre = ids[:b], roots[:b], lens[:b]
        before = runner.kv_cache.data.clone()
        meta = runner.plan(sids, draft, r, torch.tensor(pre, dtype=torch.int32),
                           prefix_lens_host=pre, num_draft_host=sizes if step % 2 else None)
        assert (meta.maybe_host is None) == (step % 2 == 0)
        want = runner.forward(meta).clone()
        want_kv = runner.kv_cache.data.clone()
        runner.kv_cache.data.copy_(before)

        pmeta, got = vg.verify(sids, draft, r, pre, num_draft_host=sizes)
        S, Q = vg.bucket(b, b + n)
        # the sizes FlashInfer plans with, from the host, are those planned on the device
        for m in (pmeta, meta) if meta.maybe_host is not None else (pmeta,):
            for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
                assert getattr(m.maybe_host, name).tolist() == getattr(m, name).tolist(), name
            assert m.maybe_host.num_mask_bytes == int(m.mask_indptr[-1])
        # what a graphed step's FlashInfer plan is handed (a stub here): the padded step's
        planned = RecordingWrapper(S + 1)
        vg._plan_wrapper(planned, pmeta)
        (qo, kv, _, last, *_), kw = planned.planned
        pages = pmeta.maybe_prefix if split else pmeta  # split: the prefix part, unmasked
        assert qo.tolist() == pmeta.qo_indptr.tolist() and kv.tolist() == pages.kv_indptr.tolist()
        assert last.tolist() == pages.kv_last_page_len.tolist()
        if split:
            assert kw["causal"] is False and "packed_custom_mask" not in kw
            assert pmeta.maybe_prefix.prefix_lens.tolist() == pre + [0] * (S - b) + [1]
        else:
            assert planned._mask_indptr_buf.tolist() == pmeta.mask_indptr.tolist()
        assert pmeta.batch_size == S + 1 and pmeta.capacity_q == Q
        assert int(pmeta.qo_indptr[-1]) == Q  # every bucket row belongs to a request
        rows = b + n
        assert pmeta.qo_indptr[:b + 1].tolist() == meta.qo_indptr[:b + 1].tolist()
        torch.testing.assert_close(got[:rows], want[:rows], atol=1e-5, rtol=1e-5)
        null = runner.kv_cache.null_page  # padding and sink KV go there, nowhere else
        torch.testing.assert_close(runner.kv_cache.data[:, :null], want_kv[:, :null])
        # next step: the first child of each root was "accepted" (slots rewritten next step)
        roots = want[meta.qo_indptr[:-1].long()].argmax(-1).to(torch.int32)
        roots = torch.cat([roots, torch.zeros(3 - b, dtype=torch.int32)])
        lens = [x + 1 if i < b else x for i, x in enumerate(lens)]


def test_rejects_what_no_bucket_holds():
    runner = _runner()
    vg = VerifyGraphs(runner, [1, 2], max_nodes=3)
    with pytest.raises(ValueError, match="exceed the largest prepared batch"):
        vg.bucket(3, 3)
    with pytest.raises(ValueError, match="largest bucket"):
        vg.bucket(2, 2 + 9)  # 2 requests of 3 nodes: 8 rows at most
    d = _draft([[(5, -1), (6, 0), (7, 1), (8, 2)]], 4)
    with pytest.raises(ValueError, match="max_nodes"):
        vg.verify(["a"], d, torch.zeros(1, dtype=torch.int32), [0], num_draft_host=[4])
    with pytest.raises(ValueError, match="max_nodes must be"):
        VerifyGraphs(runner, [1], max_nodes=0)


def test_paged_batch_through_verify_graphs_equals_exact_steps():
    """SpecDecoder's paged batch (``DecoderConfig.cuda_graphs`` on a GPU): verify_rows /
    verify_padded through the padded buckets give the exact-size step's logits, and commit
    the same KV. The flat rows are exactly the step's (``B`` roots + the draft's nodes, at
    ``tree_qo_indptr``), and acceptance on them equals acceptance on the padded layout."""
    from agspec_gpu.accept import greedy_accept, pad_tree_logits, tree_qo_indptr
    from agspec_gpu.runners.paged_batch import PagedBatch

    rng = np.random.default_rng(7)
    runner = _runner()
    vg = VerifyGraphs(runner, [1, 2, 4], max_nodes=6)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (11, 4, 19)]
    got = []
    for graphs in (None, vg):
        batch = PagedBatch(runner, graphs)
        roots = batch.prefill(prompts).argmax(-1).to(torch.int32)
        rng_t = np.random.default_rng(3)
        steps = []
        for step in range(4):
            sizes = [int(rng_t.integers(0, 7)) for _ in range(3)]
            draft = _draft(random_trees(rng_t, sizes, "random", vocab=1000), max(sizes + [1]))
            if step % 2:
                logits = batch.verify_padded(draft, roots)
            else:
                flat, qo = batch.verify_rows(draft, roots, sizes if step else None)
                assert flat.shape[0] == 3 + sum(sizes)
                assert qo.tolist() == tree_qo_indptr(draft).tolist()
                res = greedy_accept(draft, flat, qo)
                logits = pad_tree_logits(flat, qo, draft.max_nodes)
            ref = greedy_accept(draft, logits)
            if step % 2 == 0:
                for f in ("num_accepted", "accepted_nodes", "output_ids", "num_output"):
                    assert torch.equal(getattr(res, f), getattr(ref, f)), f
            batch.commit(ref)
            roots = ref.bonus_ids().to(torch.int32)
            # padding nodes' rows are unspecified: compare each request's real rows
            steps.append([logits[b, :1 + n].clone() for b, n in enumerate(sizes)])
        got.append(steps)
        batch.close()
    for a, b in zip(*got):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    assert runner.kv_cache.num_free_pages == runner.kv_cache.num_pages


def test_decode_graphs_pad_the_rows_a_larger_step_wrote():
    """DecodeGraphs (the plain decode steps of the e2e benchmark) rewrite their inputs in
    place: a step of 2 requests after one of 3 in the same size re-pads the third row, so its
    padding request writes to the null page, not to the third sequence's first slot; each
    step's logits are the unpadded step's."""
    from agspec_gpu.runners.graphs import DecodeGraphs

    rng = np.random.default_rng(5)
    runner = _runner()
    cache = runner.kv_cache
    dg = DecodeGraphs(runner, [1, 4])
    ids = ["a", "b", "c"]
    prompts = [rng.integers(0, 1000, n).tolist() for n in (9, 6, 13)]
    roots = runner.prefill(ids, prompts).argmax(-1).to(torch.int32)
    lens = [len(p) for p in prompts]
    for b in (3, 2, 1, 2):  # sizes 4, 4 (one row left over from 3), 1, 4
        before = cache.data.clone()
        meta = runner.plan(ids[:b], DraftBatch.from_lists([[]] * b), roots[:b],
                           torch.tensor(lens[:b], dtype=torch.int32), prefix_lens_host=lens[:b])
        want = runner.forward(meta)[:b].clone()
        want_kv = cache.data.clone()
        cache.data.copy_(before)
        got = dg.decode(ids[:b], roots[:b], lens[:b])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        null = cache.null_page  # padding KV goes there, nowhere else
        torch.testing.assert_close(cache.data[:, :null], want_kv[:, :null])
        roots = torch.cat([got.argmax(-1).to(torch.int32), roots[b:]])
        lens = [x + 1 if i < b else x for i, x in enumerate(lens)]


def test_a_failed_capture_reports_its_first_cause():
    """A failure inside ``torch.cuda.graph`` makes its exit end the capture, which raises an
    error of its own: ``graph_error`` (what the device script prints) names both, the
    first cause included."""
    from agspec_gpu.cuda_graph import capture_error

    try:
        try:
            raise ValueError("operation not permitted when stream is capturing")
        except ValueError:
            raise RuntimeError("CUDA error: operation failed due to a previous error "
                               "during capture")
    except RuntimeError as exc:
        msg = capture_error(exc)
    assert msg.startswith("RuntimeError: CUDA error") and \
        msg.endswith("ValueError: operation not permitted when stream is capturing")
    assert capture_error(KeyError("x")) == "KeyError: 'x'"


def test_capture_plans_are_as_wide_as_real_steps_and_touch_only_the_null_page():
    """The capture inputs (run on a GPU only) plan on each size's own page table, null pages
    as wide as a real step's, so the planner's Triton variants compile at capture, not in a
    timed step; on the CPU the same plans run eagerly: every KV write lands on the null
    page, and the table is untouched for the first real step."""
    from agspec_gpu.runners.graphs import DecodeGraphs

    runner = _runner()
    cache = runner.kv_cache
    P = cache.max_pages_per_seq
    dg = DecodeGraphs(runner, [1, 4])
    vg = VerifyGraphs(runner, [1, 4], max_nodes=3)
    before = cache.data.clone()
    metas = [dg._plan_padding(4)]
    zeros = torch.zeros(4, dtype=torch.int32)
    empty = DraftBatch.from_lists([[]] * 4)
    for Q in vg.buckets[4]:
        metas.append(vg._plan_padded(4, Q, empty, zeros, zeros, vg._inputs[4].page_table,
                                     used_rows=4))
    for meta in metas:
        runner.forward(meta)
    null = cache.null_page
    assert torch.equal(cache.data[:, :null], before[:, :null])
    assert torch.equal(cache.data[:, null + 1:], before[:, null + 1:])
    for table in (dg._inputs[4][0], vg._inputs[4].page_table):
        assert table.shape == (4, P) and bool((table == null).all())


# ---------------------------------------------------------------- buffer capacities (the pool)
def _need(qo, kv, ps):
    """Pages and mask bytes plan_tree lays out for requests of these sizes."""
    return (sum(-(-k // ps) for k in kv), sum(-(-q * k // 8) for q, k in zip(qo, kv)))


def test_padded_step_capacity_holds_every_step_a_pool_allows():
    """Random padded steps (real requests whose pages are distinct pool pages, padding
    requests of one row and one KV entry, the sink over the bucket's rows left), biased to
    the extremes: each fits the capacities, which are never above the width bounds."""
    from agspec_gpu.tree import padded_step_capacity

    rng = np.random.default_rng(0)
    tight = [0, 0]
    for _ in range(3000):
        S, P, ps, pool = (int(rng.integers(1, n)) for n in (9, 13, 9, 41))
        sink = bool(rng.integers(2))
        N = int(rng.integers(0, 9)) if sink else 0  # decode steps: no draft, no sink
        R, b = N + 1, int(rng.integers(0, S + 1))
        big = rng.random() < 0.5
        qo, kv, free = [], [], pool
        for _ in range(b):
            q = R if big else int(rng.integers(1, R + 1))
            lo = -(-q // ps)
            if lo > min(P, free):
                break
            pages = min(P, free) if big else int(rng.integers(lo, min(P, free) + 1))
            free -= pages
            qo.append(q)
            kv.append(max(q, pages * ps - (0 if big else int(rng.integers(0, ps)))))
        b = len(qo)
        rows = sum(qo) + (S - b)
        Q = next(q for q in row_buckets(S, N) if q >= rows + 1) if sink else S
        qo += [1] * (S - b) + ([Q - rows] if sink else [])
        kv += [1] * (S - b) + ([1] if sink else [])
        pages, mask_bytes = _need(qo, kv, ps)
        cap_pages, cap_bytes = padded_step_capacity(S, R, Q, P, ps, pool, sink=sink)
        assert pages <= cap_pages and mask_bytes <= cap_bytes, (S, P, ps, pool, qo, kv)
        assert cap_pages <= S * P + sink and cap_bytes <= Q * P * ps // 8 + S + sink
        tight[0] += pages == cap_pages
        tight[1] += mask_bytes >= cap_bytes - S - 1
    assert min(tight) > 50  # the extremes were reached, not only the easy middle


def _pool_runner(num_pages):
    return PagedLlamaRunner.from_hf_model(tiny_model("llama"), num_pages=num_pages, page_size=4,
                                          max_seqs=8)


def test_bucket_buffers_are_sized_by_the_pool():
    """The page table is as wide as the pool (SpecDecoder's paged runner): every bucket's
    page and mask buffers take the pool bound, well under the width bounds of old."""
    from agspec_gpu.runners.graphs import DecodeGraphs
    from agspec_gpu.tree import padded_step_capacity

    runner = _pool_runner(96)
    cache = runner.kv_cache
    P, ps, R = cache.max_pages_per_seq, cache.page_size, 7
    assert P == cache.num_pages == 96
    vg = VerifyGraphs(runner, [1, 4], max_nodes=R - 1)
    dg = DecodeGraphs(runner, [1, 4])
    old_total, new_total = 0, 0
    for (S, Q), meta in vg._meta.items():
        old_pages, old_bytes = S * P + 1, Q * P * ps // 8 + S + 2
        assert (meta.kv_indices.numel(), meta.packed_mask.numel()) == padded_step_capacity(
            S, R, Q, P, ps, cache.num_pages, sink=True)
        assert meta.kv_indices.numel() <= min(old_pages, cache.num_pages + S + 1)
        pool_bytes = R * ps * cache.num_pages // 8 + S + (Q - S + 7) // 8
        assert meta.packed_mask.numel() <= min(old_bytes, pool_bytes)
        old_total += 4 * old_pages + old_bytes
        new_total += 4 * meta.kv_indices.numel() + meta.packed_mask.numel()
    top = vg._meta[4, vg.buckets[4][-1]]
    # the buckets' page lists and masks are views of the largest's: one pair in memory
    for meta in vg._meta.values():
        for name in ("kv_indices", "packed_mask"):
            x, y = getattr(meta, name), getattr(top, name)
            assert x.data_ptr() == y.data_ptr() and x.numel() <= y.numel(), name
            assert x.untyped_storage().nbytes() == y.numel() * y.element_size(), name
    assert new_total > 3 * (4 * top.kv_indices.numel() + top.packed_mask.numel())
    assert top.kv_indices.numel() == 96 + 4 + 1 < 4 * 96 + 1
    assert top.packed_mask.numel() == 7 * 4 * 96 // 8 + 4 + 4 < 29 * 96 * 4 // 8
    assert new_total < old_total / 2
    for S, meta in dg._meta.items():
        assert meta.kv_indices.numel() == min(S * P, cache.num_pages + S)
        assert meta.packed_mask.numel() == min(S * P * ps // 8, ps * cache.num_pages // 8) + S
    assert dg._meta[4].packed_mask.numel() < 4 * -(-P * ps // 8)


@pytest.mark.parametrize("lens", [[113], [33, 33, 33], [25, 25, 21, 21]])
def test_steps_that_fill_the_pool_fit_and_equal_the_unpadded_step(lens):
    """Worst cases for the pool bound: requests whose pages (after the step's allocation)
    are the whole pool, their last pages full, each with a full ``max_nodes`` draft, in the
    largest row bucket of their size (one padding request for 3 of 4). The padded step fits
    the pool-sized buffers and gives the unpadded step's logits and KV; the Triton planner
    (interpreted here, a GPU's in a graph) fills the same buffers with the same bytes."""
    from agspec_gpu.tree import plan_tree

    runner = _pool_runner(30)
    cache = runner.kv_cache
    N = 6
    vg = VerifyGraphs(runner, [1, 4], max_nodes=N)
    rng = np.random.default_rng(len(lens))
    b = len(lens)
    ids = [f"s{i}" for i in range(b)]
    prompts = [rng.integers(0, 1000, n).tolist() for n in lens]
    roots = runner.prefill(ids, prompts).argmax(-1).to(torch.int32)
    sizes = [N] * b
    draft = _draft(random_trees(rng, sizes, "random", vocab=1000), N)
    before = cache.data.clone()
    meta = runner.plan(ids, draft, roots, torch.tensor(lens, dtype=torch.int32),
                       prefix_lens_host=lens, num_draft_host=sizes)
    assert cache.num_free_pages == 0  # the step's pages are the whole pool
    want = runner.forward(meta).clone()
    want_kv = cache.data.clone()
    cache.data.copy_(before)

    pmeta, got = vg.verify(ids, draft, roots, lens, num_draft_host=sizes)
    S, Q = vg.bucket(b, b + b * N)
    assert Q == vg.buckets[S][-1] and pmeta.batch_size == S + 1
    out = vg._meta[S, Q]
    pages, mask_bytes = int(pmeta.kv_indptr[-1]), int(pmeta.mask_indptr[-1])
    assert pages == cache.num_pages + (S - b) + 1 <= out.kv_indices.numel()
    assert mask_bytes <= out.packed_mask.numel() < Q * cache.max_pages_per_seq * 4 // 8
    kv = [n + 1 + N for n in lens] + [1] * (S - b + 1)
    assert (pages, mask_bytes) == _need([1 + N] * b + [1] * (S - b) + [Q - S - b * N], kv, 4)
    rows = b + b * N
    assert pmeta.qo_indptr[:b + 1].tolist() == meta.qo_indptr[:b + 1].tolist()
    torch.testing.assert_close(got[:rows], want[:rows], atol=1e-5, rtol=1e-5)
    null = cache.null_page
    torch.testing.assert_close(cache.data[:, :null], want_kv[:, :null])

    # the same buffers planned by the Triton kernels (a GPU's planner): the same bytes.
    # The runner is on the CPU: its tensors reach Triton only in the interpreter (on a GPU
    # machine test_gpu.py's graphed steps plan with the kernels)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    torch_bufs = [x.clone() for x in (out.kv_indices, out.packed_mask, out.mask_indptr,
                                      out.kv_indptr, out.qo_indptr, out.kv_slots)]
    for x in (out.kv_indices, out.packed_mask, out.kv_slots):
        x.fill_(7)  # what an earlier, larger step left: the kernels rewrite the tails
    inp = vg._inputs[S]
    plan_tree(inp.draft, inp.root, inp.prefix, inp.page_table, 4, out=out,
              sink_page=cache.null_page, use_triton=True)
    for x, y in zip(torch_bufs, (out.kv_indices, out.packed_mask, out.mask_indptr,
                                 out.kv_indptr, out.qo_indptr, out.kv_slots)):
        assert torch.equal(x, y)


def test_a_step_over_the_capacity_is_an_error_not_a_silent_overflow():
    """The planner's kernels drop what exceeds their buffers (a check of the sizes they
    compute would wait for the device); the step's sizes on the host, which VerifyGraphs
    and DecodeGraphs compute for FlashInfer anyway, are checked against the buffers before
    anything is launched."""
    from agspec_gpu.tree import TreeMetadata, host_sizes, plan_tree

    draft = _draft([[(5, -1), (6, 0)], [(7, -1)]], 2)
    roots = torch.tensor([1, 2], dtype=torch.int32)
    prefix = torch.tensor([9, 3], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2, 8], [3, 4, 8, 8]], dtype=torch.int32)

    def plan(**caps):
        # rows 3 + 2 + sink 2 = 7; pages 3 + 2 + 1 = 6; mask bytes 5 + 2 + 1 = 8 (kv 12, 5)
        out = TreeMetadata.empty(3, 3, 4, 4, "cpu", **caps)
        host = host_sizes([2, 1], [9, 3], 4, sink_rows=2, out=out)
        return plan_tree(draft, roots, prefix, table, 4, out=out, sink_page=8, host=host)

    meta = plan(max_total_q=7, max_total_pages=6, max_mask_bytes=8)  # exactly enough
    assert (int(meta.kv_indptr[-1]), int(meta.mask_indptr[-1])) == (6, 8)
    for caps, have in (((7, 5, 8), "7, 5 and 8"), ((7, 6, 7), "7, 6 and 7"),
                       ((6, 6, 8), "6, 6 and 8")):
        with pytest.raises(ValueError, match=f"7 rows, 6 pages and 8 mask bytes exceeds "
                                             f"the buffers' {have}"):
            plan(**dict(zip(("max_total_q", "max_total_pages", "max_mask_bytes"), caps)))
    # through VerifyGraphs: a bucket whose buffers were sized too small
    runner = _pool_runner(30)
    vg = VerifyGraphs(runner, [1], max_nodes=2)
    S, Q = vg.bucket(1, 3)
    vg._meta[S, Q] = TreeMetadata.empty(2, 3, 30, 4, "cpu", max_total_q=Q, max_total_pages=3)
    with pytest.raises(ValueError, match="pages .* exceeds the buffers'"):
        vg.verify(["a"], _draft([[(5, -1), (6, 0)]], 2), torch.tensor([1], dtype=torch.int32),
                  [9], num_draft_host=[2])


def test_a_decode_graphs_plan_hands_flashinfer_the_steps_host_sizes():
    """A plain-decode bucket's FlashInfer plan (a stub here: the GPU tests run the real
    one) gets the padded step's pages from the host sizes, equal to the device plan's."""
    from agspec_gpu.runners.graphs import DecodeGraphs

    runner = _pool_runner(40)
    graphs = DecodeGraphs(runner, [1, 2, 4])
    ids = ["a", "b", "c"]
    prompts = [list(range(1, n + 1)) for n in (9, 23, 5)]
    roots = runner.prefill(ids, prompts).argmax(-1).to(torch.int32)
    S, meta = graphs.plan(ids, roots, [len(p) for p in prompts])
    assert S == 4 and meta.maybe_host is not None
    planned = RecordingWrapper(S)
    graphs._plan_wrapper(planned, meta)
    (kv, indices, last, *dims), kw = planned.planned
    assert kv.tolist() == meta.kv_indptr[:S + 1].tolist()
    assert last.tolist() == meta.kv_last_page_len[:S].tolist()
    assert indices.tolist() == meta.kv_indices[:int(meta.kv_indptr[S])].tolist()
    assert dims[:3] == [runner.shape.num_qo_heads, runner.shape.num_kv_heads,
                        runner.shape.head_dim] and kw["pos_encoding_mode"] == "NONE"


def test_the_buckets_edges_are_the_calibrations_points():
    """A step of ``b <= S`` requests and ``n`` draft tokens needs ``S + n + 1`` bucket rows,
    so ``n = 8 * 2**j`` fills bucket ``j`` exactly whatever ``b``, and one token more opens
    the next: the cost model a calibration through the graphs measures at ``b + 8 * 2**j``
    is a staircase with these edges (``CostModel.steps``)."""
    vg = VerifyGraphs(_runner(), [1, 4, 16], max_nodes=64, use_graphs=False)
    for S in (1, 4, 16):
        for b in {S // 2 + 1, S}:  # the steps S takes: smallest S >= b
            for n in (8 << j for j in range(8) if (8 << j) < S * 64):
                assert vg.bucket(b, b + n) == (S, S + 1 + n), (b, n)
                assert vg.bucket(b, b + n + 1)[1] > S + 1 + n


def test_a_calibration_through_the_graphs_is_a_staircase():
    from agspec_gpu.calibrate import calibrate_cost_model

    runner = _runner()
    vg = VerifyGraphs(runner, [2], max_nodes=8, use_graphs=False)
    cost = calibrate_cost_model(runner, 2, 9, max_draft_tokens=16, repeats=1, warmup=0,
                                verify_graphs=vg)
    assert cost.steps and cost.requests == 2 and cost.table_base() == 2
    assert [x for x, _ in cost.points] == [2, 3, 4, 6, 10, 18]
    assert not calibrate_cost_model(runner, 2, 9, max_draft_tokens=4, repeats=1,
                                    warmup=0).steps
    # 3 requests of at most 8 nodes: the top bucket's edge is 24 draft tokens, not a power
    # of two; measured, so its first tokens are not priced at the bucket below (16)
    vg = VerifyGraphs(runner, [3], max_nodes=8, use_graphs=False)
    assert vg.buckets[3][-1] - 3 - 1 == 24
    cost = calibrate_cost_model(runner, 3, 9, max_draft_tokens=32, repeats=1, warmup=0,
                                verify_graphs=vg)
    assert [x - 3 for x, _ in cost.points] == [0, 1, 2, 4, 8, 16, 24, 32]
    assert cost.step_ms(3 + 17, num_requests=3) == dict(cost.points)[3 + 24]


@pytest.mark.parametrize("split", [True, False])
def test_a_step_plans_into_the_views_its_bucket_was_captured_with(split):
    """A captured graph reads the buffers its capture plan handed the attention (the split's
    tree kernel takes the ancestor bitsets' row stride as an argument): every later plan of
    the bucket must return views of the same storage, shapes and strides. The capture plans
    over the bucket's own draft buffers (a real step's width) for that."""
    runner = _runner(split)
    vg = VerifyGraphs(runner, [4], max_nodes=6)
    S, Q = vg.bucket(2, 2 + 8)  # the step's: 2 requests, 8 draft tokens
    inp = vg._inputs[S]
    zeros = torch.zeros(S, dtype=torch.int32)
    captured = vg._plan_padded(S, Q, inp.draft, zeros, zeros, inp.page_table, used_rows=S)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (9, 14)]
    roots = runner.prefill(["a", "b"], prompts).argmax(-1).to(torch.int32)
    draft = _draft(random_trees(rng, [3, 5], "random", vocab=1000), 5)
    key, meta = vg.plan(["a", "b"], draft, roots, [9, 14], [3, 5])
    assert key == (S, Q)
    names = ["kv_slots", "qo_indptr", "ancestor_bits", "kv_indptr", "kv_indices",
             "kv_last_page_len", "input_ids", "position_ids"]
    pairs = [(getattr(captured, n), getattr(meta, n)) for n in names]
    if split:
        pairs += list(zip(captured.maybe_prefix, meta.maybe_prefix))
    else:
        assert meta.maybe_prefix is None
    for a, b in pairs:
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
