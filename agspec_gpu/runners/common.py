"""What every verifier checks before a tree step (HF runner and paged batch alike)."""

from __future__ import annotations

import torch

from agspec_gpu.draft_batch import DraftBatch


def check_verify_call(draft: DraftBatch, root_ids: torch.Tensor, *, batch_size: int,
                      has_batch: bool, pending: bool) -> tuple[int, int]:
    """Raises ValueError naming the argument for a verify call that cannot run; ``(B, N)``.

    ``has_batch``: a prefill started the batch; ``pending``: a verify awaits its commit.
    """
    if not has_batch:
        raise ValueError("no batch: call prefill() first")
    if pending:
        raise ValueError("verify() called twice without commit()")
    B, N = draft.token_ids.shape
    if B != batch_size:
        raise ValueError(f"draft: batch {B} != prefilled batch {batch_size}")
    if root_ids.shape != (B,):
        raise ValueError(f"root_ids: expected [{B}], got {list(root_ids.shape)}")
    return B, N
