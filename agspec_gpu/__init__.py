"""agspec_gpu: a GPU-resident retrieval drafter for speculative decoding in coding agents."""

from agspec_gpu.draft_batch import PAD_ID, DraftBatch

__all__ = ["PAD_ID", "DraftBatch"]
__version__ = "0.1.0"
