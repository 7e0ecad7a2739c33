"""The drafter's device state on its own: the slots' rings and the learned statistics."""

import torch

from agspec_gpu.drafter_state import DraftStats, SlotState


def test_stats_prior_is_a_fixed_point_and_counts_decay_towards_it():
    T, L, K = 4, 6, 3
    s = DraftStats(T, L, K, "cpu")
    assert s.tables.numel() == 2 * T + 2 * (2 * T * (L + 1) * K)
    assert torch.equal(s.tier_hits / s.tier_drafts, torch.full((T,), 0.5, dtype=torch.float64))
    match = torch.arange(L + 1, dtype=torch.float64)
    want = ((match + 1) / (match + 3))[:, None].expand(L + 1, K).repeat(2 * T, 1)
    assert torch.allclose(s.calib_hits / s.calib_seen, want)
    prior = s.tables.clone()
    for _ in range(5):  # no observations: the prior stays
        s.zero_counts()
        s.fold()
    assert torch.allclose(s.tables, prior, rtol=0, atol=1e-12)
    drafted, hits, seen, accepted = s.zero_counts()
    assert drafted.numel() == hits.numel() == T and seen.shape == accepted.shape == (
        2 * T * (L + 1) * K,)
    drafted[1] += 10.0  # tier 1 drafted 10 nodes, none accepted
    seen[0] += 4.0  # mode 0, tier 0, match 0, depth 0 reached 4 times, accepted 4
    accepted[0] += 4.0
    s.fold()
    assert float(s.tier_drafts[1]) == 2.0 * s.TIER_DECAY + 10.0 + 2.0 * (1 - s.TIER_DECAY)
    assert float(s.tier_hits[1] / s.tier_drafts[1]) < 0.1
    assert float(s.calib_hits[0, 0] / s.calib_seen[0, 0]) > float(want[0, 0])
    assert torch.equal(s.tables[2:T], prior[2:T])  # other tiers untouched
    for _ in range(3000):  # unobserved, the tier's weight returns to its prior
        s.zero_counts()
        s.fold()
    assert abs(float(s.tier_hits[1] / s.tier_drafts[1]) - 0.5) < 1e-6


def test_slots_push_save_and_restore():
    D = 5
    st = SlotState(4, D, max_batch=2, device="cpu")
    st.open(1, initial_scale=0.5, draft_cap=3)
    assert (int(st.recent_len[1]), int(st.match_cap[1]), float(st.scale[1]), int(st.cap[1])) \
        == (0, D, 0.5, 3)
    st.push_one(1, torch.tensor([7, 8], dtype=torch.int32))  # shorter than the ring
    assert st.recent[1, -2:].tolist() == [7, 8] and int(st.recent_len[1]) == 2
    st.push_one(2, torch.arange(10, 20, dtype=torch.int32))  # longer: its last D tokens
    assert st.recent[2].tolist() == list(range(15, 20)) and int(st.recent_len[2]) == D
    slots = torch.tensor([2, 1])
    st.save_rings(slots)
    saved = st.recent.clone(), st.recent_len.clone()
    st.push(slots, torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
            torch.tensor([3, 1]))
    assert st.recent[2].tolist() == [18, 19, 1, 2, 3] and st.recent[1, -3:].tolist() == [7, 8, 4]
    # request 0 (slot 2) kept one token of the three: its ring as before, then that one
    st.restore_rings(torch.tensor([0]), torch.tensor([2]),
                     torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([1]))
    assert st.recent[2].tolist() == [16, 17, 18, 19, 1]
    assert torch.equal(st.recent_len[2], saved[1][2])
    st.clear(2)  # no text outlives its session
    assert not st.recent[2].any() and int(st.recent_len[2]) == 0 and not st.ring_before.any()
    assert st.recent[1, -3:].tolist() == [7, 8, 4]  # the other session's ring kept
