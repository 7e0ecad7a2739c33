"""DecoderConfig: the settings of a :class:`~agspec_gpu.decoder.SpecDecoder`, checked when made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agspec_gpu.checks import (check_at_most, check_bool_fields, check_instance_field,
                               check_int_fields)
from agspec_gpu.cost_model import BatchCostModels, CostModel
from agspec_gpu.drafter_config import DrafterConfig
from agspec_gpu.tiers import TierConfig


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Decoder settings: tiers, drafting, the largest batch a step runs, the runner.

    Attributes:
        max_batch: the most sessions of one ``propose`` step, and the most requests that
            a ``generate`` call or ``step`` runs at once (the rest wait their turn); at
            most 4096.
        max_sessions: the most concurrently open sessions, idle ones included (an agent
            waiting on a tool keeps its session, its corpus and its kept KV); None: ``4 *
            max_batch``; at most 2**20. Each open session holds a drafter state slot (a few
            hundred bytes) and, with ``runner="paged"``, a page-table row (``4 *
            kv_cache_tokens / page_size`` bytes).
        runner: ``"hf"`` runs the model's own forward (any HF causal LM, a DynamicCache);
            ``"paged"`` converts a Llama/Qwen2-family model once into a
            :class:`~agspec_gpu.runners.paged.PagedLlamaRunner` (paged KV, FlashInfer tree
            attention on a GPU) with a KV pool of ``kv_cache_tokens`` slots in pages of
            ``page_size``. With either runner each session keeps its KV between ``generate``
            calls (a call prefills only the tokens appended since) until ``close_session``
            frees it; ``paged``: a call that needs pages frees idle sessions' KV, least
            recently generated first, a step short of pages verifies shorter drafts, then
            preempts its newest requests (``admission``), and
            :class:`~agspec_gpu.kv_cache.KVCacheFull` (naming ``kv_cache_tokens``) ends a
            request that cannot get one more slot alone (a step's root: with no draft
            node, a plain decoding step); ``hf``: the sessions keep at most
            ``kv_cache_tokens`` tokens of KV in all (the least recently generated are
            freed first), each in tensors of its own between calls.
        cuda_graphs: with ``runner="paged"`` on a GPU with FlashInfer, every verification
            step (a plain decode step too) replays a CUDA graph of its padded (requests,
            rows) bucket (:class:`~agspec_gpu.runners.verify_graphs.VerifyGraphs`, captured
            when the decoder is built, for batches of 1, 2, 4, ... up to ``max_batch``; the
            buckets write their logits into one buffer of the largest bucket's
            ``max_batch * (1 + max_nodes) + 1`` rows, ~1.07 GB in bf16 at max_batch 64, 64
            nodes and a 128K vocabulary);
            False launches every step eagerly, as does a GPU without FlashInfer or a
            failed capture (:attr:`SpecDecoder.verify_graph_error` says why).
        profiles: a role-profile file from ``agspec-gpu profile``: its roles join the
            drafter's (``DrafterConfig.roles``), a role of the same name replaced (its draft
            cap; the built-in initial scale kept). ``agspec-gpu profile`` names its roles
            after the agent formats it measured (``mini-swe-agent``, ``swe-agent``,
            ``aider``) plus ``default``: open a session with such a role to draft with its
            measured cap.
        cost_model: what the batch budget steers by: verification time against tokens per
            step on your model and GPU. A calibration file (``bench/bench_e2e.py --model
            ... --calibrate`` writes ``cost-<model>-<gpu>-<date>.json``, a curve per batch size:
            a step steers by its bucket's, :class:`~agspec_gpu.cost_model.BatchCostModels`),
            a :class:`~agspec_gpu.cost_model.CostModel` or ``BatchCostModels`` (e.g.
            :meth:`SpecDecoder.calibrate_cost_model`'s), or None: the built-in estimate (an
            8B bf16 model on an H200), which prices another model or GPU wrong.
        admission: ``runner="paged"``: when a waiting request joins the running batch
            (:mod:`~agspec_gpu.scheduler`). ``"reserve"``: once the KV pool holds it and
            the running requests to their ``max_new_tokens`` (a batch never outgrows the
            pool); ``"optimistic"``: once it holds their contexts and one step, more
            requests at once when most end well before their limits; a batch that outgrows
            the pool preempts its newest requests (they wait again, their KV kept until
            the pages are needed, then recomputed). Either way a step short of pages
            preempts rather than fails while more than one request runs.
        tree_attention: ``runner="paged"``: how a verification step attends to its trees.
            ``"split"``: each row over its prefix unmasked (FlashInfer's fast path), its
            tree apart, the two merged by their log-sum-exps (:mod:`agspec_gpu.attention`);
            ``"custom"``: one batch prefill with FlashInfer's packed custom mask, whose
            mask is its slow path (1.3 TB/s of an H100's 3.35 at B = 64 over 4,096-token
            prefixes). Both compute the same attention (the CPU tests compare them).
        max_model_len: the most tokens a session's context may hold (prompt, appended
            messages and generated tokens), as a serving engine's ``max_model_len``; None:
            the model's (its config's ``max_position_embeddings``, with a ``yarn`` or
            ``linear`` RoPE scaling factor:
            :func:`~agspec_gpu.runners.common.model_max_length`; no limit when the config
            names none); a value past the model's is refused. A prompt or an
            ``append`` past it raises ValueError; a request ends with ``"length"`` when
            its context is full, and no draft reaches past it (a model with learned
            positions, such as GPT-2, cannot embed a position past its table).
    """

    tiers: TierConfig = field(default_factory=TierConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    max_batch: int = 64
    max_sessions: int | None = None
    runner: str = "hf"
    page_size: int = 16
    kv_cache_tokens: int = 1 << 15
    cuda_graphs: bool = True
    profiles: str | None = None
    cost_model: str | Path | CostModel | BatchCostModels | None = None
    admission: str = "reserve"
    tree_attention: str = "split"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        check_instance_field(self, "tiers", TierConfig)
        check_instance_field(self, "drafter", DrafterConfig)
        check_int_fields(self, ("max_batch", "max_sessions", "page_size", "kv_cache_tokens",
                                "max_model_len"), optional=("max_sessions", "max_model_len"))
        check_bool_fields(self, ("cuda_graphs",))
        if self.profiles is not None and not isinstance(self.profiles, (str, Path)):
            raise ValueError(f"profiles: expected a path or None, got {self.profiles!r}")
        if self.cost_model is not None and not isinstance(
                self.cost_model, (str, Path, CostModel, BatchCostModels)):
            raise ValueError(f"cost_model: expected a path, a CostModel, a BatchCostModels "
                             f"or None, got {type(self.cost_model).__name__}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and one to "
                             f"generate) or None, got {self.max_model_len}")
        # (per-slot buffers and tables are sized by these when the decoder is built)
        check_at_most(self, {"max_batch": 4096, "max_sessions": 1 << 20,
                             "page_size": 1 << 12})
        if self.max_sessions is not None and self.max_sessions < self.max_batch:
            raise ValueError(f"max_sessions ({self.max_sessions}) must be >= max_batch "
                             f"({self.max_batch}): a batch is made of open sessions")
        if self.runner not in ("hf", "paged"):
            raise ValueError(f"runner must be 'hf' or 'paged', got {self.runner!r}")
        if self.admission not in ("reserve", "optimistic"):
            raise ValueError(f"admission must be 'reserve' or 'optimistic', got "
                             f"{self.admission!r}")
        if self.tree_attention not in ("split", "custom"):
            raise ValueError(f"tree_attention must be 'split' or 'custom', got "
                             f"{self.tree_attention!r}")
        if self.page_size < 1 or self.kv_cache_tokens < self.page_size:
            raise ValueError("need page_size >= 1 and kv_cache_tokens >= page_size")

    @property
    def session_limit(self) -> int:
        """``max_sessions``, or ``4 * max_batch`` when it is None."""
        return 4 * self.max_batch if self.max_sessions is None else self.max_sessions
