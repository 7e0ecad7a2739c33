"""Independent per-request reference for tree planning (plain Python loops and numpy).

The packing uses ``numpy.packbits(..., bitorder="little")`` per request: FlashInfer documents
``flashinfer.quantization.packbits`` / ``segment_packbits`` as having numpy.packbits semantics,
and ``BatchPrefillWithPagedKVCacheWrapper.plan`` packs a ``custom_mask`` with
``segment_packbits(mask, mask_indptr, bitorder="little")``, one segment per request.
"""

from __future__ import annotations

import numpy as np
import torch

from agspec_gpu import DraftBatch


def random_trees(rng: np.random.Generator, sizes: list[int], kind: str,
                 vocab: int = 1000) -> list[list[tuple[int, int]]]:
    """``(token, parent)`` lists: ``chain``, ``wide`` (all root children) or ``random``."""
    trees = []
    for n in sizes:
        tree = []
        for j in range(n):
            if kind == "chain":
                parent = j - 1
            elif kind == "wide":
                parent = -1
            else:
                parent = int(rng.integers(-1, j)) if j else -1
            tree.append((int(rng.integers(0, vocab)), parent))
        trees.append(tree)
    return trees


def dense_mask(tree: list[tuple[int, int]], prefix_len: int) -> np.ndarray:
    """``bool [qo_len, kv_len]``: prefix columns, then ancestors-or-self by parent walks."""
    qo_len = 1 + len(tree)
    mask = np.zeros((qo_len, prefix_len + qo_len), dtype=bool)
    mask[:, :prefix_len] = True
    for r in range(qo_len):
        row = r
        while True:
            mask[r, prefix_len + row] = True
            if row == 0:
                break
            row = tree[row - 1][1] + 1
    return mask


def depths(tree: list[tuple[int, int]]) -> list[int]:
    out = [0]
    for _, parent in tree:
        out.append(out[parent + 1] + 1)
    return out


def reference_plan(trees, roots, prefix_lens, page_table: np.ndarray, page_size: int) -> dict:
    """Expected valid parts of every :class:`TreeMetadata` array, built request by request."""
    ref = {k: [] for k in ("input_ids", "position_ids", "kv_slots", "kv_indices",
                           "packed_mask", "kv_last_page_len")}
    qo, kv, mk = [0], [0], [0]
    for b, tree in enumerate(trees):
        prefix, qo_len = prefix_lens[b], 1 + len(tree)
        kv_len = prefix + qo_len
        num_pages = -(-kv_len // page_size)
        ref["input_ids"] += [roots[b]] + [t for t, _ in tree]
        ref["position_ids"] += [prefix + d for d in depths(tree)]
        for r in range(qo_len):
            s = prefix + r
            ref["kv_slots"].append(int(page_table[b, s // page_size]) * page_size + s % page_size)
        ref["kv_indices"] += [int(p) for p in page_table[b, :num_pages]]
        ref["kv_last_page_len"].append(kv_len - (num_pages - 1) * page_size)
        packed = np.packbits(dense_mask(tree, prefix).reshape(-1), bitorder="little")
        ref["packed_mask"] += packed.tolist()
        qo.append(qo[-1] + qo_len)
        kv.append(kv[-1] + num_pages)
        mk.append(mk[-1] + len(packed))
    ref.update(qo_indptr=qo, kv_indptr=kv, mask_indptr=mk)
    return ref


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where Triton runs


def on_device(draft: DraftBatch, *tensors: torch.Tensor, device=DEVICE):
    """``draft`` and ``tensors`` moved to ``device`` (the Triton path's inputs)."""
    moved = DraftBatch(draft.token_ids.to(device), draft.parents.to(device),
                       draft.num_draft_tokens.to(device))
    return (moved, *(t.to(device) for t in tensors))


def make_case(seed: int, sizes: list[int], kind: str, prefix_lens: list[int], page_size: int,
              extra_pages: int = 1):
    """A draft batch, roots, prefix lengths and a shuffled page table that covers them."""
    rng = np.random.default_rng(seed)
    trees = random_trees(rng, sizes, kind)
    roots = [int(x) for x in rng.integers(0, 1000, len(sizes))]
    width = max(-(-(p + 1 + max(sizes + [0])) // page_size) for p in prefix_lens) + extra_pages
    pages = rng.permutation(len(sizes) * width).reshape(len(sizes), width).astype(np.int32)
    draft = DraftBatch.from_lists(trees)
    return (trees, roots, draft, torch.tensor(roots, dtype=torch.int32),
            torch.tensor(prefix_lens, dtype=torch.int32), pages, torch.from_numpy(pages))
