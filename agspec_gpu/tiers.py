"""Corpus tiers: session, tenant workspace, tenant history, and the shared global corpus.

All corpora of one :class:`CorpusStore` live in one :class:`~agspec_gpu.index.IndexArena`,
so one batched match serves every request of a step. A request searches its own session
corpus, its tenant's workspace and history, and the global corpus: never another tenant's.

Every token carries a source tag ``tier * 8 + form`` (``form`` = index in
:class:`~agspec_gpu.forms.EmissionForm`), which drafts report per node.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import torch

from agspec_gpu.checks import (check_bool_fields, check_float_fields, check_int_fields, check_text,
                               check_token_ids, check_tuple_field, is_int)
from agspec_gpu.corpus import BudgetExceeded, DocumentCorpus
from agspec_gpu.forms import DEFAULT_FORMS, EmissionForm, render_forms
from agspec_gpu.host import to_device
from agspec_gpu.index import IndexArena, IndexConfig
from agspec_gpu.kernels.suffix_array import build_context_array
from agspec_gpu.tokenizer import Tokenizer, load_tokenizer

SEP = -1  # document separator in every corpus
_FORM_INDEX = {f: i for i, f in enumerate(EmissionForm)}


class CorpusTier(IntEnum):
    SESSION = 0
    WORKSPACE = 1
    HISTORY = 2
    GLOBAL = 3


def source_code(tier: CorpusTier, form: EmissionForm = EmissionForm.RAW) -> int:
    return int(tier) * 8 + _FORM_INDEX[form]


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Which tiers and forms are searched, and their budgets (tokens; the idle budget
    counts the token slots corpora reserve).

    A tenant's workspace and history evict least-recently-used documents past their budget,
    down to ``*_low_water`` times it, and re-index what stays (the whole corpus): a low
    water of 1 would re-index a full history at every session close (~100x the closed
    session's tokens at the default budget), 0.75 does so once per quarter budget closed.

    Tenants with no open session (idle) together hold at most ``idle_budget_tokens`` of
    workspace and history: past it, whenever a session closes or a file joins an idle
    tenant, the least recently active idle tenants are freed whole, as
    :meth:`CorpusStore.close_tenant` frees one (a server whose tenants come and go keeps
    a bounded store without calling it); the tenant just active is never the one freed
    (one over the budget alone, possible only with per-tenant budgets above it, frees
    every other idle tenant), and idle tenants holding nothing (history off) are freed
    too. None: idle tenants are kept until closed. The budget counts the token slots
    their corpora reserve (the tokens held and their room to grow; a corpus reserves at
    least 1,024, so a tenant left with one short session's history counts 1,024: counting
    tokens, 600 such tenants had held 5 MB on a budget of 12,600 tokens). A slot costs at
    most 9 bytes of device memory (id, source tag, suffix-array entry), so the default
    bounds idle tenants to ~0.22 GB.
    """

    max_depth: int = 32
    tail_tokens: int = 1024
    use_workspace: bool = True
    use_history: bool = True
    use_global: bool = True
    forms: tuple[EmissionForm, ...] = DEFAULT_FORMS
    workspace_budget_tokens: int = 4_000_000
    history_budget_tokens: int = 2_000_000
    workspace_low_water: float = 0.5
    history_low_water: float = 0.75
    idle_budget_tokens: int | None = 24_000_000

    def __post_init__(self) -> None:
        check_int_fields(self, ("max_depth", "tail_tokens", "workspace_budget_tokens",
                                "history_budget_tokens", "idle_budget_tokens"),
                         optional=("idle_budget_tokens",))
        check_bool_fields(self, ("use_workspace", "use_history", "use_global"))
        check_float_fields(self, ("workspace_low_water", "history_low_water"))
        if isinstance(self.forms, (set, frozenset)) and \
                all(isinstance(f, EmissionForm) for f in self.forms):  # in the enum's order
            object.__setattr__(self, "forms", tuple(f for f in EmissionForm if f in self.forms))
        check_tuple_field(self, "forms", EmissionForm)
        if EmissionForm.RAW not in self.forms:
            raise ValueError("forms must include EmissionForm.RAW")
        if self.workspace_budget_tokens < 1 or self.history_budget_tokens < 1:
            raise ValueError("tier budgets must be >= 1 token")
        for name in ("workspace_low_water", "history_low_water"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.idle_budget_tokens is not None and self.idle_budget_tokens < 1:
            raise ValueError(f"idle_budget_tokens must be None or an int >= 1, got "
                             f"{self.idle_budget_tokens!r}")
        IndexConfig(self.max_depth, self.tail_tokens)  # validates both


@dataclass
class _Tenant:
    version: int = 0  # bumped whenever workspace or history text changes
    ws: DocumentCorpus | None = None  # documents: (path, digest) -> emission forms
    # documents: (session id, n-th close of the tenant) -> its token stream (a session id
    # may be reused once its session closed: its text is another document)
    hist: DocumentCorpus | None = None
    num_closed: int = 0
    sessions: set[str] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        """Workspace and history tokens held (separators included)."""
        return sum(d.num_tokens for d in (self.ws, self.hist) if d is not None)

    @property
    def num_slots(self) -> int:
        """Token slots the workspace and history reserve (what the idle budget counts)."""
        return sum(d.num_slots for d in (self.ws, self.hist) if d is not None)

    @property
    def workspace(self) -> int | None:
        return None if self.ws is None else self.ws.cid

    @property
    def history(self) -> int | None:
        return None if self.hist is None else self.hist.cid


@dataclass
class _Session:
    tenant: str
    corpus: int
    closed: bool = False


class CorpusStore:
    """Owns every corpus of a decoder and keeps tenants apart.

    Args:
        tokenizer: the real tokenizer; workspace text is tokenized whole, per form.
        config: tiers, forms and budgets.
        device: where the arena lives.
        global_corpus: optional :class:`GlobalCorpus` shared read-only by every tenant.
        vocab_size: the model's vocabulary when it is padded past the tokenizer's; corpus
            tokens must be in ``[0, max(vocab_size, tokenizer.vocab_size))``.
    """

    def __init__(self, tokenizer: Tokenizer, config: TierConfig | None = None,
                 device: torch.device | str = "cpu", global_corpus: "GlobalCorpus | None" = None,
                 vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        # the model's vocabulary may be padded past the tokenizer's (Qwen2: 151936 vs
        # 151665), and the model may emit a padding id: the corpora accept every model id
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self.config = config or TierConfig()
        self.arena = IndexArena(IndexConfig(self.config.max_depth, self.config.tail_tokens),
                                device, initial_tokens=1 << 16)
        # least recently active first (a tenant moves to the end whenever it opens or closes
        # a session or a file joins its workspace): the order idle tenants are freed in
        self._tenants: dict[str, _Tenant] = {}
        self.num_evicted_tenants = 0  # idle tenants freed by idle_budget_tokens
        self._sessions: dict[str, _Session] = {}
        # changes whenever any session's corpora or any tenant's text (its version) change:
        # a caller's copy of corpora_of rows is current while it is unchanged
        self.epoch = 0
        self.global_cid: int | None = None
        if global_corpus is not None and self.config.use_global:
            global_corpus.check(tokenizer, self.config.max_depth)
            self.global_cid = self.arena.add_prebuilt(
                global_corpus.tokens.to(self.arena.device), global_corpus.sa,
                global_corpus.indexed_end, source_code(CorpusTier.GLOBAL))

    # ------------------------------------------------------------ sessions
    def open_session(self, sid: str, tenant: str,
                     prompt_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Opens a session corpus holding ``prompt_ids``; returns them as checked
        (``int32 [n]`` on the arena's device, in the vocabulary), for a caller that keeps
        them too (the drafter's ring)."""
        if not isinstance(sid, str) or not sid:
            raise ValueError("sid must be a non-empty string")
        if sid in self._sessions:
            raise ValueError(f"sid {sid!r}: a session with this id already exists")
        _check_tenant(tenant)
        ids = self._as_tokens(prompt_ids, "prompt_ids")
        t = self._touch(tenant)
        cid = self.arena.new_corpus(max(2 * ids.numel(), 1024))
        try:
            self.arena.append(cid, ids, source_code(CorpusTier.SESSION), separators=())
        except BaseException as exc:  # (a level build out of memory): nothing opened
            try:
                self.arena.free(cid)
            except Exception as cleanup:  # noqa: BLE001 - noted on the error that matters
                exc.add_note(f"then freeing the session's corpus failed too: {cleanup!r}")
            raise
        self._sessions[sid] = _Session(tenant, cid)
        t.sessions.add(sid)
        self.epoch += 1
        return ids

    def append_session(self, sid: str, tokens: torch.Tensor | list[int], *,
                       checked: bool = False) -> None:
        """Appends context or accepted tokens to a session's corpus.

        ``checked``: the caller has validated ``tokens`` (``int32``, on the arena's device,
        ids in ``[0, vocab_size)``), so no check reads them back to the host (the drafter's
        per-step commit)."""
        s = self.session(sid)
        t = tokens if checked else self._as_tokens(tokens, "tokens")
        self.arena.append(s.corpus, t, source_code(CorpusTier.SESSION), separators=())

    def append_sessions(self, sids: Sequence[str], tokens: torch.Tensor,
                        counts: Sequence[int] | torch.Tensor, *,
                        corpus_ids: Sequence[int] | None = None,
                        totals: torch.Tensor | None = None) -> None:
        """Appends row ``i``'s first ``counts[i]`` tokens of ``int32 [len(sids), M]`` to
        session ``sids[i]`` (distinct sessions), all rows in one scatter. The caller vouches
        for the ids (the drafter's per-step commit: validated, or the model's own), and for
        ``corpus_ids``, the sessions' corpora when it holds them (from ``corpora_of`` at
        this :attr:`epoch`). ``counts`` on the device defer the append (until
        ``arena.settle``), and ``totals`` is as :meth:`IndexArena.append_rows`'s."""
        cids = [self.session(sid).corpus for sid in sids] if corpus_ids is None else corpus_ids
        self.arena.append_rows(cids, tokens, counts, source_code(CorpusTier.SESSION),
                               totals=totals)

    def has_session(self, sid: str) -> bool:
        """Whether session ``sid`` is open here."""
        return sid in self._sessions

    def close_session(self, sid: str, history: bool = True) -> None:
        """Frees the session corpus; its text joins the tenant's history (bounded, LRU;
        ``history=False``: it does not, an open that failed). Once its corpus is freed the
        session is closed, whatever fails after (the arena's compaction, its history entry,
        an idle tenant's eviction: raised after); an error before leaves it open, to be
        closed again (its text not yet in the history)."""
        s = self.session(sid)
        t = self._touch(s.tenant)
        text = self.arena.corpus_tokens(s.corpus).clone() \
            if self.config.use_history and history else None
        try:
            self.arena.free(s.corpus)  # (deleted before it compacts)
        finally:
            if s.corpus not in self.arena:
                s.closed = True
                t.sessions.discard(sid)
                del self._sessions[sid]
                self.epoch += 1
        try:
            if text is not None:
                self._add_history(t, sid, text)
        finally:
            self._evict_idle(keep=s.tenant)

    def close_tenant(self, tenant: str) -> None:
        """Frees the tenant's workspace and history; its sessions must be closed first (by
        their owner: the drafter frees their slots, which freeing their corpora here would
        strand).

        Raises:
            KeyError: the tenant is unknown (or already closed, or freed as idle).
            ValueError: the tenant has open sessions.
        """
        _check_tenant(tenant)
        t = self._tenants.get(tenant)
        if t is None:
            raise KeyError(f"tenant {tenant!r} is unknown (never seen, closed, or freed as "
                           f"idle by TierConfig.idle_budget_tokens)")
        if t.sessions:
            raise ValueError(f"tenant: {tenant!r} has open sessions {sorted(t.sessions)}; "
                             f"close them first")
        self._free_tenant(tenant)

    def _free_tenant(self, tenant: str) -> None:
        """Frees the tenant's corpora: each of them, whatever another's freeing raised
        (raised after: a corpus is deleted before the arena compacts)."""
        t = self._tenants.pop(tenant)
        self.epoch += 1
        error = None
        for docs in (t.ws, t.hist):
            if docs is not None:
                try:
                    docs.free()
                except BaseException as e:  # noqa: BLE001 - raised below, after the others
                    error = error or e
        if error is not None:
            raise error

    def _touch(self, tenant: str) -> _Tenant:
        """The tenant (new if unseen), moved to the most recently active end."""
        t = self._tenants.pop(tenant, None) or _Tenant()
        self._tenants[tenant] = t
        return t

    def _evict_idle(self, keep: str) -> None:
        """Frees the least recently active idle tenants while idle ones hold more than
        ``idle_budget_tokens``, and every idle tenant holding nothing; never ``keep`` (the
        tenant just active)."""
        budget = self.config.idle_budget_tokens
        if budget is None:
            return
        idle = [(name, t.num_slots) for name, t in self._tenants.items() if not t.sessions]
        held = sum(n for _, n in idle)
        for name, n in idle:
            if name == keep or (held <= budget and n):
                continue  # (empty records go whatever the budget: they would pile up)
            self.num_evicted_tenants += 1  # (gone even if freeing a corpus of it raises)
            held -= n
            self._free_tenant(name)

    def session(self, sid: str) -> _Session:
        s = self._sessions.get(sid)
        if s is None:
            raise KeyError(f"session {sid!r} is unknown or closed")
        return s

    def session_lengths(self, sids: Sequence[str]) -> list[int]:
        """The tokens each session's corpus holds (host ints: its settled appends)."""
        return [self.arena.num_tokens(self.session(sid).corpus) for sid in sids]

    def took(self, sids: Sequence[str], before: Sequence[int],
             counts: Sequence[int]) -> list[bool]:
        """After an append that raised (a level build past the text, say): whether each
        session's corpus holds its ``counts[i] > 0`` new tokens, its length then
        ``before[i]`` (:meth:`session_lengths`) plus exactly that many."""
        return [n > 0 and now - was == n
                for now, was, n in zip(self.session_lengths(sids), before, counts)]

    def tenant_of(self, sid: str) -> str:
        return self.session(sid).tenant

    def tenant_version(self, sid: str) -> int:
        """Changes whenever text other than the session's own stream joins its corpora."""
        return self._tenants[self.session(sid).tenant].version

    # ------------------------------------------------------------ workspace
    def add_workspace_file(self, tenant: str, path: str | None, text: str,
                           first_line: int | None = None) -> int:
        """Indexes a file (or fragment) the tenant's agent opened, in every configured form.

        A re-read with identical text only refreshes its LRU position; changed text is
        added as a new version and the old one is kept (diffs quote old text). A fragment is
        indexed as a document of its own, whatever its ``first_line`` (the 1-based file line
        of its first line, or None; checked, not yet used to place it in the file). Returns
        the number of tokens added.

        Raises:
            BudgetExceeded (a ValueError) naming ``text``, nothing added, when its forms
            hold more tokens than ``workspace_budget_tokens`` (eviction keeps the newest
            file whole, so one such file would hold the tier past its budget).
        """
        _check_tenant(tenant)
        if path is not None:
            check_text(path, "path")
        check_text(text, "text")
        if first_line is not None and (not is_int(first_line) or first_line < 1):
            raise ValueError(f"first_line: expected None or an int >= 1, got {first_line!r}")
        if not self.config.use_workspace or not text:
            return 0
        key = (path or "", hashlib.sha1(text.encode()).hexdigest())
        t = self._tenants.get(tenant)
        if t is not None and t.ws is not None and t.ws.touch(key):
            self._touch(tenant)
            return 0
        rendered = render_forms(text, self.config.forms)
        forms = list(rendered)
        ids = self.tokenizer.encode_batch([rendered[f] for f in forms])
        size = sum(1 + len(toks) for toks in ids)  # (each form a document: a separator)
        if size > self.config.workspace_budget_tokens:
            raise BudgetExceeded(f"text: {size} tokens in its {len(forms)} forms exceed "
                                 f"TierConfig.workspace_budget_tokens="
                                 f"{self.config.workspace_budget_tokens}; nothing added")
        t = self._touch(tenant)
        if t.ws is None:
            t.ws = DocumentCorpus(self.arena, self.config.workspace_budget_tokens, "lru",
                                  self.config.workspace_low_water)
        try:
            added = t.ws.add(key, [(toks, source_code(CorpusTier.WORKSPACE, f))
                                   for f, toks in zip(forms, ids)])
        finally:  # (an add that raised may have rebuilt the corpus: its old id is gone)
            t.version += 1
            self.epoch += 1
        if not t.sessions:
            self._evict_idle(keep=tenant)
        return added

    # ------------------------------------------------------------ history
    def _add_history(self, t: _Tenant, sid: str, tokens: torch.Tensor) -> None:
        if t.hist is None:
            t.hist = DocumentCorpus(self.arena, self.config.history_budget_tokens, "lru",
                                    self.config.history_low_water)
        try:  # a session's text holds token ids only (its corpus takes no separators)
            t.hist.add((sid, t.num_closed), [(tokens, source_code(CorpusTier.HISTORY))],
                       token_ids_only=True)
        finally:  # (an add that raised may have rebuilt the corpus: its old id is gone)
            t.num_closed += 1
            t.version += 1
            self.epoch += 1

    # ------------------------------------------------------------ queries
    def corpora_of(self, sid: str) -> list[tuple[CorpusTier, int]]:
        """The corpora a session may search, its own tenant's only."""
        s = self.session(sid)
        t = self._tenants[s.tenant]
        out = [(CorpusTier.SESSION, s.corpus)]
        if self.config.use_workspace and t.workspace is not None:
            out.append((CorpusTier.WORKSPACE, t.workspace))
        if self.config.use_history and t.history is not None:
            out.append((CorpusTier.HISTORY, t.history))
        if self.global_cid is not None:
            out.append((CorpusTier.GLOBAL, self.global_cid))
        return out

    def oracle_prefix_len(self, sids: list[str], continuation: torch.Tensor) -> torch.Tensor:
        """``int32 [B]``: longest prefix of ``continuation[b]`` (``int32 [B, k]``, -1 padded)
        found in any corpus session ``sids[b]`` may search (the oracle drafter's accept)."""
        from agspec_gpu.oracle import longest_prefix

        rows, cids = [], []
        for b, sid in enumerate(sids):
            for _, cid in self.corpora_of(sid):
                rows.append(b)
                cids.append(cid)
        cont = continuation.to(self.arena.device, torch.int32)
        r = to_device(rows, torch.int64, self.arena.device)
        per_row = longest_prefix(self.arena, cont[r], cids)
        out = torch.zeros(len(sids), dtype=torch.int64, device=self.arena.device)
        out.scatter_reduce_(0, r, per_row, reduce="amax")
        return out.to(torch.int32)

    def nbytes(self, tier: CorpusTier | None = None, tenant: str | None = None) -> int:
        """Device bytes held, optionally restricted to a tier and/or tenant."""
        total = 0
        for name, t in self._tenants.items():
            if tenant is not None and name != tenant:
                continue
            cids = []
            if tier in (None, CorpusTier.SESSION):
                cids += [self._sessions[s].corpus for s in t.sessions]
            if tier in (None, CorpusTier.WORKSPACE) and t.workspace is not None:
                cids.append(t.workspace)
            if tier in (None, CorpusTier.HISTORY) and t.history is not None:
                cids.append(t.history)
            total += sum(self.arena.nbytes(c) for c in cids)
        if tenant is None and tier in (None, CorpusTier.GLOBAL) and self.global_cid is not None:
            total += self.arena.nbytes(self.global_cid)
        return total

    def _as_tokens(self, ids: torch.Tensor | list[int], name: str) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):  # (checked as ints: 1.7 or True is no id)
            return to_device(check_token_ids(ids, name, self.vocab_size), torch.int32,
                             self.arena.device)
        t = ids
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {self.vocab_size})")
        return t.to(self.arena.device, torch.int32)


def _check_tenant(tenant) -> None:
    # the isolation key: 5 and "5" must not name two tenants by accident
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant: expected a non-empty str, got {tenant!r}")


# ---------------------------------------------------------------- global tier
_FORMAT = "agspec-global-v2"  # v2: the index is over the reversed text


@dataclass
class GlobalCorpus:
    """A read-only corpus built offline, with its suffix array and tokenizer fingerprint;
    ``session_ids``: the trajectory sessions it holds, ``task_ids``: their tasks (a replay of
    any session of these tasks would draft from another agent's text of the same task:
    :meth:`check_disjoint`)."""

    tokens: torch.Tensor
    sa: torch.Tensor
    indexed_end: int
    max_depth: int
    fingerprint: str
    session_ids: frozenset = frozenset()
    task_ids: frozenset = frozenset()

    def check_disjoint(self, task_ids) -> None:
        """Raises ValueError naming the global corpus when it holds a session of any of
        ``task_ids`` (the tasks of the sessions about to be replayed against it)."""
        both = sorted((self.task_ids | self.session_ids).intersection(task_ids))
        if both:
            raise ValueError(f"global_corpus: holds sessions of {len(both)} of the replayed "
                             f"tasks ({both[0]!r}, ...): they would draft text of their own "
                             f"task; build it from the other half (build-global --half) and "
                             f"replay one")

    def check(self, tokenizer: Tokenizer, max_depth: int) -> None:
        if tokenizer.fingerprint != self.fingerprint:
            raise ValueError("global_corpus: built with another tokenizer "
                             f"(fingerprint {self.fingerprint[:12]}, this tokenizer "
                             f"{tokenizer.fingerprint[:12]})")
        if max_depth != self.max_depth:
            raise ValueError(f"global_corpus: indexed with max_depth={self.max_depth}, "
                             f"the store uses {max_depth}")
        # a GlobalCorpus made in code skips the file's checksum: its ids would be drafted,
        # its suffix array read as positions by the match kernel (no bounds check there)
        tok, sa, end = self.tokens, self.sa, self.indexed_end
        for name, t in (("tokens", tok), ("sa", sa)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                raise ValueError(f"global corpus {name}: expected an int32 [n] tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} "
                                 f"{list(getattr(t, 'shape', ()))}")
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= tok.numel():
            raise ValueError(f"global corpus indexed_end: expected an int in [0, "
                             f"{tok.numel()}], got {end!r}")
        if tok.numel() and (int(tok.min()) < SEP or int(tok.max()) >= tokenizer.vocab_size):
            raise ValueError(f"global corpus tokens: ids outside the tokenizer's vocabulary "
                             f"[0, {tokenizer.vocab_size}) (or the separator {SEP})")
        if sa.numel() > end or (sa.numel() and (int(sa.min()) < 0 or int(sa.max()) >= end)):
            raise ValueError(f"global corpus sa: {sa.numel()} entries, expected at most "
                             f"indexed_end = {end} positions in [0, {end})")


def _digest(tokens: torch.Tensor, sa: torch.Tensor) -> str:
    h = hashlib.sha256(tokens.numpy().tobytes())
    h.update(sa.numpy().tobytes())
    return h.hexdigest()


def session_half(task_id: str) -> int:
    """0 or 1: a stable split of sessions by their task (first bit of sha1(task id):
    :attr:`~agspec_gpu.trajectories.Session.task_id`), so a replayed half never feeds the
    global tier it is replayed against, not even through another agent's session of the
    same task."""
    # (surrogatepass: a task id taken from a file name that is not UTF-8 holds lone
    # surrogates; every other id hashes as it did)
    return hashlib.sha1(task_id.encode("utf-8", "surrogatepass")).digest()[0] & 1


def build_global_corpus(src: list[str | Path], tokenizer: Tokenizer, out: str | Path,
                        max_depth: int = 32, suffixes: tuple[str, ...] = (".py",),
                        max_tokens: int = 50_000_000, trajectories: list[str | Path] = (),
                        half: int | None = None, sessions: Sequence = ()) -> GlobalCorpus:
    """Builds and saves the global tier from public text.

    Args:
        src: directories (files with ``suffixes`` inside) or files of public text, e.g. the
            Python standard library sources.
        trajectories: public agent trajectory files; each session is one document (its
            messages tokenized one by one, as the replay does).
        half: only sessions with ``session_half(task_id) == half`` (None: all).
        sessions: loaded :class:`~agspec_gpu.trajectories.Session` objects, taken as the
            trajectories' sessions are (after them).

    Raises:
        ValueError: an argument of the wrong kind (``src``, ``trajectories`` and
            ``suffixes`` are lists, not one path or string), no text, or none that fits
            ``max_tokens``.
    """
    tokenizer = load_tokenizer(tokenizer)
    for name, v in (("src", src), ("trajectories", trajectories), ("suffixes", suffixes),
                    ("sessions", sessions)):
        if isinstance(v, (str, bytes, Path)):
            raise ValueError(f"{name}: expected a list, got one {type(v).__name__} ({v!r})")
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected an int >= 1, got {max_tokens!r}")
    if half not in (None, 0, 1) or isinstance(half, bool):
        raise ValueError(f"half: expected None, 0 or 1, got {half!r}")
    docs: list[list[int]] = []
    files = source_files(src, suffixes)
    texts, unread = [], []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            unread.append(f)
    if unread:
        warnings.warn(f"src: {len(unread)} of {len(files)} files are not readable as UTF-8 "
                      f"and were left out ({unread[0]}, ...)", stacklevel=2)
    docs += tokenizer.encode_batch(texts)
    session_ids, task_ids = [], []
    loaded = list(sessions)
    if trajectories:
        from agspec_gpu.trajectories import load_paths

        loaded = load_paths(list(trajectories)) + loaded
    from agspec_gpu.trajectories import Session

    for i, sess in enumerate(loaded):
        if not isinstance(sess, Session):
            raise ValueError(f"sessions[{i}]: expected a Session, got {type(sess).__name__}")
        if half is not None and session_half(sess.task_id) != half:
            continue
        ids = tokenizer.encode_batch([m.content for m in sess.messages])
        docs.append([t for m in ids for t in m])
        session_ids.append(sess.id)
        task_ids.append(sess.task_id)
    if not any(docs):
        found = [f"{len(files)} src files ({len(texts)} readable, none with text)"
                 if files else f"no src file with suffix {', '.join(suffixes)}"]
        if loaded:
            found.append(f"{len(session_ids)} of {len(loaded)} sessions in half {half}, none "
                         f"with text" if half is not None else
                         f"{len(loaded)} sessions, none with text")
        raise ValueError(f"no text to index: {'; '.join(found)}")
    return _save_global(docs, tokenizer, out, max_depth, max_tokens, session_ids, task_ids)


def source_files(src: Sequence[str | Path], suffixes: Sequence[str]) -> list[Path]:
    """The files ``build_global_corpus`` reads of ``src``: each file named, and each file
    with one of ``suffixes`` under each directory named (sorted by path).

    Raises:
        ValueError: a path of ``src`` does not exist.
    """
    files: list[Path] = []
    for p in map(Path, src):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in suffixes and f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"src: {p} does not exist")
    return files


def _save_global(docs: list[list[int]], tokenizer: Tokenizer, out: str | Path, max_depth: int,
                 max_tokens: int, session_ids: list[str] = (),
                 task_ids: list[str] = ()) -> GlobalCorpus:
    from safetensors.torch import save_file

    parts: list[int] = []
    num_docs = 0
    for ids in docs:
        if len(parts) + len(ids) + 1 > max_tokens:
            break
        parts.append(SEP)
        parts.extend(ids)
        num_docs += 1
    if num_docs == 0:
        raise ValueError(f"max_tokens: the first document alone ({len(docs[0]) + 1} tokens) "
                         f"exceeds {max_tokens}")
    if num_docs < len(docs):
        warnings.warn(f"max_tokens: {len(docs) - num_docs} of {len(docs)} documents left out "
                      f"(the first {num_docs} fill {len(parts):,} of {max_tokens:,} tokens)",
                      stacklevel=3)
    tokens = torch.tensor(parts, dtype=torch.int32)
    end = tokens.numel()  # the last document ends the corpus: every position is final
    sa = build_context_array(tokens, 0, end, max_depth)
    meta = {"format": _FORMAT, "fingerprint": tokenizer.fingerprint, "tokenizer": tokenizer.name,
            "max_depth": str(max_depth), "indexed_end": str(end),
            "sha256": _digest(tokens, sa), "num_docs": str(num_docs),
            "sessions": json.dumps(list(session_ids)),
            "tasks": json.dumps(sorted(set(task_ids)))}
    try:
        save_file({"tokens": tokens, "sa": sa}, str(out), metadata=meta)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
        raise OSError(f"{out}: cannot write the global corpus ({exc})") from exc
    return GlobalCorpus(tokens, sa, end, max_depth, tokenizer.fingerprint,
                        frozenset(session_ids), frozenset(task_ids))


def load_global_corpus(path: str | Path, tokenizer: Tokenizer | None = None) -> GlobalCorpus:
    """Loads and verifies a global corpus file (format, checksum, tokenizer fingerprint)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tokens, sa = f.get_tensor("tokens"), f.get_tensor("sa")
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types
        raise ValueError(f"global corpus {path}: unreadable or truncated ({exc})") from exc
    if meta.get("format") != _FORMAT:
        if str(meta.get("format", "")).startswith("agspec-global-"):
            raise ValueError(f"global corpus {path}: format {meta['format']!r}, this version "
                             f"reads {_FORMAT!r}; rebuild it with `agspec-gpu build-global`")
        raise ValueError(f"global corpus {path}: not an agspec global corpus")
    for name, t in (("tokens", tokens), ("sa", sa)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"global corpus {path}: {name} is {t.dtype} {list(t.shape)}, "
                             f"expected int32 [n]")
    if _digest(tokens, sa) != meta.get("sha256"):
        raise ValueError(f"global corpus {path}: checksum mismatch (corrupted file)")
    g = GlobalCorpus(tokens, sa, _meta_int(meta, "indexed_end", path),
                     _meta_int(meta, "max_depth", path), _meta_str(meta, "fingerprint", path),
                     _meta_names(meta, "sessions", path), _meta_names(meta, "tasks", path))
    if tokenizer is not None:
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is not None and tokenizer.fingerprint != g.fingerprint:
        raise ValueError(f"global corpus {path} was built with tokenizer "
                         f"{meta.get('tokenizer')!r} ({g.fingerprint[:12]}), not "
                         f"{tokenizer.name!r} ({tokenizer.fingerprint[:12]})")
    return g


def _meta_str(meta: dict, key: str, path: Path) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"global corpus {path}: header field {key!r} missing or empty")
    return value


def _meta_int(meta: dict, key: str, path: Path) -> int:
    value = _meta_str(meta, key, path)
    if not value.isascii() or not value.isdigit():
        raise ValueError(f"global corpus {path}: header field {key!r} = {value!r}, expected "
                         f"an int >= 0")
    return int(value)


def _meta_names(meta: dict, key: str, path: Path) -> frozenset:
    """A header's JSON list of session or task ids (absent: none)."""
    try:
        names = json.loads(meta.get(key, "[]"))
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"global corpus {path}: header field {key!r} is not a JSON list of "
                         f"strings")
    return frozenset(names)


def describe(store: CorpusStore) -> str:
    return json.dumps({"tenants": len(store._tenants), "sessions": len(store._sessions),
                       "bytes": store.nbytes()})
