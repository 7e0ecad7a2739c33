"""Acceptance rules: greedy golden cases, a property test against a per-request walk, and
for sampling: determinism under a seed, agreement with greedy at temperature 0 / top-k 1,
and a statistical check that the emitted tokens follow the target distribution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agspec_gpu.accept import (AcceptBuffers, AcceptResult, BatchSampling, SamplingParams,
                               flatten_tree_logits, greedy_accept, pad_tree_logits,
                               rows_without_finite_max, sample_accept, sample_tokens,
                               target_probs, tree_qo_indptr)
from agspec_gpu.draft_batch import PAD_ID, DraftBatch

V = 16


def one_hot_logits(targets: list[list[int]], vocab: int = V) -> torch.Tensor:
    """Flat logits whose argmax per row is ``targets[b][row]`` (rows: root, node 0, ...)."""
    flat = [t for per_req in targets for t in per_req]
    return torch.nn.functional.one_hot(torch.tensor(flat), vocab).float()


def check(res: AcceptResult, nodes: list[list[int]], outputs: list[list[int]]) -> None:
    B, D = res.accepted_nodes.shape
    for b in range(B):
        n = res.num_accepted[b].item()
        assert res.num_output[b].item() == n + 1
        assert res.accepted_nodes[b, :n].tolist() == nodes[b], (b, res)
        assert res.output_ids[b, :n + 1].tolist() == outputs[b], (b, res)
        assert (res.accepted_nodes[b, n:] == -1).all() and (res.output_ids[b, n + 1:] == -1).all()


def ref_walk(tree: list[tuple[int, int]], targets: list[int]) -> tuple[list[int], list[int]]:
    """Per-request reference: lowest-index child matching the argmax at its parent."""
    cur, nodes = -1, []
    while True:
        kids = [j for j, (tok, p) in enumerate(tree) if p == cur and tok == targets[cur + 1]]
        if not kids:
            return nodes, [tree[j][0] for j in nodes] + [targets[cur + 1]]
        cur = kids[0]
        nodes.append(cur)


# ----------------------------------------------------------------------------- greedy golden

CHAIN = [(5, -1), (7, 0), (9, 1)]
# root children 0 (tok 5), 1 (tok 6), 2 (tok 7); node 3 (tok 8) under node 2; node 4
# (tok 8) under node 0: the right token under the wrong parent
BRANCHY = [(5, -1), (6, -1), (7, -1), (8, 2), (8, 0)]


def test_full_chain_accepted():
    d = DraftBatch.from_lists([CHAIN])
    res = greedy_accept(d, one_hot_logits([[5, 7, 9, 4]]), tree_qo_indptr(d))
    check(res, [[0, 1, 2]], [[5, 7, 9, 4]])
    assert res.bonus_ids().tolist() == [4]


def test_rejected_at_first_token():
    d = DraftBatch.from_lists([CHAIN])
    check(greedy_accept(d, one_hot_logits([[3, 7, 9, 4]]), tree_qo_indptr(d)), [[]], [[3]])


def test_non_first_branch_wins():
    d = DraftBatch.from_lists([BRANCHY])
    # argmax: root 7, node0 8, node1 0, node2 8, node3 1, node4 2
    res = greedy_accept(d, one_hot_logits([[7, 8, 0, 8, 1, 2]]), tree_qo_indptr(d))
    check(res, [[2, 3]], [[7, 8, 1]])


def test_empty_drafts():
    d = DraftBatch.from_lists([[], []])
    res = greedy_accept(d, one_hot_logits([[3], [11]]), tree_qo_indptr(d))
    check(res, [[], []], [[3], [11]])


@pytest.mark.parametrize("fault", ["nan", "inf", "-inf row"])
def test_rows_without_finite_max_names_the_faulty_requests(fault):
    """A NaN or +inf anywhere in a root's or node's row, or a row of -inf only, flags its
    request, in both layouts; padding rows (past ``1 + n_b``) never do; -inf entries in a
    row with a finite maximum (a masked vocabulary) are fine."""
    d = DraftBatch.from_lists([CHAIN, [], BRANCHY, [(2, -1)]])
    flat = one_hot_logits([[5, 7, 0, 1], [4], [7, 8, 0, 8, 1, 2], [2, 13]])
    indptr = tree_qo_indptr(d)
    flat[:, 0] = float("-inf")
    assert rows_without_finite_max(d, flat, indptr).tolist() == [False] * 4
    padded = pad_tree_logits(flat, indptr, d.max_nodes)
    padded[1, 1:] = float("nan")  # request 1 has no nodes: rows 1.. are padding
    assert rows_without_finite_max(d, padded).tolist() == [False] * 4
    for row, req in ((0, 0), (4, 1), (10, 2), (12, 3)):  # the first / last rows of each
        bad = flat.clone()
        if fault == "-inf row":
            bad[row] = float("-inf")
        else:
            bad[row, 9] = float(fault)
        want = [b == req for b in range(4)]
        assert rows_without_finite_max(d, bad, indptr).tolist() == want
        assert rows_without_finite_max(d, pad_tree_logits(bad, indptr, d.max_nodes)).tolist() \
            == want
    empty = DraftBatch.from_lists([])
    assert rows_without_finite_max(empty, torch.zeros(0, V), tree_qo_indptr(empty)).numel() == 0
    # with the accepted path: only the rows that chose the tokens (the root's, the accepted
    # nodes'); a rejected node's row was never read
    res = greedy_accept(d, flat, indptr)
    path = [r[:n] for r, n in zip(res.accepted_nodes.tolist(), res.num_accepted.tolist())]
    assert path == [[0, 1], [], [2, 3], [0]]  # (column 0 is -inf: node 2 of the chain fails)
    for row, req, read in ((0, 0, True), (2, 0, True), (3, 0, False), (4, 1, True),
                           (5, 2, True), (8, 2, True), (9, 2, True), (6, 2, False),
                           (10, 2, False), (11, 3, True), (12, 3, True)):
        bad = flat.clone()
        if fault == "-inf row":
            bad[row] = float("-inf")
        else:
            bad[row, 9] = float(fault)
        want = [b == req and read for b in range(4)]
        for layout, ptr in ((bad, indptr), (pad_tree_logits(bad, indptr, d.max_nodes), None)):
            assert rows_without_finite_max(d, layout, ptr, res.accepted_nodes).tolist() == \
                want, (row, req)


def test_ragged_batch_flat_and_padded_agree():
    trees = [CHAIN, [], BRANCHY, [(2, -1)]]
    targets = [[5, 7, 0, 1], [4], [7, 8, 0, 8, 1, 2], [2, 13]]
    d = DraftBatch.from_lists(trees)
    flat, indptr = one_hot_logits(targets), tree_qo_indptr(d)
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 4, 5, 11, 13]
    expected_nodes = [[0, 1], [], [2, 3], [0]]
    expected_out = [[5, 7, 0], [4], [7, 8, 1], [2, 13]]
    check(greedy_accept(d, flat, indptr), expected_nodes, expected_out)
    padded = pad_tree_logits(flat, indptr, d.max_nodes)
    assert padded.shape == (4, 1 + d.max_nodes, V)
    check(greedy_accept(d, padded), expected_nodes, expected_out)
    assert torch.equal(flatten_tree_logits(padded, d.num_draft_tokens), flat)


def test_duplicate_sibling_tokens_lower_index_wins():
    d = DraftBatch.from_lists([[(5, -1), (5, -1), (6, 1)]])
    # both root children carry 5; only node 1 has the matching grandchild, but node 0 wins
    check(greedy_accept(d, one_hot_logits([[5, 9, 6, 3]]), tree_qo_indptr(d)), [[0]], [[5, 9]])


def test_argmax_tie_goes_to_lower_token_id():
    d = DraftBatch.from_lists([[(4, -1)]])
    logits = torch.zeros(2, V)
    logits[0, [4, 2]] = 1.0  # tie between 2 and 4 at the root: 2 wins, the draft is rejected
    check(greedy_accept(d, logits, tree_qo_indptr(d)), [[]], [[2]])


def test_max_depth_truncates_losslessly():
    d = DraftBatch.from_lists([CHAIN])
    res = greedy_accept(d, one_hot_logits([[5, 7, 9, 4]]), tree_qo_indptr(d), max_depth=2)
    assert res.max_depth == 2
    check(res, [[0, 1]], [[5, 7, 9]])  # bonus = argmax at node 1 = the token node 2 holds


def test_layout_errors_name_the_argument():
    d = DraftBatch.from_lists([CHAIN])
    flat = one_hot_logits([[5, 7, 9, 4]])
    with pytest.raises(ValueError, match="qo_indptr"):
        greedy_accept(d, flat, None)
    with pytest.raises(ValueError, match="qo_indptr"):
        greedy_accept(d, flat[None].expand(1, 4, V), tree_qo_indptr(d))
    with pytest.raises(ValueError, match="logits"):
        greedy_accept(d, flat[None, :3])
    with pytest.raises(ValueError, match="max_depth"):
        greedy_accept(d, flat, tree_qo_indptr(d), max_depth=-1)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    trees, targets = [], []
    for _ in range(B):
        n = draw(st.integers(0, 7))
        # tiny vocabulary so that matches and duplicate siblings are common
        trees.append([(draw(st.integers(0, 2)), draw(st.integers(-1, j - 1))) for j in range(n)])
        targets.append([draw(st.integers(0, 2)) for _ in range(n + 1)])
    return trees, targets


_BUFFERS = AcceptBuffers(4, 7, "cpu")  # what batches() draws fits


@settings(max_examples=40, deadline=None)
@given(batches())
def test_greedy_matches_reference_walk(case):
    trees, targets = case
    d = DraftBatch.from_lists(trees)
    flat, indptr = one_hot_logits(targets, vocab=3), tree_qo_indptr(d)
    walks = [ref_walk(t, tg) for t, tg in zip(trees, targets)]
    nodes, outs = [w[0] for w in walks], [w[1] for w in walks]
    check(greedy_accept(d, flat, indptr), nodes, outs)
    check(greedy_accept(d, pad_tree_logits(flat, indptr, d.max_nodes)), nodes, outs)
    # into a serving loop's buffers (reused: a step after another shape's), and past
    # buffers too small for the step (new tensors)
    for buf in (_BUFFERS, AcceptBuffers(1, 0, "cpu")):
        for args in ((flat, indptr), (pad_tree_logits(flat, indptr, d.max_nodes),)):
            res = greedy_accept(d, *args, out=buf)
            check(res, nodes, outs)
            inside = res.output_ids.untyped_storage().data_ptr() == \
                buf._walk.untyped_storage().data_ptr()
            assert inside == buf.fits(len(trees), d.max_nodes)
    # a one-hot target makes sampling deterministic: it must agree with greedy
    g = torch.Generator().manual_seed(0)
    check(sample_accept(d, flat, indptr, SamplingParams(top_k=1), g), nodes, outs)


# ----------------------------------------------------------------------------- sampling


def test_sampling_params_validation():
    SamplingParams(0.0, 5, 0.5)
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_k=-1),
                dict(top_k=1 << 63), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=1e-40),
                dict(temperature=1e-50), dict(temperature=1e39),  # float32: 0 or subnormal, inf
                dict(seed=-1), dict(seed=1 << 63), dict(seed=True), dict(seed=1.5),
                dict(seed="7")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(seed=(1 << 63) - 1).seed == (1 << 63) - 1
    assert SamplingParams(top_k=(1 << 63) - 1).top_k == (1 << 63) - 1  # off: k >= vocabulary


def test_extreme_temperatures_keep_the_target():
    """The smallest and largest float32 temperatures: a tiny one is the argmax (the max's
    scaled logit stays finite, the others go to -inf), a huge one is uniform over the
    tokens with a finite logit; never a token of probability 0 (a NaN row would give the
    last one)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, float("-inf")]] * 2) * 40
    tiny, huge = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    p = target_probs(logits, SamplingParams(tiny))
    assert torch.equal(p, torch.nn.functional.one_hot(torch.tensor([2, 2]), 6).float())
    p = target_probs(logits, SamplingParams(huge))
    torch.testing.assert_close(p, torch.tensor([[0.2] * 5 + [0.0]] * 2))


def test_top_k_keeps_no_near_tie_that_scaling_rounds_into_one():
    """top-k compares the logits themselves: 2e-8 and 1e-8 are distinct logits (the 2nd
    and 3rd) although ``logit - max`` rounds both to -1.0 in float32; top_k = 2 keeps two
    tokens, as Hugging Face's warper does, at any temperature."""
    logits = torch.tensor([[1.0, 2e-8, 1e-8, -5.0]])
    for t in (1.0, 0.3, 7.0):
        p = target_probs(logits, SamplingParams(t, top_k=2))
        assert p[0, 2] == 0 and p[0, 3] == 0 and p[0, :2].sum() > 0.999, (t, p)


def test_unseeded_draws_are_float64_uniforms_of_the_generator():
    """An unseeded level (and a plain step's token) draws ``torch.rand(B, dtype=float64)`` from the generator: 53 bits,
    not float32's 24, which round every token's probability to a multiple of 2**-24. The
    walk's tokens are the inverse CDF at those uniforms (an empty draft: one level)."""
    B, V = 4096, 300
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(3)) * 4
    d = DraftBatch.from_lists([[]] * B)
    params = SamplingParams(0.8, top_p=0.97)
    res = sample_accept(d, logits, tree_qo_indptr(d), params,
                        torch.Generator().manual_seed(11))
    u = torch.rand(B, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    cdf = target_probs(logits, params).double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    assert torch.equal(res.output_ids[:, 0].long(), want.clamp(max=V - 1))
    # a plain step's first token draws the same way (greedy rows: the argmax)
    rows = BatchSampling.of([params, SamplingParams(0.0)] * (B // 2), "cpu")
    got = sample_tokens(logits, rows, torch.Generator().manual_seed(11))
    assert torch.equal(got[::2], want[::2]) and torch.equal(got[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(0.7, 0, 1.0), SamplingParams(1.0, 5, 1.0),
                                    SamplingParams(1.0, 0, 0.8), SamplingParams(1.3, 7, 0.6)])
def test_target_probs_matches_hf_warpers(params):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)) * 3
    x = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        x = TopKLogitsWarper(params.top_k)(None, x)
    if params.top_p < 1.0:
        x = TopPLogitsWarper(params.top_p)(None, x)
    torch.testing.assert_close(target_probs(logits, params), x.softmax(-1))


MIXED = [SamplingParams(0.0), SamplingParams(0.7), SamplingParams(1.0, 5),
         SamplingParams(1.0, 0, 0.8), SamplingParams(1.3, 7, 0.6), SamplingParams(0.0, 3, 0.5),
         SamplingParams(0.9, 60, 1.0)]


def test_batch_sampling_rows_equal_their_own_params():
    """Row b of a mixed batch (greedy, temperature, top-k, top-p, both; k >= V) is exactly
    what that row's params give alone, for [B, V] and [B, Q, V] logits."""
    g = torch.Generator().manual_seed(3)
    for shape in ((len(MIXED), 50), (len(MIXED), 4, 50)):
        logits = torch.randn(*shape, generator=g) * 3
        logits[0, ..., 7] = logits[0, ..., 9] = logits[0].max() + 1  # an argmax tie
        batch = target_probs(logits, BatchSampling.of(MIXED, "cpu"))
        for b, params in enumerate(MIXED):
            assert torch.equal(batch[b], target_probs(logits[b], params)), (shape, params)
    assert int(batch[0, 0].argmax()) == 7 and float(batch[0, 0].max()) == 1.0
    s = BatchSampling.of(MIXED, "cpu")
    assert (s.max_top_k, s.any_top_p, s.all_greedy, s.any_greedy) == (60, True, False, True)
    with pytest.raises(ValueError, match="sampling"):
        BatchSampling.of([SamplingParams(), 0.5], "cpu")
    with pytest.raises(ValueError, match="sampling"):
        BatchSampling.of([], "cpu")


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    trees = [[(1, -1), (2, -1), (3, 0)], [], [(0, -1), (1, 0), (2, 1), (3, 1)]] * 3
    d = DraftBatch.from_lists(trees)
    logits = torch.randn(int(tree_qo_indptr(d)[-1]), 4, generator=g)
    return d, logits


def test_sampling_deterministic_under_seed():
    d, logits = _random_case(0)
    params = SamplingParams(1.0, 0, 0.95)
    runs = [sample_accept(d, logits, tree_qo_indptr(d), params, torch.Generator().manual_seed(s))
            for s in (7, 7, 8)]
    for field in ("num_accepted", "accepted_nodes", "output_ids", "num_output"):
        assert torch.equal(getattr(runs[0], field), getattr(runs[1], field))
    assert not torch.equal(runs[0].output_ids, runs[2].output_ids)


def test_temperature_zero_is_greedy():
    d, logits = _random_case(1)
    indptr = tree_qo_indptr(d)
    res = sample_accept(d, logits, indptr, SamplingParams(temperature=0.0),
                        torch.Generator().manual_seed(0))
    ref = greedy_accept(d, logits, indptr)
    assert torch.equal(res.output_ids, ref.output_ids)
    assert torch.equal(res.accepted_nodes, ref.accepted_nodes)


def test_mixed_batch_samples_each_row_from_its_own_target():
    """A batch whose requests sample with different params (and one greedy request): each
    row's first emitted token follows its own target, the greedy rows are greedy_accept's."""
    params = [SamplingParams(0.6, 0, 1.0), SamplingParams(1.4, 4, 0.9), SamplingParams(0.0)]
    B = 3 * 20000
    one = DraftBatch.from_lists([STAT_TREE])
    d = DraftBatch(one.token_ids.expand(B, -1), one.parents.expand(B, -1),
                   one.num_draft_tokens.expand(B))
    rows = _markov_rows(d, torch.full((B,), ROOT))
    res = sample_accept(d, rows, None, BatchSampling.of(params * (B // 3), "cpu"),
                        torch.Generator().manual_seed(99))
    first = res.output_ids[:, 0].long()
    for i, p in enumerate(params):
        mine = first[i::3]
        tv = 0.5 * (torch.bincount(mine, minlength=6) / mine.numel()
                    - target_probs(MARKOV[ROOT], p)).abs().sum()
        assert tv < 0.02, (p, tv)
    ref = greedy_accept(d, rows)
    assert torch.equal(res.output_ids[2::3], ref.output_ids[2::3])
    with pytest.raises(ValueError, match="sampling"):
        sample_accept(d, rows, None, BatchSampling.of(params, "cpu"))


# A toy target: a Markov chain over V=6 tokens, next-token logits depend on the last token.
MARKOV = torch.tensor([
    [0.5, 1.2, 0.9, 0.3, -0.4, 0.0],
    [0.2, -0.5, 1.0, 0.4, 1.1, -1.0],
    [1.0, 0.1, -0.3, 0.8, 0.0, 0.6],
    [-0.2, 0.7, 0.5, -1.0, 0.9, 0.3],
    [0.4, 0.4, 0.0, 1.3, -0.6, 0.8],
    [0.9, -0.8, 0.6, 0.2, 0.5, 0.1],
])
ROOT = 0
# three root children (tokens 1, 2, 3), a child (token 4) under token 1 and one (token 0)
# under token 3's node: the walk can accept 0, 1 or 2 tokens
STAT_TREE = [(1, -1), (2, -1), (3, -1), (4, 0), (0, 2)]


def _markov_rows(draft: DraftBatch, roots: torch.Tensor) -> torch.Tensor:
    """Padded logits ``[B, 1+N, 6]``: row 0 from the root token, row 1+j from node j's token."""
    ctx = torch.cat([roots[:, None], draft.token_ids.clamp(min=0)], 1).long()
    return MARKOV[ctx]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, 4, 0.9)])
def test_sampled_distribution_matches_target(params):
    B = 40000
    one = DraftBatch.from_lists([STAT_TREE])
    d = DraftBatch(one.token_ids.expand(B, -1), one.parents.expand(B, -1),
                   one.num_draft_tokens.expand(B))
    g = torch.Generator().manual_seed(1234)
    res = sample_accept(d, _markov_rows(d, torch.full((B,), ROOT)), None, params, g)
    # second emitted token: from this step when it went past the bonus, else one more step
    # with an empty draft rooted at the bonus, exactly as a decoder would do
    empty = DraftBatch(torch.empty(B, 0, dtype=torch.int32), torch.empty(B, 0, dtype=torch.int32),
                       torch.zeros(B, dtype=torch.int32))
    nxt = sample_accept(empty, _markov_rows(empty, res.bonus_ids()), None, params, g)
    first = res.output_ids[:, 0].long()
    second = torch.where(res.num_output >= 2, res.output_ids[:, 1], nxt.output_ids[:, 0]).long()

    p = target_probs(MARKOV, params)          # p[a, b] = P(next = b | last = a)
    tv1 = 0.5 * (torch.bincount(first, minlength=6) / B - p[ROOT]).abs().sum()
    joint = torch.bincount(first * 6 + second, minlength=36).reshape(6, 6) / B
    tv2 = 0.5 * (joint - p[ROOT][:, None] * p).abs().sum()
    assert tv1 < 0.015 and tv2 < 0.02, (tv1, tv2)
    # every acceptance depth occurs, so all branches of the walk were exercised
    assert set(res.num_accepted.unique().tolist()) == {0, 1, 2}


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _ks(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov statistic ``sqrt(n) * D`` of ``u`` against U(0, 1)."""
    u = u.sort().values
    n = u.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - u).max().item(), (u - (i - 1) / n).max().item()) * n ** 0.5


def test_seeded_uniforms_are_a_fixed_hash_and_uniform():
    """The seeded stream is lowbias32 of the seed's low half, twice over the position,
    then over the mixed high half (the same integers on any device: checked against plain
    Python ints, whose products never overflow), and uniform over positions and over seeds
    (KS below its 1% critical value)."""
    from agspec_gpu.seeding import seeded_uniforms
    cases = [(0, 0), (1, 0), (0, 1), (7, 12345), ((1 << 63) - 1, (1 << 31) + 5),
             (0x5EADBEEF12345678, 99)]
    seeds, pos = (torch.tensor(c, dtype=torch.int64) for c in zip(*cases))
    want = [(_lowbias32(_lowbias32(_lowbias32(_lowbias32(s & 0xFFFFFFFF) ^ p))
                        ^ _lowbias32(s >> 32)) + 0.5) / 2 ** 32 for s, p in cases]
    assert seeded_uniforms(seeds, pos).tolist() == want
    for u in (seeded_uniforms(torch.tensor(3), torch.arange(50000)),
              seeded_uniforms(torch.arange(50000), torch.tensor(11)),
              seeded_uniforms(torch.arange(50000) << 32, torch.tensor(0))):
        assert 0 < u.min() and u.max() < 1 and _ks(u) < 1.63


def test_seeded_streams_of_distinct_seeds_differ():
    """The stream's state is the whole 64-bit seed: two seeds whose halves folded into
    one 32-bit state collided (the same uniform at every position) draw different
    streams now, as do seeds that differ only in their high half."""
    from agspec_gpu.seeding import seeded_uniforms
    pos = torch.arange(64)
    for a, b in ((30064783417, 7865844771372150842), (5, 5 | (1 << 32)), (0, 1 << 62)):
        ua, ub = (seeded_uniforms(torch.tensor(s), pos) for s in (a, b))
        assert (ua != ub).sum() > 60, (a, b)


def test_seeded_uniforms_of_nearby_positions_are_independent_across_seeds():
    """A request's consecutive draws are independent over seeds: the 2-D histogram (64 x 64)
    of the uniforms at ``t`` and ``t + dt`` over 2M seeds is flat (|z| of its chi-square
    < 4). One round of the hash on the position gave z = +22 at (1001, 1002), whose low
    bits differ in two places, and +8 at (1000, 1002)."""
    from agspec_gpu.seeding import seeded_uniforms
    n, K = 1 << 21, 64
    seeds = torch.arange(n)
    for t, dt in ((1001, 1), (1000, 2)):
        u1, u2 = (seeded_uniforms(seeds, torch.tensor(p)) for p in (t, t + dt))
        counts = torch.bincount((u1 * K).long() * K + (u2 * K).long(), minlength=K * K)
        expected, df = n / K ** 2, K * K - 1
        chi2 = ((counts.double() - expected) ** 2 / expected).sum().item()
        assert abs(chi2 - df) / (2 * df) ** 0.5 < 4, (t, dt, chi2)


def test_seeded_rows_draw_what_plain_sampling_draws():
    """A seeded request draws position ``t`` with its seed's uniform for ``t``: walking a
    draft tree emits exactly the tokens that plain sampling (an empty draft a step) emits
    from the same seed and positions, whatever the generator; the tokens follow the target
    across seeds; and its unseeded neighbours still use the generator."""
    B = 12000
    one = DraftBatch.from_lists([STAT_TREE])
    d = DraftBatch(one.token_ids.expand(B, -1), one.parents.expand(B, -1),
                   one.num_draft_tokens.expand(B))
    params = [SamplingParams(0.9, seed=1000 + b) if b % 4 else SamplingParams(0.9)
              for b in range(B)]
    rows = BatchSampling.of(params, "cpu")
    seeded = torch.tensor([p.seed is not None for p in params])
    pos = torch.arange(B, dtype=torch.int64) % 97 + 5  # where each request's draw is
    runs = [sample_accept(d, _markov_rows(d, torch.full((B,), ROOT)), None, rows,
                          torch.Generator().manual_seed(g), positions=pos) for g in (1, 2)]
    tree = runs[0]
    assert torch.equal(tree.output_ids[seeded], runs[1].output_ids[seeded])
    assert not torch.equal(tree.output_ids[~seeded], runs[1].output_ids[~seeded])
    assert set(tree.num_accepted[seeded].unique().tolist()) == {0, 1, 2}
    empty = DraftBatch(torch.empty(B, 0, dtype=torch.int32),
                       torch.empty(B, 0, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
    last = torch.full((B,), ROOT)
    for k in range(3):  # plain sampling, one position a step
        plain = sample_accept(empty, _markov_rows(empty, last), None, rows,
                              torch.Generator().manual_seed(k), positions=pos + k)
        last = plain.output_ids[:, 0]
        here = seeded & (tree.num_output > k)
        assert torch.equal(tree.output_ids[here, k], last[here]), k
    first = tree.output_ids[seeded, 0].long()
    tv = 0.5 * (torch.bincount(first, minlength=6) / first.numel()
                - target_probs(MARKOV[ROOT], params[1])).abs().sum()
    assert tv < 0.03, tv
    with pytest.raises(ValueError, match="positions"):
        sample_accept(d, _markov_rows(d, torch.full((B,), ROOT)), None, rows)


def test_capped_draft_is_a_prefix_of_each_tree():
    """``DraftBatch.capped``: each tree keeps its first ``min(num, cap)`` nodes (a tree, since
    nodes are topologically ordered), the rest become padding; greedy acceptance on the cut
    tree never goes past the cut."""
    trees = [BRANCHY, CHAIN, [], [(4, -1)]]
    d = DraftBatch.from_lists(trees)
    d = DraftBatch(d.token_ids, d.parents, d.num_draft_tokens,
                   torch.arange(d.token_ids.numel(), dtype=torch.int8).view_as(d.token_ids))
    for cap in ([2, 0, 5, 0], [0, 1, 1, 1], [99] * 4):
        c = d.capped(torch.tensor(cap, dtype=torch.int32))
        for b, tree in enumerate(trees):
            n = min(len(tree), cap[b])
            assert int(c.num_draft_tokens[b]) == n
            assert list(zip(c.token_ids[b, :n].tolist(), c.parents[b, :n].tolist())) == tree[:n]
            assert (c.token_ids[b, n:] == PAD_ID).all() and (c.parents[b, n:] == PAD_ID).all()
            assert c.maybe_source[b, :n].tolist() == d.maybe_source[b, :n].tolist()
            assert (c.maybe_source[b, n:] == -1).all()
    one = d.capped(1)  # one cap for every request
    assert one.num_draft_tokens.tolist() == [1, 1, 0, 1]
    chain = DraftBatch.from_lists([CHAIN])  # the target agrees with all of it ...
    logits = one_hot_logits([[5, 7, 9, 4]]).view(1, 4, V)  # padded [B, 1 + N, V]
    check(greedy_accept(chain, logits), [[0, 1, 2]], [[5, 7, 9, 4]])
    cut = chain.capped(1)  # ... and with the first node of it after the cut
    check(greedy_accept(cut, logits), [[0]], [[5, 7]])
