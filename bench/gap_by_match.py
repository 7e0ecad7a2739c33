"""Where agspec's tau falls short of the oracle bound: per step, by the drafter's match length.

At every step of the agspec lane (teacher-forced greedy, as ``agspec-gpu replay``), the
oracle's answer at the same position and over the same corpora (the longest prefix of the true
continuation, at most ``k`` tokens, found in any corpus the request may search) is computed
next to what agspec accepted. Steps are grouped by the longest context match the drafter found
(``0`` = no match: no draft). Per group: the share of steps, agspec's accepted tokens per step,
the oracle's, the tokens drafted, the deepest node, and the group's share of the missing
tokens (oracle minus accepted, summed). This says where a better drafter could gain: at copy
starts (short matches: the context does not say where the copy comes from) or inside copies
(long matches: the draft was cut short or diverged).

Two bounds in between decompose the gap. ``ctx``: the longest agreement with the truth among
the continuations of up to ``--all-positions`` most recent occurrences of each tier's longest
context match (what a drafter matching the context, as agspec does, could at best pick).
``top8``: the same among the 8 most recent per tier, the drafter's own candidates (what
its tree, depth and budget could at best keep). ``first``: the agreement of the single
candidate the drafter ranks first (the most recent occurrence in the tier with the longest
match plus tier bonus), i.e. one chain drafted to full depth. oracle - ctx is out of reach of
context matching; ctx - top8 is ranking; top8 - acc is the tree, depth and budget. Each
tau counts a step's accepted tokens and its bonus, never past the message's end, as the
replay's tau does (before session 54 this script counted a bonus past it too: its figures
in ``bench/results`` up to then read 0-1% high).

Usage::

    python bench/gap_by_match.py --global dev-half0.agspec --half 1 [--sessions N]
        [--max-target-tokens T] [--batch-size B] [--k 32] [--cost-model FILE]
        [--json out.json]

``--cost-model``: the batch budget steers by this verification cost (a GPU run's calibrated
file, e.g. ``bench/results/cost-llama3-8b-h100-80gb-hbm3-20261205.json``: each step by the
curve measured at the smallest batch at or above its bucket); default the built-in
estimate.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from agspec_gpu.cost_model import BatchCostModels, CostModel
from agspec_gpu.draft_batch import PAD_ID
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.kernels.suffix_match import suffix_match
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.replay_lanes import BatchedLane
from agspec_gpu.tiers import CorpusStore, TierConfig, load_global_corpus, session_half
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths

from bench_drafter import DEV, FILES, cut

BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 1 << 30))


class GapLane(BatchedLane):
    """The agspec lane, recording per step (match length, drafted, depth, accepted, oracle)."""

    def __init__(self, *args, k: int, all_positions: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.k = k
        self.all_positions = all_positions
        self.records: list[np.ndarray] = []
        propose = self.drafter.propose  # the step's draft, kept for its depths

        def keep(sids, **kw):
            self._draft = propose(sids, **kw)
            return self._draft

        self.drafter.propose = keep

    def _context_bounds(self, sids, slots, qlen, cont) -> tuple[np.ndarray, np.ndarray]:
        """(ctx, top8) ``int64 [B]``: the longest agreement of ``cont`` with the continuation
        of an occurrence of each tier's longest match, over up to ``all_positions`` / 8 most
        recent occurrences per tier."""
        d, store = self.drafter, self.store
        req, cids = [], []
        for b, sid in enumerate(sids):
            for _, cid in store.corpora_of(sid):
                req.append(b)
                cids.append(cid)
        req = torch.tensor(req)
        arena = store.arena
        desc = arena.descriptors(cids)
        m = suffix_match(arena.tokens, arena.sa, desc, d.state.recent[slots][req].contiguous(),
                         qlen[req].contiguous(), max_depth=store.config.max_depth,
                         max_positions=self.all_positions)
        pos = m.positions  # [R, P] corpus relative, -1 padded
        j = torch.arange(self.k)
        at = pos[:, :, None] + j
        ok = (pos[:, :, None] >= 0) & (at < desc.num_tokens.to(torch.int64)[:, None, None])
        win = torch.take(arena.tokens, torch.where(ok, desc.tok_base[:, None, None] + at, 0))
        eq = ok & (win == cont[req][:, None, :]) & (cont[req][:, None, :] >= 0)
        agree = torch.cumprod(eq.to(torch.int64), 2).sum(2)  # [R, P]
        B = len(sids)
        out = []
        for n in (self.all_positions, 8):
            best = agree[:, :n].max(dim=1).values
            out.append(torch.zeros(B, dtype=torch.int64).scatter_reduce(
                0, req, best, reduce="amax").numpy())
        # the first candidate: the most recent occurrence in the row of the longest match
        # (the drafter's tier bonus added), the earlier row on ties
        tiers = torch.tensor([int(t) for sid in sids for t, _ in store.corpora_of(sid)])
        score = torch.where(m.length > 0, m.length + d._tier_bonus[tiers], -1).to(torch.int64)
        R = req.numel()
        key = score * R - torch.arange(R)  # larger score, then the earlier row
        top = torch.full((B,), -(1 << 62), dtype=torch.int64).scatter_reduce(0, req, key,
                                                                           reduce="amax")
        is_top = key == top[req]
        first = torch.zeros(B, dtype=torch.int64).scatter_reduce(
            0, req, torch.where(is_top, agree[:, 0], 0), reduce="amax").numpy()
        return out[0], out[1], first

    def step(self, sids, contexts, truth, remaining):
        d = self.drafter
        slots = torch.tensor([d._slot_of(s) for s in sids])
        qlen = torch.minimum(d.state.recent_len[slots], d.state.match_cap[slots])  # propose's query
        res = super().step(sids, contexts, truth, remaining)
        match = d.state.match_cap[slots].numpy().astype(np.int64)
        depth = self._draft.depths().max(dim=1).values.numpy().astype(np.int64)
        cont = torch.from_numpy(truth(self.k, PAD_ID))
        oracle = self.store.oracle_prefix_len(sids, cont).numpy().astype(np.int64)
        ctx, top8, first = self._context_bounds(sids, slots, qlen, cont)
        acc = np.minimum(res.num_accepted, remaining)
        self.records.append(np.stack([match, res.num_drafted, depth, acc,
                                      np.minimum(oracle, remaining),
                                      np.minimum(ctx, remaining),
                                      np.minimum(top8, remaining),
                                      np.minimum(first, remaining), remaining], 1))
        return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=12, help="sessions per dev file (12)")
    p.add_argument("--max-target-tokens", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--k", type=int, default=32, help="oracle depth cap (32)")
    p.add_argument("--all-positions", type=int, default=1024,
                   help="occurrences per tier for the ctx bound (1024)")
    p.add_argument("--global", dest="global_corpus")
    p.add_argument("--half", type=int, choices=(0, 1))
    p.add_argument("--cost-model", help="a calibrated cost file (default: the estimate)")
    p.add_argument("--json")
    args = p.parse_args()
    # every curve the file measured: a step steers by its bucket's, as the e2e's does
    cost = BatchCostModels.from_json(args.cost_model) \
        if args.cost_model else CostModel.default()
    torch.set_num_threads(1)
    tok = load_tokenizer("cl100k")
    gc = load_global_corpus(args.global_corpus, tok) if args.global_corpus else None
    out = {"config": vars(args), "files": {}}
    t0 = time.time()
    for f in FILES:
        ss = [s for s in load_paths([DEV + f])
              if args.half is None or session_half(s.task_id) == args.half][:args.sessions]
        if gc is not None:
            gc.check_disjoint(s.task_id for s in ss)
        corpus = tokenize_sessions([cut(s, args.max_target_tokens, tok) for s in ss], tok)
        lanes = []

        def make():
            store = CorpusStore(tok, TierConfig(), global_corpus=gc)
            lane = GapLane("agspec", Drafter(store, DrafterConfig(), max_batch=args.batch_size,
                                             cost=cost),
                           store, "cpu", k=args.k, all_positions=args.all_positions)
            lanes.append(lane)
            return lane

        run_replay(corpus, [("agspec", make)], tok,
                   ReplayConfig(batch_size=args.batch_size, oracle=False))
        rec = np.concatenate(lanes[0].records)
        match, drafted, depth, acc, orc, ctx, top8, first, rem = rec.T

        def tau(accepted: np.ndarray) -> float:
            """Tokens per step as the replay counts them: the accepted and the bonus, not
            past the message's end (no bonus after its last token)."""
            return float(np.minimum(accepted + 1, rem).mean())

        gap_total = max(int((orc - acc).clip(min=0).sum()), 1)
        rows = []
        print(f"\n{f}: {len(ss)} sessions, {len(rec)} steps, agspec tau "
              f"{tau(acc):.2f}; at the same steps: first {tau(first):.2f}, "
              f"top8 {tau(top8):.2f}, ctx {tau(ctx):.2f}, oracle {tau(orc):.2f}")
        print(f"{'match':>7} {'steps':>6} {'acc':>6} {'first':>6} {'top8':>6} {'ctx':>6} "
              f"{'oracle':>6} "
              f"{'drafted':>7} {'depth':>6} {'gap share':>9}")
        for lo, hi in BUCKETS:
            sel = (match >= lo) & (match <= hi)
            if not sel.any():
                continue
            row = {"match_lo": lo, "match_hi": hi, "step_share": float(sel.mean()),
                   "accepted": float(acc[sel].mean()), "oracle": float(orc[sel].mean()),
                   "ctx": float(ctx[sel].mean()), "top8": float(top8[sel].mean()),
                   "first": float(first[sel].mean()),
                   "drafted": float(drafted[sel].mean()), "depth": float(depth[sel].mean()),
                   "gap_share": float((orc[sel] - acc[sel]).clip(min=0).sum() / gap_total)}
            rows.append(row)
            name = f"{lo}" if lo == hi else f"{lo}-{hi if hi < 1 << 20 else ''}"
            print(f"{name:>7} {row['step_share']:6.1%} {row['accepted']:6.2f} "
                  f"{row['first']:6.2f} {row['top8']:6.2f} {row['ctx']:6.2f} "
                  f"{row['oracle']:6.2f} {row['drafted']:7.2f} {row['depth']:6.2f} "
                  f"{row['gap_share']:9.1%}")
        out["files"][f] = {"steps": len(rec), "tau": tau(acc),
                           "top8_tau_same_steps": tau(top8),
                           "first_tau_same_steps": tau(first),
                           "ctx_tau_same_steps": tau(ctx),
                           "oracle_tau_same_steps": tau(orc), "rows": rows}
    out["wall_seconds"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
