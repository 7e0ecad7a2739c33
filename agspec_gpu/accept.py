"""Acceptance of draft trees from the target model's verification logits.

Verification convention: for request ``b`` the verifier runs the model on
``[root, node_0, ..., node_{n_b-1}]`` (``root`` = the last committed token, ``n_b =
num_draft_tokens[b]``), so request ``b`` owns ``1 + n_b`` logit rows: row 0 is the root's
(the target's next-token distribution after the committed prefix), row ``1 + j`` is node
``j``'s (the distribution after the path root -> ... -> node ``j``).

Logits come in one of two layouts:

- flat ``[total_q, V]`` with ``qo_indptr int32 [B+1]``: request ``b``'s rows are
  ``qo_indptr[b] .. qo_indptr[b+1]-1`` (what FlashInfer's ragged prefill produces);
  :func:`tree_qo_indptr` builds ``qo_indptr`` from a draft;
- padded ``[B, 1+N, V]`` with ``qo_indptr=None``; rows past ``1 + n_b`` are ignored.
  :func:`pad_tree_logits` / :func:`flatten_tree_logits` convert between the two.

Both acceptance rules walk the tree one depth at a time for the whole batch at once (no
loop over requests, no host sync) and return an :class:`AcceptResult`:

- :func:`greedy_accept`: the longest path whose every token is the target's argmax at its
  parent, plus the bonus token (the argmax at the last accepted node). Lossless: the output
  is token for token the target's greedy output.
- :func:`sample_accept`: multi-branch rejection sampling for deterministic drafts; the
  emitted tokens are distributed exactly as sampling from the target would be.

:func:`teacher_forced_accept` finds the path a *known* token sequence spells in each tree
(the replay's verification, and the drafter's commit of what the model accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import torch

from agspec_gpu.checks import check_int_fields
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.kernels.tree_accept import greedy_tree_accept, path_outputs_torch, tree_accept
from agspec_gpu.seeding import seeded_uniforms


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the target distribution is formed from logits.

    Attributes:
        temperature: ``>= 0``; 0 means greedy (argmax, lower token id on ties).
        top_k: keep the ``top_k`` largest logits (and every logit tied with the k-th,
            as Hugging Face's filter does: ``top_k=1`` is greedy only where the largest
            logit is not tied, which bf16 logits often are), 0 disables.
        top_p: nucleus mass in ``(0, 1]``; 1.0 disables.
        seed: None (the call's generator), or an int in ``[0, 2**63)``: the token at
            sequence position ``t`` is drawn with a uniform that depends on ``(seed, t)``
            only (:func:`~agspec_gpu.seeding.seeded_uniforms`), so the request's output is
            a function of its context and seed: the same in any batch, and with or
            without speculation (the tree's levels draw what plain decoding draws at
            each position; up to float rounding between a verification's logits and a
            decode step's: a draw is a walk of the cumulative probabilities in token-id
            order, so a difference in the last bits moves a draw that falls within it of
            a token's edge; with ``top_p`` the nucleus's own edge makes that more
            frequent: 1-2 of 24 seeded 24-token requests at ``top_p=0.9`` differed
            between a batched and a plain run on a CPU, none without it).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if not isinstance(v, Real) or isinstance(v, bool):
                raise ValueError(f"{name}: expected a number, got {v!r}")
        # float32 holds it (the device rows do): a normal number, or 0 (greedy); also
        # rejects NaN
        f32 = torch.finfo(torch.float32)
        if not (self.temperature == 0.0 or f32.tiny <= self.temperature <= f32.max):
            raise ValueError(f"temperature must be 0 or in [{f32.tiny:.3g}, {f32.max:.3g}] "
                             f"(float32), got {self.temperature}")
        # the device rows are int64: a larger k (any k >= the vocabulary is off) would fail
        # inside a step, ending the other requests of its batch
        check_int_fields(self, ("top_k", "seed"), optional=("seed",))
        if not 0 <= self.top_k < 1 << 63:
            raise ValueError(f"top_k must be an int in [0, 2**63), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class BatchSampling:
    """Per-request :class:`SamplingParams` of a batch, as device tensors.

    Attributes:
        temperature: ``float32 [B]`` (0 = greedy).
        top_k: ``int64 [B]`` (0 = off).
        top_p_drop: ``float32 [B]``: ``1 - top_p``, the nucleus's dropped mass (0 = off).
        seed: ``int64 [B]`` (0 where unseeded); seeded: ``bool [B]``.
        max_top_k, any_top_p, all_greedy, any_greedy, any_seeded: host-known flags of the
            rows (``any_seeded``: a sampled row has a seed; a greedy row's seed is moot).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p_drop: torch.Tensor
    seed: torch.Tensor
    seeded: torch.Tensor
    max_top_k: int
    any_top_p: bool
    all_greedy: bool
    any_greedy: bool
    any_seeded: bool

    @staticmethod
    def of(params: "SamplingParams | list[SamplingParams]", device: torch.device | str
           ) -> "BatchSampling":
        """One row per element of ``params`` (a single ``SamplingParams``: one row that
        broadcasts over every request)."""
        ps = [params] if isinstance(params, SamplingParams) else list(params)
        if not ps or not all(isinstance(p, SamplingParams) for p in ps):
            raise ValueError("sampling: expected SamplingParams or a non-empty list of them")
        greedy = [p.is_greedy for p in ps]
        seeded = [p.seed is not None and not p.is_greedy for p in ps]
        return BatchSampling(
            torch.tensor([p.temperature for p in ps], dtype=torch.float32).to(device),
            torch.tensor([p.top_k for p in ps], dtype=torch.int64).to(device),
            torch.tensor([1.0 - p.top_p for p in ps], dtype=torch.float32).to(device),
            torch.tensor([p.seed or 0 for p in ps], dtype=torch.int64).to(device),
            torch.tensor(seeded).to(device),
            max(p.top_k for p in ps), any(p.top_p < 1.0 for p in ps), all(greedy),
            any(greedy), any(seeded))

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


@dataclass
class AcceptResult:
    """What verification accepted, per request.

    Attributes:
        num_accepted: ``int32 [B]`` draft tokens accepted (bonus excluded).
        accepted_nodes: ``int32 [B, D]`` node indices along the accepted path from the root,
            ``PAD_ID`` padded. ``D`` is the depth bound the walk used.
        output_ids: ``int32 [B, D+1]`` the accepted tokens then the bonus token,
            ``PAD_ID`` padded.
        num_output: ``int32 [B]`` valid entries of ``output_ids`` (``num_accepted + 1``).
        maybe_bonus: ``int32 [B]`` or None: the bonus tokens, when the walk wrote them
            (:meth:`bonus_ids` reads them from ``output_ids`` otherwise).
    """

    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    output_ids: torch.Tensor
    num_output: torch.Tensor
    maybe_bonus: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.accepted_nodes.ndim != 2:
            raise ValueError(f"accepted_nodes: expected [B, D], "
                             f"got {list(self.accepted_nodes.shape)}")
        B, D = self.accepted_nodes.shape
        for name, t, shape in (("num_accepted", self.num_accepted, (B,)),
                               ("accepted_nodes", self.accepted_nodes, (B, D)),
                               ("output_ids", self.output_ids, (B, D + 1)),
                               ("num_output", self.num_output, (B,)),
                               ("maybe_bonus", self.maybe_bonus, (B,))):
            if t is None:
                continue
            if t.dtype != torch.int32 or tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected int32 {list(shape)}, "
                                 f"got {t.dtype} {list(t.shape)}")

    @property
    def max_depth(self) -> int:
        return self.accepted_nodes.shape[1]

    def bonus_ids(self) -> torch.Tensor:
        """``int32 [B]``: each request's bonus token, i.e. the next root."""
        if self.maybe_bonus is not None:
            return self.maybe_bonus
        return self.output_ids.gather(1, self.num_accepted.long()[:, None])[:, 0]


class AcceptBuffers:
    """Greedy acceptance's outputs preallocated for up to ``max_batch`` requests of up to
    ``max_nodes`` nodes (a serving loop's, so that its steps allocate nothing): the
    target's argmax rows and the walk's five outputs. A result made in them is valid until
    the next acceptance into them; views are made once per step shape."""

    def __init__(self, max_batch: int, max_nodes: int, device: torch.device | str) -> None:
        if max_batch < 1 or max_nodes < 0:
            raise ValueError(f"max_batch must be >= 1 and max_nodes >= 0, got {max_batch} "
                             f"and {max_nodes}")
        self.max_batch, self.max_nodes = max_batch, max_nodes
        B, N = max_batch, max_nodes
        self.target = torch.empty(B * (1 + N), dtype=torch.int64, device=device)
        # num_accepted, path, output_ids, num_output, bonus: one int32 buffer
        self._walk = torch.empty(B * (2 * N + 4), dtype=torch.int32, device=device)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._targets: dict[int, torch.Tensor] = {}

    def fits(self, B: int, D: int) -> bool:
        return B <= self.max_batch and D <= self.max_nodes

    def walk(self, B: int, D: int) -> tuple[torch.Tensor, ...]:
        """``(num_accepted [B], path [B, D], output_ids [B, D + 1], num_output [B], bonus
        [B])``, int32, contiguous: :func:`greedy_tree_accept`'s ``out``."""
        views = self._views.get((B, D))
        if views is None:
            sizes = [B, B * D, B * (D + 1), B, B]
            parts = self._walk[:sum(sizes)].split(sizes)
            views = self._views[(B, D)] = (parts[0], parts[1].view(B, D),
                                           parts[2].view(B, D + 1), parts[3], parts[4])
        return views

    def argmax(self, T: int) -> torch.Tensor:
        """``int64 [T]``: the target's argmax over ``T`` logits rows."""
        t = self._targets.get(T)
        if t is None:
            t = self._targets[T] = self.target[:T]
        return t


# ----------------------------------------------------------------------------- layouts


def tree_qo_indptr(draft: DraftBatch) -> torch.Tensor:
    """``int32 [B+1]``: row offsets of the flat layout, ``1 + num_draft_tokens[b]`` per request."""
    n = draft.num_draft_tokens.to(torch.int32)
    return torch.nn.functional.pad(torch.cumsum(n + 1, 0, dtype=torch.int32), (1, 0))


def pad_tree_logits(logits: torch.Tensor, qo_indptr: torch.Tensor, max_nodes: int
                    ) -> torch.Tensor:
    """Flat ``[total_q, V]`` -> padded ``[B, 1+max_nodes, V]`` (no host sync).

    Rows past a request's ``1 + n_b`` hold unspecified (other requests') rows.
    """
    if logits.ndim != 2 or qo_indptr.ndim != 1:
        raise ValueError(f"logits must be [total_q, V] and qo_indptr [B+1], got "
                         f"{list(logits.shape)} and {list(qo_indptr.shape)}")
    idx = qo_indptr[:-1, None].long() + torch.arange(1 + max_nodes, device=logits.device)
    return logits[idx.clamp(max=max(logits.shape[0] - 1, 0))]


def flatten_tree_logits(logits: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Padded ``[B, 1+N, V]`` -> flat ``[total_q, V]``, requests in order.

    The output size depends on ``num_draft_tokens``, so this syncs with the host once.
    """
    if logits.ndim != 3 or num_draft_tokens.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [B, 1+N, V] and num_draft_tokens [B], got "
                         f"{list(logits.shape)} and {list(num_draft_tokens.shape)}")
    keep = torch.arange(logits.shape[1], device=logits.device) <= num_draft_tokens[:, None]
    return logits[keep]


def rows_without_finite_max(draft: DraftBatch, logits: torch.Tensor,
                            qo_indptr: torch.Tensor | None = None,
                            accepted_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """``bool [B]``: request ``b`` has a row (its root's or a node's; padding rows are
    ignored) whose maximum is not finite: a NaN or ``+inf`` anywhere in it, or ``-inf``
    throughout. Such a row names no next token (its argmax is the NaN's column, its softmax
    NaN), so a caller's logits holding one are a model fault, not a distribution. With
    ``accepted_nodes`` (``int [B, D]``, -1 padded: an :class:`AcceptResult`'s), only the
    rows that chose the step's tokens count: the root's and the accepted nodes' (a
    rejected node's row was never read, as plain decoding never computes it). One
    reduction over the logits; no host sync."""
    rows, row_start = _tree_rows(draft, logits, qo_indptr)
    bad = ~torch.isfinite(rows.amax(-1))
    B, N = draft.token_ids.shape
    if accepted_nodes is not None:
        if not bad.numel():
            return bad.new_zeros(B)
        nodes = accepted_nodes.long()
        at = (row_start.long()[:, None] + 1 + nodes.clamp(min=0)).clamp(max=bad.numel() - 1)
        return bad[row_start.long()] | (bad[at] & (nodes >= 0)).any(-1)
    if logits.ndim == 3:
        real = torch.arange(1 + N, device=logits.device) <= draft.num_draft_tokens[:, None]
        return (bad.view(B, 1 + N) & real).any(-1)
    # flat rows: request b's count of bad rows from the running count at its bounds
    cum = torch.nn.functional.pad(bad.cumsum(0), (1, 0))
    return cum[qo_indptr[1:].long()] > cum[qo_indptr[:-1].long()]


def _tree_rows(draft: DraftBatch, logits: torch.Tensor, qo_indptr: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``rows [R, V]`` and ``row_start [B]`` (row of each request's root; int64, or
    ``qo_indptr``'s dtype)."""
    B, N = draft.token_ids.shape
    if logits.ndim == 3:
        if qo_indptr is not None:
            raise ValueError("qo_indptr must be None when logits are padded [B, 1+N, V]")
        if logits.shape[:2] != (B, 1 + N):
            raise ValueError(f"logits: expected [B={B}, 1+N={1 + N}, V], got {list(logits.shape)}")
        row_start = torch.arange(B, device=logits.device) * (1 + N)
        return logits.reshape(B * (1 + N), logits.shape[2]), row_start
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [total_q, V] or [B, 1+N, V], got {list(logits.shape)}")
    if qo_indptr is None or qo_indptr.shape != (B + 1,):
        raise ValueError(f"qo_indptr: expected [B+1={B + 1}] with flat logits, got "
                         f"{None if qo_indptr is None else list(qo_indptr.shape)}")
    if qo_indptr.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qo_indptr: expected int32 (or int64), got {qo_indptr.dtype}")
    return logits, qo_indptr[:-1]


def _depth_bound(draft: DraftBatch, max_depth: int | None) -> int:
    # The tree depth is data; N (a shape) bounds it without a host sync. A caller that knows a
    # tighter bound (the drafter's depth cap) saves loop iterations; a bound below the real
    # depth only truncates acceptance, which stays lossless.
    if max_depth is None:
        return draft.max_nodes
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    return min(max_depth, draft.max_nodes)


def _first_true(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask bool [B, N]`` -> (``any [B]``, lowest true column ``int64 [B]``, 0 if none)."""
    N = mask.shape[1]
    col = torch.where(mask, torch.arange(N, device=mask.device), N).amin(1)
    has = col < N
    return has, torch.where(has, col, 0)


def _assemble(draft: DraftBatch, accepted: torch.Tensor, num_acc: torch.Tensor,
              bonus: torch.Tensor) -> AcceptResult:
    """Builds the result from the accepted path ``int64 [B, D]`` (-1 padded) and bonus ``[B]``."""
    out, num_out = path_outputs_torch(draft.token_ids, accepted, num_acc, bonus)
    return AcceptResult(num_acc.to(torch.int32), accepted.to(torch.int32), out, num_out)


# ----------------------------------------------------------------------------- greedy


def greedy_accept(draft: DraftBatch, logits: torch.Tensor,
                  qo_indptr: torch.Tensor | None = None, *, max_depth: int | None = None,
                  out: AcceptBuffers | None = None) -> AcceptResult:
    """Longest path of target-argmax tokens, plus the bonus token.

    Parameters:
        draft: ``B`` trees padded to ``N`` nodes.
        logits: ``[total_q, V]`` with ``qo_indptr``, or ``[B, 1+N, V]`` with ``qo_indptr=None``.
        qo_indptr: ``int32 [B+1]`` (see :func:`tree_qo_indptr`).
        max_depth: walk at most this many levels (default ``N``); the result has
            ``D = min(max_depth, N)`` path columns.
        out: buffers the result is written in (valid until their next use), when the step
            fits them; None: new tensors.

    Returns:
        :class:`AcceptResult`. Node ``j`` is accepted iff its parent was and
        ``token_ids[b, j] == argmax(logits at its parent)``; argmax ties go to the lower
        token id (``torch.argmax``), as in :func:`agspec_gpu.runners.hf.greedy_generate`.
        Sibling nodes carrying the same token (invalid drafts: a drafter merges them) are
        resolved to the lower node index.

    Example:
        >>> d = DraftBatch.from_lists([[(5, -1), (7, 0)]])                # chain 5 -> 7
        >>> logits = torch.nn.functional.one_hot(torch.tensor([5, 9, 0]), 16).float()
        >>> greedy_accept(d, logits, tree_qo_indptr(d)).output_ids.tolist()  # 5 ok, 7 != 9
        [[5, 9, -1]]
    """
    B, N = draft.token_ids.shape
    D = _depth_bound(draft, max_depth)
    # the target's argmax at the root and at each node: padded [B, 1+N], or the flat rows'
    # [total_q] that the walk reads at qo_indptr[b] + 1 + j
    row_start = None
    if out is not None and not out.fits(B, D):
        out = None
    if logits.ndim == 3 and qo_indptr is None and logits.shape[:2] == (B, 1 + N):
        target = logits.argmax(-1)
    else:
        rows, _ = _tree_rows(draft, logits, qo_indptr)  # (raises for bad shapes)
        if rows.shape[0] == 0:  # (an empty batch)
            rows = rows.new_zeros(1, rows.shape[1])
        row_start = qo_indptr[:-1]
        if out is not None and rows.shape[0] <= out.target.shape[0]:
            target = torch.argmax(rows, -1, out=out.argmax(rows.shape[0]))
        else:
            target = rows.argmax(-1)
    # the walk down each tree, its output tokens and the bonus: one kernel on a GPU
    # (kernels/tree_accept.py)
    num_acc, accepted, ids, num_out, bonus = greedy_tree_accept(
        draft.token_ids, draft.parents, draft.num_draft_tokens, target, max_depth=D,
        row_start=row_start, out=None if out is None else out.walk(B, D))
    return AcceptResult(num_acc, accepted, ids, num_out, bonus)


# ----------------------------------------------------------------------------- sampling


def target_probs(logits: torch.Tensor, params: SamplingParams | BatchSampling) -> torch.Tensor:
    """The target distribution ``float32 [..., V]`` from logits ``[..., V]``.

    Order as in Hugging Face ``generate``: temperature, then top-k (ties with the k-th
    logit are kept), then top-p over what is left (sort ascending, drop the tokens whose
    cumulative mass is ``<= 1 - top_p``, always keep the most likely). The sort is stable,
    so among equal logits at the nucleus edge the lower token id is dropped first.
    Temperature 0 gives the one-hot of the argmax (lower id on ties).

    ``params``: one :class:`SamplingParams` for every row, or a :class:`BatchSampling`
    whose row ``b`` applies to ``logits[b]`` (``logits [B, ..., V]``).
    """
    s = params if isinstance(params, BatchSampling) else BatchSampling.of(params, logits.device)
    if s.all_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    row = (-1,) + (1,) * (logits.dim() - 1)  # a per-row value against [B, ..., V]
    temp = s.temperature.view(row)
    # shifted by the row's max before the scaling (the same distribution): a tiny
    # temperature sends the others to -inf, never the max to inf (inf - inf: NaN)
    raw = logits.float()
    top = raw.amax(-1, keepdim=True)
    x = (raw - torch.where(top.isfinite(), top, 0.0)) / torch.where(temp > 0, temp, 1.0)
    V = x.shape[-1]
    if s.max_top_k > 0:
        # the k-th logit is found among the logits themselves: the shift and scaling keep
        # the order but may round two logits a few ulp apart into a tie
        k = min(s.max_top_k, V)
        idx = (s.top_k - 1).clamp(0, k - 1).view(row).expand(*x.shape[:-1], 1)
        kth = torch.topk(raw, k, dim=-1).values.gather(-1, idx)
        on = ((s.top_k > 0) & (s.top_k < V)).view(row)
        x = x.masked_fill(on & (raw < kth), float("-inf"))
    if s.any_top_p:
        sorted_x, order = torch.sort(x, dim=-1, stable=True)
        drop = s.top_p_drop.view(row)
        drop_sorted = (sorted_x.softmax(-1).cumsum(-1) <= drop) & (drop > 0)
        drop_sorted[..., -1] = False
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = x.softmax(-1)
    if s.any_greedy:
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
        probs = torch.where(temp.view(row) == 0, one_hot, probs)
    return probs


def sample_tokens(logits: torch.Tensor, sampling: BatchSampling,
                  generator: torch.Generator | None = None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` from the target distribution (row ``b`` by
    ``sampling``'s row ``b``; the argmax, lower id on ties, where it is greedy; else by
    inverse CDF, as :func:`sample_accept`'s levels draw: at a float64 uniform of
    ``generator``, or for a seeded row at its uniform for ``positions[b]``, the sequence
    position of the token drawn, ``int64 [B]``, needed when ``sampling.any_seeded``)."""
    if sampling.all_greedy:
        return logits.argmax(dim=-1)
    p = target_probs(logits.float(), sampling)
    u = torch.rand(p.shape[0], generator=generator, device=p.device, dtype=torch.float64)
    if sampling.any_seeded:
        u = torch.where(sampling.seeded,
                        seeded_uniforms(sampling.seed, _checked_positions(positions, u.shape[0])),
                        u)
    return _inverse_cdf(p, u)


def _checked_positions(positions: torch.Tensor | None, B: int) -> torch.Tensor:
    """``positions``: what a batch with seeded rows must be given."""
    if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (B,):
        raise ValueError(f"positions: a seeded request needs the sequence position of each "
                         f"row's draw, int64 [{B}], got "
                         f"{getattr(positions, 'shape', positions)}")
    return positions


def _sample_rows(logits: torch.Tensor, params: BatchSampling, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of one token per row of ``logits [B, V]`` with uniforms ``u [B]``."""
    return _inverse_cdf(target_probs(logits, params), u)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` at uniforms ``u [B]``.

    ``searchsorted(right=True)`` never returns a zero-probability token; scaling ``u`` by the
    total keeps the last token reachable when the float64 cumsum ends a hair below 1.
    """
    cdf = probs.double().cumsum(-1)
    x = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    return x.clamp(max=probs.shape[-1] - 1)


def sample_accept(draft: DraftBatch, logits: torch.Tensor, qo_indptr: torch.Tensor | None,
                  sampling: SamplingParams | BatchSampling,
                  generator: torch.Generator | None = None, *,
                  max_depth: int | None = None,
                  positions: torch.Tensor | None = None) -> AcceptResult:
    """Multi-branch rejection sampling for deterministic drafts.

    At the current node (starting at the root) draw ``x`` from the target distribution
    ``p`` there (:func:`target_probs`). If some child carries ``x`` (lowest node index on
    duplicates), accept that child and descend; otherwise emit ``x`` as the bonus and stop.
    At a leaf (or at the depth bound) the bonus is drawn from ``p`` the same way.

    Why this is exact: a deterministic draft has ``q = one-hot``, so SpecInfer's rule
    (accept child ``c_i`` with probability ``p'(c_i)``; on rejection set ``p' = p'`` without
    ``c_i``, renormalised; after every child sample the bonus from ``p'``) accepts ``c_i``
    with total probability ``p(c_i)`` and otherwise emits a token from ``p`` restricted to
    the non-child tokens. One draw ``x ~ p`` matched against the children has exactly that
    law, so every emitted token is distributed as ``p`` at its context, i.e. as plain
    sampling from the target.

    Parameters:
        draft, logits, qo_indptr, max_depth: as in :func:`greedy_accept`.
        sampling: temperature / top-k / top-p, for every request or per request
            (:class:`BatchSampling`); temperature 0 everywhere returns :func:`greedy_accept`
            (a greedy request in a sampled batch walks its argmaxes all the same).
        generator: the random stream (on the logits' device). Every call draws exactly
            ``B`` uniforms per level for ``D + 1`` levels, whatever is accepted, so results
            are a deterministic function of the generator state.
        positions: ``int64 [B]``, the sequence position of each request's first draw (its
            root's + 1): level ``d`` of a seeded row draws with the uniform of its seed at
            ``positions[b] + d`` (needed when ``sampling`` has seeded rows).

    Returns:
        :class:`AcceptResult`.
    """
    s = sampling if isinstance(sampling, BatchSampling) else \
        BatchSampling.of(sampling, draft.token_ids.device)
    if s.all_greedy:
        return greedy_accept(draft, logits, qo_indptr, max_depth=max_depth)
    if s.num_rows not in (1, draft.batch_size):
        raise ValueError(f"sampling: {s.num_rows} rows for a batch of {draft.batch_size}")
    rows, row_start = _tree_rows(draft, logits, qo_indptr)
    if generator is not None and generator.device.type != rows.device.type:
        raise ValueError(f"generator is on {generator.device}, logits on {rows.device}")
    B, N = draft.token_ids.shape
    D = _depth_bound(draft, max_depth)
    dev = draft.token_ids.device
    if s.any_seeded:
        positions = _checked_positions(positions, B).long()
    valid = torch.arange(N, device=dev)[None, :] < draft.num_draft_tokens[:, None]
    parents = draft.parents.long()
    tokens = draft.token_ids.long()

    cur = torch.full((B,), -1, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    num_acc = torch.zeros(B, dtype=torch.long, device=dev)
    bonus = torch.full((B,), PAD_ID, dtype=torch.long, device=dev)
    accepted = torch.full((B, D), PAD_ID, dtype=torch.long, device=dev)
    for d in range(D + 1):
        # float64: a float32 uniform has 24 bits, which would round every token's
        # probability to a multiple of 2**-24 (a total-variation error ~1e-3 at V = 152k)
        u = torch.rand(B, generator=generator, device=dev, dtype=torch.float64)
        if s.any_seeded:  # the generator's stream advances alike
            u = torch.where(s.seeded, seeded_uniforms(s.seed, positions + d), u)
        # finished requests re-read a valid row; their draw is discarded
        x = _sample_rows(rows[row_start + 1 + cur], s, u)
        if d < D:
            cand = valid & (parents == cur[:, None]) & (tokens == x[:, None]) & alive[:, None]
            has, child = _first_true(cand)
            accepted[:, d] = torch.where(has, child, PAD_ID)
        else:
            has, child = torch.zeros_like(alive), cur
        bonus = torch.where(alive & ~has, x, bonus)
        cur = torch.where(has, child, cur)
        num_acc += has
        alive &= has
    return _assemble(draft, accepted, num_acc, bonus)


def accept_tree(draft: DraftBatch, logits: torch.Tensor, sampling: BatchSampling,
                generator: torch.Generator | None = None,
                qo_indptr: torch.Tensor | None = None, out: AcceptBuffers | None = None,
                positions: torch.Tensor | None = None) -> AcceptResult:
    """:func:`greedy_accept` where every row of ``sampling`` is greedy (into ``out``),
    else :func:`sample_accept` (greedy rows there stay greedy; ``positions`` for its
    seeded rows); ``logits [B, 1 + N, V]``, or ``[total_q, V]`` with ``qo_indptr``."""
    if sampling.all_greedy:
        return greedy_accept(draft, logits, qo_indptr, out=out)
    return sample_accept(draft, logits, qo_indptr, sampling, generator, positions=positions)


NO_TOKEN = -2  # truth padding past the end of a message: no draft token equals it


@dataclass
class AcceptedPaths:
    """What teacher forcing accepted in a batch of draft trees.

    Attributes:
        num_accepted: ``int64 [B]`` draft tokens accepted (the bonus token excluded).
        path_nodes: ``int64 [B, N]``: column ``d`` is the node accepted at depth ``d + 1``,
            ``-1`` past ``num_accepted``.
    """

    num_accepted: torch.Tensor
    path_nodes: torch.Tensor


def teacher_forced_accept(draft: DraftBatch, truth: torch.Tensor) -> AcceptedPaths:
    """Longest root-to-node path of ``draft`` that spells the true continuation.

    Parameters
    ----------
    draft : ``B`` trees padded to ``N`` nodes (topological order, ``parents[b, j] < j``).
    truth : ``int32 [B, W]``: ``truth[b, d]`` is the true token at depth ``d + 1``; pad with
        :data:`NO_TOKEN` past the end of the message, so acceptance never runs past it.
        Depths beyond ``W`` are never accepted.

    Returns
    -------
    :class:`AcceptedPaths` from :func:`agspec_gpu.kernels.tree_accept.tree_accept` with
    ``by_depth=True`` (one kernel per batch on a GPU; pointer jumping on CPU, no host reads).
    Sibling nodes with the same token (a drafter should merge them) never cost acceptance:
    the deepest path that spells the truth counts, and ``path_nodes`` reports the lowest
    matched node index at each depth. With such siblings those nodes need not form one
    root-to-node path (tokens ``[0, 0, 0, 0]``, parents ``[-1, -1, -1, 2]``, truth ``[0,
    0]``: nodes 0 and 3), so what is read per accepted node (its source tag) may come from
    a sibling twin; agspec's tries and the host baselines' chains have none.

    Example
    -------
    >>> d = DraftBatch.from_lists([[(5, -1), (7, 0), (8, 0)]])   # 5 -> {7, 8}
    >>> teacher_forced_accept(d, torch.tensor([[5, 8, 1]])).num_accepted.tolist()
    [2]
    """
    B, N = draft.token_ids.shape
    dev = draft.token_ids.device
    if not isinstance(truth, torch.Tensor) or truth.dtype not in (torch.int32, torch.int64) \
            or truth.ndim != 2 or truth.shape[0] != B:
        raise ValueError(f"truth: expected an int32 (or int64) tensor [B={B}, W], got "
                         f"{getattr(truth, 'dtype', type(truth).__name__)} "
                         f"{list(getattr(truth, 'shape', ()))}")
    if N == 0 or truth.shape[1] == 0:
        return AcceptedPaths(torch.zeros(B, dtype=torch.long, device=dev),
                             torch.full((B, N), -1, dtype=torch.long, device=dev))
    num_accepted, path = tree_accept(draft.token_ids, draft.parents,
                                     draft.num_draft_tokens.to(dev), truth.to(dev).long(),
                                     by_depth=True, max_depth=N)
    return AcceptedPaths(num_accepted, path)
