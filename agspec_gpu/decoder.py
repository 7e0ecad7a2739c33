"""SpecDecoder: speculative decoding with the retrieval drafter inside a user's loop.

Example::

    dec = SpecDecoder(model, tokenizer)
    sid = dec.open_session(tenant="t0", role="coder", prompt_ids=ids)
    out = dec.generate([sid], max_new_tokens=48)   # list[list[int]], greedy by default
    dec.append(sid, tool_output_ids, text=output)  # the agent's next observation (the
                                                   # files it shows join the workspace)
    dec.close_session(sid)

Each step: ``propose`` (one batched match + draft trees), ``verify`` (one forward over every
request's tree), ``accept`` (greedy: longest path of target argmaxes plus the bonus; sampled:
multi-branch rejection sampling, which preserves the target distribution), ``commit`` (KV of
the accepted path, session tier, controller). Greedy output equals plain greedy decoding
token for token.

Continuous batching (a server's loop: requests join and leave a running batch)::

    dec.submit(sid, max_new_tokens=256)                # queued; joins at the next step
    for out in dec.step():                             # StepOutput per running request
        stream(out.session_id, out.token_ids)          # out.finished: it left the batch
                                                       # (out.finish_reason: eos, stop, length)

Inside your own loop, with your own model and KV cache::

    draft = dec.propose(sids)                          # DraftBatch, rooted at each last token
    inp = dec.tree_inputs(sids, draft)                 # ids, positions, in-tree mask
    logits = my_verify(inp)                            # [B, 1 + N, V]: root row, then nodes
    res = dec.commit(sids, draft, logits)              # AcceptResult; prune your KV with
                                                       # res.accepted_nodes, next root = bonus
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import replace
from numbers import Integral
from pathlib import Path
from typing import Callable, Iterable, Sequence

import nvtx
import torch

from agspec_gpu.accept import (AcceptResult, BatchSampling, SamplingParams, accept_tree,
                               rows_without_finite_max)
from agspec_gpu.attention import FlashInferPagedAttention
from agspec_gpu.calibrate import (calibrate_batch_costs, calibration_pages,
                                  check_calibration_args)
from agspec_gpu.capture import capture_agent_writes, capture_tool_output
from agspec_gpu.checks import check_text, check_token_ids, is_int
from agspec_gpu.commit_checks import (check_commit_logits, check_qo_indptr, commit_end_rules,
                                      cut_result)
from agspec_gpu.controller import load_profiles
from agspec_gpu.corpus import BudgetExceeded
from agspec_gpu.cost_model import BatchCostModels, CostModel
from agspec_gpu.cuda_graph import batch_buckets
from agspec_gpu.decoder_config import DecoderConfig
from agspec_gpu.draft_batch import DraftBatch, TreeInputs, check_draft
from agspec_gpu.drafter import Drafter
from agspec_gpu.host import HostReader, cuda_index, device_guard, serialized, to_device
from agspec_gpu.requests import Requests, SessionState, SessionStats, StepOutput, per_session
from agspec_gpu.runners.common import model_max_length, model_vocab_sizes
from agspec_gpu.runners.hf import HFRunner, check_hf_model, check_hf_probe
from agspec_gpu.runners.paged import PagedLlamaRunner
from agspec_gpu.runners.paged_batch import PagedBatch
from agspec_gpu.runners.verify_graphs import VerifyGraphs
from agspec_gpu.running_batch import RunningBatch
from agspec_gpu.scheduler import Scheduler
from agspec_gpu.session_kv import SessionKVCache
from agspec_gpu.tiers import CorpusStore, GlobalCorpus, load_global_corpus
from agspec_gpu.tokenizer import Tokenizer, load_tokenizer


class SpecDecoder:
    """Speculative decoding for any Hugging Face causal LM.

    Args:
        model: a ``transformers`` causal LM (eval mode).
        tokenizer: its tokenizer (HF object or path), or ``"cl100k"``.
        config: :class:`DecoderConfig`.
        global_corpus: optional read-only public corpus shared by every tenant: a
            :class:`GlobalCorpus` or the path of a file from ``agspec-gpu build-global``
            (loaded and checked against ``tokenizer``).

    Every call runs on the model's device whatever device is current (a model on
    ``cuda:1`` needs no ``torch.cuda.device(1)`` around the calls): a call that does device
    work makes the model's GPU current and restores the caller's on return. Calls from
    several threads run one at a time, each whole (:func:`~agspec_gpu.host.serialized`);
    its attributes (``config``, ``store``, ``drafter``) are its state, for reading while no
    other thread calls it.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, config: DecoderConfig | None = None,
                 global_corpus: GlobalCorpus | str | Path | None = None) -> None:
        if not isinstance(model, torch.nn.Module) or \
                next(model.parameters(), None) is None:
            raise ValueError(f"model: expected a causal LM (a torch.nn.Module with "
                             f"parameters), got {type(model).__name__}")
        if config is not None and not isinstance(config, DecoderConfig):
            raise ValueError(f"config: expected a DecoderConfig or None, got "
                             f"{type(config).__name__}")
        if global_corpus is not None and \
                not isinstance(global_corpus, (GlobalCorpus, str, os.PathLike)):
            raise ValueError(f"global_corpus: expected a GlobalCorpus, a path or None, got "
                             f"{type(global_corpus).__name__}")
        self._lock = threading.RLock()  # public calls from several threads: one at a time
        self.model = model
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        if isinstance(global_corpus, (str, os.PathLike)):
            global_corpus = load_global_corpus(global_corpus, self.tokenizer)
        self.config = config or DecoderConfig()
        if getattr(model, "config", None) is None:
            raise ValueError(f"model: expected a Hugging Face causal LM (with a .config), "
                             f"got {type(model).__name__}")
        if self.config.runner == "hf":  # a model it cannot verify exactly fails here
            check_hf_model(model)  # (then probed, on its device: _build)
        # the ids the model scores are the decoder's vocabulary (prompts, drafts, outputs);
        # a tokenizer may hold more if the embedding does (Mllama's <|image|>: input only,
        # refused in a prompt by name)
        vocab, embedded = model_vocab_sizes(model)
        size, what = (embedded, "embeds") if embedded else (vocab, "scores")
        if size and self.tokenizer.vocab_size > size:
            raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} ids but the model "
                             f"{what} {size}: mismatched vocabularies")
        self.vocab_size = vocab or self.tokenizer.vocab_size
        # the most tokens a context may hold (None: no limit): the model's, or less
        model_len, want = model_max_length(model), self.config.max_model_len
        if want is not None and model_len is not None and want > model_len:
            raise ValueError(f"config.max_model_len={want} exceeds the model's context length "
                             f"{model_len} (its config's max_position_embeddings): positions "
                             f"past it are not trained (or not embedded at all)")
        self.max_model_len: int | None = model_len if want is None else want
        device = self._device = next(model.parameters()).device
        # the model's GPU is current in every public call that does device work (Triton
        # launches and graph captures go to the current device), building included
        self._cuda_index = cuda_index(device)
        self._build(model, global_corpus)
        self._sessions: dict[str, SessionState] = {}
        # continuous batching (submit / step): the requests waiting for room, the running batch
        self._scheduler = Scheduler(self.config.max_batch, self._running_batch, Requests.advance,
                                    self._kv.fits)
        self._proposed: list[str] | None = None  # the sessions of the last public propose
        self._proposed_draft: DraftBatch | None = None  # and its draft, checked as made
        self._generating: set[str] = set()  # the sessions of the running generate() calls
        self._last_sampling: tuple = ((), None)  # (rows of SamplingParams, BatchSampling)
        self._next = 0
        self._next_request = 0  # the next request's id (StepOutput.request_id)
        # a per-instance prefix: one decoder never takes another decoder's session id for
        # one of its own (possibly another tenant's session)
        self._sid_prefix = f"d{uuid.uuid4().hex[:8]}-s"
        # cumulative counters (host): verification steps, tokens emitted, draft tokens
        # drafted and accepted
        self._steps = self._tokens = self._drafted = self._accepted = 0
        self._preemptions = 0  # those of finished generate() calls
        self._calls: list[Scheduler] = []  # the running generate() calls' schedulers

    @device_guard
    def _build(self, model: torch.nn.Module, global_corpus: GlobalCorpus | None) -> None:
        """The decoder's device state: corpora, drafter (its graphs captured), the paged
        runner and its verification graphs, the step's host reader, the sessions' KV."""
        device = self._device
        if self.config.runner == "hf":  # what no list names: probed against its own forward
            check_hf_probe(model)
        self.store = CorpusStore(self.tokenizer, self.config.tiers, device, global_corpus,
                                 vocab_size=self.vocab_size)
        drafter_cfg = self.config.drafter
        if self.config.profiles is not None:
            roles = load_profiles(self.config.profiles, {r.name: r for r in drafter_cfg.roles})
            drafter_cfg = replace(drafter_cfg, roles=tuple(roles.values()))
        self.drafter = Drafter(self.store, drafter_cfg, self.config.max_batch,
                               cost=self._cost_model(), max_sessions=self.config.session_limit)
        self._paged: PagedLlamaRunner | None = None
        if self.config.runner == "paged":  # converted once, here, so a bad model fails early
            cfg = self.config
            pages = -(-cfg.kv_cache_tokens // cfg.page_size)
            try:
                self._paged = PagedLlamaRunner.from_hf_model(
                    model, num_pages=pages, page_size=cfg.page_size, max_seqs=cfg.session_limit,
                    max_pages_per_seq=pages, split_attention=cfg.tree_attention == "split")
            except ValueError as exc:
                raise ValueError(f"model: runner='paged' takes Llama/Qwen2-family models "
                                 f"({exc})") from exc
        self._verify_graphs: VerifyGraphs | None = None
        # why a paged decoder on a GPU verifies eagerly (None: graphed, or not asked for)
        self.verify_graph_error: str | None = None
        if self._paged is not None and self.config.cuda_graphs and device.type == "cuda":
            self._verify_graphs = self._capture_verify_graphs(drafter_cfg.max_nodes)
        # a step's host reads (draft sizes; output tokens and counts), sized for the largest
        self._reader = HostReader(self.config.max_batch * (drafter_cfg.max_nodes + 2), device)
        # each session's KV between generate calls (a call prefills what was appended since)
        self._kv = SessionKVCache(self._paged, self.config.kv_cache_tokens,
                                  reserve_tokens=1 + drafter_cfg.max_nodes,
                                  reserve_new_tokens=self.config.admission == "reserve")

    def _cost_model(self) -> CostModel | BatchCostModels | None:
        """``config.cost_model``, a file of it loaded (ValueError naming it if unreadable)."""
        cost = self.config.cost_model
        if isinstance(cost, (str, Path)):
            try:
                cost = BatchCostModels.from_json(cost)
            except ValueError as exc:
                raise ValueError(f"cost_model: {exc}") from None
        return cost

    def _capture_verify_graphs(self, max_nodes: int) -> VerifyGraphs | None:
        """The paged runner's verification graphs, or None (:attr:`verify_graph_error` says
        why): their padded buckets pay only when replayed as graphs; run eagerly, each step
        would plan over the whole pool's page-table width."""
        if not isinstance(self._paged.attention, FlashInferPagedAttention):
            self.verify_graph_error = ("the paged runner's attention is not FlashInfer "
                                       "(flashinfer missing, or a float32 model)")
            return None
        vg = VerifyGraphs(self._paged, batch_buckets(self.config.max_batch), max_nodes)
        if not vg.uses_graphs:
            self.verify_graph_error = vg.graph_error
            return None
        return vg

    @serialized
    @device_guard
    @torch.no_grad()
    def calibrate_cost_model(self, context_tokens: int, batch_sizes: Sequence[int] | None = None,
                             *, max_draft_tokens: int | None = None, repeats: int = 5,
                             out: str | Path | None = None) -> BatchCostModels:
        """Measures this decoder's verification cost on its model and GPU, and steers the
        batch budget by it from the next step on (``runner="paged"``).

        At each of ``batch_sizes`` (default: the verification graphs' buckets, 1, 2, 4, ...
        ``max_batch``), that many requests of ``context_tokens`` tokens of KV verify no
        draft tokens, then the powers of two up to ``max_draft_tokens`` (default: the most a
        step of the bucket verifies, ``max_nodes`` each) through the same verification
        graphs as the decoder's steps (:func:`~agspec_gpu.calibrate.calibrate_cost_model`);
        ~1 s per batch size on an H100. ``out``: also written there as JSON, which
        ``DecoderConfig(cost_model=out)`` loads into the next decoder of this model and GPU
        (``config.cost_model`` is then these curves). Each batch size ``b`` needs ``b``
        sequences of ``context_tokens`` tokens of KV plus each one's share of the widest
        step's draft tokens (``max_nodes`` by default;
        :func:`~agspec_gpu.calibrate.calibration_pages`): where the pool's free pages or
        sequence rows fall short, idle sessions' kept KV is freed for it, least recently
        used first, as a step does (their next call prefills again;
        :class:`~agspec_gpu.kv_cache.KVCacheFull`, naming the arguments, before anything is
        measured if even that is not enough). Between calls only: no request may run and no
        ``propose`` wait for its ``commit`` (RuntimeError).

        Returns:
            The measured curves (:class:`~agspec_gpu.cost_model.BatchCostModels`).
        """
        if self._paged is None:
            raise ValueError("calibrate_cost_model: needs DecoderConfig(runner='paged') (the "
                             "HF runner's steps are its model's own forward)")
        sizes = check_calibration_args(context_tokens, batch_sizes, self.config.max_batch,
                                       max_draft_tokens, repeats)
        if self._generating or self.running or self.queued or self._proposed is not None:
            raise RuntimeError("calibrate_cost_model: requests are running or queued, or a "
                               "propose() waits for its commit")
        self.drafter.check_between_steps("calibrate_cost_model")
        cache, nodes = self._paged.kv_cache, self.drafter.config.max_nodes
        self._kv.free_idle(max(calibration_pages(cache, b, int(context_tokens),
                                                 int(max_draft_tokens or b * nodes))
                               for b in sizes), max(sizes))
        cost = calibrate_batch_costs(
            self._paged, sizes, int(context_tokens), max_draft_tokens=max_draft_tokens,
            max_nodes=nodes, repeats=repeats,
            verify_graphs=self._verify_graphs,
            source=f"measured: SpecDecoder on {self._device_name()}")
        self.drafter.set_cost(cost)
        self.config = replace(self.config, cost_model=cost)
        if out is not None:
            Path(out).write_text(json.dumps(cost.to_json(), indent=1) + "\n")
        return cost

    def _device_name(self) -> str:
        dev = self._device
        return torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)

    @property
    @serialized
    def stats(self) -> dict[str, int]:
        """Cumulative ``steps`` (verification steps), ``tokens`` (emitted by them),
        ``drafted`` and ``accepted`` draft tokens (what verification accepted, also past
        where a request ended inside the draft: a measure of the drafts; ``tokens`` counts
        the output), ``prefills`` (prefill forwards: one per
        join, a ``generate`` call's first step or a later one, or :meth:`step`'s, each
        also emitting a token per running request) and ``prefill_tokens`` (the context
        tokens they ran, past each session's kept KV), ``preemptions`` (requests that
        left a running batch unfinished to wait for room, :mod:`~agspec_gpu.scheduler`)
        and ``evicted_tenants`` (idle tenants freed past ``TierConfig.idle_budget_tokens``)."""
        return {"steps": self._steps, "tokens": self._tokens, "drafted": self._drafted,
                "accepted": self._accepted, "prefills": self._kv.num_prefills,
                "prefill_tokens": self._kv.num_prefill_tokens,
                "preemptions": self._preemptions + self._scheduler.num_preemptions +
                sum(c.num_preemptions for c in self._calls),
                "evicted_tenants": self.store.num_evicted_tenants}

    # ------------------------------------------------------------ lifecycle
    @serialized
    @device_guard
    def open_session(self, tenant: str, role: str = "default",
                     prompt_ids: Sequence[int] | torch.Tensor = (),
                     session_id: str | None = None, text: str | None = None) -> str:
        """Opens a session and returns its id (``session_id`` if given; must be new).

        ``role``: the session's drafting profile, one of the drafter's roles
        (``DrafterConfig.roles``: ``default``, ``planner``, ``coder``, ``reviewer``, and
        those a ``DecoderConfig(profiles=)`` file adds); another name raises ValueError
        listing them.

        ``text``: the prompt as the agent framework printed it (without chat-template
        markup); the files it shows (editor views, ``[File: ...]`` windows, aider listings:
        :func:`~agspec_gpu.capture.capture_tool_output` without a command) join the
        tenant's workspace tier, as :meth:`append`'s do.
        """
        ids = check_token_ids(prompt_ids, "prompt_ids", self.vocab_size)
        if not ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_model_len is not None and len(ids) > self.max_model_len:
            raise ValueError(f"prompt_ids: {len(ids)} tokens exceed max_model_len="
                             f"{self.max_model_len}")
        if text is not None:
            check_text(text, "text")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError(f"session_id: expected a non-empty str or None, got "
                             f"{session_id!r}")
        if session_id is None:  # the next unused id (a caller may have chosen one like it)
            while f"{self._sid_prefix}{self._next}" in self._sessions:
                self._next += 1
            sid = f"{self._sid_prefix}{self._next}"
            self._next += 1
        elif session_id in self._sessions:
            raise ValueError(f"session_id {session_id!r} already exists")
        else:
            sid = session_id
        files = capture_tool_output(None, text) if text is not None else []
        self.drafter.open_session(sid, tenant, role, ids)
        try:  # (a workspace build out of memory): the session does not stay open, unnamed
            self._add_files(tenant, files)
        except BaseException as exc:
            self.drafter.discard_session(sid, exc)
            raise
        self._sessions[sid] = SessionState(tenant, role, list(ids))
        return sid

    @serialized
    @device_guard
    def append(self, sid: str, token_ids: Sequence[int] | torch.Tensor,
               text: str | None = None) -> list[str | None]:
        """Appends context the model did not generate (a tool output, a user turn).

        The files the session's tenant saw join its workspace tier, so that later drafts
        can quote them: the files the message generated since the last ``append`` wrote
        (heredocs, editor ``create`` calls, aider listings), and, given ``text`` (the
        appended message as the tool printed it, without chat-template markup), the files
        it shows, read with that message's command (``cat``, ``sed -n``, ``nl``, ``grep
        -n``, editor views; :func:`~agspec_gpu.capture.capture_tool_output`).

        Returns:
            The paths of the files captured (None: a file of unknown path).

        Raises:
            ValueError naming the argument, nothing appended. An error of the session
            tier's index after it took the tokens (a level build out of memory) is raised
            with the tokens in the context too (``session_stats(sid).context_len`` tells):
            a retry would append them twice.
        """
        st = self._session(sid)
        self._check_idle([sid], "sid")
        ids = check_token_ids(token_ids, "token_ids", self.vocab_size)
        if self.max_model_len is not None and len(st.context) + len(ids) > self.max_model_len:
            raise ValueError(f"token_ids: {len(ids)} tokens would pass max_model_len="
                             f"{self.max_model_len} (the session's context holds "
                             f"{len(st.context)})")
        if text is not None:
            check_text(text, "text")
        command = self.tokenizer.decode(st.message, skip_special=True) if st.message else None
        files = capture_agent_writes(command) if command else []
        if text is not None:
            files += capture_tool_output(command, text)
        self._supersede([sid])
        before = self.store.session_lengths([sid])
        try:
            self.drafter.extend(sid, ids)
        except BaseException as exc:  # the tier took them (a level build raised): the
            if self.store.took([sid], before, [len(ids)])[0]:
                st.context.extend(ids)  # context too, and the files they showed (a retry
                st.message = []         # would append them twice)
                try:
                    self._add_files(st.tenant, files)
                except Exception as cleanup:  # noqa: BLE001 - noted on the error
                    exc.add_note(f"then adding the captured files failed too: {cleanup!r}")
            raise
        st.context.extend(ids)
        st.message = []
        self._add_files(st.tenant, files)
        return [f.path for f in files]

    def _add_files(self, tenant: str, files) -> None:
        """Indexes the files captured from a session's text; one larger than the
        workspace's whole budget is left out (the text that held it is taken all the
        same)."""
        for f in files:
            try:
                self.store.add_workspace_file(tenant, f.path, f.text, first_line=f.first_line)
            except BudgetExceeded:
                pass

    @serialized
    @device_guard
    def add_workspace_file(self, sid: str, path: str | None, text: str) -> int:
        """Indexes a file the session's tenant opened (all emission forms; ``path`` None:
        text of no file); the tokens added (0: the same text was indexed already).

        Raises:
            ValueError naming the argument, nothing added: bad ``path`` or ``text``, or
            (``BudgetExceeded``) a file whose forms hold more tokens than
            ``TierConfig.workspace_budget_tokens``.
        """
        return self.store.add_workspace_file(self._session(sid).tenant, path, text)

    @serialized
    @device_guard
    def close_session(self, sid: str) -> None:
        """Frees the session's corpus and KV (ending its submitted request, if any); its
        text joins its tenant's history. An error past the point where its corpus was
        freed (a compaction, an idle tenant's eviction out of memory) is raised with the
        session closed; one before it leaves the session open, to be closed again."""
        self._session(sid)
        self._check_idle([sid], "sid", submitted_ok=True)
        self.cancel(sid)
        error = None
        if self.drafter.has_session(sid):  # (else a close that raised closed it there)
            try:
                self.drafter.close_session(sid)
            except BaseException as e:
                if self.drafter.has_session(sid):  # nothing closed: a retry may
                    raise
                error = e  # closed past the error (an idle tenant's eviction): finish
        try:
            self._kv.drop(sid)  # (raising: the session stays here, a retry drops its KV)
        except BaseException as e:
            if error is not None:
                e.add_note(f"closing the session's corpora had failed too: {error!r}")
            raise
        del self._sessions[sid]
        self._supersede([sid])
        if error is not None:
            raise error

    @serialized
    @device_guard
    def close_tenant(self, tenant: str) -> None:
        """Frees the tenant's workspace and history tiers (its sessions must be closed).
        Idle tenants past ``TierConfig.idle_budget_tokens`` are freed without this call.

        Raises:
            KeyError: the tenant is unknown (or already closed, or freed as idle).
            ValueError: the tenant has open sessions.
        """
        open_sids = [sid for sid, st in self._sessions.items() if st.tenant == tenant]
        if open_sids:
            raise ValueError(f"tenant: {tenant!r} has open sessions {open_sids}; close them "
                             f"first")
        self.store.close_tenant(tenant)

    @serialized
    def session_stats(self, sid: str) -> SessionStats:
        """Session ``sid``'s figures since it opened: tokens generated, verification steps,
        drafted and accepted tokens (its own share of :attr:`stats`; tokens per step and
        acceptance rate as properties) and why its last request ended (``generate`` returns
        tokens only: this says whether each ended at EOS, a stop string or its limit)."""
        return self._session(sid).stats()

    def _session(self, sid: str) -> SessionState:
        if not isinstance(sid, str):
            raise KeyError(f"session id: expected a str, got {type(sid).__name__}")
        st = self._sessions.get(sid)
        if st is None:
            raise KeyError(f"session {sid!r} is unknown or closed (sessions of another "
                           "decoder are unknown here)")
        return st

    # ------------------------------------------------------------ your own loop
    @serialized
    @device_guard
    def propose(self, session_ids: Sequence[str]) -> DraftBatch:
        """Draft trees for one verification step of ``session_ids`` (distinct, open).

        Tree ``b`` continues session ``b``'s last token, its *root* (:meth:`root_ids`), which
        your KV cache does not hold yet. Verify ``[root, node_0, ..., node_{N-1}]`` per session
        in one forward (:meth:`tree_inputs`: ids, positions and the in-tree mask; every row
        also attends the session's cached context), then pass the logits to :meth:`commit`.
        ``N`` is the drafter's static ``max_nodes`` (fixed shapes for CUDA graphs);
        ``draft.narrowed(...)`` to the widest tree is fine too. Only the latest propose of
        these sessions can be committed: a propose replaces the last one's. :meth:`commit`
        checks the sessions and their order against it, and the draft passed is verified
        as given (a narrowed or built one is checked), not matched to the propose's object:
        pass the latest one's (the logits of an older draft, computed before an
        :meth:`append`, would commit tokens predicted for another context).

        Each tree is at most its session's room under :attr:`max_model_len` less one token
        deep (the step's bonus token takes the last), so no position reaches the limit;
        a session whose context is full raises ValueError naming it, nothing proposed.

        Returns:
            :class:`DraftBatch` of device tensors (``PAD_ID`` padded).
        """
        sids = self._batch(session_ids)
        if not sids:
            raise ValueError("session_ids: propose() drafts for at least one session")
        self._check_idle(sids)
        bounds = None  # no node past the model's last position: depth <= room - 1
        if self.max_model_len is not None:
            room = [self.max_model_len - len(self._sessions[s].context) for s in sids]
            full = [s for s, r in zip(sids, room) if r < 1]
            if full:
                raise ValueError(f"session_ids: the contexts of {full} hold max_model_len="
                                 f"{self.max_model_len} tokens: no room for another")
            bounds = [r - 1 for r in room]
        if self._proposed is not None:  # the last propose's draft: never committed now
            self.drafter.forget(self._proposed)
            self._proposed = self._proposed_draft = None
        with nvtx.annotate("agspec.propose"):
            draft = self.drafter.propose(sids, max_depths=bounds)
        self._proposed, self._proposed_draft = sids, draft
        return draft

    @serialized
    @device_guard
    def root_ids(self, session_ids: Sequence[str]) -> torch.Tensor:
        """``int32 [B]`` each session's last token: row 0 of its verification."""
        states = [self._session(s) for s in self._batch(session_ids)]
        return to_device([st.context[-1] for st in states], torch.int32, self._device)

    @serialized
    @device_guard
    def tree_inputs(self, session_ids: Sequence[str], draft: DraftBatch) -> TreeInputs:
        """The verification forward's inputs for ``draft`` (:meth:`DraftBatch.tree_inputs`):
        ``[root, nodes]`` ids, positions from each session's cached length
        ``len(context) - 1``, and the ``bool [B, 1+N, 1+N]`` in-tree mask.

        A draft other than the one :meth:`propose` returned for these sessions in this
        order (a narrowed, masked or built one, or its own draft given other sessions) is
        checked first, in one device read, as :meth:`commit` checks it: at most the
        drafter's ``max_nodes`` wide and ``max_draft_depth`` deep, sizes, token ids in the
        vocabulary, parents earlier nodes; ValueError naming the field, before your
        forward would index the embedding with it. A read more checks its positions: a node
        at :attr:`max_model_len` or past it raises ValueError naming ``draft``."""
        sids = self._batch(session_ids)
        states = [self._session(s) for s in sids]
        check_draft(draft, len(states), self.drafter.config.max_nodes)
        # propose's own draft of these sessions in this order stays inside their rooms
        built = draft is not self._proposed_draft or sids != self._proposed
        if built:
            draft.checked_sizes(self.vocab_size, self._reader,
                                self.drafter.config.max_draft_depth)
        dev = draft.token_ids.device
        inputs = draft.tree_inputs(to_device([st.context[-1] for st in states], torch.int64,
                                             dev),
                                   to_device([len(st.context) - 1 for st in states],
                                             torch.int64, dev))
        if built and self.max_model_len is not None and inputs.position_ids.numel():
            (last,) = self._reader.read(inputs.position_ids.amax(1))
            past = [s for s, p in zip(sids, last) if p >= self.max_model_len]
            if past:
                raise ValueError(f"draft: the trees of {past} reach position "
                                 f"{max(last)}, past max_model_len={self.max_model_len} "
                                 f"(a node's position must stay below it)")
        return inputs

    @serialized
    @device_guard
    def commit(self, session_ids: Sequence[str], draft: DraftBatch, logits: torch.Tensor,
               sampling: SamplingParams | Sequence[SamplingParams] | None = None,
               generator: torch.Generator | None = None, *,
               qo_indptr: torch.Tensor | None = None, eos_id: int | None = None,
               max_new_tokens: int | Sequence[int] | None = None,
               stop: str | Sequence[str] | Sequence[Sequence[str]] | None = None
               ) -> AcceptResult:
        """Accepts a verified step of the last :meth:`propose` of ``session_ids``.

        Args:
            draft: the proposed trees (or a narrowed / masked copy of them; a built
                one at most the drafter's ``max_nodes`` wide and ``max_draft_depth`` deep).
            logits: ``[B, 1 + N, V]`` the target's logits at each root (row 0) and node ``j``
                (row ``1 + j``), ``N = draft.max_nodes``, ``V >= `` the model's vocabulary
                (columns past it, a padded head's, are ignored); rows of padding nodes are
                ignored. With ``qo_indptr``: the flat rows
                ``[total_q, V]`` of a ragged batch (FlashInfer's layout, as
                :func:`agspec_gpu.tree.plan_tree` plans it), request ``b``'s root at row
                ``qo_indptr[b]`` and node ``j`` at ``qo_indptr[b] + 1 + j``.
            qo_indptr: ``int32 [B + 1]`` (or int64), with ``qo_indptr[b + 1] - qo_indptr[b]
                = 1 + draft.num_draft_tokens[b]``; read once to check it.
            sampling: None or temperature 0 = greedy (the output is the target's greedy
                tokens); else multi-branch rejection sampling (the target distribution).
                One :class:`SamplingParams` for all, or one per session.
            eos_id: an end token (-1: the tokenizer's; None: none): a session's output ends
                with its first one, the draft tokens accepted after it are not taken.
            max_new_tokens: the most tokens each session takes from this step (what its
                request may still emit; >= 1): one for all, or one per session; None: no
                limit.
            stop: stop strings (as :meth:`generate` takes them): a session's output ends
                with the first token that completes one of them in the text it generated
                since its last :meth:`append` (its message: a stop string may begin in an
                earlier step's tokens; one the message already held does not count).

        Returns:
            :class:`AcceptResult`: per session ``output_ids[b, :num_output[b]]`` (the accepted
            draft tokens, then the bonus token: the next root) and ``accepted_nodes`` (the
            draft nodes whose KV your cache keeps, after the root's). The tokens join each
            session's context, its session tier and the controller. A session that
            ``eos_id``, a stop string, ``max_new_tokens`` or a context full to
            :attr:`max_model_len` ended keeps the tokens up to its end only: ``num_output``
            counts them, ``num_accepted = num_output - 1`` and the rest is ``PAD_ID``
            (its last token is the root a next step would take), and
            ``session_stats(sid).finish_reason`` says ``"eos"``, ``"stop"`` or ``"length"``
            (None for a session this step did not end: its request runs).

        Raises:
            KeyError / ValueError naming the argument, nothing committed (the proposal
            stands: a corrected commit may follow), for bad arguments and for ``logits``
            whose rows that chose the step's tokens (the root's, the accepted nodes') hold
            a NaN or +inf, or only -inf (a model fault; a rejected node's row is not read).
            A drafter error after the session tiers took the step's tokens (a level build
            out of memory) is raised with the step committed: the contexts hold its
            tokens (``session_stats(sid).context_len`` counts them; ``root_ids`` is the
            bonus token) and the proposal is spent, so a retry cannot append them twice;
            the loop's verifier, which never got the result, starts again from the
            sessions' contexts.
        """
        sids = self._batch(session_ids)
        if self._proposed != sids:
            raise ValueError("session_ids: commit() must follow propose() of the same "
                             f"sessions in the same order (last propose: {self._proposed})")
        check_draft(draft, len(sids), self.drafter.config.max_nodes)
        check_commit_logits(logits, draft, self.vocab_size, flat=qo_indptr is not None)
        self._check_generator(generator)
        # the sessions' end rules: the Requests that generate() would build
        ends = commit_end_rules(sids, [self._sessions[s] for s in sids], self._eos(eos_id),
                                max_new_tokens, stop, self.vocab_size, self.tokenizer,
                                self.max_model_len, 1 + draft.max_nodes)
        logits = logits[..., :self.vocab_size]  # a padded head's columns are no tokens
        num_draft = draft.checked_sizes(  # (propose's own draft is no deeper)
            self.vocab_size, self._reader,
            None if draft is self._proposed_draft else self.drafter.config.max_draft_depth)
        if qo_indptr is not None:
            check_qo_indptr(qo_indptr, num_draft, logits)
        params = self._sampling(sampling, len(sids))
        pos = None  # a seeded request's draws are keyed by sequence position
        if params.any_seeded:
            pos = to_device([len(self._sessions[s].context) for s in sids], torch.int64,
                            logits.device)
        with nvtx.annotate("agspec.commit"):
            res = accept_tree(draft, logits, params, generator, qo_indptr, positions=pos)
            faulty = rows_without_finite_max(draft, logits, qo_indptr, res.accepted_nodes)
            n_out, rows, faulty = self._reader.read(res.num_output, res.output_ids, faulty)
            if any(faulty):  # (nothing committed: propose() stands, commit may be retried)
                raise ValueError(
                    f"logits: the rows of session(s) {[s for s, f in zip(sids, faulty) if f]}"
                    f" hold a NaN or +inf, or only -inf (no next token): a model fault")
            new = [r[:n] for r, n in zip(rows, n_out)]
            states = [self._sessions[s] for s in sids]
            reasons = [st.finish_reason for st in states]  # back if the drafter raises
            observed = False
            try:
                for st in states:  # each own-loop request runs, unless this step ends it
                    st.finish_reason = None
                if ends is not None:  # the stop strings see the message so far
                    for matcher, st in zip(ends.stop, states):
                        matcher.seed(st.message)
                    new = ends.emit(new)
                taken = list(map(len, new))
                # the counts are read already: committed as the serving loop commits (one
                # path, a request cut at its end included), settled at once by _record
                self.drafter.observe(sids, res.output_ids, res.num_output, res.num_accepted,
                                     validate=False, path_nodes=res.accepted_nodes,
                                     defer=True)
                observed = True
                self._record(sids, taken, n_out, num_draft)
            except BaseException as exc:
                if not (observed and not self.drafter.commit_pending):
                    for st, reason in zip(states, reasons):
                        st.finish_reason = reason
                    try:  # a settle that raised before the tiers took the tokens: none
                        self.drafter.withdraw()
                    except Exception as cleanup:  # noqa: BLE001 - noted on the error
                        exc.add_note(f"then withdrawing the drafter's commit failed too: "
                                     f"{cleanup!r}")
                    raise
                # the settle raised after the session tiers took the tokens (a level
                # build): the step happened; the contexts take them too, the proposal is
                # spent (a retry would append them twice)
                self._commit_contexts(sids, new)
                raise
            self._commit_contexts(sids, new)
        return res if taken == n_out else cut_result(res, taken)

    def _commit_contexts(self, sids: list[str], new: list[list[int]]) -> None:
        """The sessions' contexts take what a committed step emitted; its proposal is
        spent."""
        for s, toks in zip(sids, new):
            self._sessions[s].extend(toks)
        self._proposed = self._proposed_draft = None

    def _batch(self, session_ids: Sequence[str], bounded: bool = True) -> list[str]:
        """``session_ids`` as a list, checked: distinct, open, at most ``max_batch`` (when
        ``bounded``: they run as one batch)."""
        if isinstance(session_ids, str) or not isinstance(session_ids, Iterable):
            raise ValueError(f"session_ids: expected a list of session ids, got "
                             f"{session_ids!r}")
        sids = list(session_ids)
        if bounded and len(sids) > self.config.max_batch:
            raise ValueError(f"session_ids: {len(sids)} sessions exceed DecoderConfig."
                             f"max_batch={self.config.max_batch}; propose for them in "
                             f"batches, or raise max_batch")
        for s in sids:
            self._session(s)
        if len(set(sids)) != len(sids):
            raise ValueError("session_ids must be distinct")
        return sids

    def _sampling(self, sampling, num_sessions: int) -> BatchSampling:
        """``sampling`` (None = greedy; one ``SamplingParams``; or one per session, None =
        greedy) as rows of the batch, validated before anything changes."""
        greedy = SamplingParams(temperature=0.0)
        if sampling is None or isinstance(sampling, SamplingParams):
            rows = (sampling or greedy,)
        else:
            rows = tuple(p or greedy for p in per_session(
                sampling, num_sessions, "sampling", (SamplingParams, type(None))))
        # a user's loop commits with the same params step after step: their device
        # tensors are made once, not per step
        if self._last_sampling[0] != rows:
            self._last_sampling = (rows, BatchSampling.of(list(rows), self._device))
        return self._last_sampling[1]

    def _record(self, sids: list[str], taken: list[int], num_output: list[int],
                num_draft: list[int]) -> None:
        """Settles the step's drafter commit (``Drafter.observe(defer=True)``, queued before
        the host read the step) with ``taken[b]`` output tokens of each session (session
        tier, recent tokens) and counts them; ``taken`` is ``num_output`` (host) cut where
        a request ended; ``num_draft``: the verified draft sizes (host). A settle that
        raises before the session tiers took the tokens leaves the counters as they were;
        one that raises after (a level build) counts the step, whose tokens the sessions
        keep."""
        try:
            self.drafter.settle(taken, num_queued_host=num_output)
        except BaseException:
            if not self.drafter.commit_pending:  # the corpora took the tokens
                self._count_step(sids, taken, num_output, num_draft)
            raise
        self._count_step(sids, taken, num_output, num_draft)

    def _count_step(self, sids: list[str], taken: list[int], num_output: list[int],
                    num_draft: list[int]) -> None:
        """Counts a settled step in the decoder's and the sessions' counters."""
        self._steps += 1
        self._tokens += sum(taken)
        self._drafted += sum(num_draft)
        self._accepted += sum(num_output) - len(num_output)
        for sid, t, n_out, n_draft in zip(sids, taken, num_output, num_draft):
            st = self._sessions[sid]
            st.num_steps += 1
            st.num_step_tokens += t
            st.num_drafted += n_draft
            st.num_accepted += n_out - 1

    # ------------------------------------------------------------ generation
    @serialized
    @device_guard
    @torch.no_grad()
    def generate(self, session_ids: Sequence[str], max_new_tokens: int | Sequence[int] = 256,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 stop: str | Sequence[str] | Sequence[Sequence[str]] | None = (),
                 speculate: bool | Sequence[bool] = True, eos_id: int | None = -1,
                 generator: torch.Generator | None = None,
                 on_tokens: Callable[[str, list[int]], bool | None] | None = None
                 ) -> list[list[int]]:
        """Generates for a batch of sessions; returns the new tokens per session.

        A request that ends (EOS, a stop string, its limit, its callback) leaves the batch
        before the next step, its KV kept: the rest run on without its row and pages. At
        most ``max_batch`` requests run at once; the others wait, in order, and join as
        requests end, as submitted ones do in :meth:`step` (``runner="paged"``: each once
        the KV pool holds it beside those running, as ``DecoderConfig.admission`` says;
        one that fits nowhere runs alone).

        Args:
            session_ids: open sessions (distinct, not submitted to :meth:`step`), any
                number.
            max_new_tokens: per session (ints >= 0): one limit for all, or one per session.
                A limit of 0 returns no tokens at once, its ``finish_reason`` ``"length"``
                (:meth:`commit` and :meth:`submit` take >= 1: a verified step emits one).
                A request also ends at ``"length"`` when its context holds
                :attr:`max_model_len` tokens (one already full returns none).
            sampling: None or temperature 0 = greedy (lossless: equals plain greedy); one
                :class:`SamplingParams` for all, or one per session (a batch may mix greedy
                and sampled requests).
            stop: a string or strings that end a request (the output ends with the token
                completing one); or one list of them per session; None: none. A stop
                string counts in this call's output alone, decoded on its own (as a
                server's request: text from an earlier call does not complete one;
                :meth:`commit`'s message spans its calls; a SentencePiece tokenizer's
                decode drops the output's leading space, so " x" cannot stop its first
                token).
            speculate: per-request opt-out of drafting.
            eos_id: end token (-1: the tokenizer's); the output ends with it.
            on_tokens: streaming callback ``(sid, new_tokens)`` after every step; returning
                False ends that session's request there (a client that went away), the
                others go on; None or True go on, any other return raises TypeError. The
                call's sessions are busy for it (its ``append``, ``generate``,
                ``propose``, ``submit``, ``cancel`` or ``close_session`` of them raise).
                It runs with the model's GPU current; for a request's last tokens,
                ``session_stats(sid).finish_reason`` already says why it ends. It runs
                holding the decoder (other threads' calls wait): one that waits for
                another thread's call of the decoder (a full bounded queue whose consumer
                reads ``session_stats``, say) waits for good.

        Returns:
            The new tokens per session, in ``session_ids`` order (why each ended:
            ``session_stats(sid).finish_reason``).

        Raises:
            KeyError / ValueError naming the argument before anything changes, as does
            :class:`~agspec_gpu.kv_cache.KVCacheFull` for a session whose context and first
            step exceed even an empty KV pool, or the pages the submitted requests'
            running batch leaves (``runner="paged"``). An error
            raised later (in a step, or by ``on_tokens``) leaves each session's context,
            session tier and kept KV in step at what was emitted before it: the next call
            continues from there. Every token emitted was passed to ``on_tokens`` (one that
            raises does not keep the step's other sessions from their calls; the first
            error is raised after them).
        """
        sids = self._batch(session_ids, bounded=False)
        self._check_idle(sids)
        # a call runs while the submitted requests' batch keeps its pages
        reqs = self._requests(sids, max_new_tokens, sampling, stop, speculate, eos_id,
                              beside_running=True)
        self._check_generator(generator)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"on_tokens: expected a callable or None, got "
                             f"{type(on_tokens).__name__}")
        self._supersede(sids)
        reqs.start()
        # the call's own queue and running batch (beside the submitted requests'): the
        # requests join at its first step, or as requests end and the KV pool holds them
        call = Scheduler(self.config.max_batch, self._running_batch,
                         lambda r, new: r.advance(new, on_tokens), self._kv.fits)
        for row, done in zip(reqs.rows(), reqs.done):
            if not done:  # a limit of 0 ended at once
                call.submit(row)
        # busy until the call returns: a callback's append, generate, propose, submit or
        # close_session of them would move a context under the running batch
        self._generating.update(sids)
        self._calls.append(call)  # its preemptions count in stats while it runs
        try:
            while call.running or call.queued:
                call.step(generator)  # an error ends the running requests; the rest never ran
        except BaseException as exc:
            try:  # a batch an error left running (one raised between or before a step's
                call.end_after(exc)  # own handling) ends: its sessions' KV is not in use
            except BaseException as cleanup:  # noqa: BLE001 - noted on the error
                exc.add_note(f"then ending the call's batch failed too: {cleanup!r}")
            reqs.fail()  # "error": the ones that ran and the ones still waiting
            raise
        finally:
            self._generating.difference_update(sids)
            self._calls.remove(call)
            self._preemptions += call.num_preemptions
        return reqs.outs

    # ------------------------------------------------------------ continuous batching
    @serialized
    def submit(self, session_id: str, max_new_tokens: int = 256,
               sampling: SamplingParams | None = None, stop: str | Sequence[str] | None = (),
               speculate: bool = True, eos_id: int | None = -1) -> int:
        """Queues a request of an open session for :meth:`step` (continuous batching);
        returns its id, which each of its :class:`StepOutput` carries (``request_id``).

        The request joins the running batch at the next step with room (``max_batch``
        requests run at once; the rest wait in submission order). Arguments as
        :meth:`generate`'s, for one session. The session is busy until the request ends
        (``generate``, ``propose``, ``append`` and another ``submit`` of it raise). A
        request that could not run even alone in an empty KV pool raises
        :class:`~agspec_gpu.kv_cache.KVCacheFull` here, queueing nothing; one of a session
        whose context holds :attr:`max_model_len` tokens raises ValueError.
        """
        sid = self._batch([session_id])[0]
        self._check_idle([sid], "session_id")
        # one session's scalars (generate's per-session lists would pass _requests for one)
        for name, v, kinds in (("max_new_tokens", max_new_tokens, Integral),
                               ("sampling", sampling, (SamplingParams, type(None))),
                               ("speculate", speculate, bool)):
            if not isinstance(v, kinds) or (name == "max_new_tokens" and isinstance(v, bool)):
                raise ValueError(f"{name}: submit() takes one session's value, got {v!r}")
        if not isinstance(stop, (str, bytes, bytearray, Mapping)) and isinstance(stop, Iterable):
            stop = list(stop)
            if any(not isinstance(x, str) for x in stop):
                raise ValueError(f"stop: submit() takes one session's stop strings, got "
                                 f"{stop!r}")
        reqs = self._requests([sid], max_new_tokens, sampling, stop, speculate, eos_id)
        if reqs.limits[0] == 0:  # (the limit is at most the context's room)
            raise ValueError("max_new_tokens: a submitted request needs >= 1" if
                             max_new_tokens < 1 else
                             f"session_id: the session's context holds max_model_len="
                             f"{self.max_model_len} tokens: no room for another")
        self._scheduler.submit(reqs)
        reqs.start()
        self._supersede([sid])
        return reqs.rids[0]

    @serialized
    @device_guard
    @torch.no_grad()
    def step(self, generator: torch.Generator | None = None) -> list[StepOutput]:
        """Runs one step of the submitted requests; returns what each running one emitted.

        If requests wait and the batch has room, they join (in submission order, each once
        the KV pool holds it beside the running requests, as ``DecoderConfig.admission``
        says; one that fits nowhere runs alone, when nothing else does): one forward
        prefills them
        (after their sessions' kept KV) and gives every running request one token, as a
        plain decoding step does (``runner="paged"``: the running requests' KV stays in
        place; ``"hf"``: the padded cache is rebuilt, one copy of their KV per join).
        Otherwise one speculative step (propose, verify, accept, commit), after the newest
        requests leave the batch unfinished to wait again if the pool cannot hold the step
        (``runner="paged"``, :mod:`~agspec_gpu.scheduler`). Greedy requests stay plain
        greedy decoding whatever joins, leaves or is preempted around them. Requests that end
        leave the batch before ``step`` returns (their KV kept), so their sessions take
        ``append`` and a new ``submit`` at once.

        Returns:
            :class:`StepOutput` per request that ran (none when nothing is submitted),
            after those a failed step or cancel ended and had not yet returned (finished,
            ``"error"`` unless they had ended otherwise; tokens possibly none).

        Raises:
            What a step raises (a full KV pool, say): the step's requests (running and
            joining) end there, their sessions usable and in step at what they emitted;
            requests still queued stay queued. Tokens the failed step had put into its
            sessions' contexts (a session tier's level build that failed after the tier
            took them; requests that failed to leave) come first in the next ``step``'s
            outputs, each finished with its request's reason (``"error"`` unless it ended
            in that step), so the outputs always spell the contexts; a session that
            moves on first (``submit``, ``generate``, ``append``, ``cancel``,
            ``close_session``) drops its share, which would read as its new request's.
        """
        self._check_generator(generator)
        return self._scheduler.step(generator)

    @serialized
    @device_guard
    def cancel(self, session_id: str, request_id: int | None = None) -> None:
        """Ends ``session_id``'s submitted request now (queued: dropped; running: leaves
        the batch, its KV and what it emitted kept). For an idle session it only drops
        what a failed :meth:`step` had not yet returned of it; raises
        ValueError for one in a running :meth:`generate` (its ``on_tokens`` returning
        False ends its request). ``request_id`` (what :meth:`submit` returned): that
        request only, a no-op once it ended (a client that went away never ends the
        session's next request). If the request's leaving fails (raised here), the batch
        ends as after a failed step: the next :meth:`step` returns each other request of
        it finished with ``"error"``."""
        if request_id is not None and not is_int(request_id):
            raise ValueError(f"request_id: expected None or an int from submit(), got "
                             f"{request_id!r}")
        self._session(session_id)
        self._check_idle([session_id], "session_id", submitted_ok=True)
        self._scheduler.cancel(session_id, request_id)

    @property
    @serialized
    def running(self) -> list[str]:
        """Sessions whose submitted request is in the running batch."""
        return self._scheduler.running

    @property
    @serialized
    def queued(self) -> list[str]:
        """Sessions whose submitted request waits for room in the batch."""
        return self._scheduler.queued

    def _eos(self, eos_id):
        """The tokenizer's EOS for the default ``-1`` (an integer: any other value goes to
        the end rules' checks as given)."""
        return self.tokenizer.eos_id if is_int(eos_id) and eos_id == -1 \
            else eos_id

    def _check_idle(self, sids: list[str], name: str = "session_ids",
                    submitted_ok: bool = False) -> None:
        hit = [s for s in sids if s in self._generating]
        if hit:
            raise ValueError(f"{name}: session {hit[0]!r} is in a running generate() call "
                             f"(its on_tokens returning False ends its request there)")
        if submitted_ok:
            return
        busy = set(self.running) | set(self.queued)
        hit = [s for s in sids if s in busy]
        if hit:
            raise ValueError(f"{name}: session {hit[0]!r} has a submitted request (step() "
                             f"runs it; cancel() ends it)")

    def _supersede(self, sids: list[str]) -> None:
        """A pending :meth:`propose` of any of ``sids`` is stale: their context moves on
        elsewhere (``commit`` of it then raises); one of other sessions stays valid. So is
        what a failed step had not yet returned of them (:meth:`step`), and the drafter's
        record of the proposal (a request cancelled before its first step had left it, and
        calibration refused until the session moved)."""
        if self._proposed is not None and not set(sids).isdisjoint(self._proposed):
            self._proposed = self._proposed_draft = None
        self.drafter.forget(sids)
        self._scheduler.discard(sids)

    def _check_generator(self, generator) -> None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator: expected a torch.Generator or None, got "
                             f"{type(generator).__name__}")
        if generator is not None and generator.device.type != self._device.type:
            raise ValueError(f"generator: on {generator.device}, the model on {self._device}")

    def _requests(self, sids, max_new_tokens, sampling, stop, speculate, eos_id,
                  beside_running: bool = False) -> Requests:
        """The requests of ``sids`` with per-session arguments, validated (nothing changes
        on an error, a request that could not run even alone in the KV pool, or beside
        the running batches' pages for ``beside_running``, included); their outputs are
        new lists."""
        states = [self._sessions[s] for s in sids]
        reqs = Requests.build(sids, states, max_new_tokens, sampling, stop, speculate,
                              self._eos(eos_id), self.vocab_size, self.tokenizer,
                              first_id=self._next_request, max_context=self.max_model_len)
        self._kv.check_fits_alone(sids, [st.context for st in states], reqs.limits,
                                  beside_running)
        self._next_request += len(sids)
        return reqs

    # ------------------------------------------------------------ the running batch
    def _running_batch(self, reqs: Requests) -> RunningBatch:
        runner = HFRunner(self.model) if self._paged is None else \
            PagedBatch(self._paged, self._verify_graphs)
        return RunningBatch(reqs, runner, self.drafter, self._kv,
                            lambda params: self._sampling(params, len(params)), self._record,
                            self._reader)
