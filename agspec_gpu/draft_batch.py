"""The one draft type: a batch of ragged draft trees as padded device tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_ID = -1


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
