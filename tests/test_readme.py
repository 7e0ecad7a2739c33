"""The README's Python snippets run as written, on a tiny random Llama and the real tokenizer.

Each ```python block of the README is executed in order in one namespace that holds what the
prose around it assumes (``model``, ``tokenizer``, the prompt's ids and text, ``send``,
``my_verify``, ...). A snippet that drifts from the API (a renamed argument, a call on a
closed session) fails here, and the tokens the snippets produce are plain greedy decoding's.
"""

import os
import re
from pathlib import Path

import torch

from agspec_gpu import DecoderConfig
from agspec_gpu.runners.hf import greedy_generate
from agspec_gpu.tokenizer import load_tokenizer
from tiny_models import tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPT = ("$ cat -n src/loss.py\n     1\tdef loss(pred, target):\n     2\t    diff = pred - "
          "target\n     3\t    return (diff * diff).mean()\n$ ")
FILE = "def loss(pred, target):\n    diff = pred - target\n    return (diff * diff).mean()\n"


def readme_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def per_node_verify(model, contexts):
    """``my_verify`` of the README's own-loop snippet, the slow obvious way: each row's logits
    from a plain forward over the session's cached context and the row's tree path (its
    ancestors and itself, ``tree_mask``'s row, in node order)."""
    def my_verify(inp):
        B, R = inp.input_ids.shape
        out = []
        for b in range(B):
            rows = []
            for i in range(R):
                path = inp.input_ids[b][inp.tree_mask[b, i]].tolist()
                seq = torch.tensor([contexts[b][:-1] + path])
                rows.append(model(seq, logits_to_keep=1).logits[0, -1])
            out.append(torch.stack(rows))
        return torch.stack(out)
    return my_verify


@torch.no_grad()
def test_readme_python_snippets_run_as_written(tmp_path):
    blocks = readme_blocks()
    assert len(blocks) == 4, "the README's usage snippets changed: update this test"
    tok = load_tokenizer("cl100k")
    model = tiny_model("llama", "sdpa", tok.vocab_size)
    ids = tok.encode(PROMPT)
    tool_output = "0.25\n$ "
    ns = dict(model=model, tokenizer=tok, ids=ids, prompt=PROMPT, text=FILE,
              tool_output=tool_output, tool_output_ids=tok.encode(tool_output))
    exec(blocks[0], ns)  # open, workspace file, generate, append, stats, close
    dec = ns["dec"]
    out = ns["out"][0]
    assert 0 < len(out) <= 256
    assert out == greedy_generate(model, ids, len(out), eos_id=tok.eos_id)[:len(out)]
    assert dec.stats["steps"] > 0

    # continuous batching: submit / step
    sid = dec.open_session("acme", "coder", ids)
    sent: list[int] = []
    ns.update(sid=sid, send=lambda s, toks: sent.extend(toks) if s == sid else None)
    exec(blocks[1], ns)
    assert not dec.running and not dec.queued and sent
    assert sent == greedy_generate(model, ids, len(sent), eos_id=tok.eos_id)[:len(sent)]
    dec.close_session(sid)

    # calibration on the paged runner, then a decoder that loads the file (at max_batch 2
    # and a small pool: the README's 64 x 1024 tokens of KV take minutes on a CPU)
    small = lambda **kw: DecoderConfig(**{**kw, "max_batch": 2, "kv_cache_tokens": 4096})
    ns["DecoderConfig"] = small
    cwd = os.getcwd()
    os.chdir(tmp_path)  # its out="cost.json"
    try:
        exec(blocks[2], ns)
    finally:
        os.chdir(cwd)
    dec = ns["dec"]
    assert (tmp_path / "cost.json").exists() and dec.config.cost_model == "cost.json"
    assert [b for b, _ in dec.drafter.cost.curves] == [1, 2]

    # your own loop: propose, tree_inputs, your verification forward, commit
    contexts = [ids, tok.encode(PROMPT + "python -c 'import loss'\n")]
    sids = [dec.open_session(f"t{b}", "coder", c) for b, c in enumerate(contexts)]
    for s in sids:  # something to draft from: the file the session has shown
        dec.add_workspace_file(s, "src/loss.py", FILE)
    ns.update(sids=sids, my_verify=per_node_verify(model, contexts))
    exec(blocks[3], ns)
    res = ns["res"]
    for b, c in enumerate(contexts):
        got = res.output_ids[b, :int(res.num_output[b])].tolist()
        assert got == greedy_generate(model, c, len(got), eos_id=None)
        assert dec.session_stats(sids[b]).num_steps == 1
