"""Draft trees on hand-made corpora with known frequencies, and the drafter's lifecycle.

Token ids are written by hand (small ids of the real cl100k vocabulary, appended with
`Drafter.extend` / ``prompt_ids``), so every expected tree can be worked out on paper:

    F0 A B C X  F1 A B C Y  F2 A B C X  F3 A B C      (query: ... F3 A B C)

has the longest match ``A B C`` three times; the candidates, most recent first, continue with
``X F3 ...``, ``Y F2 ...``, ``X F1 ...``, so the root children are X (2/3) and Y (1/3).

Documented tie-break of the best-first expansion: higher probability first, then the
shallower node, then the lower candidate index (= the more recent occurrence).
"""

import dataclasses
import functools
import json
import random
from operator import attrgetter

import pytest
import torch

import agspec_gpu.drafter as drafter_mod
import agspec_gpu.index as index_mod
from agspec_gpu.accept import teacher_forced_accept
from agspec_gpu.controller import ControllerConfig, RoleProfile
from agspec_gpu.cost_model import BatchCostModels, CostModel
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.forms import EmissionForm
from agspec_gpu.host import HostWriter
from agspec_gpu.kernels.suffix_match import MatchResult
from agspec_gpu.tiers import CorpusStore, CorpusTier, TierConfig, build_global_corpus
from agspec_gpu.tokenizer import load_tokenizer
from op_count import CountOps

A, B, C, X, Y = 10, 11, 12, 13, 14
F0, F1, F2, F3, F4 = 20, 21, 22, 23, 24
# X most recent, X twice, Y once
CASE_A = [F0, A, B, C, X, F1, A, B, C, Y, F2, A, B, C, X, F3, A, B, C]
# Y most recent, X twice (older): the heavier root child is not the most recent one
CASE_B = [F0, A, B, C, X, F1, A, B, C, X, F2, A, B, C, Y, F3, A, B, C]

# trees are checked on candidate shares alone: no online calibration, no probability floor
# and the pre-tuning controller, whose depths the golden trees were written for
_SHARES = {"calibrate": False, "min_prob": 0.0,
           "controller": ControllerConfig(alpha=1.5, beta=0.6, s_min=0.25, s_max=4.0),
           "roles": (RoleProfile("default", 24), RoleProfile("planner", 12),
                     RoleProfile("coder", 32), RoleProfile("reviewer", 16))}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("cl100k")


def make(tok, *, tier=None, **cfg):
    store = CorpusStore(tok, tier or TierConfig(use_global=False))
    return store, Drafter(store, DrafterConfig(**{**_SHARES, **cfg}), max_batch=16)


def nodes(draft: DraftBatch, b: int = 0) -> list[tuple[int, int]]:
    n = int(draft.num_draft_tokens[b])
    return list(zip(draft.token_ids[b, :n].tolist(), draft.parents[b, :n].tolist()))


def paths(draft: DraftBatch, b: int = 0) -> list[tuple[int, ...]]:
    """Root-to-node token path of every node, in node order."""
    out: list[tuple[int, ...]] = []
    for t, p in nodes(draft, b):
        out.append((() if p == -1 else out[p]) + (t,))
    return out


def check_invariants(draft: DraftBatch, max_depth: int | None = None) -> None:
    Bsz, N = draft.token_ids.shape
    assert draft.token_ids.dtype == torch.int32 and draft.parents.dtype == torch.int32
    assert draft.num_draft_tokens.dtype == torch.int32
    assert draft.parents.shape == (Bsz, N) and draft.num_draft_tokens.shape == (Bsz,)
    assert draft.maybe_source is not None and draft.maybe_source.shape == (Bsz, N)
    for b in range(Bsz):
        n = int(draft.num_draft_tokens[b])
        assert 0 <= n <= N
        tok, par = draft.token_ids[b].tolist(), draft.parents[b].tolist()
        src = draft.maybe_source[b].tolist()
        assert tok[n:] == [PAD_ID] * (N - n) and par[n:] == [PAD_ID] * (N - n)
        assert src[n:] == [-1] * (N - n)
        assert all(t >= 0 for t in tok[:n])
        assert all(-1 <= par[j] < j for j in range(n)), par[:n]
        assert all(s >= 0 for s in src[:n])
        # a trie: siblings carry distinct tokens
        sib = [(par[j], tok[j]) for j in range(n)]
        assert len(set(sib)) == n, sib
        if max_depth is not None and n:
            assert int(draft.depths()[b, :n].max()) <= max_depth


# ---------------------------------------------------------------- golden trees
@pytest.mark.parametrize("max_nodes, expected", [
    (1, [(X, -1)]),
    (2, [(X, -1), (Y, -1)]),
    # depth-1 nodes all have p = 1/3 (= Y's): Y first (shallower), then by candidate index
    (3, [(X, -1), (Y, -1), (F3, 0)]),
    (4, [(X, -1), (Y, -1), (F3, 0), (F2, 1)]),
    (5, [(X, -1), (Y, -1), (F3, 0), (F2, 1), (F1, 0)]),
    (6, [(X, -1), (Y, -1), (F3, 0), (F2, 1), (F1, 0), (A, 2)]),
    (8, [(X, -1), (Y, -1), (F3, 0), (F2, 1), (F1, 0), (A, 2), (A, 3), (A, 4)]),
])
def test_golden_tree_best_first(tok, max_nodes, expected):
    _, d = make(tok, max_nodes=max_nodes, batch_budget=False,
                controller=ControllerConfig(static_k=8))
    d.open_session("s", "t", prompt_ids=CASE_A)
    draft = d.propose(["s"])
    assert nodes(draft) == expected
    check_invariants(draft, 8)


def test_golden_tree_full_depth(tok):
    # the whole trie up to depth 3 (adaptive k = S * L_match = 1.0 * 3)
    _, d = make(tok, batch_budget=False)
    d.open_session("s", "t", role="coder", prompt_ids=CASE_A)
    got = set(paths(d.propose(["s"])))
    assert got == {(X,), (Y,), (X, F3), (X, F1), (Y, F2), (X, F3, A), (X, F1, A), (Y, F2, A)}


def test_probabilities_are_weighted_count_ratios(tok, monkeypatch):
    """The scores handed to the batch budget are the nodes' estimated acceptance
    probabilities: X = 2/3, Y and every deeper node 1/3 (one candidate of three)."""
    seen = []
    real = drafter_mod.budget_keep

    def spy(ranked, keep_n, num_requests, table, **kw):
        seen.append((ranked.clone(), keep_n.clone(), num_requests))
        assert table is d._cost_tables[d.max_batch][0]  # its one curve's table, built once
        return real(ranked, keep_n, num_requests, table, **kw)

    monkeypatch.setattr(drafter_mod, "budget_keep", spy)
    free = CostModel(((1, 1.0), (4096, 1.0)))
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = Drafter(store, DrafterConfig(**_SHARES), cost=free)
    d.open_session("s", "t", role="coder", prompt_ids=CASE_A)
    draft = d.propose(["s"])
    assert len(seen) == 1
    ranked, keep_n, nreq = seen[0]
    # the budget sees each request's best max_nodes scores, best first, -2: no node
    assert nreq == 1 and ranked.shape == (1, d.config.max_nodes) and keep_n.tolist() == [8]
    expected = torch.tensor([2 / 3] + [1 / 3] * 7)
    torch.testing.assert_close(ranked[0, :8], expected, atol=1e-5, rtol=0)
    assert bool((ranked[0, 8:] < -1.5).all())
    assert int(draft.num_draft_tokens[0]) == 8  # free verification keeps every node


def test_heavier_but_older_branch_structure(tok):
    # Y is the most recent occurrence, X has twice its mass: max_nodes=1 keeps X
    _, d = make(tok, max_nodes=1, batch_budget=False, controller=ControllerConfig(static_k=8))
    d.open_session("s", "t", prompt_ids=CASE_B)
    assert nodes(d.propose(["s"])) == [(X, -1)]
    _, d = make(tok, max_nodes=3, batch_budget=False, controller=ControllerConfig(static_k=8))
    d.open_session("s", "t", prompt_ids=CASE_B)
    # X, Y, then the 1/3 depth-1 node of the lowest candidate (the most recent: Y -> F3)
    assert set(paths(d.propose(["s"]))) == {(X,), (Y,), (Y, F3)}


def test_heavier_but_older_branch_comes_first(tok):
    _, d = make(tok, max_nodes=4, batch_budget=False, controller=ControllerConfig(static_k=8))
    d.open_session("s", "t", prompt_ids=CASE_B)
    # best-first: X (2/3), Y (1/3), Y->F3 (1/3, candidate 0), X->F2 (1/3, candidate 1)
    assert nodes(d.propose(["s"])) == [(X, -1), (Y, -1), (F3, 1), (F2, 0)]


LONG_X = list(range(100, 116))
LONG_Y = list(range(200, 216))
TWO_BRANCHES = [1, 50] + LONG_X + [2, 50] + LONG_Y + [3, 50]


@pytest.mark.parametrize("max_nodes", [20, 22])
def test_equal_probability_branches_expand_shallower_first(tok, max_nodes):
    # two candidates after `50`, p = 1/2 each, 16-token continuations
    _, d = make(tok, max_nodes=max_nodes, batch_budget=False,
                controller=ControllerConfig(static_k=16))
    d.open_session("s", "t", prompt_ids=TWO_BRANCHES)
    toks = d.propose(["s"]).token_ids[0].tolist()
    depth_x = sum(t in LONG_X for t in toks)
    depth_y = sum(t in LONG_Y for t in toks)
    assert (depth_y, depth_x) == (max_nodes // 2, max_nodes // 2)


def test_equal_probability_branches_shallow_cut_is_exact(tok):
    # the same case at small depths, where the float tie-break still holds
    for max_nodes in range(1, 9):
        _, d = make(tok, max_nodes=max_nodes, batch_budget=False,
                    controller=ControllerConfig(static_k=16))
        d.open_session("s", "t", prompt_ids=TWO_BRANCHES)
        toks = d.propose(["s"]).token_ids[0].tolist()
        # the Y occurrence is more recent (candidate 0): it gets the odd node
        assert sum(t in LONG_Y for t in toks) == (max_nodes + 1) // 2
        assert sum(t in LONG_X for t in toks) == max_nodes // 2


def test_chains_follow_the_heaviest_child(tok):
    _, d = make(tok, tree=False, batch_budget=False, controller=ControllerConfig(static_k=8))
    d.open_session("a", "t", prompt_ids=CASE_A)
    d.open_session("b", "t", prompt_ids=CASE_B)
    draft = d.propose(["a", "b"])
    # A: X (2/3), then F3 vs F1 tie -> the more recent F3; then A B C and the corpus ends
    assert nodes(draft, 0) == [(X, -1), (F3, 0), (A, 1), (B, 2), (C, 3)]
    # B: X (2/3), then F2 (more recent of X's two) and on through the Y occurrence
    assert [t for t, _ in nodes(draft, 1)] == [X, F2, A, B, C, Y, F3, A]
    for b in range(2):
        assert [p for _, p in nodes(draft, b)] == list(
            range(-1, int(draft.num_draft_tokens[b]) - 1))
    check_invariants(draft, 8)


# ---------------------------------------------------------------- limits
def test_static_k_limits_depth(tok):
    for k in (1, 2, 5):
        _, d = make(tok, batch_budget=False, controller=ControllerConfig(static_k=k))
        d.open_session("s", "t", prompt_ids=CASE_A)
        draft = d.propose(["s"])
        assert int(draft.depths()[0].max()) == k
        check_invariants(draft, k)


def test_adaptive_k_is_scale_times_match_capped_by_role(tok):
    text = list(range(300, 340))
    prompt = text + [7] + text[:12]  # the query's longest match is 12 tokens long
    roles = (RoleProfile("default"), RoleProfile("tiny", draft_cap=4),
             RoleProfile("wide", draft_cap=32, initial_scale=2.0),
             RoleProfile("half", draft_cap=32, initial_scale=0.5))
    _, d = make(tok, batch_budget=False, tree=False, roles=roles)
    for role in ("default", "tiny", "wide", "half"):
        d.open_session(role, "t", role=role, prompt_ids=prompt)
    draft = d.propose(["default", "tiny", "wide", "half"])
    got = draft.num_draft_tokens.tolist()
    # default: cap 24, S=1 -> 12; tiny: cap 4; wide: S=2 -> 24; half: S=0.5 -> 6
    assert got == [12, 4, 24, 6]
    assert draft.token_ids[0, :12].tolist() == text[12:24]
    check_invariants(draft)


def test_max_draft_depth_caps_static_k(tok):
    _, d = make(tok, batch_budget=False, max_draft_depth=3, controller=ControllerConfig(static_k=8))
    d.open_session("s", "t", prompt_ids=CASE_A)
    assert int(d.propose(["s"]).depths()[0].max()) == 3


def test_min_match(tok):
    # the longest match is 3 tokens (A B C): min_match=4 suppresses the draft
    _, d = make(tok, batch_budget=False, min_match=4)
    d.open_session("s", "t", prompt_ids=CASE_A)
    assert int(d.propose(["s"]).num_draft_tokens[0]) == 0


# ---------------------------------------------------------------- random inputs
def reference_paths(corpora, query, D, P, K, k, max_nodes, tree, bonus=None):
    """Best-first draft of equal-weight corpora, from the definitions (pure Python).
    ``bonus[r]``: tokens added to corpus ``r``'s match length when choosing the rows that
    supply candidates (the drafter's ``tier_bonus``)."""
    bonus = bonus or [0] * len(corpora)
    q = query[-D:]
    rows = []
    for c in corpora:
        found = (0, [])
        for l in range(len(q), 0, -1):
            pat = q[-l:]
            occ = [p + l for p in range(len(c) - l) if c[p:p + l] == pat and c[p + l] >= 0]
            if occ:
                found = (l, sorted(occ, reverse=True)[:P])
                break
        rows.append(found)
    score = [l + bonus[r] if l > 0 else 0 for r, (l, _) in enumerate(rows)]
    best = max(score + [0])
    if best < 1:
        return set()
    trie: dict[tuple[int, ...], list[int]] = {}  # path -> [count, representative candidate]
    for r, (l, occ) in enumerate(rows):
        if l < 1 or score[r] != best:
            continue
        for j, pos in enumerate(occ):
            win = []
            for t in corpora[r][pos:pos + K]:
                if t < 0:
                    break
                win.append(t)
            for dd in range(min(len(win), k)):
                e = trie.setdefault(tuple(win[:dd + 1]), [0, r * P + j])
                e[0] += 1
                e[1] = min(e[1], r * P + j)
    if not tree:
        chain, cur = set(), ()
        while True:
            kids = [p for p in trie if len(p) == len(cur) + 1 and p[:-1] == cur]
            if not kids:
                break
            cur = min(kids, key=lambda p: (-trie[p][0], trie[p][1]))
            chain.add(cur)
        trie = {p: v for p, v in trie.items() if p in chain}
    order = sorted(trie, key=lambda p: (-trie[p][0], len(p), trie[p][1]))
    return set(order[:max_nodes])


def test_random_drafts_match_reference_and_invariants(tok):
    rng = random.Random(1234)
    nonempty = 0
    for trial in range(40):
        D = rng.choice([4, 8])
        P, K = rng.choice([1, 2, 4, 8]), rng.choice([4, 8, 16])
        k, max_nodes, tree = rng.randint(1, K), rng.randint(1, 30), rng.random() < 0.7
        store = CorpusStore(tok, TierConfig(max_depth=D, tail_tokens=rng.choice([4, 16, 64]),
                                            use_global=False))
        cfg = {**_SHARES, "controller": ControllerConfig(static_k=k)}
        d = Drafter(store, DrafterConfig(**cfg, max_positions=P, max_draft_depth=K,
                                         max_nodes=max_nodes, tree=tree, batch_budget=False),
                    max_batch=4)
        letters = "abcd"[:rng.randint(2, 4)]
        alphabet = [tok.encode(" " + ch)[0] for ch in letters]
        if rng.random() < 0.5:  # a workspace file over the same tokens, in every form
            store.add_workspace_file("t", "w.txt", "".join(
                " " + rng.choice(letters) + ("\n" if rng.random() < 0.2 else "")
                for _ in range(rng.randint(1, 40))))
        for h in range(rng.randint(0, 2)):  # closed sessions: a history corpus
            d.open_session(f"h{h}", "t", prompt_ids=[rng.choice(alphabet)
                                                    for _ in range(rng.randint(1, 40))])
            d.close_session(f"h{h}")
        s = [rng.choice(alphabet) for _ in range(rng.randint(0, 60))]
        d.open_session("s", "t", prompt_ids=s)
        corpora = [store.arena.corpus_tokens(cid).tolist() for _, cid in store.corpora_of("s")]
        bonus = [d.config.tier_bonus[t] for t, _ in store.corpora_of("s")]
        draft = d.propose(["s"])
        check_invariants(draft, k)
        got = paths(draft)
        assert len(got) == len(set(got))
        assert set(got) == reference_paths(corpora, s, D, P, K, k, max_nodes, tree,
                                           bonus), trial
        nonempty += bool(got)
    assert nonempty >= 30


# ---------------------------------------------------------------- observe
def test_observe_updates_ring_session_scale_and_tier_weights(tok):
    store, d = make(tok, batch_budget=False)
    d.open_session("s", "t", role="coder", prompt_ids=CASE_A)
    slot = d._slot["s"]
    draft = d.propose(["s"])  # k = 3: X F3 A / X F1 A / Y F2 A
    assert int(draft.depths()[0].max()) == 3
    n = int(draft.num_draft_tokens[0])
    # accept X F3, reject the third token, bonus B (the target's own choice)
    out = torch.tensor([[X, F3, B, PAD_ID]], dtype=torch.int32)
    d.observe(["s"], out, torch.tensor([3]), torch.tensor([2]))
    # recent ring and session tier end with the committed tokens
    assert d.state.recent[slot, -3:].tolist() == [X, F3, B]
    assert int(d.state.recent_len[slot]) == len(CASE_A) + 3
    assert store.arena.corpus_tokens(store.session("s").corpus).tolist() == CASE_A + [X, F3, B]
    # rejection: S * beta
    assert float(d.state.scale[slot]) == pytest.approx(_SHARES["controller"].beta)
    # tier weights: 2 accepted session nodes of n drafted, over a prior of 1 in 2 that stays
    s = int(CorpusTier.SESSION)
    assert float(d.stats.tier_hits[s]) == pytest.approx(1 + 2)
    assert float(d.stats.tier_drafts[s]) == pytest.approx(2 + n)
    other = [i for i in range(len(CorpusTier)) if i != s]
    assert d.stats.tier_hits[other].tolist() == pytest.approx([1.0] * 3)
    assert d.stats.tier_drafts[other].tolist() == pytest.approx([2.0] * 3)
    assert d.last_accepted_sources[0, :2].tolist() == [0, 0]
    # the next propose matches the new context (... C X F3 B): only `B` recurs, always
    # followed by C, and k = max(1, floor(0.6 * 1)) = 1
    assert paths(d.propose(["s"])) == [(C,)]


def test_calibration_cells_decay_to_their_prior(tok):
    """Every commit decays the calibration's observations, never its prior: a cell no step
    reaches keeps ``hits / seen = (L + 1) / (L + 3)``, and one that was reached returns to it
    (a floor on ``seen`` alone once let ``hits`` of unreached cells decay: long matches and
    deep nodes, rarely drafted, were scored near zero after a few thousand steps). A tier
    no step drafts keeps its prior weight too (decayed, its counts would reach 0 / 0)."""
    _, d = make(tok, calibrate=True)
    d.open_session("s", "t", role="coder", prompt_ids=CASE_A * 3)
    L = d.store.config.max_depth
    prior = (torch.arange(L + 1, dtype=torch.float64) + 1) / (torch.arange(L + 1) + 3)
    row, col = L, d.stats.calib_seen.shape[1] - 1  # mode 0, tier 0, match L, the deepest node
    d.stats.calib_seen[row + L + 1, col] += 8.0  # mode 0, tier 1, match L: reached 8 times, missed
    steps = 700
    for _ in range(steps):
        draft = d.propose(["s"])
        out = torch.full((1, draft.max_nodes + 1), PAD_ID, dtype=torch.int32)
        out[0, 0] = int(draft.token_ids[0, 0]) if int(draft.num_draft_tokens[0]) else 7
        d.observe(["s"], out, torch.tensor([1]), torch.tensor([0]))
    ratio = d.stats.calib_hits / d.stats.calib_seen
    assert float(ratio[row, col]) == pytest.approx(float(prior[L]), rel=1e-9)
    assert float(d.stats.calib_seen[row, col]) == pytest.approx(2.0, rel=1e-9)
    # the missed cell: its misses decay (2 + 8 * 0.999**700 reached), its prior's hits stay
    assert float(ratio[row + L + 1, col]) == pytest.approx(
        2 * float(prior[L]) / (2 + 8 * 0.999 ** steps), rel=1e-6)
    assert float(d.stats.calib_seen[:, 0].max()) > 2.0  # the steps reached the first level
    g = int(CorpusTier.GLOBAL)  # no global tier here: never drafted
    assert (float(d.stats.tier_hits[g]), float(d.stats.tier_drafts[g])) == pytest.approx((1.0, 2.0),
                                                                              rel=1e-9)
    assert float(d.stats.tier_drafts[int(CorpusTier.SESSION)]) > 2.0


def test_observe_with_the_verifiers_path_equals_observe_without(tok):
    """``path_nodes`` (the verifier's accepted path) spares observe its own tree search and
    changes nothing: the same state after several steps of random acceptance, and the same
    next drafts; nodes past ``num_accepted`` are ignored."""

    rng = random.Random(4)
    drafters = [make(tok) for _ in range(2)]
    sids = ["a", "b", "c"]
    for _, d in drafters:
        for i, sid in enumerate(sids):
            d.open_session(sid, "t", role="coder", prompt_ids=(CASE_A * 3)[i:])
    for step in range(6):
        drafts = [d.propose(sids) for _, d in drafters]
        assert torch.equal(drafts[0].token_ids, drafts[1].token_ids)
        draft = drafts[0]
        # a "true" continuation: a random node's path, then a token no draft has
        truth = torch.full((3, draft.max_nodes + 1), 0, dtype=torch.long)
        for b in range(3):
            n = int(draft.num_draft_tokens[b])
            node = rng.randrange(-1, n) if n else -1
            path = []
            while node >= 0:
                path.append(int(draft.token_ids[b, node]))
                node = int(draft.parents[b, node])
            truth[b, :len(path)] = torch.tensor(path[::-1])
        res = teacher_forced_accept(draft, truth)
        nacc = res.num_accepted.to(torch.int32)
        out = torch.full((3, draft.max_nodes + 1), PAD_ID, dtype=torch.int32)
        for b in range(3):
            k = int(nacc[b])
            out[b, :k + 1] = truth[b, :k + 1].to(torch.int32)
            out[b, k] = B  # the bonus token
        nout = nacc + 1
        cut = nacc.clone()
        if step == 3:  # the caller cut acceptance short (a message end): path entries ignored
            cut = (nacc - 1).clamp(min=0)
            nout = cut + 1
            for b in range(3):
                out[b, int(cut[b]):] = PAD_ID
                out[b, int(cut[b])] = B
        drafters[0][1].observe(sids, out, nout, cut)
        drafters[1][1].observe(sids, out, nout, cut, path_nodes=res.path_nodes)
    (_, d0), (_, d1) = drafters
    for name in ("state.scale", "state.prev_full", "stats.calib_seen", "stats.calib_hits",
                 "stats.tier_hits", "stats.tier_drafts", "state.recent", "state.recent_len",
                 "last_accepted_sources"):
        assert torch.equal(attrgetter(name)(d0), attrgetter(name)(d1)), name
    assert torch.equal(d0.propose(sids).token_ids, d1.propose(sids).token_ids)


_STATE = ("state.scale", "state.prev_full", "stats.calib_seen", "stats.calib_hits",
          "stats.tier_hits", "stats.tier_drafts", "state.recent", "state.recent_len",
          "state.match_cap", "last_accepted_sources")
_PER_SLOT = {"state.scale", "state.prev_full", "state.recent", "state.recent_len",
             "state.match_cap"}


def assert_same_state(d0: Drafter, d1: Drafter, where) -> None:
    """Every piece of drafter state equal, but the spare slot's row (slot ``max_sessions``,
    which padding rows of a graphed step read and write: junk by design, e.g. its scale is
    clamped into the controller's range there)."""
    for name in _STATE:
        a, c = attrgetter(name)(d0), attrgetter(name)(d1)
        if name in _PER_SLOT:
            a, c = a[:d0.max_sessions], c[:d1.max_sessions]
        assert torch.equal(a, c), (where, name)


def _lockstep_drafters(tok, batch_budget: bool, cost=None, **cfg) -> list[Drafter]:
    """Two equal drafters (max_sessions 12, max_batch 8; a shared workspace tenant and
    tenants without one: a ragged (request, corpus) grid)."""
    ds = []
    for _ in range(2):
        store = CorpusStore(tok, TierConfig(use_global=False))
        d = Drafter(store, DrafterConfig(**{**_SHARES, "batch_budget": batch_budget, **cfg}),
                    max_batch=8, max_sessions=12, cost=cost)
        store.add_workspace_file("w", "w.txt", "".join(chr(97 + i % 7) * 3 for i in range(60)))
        ds.append(d)
    return ds


def _run_lockstep(ds: list[Drafter], spelled: bool) -> None:
    """Ten sessions, then steps of any of them (buckets 1, 4, 8, 8, 2, 8) through both
    drafters: the same drafts, the same state after every commit. Commits pass the
    verifier's accepted nodes, or (``spelled``) leave the drafter to find them."""
    sids = [f"s{i}" for i in range(10)]
    for d in ds:
        for i, sid in enumerate(sids):
            d.open_session(sid, "w" if i % 2 else f"t{i}", role="coder",
                           prompt_ids=(CASE_A * 3)[i:])
    rng = random.Random(2)
    batches = [[9], [2, 8, 0], [3, 4, 5, 6, 7, 8], [9, 1, 4, 7, 5], [6, 3], list(range(8))]
    for step, rows in enumerate(batches):
        batch, b = [sids[i] for i in rows], len(rows)
        drafts = [d.propose(batch) for d in ds]
        for f in ("token_ids", "parents", "num_draft_tokens", "maybe_source"):
            assert torch.equal(getattr(drafts[0], f), getattr(drafts[1], f)), (step, f)
        res = teacher_forced_accept(drafts[0], drafts[0].token_ids[:, :3].clamp(min=0))
        take = torch.tensor([min(int(x), rng.randrange(4)) for x in res.num_accepted],
                            dtype=torch.int32)
        out = torch.full((b, 4), B, dtype=torch.int32)
        for r in range(b):
            path = res.path_nodes[r, :int(take[r])]
            out[r, :path.numel()] = drafts[0].token_ids[r, path]
        for d in ds:
            d.observe(batch, out, take + 1, take,
                      path_nodes=None if spelled else res.path_nodes)
        assert_same_state(*ds, step)
    assert ds[1].stats.calib_seen.ne(2.0).any()  # commits calibrated something


@pytest.mark.parametrize("batch_budget,spelled", [(True, False), (False, False), (True, True)])
def test_padded_steps_equal_unpadded(tok, batch_budget, spelled):
    """Both device halves of a step padded to a batch bucket (what StepGraphs replays as CUDA
    graphs on a GPU; here eagerly) do exactly what the unpadded step does: the same drafts,
    the same state after every commit. Padding requests add no nodes, the batch budget prices
    the real requests only, and their writes land in the spare slot. More sessions are open
    than a step takes, and steps pick any of them."""
    ds = _lockstep_drafters(tok, batch_budget)
    ds[1]._graphs = ds[1]._step_graphs(use_graphs=False)
    _run_lockstep(ds, spelled)


def test_padded_steps_equal_unpadded_with_a_curve_per_bucket(tok):
    """With cost curves measured at the graph buckets' batch sizes, a padded step's budget
    (which picks the curve by its bucket) prices what the unpadded one (by its own batch)
    does: the same drafts and state. The curves differ enough to change the drafts."""
    stair = lambda b, ms: CostModel(tuple((b + n, ms * (1 + n / 8)) for n in (0, 8, 16, 32,
                                                                            64, 128)),
                                    steps=True, requests=b)
    cost = BatchCostModels(((1, stair(1, 1.0)), (2, stair(2, 40.0)), (4, stair(4, 1.0)),
                            (8, stair(8, 3.0))))
    ds = _lockstep_drafters(tok, True, cost=cost)
    ds[1]._graphs = ds[1]._step_graphs(use_graphs=False)
    _run_lockstep(ds, False)


def test_batch_budget_steers_by_the_curve_of_the_steps_bucket(tok):
    """A step of ``b`` requests steers by the curve measured at the smallest batch ``>= b``
    (its verification's bucket): with every draft token ruinous at 4 requests and free at
    1, one request drafts and three (bucket 4) draft nothing; swapped, the reverse. Each
    curve's table is built once."""
    free = CostModel(((1, 1.0), (4096, 1.0)))
    huge = lambda b: CostModel(((b, 1.0), (b + 1, 1e6)), steps=True, requests=b)
    for one, four, drafts in ((free, huge(4), (True, False)),
                              (huge(1), free, (False, True))):
        for graphs in (False, True):
            store = CorpusStore(tok, TierConfig(use_global=False))
            d = Drafter(store, DrafterConfig(**_SHARES), max_batch=4,
                        cost=BatchCostModels(((1, one), (4, four))))
            if graphs:
                d._graphs = d._step_graphs(use_graphs=False)
            for i in range(3):
                d.open_session(f"s{i}", "t", role="coder", prompt_ids=CASE_A[i:])
            got = (int(d.propose(["s0"]).num_draft_tokens.sum()) > 0,
                   int(d.propose(["s0", "s1", "s2"]).num_draft_tokens.sum()) > 0)
            assert got == drafts, (graphs, got)
            assert sorted(d._cost_tables) == [1, 4]
    with pytest.raises(ValueError, match="cost: expected"):
        Drafter(CorpusStore(tok, TierConfig(use_global=False)), cost={1: free})
    # curves at sizes that are no bucket (3): padded and unpadded steps read the curve of
    # the bucket (4), not of their own row count
    for graphs in (False, True):
        store = CorpusStore(tok, TierConfig(use_global=False))
        d = Drafter(store, DrafterConfig(**_SHARES), max_batch=4,
                    cost=BatchCostModels(((3, free), (4, huge(4)))))
        if graphs:
            d._graphs = d._step_graphs(use_graphs=False)
        for i in range(3):
            d.open_session(f"s{i}", "t", role="coder", prompt_ids=CASE_A[i:])
        assert int(d.propose(["s0", "s1", "s2"]).num_draft_tokens.sum()) == 0, graphs


def test_set_cost_is_all_or_nothing(tok, monkeypatch):
    """``set_cost`` between steps installs the new curves (and captures the step graphs
    again); a capture that raises leaves the old prices, tables and graphs; a pending
    proposal refuses it."""
    free = CostModel(((1, 1.0), (4096, 1.0)))
    huge = CostModel(((1, 1.0), (2, 1e6)))
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = Drafter(store, DrafterConfig(**_SHARES), max_batch=4, cost=huge)
    d._graphs = d._step_graphs(use_graphs=False)
    d.open_session("s", "t", role="coder", prompt_ids=CASE_A)
    old = (d.cost, d._cost_tables, d._graphs)
    monkeypatch.setattr(Drafter, "_step_graphs", lambda self, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        d.set_cost(free)
    assert (d.cost, d._cost_tables, d._graphs) == old
    monkeypatch.undo()
    assert int(d.propose(["s"]).num_draft_tokens.sum()) == 0  # still the old prices
    with pytest.raises(RuntimeError, match="set_cost: a proposed step"):
        d.set_cost(free)
    d.forget(["s"])
    assert d._match_outs  # the old graphs' plans (made by the propose above) ...
    d.set_cost(free)
    assert not d._match_outs and not d._commit_plans  # ... let go with them
    assert d._graphs is not old[2] and int(d.propose(["s"]).num_draft_tokens.sum()) > 0


@pytest.mark.parametrize("spelled", [False, True])
def test_padded_steps_equal_unpadded_with_few_candidates(tok, spelled):
    """The same with drafts narrower than the commit step's widest (one position, depth
    3: a request with one corpus drafts at most 3 nodes, one with two at most 6): its
    buckets are keyed by the draft's width, and what a commit writes in place lands in the
    bucket the step runs."""
    ds = _lockstep_drafters(tok, True, max_positions=1, max_draft_depth=3)
    ds[1]._graphs = ds[1]._step_graphs(use_graphs=False)
    _run_lockstep(ds, spelled)



@pytest.mark.parametrize("graphed", [False, True])
def test_match_buffers_grow_with_the_levels(tok, graphed):
    """The match writes into buffers the drafter keeps (in the propose graph's inputs when
    graphed): corpora indexed in many levels (tail_tokens=2) grow their level columns
    past the first width, and every draft equals one whose match allocated a new result
    of the exact width (what the drafter did before it kept buffers; unpadded)."""
    ds = []
    for keep in (True, False):
        store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=2))
        d = Drafter(store, DrafterConfig(**_SHARES), max_batch=4, max_sessions=6)
        if keep and graphed:
            d._graphs = d._step_graphs(use_graphs=False)
        if not keep:
            d._match_out = functools.partial(_fresh_match_out, d)
        store.add_workspace_file("w", "w.txt", "".join(chr(97 + i % 5) * 2 for i in range(40)))
        for i in range(4):
            d.open_session(f"s{i}", "w" if i % 2 else f"t{i}", role="coder",
                           prompt_ids=(CASE_A * 12)[i * 7:])
            for chunk in (CASE_A * 3, CASE_A, CASE_A[:8], CASE_A[i:i + 3]):  # a level each
                d.extend(f"s{i}", chunk)
        ds.append(d)
    for step, rows in enumerate([[0], [1, 2, 3], [3, 0], [0, 1, 2, 3]]):
        sids = [f"s{i}" for i in rows]
        drafts = [d.propose(sids) for d in ds]
        for f in ("token_ids", "parents", "num_draft_tokens", "maybe_source"):
            assert torch.equal(getattr(drafts[0], f), getattr(drafts[1], f)), (step, f)
        for d in ds:  # more tokens each: more levels
            n = torch.full((len(sids),), 2, dtype=torch.int32)
            d.append_generated(sids, torch.tensor([CASE_A[step:step + 2]] * len(sids),
                                                  dtype=torch.int32), n)
    assert ds[0]._match_scratch.sa_lo.shape[1] > 4
    if graphed:  # written in place: the propose graph's input buffers
        out, matched, plan = ds[0]._match_out(2, 3, 1)
        again = ds[0]._graphs[0].plan(2, ds[0]._draft_example(3), ("length", "win", "src"))
        assert again.buf is plan.buf and all(matched[n] is plan.staged[n] for n in matched)
        for n in ("length", "win", "src"):
            assert matched[n].data_ptr() == again.staged[n].data_ptr() == \
                again.buf[n].data_ptr()
        assert out.windows.data_ptr() == matched["win"].data_ptr()


def _fresh_match_out(d: Drafter, B: int, Rs: int, max_levels: int):
    P, K, Q = d.config.max_positions, d.config.max_draft_depth, B * Rs
    i64 = functools.partial(torch.empty, dtype=torch.int64)
    out = MatchResult(torch.empty(Q, dtype=torch.int32), i64(Q), i64(Q, P), i64(Q, max_levels),
                      i64(Q, max_levels), torch.empty(Q, P, K, dtype=torch.int32),
                      torch.empty(Q, P, K, dtype=torch.int8))
    return out, {"length": out.length.view(B, Rs), "win": out.windows.view(B, Rs, P, K),
                 "src": out.window_sources.view(B, Rs, P, K)}, None

@pytest.mark.parametrize("spelled", [False, True])
def test_host_rings_coming_round_change_no_draft(tok, spelled):
    """The step's host lists go through ``HostWriter`` rings whose views live until the
    ring comes round: with rings of 64 bytes (every write fills a half or grows it, so the
    bytes of a write are reused within a few writes) a drafter drafts and commits exactly
    what one with the default rings does, so no step keeps a view past its launches."""
    ds = _lockstep_drafters(tok, batch_budget=True)
    ds[1]._writer = HostWriter(64, ds[1].state.recent.device)
    ds[1].store.arena._writer = HostWriter(64, ds[1].state.recent.device)
    _run_lockstep(ds, spelled)
    assert ds[1]._writer.nbytes < 1 << 12 and ds[1].store.arena._writer.nbytes < 1 << 12


def _padded_drafter(tok, num_sessions: int, max_batch: int) -> tuple[Drafter, list[str]]:
    """A drafter whose steps run the padded functions its CUDA graphs capture (eagerly), and
    ``num_sessions`` sessions of similar code, half of them with a shared workspace."""
    store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=4096))
    store.add_workspace_file("w", "w.py", "def f(x):\n    return x + 2\n" * 4)
    d = Drafter(store, DrafterConfig(), max_batch=max_batch)
    d._graphs = d._step_graphs(use_graphs=False)
    text = tok.encode("def f(x):\n    return x + 1\n\n" * 6)
    sids = [f"s{i}" for i in range(num_sessions)]
    for i, sid in enumerate(sids):
        d.open_session(sid, "w" if i % 2 else f"t{i}", prompt_ids=text[: 20 + 7 * (i % 5)])
    return d, sids


def _verified(draft: DraftBatch) -> dict:
    """``observe``'s arguments after a verifier accepted each draft's first two tokens where
    they are drafted (host counts and the accepted path, as a serving loop passes them)."""
    truth = draft.token_ids[:, :2].clamp(min=0)
    res = teacher_forced_accept(draft, truth)
    n = res.num_accepted.to(torch.int32)
    return dict(output_ids=torch.cat([truth, truth[:, :1]], 1).to(torch.int32),
                num_output=n + 1, num_accepted=n, num_output_host=(n + 1).tolist(),
                validate=False, path_nodes=res.path_nodes)


def test_graphed_step_launches_few_kernels_outside_its_graphs(tok, monkeypatch):
    """With the step's device halves graphed, what a GPU still launches one by one per step
    stays small: counted here on the CPU with the graphed functions and the match (one
    Triton launch on a GPU, its queries read from the ring and its windows written in it;
    three launches before session 24) left out, and the session tier's append counted as
    its one launch. Before the graphs: ~185 ops per propose,
    ~105 per commit; before the queries and windows kernels, ~30 per propose; before the
    graphs' inputs were copied one launch per dtype (and the commit's output cloned), 11
    and 16; 9 and 7 before the match wrote its outputs into the propose graph's input
    buffers, and the commit its padded inputs (session 25: 7 and 9, no allocation; session
    26: 7 and 6; session 27: 7 and 7, the propose's host-to-device copy of its descriptors,
    which a CPU does not count, traded for an add on the kept ones; session 28: 7 and 6,
    the add made by the append's launch)."""
    d, sids = _padded_drafter(tok, 5, max_batch=8)
    count = CountOps()
    for g in d._graphs:
        g.fn = count.pause(g.fn)
    monkeypatch.setattr(drafter_mod, "suffix_match", count.pause(drafter_mod.suffix_match))
    monkeypatch.setattr(index_mod, "arena_append",
                        count.launches(index_mod.arena_append, "arena_append"))
    per_step = []
    for _ in range(4):
        with count.mode:
            draft = d.propose(sids)
            n_propose = len(count.ops)
            kw = _verified(draft)
            n_acc = len(count.ops)
            d.observe(sids, **kw)
        per_step.append((n_propose, len(count.ops) - n_acc))
        count.ops.clear()
    assert int(draft.num_draft_tokens.sum()) > 0
    for n_propose, n_commit in per_step[1:]:  # the first step also fills new buckets' buffers
        # 7: the graph's int64 inputs' copy and its six outputs' clones (stable drafts)
        assert n_propose <= 7, per_step
        # 6: the accepted tokens and path into the graph's buffers (a copy each: their
        # padding columns already hold the pad), three dtype groups of inputs' copies, the
        # session corpora's append, which grows the kept descriptors' lengths too (9 in
        # session 25: a fill of the tokens' padding columns every step, and the append a
        # gather, a scatter and a fill; 7 before it: a padded copy of the tokens, one op
        # counted here, is an allocation, a fill and a copy)
        assert n_commit <= 6, per_step


def test_graphed_step_replays_few_kernels(tok, monkeypatch):
    """What the drafter's two CUDA graphs replay per step: counted on the CPU as the ops of
    the graphed functions, each Triton-backed function one launch (as on a GPU). Every
    replayed kernel costs a microsecond or two of a step that the drafter should keep under
    2% of. Before the candidate-rows, depth-caps, batch-budget and controller-commit
    kernels (and the decayed tables in one buffer): 86 in the propose graph, 40 in the
    commit's."""
    d, sids = _padded_drafter(tok, 12, max_batch=16)
    count = CountOps()
    for name in ("candidate_rows", "depth_caps", "node_probs", "best_first", "budget_keep",
                 "emit_nodes", "controller_commit", "drafter_commit"):
        monkeypatch.setattr(drafter_mod, name,
                            count.launches(getattr(drafter_mod, name), name))
    per_graph = [[], []]
    for g, log in zip(d._graphs, per_graph):
        def counted(*a, _fn=g.fn, _log=log, **k):
            count.ops.clear()
            with count.mode:
                out = _fn(*a, **k)
            _log.append(len(count.ops))
            return out
        g.fn = counted
    for _ in range(3):
        draft = d.propose(sids)
        d.observe(sids, **_verified(draft))
    assert int(draft.num_draft_tokens.sum()) > 0
    assert max(per_graph[0]) <= 10 and max(per_graph[1]) <= 8, per_graph  # 8 and 6


def test_session_lifecycle_edges(tok):
    """A session id reused in its tenant after its close: both closes succeed and the
    history holds both texts; a session twice in one step is refused before any state
    changes; a closed session's ring row is cleared for the slot's next owner; the store
    refuses to close a tenant with open sessions (the drafter frees their slots)."""
    store, d = make(tok, batch_budget=False)
    d.open_session("s", "t", role="coder", prompt_ids=CASE_A)
    slot = d._slot["s"]
    d.close_session("s")
    assert d.state.recent[slot].abs().sum() == 0 and int(d.state.recent_len[slot]) == 0
    d.open_session("s", "t", role="coder", prompt_ids=[F0, A, B])
    d.close_session("s")  # the same id again: another history document
    held = store.arena.corpus_tokens(store._tenants["t"].history).tolist()
    assert held.count(F1) == 1 and held.count(F0) == 2
    d.open_session("a", "t", role="coder", prompt_ids=CASE_A)
    ring = d.state.recent.clone()
    for call in (lambda: d.propose(["a", "a"]),
                 lambda: d.observe(["a", "a"], torch.tensor([[X], [X]], dtype=torch.int32),
                                   torch.tensor([1, 1]), torch.tensor([0, 0]))):
        with pytest.raises(ValueError, match="each session at most once"):
            call()
    assert torch.equal(d.state.recent, ring)
    assert store.arena.corpus_tokens(store.session("a").corpus).tolist() == CASE_A
    with pytest.raises(ValueError, match="open sessions"):
        store.close_tenant("t")
    d.close_session("a")
    store.close_tenant("t")
    assert len(d._free) == 16 and store.nbytes() == 0


def test_observe_full_acceptance_expands_scale_and_new_tokens_drive_the_match(tok):
    store, d = make(tok, batch_budget=False, tree=False)
    d.open_session("s", "t", role="coder", prompt_ids=CASE_A)
    slot = d._slot["s"]
    draft = d.propose(["s"])
    assert nodes(draft) == [(X, -1), (F3, 0), (A, 1)]  # chain, depth k = 3
    d.observe(["s"], torch.tensor([[X, F3, A, B]]), torch.tensor([4]), torch.tensor([3]))
    assert float(d.state.scale[slot]) == pytest.approx(ControllerConfig().alpha)
    # context now ends `A B C X F3 A B`: that 7-token match starts at the third `A B C`
    # and continues with the committed tokens (k = floor(1.5 * 7) = 10, the corpus ends first)
    nxt = d.propose(["s"])
    assert [t for t, _ in nodes(nxt)] == [C, X, F3, A, B]


def test_observe_for_another_batch_skips_the_controller(tok):
    _, d = make(tok, batch_budget=False)
    d.open_session("s", "t", prompt_ids=CASE_A)
    d.open_session("u", "t", prompt_ids=CASE_B)
    d.propose(["s", "u"])
    hits = d.stats.tier_hits.clone()
    d.observe(["s"], torch.tensor([[X]]), torch.tensor([1]), torch.tensor([0]))
    assert float(d.state.scale[d._slot["s"]]) == 1.0  # not the batch that was proposed
    assert torch.equal(d.stats.tier_hits, hits)
    assert d.state.recent[d._slot["s"], -1].item() == X


def test_append_generated_commits_without_controller_update(tok):
    store, d = make(tok, batch_budget=False)
    d.open_session("s", "t", prompt_ids=CASE_A)
    d.propose(["s"])
    d.append_generated(["s"], torch.tensor([[X, F3, PAD_ID]]), torch.tensor([2]))
    assert float(d.state.scale[d._slot["s"]]) == 1.0
    assert store.arena.corpus_tokens(store.session("s").corpus).tolist()[-2:] == [X, F3]


# ---------------------------------------------------------------- source tags
def upto(tok, text: str, marker: str) -> list[int]:
    """Tokens of ``text`` (encoded whole) up to the first token that completes ``marker``."""
    ids = tok.encode(text)
    for n in range(1, len(ids) + 1):
        if marker in tok.decode(ids[:n]):
            return ids[:n]
    raise AssertionError(marker)


def test_maybe_source_tags_tier_and_form(tok, tmp_path):
    (tmp_path / "lib.py").write_text("def global_helper_function(alpha, beta):\n"
                                     "    return alpha * beta + 12345\n")
    g = build_global_corpus([tmp_path], tok, tmp_path / "g.agspec", max_depth=32)
    store = CorpusStore(tok, TierConfig(), global_corpus=g)
    d = Drafter(store, DrafterConfig(**{**_SHARES, "controller": ControllerConfig(static_k=6)},
                                     tree=False, batch_budget=False))
    ws = ("class WorkspaceOnlyThing:\n    def method_one(self, gamma):\n"
          "        return gamma + 98765\n")
    store.add_workspace_file("t", "w.py", ws)
    hist = tok.encode("history only words zebra quartz fjord marmalade trombone")
    d.open_session("old", "t", prompt_ids=hist)
    d.close_session("old")

    def lines(prefix):
        return "\n".join(prefix + ln for ln in ws.split("\n")[:-1]) + "\n"

    ws_tag = int(CorpusTier.WORKSPACE) * 8
    form = {f: i for i, f in enumerate(EmissionForm)}
    # each query crosses the first line break, where the forms differ
    cases = {
        "sess": (list(range(500, 520)) + list(range(500, 505)), 0),
        "raw": (upto(tok, ws, "    def"), ws_tag + form[EmissionForm.RAW]),
        "diff+": (upto(tok, lines("+"), "+    def"), ws_tag + form[EmissionForm.DIFF_ADD]),
        "diff-": (upto(tok, lines("-"), "-    def"), ws_tag + form[EmissionForm.DIFF_DEL]),
        "json": (upto(tok, '{"new_str": ' + json.dumps(ws), "    def"),
                 ws_tag + form[EmissionForm.JSON]),
        "indent": (upto(tok, lines("    "), "        def"), ws_tag + form[EmissionForm.INDENT_IN]),
        "hist": (hist[:4], int(CorpusTier.HISTORY) * 8),
        "glob": (upto(tok, "def global_helper_function(alpha", "_function"),
                 int(CorpusTier.GLOBAL) * 8),
    }
    for name, (prompt, _) in cases.items():
        d.open_session(name, "t", prompt_ids=prompt)
    draft = d.propose(list(cases))
    check_invariants(draft)
    for b, (name, (_, tag)) in enumerate(cases.items()):
        n = int(draft.num_draft_tokens[b])
        assert n >= 2, name
        assert draft.maybe_source[b, :n].tolist() == [tag] * n, name
    assert [tag for _, tag in cases.values()] == [0, 8, 9, 11, 12, 13, 16, 24]


# ---------------------------------------------------------------- batch budget
def test_batch_budget_on_off(tok):
    huge = CostModel(((1, 1.0), (2, 1e6)))  # every extra token costs a million
    for budget, expect_empty in ((True, True), (False, False)):
        store = CorpusStore(tok, TierConfig(use_global=False))
        d = Drafter(store, DrafterConfig(batch_budget=budget), cost=huge)
        for i in range(3):
            d.open_session(f"s{i}", "t", prompt_ids=CASE_A[i:])
        draft = d.propose(["s0", "s1", "s2"])
        total = int(draft.num_draft_tokens.sum())
        assert (total == 0) == expect_empty, (budget, total)
        check_invariants(draft)
    # the default (cheap, memory-bound) cost keeps the draft
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = Drafter(store, DrafterConfig(batch_budget=True))
    d.open_session("s", "t", prompt_ids=CASE_A)
    assert int(d.propose(["s"]).num_draft_tokens[0]) > 0


def test_batch_budget_is_off_under_static_k(tok):
    huge = CostModel(((1, 1.0), (2, 1e6)))
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = Drafter(store, DrafterConfig(controller=ControllerConfig(static_k=4)), cost=huge)
    d.open_session("s", "t", prompt_ids=CASE_A)
    assert int(d.propose(["s"]).num_draft_tokens[0]) > 0


# ---------------------------------------------------------------- batches
def test_match_grid_is_reused_until_the_batch_or_the_corpora_change(tok):
    """A propose reuses the last (request, corpus) grid while the batch and the store's
    epoch stay; every change of the corpora a session may search (a session opened or
    closed, a workspace created or rebuilt on eviction, a history created, a tenant
    closed) bumps the epoch, so the grid used always equals a fresh one, and the tenant
    versions it checks are current. The commit after it appends each session's tokens to
    that session's corpus, taken from the grid (rows of 1-2 corpora: ragged)."""
    store = CorpusStore(tok, TierConfig(use_global=False, workspace_budget_tokens=300))
    d = Drafter(store, DrafterConfig(**_SHARES), max_batch=8, max_sessions=8)
    for i in range(4):
        d.open_session(f"s{i}", f"t{i % 2}", role="coder", prompt_ids=CASE_A[i:])
    batch = ["s0", "s1", "s2"]
    built = []
    grid = d._match_grid

    def counted(sids):
        built.append(list(sids))
        return grid(sids)

    d._match_grid = counted

    def propose(sids, rebuilt: bool):
        """A step: propose (the grid rebuilt or not), then commit one token to each session
        (the commit takes the sessions' corpora from the grid), and where it landed."""
        n = len(built)
        d.propose(sids)
        fresh = grid(sids)  # the host lists equal, and the device lists hold them
        assert len(built) == n + rebuilt and d._grid[:5] == fresh[:5]
        assert [t.tolist() for t in d._grid[5:]] == \
            [fresh[0], torch.tensor(fresh[2]).view(len(sids), -1).tolist(), fresh[4]]
        assert d._grid_key == (store.epoch, tuple(sids))
        assert all(d._version[s] == store.tenant_version(s) for s in sids)
        cids = [store.session(s).corpus for s in sids]
        sizes = [store.arena.num_tokens(c) for c in cids]
        B, tok = len(sids), 11 + len(built)
        d.observe(sids, torch.full((B, 1), tok, dtype=torch.int32),
                  torch.ones(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
        for c, n in zip(cids, sizes):
            assert store.arena.num_tokens(c) == n + 1
            assert store.arena.corpus_tokens(c)[-1].item() == tok

    propose(batch, True)
    propose(batch, False)  # a running batch's next step
    propose(batch[::-1], True)  # another batch (order matters: rows follow it)
    store.add_workspace_file("t0", "a.py", "def f(x):\n    return x + 1\n")
    propose(batch, True)  # t0's sessions gain a workspace row
    before = store.corpora_of("s0")
    for k in range(12):  # past the 300-token budget: evicted, rebuilt under a new id
        store.add_workspace_file("t0", f"b{k}.py", f"x{k} = {k} * 7  # {'pad ' * 10}\n")
    assert store.corpora_of("s0") != before
    propose(batch, True)
    d.close_session("s3")  # t1 gains a history corpus
    propose(batch, True)
    assert len(store.corpora_of("s1")) == 2
    d.open_session("s4", "t2", prompt_ids=CASE_B)
    propose(batch + ["s4"], True)
    propose(batch + ["s4"], False)
    propose(["s1", "s0"], True)
    with pytest.raises(ValueError, match="open sessions"):  # s1 first (its slot is the
        store.close_tenant("t1")                            # drafter's to free)
    d.close_session("s1")
    store.close_tenant("t1")  # s1's corpora are gone: the grid is not reused
    with pytest.raises(KeyError, match="s1"):
        d.propose(["s1", "s0"])
    # without a history, closing a session changes no other corpus: the epoch still moves
    store = CorpusStore(tok, TierConfig(use_global=False, use_history=False))
    d = Drafter(store, DrafterConfig(**_SHARES), max_batch=8, max_sessions=8)
    for i in range(3):
        d.open_session(f"s{i}", "t0", role="coder", prompt_ids=CASE_A[i:])
    d.propose(batch)
    d.close_session("s2")
    with pytest.raises(KeyError, match="s2"):
        d.propose(batch)


def _assert_kept_descriptors_current(d: Drafter) -> None:
    """The drafter's kept match descriptors equal a fresh gather of its grid's rows (the
    padding rows' lengths aside: they have no query), ``max_tail`` a bound of the fresh."""
    kept = d._kept.desc
    assert d._kept.key == d._grid_key and d._kept.version == d.store.arena.descriptor_version
    rows_cid, rows_tier = d._grid[1], d._grid[2]
    fresh = d.store.arena.descriptors(rows_cid)
    real = torch.tensor(rows_tier) >= 0
    for f in ("tok_base", "tail_start", "level_indptr", "level_sa_base", "level_sa_len",
              "level_key"):
        assert torch.equal(getattr(kept, f), getattr(fresh, f)), f
    assert torch.equal(kept.num_tokens[real], fresh.num_tokens[real])
    assert kept.max_levels == fresh.max_levels and kept.max_tail >= fresh.max_tail


def test_kept_descriptors_follow_the_corpora(tok, monkeypatch):
    """A propose gathers the match's descriptors only when the grid or a corpus's layout
    changed; a running batch's commits grow the kept lengths on the device. Through level
    builds (tail_tokens=12: every few steps), another batch's steps, context from outside
    (``extend``), a workspace file and a closed session, the kept descriptors always equal
    a fresh gather, and most steps of a running batch gather nothing."""
    store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=12))
    d = Drafter(store, DrafterConfig(**_SHARES), max_batch=8, max_sessions=8)
    for i in range(5):
        d.open_session(f"s{i}", f"t{i % 2}", role="coder", prompt_ids=CASE_A[i:])
    gathers = []
    fields = store.arena.descriptor_fields
    monkeypatch.setattr(store.arena, "descriptor_fields",
                        lambda cids: gathers.append(len(cids)) or fields(cids))
    rng = random.Random(5)

    def step(sids: list[str]) -> bool:
        """One step of ``sids`` (1-3 tokens each); whether its propose gathered."""
        n = len(gathers)
        d.propose(sids)
        gathered = len(gathers) > n
        _assert_kept_descriptors_current(d)  # (a gather too)
        counts = [rng.randrange(1, 4) for _ in sids]
        out = torch.tensor([[rng.choice(CASE_A) for _ in range(3)] for _ in sids],
                           dtype=torch.int32)
        num = torch.tensor(counts, dtype=torch.int32)
        d.observe(sids, out, num, num - 1, num_output_host=counts, validate=False)
        if d._kept.key == d._grid_key:
            _assert_kept_descriptors_current(d)
        return gathered

    batch = ["s0", "s1", "s2"]
    gathered = [step(batch) for _ in range(12)]
    assert gathered[0] and not all(gathered[1:]) and any(gathered[1:])  # builds: regathers
    assert step(["s3", "s4"])  # another batch
    assert step(batch)  # back: the other batch's appends changed the corpora
    d.extend("s1", CASE_B[:2])
    assert step(batch)
    store.add_workspace_file("t0", "a.py", "def f(x):\n    return x + 1\n")
    assert step(batch)
    d.close_session("s4")  # t0 gains a history corpus
    assert step(batch)
    gathered = [step(batch) for _ in range(12)]
    assert not all(gathered)


def test_match_arguments_are_checked_once_per_buffer(tok, monkeypatch):
    """The match's launcher checks its arguments when any tensor the drafter passes is new
    (the first step, the arena's grown buffers, a new grid or new descriptors) and skips
    the checks for the very tensors it checked the step before."""
    import agspec_gpu.kernels.suffix_match as sm

    checks = []
    check = sm.check_match_args
    monkeypatch.setattr(sm, "check_match_args",
                        lambda *a, **k: checks.append(1) or check(*a, **k))
    # (no level builds: the extend below stays in the tail)
    store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=1 << 17))
    d = Drafter(store, DrafterConfig(**_SHARES), max_batch=8, max_sessions=8)
    for i in range(3):
        d.open_session(f"s{i}", "t0", role="coder", prompt_ids=CASE_A[i:])
    batch = ["s0", "s1"]

    def step(sids: list[str]) -> int:
        n = len(checks)
        d.propose(sids)
        one = torch.ones(len(sids), dtype=torch.int32)
        d.observe(sids, torch.full((len(sids), 1), A, dtype=torch.int32), one, one - 1,
                  num_output_host=one.tolist(), validate=False)
        return len(checks) - n

    assert [step(batch) for _ in range(3)] == [1, 0, 0]
    assert step(["s2"]) == 1 and step(["s2"]) == 0  # a new grid
    tokens = store.arena.tokens
    d.extend("s2", [A, B, C] * 23000)  # past the arena's 65,536 tokens: new buffers
    assert store.arena.tokens is not tokens
    # new buffers; then new descriptors (the corpus, filled to its capacity by the extend,
    # moved as the first step appended); then neither
    assert [step(["s2"]) for _ in range(3)] == [1, 1, 0]


def test_batch_of_five_ragged_equals_one_at_a_time(tok):
    rng = random.Random(7)
    prompts = {
        "e": [],  # empty context
        "a": CASE_A,
        "b": CASE_B[5:],
        "r": [10 + rng.randrange(3) for _ in range(90)],
        "x": [1, 2, 3],  # no repeat: no match
    }
    tenants = {"e": "t1", "a": "t1", "b": "t2", "r": "t2", "x": "t3"}
    store, d = make(tok, batch_budget=False)
    d.open_session("h", "t2", prompt_ids=CASE_A)  # t2 gets a history corpus: ragged rows
    d.close_session("h")
    for sid, p in prompts.items():
        d.open_session(sid, tenants[sid], prompt_ids=p)
    singles = {sid: paths(d.propose([sid])) for sid in prompts}
    order = ["r", "e", "b", "x", "a"]
    draft = d.propose(order)
    check_invariants(draft)
    assert draft.batch_size == 5
    for b, sid in enumerate(order):
        assert paths(draft, b) == singles[sid], sid
    assert singles["e"] == [] and singles["x"] == []
    assert singles["a"] and singles["r"]
    # B = 1 of a non-empty request
    one = d.propose(["a"])
    assert one.batch_size == 1 and paths(one) == singles["a"]


def test_empty_context_gives_empty_draft(tok):
    _, d = make(tok)
    d.open_session("e", "t")
    draft = d.propose(["e"])
    assert draft.num_draft_tokens.tolist() == [0]
    # the node axis is static (max_nodes: no host sync on the node count), all padding
    assert draft.token_ids.shape == (1, d.config.max_nodes)
    assert (draft.token_ids == PAD_ID).all() and (draft.parents == PAD_ID).all()
    # and observe on it commits tokens without a controller update
    d.observe(["e"], torch.tensor([[A]]), torch.tensor([1]), torch.tensor([0]))
    assert float(d.state.scale[d._slot["e"]]) == 1.0


def test_lifecycle_errors(tok):
    _, d = make(tok)
    with pytest.raises(ValueError, match="role"):
        d.open_session("s", "t", role="nobody")
    d.open_session("s", "t")
    with pytest.raises(ValueError, match="already exists"):
        d.open_session("s", "t")
    d.close_session("s")
    with pytest.raises(KeyError, match="unknown or closed"):
        d.propose(["s"])
    with pytest.raises(KeyError):
        d.close_session("s")
    small = Drafter(CorpusStore(tok, TierConfig(use_global=False)), max_batch=2)
    small.open_session("1", "t")
    small.open_session("2", "t")
    with pytest.raises(ValueError, match="max_sessions=2"):
        small.open_session("3", "t")
    small.close_session("1")
    small.open_session("3", "t")  # the slot is reused
    assert small.propose(["2", "3"]).batch_size == 2
    # more open sessions than a step's batch: any max_batch of them per step
    wide = Drafter(CorpusStore(tok, TierConfig(use_global=False)), max_batch=2,
                   max_sessions=4)
    for s in "abcd":
        wide.open_session(s, "t", prompt_ids=tok.encode(f"session {s}: x = 1\nx = 1\n"))
    with pytest.raises(ValueError, match="max_sessions=4"):
        wide.open_session("e", "t")
    with pytest.raises(ValueError, match="max_batch=2"):
        wide.propose(["a", "b", "c"])
    with pytest.raises(ValueError, match="max_batch=2"):
        wide.propose([])
    assert wide.propose(["d", "a"]).batch_size == 2
    with pytest.raises(ValueError, match="max_sessions"):
        Drafter(CorpusStore(tok, TierConfig(use_global=False)), max_batch=2, max_sessions=0)


def test_observe_refuses_bad_counts_before_the_proposal_is_taken(tok):
    """Counts of ``observe`` out of range (a negative or too wide ``num_output``, a negative
    ``num_accepted`` or one deeper than ``max_draft_depth``, rows that are not the batch's,
    host counts that disagree, tensors that are not integer ones: ``path_nodes`` and
    ``num_verified`` too) raise naming the argument, and the proposal stands: a retry
    with good counts commits it."""
    _, d = make(tok)
    ids = tok.encode("def f(x):\n    return x + 1\n\ndef f(x):\n")
    for s in ("a", "b"):
        d.open_session(s, "t", prompt_ids=ids)
    sids = ["a", "b"]
    d.propose(sids)
    out = torch.tensor([[ids[0], ids[1]], [ids[2], -1]], dtype=torch.int32)
    good_n, good_a = torch.tensor([2, 1], dtype=torch.int32), torch.tensor([1, 0],
                                                                         dtype=torch.int32)
    depth = d.config.max_draft_depth
    bad = [
        (dict(num_output=torch.tensor([-1, 1], dtype=torch.int32)), "num_output: counts"),
        (dict(num_output=torch.tensor([3, 1], dtype=torch.int32)), r"num_output: .*\[0, 2\]"),
        (dict(num_accepted=torch.tensor([-2, 0], dtype=torch.int32)), "num_accepted"),
        (dict(num_accepted=torch.tensor([depth + 1, 0], dtype=torch.int32)),
         rf"num_accepted: .*\[0, {depth}\]"),
        (dict(num_output=good_n[:1]), r"num_output: expected an integer tensor \[2\]"),
        (dict(num_accepted=good_a[:, None]), r"num_accepted: expected an integer tensor \[2\]"),
        (dict(output_ids=out[0]), r"output_ids: expected an integer tensor \[2, \*\]"),
        # a float count would reach the arena's host lengths (its next compaction raised,
        # and a close of another tenant's session with it)
        (dict(num_output=good_n.float()), r"num_output: expected an integer tensor"),
        (dict(num_accepted=good_a.float()), "num_accepted"),
        (dict(output_ids=out.float()), "output_ids"),
        (dict(num_output=[2, 1]), r"num_output: expected an integer tensor \[2\], got list"),
        (dict(path_nodes=torch.zeros(2, 3)), "path_nodes: expected an integer tensor"),
        (dict(path_nodes=torch.zeros(3, 3, dtype=torch.int64)), r"path_nodes: .*\[2, \*\]"),
        (dict(num_verified=torch.ones(1, dtype=torch.int32)), r"num_verified: .*\[2\]"),
        (dict(num_output_host=[2, 5]), r"num_output_host: expected 2 counts in \[0, 2\]"),
        (dict(num_output_host=[2]), "num_output_host"),
        (dict(output_ids=out.masked_fill(out == ids[2], 10 ** 7)), "output_ids: token ids"),
    ]
    for change, match in bad:
        kw = dict(output_ids=out, num_output=good_n, num_accepted=good_a) | change
        with pytest.raises(ValueError, match=match):
            d.observe(sids, kw.pop("output_ids"), kw.pop("num_output"), kw.pop("num_accepted"),
                      **kw)
        assert tuple(sids) in d._pending  # nothing was taken
    held = [d.store.arena.corpus_tokens(d.store.session(s).corpus).tolist() for s in sids]
    assert held == [ids, ids]
    d.observe(sids, out, good_n, good_a)
    assert tuple(sids) not in d._pending
    assert [d.store.arena.corpus_tokens(d.store.session(s).corpus).tolist() for s in sids] \
        == [ids + ids[:2], ids + ids[2:3]]


@pytest.mark.parametrize("kwargs", [dict(max_positions=0), dict(max_draft_depth=0),
                                    dict(max_nodes=0), dict(min_match=0),
                                    dict(candidate_slack=-1), dict(min_prob=1.0),
                                    dict(max_scan=0), dict(max_candidate_rows=0),
                                    dict(tier_bonus=(1, 1, 1)), dict(tier_bonus=(0, 0, 0, -1)),
                                    # past what a buffer, a table or an int32 score holds
                                    dict(min_match=2 ** 63), dict(candidate_slack=2 ** 63),
                                    dict(tier_bonus=(2 ** 31 - 1, 0, 0, 0)),
                                    dict(max_nodes=2 * 10 ** 5), dict(max_draft_depth=10 ** 5),
                                    dict(max_positions=10 ** 5), dict(max_scan=2 ** 31)])
def test_drafter_config_validation(kwargs):
    with pytest.raises(ValueError, match="|".join(kwargs)):
        DrafterConfig(**kwargs)


def test_a_min_match_no_corpus_reaches_is_refused(tok):
    """``min_match`` above the corpora's ``max_depth`` would never draft, silently."""
    store = CorpusStore(tok, TierConfig(use_global=False))
    with pytest.raises(ValueError, match="min_match=33 exceeds the corpora's max_depth=32"):
        Drafter(store, DrafterConfig(min_match=33))
    with pytest.raises(ValueError, match="max_batch"):
        Drafter(store, max_batch=True)
    assert Drafter(store, DrafterConfig(min_match=32)).config.min_match == 32


def test_candidate_slack_adds_rows_with_shorter_matches(tok):
    # the session matches "zeta beta gamma" (4 tokens: "z", "eta", " beta", " gamma",
    # continued by " epsilon"); the workspace only " beta gamma" (2 tokens, continued by
    # " delta"): slack 2 adds the latter
    enc = tok.encode
    prompt = enc("zeta") + enc(" beta gamma epsilon") + enc(" omega") + enc("zeta") + \
        enc(" beta gamma")
    eps, delta = enc(" epsilon")[0], enc(" delta")[0]
    store = CorpusStore(tok, TierConfig(use_global=False, forms=(EmissionForm.RAW,)))
    store.add_workspace_file("t", "w.py", "alpha beta gamma delta")
    trees = []
    for slack in (0, 2):
        d = Drafter(store, DrafterConfig(**_SHARES, candidate_slack=slack, batch_budget=False,
                                         max_candidate_rows=None))
        d.open_session(f"s{slack}", "t", prompt_ids=prompt)
        trees.append(d.propose([f"s{slack}"]).token_ids[0].tolist())
        d.close_session(f"s{slack}")
    assert eps in trees[0] and delta not in trees[0]
    assert eps in trees[1] and delta in trees[1]


def test_max_candidate_rows_keeps_the_best_scored_rows(tok):
    # three rows supply candidates at slack 2: the session ("zeta beta gamma", 4 tokens + bonus
    # 2, continued by " epsilon"), the tenant's history (a closed session's "zeta beta gamma
    # theta", 4 + 1) and the workspace (" beta gamma delta", 2 + 2). A cap keeps the
    # best-scored rows; a cap that does not bind leaves the draft exactly as without one.
    enc = tok.encode
    prompt = enc("zeta") + enc(" beta gamma epsilon") + enc(" omega") + enc("zeta") + \
        enc(" beta gamma")
    eps, theta, delta = enc(" epsilon")[0], enc(" theta")[0], enc(" delta")[0]
    drafts = {}
    for cap in (None, 3, 2, 1):
        store = CorpusStore(tok, TierConfig(use_global=False, forms=(EmissionForm.RAW,)))
        store.add_workspace_file("t", "w.py", "alpha beta gamma delta")
        store.open_session("old", "t", enc("zeta") + enc(" beta gamma theta"))
        store.close_session("old")  # its text joins the tenant's history
        d = Drafter(store, DrafterConfig(**_SHARES, candidate_slack=2, batch_budget=False,
                                         max_candidate_rows=cap))
        d.open_session(f"s{cap}", "t", prompt_ids=prompt)
        assert len(store.corpora_of(f"s{cap}")) == 3
        drafts[cap] = d.propose([f"s{cap}"])
    for f in ("token_ids", "parents", "num_draft_tokens", "maybe_source"):
        assert torch.equal(getattr(drafts[3], f), getattr(drafts[None], f)), f
    first = {cap: {t for t, p in zip(dr.token_ids[0].tolist(), dr.parents[0].tolist())
                   if t >= 0 and p == -1} for cap, dr in drafts.items()}
    assert first[None] == {eps, theta, delta}
    assert first[2] == {eps, theta}
    assert first[1] == {eps}


def test_tier_bonus_prefers_the_session_over_a_longer_workspace_match(tok):
    # the session matches " beta gamma" (2 tokens, continued by " epsilon"), the workspace
    # "zeta beta gamma" (4 tokens, continued by " delta"): with a session bonus of 2 over
    # the workspace the two rows tie and both supply candidates; of 3 the session wins alone
    enc = tok.encode
    prompt = enc(" beta gamma epsilon") + enc(" omega") + enc("zeta") + enc(" beta gamma")
    eps, delta = enc(" epsilon")[0], enc(" delta")[0]
    store = CorpusStore(tok, TierConfig(use_global=False, forms=(EmissionForm.RAW,)))
    store.add_workspace_file("t", "w.py", "zeta beta gamma delta")
    got = []
    for bonus in ((0, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0)):
        cfg = {**_SHARES, "tier_bonus": bonus, "batch_budget": False}
        d = Drafter(store, DrafterConfig(**cfg))
        d.open_session(f"s{bonus[0]}", "t", prompt_ids=prompt)
        toks = d.propose([f"s{bonus[0]}"]).token_ids[0].tolist()
        got.append((eps in toks, delta in toks))
        d.close_session(f"s{bonus[0]}")
    assert got == [(False, True), (True, True), (True, False)]


def test_per_step_path_reads_nothing_back_to_the_host(tok, monkeypatch):
    """propose + observe(num_output_host=..., validate=False), the serving loop's step, never
    reads a tensor back to the host (``item``/``tolist``/``bool``/``int``/``float``/
    ``numpy``/``nonzero``), so on a GPU it runs ahead of the device. The match itself is left
    out: on a GPU it is one Triton launch; here it runs the CPU torch path, which may read.
    A level build (every ``tail_tokens`` appended tokens) checks its size on a CPU, a read:
    none happens here (on a GPU a build reads nothing: ``tests/test_index.py``'s meta-device
    build, and ``test_drafter_step_does_not_sync_on_cuda``)."""
    store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=4096))
    d = Drafter(store, DrafterConfig(), max_batch=4)
    text = tok.encode("def f(x):\n    return x + 1\n\n" * 6)
    for i in range(3):
        d.open_session(f"s{i}", "t", prompt_ids=text[: 20 + 7 * i])
    sids = ["s0", "s1", "s2"]
    d.propose(sids)
    d.observe(sids, torch.tensor([[text[20], -1], [text[27], text[28]], [text[34], -1]],
                                 dtype=torch.int32),
              torch.tensor([1, 2, 1], dtype=torch.int32), torch.tensor([0, 1, 0]))
    reads = []

    def forbid(name):
        def f(*a, **k):
            reads.append(name)
            raise AssertionError(f"host read: Tensor.{name}")
        return f

    real_match = drafter_mod.suffix_match
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    inside_match = []

    def match_unguarded(*a, **k):  # the CPU stand-in for the device kernel
        for n, f in saved.items():
            monkeypatch.setattr(torch.Tensor, n, f)
        inside_match.append(True)
        try:
            return real_match(*a, **k)
        finally:
            inside_match.pop()
            for n in names:
                monkeypatch.setattr(torch.Tensor, n, forbid(n))

    def nonzero(*a, **k):  # a data-dependent shape: a device-to-host read on a GPU
        if not inside_match:
            reads.append("nonzero")
        return real_nonzero(*a, **k)

    monkeypatch.setattr(drafter_mod, "suffix_match", match_unguarded)
    real_nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", nonzero)
    for n in names:
        monkeypatch.setattr(torch.Tensor, n, forbid(n))
    try:
        draft = d.propose(sids)
        out = torch.stack([draft.token_ids[:, 0].clamp(min=0), draft.token_ids[:, 0]], 1)
        d.observe(sids, out.to(torch.int32), torch.full((3,), 2, dtype=torch.int32),
                  torch.ones(3, dtype=torch.int32), num_output_host=[2, 2, 2], validate=False)
    finally:
        for n, f in saved.items():
            monkeypatch.setattr(torch.Tensor, n, f)
    assert reads == [], reads
    assert store.arena.corpus_tokens(store.session("s0").corpus).numel() == 20 + 1 + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_graphs_draft_and_commit_what_eager_steps_do_on_cuda(tok):
    """DrafterConfig(cuda_graphs=True) replays propose (after the match) and commit as CUDA
    graphs per batch bucket; drafts and every piece of drafter state equal those of eager
    steps, through buckets with padding, repeated ones, a tenant with a workspace (ragged
    corpora), an arena that grows between steps, and more open sessions than a step takes
    (padding rows write the spare slot ``max_sessions``)."""
    dev = torch.device("cuda")
    code = "def area(r):\n    return 3.14159 * r * r\n\n" * 8 + "print(area(2))\n" * 3
    ids = tok.encode(code)
    ds = []
    for graphs in (True, False):
        store = CorpusStore(tok, TierConfig(tail_tokens=64, use_global=False), device=dev)
        store.add_workspace_file("w", "w.py", code.replace("area", "volume"))
        d = Drafter(store, DrafterConfig(cuda_graphs=graphs), max_batch=8, max_sessions=12)
        assert (d._graphs is not None) == graphs
        for i in range(11):
            d.open_session(f"s{i}", "w" if i % 2 else f"t{i}", prompt_ids=ids[: len(ids) - 3 * i])
        ds.append(d)
    for step, b in enumerate([3, 5, 1, 3, 5, 4, 5, 2]):
        sids = [f"s{(i + 2 * step) % 11}" for i in range(b)]
        drafts = [d.propose(sids) for d in ds]
        for f in ("token_ids", "parents", "num_draft_tokens", "maybe_source"):
            assert torch.equal(getattr(drafts[0], f), getattr(drafts[1], f)), (step, f)
        truth = drafts[0].token_ids[:, :2].clamp(min=0)
        res = teacher_forced_accept(drafts[0], truth)
        n = res.num_accepted.to(torch.int32)
        out = torch.cat([truth, truth[:, :1]], 1).to(torch.int32)  # accepted, then a bonus
        for d in ds:
            d.observe(sids, out, n + 1, n, path_nodes=res.path_nodes if step % 2 else None)
        assert_same_state(*ds, step)
        if step == 3:  # more text than the arena holds: its buffers move
            for d in ds:
                d.extend("s0", ids * 4)
    for g in ds[0]._graphs:
        assert g.graph_error is None
        assert any("graph" in buf for buf in g._buckets.values())


def _two_sessions_on_cuda(tok, tail_tokens: int) -> tuple[CorpusStore, Drafter, list[str]]:
    """A drafter on the GPU (``tail_tokens`` per level build) with two sessions of
    repeated code, ``s0`` and ``s1``."""
    code = "def area(r):\n    return 3.14159 * r * r\n\n" * 8 + "print(area(2))\n" * 3
    ids = tok.encode(code)
    store = CorpusStore(tok, TierConfig(tail_tokens=tail_tokens), device="cuda")
    d = Drafter(store, DrafterConfig(), max_batch=4)
    for i in range(2):
        d.open_session(f"s{i}", "t", prompt_ids=ids[: len(ids) - 5 * i])
    return store, d, ["s0", "s1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tail_tokens", [64, 3])
def test_drafter_step_does_not_sync_on_cuda(tok, tail_tokens):
    """propose + observe (host counts, no validation) queue work without waiting for the GPU:
    under ``torch.cuda.set_sync_debug_mode("error")`` a synchronizing call raises. With a
    3-token tail the checked steps build index levels too (a level's size is counted from
    the separators the arena records, not read back: session 37)."""
    dev = torch.device("cuda")
    store, d, sids = _two_sessions_on_cuda(tok, tail_tokens)

    def step():
        draft = d.propose(sids)
        out = draft.token_ids[:, :1].clamp(min=0).to(torch.int32)  # one emitted token each
        n = torch.ones(2, dtype=torch.int32, device=dev)
        d.observe(sids, out, n, torch.zeros(2, dtype=torch.int32, device=dev),
                  num_output_host=[1, 1], validate=False)
        return draft

    step()  # compiles the match kernel
    torch.cuda.synchronize()
    assert store.arena.num_levels(store.session("s0").corpus) >= 1  # levels are searched too
    corpora = [store.arena._corpora[store.session(sid).corpus] for sid in sids]
    tails = [c.tail_start for c in corpora]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            draft = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(draft.num_draft_tokens.min()) > 0  # the repeated code is drafted
    built = [c.tail_start for c in corpora] != tails  # a level over the tail, or not
    assert built == (tail_tokens == 3)


def test_observe_counts_only_the_verified_nodes_of_a_cut_draft(tok):
    """A loop that cuts the proposal (an opted-out request's cap of 0, a draft fitted to the
    KV pool) passes ``num_verified``: the cut nodes were never verified and count neither as
    drafted nor as reached. Uncut, it changes nothing; cut to nothing, the step drafted
    nothing (tier counts, calibration, the controller's full-acceptance flag)."""
    drafters = [make(tok, calibrate=True)[1] for _ in range(3)]
    sids = ["a", "b"]
    for d in drafters:
        for i, sid in enumerate(sids):
            d.open_session(sid, "t", role="coder", prompt_ids=(CASE_A * 3)[i:])
    drafts = [d.propose(sids) for d in drafters]
    draft = drafts[0]
    assert int(draft.num_draft_tokens.min()) > 0
    out = torch.full((2, draft.max_nodes + 1), PAD_ID, dtype=torch.int32)
    out[:, 0] = 7  # nothing accepted: the bonus token only
    one, zero = torch.ones(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    for d, verified in zip(drafters, (None, draft.num_draft_tokens.clone(), zero)):
        d.observe(sids, out, one, zero, num_verified=verified)
    T = drafter_mod._NUM_TIERS
    n = drafters[0].stats.calib_seen.numel()
    full, same, none = (d.stats.counts for d in drafters)
    assert torch.equal(full, same)
    for a, b in zip(drafters[0]._commit_state(), drafters[1]._commit_state()):
        assert torch.equal(a, b)
    assert full[:T].sum() == int(draft.num_draft_tokens.sum()) > 0  # every node drafted
    assert full[2 * T:2 * T + n].sum() > 0  # the first level reached
    assert none[:T].sum() == 0 and none[2 * T:2 * T + n].sum() == 0
    assert int(drafters[2].state.prev_full.sum()) == 0


def test_a_sessions_context_enters_its_ring_as_the_general_push_leaves_it(tok):
    """``open_session`` / ``extend`` push one session's context: a run as long as the ring
    replaces it in three ops; shorter runs (and an empty prompt) take the general push. The
    ring, its fill and the match cap equal what ``ring_push_torch`` leaves, for runs
    shorter than, equal to and longer than the ring, after a context already there."""
    from agspec_gpu.kernels.drafter_commit import ring_push_torch

    _, d = make(tok)
    D = d.state.recent.shape[1]
    want = [d.state.recent.clone(), d.state.recent_len.clone(), d.state.match_cap.clone()]
    g = torch.Generator().manual_seed(0)
    for i, runs in enumerate(([], [3], [D], [D + 5, 2], [1, D - 1, 3 * D])):
        sid = f"s{i}"
        prompt = torch.randint(0, 1000, (runs[0] if runs else 0,), generator=g).tolist()
        d.open_session(sid, "t", "default", prompt)
        slot = torch.tensor([d._slot[sid]])
        want[0][slot] = 0
        want[1][slot] = 0
        want[2][slot] = d.store.config.max_depth
        ring_push_torch(*want, slot, torch.tensor([prompt], dtype=torch.int32).view(1, -1),
                        torch.tensor([len(prompt)]))
        for m in runs[1:]:
            toks = torch.randint(0, 1000, (m,), generator=g).tolist()
            d.extend(sid, toks)
            ring_push_torch(*want, slot, torch.tensor([toks], dtype=torch.int32),
                            torch.tensor([m]))
        for got, ref in zip((d.state.recent, d.state.recent_len, d.state.match_cap), want):
            assert torch.equal(got[slot], ref[slot]), (runs, got[slot], ref[slot])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tail_tokens", [3, 256])
def test_deferred_commit_does_not_sync_on_cuda(tok, tail_tokens):
    """The overlapped loop's order, observe(defer=True), propose_ahead, then settle with
    the counts the loop read and the next propose, queues work without waiting for the GPU
    and leaves the state a plain observe does. A 3-token tail: settles build levels (and a
    step that could make a build due proposes nothing ahead); 256: every draft proposed
    ahead is the next propose's."""
    dev = torch.device("cuda")
    store, d, sids = _two_sessions_on_cuda(tok, tail_tokens)
    n = torch.ones(2, dtype=torch.int32, device=dev)
    ahead = []

    def step(draft):
        out = draft.token_ids[:, :1].clamp(min=0).to(torch.int32)  # one emitted token each
        d.observe(sids, out, n, torch.zeros(2, dtype=torch.int32, device=dev),
                  validate=False, defer=True)
        early = d._ahead.draft if d.propose_ahead(sids) else None  # before the counts
        d.settle([1, 1])
        nxt = d.propose(sids, stable=False)
        ahead.append(early is not None and nxt is early)
        return nxt

    draft = step(d.propose(sids, stable=False))  # compiles the kernels
    torch.cuda.synchronize()
    cid = store.session("s0").corpus
    n0, tail = store.arena.num_tokens(cid), store.arena._corpora[cid].tail_start
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            draft = step(draft)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert store.arena.num_tokens(cid) == n0 + 4
    # levels built at the settles, or drafts proposed ahead taken
    assert (store.arena._corpora[cid].tail_start > tail) == (tail_tokens == 3)
    assert all(ahead[1:]) if tail_tokens == 256 else not all(ahead[1:])
    assert int(draft.num_draft_tokens.min()) > 0


def _code_drafters(tok, tail_tokens: int, padded: bool, **cfg
                   ) -> tuple[list[Drafter], list[int], dict[str, int]]:
    """Two equal drafters (max_batch 4) over the same six sessions of a code file's
    prefixes (tenants t0, t1; ``padded``: the commit's device half as the CUDA-graph
    buckets run it), the file's ids and each session's position in them."""
    code = ("def area(r):\n    return 3.14159 * r * r\n\n" * 4 +
            "class Box:\n    def __init__(self, w):\n        self.w = w\n" * 3)
    ids = tok.encode(code)
    ds = []
    for _ in range(2):
        store = CorpusStore(tok, TierConfig(use_global=False, tail_tokens=tail_tokens))
        d = Drafter(store, DrafterConfig(**cfg), max_batch=4, max_sessions=6)
        if padded:
            d._graphs = d._step_graphs(use_graphs=False)
        for i in range(6):
            d.open_session(f"s{i}", f"t{i % 2}", prompt_ids=ids[:10 + 3 * i])
        ds.append(d)
    return ds, ids, {f"s{i}": 10 + 3 * i for i in range(6)}


def _teacher_forced_step(drafts: list[DraftBatch], ids: list[int], pos: dict[str, int],
                         sids: list[str], step: int):
    """Checks that both drafters drafted the same; the step's acceptance against the file's
    next tokens, its outputs ``int32 [B, K + 1]`` (accepted, then the bonus), accepted and
    emitted counts."""
    for f in ("token_ids", "parents", "num_draft_tokens", "maybe_source"):
        assert torch.equal(getattr(drafts[0], f), getattr(drafts[1], f)), (step, f)
    K1 = DrafterConfig().max_draft_depth + 1
    truth = torch.tensor([ids[pos[s]:pos[s] + K1] for s in sids], dtype=torch.int32)
    res = teacher_forced_accept(drafts[0], truth)
    nacc = res.num_accepted.to(torch.int32)
    nout = nacc + 1
    out = torch.where(torch.arange(K1)[None, :] < nout[:, None], truth, -1).to(torch.int32)
    return res, out, nacc, nout


@pytest.mark.parametrize("padded", [False, True])
def test_deferred_observe_commits_what_observe_does(tok, padded):
    """observe(defer=True), the commit a loop queues before it reads the step's results,
    then settle(counts): the same state as observe with host counts, step after step, level
    builds included (an 8-token tail: most steps make one due), whether the loop settles at
    once, proposes the same sessions first (the kept descriptors serve the match while the
    host's lengths lag; whole ranges read, so tail and levels sample the same positions),
    or leaves the settle to the next call (which reads the counts back), and when sessions
    keep fewer tokens than the step queued (a request that ended inside it: the plain
    observe gets the cut counts). Padded: the commit's device half as the CUDA-graph
    buckets run it."""
    ds, ids, pos = _code_drafters(tok, 8, padded, max_scan=None)
    plain, deferred = ds
    rng = random.Random(3)
    batches = [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4], [5, 0, 1, 2], [1], [1], [2, 3, 4, 5],
               [2, 3, 4, 5], [0, 5]] * 2
    for step, rows in enumerate(batches):
        sids = [f"s{i}" for i in rows]
        drafts = [d.propose(sids) for d in ds]
        res, out, nacc, nout = _teacher_forced_step(drafts, ids, pos, sids, step)
        queued = nout.tolist()
        mode = step % 4
        # mode 3: a request ends inside the step (EOS, a stop string): it keeps fewer
        counts = [rng.randint(0, q) for q in queued] if mode == 3 else queued
        plain.observe(sids, out, torch.tensor(counts, dtype=torch.int32), nacc,
                      num_output_host=counts, validate=False, path_nodes=res.path_nodes)
        deferred.observe(sids, out, nout.clone(), nacc, validate=False,
                         path_nodes=res.path_nodes, defer=True)
        nout.fill_(0)  # the loop's buffer, reused: the arena holds its own copy
        if mode == 1:  # the next propose of these sessions first, then the settle
            again = [d.propose(sids) for d in ds]
            assert torch.equal(again[0].token_ids, again[1].token_ids), step
            assert deferred.store.arena.unsettled is not None  # nothing read back
        if mode != 2:
            deferred.settle(counts, num_queued_host=queued if mode == 3 else None)
        assert_same_state(plain, deferred, step)
        for s, n in zip(sids, counts):
            pos[s] += n
        if mode != 2:
            for s in sids:  # (and no token past a corpus's end: the cut ones zeroed)
                a, b = (d.store.arena for d in ds)
                ca, cb = (d.store.session(s).corpus for d in ds)
                assert torch.equal(a.corpus_tokens(ca), b.corpus_tokens(cb)), (step, s)
                assert a.num_levels(ca) == b.num_levels(cb), (step, s)
                c = b._corpora[cb]
                assert not b.tokens[c.tok_base + c.n:c.tok_base + c.tok_cap].any(), (step, s)
    # the steps built levels: the session's indexed positions grew past its prompt's
    arena = deferred.store.arena
    assert arena._corpora[deferred.store.session("s1").corpus].tail_start > 13 + 8


def test_deferred_observe_checks_its_arguments(tok):
    store, d = make(tok)
    d.open_session("s0", "t", prompt_ids=CASE_A)
    d.propose(["s0"])
    one = torch.ones(1, dtype=torch.int32)
    out = torch.full((1, 2), A, dtype=torch.int32)
    for kw, msg in ((dict(), "defer: needs validate=False"),
                    (dict(validate=False, num_output_host=[1]), "defer: needs validate=False")):
        args = {"output_ids": out, **kw}
        with pytest.raises(ValueError, match=msg):
            d.observe(["s0"], args.pop("output_ids"), one, one - 1, defer=True, **args)
    n0 = store.arena.num_tokens(store.session("s0").corpus)
    d.observe(["s0"], out, one, one - 1, validate=False, defer=True)
    with pytest.raises(ValueError, match=r"num_output_host: expected 1 counts in \[0, 2\]"):
        d.settle([3])
    assert store.arena.unsettled is not None  # a bad settle changes nothing
    d.settle([1])
    d.settle([1])  # nothing waits: a no-op
    assert store.arena.num_tokens(store.session("s0").corpus) == n0 + 1


def test_deferred_observe_of_a_failed_step_leaves_the_sessions_text(tok):
    """A loop whose step fails after it queued the drafter's commit settles it with no
    token kept (``settle([0] * B, num_queued_host=[M] * B)``, what ``RunningBatch`` does):
    each session's corpus and recent-token ring are as before the step."""
    store, d = make(tok, tier=TierConfig(use_global=False, tail_tokens=4))
    for i in range(3):
        d.open_session(f"s{i}", "t", prompt_ids=CASE_A[i:])
    sids = ["s0", "s1", "s2"]
    draft = d.propose(sids)
    before = [t.clone() for t in (d.state.recent, d.state.recent_len, d.state.match_cap)]
    texts = [store.arena.corpus_tokens(store.session(s).corpus).clone() for s in sids]
    res = teacher_forced_accept(draft, torch.tensor([[X, F1, A]] * 3, dtype=torch.int32))
    out = torch.tensor([[X, F1, A, B]] * 3, dtype=torch.int32)  # accepted, then a bonus
    nacc = res.num_accepted.to(torch.int32)
    d.observe(sids, out, nacc + 1, nacc, validate=False, path_nodes=res.path_nodes,
              defer=True)
    assert int(nacc.sum()) > 0 and not torch.equal(d.state.recent, before[0])  # it was queued
    d.settle([0, 0, 0], num_queued_host=[4, 4, 4])
    for t, b in zip((d.state.recent, d.state.recent_len, d.state.match_cap), before):
        assert torch.equal(t, b)
    for s, text in zip(sids, texts):
        c = store.session(s).corpus
        assert torch.equal(store.arena.corpus_tokens(c), text)
        cc = store.arena._corpora[c]
        assert not store.arena.tokens[cc.tok_base + cc.n:cc.tok_base + cc.tok_cap].any()
    d.observe(sids, out, nacc + 1, nacc, validate=False, defer=True)
    with pytest.raises(ValueError, match="num_queued_host"):  # more kept than queued
        d.settle([1, 1, 1], num_queued_host=[0, 0, 0])
    assert store.arena.unsettled is not None  # a bad settle changed nothing
    d.settle((nacc + 1).tolist())
    assert store.arena.corpus_tokens(store.session("s0").corpus).numel() == \
        texts[0].numel() + int(nacc[0]) + 1


def test_deferred_observe_settled_in_between_cannot_be_cut(tok):
    """A call between observe(defer=True) and settle that needs the corpora settles with
    the queued counts (read back): a later settle that says a session kept fewer raises
    instead of leaving its tokens past its end; one with the queued counts is a no-op. A
    closed session leaves no copy of its ring behind, nor a draft proposed ahead."""
    store, d = make(tok)
    for i in range(2):
        d.open_session(f"s{i}", "t", prompt_ids=CASE_A[i:])
    sids = ["s0", "s1"]
    draft = d.propose(sids)
    res = teacher_forced_accept(draft, torch.tensor([[X, F1, A]] * 2, dtype=torch.int32))
    nacc = res.num_accepted.to(torch.int32)
    out = torch.tensor([[X, F1, A, B]] * 2, dtype=torch.int32)
    d.observe(sids, out, nacc + 1, nacc, validate=False, path_nodes=res.path_nodes,
              defer=True)
    n = store.arena.num_tokens(store.session("s1").corpus)  # settles: a read back
    assert n == len(CASE_A) - 1 + int(nacc[1]) + 1
    with pytest.raises(RuntimeError, match="only a propose of the same sessions"):
        d.settle([1, 1], num_queued_host=(nacc + 1).tolist())
    d.settle((nacc + 1).tolist(), num_queued_host=(nacc + 1).tolist())  # nothing waits
    assert d.state.ring_before.any()  # the commit's copies of the batch's rings
    d.propose(sids)  # (the descriptors current again: the read back moved them)
    d.observe(sids, out, nacc + 1, nacc, validate=False, defer=True)
    assert d.propose_ahead(sids) and d._ahead is not None
    d.close_session("s0")  # (settles first, reading the counts back)
    assert not d.state.ring_before.any() and d._ahead is None
    # ... so s1 can no longer be cut either (its tokens past its end would stay)
    with pytest.raises(RuntimeError, match="only a propose of the same sessions"):
        d.settle([1, 1], num_queued_host=(nacc + 1).tolist())
    d.settle((nacc + 1).tolist(), num_queued_host=(nacc + 1).tolist())


@pytest.mark.parametrize("padded", [False, True])
def test_propose_ahead_drafts_what_a_propose_after_the_settle_does(tok, padded):
    """propose_ahead, right behind a deferred observe (before the loop has the counts),
    then settle, then propose(stable=False): the same drafts and state as observe with host
    counts then propose, step after step. The ahead draft is returned when nothing but
    the settle changed the corpora; not proposed when the settle could build a level; and
    drafted afresh after a cut, another session's append, or a batch of other sessions."""
    ds, ids, pos = _code_drafters(tok, 160, padded)
    plain, ahead = ds
    batches = [[0, 1, 2]] * 6 + [[3, 4]] * 5 + [[5, 0, 1, 2]] * 5 + [[1]] * 4
    used = skipped = 0
    drafts = [d.propose([f"s{i}" for i in batches[0]], stable=False) for d in ds]
    for step, rows in enumerate(batches):
        sids = [f"s{i}" for i in rows]
        res, out, nacc, nout = _teacher_forced_step(drafts, ids, pos, sids, step)
        queued = nout.tolist()
        counts = [max(q - 1, 0) for q in queued] if step == 9 else queued  # a cut: fewer
        plain.observe(sids, out, torch.tensor(counts, dtype=torch.int32), nacc,
                      num_output_host=counts, validate=False, path_nodes=res.path_nodes)
        ahead.observe(sids, out, nout, nacc, validate=False, path_nodes=res.path_nodes,
                      defer=True)
        proposed = ahead.propose_ahead(sids)
        early = ahead._ahead.draft if proposed else None
        ahead.settle(counts, num_queued_host=queued)
        for s, n in zip(sids, counts):
            pos[s] += n
        if step == 13:  # another session's text moves the corpora: the ahead draft is stale
            for d in ds:
                d.extend("s3", ids[:5])
        nxt = [f"s{i}" for i in batches[min(step + 1, len(batches) - 1)]]
        drafts = [d.propose(nxt, stable=False) for d in ds]
        # the state but the match caps: a draft proposed ahead and then not used capped
        # its sessions' next queries at its longest matches (a bound no less tight, so
        # the drafts stay the same: compared every step)
        for name in _STATE:
            if name != "state.match_cap":
                a, b = attrgetter(name)(plain), attrgetter(name)(ahead)
                if name in _PER_SLOT:
                    a, b = a[:plain.max_sessions], b[:ahead.max_sessions]
                assert torch.equal(a, b), (step, name)
        assert set(plain._pending) == set(ahead._pending), step
        hit = drafts[1] is early and early is not None
        assert not hit or (nxt == sids and step not in (9, 13)), step
        used += hit
        skipped += not proposed
    assert used >= 5 and not skipped, (used, skipped)
    # a draft proposed ahead whose session a call in between moved on (an empty extend
    # forgets its proposals) or that a cut made stale is dropped, pending entry and all
    for cut in (False, True):
        draft = ahead.propose(["s2"], stable=False)
        one = torch.ones(1, dtype=torch.int32)
        out = draft.token_ids[:, :2].clamp(min=0).to(torch.int32)
        ahead.observe(["s2"], out, one + 1, one, validate=False, defer=True)
        assert ahead.propose_ahead(["s2"])
        early = ahead._ahead.draft
        ahead.settle([1] if cut else [2], num_queued_host=[2])
        if not cut:
            ahead.extend("s2", [])
        assert ("s2",) not in ahead._pending
        assert ahead.propose(["s2"], stable=False) is not early
    # a session whose tail is a step's tokens from a level build: not proposed ahead
    arena = ahead.store.arena
    c = arena._corpora[ahead.store.session("s1").corpus]
    ahead.extend("s1", ids[:arena.config.tail_tokens - (c.n - c.tail_start) - 10])
    draft = ahead.propose(["s1"], stable=False)
    one = torch.ones(1, dtype=torch.int32)
    out = torch.full((1, ahead.config.max_draft_depth + 1), -1, dtype=torch.int32)
    out[0, 0] = draft.token_ids[0, 0].clamp(min=0)  # one token; a step emits up to 33
    ahead.observe(["s1"], out, one, one - 1, validate=False, defer=True)
    assert not ahead.propose_ahead(["s1"])
    ahead.settle([1])
    assert ahead.propose(["s1"], stable=False) is not draft


def test_a_plain_commit_of_more_sessions_than_max_batch(tok):
    """A commit with no draft (``append_generated``) of more sessions than ``max_batch``
    takes them all (the rings it saves to put back on a failed append are max_batch rows:
    a wider commit saves none rather than failing)."""
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = Drafter(store, DrafterConfig(**_SHARES), max_batch=2, max_sessions=4)
    sids = [f"s{i}" for i in range(3)]
    for s in sids:
        d.open_session(s, "t", "default", [1, 2, 3])
    d.append_generated(sids, torch.tensor([[5], [6], [7]], dtype=torch.int32),
                       torch.tensor([1, 1, 1], dtype=torch.int32))
    assert store.session_lengths(sids) == [4, 4, 4]


def test_a_propose_failing_past_its_grid_rebuild_still_resets_the_stale_match_caps(tok):
    """A propose rebuilt its match grid and recorded its key before resetting the match
    caps of the sessions whose tenant's text had changed: one that raised in between left
    them capped at the old corpora's matches, and the next propose (same key, grid current)
    never reset them, so the new text's longer matches went unseen."""
    text = "for name in sorted(table):\n    print(name, table[name].size)\n"
    drafts = []
    for fail in (False, True):
        store, d = make(tok, tier=TierConfig(use_global=False, tail_tokens=4))
        d.open_session("s0", "t", prompt_ids=tok.encode("x = 1\n" + text[:30]))
        d.propose(["s0"])
        slot = d._slot_of("s0")
        d.state.match_cap[slot] = 1  # the session's own text matched one token at most
        store.add_workspace_file("t", "w.py", text)
        if fail:
            kept = d._kept

            class Failing:
                def get(self, *a):
                    d._kept = kept
                    raise MemoryError("injected: the kept descriptors")

            d._kept = Failing()
            with pytest.raises(MemoryError, match="injected"):
                d.propose(["s0"])
        drafts.append(d.propose(["s0"]))
        assert int(d.state.match_cap[slot]) == 7  # the workspace's match, not the old cap
    assert int(drafts[0].num_draft_tokens[0]) == 7
    for a, b in zip(dataclasses.astuple(drafts[0]), dataclasses.astuple(drafts[1])):
        assert torch.equal(a, b)
