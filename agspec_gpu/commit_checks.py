"""The arguments of an own loop's :meth:`~agspec_gpu.decoder.SpecDecoder.commit`, checked,
and its result cut where a request ended.

A user's loop verifies a :class:`~agspec_gpu.draft_batch.DraftBatch` with its own forward
and hands back the logits, dense ``[B, 1 + N, V]`` or flat ``[total_q, V]`` rows with
``qo_indptr`` (FlashInfer's ragged layout). Each check raises ValueError naming the
argument before anything is committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch

from agspec_gpu.accept import AcceptResult
from agspec_gpu.draft_batch import PAD_ID, DraftBatch
from agspec_gpu.host import to_device
from agspec_gpu.requests import Requests, SessionState, per_session
from agspec_gpu.stops import StopTokenizer


def check_commit_logits(logits, draft: DraftBatch, vocab_size: int, flat: bool) -> None:
    """``logits``: a floating tensor on the draft's device, ``[B, 1 + N, >= vocab_size]``
    for ``draft``'s ``[B, N]`` nodes, or ``[total_q, >= vocab_size]`` when ``flat`` (its
    rows are checked against ``qo_indptr`` by :func:`check_qo_indptr`)."""
    B, N = draft.token_ids.shape
    lead = "total_q" if flat else f"{B}, {1 + N}"
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != (2 if flat else 3) or \
            (not flat and tuple(logits.shape[:2]) != (B, 1 + N)) or \
            logits.shape[-1] < vocab_size:
        raise ValueError(f"logits: expected [{lead}, >= {vocab_size}], got "
                         f"{list(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating dtype, got {logits.dtype}")
    if logits.device != draft.token_ids.device:
        raise ValueError(f"logits: on {logits.device}, draft on {draft.token_ids.device}")


def check_qo_indptr(qo_indptr, num_draft: list[int], logits: torch.Tensor) -> None:
    """``qo_indptr`` of a flat commit: ``int [B + 1]`` on the logits' device, each request's
    rows its root and nodes (``num_draft``: the draft's sizes, host), inside ``logits``.
    One device read."""
    B = len(num_draft)
    if not isinstance(qo_indptr, torch.Tensor) or qo_indptr.shape != (B + 1,) or \
            qo_indptr.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qo_indptr: expected int32 [{B + 1}], got "
                         f"{getattr(qo_indptr, 'dtype', type(qo_indptr).__name__)} "
                         f"{list(getattr(qo_indptr, 'shape', ()))}")
    if qo_indptr.device != logits.device:
        raise ValueError(f"qo_indptr: on {qo_indptr.device}, logits on {logits.device}")
    qo = qo_indptr.tolist()
    sizes = [b - a for a, b in zip(qo, qo[1:])]
    if qo[0] < 0 or qo[-1] > logits.shape[0] or sizes != [1 + n for n in num_draft]:
        raise ValueError(f"qo_indptr: {qo} must start at >= 0, end at <= {logits.shape[0]} "
                         f"logits rows and give each request 1 + its draft's nodes "
                         f"{[1 + n for n in num_draft]}")


def commit_end_rules(sids: list[str], states: Sequence[SessionState], eos_id: int | None,
                     max_new_tokens, stop, vocab_size: int, tokenizer: StopTokenizer,
                     max_context: int | None = None, max_output: int = 0
                     ) -> Requests | None:
    """The sessions' end rules, as ``generate`` builds them: ``eos_id`` (already resolved:
    None for none), ``max_new_tokens`` (None: no limit; else ints >= 1, one for all or one
    per session) and ``stop`` strings (read with ``tokenizer``'s decoder), each session's
    limit at most the room its context has left under ``max_context`` (None: no limit);
    None when none is given and every session's room is more than ``max_output``, the
    most tokens the step can emit (a step that fills a context ends its request at
    ``"length"``)."""
    if max_new_tokens is not None and any(
            isinstance(m, bool) or m < 1
            for m in per_session(max_new_tokens, len(sids), "max_new_tokens", Integral)):
        raise ValueError(f"max_new_tokens: expected ints >= 1, got {max_new_tokens!r}")
    room = None if max_context is None else min(max_context - len(st.context)
                                                for st in states)
    if eos_id is None and max_new_tokens is None and stop is None and \
            (room is None or room > max_output):  # (a step that fills it ends there)
        return None
    limits = (1 << 62) if max_new_tokens is None else max_new_tokens
    return Requests.build(sids, list(states), limits, None, () if stop is None else stop,
                          True, eos_id, vocab_size, tokenizer, max_context=max_context)


def cut_result(res: AcceptResult, taken: list[int]) -> AcceptResult:
    """``res`` with each request's output cut to its first ``taken[b]`` tokens (the last of
    them its root), ``PAD_ID`` after them."""
    n = to_device(taken, torch.int32, res.output_ids.device)
    cols = torch.arange(res.output_ids.shape[1], device=n.device)[None, :]
    return AcceptResult(num_accepted=n - 1,
                        accepted_nodes=res.accepted_nodes.masked_fill(
                            cols[:, :-1] >= (n - 1)[:, None], PAD_ID),
                        output_ids=res.output_ids.masked_fill(cols >= n[:, None], PAD_ID),
                        num_output=n)
