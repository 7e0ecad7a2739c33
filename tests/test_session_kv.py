"""The session KV bookkeeping's own counts."""

import pytest

from agspec_gpu.session_kv import SessionKVCache


def test_a_failed_prefill_counts_no_prefill():
    """``SessionKVCache``'s stats count a prefill once its forward ran (a forward that
    raised was counted: a helper's audit)."""
    class Failing:
        def prefill(self, contexts, past):
            raise RuntimeError("out of memory")

    class Working:
        def prefill(self, contexts, past):
            return "logits"

    kv = SessionKVCache(None, budget_tokens=1000, reserve_tokens=0)
    with pytest.raises(RuntimeError, match="out of memory"):
        kv.prefill(Failing(), ["a"], [[1, 2, 3]], [4])
    assert (kv.num_prefills, kv.num_prefill_tokens) == (0, 0)
    assert kv.prefill(Working(), ["a", "b"], [[1, 2, 3], [4, 5]], [4, 4]) == "logits"
    assert (kv.num_prefills, kv.num_prefill_tokens) == (1, 5)
