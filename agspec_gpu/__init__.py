"""agspec_gpu: a GPU-resident retrieval drafter for speculative decoding in coding agents."""

from agspec_gpu.accept import SamplingParams
from agspec_gpu.controller import ControllerConfig, RoleProfile
from agspec_gpu.decoder import SpecDecoder
from agspec_gpu.decoder_config import DecoderConfig
from agspec_gpu.draft_batch import PAD_ID, DraftBatch, TreeInputs
from agspec_gpu.drafter import Drafter
from agspec_gpu.drafter_config import DrafterConfig
from agspec_gpu.kv_cache import KVCacheFull
from agspec_gpu.requests import SessionStats, StepOutput
from agspec_gpu.tiers import CorpusStore, CorpusTier, TierConfig

__all__ = ["PAD_ID", "ControllerConfig", "CorpusStore", "CorpusTier", "DecoderConfig",
           "DraftBatch", "Drafter", "DrafterConfig", "KVCacheFull", "RoleProfile",
           "SamplingParams", "SessionStats", "SpecDecoder", "StepOutput", "TierConfig",
           "TreeInputs"]
__version__ = "0.1.0"
