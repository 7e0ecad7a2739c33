"""End-to-end throughput on replayed agent sessions: agspec_gpu against plain decoding and peers.

The fast runner (``PagedLlamaRunner``: paged KV, FlashInfer tree attention on a GPU) at a
realistic size -- the Llama-3-8B or Qwen2.5-Coder-7B architecture from the HF configs below,
random bf16 weights drawn on the device -- runs in REPLAY TARGET mode
(``agspec_gpu.replay_target``): every forward pass is real, the token the target predicts is
the trajectory's next token (teacher forcing). Sessions (``../shared/data/trajectories/dev``
or the paths given) run as one continuous batch at every ``--batch-sizes`` B, for every
``--methods`` method:

* ``none`` (plain decoding; one-token steps as CUDA graphs on a GPU), ``pld-hf``,
  ``suffix-decoding`` (arctic-inference, when installed: its CPU speculate loop per request),
  ``agspec``, ``agspec-nobudget`` (no batch-level budget), and ``oracle`` (drafts the longest
  prefix of the true continuation found in agspec's corpora, capped at 32: the ceiling).

Before the methods, a calibration (unless ``--no-calibrate`` or ``--cost-model``;
``--calibrate`` calibrates and exits) measures verification time against tokens per step on
this runner, per batch size, and saves it as a ``CostModel`` JSON
(``bench/results/cost-<model>-<gpu>-<date>.json``); agspec's batch budget in the same run
uses it.

Sessions enter the batch longest first (``--order``; ``ReplayTargetConfig.order``): the run
replays a fixed set of them (``--sessions-per-slot`` times B) and drains at its end, and
longest first keeps the batch nearer B (``mean_batch`` in each row).

Reported per (method, B): output tokens/s, speedup over ``none`` at the same B, tau (tokens
per request per step, bonus included), drafter / verification / commit ms per step (the
drafter's work between requests -- context and files fed, sessions opened and closed --
spread over the steps as ``drafter_message_ms_per_step``, counted in its share), peak GPU
memory, and the cost model's predicted speedup (``modelled_replay_speedup``: the replay
evaluator's figure over this run's own steps, each priced ``cost(rows + drafted)`` on the
curve calibrated at its batch's graph bucket (the calibration measures every graph batch
size up to the largest B, so a drain's smaller steps are priced as the smaller buckets they
run in), drafting left out; ``modelled_verify_ms_per_step``: the same price per step, to
set beside the measured ``verify_ms_per_step``; ``modelled_full_batch_speedup``: the priced
throughput of the full-batch steps alone, a loaded server's steady state without the run's
drain); plus the memory bandwidth plain decoding reaches at B=1.
JSON (``{"gpu", "model", "protocol", "rows", ...}``) and CSV go to ``--out``
(default ``bench/results/e2e-YYYYMMDD-<gpu>.json`` / ``.csv``).

Usage::

    python bench/bench_e2e.py --model llama3-8b                        # H200: the full run
    python bench/bench_e2e.py --model llama3-8b --calibrate            # cost model only
    python bench/bench_e2e.py --device cpu --tiny                      # CPU smoke test
    python bench/bench_e2e.py ... --profile                            # + one Chrome trace

Profiling: ``--profile`` writes one ``torch.profiler`` Chrome trace (open it in Perfetto or
chrome://tracing) of ``--profile-steps`` steps of ``--profile-method`` at the largest batch,
after ``--profile-warmup`` steps, in a run of its own before the timed ones (the profiler's
overhead is in no row). The loop marks NVTX ranges ``e2e.propose`` /
``e2e.verify`` / ``e2e.commit`` / ``e2e.prefill`` (and the drafter's
``agspec.drafter.propose`` / ``agspec.drafter.commit``), so under Nsight Systems the phases
are visible:
``nsys profile -t cuda,nvtx -o e2e python bench/bench_e2e.py --batch-sizes 16 --methods agspec``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import triton

from agspec_gpu.accept import teacher_forced_accept
from agspec_gpu.calibrate import calibrate_batch_costs
from agspec_gpu.cost_model import BatchCostModels, CostModel
from agspec_gpu.cuda_graph import batch_buckets
from agspec_gpu.draft_batch import DraftBatch
from agspec_gpu.host import synchronize
from agspec_gpu.kernels.suffix_array import MAX_BLOCK, context_array
from agspec_gpu.replay import session_responses, tokenize_sessions
from agspec_gpu.replay_target import (
    METHOD_NAMES, DecodeGraphs, MetadataPool, ReplayTargetConfig, make_proposer, protocol,
    run_replay_target,
)
from agspec_gpu.runners.verify_graphs import VerifyGraphs
from agspec_gpu.runners.paged import PagedLlamaRunner
from agspec_gpu.tiers import TierConfig
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_paths
from devices import device_slug, pick_device
from triton_compiles import TritonCompiles

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "trajectories" / "dev"
# peak memory bandwidth (GB/s) by the vendors' datasheets, matched in order against
# torch.cuda.get_device_name (lower case): the device tool lends H100 (80GB HBM3, SXM) and
# H200 machines; the bandwidth goal of issue 7 is a fraction of the GPU it ran on
DATASHEET_BANDWIDTH_GBPS: tuple[tuple[str, float], ...] = (
    ("h200", 4800.0),                                         # HBM3e, SXM and NVL
    ("h100 nvl", 3900.0), ("h100 pcie", 2000.0), ("h100", 3350.0),  # 80GB HBM3: SXM5
    ("h800", 3350.0),
    ("a100-sxm4-80gb", 2039.0), ("a100 80gb pcie", 1935.0), ("a100", 1555.0),  # 40 GB
    ("l40s", 864.0), ("l4", 300.0),
)

# config.json of meta-llama/Llama-3.1-8B (the Llama-3-8B architecture with llama3 RoPE
# scaling) and Qwen/Qwen2.5-Coder-7B, as transformers reads them
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama3-8b": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        attention_bias=False, mlp_bias=False, hidden_act="silu", tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001)),
    "qwen2.5-coder-7b": ("qwen2", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6,
        max_position_embeddings=32768, rope_theta=1000000.0, use_sliding_window=False,
        sliding_window=131072, max_window_layers=28, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643)),
    # CPU smoke test: cl100k's vocabulary, two small layers
    "tiny": ("llama", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100277, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False)),
}
# suffix-decoding-warm (with --half): its cache holds the other half's responses, the
# traffic agspec's --global-corpus is built from: the peer given what agspec is given. The
# goals' rows run first at each batch size (a run cut by a time limit keeps its finished
# rows; the device check's e2e step runs close to its limit)
DEFAULT_METHODS = ("none", "agspec", "suffix-decoding", "suffix-decoding-warm", "pld-hf",
                   "agspec-nobudget", "oracle")


def make_config(name: str):
    import transformers

    kind, kwargs = ARCHITECTURES[name]
    cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    return cls(**kwargs)


class RandomWeights(Mapping):
    """A ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` state dict drawn on demand.

    Matrices and biases are ``N(0, std)``, norms are ones, each tensor drawn directly on
    ``device`` in ``dtype`` from a generator seeded per name when it is read, so an 8B model
    is never held twice (``PagedLlamaRunner`` fuses QKV and gate/up as it reads them).
    """

    def __init__(self, config, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 std: float = 0.02) -> None:
        self.device, self.dtype, self.seed, self.std = device, dtype, seed, std
        h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
        H, Hkv = config.num_attention_heads, config.num_key_value_heads
        d = getattr(config, "head_dim", None) or h // H
        bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                  "lm_head.weight": (v, h)}
        for n in range(config.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (H * d, h),
                p + "self_attn.k_proj.weight": (Hkv * d, h),
                p + "self_attn.v_proj.weight": (Hkv * d, h),
                p + "self_attn.o_proj.weight": (h, H * d),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i)})
            if bias:
                shapes.update({p + "self_attn.q_proj.bias": (H * d,),
                               p + "self_attn.k_proj.bias": (Hkv * d,),
                               p + "self_attn.v_proj.bias": (Hkv * d,)})
        self._shapes = shapes
        self._index = {k: n for n, k in enumerate(shapes)}

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        g = torch.Generator(device=self.device).manual_seed(self.seed * 100_003 + self._index[name])
        return torch.randn(shape, generator=g, device=self.device, dtype=self.dtype).mul_(self.std)

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def replay_context_tokens(corpus, messages_per_session: int | None, context: int,
                          max_message_tokens: int | None = None) -> int:
    """The mean KV length a replayed token is decoded at: each session's first
    ``messages_per_session`` target messages (None: all) that start after its first token,
    each with ``min(start, context)`` tokens of context, as the replay loop gives them, and
    its KV growing by one slot per token of the message (``max_message_tokens`` of it;
    None: all). Weighted by tokens, not messages: a long message holds a longer KV for
    more steps (~10% above the messages' mean start on the dev set)."""
    total = weighted = 0
    for s in corpus.sessions:
        for i in [i for i in s.target_messages if s.bounds[i] >= 1][:messages_per_session]:
            c = min(int(s.bounds[i]), context)
            n = int(s.bounds[i + 1] - s.bounds[i])
            n = min(n, max_message_tokens) if max_message_tokens else n
            total += n
            weighted += n * c + n * (n - 1) // 2  # KV lengths c, c + 1, ..., c + n - 1
    return max(1, round(weighted / total)) if total else context


def write_atomic(path: Path, text: str) -> None:
    """``path.write_text(text)`` through a temporary file: a run killed by its time limit
    mid-write leaves the previous whole file, not a truncated one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def decode_bytes(runner: PagedLlamaRunner, kv_len: int, batch: int = 1) -> int:
    """Bytes one decode step must read: every weight but the embedding table (one row), and
    each request's KV of ``kv_len`` tokens."""
    t = [runner.lm_head, runner.final_norm]
    for layer in runner.layers:  # the fields themselves: astuple would deep-copy 15 GB
        t += [x for x in (getattr(layer, f.name) for f in dataclasses.fields(layer))
              if x is not None]
    weights = sum(x.numel() * x.element_size() for x in t)
    s = runner.shape
    kv = 2 * s.num_layers * s.num_kv_heads * s.head_dim * runner.kv_cache.data.element_size()
    return weights + batch * kv * kv_len


# kernel (or CPU op) name patterns -> the part of a decode step they belong to; first match
KERNEL_KINDS = (
    ("attention", ("flashinfer", "batchdecode", "batchprefill", "attention", "paged")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "cublas", "splitk", "nvjet", "sm90_xmma",
                "aten::mm",
                "aten::addmm", "aten::linear", "aten::matmul")),
    ("norm / rope / silu", ("rms_norm", "rope", "silu")),
)


def kernel_breakdown(step, device: torch.device, iters: int = 5, top: int = 12) -> dict:
    """Where a step's device time goes: ``step()`` ``iters`` times under ``torch.profiler``.

    On a GPU, the CUDA kernels (inside a graph replay too; ``calls``: launches); on a CPU, the
    ``aten`` ops (self time; ``calls``: op calls, views included). Returns per-step ms and
    calls by kind (``KERNEL_KINDS``, else ``other``), the ``top`` kernels by time, and
    ``busy_ms``: the kernels' summed time per step (against the step's wall time, the rest is
    the GPU waiting between kernels).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    synchronize(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        synchronize(device)
    kernels = []
    for e in prof.key_averages():
        if cuda:
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
            if getattr(e, "device_type", None) != DeviceType.CUDA or not us:
                continue
        else:
            us = e.self_cpu_time_total
            if not e.key.startswith("aten::") or not us:
                continue
        kernels.append((e.key, us / 1e3 / iters, e.count / iters))
    kernels.sort(key=lambda k: -k[1])
    kinds: dict[str, dict[str, float]] = {}
    for name, ms, n in kernels:
        low = name.lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p in low for p in pats)), "other")
        agg = kinds.setdefault(kind, {"ms": 0.0, "calls": 0.0})
        agg["ms"] += ms
        agg["calls"] += n
    return {"source": "CUDA kernels" if cuda else "CPU aten ops (self time)",
            "iters": iters, "busy_ms": sum(k[1] for k in kernels),
            "calls": sum(k[2] for k in kernels), "by_kind": kinds,
            "top": [{"name": name[:120], "ms": ms, "calls": n}
                    for name, ms, n in kernels[:top]]}


def round_robin_by_agent(sessions: list) -> list:
    """Interleaves agent formats (first session of each agent, then the second, ...), so that
    any prefix of the list mixes agents."""
    by_agent: dict[str, list] = {}
    for s in sessions:
        by_agent.setdefault(s.agent, []).append(s)
    out, queues = [], list(by_agent.values())
    for k in range(max((len(q) for q in queues), default=0)):
        out += [q[k] for q in queues if k < len(q)]
    return out


def peak_bandwidth_gbps(gpu: str) -> tuple[float | None, str]:
    """(peak memory bandwidth in GB/s, where it came from) for a GPU named ``gpu`` (as
    ``torch.cuda.get_device_name`` names it): the first :data:`DATASHEET_BANDWIDTH_GBPS`
    entry whose key ``gpu`` contains, else (None, why)."""
    name = gpu.lower()
    for key, gbps in DATASHEET_BANDWIDTH_GBPS:
        if key in name:
            return gbps, f"{gpu}: {gbps / 1e3:.2f} TB/s by the vendor's datasheet"
    return None, f"{gpu}: no datasheet bandwidth known (only GB/s reported)"


def environment(device: torch.device) -> dict:
    import transformers

    env = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": str(device),
           "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            import flashinfer

            env["flashinfer"] = getattr(flashinfer, "__version__", "?")
        except ImportError:
            env["flashinfer"] = None
    return env


# ---------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", help=f"trajectory files/dirs (default {DEFAULT_DATA})")
    ap.add_argument("--git", default=None, help="also build sessions from this git repo's history")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(ARCHITECTURES))
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny config, a few sessions and steps (CPU smoke test)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    ap.add_argument("--batch-sizes", default=None, help="comma list (default 1,16,64)")
    ap.add_argument("--methods", default=None,
                    help=f"comma list of {', '.join(METHOD_NAMES)} (default: "
                         f"{','.join(DEFAULT_METHODS)})")
    ap.add_argument("--sessions", type=int, default=None,
                    help="sessions loaded (default: what the largest batch runs)")
    ap.add_argument("--sessions-per-slot", type=float, default=4.0,
                    help="at batch size B, the first max(min-sessions, this * B) sessions run "
                         "(2 left half of agspec's B=16 steps draining behind one session)")
    ap.add_argument("--min-sessions", type=int, default=8)
    ap.add_argument("--order", default="longest-first", choices=("longest-first", "given"),
                    help="the order sessions enter the batch (ReplayTargetConfig.order): "
                         "longest first keeps the batch fuller while it drains")
    ap.add_argument("--context", type=int, default=None,
                    help="context tokens per request (default 4096)")
    ap.add_argument("--max-message-tokens", type=int, default=None,
                    help="target tokens per assistant message (0: whole messages; default "
                         "1024)")
    ap.add_argument("--messages-per-session", type=int, default=None,
                    help="0: all (the default)")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="decode steps per run (0: all, the default)")
    ap.add_argument("--prefill", default="real", choices=("real", "skip"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-draft-nodes", type=int, default=64,
                    help="most draft nodes per request the planner holds")
    ap.add_argument("--no-graphs", action="store_true",
                    help="plain decode and verification steps run eagerly")
    ap.add_argument("--eager-verify", action="store_true",
                    help="verification steps run eagerly over exact-size metadata (the "
                         "padded CUDA-graph buckets off; plain decode still graphed)")
    ap.add_argument("--tree-attention", default="split", choices=("split", "custom"),
                    help="verification attention: the prefix unmasked and the tree apart "
                         "(split), or FlashInfer's custom mask over both (DecoderConfig)")
    ap.add_argument("--calibrate", action="store_true", help="calibrate the cost model and exit")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip calibration (agspec uses --cost-model or the default model)")
    ap.add_argument("--cost-model", default=None, help="a cost JSON to use instead of calibrating")
    ap.add_argument("--calibrate-max-tokens", type=int, default=None, help="default 2048")
    ap.add_argument("--calibrate-repeats", type=int, default=None, help="default 5")
    ap.add_argument("--profile", action="store_true", help="write one Chrome trace")
    ap.add_argument("--profile-method", default="agspec")
    ap.add_argument("--profile-warmup", type=int, default=None, help="default 8")
    ap.add_argument("--profile-steps", type=int, default=None, help="default 4")
    ap.add_argument("--bandwidth-iters", type=int, default=None, help="default 50")
    ap.add_argument("--global-corpus", default=None, help="an agspec global corpus file")
    ap.add_argument("--half", type=int, choices=(0, 1), default=None,
                    help="only sessions of this half (agspec_gpu.tiers.session_half), e.g. 1 "
                         "with a global corpus built from --half 0: no session feeds its own "
                         "global tier")
    ap.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--out", default=None, help="e2e JSON path (CSV next to it)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
    # the defaults of the options --tiny changes, filled where not given (a value given
    # equal to the full run's default stays: --tiny --max-steps 0 runs every step)
    for k, v in {**_DEFAULTS, **(_TINY_DEFAULTS if args.tiny else {})}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


_DEFAULTS = dict(batch_sizes="1,16,64", context=4096, max_message_tokens=1024,
                 messages_per_session=0, max_steps=0, calibrate_max_tokens=2048,
                 calibrate_repeats=5, bandwidth_iters=50, profile_warmup=8, profile_steps=4)
_TINY_DEFAULTS = dict(batch_sizes="1,2", sessions=3, context=256, max_message_tokens=24,
                      messages_per_session=2, max_steps=12, calibrate_max_tokens=8,
                      calibrate_repeats=1, bandwidth_iters=3, profile_warmup=2,
                      profile_steps=2)


def load_corpus(args, tokenizer):
    if args.git:
        from agspec_gpu.gitlog import sessions_from_git

        sessions = sessions_from_git(args.git)
    else:
        sessions = []
    paths = args.paths or ([] if args.git else [DEFAULT_DATA])
    if paths:
        sessions += load_paths(paths)
    if args.half is not None:
        from agspec_gpu.tiers import session_half

        sessions = [s for s in sessions if session_half(s.task_id) == args.half]
    if args.sessions is None:  # only what the largest batch runs (tokenizing costs)
        max_b = max(int(b) for b in args.batch_sizes.split(",") if b)
        args.sessions = max(args.min_sessions, math.ceil(args.sessions_per_slot * max_b))
    sessions = round_robin_by_agent(sessions)[:args.sessions]
    if not sessions:
        raise SystemExit("no sessions found")
    return tokenize_sessions(sessions, tokenizer, capture_files=True)


def other_half_responses(args, tokenizer) -> tuple:
    """The assistant messages of the sessions of the given paths in the half ``--half``
    leaves out (all of them, not cut by ``--sessions``): what a warm SuffixDecoding server
    cached, as agspec's global corpus of that half holds them."""
    from agspec_gpu.tiers import session_half

    sessions = [s for s in load_paths(args.paths or [DEFAULT_DATA])
                if session_half(s.task_id) != args.half]
    return session_responses(tokenize_sessions(sessions, tokenizer).sessions)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    if device.type == "cpu" and args.model != "tiny":  # (--device auto on a CPU machine)
        raise SystemExit(f"--model {args.model}: a full-size model on the CPU (tens of GB in "
                         f"float32, seconds a step) measures nothing; run it on a GPU "
                         f"(bench/device_check.sh) or pass --tiny")
    dtype = getattr(torch, args.dtype) if args.dtype else \
        (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    torch.manual_seed(args.seed)
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b})
    explicit = args.methods is not None  # (a method the default lists may be skipped)
    methods = [m for m in args.methods.split(",") if m] if explicit else list(DEFAULT_METHODS)
    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHOD_NAMES)}")
    skipped = {}
    if any(m.startswith("suffix-decoding") for m in methods):
        from agspec_gpu.baselines import SUFFIX_DECODING_INSTALL_HINT, suffix_decoding_available

        if not suffix_decoding_available():
            for m in [m for m in methods if m.startswith("suffix-decoding")]:
                methods.remove(m)
                skipped[m] = SUFFIX_DECODING_INSTALL_HINT
    if "suffix-decoding-warm" in methods and (args.half is None or args.git):
        if explicit:
            raise SystemExit("suffix-decoding-warm needs --half (its cache holds the other "
                             "half's responses) and no --git")
        methods.remove("suffix-decoding-warm")
        skipped["suffix-decoding-warm"] = "needs --half: its cache holds the other half's " \
                                          "responses"
    if "none" not in methods:
        methods.insert(0, "none")  # every speedup is over it
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu_slug = device_slug(device)
    peak_gbps, peak_note = peak_bandwidth_gbps(gpu) if device.type == "cuda" else \
        (None, "no GPU")
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    max_msg = args.max_message_tokens or None
    per_msg = args.messages_per_session or None
    max_steps = args.max_steps or None
    t_start = time.perf_counter()

    # ---------------------------------------------------------------- workload
    tokenizer = load_tokenizer("cl100k")
    corpus = load_corpus(args, tokenizer)
    warm = other_half_responses(args, tokenizer) if "suffix-decoding-warm" in methods else ()
    if warm and not args.global_corpus:
        print("note: suffix-decoding-warm holds the other half's responses but agspec has no "
              "global tier (--global-corpus built from that half): the comparison favours "
              "the warm lane", file=sys.stderr)
    maybe_global = None
    if args.global_corpus:
        from agspec_gpu.tiers import load_global_corpus

        maybe_global = load_global_corpus(args.global_corpus, tokenizer)
        maybe_global.check_disjoint(s.task for s in corpus.sessions)
    longest = max(int(s.bounds[i + 1] - s.bounds[i]) for s in corpus.sessions
                  for i in s.target_messages) if corpus.sessions else 1
    msg_room = min(longest, max_msg) if max_msg else longest

    # ---------------------------------------------------------------- runner
    config = make_config(args.model)
    max_b = max(batch_sizes)
    ps = args.page_size
    per_request = args.context + msg_room + args.max_draft_nodes + 2
    calib_need = args.context + args.calibrate_max_tokens + 2
    max_pages_per_seq = -(-max(per_request, calib_need) // ps)
    num_pages = max(max_b * -(-per_request // ps), max_pages_per_seq,
                    max_b * -(-(args.context + -(-args.calibrate_max_tokens // max_b) + 2) // ps))
    t0 = time.perf_counter()
    runner = PagedLlamaRunner(config, RandomWeights(config, device, dtype, args.seed),
                              num_pages=num_pages, page_size=ps, max_seqs=max_b + 2,
                              max_pages_per_seq=max_pages_per_seq, device=device, dtype=dtype,
                              split_attention=args.tree_attention == "split")
    # what verification steps run: the split's prefix and tree, or the custom mask
    tree_attention = "split" if runner.splits(args.max_draft_nodes) else "custom"
    # the buckets a server captures (powers of two and the largest batch), the same list
    # the drafter's budget picks its curve by: a run at B = 6 pads its full steps to 8, as
    # it would in the drafter's reckoning (adding 6 here had a drain step of 5 rows verify
    # and be priced at 6 while the budget steered by 8's curve)
    graph_sizes = batch_buckets(max_b)
    graphs = DecodeGraphs(runner, graph_sizes, use_graphs=False if args.no_graphs else None)
    verify = None if args.eager_verify else VerifyGraphs(
        runner, graph_sizes, args.max_draft_nodes,
        use_graphs=False if args.no_graphs else None)
    # the padded buckets pay only as graphs: run eagerly (no GPU, --no-graphs, a failed
    # capture) each step would plan over the page table's whole width, so steps then run
    # unpadded, as SpecDecoder runs them
    verify_steps = verify if verify is not None and verify.uses_graphs else None
    pool = MetadataPool(max_b, args.max_draft_nodes, max_pages_per_seq, ps, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - t0
    model_gb = decode_bytes(runner, 0) / 1e9
    pool_gb = runner.kv_cache.data.numel() * runner.kv_cache.data.element_size() / 1e9
    print(f"[e2e] {args.model} on {gpu} ({dtype}): {model_gb:.2f} GB of weights read per "
          f"step, KV pool {pool_gb:.1f} GB, "
          f"decode graphs: {graphs.uses_graphs}"
          f"{' (capture failed: ' + graphs.graph_error + ')' if graphs.graph_error else ''}, "
          f"verify graphs: {verify.uses_graphs if verify else 'off'}"
          + (f" (capture failed: {verify.graph_error})" if verify and verify.graph_error
             else "") + "; "
          f"setup {setup_s:.1f} s", flush=True)

    # ---------------------------------------------------------------- cost model
    cost_path = results / f"cost-{args.model}-{gpu_slug}-{_dt.date.today():%Y%m%d}.json"
    cost_for: dict[int, CostModel] = {}
    if args.cost_model:
        cost_for = load_cost_models(args.cost_model, batch_sizes)
        cost_path = Path(args.cost_model)
    elif not args.no_calibrate or args.calibrate:
        t0 = time.perf_counter()
        # at the KV length the replayed steps hold (a request's context is its message's
        # start, capped at --context: the first messages start early; then its own tokens),
        # not at the cap
        calib_ctx = replay_context_tokens(corpus, per_msg, args.context, max_msg)
        # at every graph batch size up to the largest run's: a step of b requests runs in
        # the smallest bucket >= b (a run's drain in smaller ones), and is priced there
        cost_for = dict(calibrate_batch_costs(
            runner, graph_sizes, calib_ctx, max_draft_tokens=args.calibrate_max_tokens,
            repeats=args.calibrate_repeats, graphs=graphs, verify_graphs=verify_steps,
            source=f"measured: {args.model} on {gpu} (KV: the replayed messages' mean "
                   f"context)").curves)
        for b, curve in cost_for.items():
            print(f"[e2e] cost B={b}: " + ", ".join(f"{x}:{y:.2f}ms" for x, y in
                                                    curve.points), flush=True)
        cost_obj = {**BatchCostModels(tuple(sorted(cost_for.items()))).to_json(),
                    "model": args.model, "gpu": gpu,
                    "dtype": str(dtype).removeprefix("torch."), "context_tokens": calib_ctx,
                    "page_size": ps, "decode_cuda_graphs": graphs.uses_graphs,
                    "verify_cuda_graphs": verify.uses_graphs if verify else False,
                    "tree_attention": tree_attention}
        write_atomic(cost_path, json.dumps(cost_obj, indent=2) + "\n")
        print(f"[e2e] wrote {cost_path} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if args.calibrate:
            return 0
    else:
        cost_path = None
    cost_for, prices = step_prices(cost_for, batch_sizes)

    # ---------------------------------------------------------------- decode bandwidth (B=1)
    bw_id = "__bandwidth"
    runner.kv_cache.allocate(bw_id, args.context)
    step_ms = graphs.time_step([bw_id], torch.zeros(1, dtype=torch.int32), [args.context - 1],
                               iters=args.bandwidth_iters)
    bw_gbps = decode_bytes(runner, args.context) / (step_ms / 1e3) / 1e9
    print(f"[e2e] plain decode B=1 at {args.context} tokens: {step_ms:.3f} ms/step, "
          f"{bw_gbps:.0f} GB/s", flush=True)
    # where that step's time goes (the bandwidth goal's diagnosis): kernels by kind; a
    # profiler that cannot run here costs this figure only, not the run
    try:
        decode_kernels = kernel_breakdown(
            graphs.step_fn([bw_id], torch.zeros(1, dtype=torch.int32), [args.context - 1]),
            device)
        print(f"[e2e] plain decode B=1 kernels: {decode_kernels['busy_ms']:.3f} ms busy in "
              f"{decode_kernels['calls']:.0f} calls per step; " + ", ".join(
                  f"{k} {v['ms']:.3f} ms / {v['calls']:.0f}"
                  for k, v in decode_kernels["by_kind"].items()), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        decode_kernels = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[e2e] plain decode B=1 kernels: not profiled ({decode_kernels['error']})")
    runner.kv_cache.free(bw_id)

    # ---------------------------------------------------------------- methods
    drafter_graphs: dict[str, list[str]] = {}  # method -> propose / commit graph status

    def run(method: str, b: int, sessions, steps=max_steps, hook=None):
        # agspec's budget steers by the curve of each step's bucket, as `prices` prices it
        proposer = make_proposer(method, tokenizer, device, b, cost=prices,
                                 global_corpus=maybe_global, warm_responses=warm)
        cfg = ReplayTargetConfig(batch_size=b, context_tokens=args.context,
                                 max_message_tokens=max_msg, messages_per_session=per_msg,
                                 prefill=args.prefill, max_steps=steps, order=args.order)
        sub = dataclasses.replace(corpus, sessions=tuple(sessions))
        res = run_replay_target(runner, sub, proposer, cfg, pool=pool,
                                graphs=None if args.no_graphs else graphs,
                                verify_graphs=verify_steps, step_hook=hook)
        step_graphs = getattr(getattr(proposer, "drafter", None), "_graphs", None)
        if step_graphs is not None:  # the agspec drafter's propose / commit graphs
            drafter_graphs[method] = [g.graph_error or "captured" for g in step_graphs]
        return res

    # warm-up: Triton kernels compile, allocator pools fill (results discarded). Plain
    # decoding and agspec at every batch size of the sweep (their kernels' block shapes
    # follow the batch: the verification steps, acceptance and the KV commit are every
    # method's), the others at one small batch; what still compiles in a timed run is
    # counted in its row (jit_compiles)
    t0 = time.perf_counter()
    with TritonCompiles() as warm_jit:
        # the acceptance walk compiles once per power-of-two draft width, and the baselines'
        # drafts change width from step to step: every width up to the planner's, once
        widths = range(1, args.max_draft_nodes + 1)
        for n in sorted({triton.next_power_of_2(w) for w in widths}):
            z = torch.zeros(1, n, dtype=torch.int32, device=device)
            teacher_forced_accept(DraftBatch(z, z - 1, torch.full((1,), n, dtype=torch.int32,
                                                                  device=device)), z)
        # the index's one-launch level build: one compile per block (1024, MAX_BLOCK), at
        # the corpora's depth (a window of a few hundred positions at every tail flush,
        # up to MAX_BLOCK when levels merge)
        for w in (1000, MAX_BLOCK - 1):
            context_array(torch.zeros(w + 1, dtype=torch.int32, device=device), 0, w + 1,
                          TierConfig().max_depth, num_selected=w)
        for m in dict.fromkeys(["none", "agspec"] + methods):
            for b in batch_sizes if m in ("none", "agspec") else [min(2, max_b)]:
                run(m, b, corpus.sessions[:max(b, 2)], steps=4)
    print(f"[e2e] warm-up {time.perf_counter() - t0:.1f} s ({warm_jit.count} Triton "
          f"compiles, {warm_jit.seconds:.1f} s); agspec drafter graphs (propose, commit): "
          f"{drafter_graphs.get('agspec', 'off')}", flush=True)

    results_by = {}
    trace_path = None
    if args.profile and args.profile_method in methods:
        # a run of its own, untimed: the profiler's overhead stays out of every row (it
        # once slowed a few steps of the timed run at the largest batch, a goal's row)
        trace_path = results / f"trace-e2e-{args.model}-{args.profile_method}-B{max_b}-" \
                               f"{gpu_slug}.json"
        n_prof = min(len(corpus.sessions), max(args.min_sessions, max_b))
        try:  # a diagnostic: a profiler that fails (CUPTI, the export) costs the trace only
            prof = _StepProfiler(device, args.profile_warmup, args.profile_steps, trace_path)
            try:
                run(args.profile_method, max_b, corpus.sessions[:n_prof],
                    steps=args.profile_warmup + args.profile_steps + 1, hook=prof.hook)
            finally:
                prof.close()
            print(f"[e2e] profiled {args.profile_method} B={max_b}: {trace_path}", flush=True)
        except Exception as exc:
            trace_path = None
            print(f"[e2e] profile of {args.profile_method} B={max_b} failed, no trace "
                  f"({type(exc).__name__}: {exc})", flush=True)

    # ---------------------------------------------------------------- report
    def save() -> dict:
        """Writes the JSON and CSV of the rows measured so far (after every run, so a
        run cut short by a time limit still leaves its finished rows)."""
        rows = []
        for (m, b), (r, peak, jit) in results_by.items():
            base = results_by.get(("none", b), (None,))[0]
            steps = max(r.steps, 1)
            mean_batch = r.request_steps / steps
            step_ms_run = 1e3 * r.decode_s / steps
            draft_ms = r.per_step_ms(r.draft_s) if r.counts_draft_time else 0.0
            # the drafter's commit, host time (part of commit ms); agspec queues most of it,
            # and the next step's propose where no request can end in this one, before the
            # step's wait for the device (their host time then overlaps the verification:
            # reported apart, in the drafter's share only at the steps whose wait found
            # the device done: exposed, a bound)
            observe_ms = r.per_step_ms(r.observe_s) if r.counts_draft_time else 0.0
            queued_ms = r.per_step_ms(r.drafter_queued_s) if r.counts_draft_time else 0.0
            ahead_ms = r.per_step_ms(r.propose_ahead_s) if r.counts_draft_time else 0.0
            exposed_ms = r.per_step_ms(r.drafter_queued_exposed_s) \
                if r.counts_draft_time else 0.0
            # its work between requests (context and files fed, sessions opened and
            # closed), outside the steps, spread over them
            message_ms = r.per_step_ms(r.message_s) if r.counts_draft_time else 0.0
            # the replay evaluator's figure (replay_stats.add_replay_speedups): verification
            # time priced step by step (each at the curve of its batch's graph bucket),
            # plain decoding's over this method's, drafting left out
            modelled_ms = r.step_tokens.modelled_ms(prices) if r.steps else None
            base_ms = base.step_tokens.modelled_ms(prices) if base is not None and \
                base.steps else None
            # the same price over the full-batch steps alone: throughputs (their tokens
            # differ between methods), this method's over plain decoding's
            full_ms = r.full_step_tokens.modelled_ms(prices) if r.full_steps else None
            base_full_ms = base.full_step_tokens.modelled_ms(prices) \
                if base is not None and base.full_steps else None
            rows.append({
                "method": m, "batch_size": b,
                "tokens_per_s": r.tokens_per_s,
                "speedup": r.tokens_per_s / base.tokens_per_s
                if base is not None and base.tokens_per_s else None,
                # with the drafters' work between requests (sessions opened and closed,
                # context and files fed) counted as decode time
                "tokens_per_s_with_messages": r.tokens_per_s_with_messages,
                "speedup_with_messages": r.tokens_per_s_with_messages /
                base.tokens_per_s_with_messages
                if base is not None and base.tokens_per_s_with_messages else None,
                "tau": r.tau,
                # while the batch was full (the queue held work: a loaded server's steady
                # state), without the run's drain, over plain decoding's full-batch figure
                "full_batch_tokens_per_s": r.full_batch_tokens_per_s,
                "full_batch_speedup": r.full_batch_tokens_per_s / base.full_batch_tokens_per_s
                if base is not None and base.full_batch_tokens_per_s else None,
                "full_batch_step_share": r.full_steps / steps,
                "draft_ms_per_step": draft_ms,
                "drafter_commit_ms_per_step": observe_ms,
                "drafter_queued_ms_per_step": queued_ms,
                # of the queued time, the next step's propose (drafting done in the commit
                # phase: draft_ms_per_step leaves it out)
                "propose_ahead_ms_per_step": ahead_ms,
                # every ms of drafter work, hidden behind the device or not: propose
                # (ahead too), commit, and between requests (like for like across methods)
                "drafter_total_ms_per_step": draft_ms + observe_ms + queued_ms + message_ms,
                "drafter_queued_exposed_ms_per_step": exposed_ms,
                "drafter_message_ms_per_step": message_ms,
                # its host time by part, per step (the rest of it: the wait for the device)
                "message_host_ms_per_step_by_part": {
                    k: r.per_step_ms(v) for k, v in sorted(r.message_parts.items())},
                "verify_ms_per_step": r.per_step_ms(r.verify_s),
                "peak_mem_gb": None if peak is None else peak / 1e9,
                "commit_ms_per_step": max(r.per_step_ms(r.commit_s), 0.0),
                "step_ms": step_ms_run,
                # the drafter's propose and commit, and its work between requests
                "draft_share_of_step": (draft_ms + observe_ms + exposed_ms + message_ms)
                / step_ms_run
                if step_ms_run else None,
                # throughputs (emitted tokens per modelled ms), this method's over plain
                # decoding's: a step-capped run (--max-steps) emits different tokens per lane
                "modelled_replay_speedup": throughput_ratio(
                    r.tokens, modelled_ms, base and base.tokens, base_ms),
                "modelled_verify_ms_per_step": modelled_ms / steps if modelled_ms else None,
                "modelled_full_batch_speedup": throughput_ratio(
                    r.full_tokens, full_ms, base and base.full_tokens, base_full_ms),
                "acceptance_rate": r.accepted / r.drafted if r.drafted else None,
                "drafted_per_request_step": r.drafted / r.request_steps if r.request_steps else 0.0,
                "mean_batch": mean_batch,
                "plain_step_share": r.plain_steps / steps,
                "steps": r.steps, "tokens": r.tokens, "messages": r.messages,
                "sessions": r.sessions, "prefill_s": r.prefill_s,
                "prefill_tokens": r.prefill_tokens,
                # Triton compiles inside the timed run (0 once warm: else it timed some JIT)
                "jit_compiles": jit.count, "jit_s": jit.seconds,
            })
        none_b1 = results_by.get(("none", 1))
        loop_bw = None
        if none_b1 is not None and none_b1[0].steps:
            loop_step_s = none_b1[0].decode_s / none_b1[0].steps
            loop_bw = decode_bytes(runner, args.context) / loop_step_s / 1e9
        how = "a CUDA graph replayed back to back" if graphs.uses_graphs else \
            "run eagerly (no CUDA graphs)"
        out = Path(args.out) if args.out else \
            results / f"e2e-{_dt.date.today().strftime('%Y%m%d')}-{gpu_slug}.json"
        report = {
            "gpu": gpu,
            "model": args.model,
            "out": str(out),
            "protocol": protocol(args.context, str(dtype).removeprefix("torch."), args.prefill),
            "rows": rows,
            "decode_bandwidth_gbps": bw_gbps,
            "decode_bandwidth_fraction": bw_gbps / peak_gbps if peak_gbps else None,
            "peak_bandwidth_gbps": peak_gbps,
            "decode_step_ms": step_ms,
            "decode_bandwidth_note": (
                f"plain decode, B=1, {args.context} tokens of KV: (weights except the embedding "
                f"table + KV bytes) / step time; the step is "
                f"{how}"
                f"; fraction of the peak: {peak_note}. "
                "loop_decode_bandwidth_gbps: the same bytes over the none B=1 loop's mean step "
                "(host work of the replay loop included)"),
            "loop_decode_bandwidth_gbps": loop_bw,
            "decode_kernels": decode_kernels,
            "decode_cuda_graphs": graphs.uses_graphs,
            "decode_graph_error": graphs.graph_error,
            "tree_attention": tree_attention,
            "verify_cuda_graphs": verify.uses_graphs if verify else False,
            "verify_graph_error": verify.graph_error if verify else None,
            "verify_graph_buckets": sum(len(v) for v in verify.buckets.values())
            if verify else 0,
            "drafter_graphs": drafter_graphs,
            "goals": goals(rows, batch_sizes),
            "cost_model": {"path": str(cost_path) if cost_path else None,
                           "by_batch_size": {str(b): [list(p) for p in c.points]
                                             for b, c in cost_for.items()},
                           "source": {str(b): c.source for b, c in cost_for.items()}},
            "skipped_methods": skipped,
            "trace": str(trace_path) if trace_path else None,
            "config": {k: v for k, v in vars(args).items()} | {
                "methods": methods, "batch_sizes": batch_sizes, "dtype": str(dtype),
                "sessions_loaded": len(corpus.sessions), "num_pages": num_pages,
                "max_pages_per_seq": max_pages_per_seq, "graph_sizes": graph_sizes,
                "wall_s": time.perf_counter() - t_start, **environment(device)},
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(report, indent=2) + "\n")
        with out.with_suffix(".csv").open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            # (a nested field as JSON, not Python's repr)
            w.writerows({k: json.dumps(v) if isinstance(v, dict) else v for k, v in r.items()}
                        for r in rows)
        return report

    for b in batch_sizes:
        n_sessions = min(len(corpus.sessions),
                         max(args.min_sessions, math.ceil(args.sessions_per_slot * b)))
        sessions = corpus.sessions[:n_sessions]
        for m in methods:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            with TritonCompiles() as jit:
                r = run(m, b, sessions)
            # (None on a CPU: torch counts no host allocations)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            results_by[(m, b)] = (r, peak, jit)
            save()
            print(f"[e2e] {m:>16} B={b:<3} {r.tokens_per_s:9.1f} tok/s  tau {r.tau:5.2f}  "
                  f"{r.steps} steps, {r.tokens} tokens, {r.messages} messages "
                  f"({time.perf_counter() - t0:.1f} s)"
                  + (f"; {jit.count} Triton compiles in the timed run ({jit.seconds:.2f} s: "
                     f"{', '.join(dict.fromkeys(jit.kernels))})" if jit.count else ""),
                  flush=True)

    report = save()
    print_table(report)
    out = Path(report["out"])
    print(f"[e2e] wrote {out} and {out.with_suffix('.csv')}"
          + (f"; trace {trace_path}" if trace_path else ""))
    return 0


def throughput_ratio(tokens: int, ms: float | None, base_tokens: int | None,
                     base_ms: float | None) -> float | None:
    """``(tokens / ms) / (base_tokens / base_ms)``: a lane's modelled throughput over plain
    decoding's; None where either has no steps or tokens."""
    if not (ms and tokens and base_ms and base_tokens):
        return None
    return (tokens / ms) / (base_tokens / base_ms)


def step_prices(cost_for: dict[int, CostModel], batch_sizes: list[int]
                ) -> tuple[dict[int, CostModel], BatchCostModels]:
    """``(curves, prices)``: what prices a step of any batch, the curve of the smallest
    calibrated batch ``>=`` its own (a batch between two graph buckets runs padded to the
    larger: its measured curve, never the built-in estimate); the built-in estimate at
    each of ``batch_sizes`` only where nothing was calibrated or given."""
    if not cost_for:
        cost_for = {b: CostModel.default() for b in batch_sizes}
    return cost_for, BatchCostModels(tuple(sorted(cost_for.items())))


def load_cost_models(path: str | Path, batch_sizes: list[int]) -> dict[int, CostModel]:
    """The curves of a saved calibration by batch size (:meth:`BatchCostModels.from_json`):
    every batch it measured, and each of ``batch_sizes`` (its top-level curve where it
    measured none there)."""
    return dict(BatchCostModels.from_json(path, batch_sizes).curves)


def goals(rows: list[dict], batch_sizes: list[int]) -> dict:
    """The issue's targets, read off the rows (None where a method did not run)."""
    by = {(r["method"], r["batch_size"]): r for r in rows}

    def ratio(a: str, b: str, bs: int, key: str = "speedup", key_b: str | None = None):
        """``row(a, bs)[key] / row(b, bs)[key_b or key]``, None where either is missing."""
        x, y, key_b = by.get((a, bs)), by.get((b, bs)), key_b or key
        return x[key] / y[key_b] if x and y and x[key] and y[key_b] else None

    return {
        "agspec_speedup_over_suffix_speedup": {b: ratio("agspec", "suffix-decoding", b)
                                               for b in batch_sizes},
        # against SuffixDecoding given the traffic agspec's global tier holds (with --half)
        "agspec_speedup_over_warm_suffix_speedup": {
            b: ratio("agspec", "suffix-decoding-warm", b) for b in batch_sizes},
        "agspec_fraction_of_oracle_speedup": {b: ratio("agspec", "oracle", b)
                                              for b in batch_sizes},
        # measured speedup over the replay evaluator's modelled one (step by step, drafting
        # left out): within 10% once the cost model is calibrated
        "agspec_measured_over_modelled": {
            b: ratio("agspec", "agspec", b, "speedup", "modelled_replay_speedup")
            for b in batch_sizes},
        # the cost model alone: measured verification ms per step over its price
        "agspec_verify_measured_over_modelled": {
            b: ratio("agspec", "agspec", b, "verify_ms_per_step", "modelled_verify_ms_per_step")
            for b in batch_sizes},
        "agspec_draft_share_of_step": {b: by[("agspec", b)]["draft_share_of_step"]
                                       if ("agspec", b) in by else None for b in batch_sizes},
        # beside the targets, not one of them: the same two ratios while the batch was full
        # (a loaded server's steady state, without the run's drain)
        "full_batch_agspec_speedup_over_suffix_speedup": {
            b: ratio("agspec", "suffix-decoding", b, "full_batch_speedup")
            for b in batch_sizes},
        "full_batch_agspec_speedup": {b: by[("agspec", b)]["full_batch_speedup"]
                                      if ("agspec", b) in by else None for b in batch_sizes},
        "full_batch_modelled_agspec_speedup_over_suffix_speedup": {
            b: ratio("agspec", "suffix-decoding", b, "modelled_full_batch_speedup")
            for b in batch_sizes},
        "full_batch_modelled_agspec_speedup_over_warm_suffix_speedup": {
            b: ratio("agspec", "suffix-decoding-warm", b, "modelled_full_batch_speedup")
            for b in batch_sizes},
        "targets": "agspec/suffix >= 1.3 at B=1,16; agspec speedup > 1 at B=64; >= 0.7 of the "
                   "oracle; measured/modelled within 10%; draft share < 2%; plain decode >= 70% "
                   "of memory bandwidth at B=1",
    }


class _StepProfiler:
    """torch.profiler over steps ``[warmup, warmup + steps)`` of one run, one Chrome trace."""

    def __init__(self, device: torch.device, warmup: int, steps: int, path: Path) -> None:
        self.first, self.last, self.path = warmup, warmup + steps, path
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts, record_shapes=False)
        self._on = False

    def hook(self, step: int, kv=None) -> None:
        if step == self.first and not self._on:
            self._prof.__enter__()
            self._on = True
        elif step == self.last and self._on:
            self.close()

    def close(self) -> None:
        if self._on:
            self._prof.__exit__(None, None, None)
            self._on = False
            self._prof.export_chrome_trace(str(self.path))


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"agspec_gpu end to end - {report['model']} on {report['gpu']} "
                    f"(replay target)", title_justify="left")
    cols = [("method", "method", ""), ("B", "batch_size", "d"), ("tok/s", "tokens_per_s", ".1f"),
            ("speedup", "speedup", ".2f"), ("+msg", "speedup_with_messages", ".2f"),
            ("full B", "full_batch_speedup", ".2f"),
            ("model", "modelled_replay_speedup", ".2f"),
            ("model full B", "modelled_full_batch_speedup", ".2f"), ("tau", "tau", ".2f"),
            ("acc", "acceptance_rate", ".2f"),
            ("draft ms", "draft_ms_per_step", ".3f"), ("verify ms", "verify_ms_per_step", ".2f"),
            ("commit ms", "commit_ms_per_step", ".2f"),
            ("of which drafter", "drafter_commit_ms_per_step", ".3f"),
            ("step ms", "step_ms", ".2f"),
            ("msg ms", "drafter_message_ms_per_step", ".3f"), ("mean B", "mean_batch", ".1f"),
            ("plain", "plain_step_share", ".2f"), ("peak GB", "peak_mem_gb", ".1f")]
    for h, _, _ in cols:
        t.add_column(h, justify="left" if h == "method" else "right")
    for r in sorted(report["rows"], key=lambda r: (r["batch_size"], r["method"] != "none")):
        t.add_row(*["-" if r.get(k) is None else format(r[k], f) if f else str(r[k])
                    for _, k, f in cols])
    con = Console(width=160)
    con.print(f"protocol: {report['protocol']}", soft_wrap=True)
    con.print(t)
    frac = report["decode_bandwidth_fraction"]
    con.print(f"plain decode B=1: {report['decode_step_ms']:.3f} ms/step, "
              f"{report['decode_bandwidth_gbps']:.0f} GB/s"
              + (f" = {100 * frac:.0f}% of {report['peak_bandwidth_gbps'] / 1e3:.2f} TB/s"
                 if frac is not None else "")
              + f" (CUDA graphs: {report['decode_cuda_graphs']}; verification steps as "
              f"CUDA graphs: {report['verify_cuda_graphs']})")


if __name__ == "__main__":
    sys.exit(main())
