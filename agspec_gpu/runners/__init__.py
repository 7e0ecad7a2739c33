"""Target-model runners.

- :mod:`agspec_gpu.runners.hf`: a Hugging Face model run as-is (reference, CPU-friendly);
- :mod:`agspec_gpu.runners.paged`: a compact Llama/Qwen2 forward over the paged KV cache with
  tree attention (FlashInfer on GPU);
- :mod:`agspec_gpu.runners.paged_batch`: a batch on the paged runner behind the HF runner's
  prefill / verify / commit interface (what ``SpecDecoder(runner="paged")`` drives);
- :mod:`agspec_gpu.runners.graphs`: CUDA-graph plain decode steps of the paged runner;
- :mod:`agspec_gpu.runners.verify_graphs`: CUDA-graph tree-verification steps of the paged
  runner, padded to (requests, rows) buckets.
"""

from agspec_gpu.runners.hf import HFRunner
from agspec_gpu.runners.paged import ModelShape, PagedLlamaRunner

__all__ = ["HFRunner", "ModelShape", "PagedLlamaRunner"]
