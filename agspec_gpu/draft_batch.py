"""The one draft type: a batch of ragged draft trees as padded device tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agspec_gpu.checks import check_int_tensor
from agspec_gpu.host import HostReader

PAD_ID = -1


@dataclass(frozen=True)
class TreeInputs:
    """One verification forward's inputs for ``B`` draft trees, rows ``[root, nodes]``.

    Attributes:
        input_ids: ``int64 [B, 1+N]`` the root, then the draft tokens (padding nodes: 0).
        position_ids: ``int64 [B, 1+N]`` prefix length + depth (the root's depth is 0).
        tree_mask: ``bool [B, 1+N, 1+N]`` row ``i`` may attend column ``i``'s tree ancestors
            and itself (:meth:`DraftBatch.tree_mask`); every row attends the cached prefix.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tree_mask: torch.Tensor


@dataclass
class DraftBatch:
    """Draft trees for ``B`` requests, padded to ``N`` nodes.

    Nodes of request ``b`` are ``0 .. num_draft_tokens[b]-1`` in topological order
    (a node's parent has a smaller index). Node ``j``'s parent is ``parents[b, j]``,
    ``-1`` for children of the root (the last committed token). A chain is the tree whose
    node ``j`` has parent ``j-1``. Padding slots hold ``PAD_ID`` in both tensors.

    Attributes:
        token_ids: ``int32 [B, N]`` draft tokens, ``PAD_ID`` padded.
        parents: ``int32 [B, N]`` parent node index, ``-1`` for root children, ``PAD_ID`` padded.
        num_draft_tokens: ``int32 [B]`` valid nodes per request (0 = no draft).
        maybe_source: ``int8 [B, N]`` or None: which corpus tier / form proposed each node
            (for per-tier statistics), ``-1`` padded.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    num_draft_tokens: torch.Tensor
    maybe_source: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.token_ids.shape[1]

    def narrowed(self, num_nodes: int) -> "DraftBatch":
        """The first ``num_nodes`` node columns (at least every valid node: callers pass
        ``max(num_draft_tokens)`` or more). A verifier whose cost grows with the padded
        width narrows a drafter's static ``max_nodes`` axis to the batch's widest tree."""
        src = self.maybe_source
        return DraftBatch(self.token_ids[:, :num_nodes], self.parents[:, :num_nodes],
                          self.num_draft_tokens, None if src is None else src[:, :num_nodes])

    def capped(self, max_nodes: int | torch.Tensor) -> "DraftBatch":
        """Each tree cut to its first ``min(num_draft_tokens[b], max_nodes[b])`` nodes: a
        topological prefix, so still a tree; the nodes cut become padding. ``max_nodes``:
        one cap for all, or ``int [B]`` on the draft's device (0 drops a request's draft).
        """
        n = self.num_draft_tokens
        # an int cap is a scalar of the kernel (a tensor of it would be a blocking copy)
        num = n.clamp(max=max_nodes) if isinstance(max_nodes, int) else \
            torch.minimum(n, max_nodes.to(n.device)).to(n.dtype)
        valid = torch.arange(self.max_nodes, device=num.device)[None, :] < num[:, None]
        src = self.maybe_source
        return DraftBatch(torch.where(valid, self.token_ids, PAD_ID),
                          torch.where(valid, self.parents, PAD_ID), num,
                          None if src is None else torch.where(valid, src, -1).to(src.dtype))

    def checked_sizes(self, vocab_size: int, reader: HostReader | None = None,
                      max_depth: int | None = None) -> list[int]:
        """``num_draft_tokens`` on the host, in one read (through ``reader`` when given) that
        also checks the trees: every size in ``[0, N]``, every draft token in ``[0,
        vocab_size)``, every parent an earlier node or the root (``-1 <= parents[b, j] <
        j``) and, with ``max_depth``, no node deeper than it (a drafter commits at most its
        ``max_draft_depth`` accepted tokens a step); ValueError naming
        ``draft.num_draft_tokens``, ``draft.token_ids``, ``draft.parents`` or ``draft`` if
        not."""
        cols = torch.arange(self.max_nodes, device=self.token_ids.device)[None, :]
        valid = cols < self.num_draft_tokens[:, None]
        par_ok = (self.parents >= -1) & (self.parents < cols)
        too_deep = torch.zeros((), dtype=torch.bool, device=valid.device)
        if max_depth is not None and max_depth < self.max_nodes:  # (N nodes: depth <= N)
            # a node deeper than max_depth has a max_depth-th ancestor node: found by
            # binary lifting (log2(max_depth) hops of the whole tree, not N); a bad parent
            # (reported first) is taken as the root
            hop = torch.where(valid & par_ok, self.parents, -1).long()  # the 1st ancestor
            at = cols.expand_as(hop).long()  # each node's k-th ancestor, k = 0 first
            k = max_depth
            while k:
                if k & 1:
                    at = torch.where(at >= 0, hop.gather(1, at.clamp(min=0)), -1)
                k >>= 1
                if k:
                    hop = torch.where(hop >= 0, hop.gather(1, hop.clamp(min=0)), -1)
            too_deep = (valid & (at >= 0)).any()
        flags = torch.stack([
            ((self.num_draft_tokens < 0) | (self.num_draft_tokens > self.max_nodes)).any(),
            (valid & ((self.token_ids < 0) | (self.token_ids >= vocab_size))).any(),
            (valid & ~par_ok).any(), too_deep]).int()
        # int32, the sizes' contract dtype and the reader's: no conversion on the way
        both = torch.cat([self.num_draft_tokens.to(torch.int32), flags])
        *num, bad_num, bad_tok, bad_par, too_deep = both.tolist() if reader is None else \
            reader.read(both)[0]
        if bad_num:
            raise ValueError(f"draft.num_draft_tokens: sizes must be in [0, {self.max_nodes}]"
                             f", got {num}")
        if bad_tok:
            raise ValueError("draft.token_ids: a draft token is outside the model's vocabulary")
        if bad_par:
            raise ValueError("draft.parents: a node's parent must be an earlier node or -1 "
                             "(the root): parents[b, j] in [-1, j)")
        if too_deep:
            raise ValueError(f"draft: a node is deeper than the drafter's max_draft_depth="
                             f"{max_depth} (a step accepts at most that many draft tokens)")
        return num

    def depths(self) -> torch.Tensor:
        """``int32 [B, N]``: 1 for root children, parent depth + 1 below; 0 for padding."""
        B, N = self.token_ids.shape
        depth = torch.zeros(B, N, dtype=torch.int32, device=self.token_ids.device)
        valid = torch.arange(N, device=depth.device)[None, :] < self.num_draft_tokens[:, None]
        par = self.parents.long().clamp(min=0)
        # topological order: one pass of N gathers is exact; N is small (<= a few hundred)
        for j in range(N):
            pd = torch.where(self.parents[:, j] >= 0, depth.gather(1, par[:, j:j + 1])[:, 0], 0)
            depth[:, j] = torch.where(valid[:, j], pd + 1, 0)
        return depth

    def tree_mask(self) -> torch.Tensor:
        """``bool [B, 1+N, 1+N]``: row ``i`` may attend column ``k`` within ``[root, nodes]``.

        Index 0 is the root, ``1 + j`` node ``j``. A valid node sees the root, its ancestors
        and itself; the root and padding slots see only themselves (no row is empty).
        """
        B, N = self.token_ids.shape
        dev = self.token_ids.device
        attend = torch.eye(1 + N, dtype=torch.bool, device=dev).repeat(B, 1, 1)
        valid = torch.arange(N, device=dev)[None, :] < self.num_draft_tokens[:, None]
        parent_col = (self.parents.long() + 1).clamp(min=0)  # root children -> column 0
        rows = torch.arange(B, device=dev)
        # topological order: a parent's row is complete before its children copy it
        for j in range(N):
            attend[:, 1 + j] |= attend[rows, parent_col[:, j]] & valid[:, j:j + 1]
        return attend

    def tree_inputs(self, root_ids: torch.Tensor, prefix_lens: torch.Tensor) -> "TreeInputs":
        """The inputs of one verification forward over ``[root, node_0, ..., node_{N-1}]``.

        Args:
            root_ids: ``int [B]`` each request's last committed token (not in its KV yet).
            prefix_lens: ``int [B]`` tokens in each request's KV (the context but the root).

        Returns:
            :class:`TreeInputs` on the draft's device; every row also attends its request's
            whole cached prefix.
        """
        B, N = self.token_ids.shape
        dev = self.token_ids.device
        if tuple(root_ids.shape) != (B,) or tuple(prefix_lens.shape) != (B,):
            raise ValueError(f"root_ids, prefix_lens: expected shape [{B}], got "
                             f"{list(root_ids.shape)} and {list(prefix_lens.shape)}")
        valid = torch.arange(N, device=dev)[None, :] < self.num_draft_tokens[:, None]
        # padding nodes get token 0: any valid id; their rows and keys are never used
        tokens = torch.where(valid, self.token_ids.long(), 0)
        ids = torch.cat([root_ids.to(dev).long()[:, None], tokens], 1)
        depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev),
                           self.depths().long()], 1)
        return TreeInputs(ids, prefix_lens.to(dev).long()[:, None] + depth, self.tree_mask())

    @staticmethod
    def from_host(drafts: "list[tuple[list[int], list[int]]]", device: torch.device | str = "cpu"
                  ) -> "DraftBatch":
        """Pads host drafts, one ``(token_ids, parents)`` pair of lists per request (padded
        on the host with numpy, then one tensor each: per-row torch ops cost microseconds)."""
        B = len(drafts)
        N = max((len(t) for t, _ in drafts), default=0)
        tok = np.full((B, N), PAD_ID, dtype=np.int32)
        par = np.full((B, N), PAD_ID, dtype=np.int32)
        num = np.zeros(B, dtype=np.int32)
        for b, (t, p) in enumerate(drafts):
            if len(t):
                num[b] = len(t)
                tok[b, :len(t)] = t
                par[b, :len(p)] = p
        return DraftBatch(*(torch.from_numpy(x).to(device) for x in (tok, par, num)))

    @staticmethod
    def from_lists(trees: list[list[tuple[int, int]]], device: torch.device | str = "cpu"
                   ) -> "DraftBatch":
        """Builds a batch from host lists of ``(token_id, parent)`` per request (tests, demos)."""
        B = len(trees)
        N = max([len(t) for t in trees] + [1])
        tok = torch.full((B, N), PAD_ID, dtype=torch.int32)
        par = torch.full((B, N), PAD_ID, dtype=torch.int32)
        for b, t in enumerate(trees):
            for j, (tid, p) in enumerate(t):
                if not -1 <= p < j:
                    raise ValueError(f"trees[{b}][{j}]: parent {p} is not an earlier node or -1")
                tok[b, j], par[b, j] = tid, p
        num = torch.tensor([len(t) for t in trees], dtype=torch.int32)
        return DraftBatch(tok.to(device), par.to(device), num.to(device))


def check_draft(draft: Any, num_sessions: int, max_nodes: int | None = None) -> None:
    """``draft`` is a :class:`DraftBatch` of one tree per session, of integer tensors
    whose shapes agree, at most ``max_nodes`` wide (the drafter's: its commit buffers hold
    no more); ValueError naming ``draft`` (or its field) if not. The values are
    :meth:`DraftBatch.checked_sizes`' to check, in its one device read."""
    if not isinstance(draft, DraftBatch):
        raise ValueError(f"draft: expected the DraftBatch of propose(), got "
                         f"{type(draft).__name__}")
    for name in ("token_ids", "parents", "num_draft_tokens"):
        check_int_tensor(getattr(draft, name), f"draft.{name}",
                         ("B",) if name == "num_draft_tokens" else ("B", "N"))
    if draft.parents.shape != draft.token_ids.shape or \
            draft.num_draft_tokens.shape[0] != draft.token_ids.shape[0]:
        raise ValueError(f"draft: token_ids {list(draft.token_ids.shape)}, parents "
                         f"{list(draft.parents.shape)} and num_draft_tokens "
                         f"{list(draft.num_draft_tokens.shape)} disagree")
    if draft.token_ids.shape[0] != num_sessions:
        raise ValueError(f"draft: batch {draft.token_ids.shape[0]} != {num_sessions} "
                         f"session_ids")
    if max_nodes is not None and draft.max_nodes > max_nodes:
        raise ValueError(f"draft: {draft.max_nodes} node columns, past the drafter's "
                         f"max_nodes={max_nodes}")
