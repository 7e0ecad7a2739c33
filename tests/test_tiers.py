"""Corpus tiers: emission forms end to end, tenant isolation, memory, bad input, budgets.

Golden cases read one file through each tool-output format an agent sees (``cat -n``,
``nl -ba``, ``sed -n``, ``grep -n`` fragment, SWE-agent editor ``view``, heredoc write,
editor ``create``), capture it into the workspace tier, then let the agent write it back in
each emission form (unified-diff ``+``/`` ``/``-`` lines, a JSON ``str_replace`` argument,
re-indented blocks). With every form indexed, the drafter continues across line breaks for
20+ tokens; with raw text only it cannot get past the end of the current line.

All text goes through the real cl100k BPE, tokenized whole, as the library does.
"""

import dataclasses
import json
import random
import re

import pytest
import torch

import agspec_gpu.corpus as corpus_mod
from agspec_gpu.capture import capture_agent_writes, capture_tool_output
from agspec_gpu.controller import ControllerConfig
from agspec_gpu.drafter import Drafter, DrafterConfig
from agspec_gpu.forms import EmissionForm, render_forms
from agspec_gpu.tiers import (
    CorpusStore,
    CorpusTier,
    TierConfig,
    build_global_corpus,
    load_global_corpus,
)
from agspec_gpu.tokenizer import load_tokenizer

RAW_ONLY = (EmissionForm.RAW,)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("cl100k")


def chain_drafter(store: CorpusStore, k: int = 32, max_batch: int = 64) -> Drafter:
    return Drafter(store, DrafterConfig(calibrate=False, min_prob=0.0, tree=False,
                                        batch_budget=False,
                                        controller=ControllerConfig(static_k=k)),
                   max_batch=max_batch)


def draft_tokens(draft, b: int = 0) -> list[int]:
    return draft.token_ids[b, :int(draft.num_draft_tokens[b])].tolist()


def draft_paths(draft, b: int = 0) -> list[tuple[int, ...]]:
    n = int(draft.num_draft_tokens[b])
    out: list[tuple[int, ...]] = []
    for t, p in zip(draft.token_ids[b, :n].tolist(), draft.parents[b, :n].tolist()):
        out.append((() if p == -1 else out[p]) + (t,))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def occurs_in(seq: tuple[int, ...], docs: list[list[int]]) -> bool:
    m = len(seq)
    return any(tuple(d[i:i + m]) == seq for d in docs for i in range(len(d) - m + 1))


# ---------------------------------------------------------------- the file and its captures
SOURCE = '''"""Configuration loading for the demo service."""

import json
import os


def read_settings(path):
    with open(path) as fh:
        return json.load(fh)


class SettingsCache:
    """Caches parsed settings files by name."""

    def __init__(self, root, loader=read_settings):
        self.root = root
        self.loader = loader
        self.entries = {}

    def get(self, name):
        if name not in self.entries:
            path = os.path.join(self.root, name + ".json")
            self.entries[name] = self.loader(path)
        return self.entries[name]

    def invalidate(self, name=None):
        if name is None:
            self.entries.clear()
        else:
            self.entries.pop(name, None)
'''
LINES = SOURCE.split("\n")[:-1]
CLASS_LINE = LINES.index("class SettingsCache:") + 1  # 1-based: 12
REGION = "".join(ln + "\n" for ln in LINES[CLASS_LINE - 1:])  # the class block, to the end
PATH = "src/settings.py"


def mini_cmd(command: str) -> str:
    return f"THOUGHT: Let me look at the file.\n\n```bash\n{command}\n```"


def mini_out(body: str) -> str:
    return f"<returncode>0</returncode>\n<output>\n{body}</output>"


def swe_call(name: str, **arguments) -> str:
    return f"Let me check.\n\n<tool_call>{json.dumps({'name': name, 'arguments': arguments})}" \
           "</tool_call>"


def gutter(lines: list[str], first: int = 1) -> str:
    return "".join(f"{i:6d}\t{ln}\n" for i, ln in enumerate(lines, first))


def capture(fmt: str):
    """(captured files, expected text, expected first_line) for one tool-output format."""
    if fmt == "cat -n":
        caps = capture_tool_output(mini_cmd(f"cat -n {PATH}"), mini_out(gutter(LINES)))
        return caps, SOURCE, None
    if fmt == "nl -ba":
        caps = capture_tool_output(mini_cmd(f"nl -ba {PATH}"), mini_out(gutter(LINES)))
        return caps, SOURCE, None
    if fmt == "sed -n":
        caps = capture_tool_output(mini_cmd(f"sed -n '{CLASS_LINE},{len(LINES)}p' {PATH}"),
                                   mini_out(REGION))
        return caps, REGION, CLASS_LINE
    if fmt == "grep -n":
        body = "".join(f"{i}{':' if i == CLASS_LINE else '-'}{ln}\n"
                       for i, ln in enumerate(LINES[CLASS_LINE - 1:], CLASS_LINE))
        caps = capture_tool_output(
            mini_cmd(f'grep -n -A {len(LINES) - CLASS_LINE} "^class SettingsCache" {PATH}'),
            mini_out(body))
        return caps, REGION, CLASS_LINE
    if fmt == "swe-view":
        # the editor numbers content.split("\n") and strips trailing whitespace: a bare number
        out = ("OBSERVATION:\nHere's the result of running `cat -n` on /testbed/" + PATH + ":\n"
               + gutter(LINES) + f"{len(LINES) + 1:6d}").replace("\n", "\r\n")
        caps = capture_tool_output(swe_call("str_replace_editor", command="view",
                                            path="/testbed/" + PATH), out)
        return caps, SOURCE, None
    if fmt == "heredoc":
        return capture_agent_writes(mini_cmd(f"cat > {PATH} << 'EOF'\n{SOURCE}EOF")), SOURCE, None
    if fmt == "create":
        return capture_agent_writes(swe_call("str_replace_editor", command="create",
                                             path="/testbed/" + PATH, file_text=SOURCE)), \
            SOURCE, None
    raise AssertionError(fmt)


FORMATS = ["cat -n", "nl -ba", "sed -n", "grep -n", "swe-view", "heredoc", "create"]


def agent_message(form: EmissionForm) -> tuple[str, str]:
    """(header, body): the agent writing REGION back in ``form``, as it would in a message."""
    lines = REGION.split("\n")[:-1]
    if form in (EmissionForm.DIFF_ADD, EmissionForm.DIFF_CTX, EmissionForm.DIFF_DEL):
        prefix = {EmissionForm.DIFF_ADD: "+", EmissionForm.DIFF_CTX: " ",
                  EmissionForm.DIFF_DEL: "-"}[form]
        header = (f"```diff\n--- a/{PATH}\n+++ b/{PATH}\n"
                  f"@@ -{CLASS_LINE},{len(lines)} +{CLASS_LINE},{len(lines)} @@\n")
        return header, "".join(prefix + ln + "\n" for ln in lines)
    if form is EmissionForm.JSON:
        header = ('<tool_call>{"name": "str_replace_editor", "arguments": {"command": '
                  f'"str_replace", "path": "/testbed/{PATH}", "old_str": "')
        return header, json.dumps(REGION)[1:-1] + '", "new_str": "'
    if form is EmissionForm.INDENT_IN:  # the class moved into a block
        return "```python\nif HAVE_SETTINGS:\n", "".join(
            ("    " + ln if ln.strip() else ln) + "\n" for ln in lines)
    if form is EmissionForm.INDENT_OUT:  # the class body moved out one level
        return "```python\n", "".join(
            (ln[4:] if ln.startswith("    ") else ln) + "\n" for ln in lines)
    raise AssertionError(form)


WRITE_FORMS = [EmissionForm.DIFF_ADD, EmissionForm.DIFF_CTX, EmissionForm.DIFF_DEL,
               EmissionForm.JSON, EmissionForm.INDENT_IN, EmissionForm.INDENT_OUT]
BODY_CONTEXT = 6  # body tokens the drafter has seen when it proposes


def propose_in(tok, forms, captured, form):
    """(draft tokens, true continuation) for a fresh store holding ``captured``."""
    cfg = TierConfig(use_history=False, use_global=False) if forms is None else \
        TierConfig(forms=forms, use_history=False, use_global=False)
    store = CorpusStore(tok, cfg)
    for c in captured:
        assert store.add_workspace_file("t", c.path, c.text, c.first_line) > 0
    header, body = agent_message(form)
    ids = tok.encode(header + body)
    n_header = next(n for n in range(len(ids) + 1) if len(tok.decode(ids[:n])) >= len(header))
    cut = n_header + BODY_CONTEXT
    d = chain_drafter(store)
    d.open_session("s", "t", role="coder", prompt_ids=ids[:cut])
    return draft_tokens(d.propose(["s"])), ids[cut:]


def later_lines(text: str) -> list[str]:
    """Non-blank lines after the first line break (real or JSON-escaped)."""
    return [ln for ln in re.split(r"\n|\\n", text)[1:] if ln.strip()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_capture_formats_recover_the_file(fmt):
    caps, text, first_line = capture(fmt)
    assert len(caps) == 1, caps
    c = caps[0]
    assert c.text == text
    assert c.first_line == first_line
    assert c.path is not None and c.path.endswith(PATH)


@pytest.mark.parametrize("form", WRITE_FORMS, ids=lambda f: f.value)
@pytest.mark.parametrize("fmt", FORMATS)
def test_emission_forms_continue_across_lines(tok, fmt, form):
    captured, _, _ = capture(fmt)
    draft, truth = propose_in(tok, None, captured, form)
    good = common_prefix(draft, truth)
    assert good >= 20, (fmt, form, tok.decode(draft), tok.decode(truth[:40]))
    assert tok.decode(draft[:good]) == tok.decode(truth[:good])
    assert len(later_lines(tok.decode(draft[:good]))) >= 1  # crossed a line break
    # the raw text alone stops within the current line
    raw_draft, raw_truth = propose_in(tok, RAW_ONLY, captured, form)
    assert raw_truth == truth
    raw_good = common_prefix(raw_draft, truth)
    assert raw_good < 20, (fmt, form, tok.decode(raw_draft))
    assert later_lines(tok.decode(truth[:raw_good])) == []


def test_raw_form_alone_reads_back_raw_text(tok):
    # sanity: the raw-only store does draft when the agent writes raw text
    captured, _, _ = capture("cat -n")
    store = CorpusStore(tok, TierConfig(forms=RAW_ONLY, use_global=False))
    store.add_workspace_file("t", captured[0].path, captured[0].text)
    ids = tok.encode("```python\n" + REGION)
    d = chain_drafter(store)
    d.open_session("s", "t", prompt_ids=ids[:8])
    assert common_prefix(draft_tokens(d.propose(["s"])), ids[8:]) == 32


# ---------------------------------------------------------------- isolation
def code_file(rng: random.Random, words: list[str], n_lines: int) -> str:
    out = []
    for i in range(n_lines):
        a, b, c = rng.sample(words, 3)
        out.append(f"def {a}_{i}({b}, {c}):\n    return {b}.{a}({c}) + {rng.randint(0, 999)}\n")
    return "".join(out)


WORDS_A = ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum"]
WORDS_B = ["zircon", "quartz", "basalt", "gneiss", "schist", "marble", "obsidian", "pumice"]


def test_tenants_never_see_each_others_corpora(tok):
    rng = random.Random(5)
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = Drafter(store, DrafterConfig(batch_budget=False), max_batch=64)
    file_a, file_b = code_file(rng, WORDS_A, 12), code_file(rng, WORDS_B, 12)
    hist_a = tok.encode(code_file(rng, WORDS_A, 4))
    hist_b = tok.encode("B_HISTORY_SECRET = 'k9-" + "-".join(WORDS_B) + "'\n" +
                        code_file(rng, WORDS_B, 4))
    store.add_workspace_file("A", "a.py", file_a)
    store.add_workspace_file("B", "b.py", file_b)
    for tenant, hist in (("A", hist_a), ("B", hist_b)):
        d.open_session(f"{tenant}-old", tenant, role="coder", prompt_ids=hist)
        d.close_session(f"{tenant}-old")
    # what each tenant legitimately saw, tokenized independently of the store
    docs_a = tok.encode_batch(list(render_forms(file_a).values())) + [hist_a]
    docs_b = tok.encode_batch(list(render_forms(file_b).values())) + [hist_b]
    secrets = [tok.encode(file_b), hist_b]
    queries = []
    for _ in range(30):
        src = rng.choice(secrets)
        i, m = rng.randrange(0, len(src) - 20), rng.randint(3, 12)
        queries.append((src[i:i + m], src[i + m]))
    sids = []
    for q, (ids, _) in enumerate(queries):
        for tenant in ("A", "B"):
            d.open_session(f"{tenant}{q}", tenant, role="coder", prompt_ids=ids)
            sids.append(f"{tenant}{q}")
    draft = d.propose(sids)  # one batch mixes both tenants' rows
    cids_b = {cid for _, cid in store.corpora_of("B0")}
    b_hits = 0
    for row, sid in enumerate(sids):
        q = int(sid[1:])
        ids, nxt = queries[q]
        tiers = store.corpora_of(sid)
        assert [t for t, _ in tiers] == [CorpusTier.SESSION, CorpusTier.WORKSPACE,
                                        CorpusTier.HISTORY]
        assert tiers[0][1] == store.session(sid).corpus
        paths = draft_paths(draft, row)
        if sid[0] == "B":
            b_hits += bool(paths) and paths[0][0] == nxt
            continue
        assert not {cid for _, cid in tiers} & cids_b
        visible = docs_a + [ids]
        for p in paths:  # every draft path was copied from text tenant A saw
            assert occurs_in(p, visible), (sid, tok.decode(list(p)))
        # and never B's secret continuation (B-only 3-grams)
        for p in paths:
            for j in range(len(p) - 2):
                g = p[j:j + 3]
                assert not (occurs_in(g, docs_b) and not occurs_in(g, visible)), sid
        assert set(draft.maybe_source[row, :int(draft.num_draft_tokens[row])].tolist()) <= \
            {0, 8, 9, 10, 11, 12, 13, 14, 16}
    # B drafts its own continuation from the same queries: the check above is not vacuous
    assert b_hits >= 25
    # A's history: A's next session sees A's closed session, never B's
    d.open_session("A-new", "A", prompt_ids=hist_a[:6])
    d.open_session("A-probe", "A", prompt_ids=hist_b[:6])
    got = d.propose(["A-new", "A-probe"])
    assert draft_tokens(got, 0)[:4] == hist_a[6:10]
    assert all(occurs_in(p, [hist_b[:6]] + docs_a) for p in draft_paths(got, 1))
    # a session of one tenant cannot be extended into another's corpora
    assert store.tenant_of("A-new") == "A" and store.tenant_of("B0") == "B"


# ---------------------------------------------------------------- memory
def storage_bytes(arena) -> int:
    return sum(t.untyped_storage().nbytes() for t in (arena.tokens, arena.sa, arena.src))


def test_closing_frees_device_memory(tok):
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = chain_drafter(store, k=8)
    big = SOURCE * 20
    store.add_workspace_file("T", "big.py", big)
    d.open_session("t1", "T", prompt_ids=tok.encode(big[:4000]))
    d.open_session("u1", "U", prompt_ids=tok.encode(SOURCE))
    d.extend("u1", tok.encode("class SettingsCache:\n"))
    before_u = draft_tokens(d.propose(["u1"]))
    assert before_u
    cid_t1 = store.session("t1").corpus
    cid_ws = store.corpora_of("t1")[1][1]
    u_bytes = store.nbytes(tenant="U")
    assert store.nbytes(tenant="T") > 0 and u_bytes > 0
    arena_before, storage_before = store.arena.nbytes(), storage_bytes(store.arena)
    assert arena_before == storage_before  # nbytes() reports the real buffer storage
    d.close_session("t1")
    assert store.nbytes(CorpusTier.SESSION, tenant="T") == 0
    assert store.nbytes(CorpusTier.HISTORY, tenant="T") > 0  # the session joined history
    cid_hist = [c for t, c in store_corpora(store, "T") if t is CorpusTier.HISTORY][0]
    store.close_tenant("T")
    assert store.nbytes(tenant="T") == 0
    for cid in (cid_t1, cid_ws, cid_hist):
        assert cid not in store.arena
        with pytest.raises(KeyError, match="unknown or freed"):
            store.arena.num_tokens(cid)
        with pytest.raises(KeyError):
            store.arena.corpus_tokens(cid)
    arena_after, storage_after = store.arena.nbytes(), storage_bytes(store.arena)
    assert arena_after == storage_after
    assert arena_after < arena_before / 10, (arena_before, arena_after)
    # the remaining buffers hold little more than the live corpora (compaction shrank them)
    live = sum(store.arena.nbytes(c) for c in store.arena._corpora)
    assert live == u_bytes == store.nbytes()
    assert arena_after <= 2 * live + 1024
    # the other tenant is untouched
    assert draft_tokens(d.propose(["u1"])) == before_u
    with pytest.raises(KeyError):
        store.close_tenant("T")


def store_corpora(store: CorpusStore, tenant: str):
    """(tier, cid) of a tenant's workspace and history through any open session or the
    tenant record (a tenant may have no open session)."""
    t = store._tenants[tenant]
    out = []
    if t.workspace is not None:
        out.append((CorpusTier.WORKSPACE, t.workspace))
    if t.history is not None:
        out.append((CorpusTier.HISTORY, t.history))
    return out


def test_close_session_without_history_frees_everything(tok):
    store = CorpusStore(tok, TierConfig(use_global=False, use_history=False))
    store.open_session("s", "T", tok.encode(SOURCE * 10))
    held = store.arena.nbytes()
    assert store.nbytes(tenant="T") > 0
    store.close_session("s")
    assert store.nbytes(tenant="T") == 0 and store.nbytes() == 0
    assert store.arena.nbytes() == storage_bytes(store.arena) < held / 100  # shrunk


# ---------------------------------------------------------------- bad input
@pytest.fixture()
def live(tok):
    """A drafter with two working sessions and their current drafts."""
    store = CorpusStore(tok, TierConfig(use_global=False))
    d = Drafter(store, DrafterConfig(batch_budget=False), max_batch=8)
    store.add_workspace_file("T", PATH, SOURCE)
    d.open_session("good1", "T", role="coder", prompt_ids=tok.encode(REGION)[:12])
    d.open_session("good2", "U", role="coder", prompt_ids=tok.encode("x = 1\ny = 2\nx = 1\n"))
    before = {s: draft_paths(d.propose([s])) for s in ("good1", "good2")}
    assert before["good1"] and before["good2"]
    return store, d, before


def still_works(d, before):
    got = d.propose(["good1", "good2"])
    assert draft_paths(got, 0) == before["good1"]
    assert draft_paths(got, 1) == before["good2"]


def test_unknown_and_closed_sessions(live):
    store, d, before = live
    d.open_session("gone", "T", prompt_ids=[1, 2, 3])
    d.close_session("gone")
    for sid in ("nope", "gone"):
        with pytest.raises(KeyError, match=sid):
            d.propose(["good1", sid])
        with pytest.raises(KeyError, match=sid):
            d.extend(sid, [1, 2])
        with pytest.raises(KeyError, match=sid):
            d.observe([sid], torch.tensor([[1]]), torch.tensor([1]), torch.tensor([0]))
        with pytest.raises(KeyError, match=sid):
            d.close_session(sid)
        for call in (store.session, store.tenant_of, store.corpora_of, store.close_session):
            with pytest.raises(KeyError, match="unknown or closed"):
                call(sid)
        with pytest.raises(KeyError):
            store.append_session(sid, [1])
    with pytest.raises(KeyError, match="tenant"):
        store.close_tenant("nobody")
    still_works(d, before)


def test_duplicate_session_id(live, tok):
    store, d, before = live
    n = store.arena.num_tokens(store.session("good1").corpus)
    for tenant in ("T", "U", "V"):
        with pytest.raises(ValueError, match="already exists"):
            d.open_session("good1", tenant, prompt_ids=tok.encode("something else"))
        with pytest.raises(ValueError, match="already exists"):
            store.open_session("good1", tenant, [5, 6])
    assert store.arena.num_tokens(store.session("good1").corpus) == n
    assert store.tenant_of("good1") == "T"
    with pytest.raises(ValueError, match="sid"):
        store.open_session("", "T", [1])
    still_works(d, before)


@pytest.mark.parametrize("bad", [[5, 100_277], [-1, 5], [5, -7, 9], [2**31 - 1], [2**40],
                                 [1.7, 2.9], [True, 3]])
def test_out_of_vocabulary_ids_are_rejected(live, tok, bad):
    """Ids outside the vocabulary, and non-integers (a float or bool list was truncated
    into ids), named as token ids."""
    store, d, before = live
    assert tok.vocab_size == 100_277
    with pytest.raises(ValueError, match="token id"):
        d.open_session("new", "T", prompt_ids=bad)
    with pytest.raises(ValueError, match="token id"):
        d.extend("good1", bad)
    with pytest.raises(ValueError, match="token id"):
        store.append_session("good1", bad)
    if all(type(t) is int for t in bad) and max(bad) < 2**62:
        with pytest.raises(ValueError, match="token ids"):
            store.open_session("new2", "T", torch.tensor(bad))
    still_works(d, before)
    d.open_session("new", "T", prompt_ids=[5])  # the failed open left no trace
    assert "new2" not in store._sessions


@pytest.mark.parametrize("bad_ids", [[[5, 100_277]], [[-5, 7]]])
def test_out_of_vocabulary_commit_is_rejected_atomically(live, bad_ids):
    """observe() with an invalid id must raise before it changes any state, so that the
    batch's other sessions (and the bad one) draft exactly as before."""
    store, d, before = live
    d.propose(["good1", "good2"])
    out = torch.tensor([[1, 2]] + bad_ids, dtype=torch.int32)
    n1 = store.arena.num_tokens(store.session("good1").corpus)
    with pytest.raises(ValueError, match="token ids"):
        d.observe(["good1", "good2"], out, torch.tensor([2, 2]), torch.tensor([0, 0]))
    assert store.arena.num_tokens(store.session("good1").corpus) == n1
    still_works(d, before)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[[1, 2]]), "integer token ids"),
    (dict(prompt_ids=torch.tensor([1.0, 2.0])), "int32 or int64 tensor"),
])
def test_malformed_prompts(live, kwargs, match):
    store, d, before = live
    with pytest.raises(ValueError, match=match):
        d.open_session("bad", "T", **kwargs)
    still_works(d, before)


@pytest.fixture(scope="module")
def global_file(tok, tmp_path_factory):
    src = tmp_path_factory.mktemp("stdlib")
    (src / "pkg").mkdir()
    (src / "textwrap_like.py").write_text(
        "def shorten_paragraph_text(text, width=70, placeholder=' [...]'):\n"
        "    words = text.split()\n    return ' '.join(words)[:width] + placeholder\n")
    (src / "pkg" / "queue_like.py").write_text(
        "class BoundedWorkQueue:\n    def put_nowait(self, item):\n"
        "        if self.full():\n            raise QueueFullError(item)\n"
        "        self._items.append(item)\n" * 3)
    (src / "notes.txt").write_text("not python: never indexed\n")
    out = tmp_path_factory.mktemp("global") / "global.agspec"
    g = build_global_corpus([src], tok, out, max_depth=32)
    return out, g, src


def test_global_corpus_round_trip(tok, global_file):
    path, built, src = global_file
    g = load_global_corpus(path, tok)
    assert torch.equal(g.tokens, built.tokens) and torch.equal(g.sa, built.sa)
    assert (g.indexed_end, g.max_depth, g.fingerprint) == \
        (built.tokens.numel(), 32, tok.fingerprint)
    files = sorted(p for p in src.rglob("*.py"))
    expected = []
    for p in files:
        expected += [-1] + tok.encode(p.read_text())
    assert g.tokens.tolist() == expected  # whole-text tokenization, one document per file
    assert load_global_corpus(path).fingerprint == tok.fingerprint  # no tokenizer: no check


def test_global_corpus_serves_every_tenant(tok, global_file):
    path, _, _ = global_file
    store = CorpusStore(tok, TierConfig(), global_corpus=load_global_corpus(path, tok))
    d = chain_drafter(store, k=12)
    text = "class BoundedWorkQueue:\n    def put_nowait(self, item):\n        if self.full():\n"
    ids = tok.encode(text)
    for tenant in ("A", "B", "C"):
        d.open_session(tenant, tenant, prompt_ids=ids[:5])
    draft = d.propose(["A", "B", "C"])
    for b in range(3):
        assert draft_tokens(draft, b)[:8] == ids[5:13]
        assert set(draft.maybe_source[b, :int(draft.num_draft_tokens[b])].tolist()) == \
            {int(CorpusTier.GLOBAL) * 8}
        assert store.corpora_of("ABC"[b])[-1] == (CorpusTier.GLOBAL, store.global_cid)
    assert store.nbytes(CorpusTier.GLOBAL) > 0
    assert store.nbytes(tenant="A") == store.nbytes(CorpusTier.SESSION, tenant="A")
    off = CorpusStore(tok, TierConfig(use_global=False), global_corpus=load_global_corpus(path))
    assert off.global_cid is None


def test_global_corpus_object_is_checked_as_a_file_is(tok, global_file):
    """A GlobalCorpus made in code skips the file's checksum: ids past the vocabulary
    (they would be drafted) and suffix-array entries past its positions (the match kernel
    reads them unchecked) raise naming the field, as does a wrong dtype or shape."""
    _, g, _ = global_file
    CorpusStore(tok, TierConfig(), global_corpus=g)  # the built one passes
    big = g.tokens.clone()
    big[5] = tok.vocab_size + 100
    low = g.tokens.clone()
    low[5] = -2
    far = g.sa.clone()
    far[0] = g.indexed_end
    for bad, match in ((dict(tokens=big), "tokens: ids outside"),
                       (dict(tokens=low), "tokens: ids outside"),
                       (dict(tokens=g.tokens.long()), "tokens: expected an int32"),
                       (dict(sa=far), "sa: "), (dict(sa=g.sa[None]), "sa: expected an int32"),
                       (dict(sa=torch.cat([g.sa, g.sa])), "sa: "),
                       (dict(indexed_end=g.tokens.numel() + 1), "indexed_end")):
        with pytest.raises(ValueError, match=f"global corpus {match}"):
            CorpusStore(tok, TierConfig(), global_corpus=dataclasses.replace(g, **bad))


def test_global_corpus_truncated(live, global_file, tmp_path):
    store, d, before = live
    path, _, _ = global_file
    data = path.read_bytes()
    for keep in (len(data) // 2, len(data) - 3, 7):
        bad = tmp_path / f"trunc{keep}.agspec"
        bad.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="truncated"):
            load_global_corpus(bad, store.tokenizer)
    still_works(d, before)


def test_global_corpus_corrupted(live, global_file, tmp_path):
    store, d, before = live
    path, _, _ = global_file
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 8):
        data[i] ^= 0x5A
    bad = tmp_path / "flipped.agspec"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        load_global_corpus(bad, store.tokenizer)
    not_agspec = tmp_path / "other.safetensors"
    from safetensors.torch import save_file
    save_file({"tokens": torch.zeros(4, dtype=torch.int32),
               "sa": torch.zeros(4, dtype=torch.int32)}, str(not_agspec))
    with pytest.raises(ValueError, match="not an agspec global corpus"):
        load_global_corpus(not_agspec)
    old = tmp_path / "v1.agspec"  # the forward suffix array of earlier versions
    save_file({"tokens": torch.zeros(4, dtype=torch.int32),
               "sa": torch.zeros(4, dtype=torch.int32)}, str(old),
              metadata={"format": "agspec-global-v1"})
    with pytest.raises(ValueError, match="agspec-global-v1.*rebuild it with"):
        load_global_corpus(old)
    with pytest.raises(ValueError, match="truncated|unreadable"):
        load_global_corpus(tmp_path / "missing.agspec")
    still_works(d, before)


def test_global_corpus_built_with_another_tokenizer(live, global_file, tmp_path, tok):
    store, d, before = live
    path, built, src = global_file
    other = dataclasses.replace(tok, name="other-bpe", fingerprint="f" * 64)
    with pytest.raises(ValueError, match="tokenizer"):
        load_global_corpus(path, other)
    with pytest.raises(ValueError, match="another tokenizer"):
        CorpusStore(other, TierConfig(), global_corpus=built)
    foreign = build_global_corpus([src], other, tmp_path / "foreign.agspec")
    with pytest.raises(ValueError, match="tokenizer"):
        load_global_corpus(tmp_path / "foreign.agspec", tok)
    with pytest.raises(ValueError, match="another tokenizer"):
        CorpusStore(tok, TierConfig(), global_corpus=foreign)
    with pytest.raises(ValueError, match="max_depth"):
        CorpusStore(tok, TierConfig(max_depth=16), global_corpus=built)
    with pytest.raises(ValueError, match="does not exist"):
        build_global_corpus([tmp_path / "nowhere"], tok, tmp_path / "x.agspec")
    # one path where a list is meant (iterated by character, or ".py" read as a set of
    # suffixes that takes files with none), a budget nothing fits in, no such half
    for kw, name in ((dict(src=str(src)), "src"), (dict(src=src), "src"),
                     (dict(src=[src], suffixes=".py"), "suffixes"),
                     (dict(src=[src], trajectories="t.jsonl"), "trajectories"),
                     (dict(src=[src], max_tokens=3), "max_tokens"),
                     (dict(src=[src], max_tokens=-1), "max_tokens"),
                     (dict(src=[src], half=2), "half"), (dict(src=[src], half=True), "half")):
        with pytest.raises(ValueError, match=name):
            build_global_corpus(tokenizer=tok, out=tmp_path / "x.agspec", **kw)
    assert not (tmp_path / "x.agspec").exists()
    still_works(d, before)



def test_global_corpus_header_fields_are_checked(global_file, tmp_path):
    """The checksum covers the tensors only: a header field missing or of the wrong kind
    (or tensors of another dtype, which the checksum could not even read) had escaped as
    KeyError / TypeError / a bare int() message; each names the file and the field now."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from agspec_gpu.tiers import _digest

    path, _, _ = global_file
    with safe_open(str(path), "pt") as f:
        meta, tokens, sa = dict(f.metadata()), f.get_tensor("tokens"), f.get_tensor("sa")
    for i, (change, tensors, field) in enumerate((
            (dict(indexed_end=None), None, "'indexed_end' missing"),
            (dict(fingerprint=None), None, "'fingerprint' missing"),
            (dict(indexed_end="abc"), None, "'indexed_end' = 'abc'"),
            (dict(max_depth="-3"), None, "'max_depth' = '-3'"),
            (dict(sessions="5"), None, "'sessions' is not a JSON list"),
            (dict(tasks="[1]"), None, "'tasks' is not a JSON list"),
            ({}, dict(tokens=tokens.to(torch.bfloat16), sa=sa), "tokens is torch.bfloat16"))):
        t = tensors or dict(tokens=tokens, sa=sa)
        m = {k: v for k, v in {**meta, **change}.items() if v is not None}
        if tensors is None:
            m["sha256"] = _digest(t["tokens"], t["sa"])
        bad = tmp_path / f"bad{i}.agspec"
        save_file(t, str(bad), metadata=m)
        with pytest.raises(ValueError, match=f"global corpus {re.escape(str(bad))}: .*"
                                             f"{re.escape(field)}"):
            load_global_corpus(bad)


def test_build_global_says_what_it_leaves_out(tok, global_file, tmp_path):
    """Documents past ``max_tokens`` and source files that are not UTF-8 were dropped
    without a word; both warn now, and an error names what was found (it had said "no
    file with suffix .py" of a directory holding one). The tokenizer may be named."""
    _, _, src = global_file
    with pytest.warns(UserWarning, match=r"max_tokens: 1 of 2 documents left out"):
        build_global_corpus([src], tok, tmp_path / "cut.agspec", max_tokens=120)
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "caf.py").write_bytes(b"x = '\xe9'\n")
    with pytest.warns(UserWarning, match=r"src: 1 of 1 files are not readable as UTF-8"), \
            pytest.raises(ValueError, match=r"1 src files \(0 readable"):
        build_global_corpus([latin], tok, tmp_path / "x.agspec")
    with pytest.raises(ValueError, match=r"sessions\[0\]: expected a Session"):
        build_global_corpus([src], tok, tmp_path / "x.agspec", sessions=[1])
    g = build_global_corpus([src], "cl100k", tmp_path / "named.agspec")
    assert g.fingerprint == load_tokenizer("cl100k").fingerprint
    assert load_global_corpus(tmp_path / "named.agspec", "cl100k").fingerprint == g.fingerprint
    with pytest.raises(OSError, match="cannot write the global corpus"):
        build_global_corpus([src], tok, tmp_path / "no-dir" / "x.agspec")

# ---------------------------------------------------------------- workspace
def ws_cid(store, tenant):
    return store._tenants[tenant].workspace


def test_rereading_the_same_text_adds_nothing(tok):
    store = CorpusStore(tok, TierConfig(use_global=False))
    added = store.add_workspace_file("T", PATH, SOURCE)
    forms = render_forms(SOURCE)
    assert added == sum(1 + len(ids) for ids in tok.encode_batch(list(forms.values())))
    n = store.arena.num_tokens(ws_cid(store, "T"))
    for path in (PATH, PATH):
        assert store.add_workspace_file("T", path, SOURCE) == 0
    assert store.arena.num_tokens(ws_cid(store, "T")) == n
    assert store.add_workspace_file("T", PATH, "") == 0
    # another tenant reading the same text gets its own copy
    assert store.add_workspace_file("U", PATH, SOURCE) == added


def test_changed_file_keeps_the_old_version_searchable(tok):
    store = CorpusStore(tok, TierConfig(use_global=False, forms=RAW_ONLY))
    v1 = SOURCE
    v2 = SOURCE.replace("self.entries.pop(name, None)", "del self.entries[name]  # strict")
    store.add_workspace_file("T", PATH, v1)
    assert store.add_workspace_file("T", PATH, v2) > 0
    d = chain_drafter(store, k=6)
    old, new = tok.encode(v1), tok.encode(v2)
    # the versions share everything up to the last line; query just before it differs
    split = common_prefix(old, new)
    d.open_session("o", "T", prompt_ids=old[split - 8:split] + old[split:split + 2])
    d.open_session("n", "T", prompt_ids=new[split - 8:split] + new[split:split + 2])
    draft = d.propose(["o", "n"])
    assert draft_tokens(draft, 0) == old[split + 2:split + 8][:len(draft_tokens(draft, 0))]
    assert draft_tokens(draft, 1) == new[split + 2:split + 8][:len(draft_tokens(draft, 1))]
    assert draft_tokens(draft, 0) and draft_tokens(draft, 1)


def small_file(i: int) -> str:
    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    n = names[i]
    return (f"def {n}_handler_{i}(request):\n    {n}_payload = request.{n}_fields()\n"
            f"    return respond_{n}({n}_payload, code={100 + i})\n")


def test_workspace_lru_eviction_drops_the_oldest_first(tok):
    sizes = [1 + len(tok.encode(small_file(i))) for i in range(6)]
    budget = int(sum(sizes[:5]) + sizes[5] // 2)  # the sixth file overflows the budget
    store = CorpusStore(tok, TierConfig(use_global=False, forms=RAW_ONLY,
                                        workspace_budget_tokens=budget))
    for i in range(5):
        assert store.add_workspace_file("T", f"f{i}.py", small_file(i)) == sizes[i]
    assert store.add_workspace_file("T", "f0.py", small_file(0)) == 0  # refresh: f0 newest
    store.add_workspace_file("T", "f5.py", small_file(5))
    # LRU order was f1 f2 f3 f4 f0 f5: drop from f1 until at most budget // 2 remains
    keep, total = [5, 0], sizes[5] + sizes[0]
    order = [4, 3, 2, 1]
    for i in order:
        if total + sizes[i] > budget // 2:
            break
        keep.append(i)
        total += sizes[i]
    assert store.arena.num_tokens(ws_cid(store, "T")) == total
    d = chain_drafter(store, k=6)
    for i in range(6):
        ids = tok.encode(small_file(i))
        d.open_session(f"q{i}", "T", prompt_ids=ids[:7])
    draft = d.propose([f"q{i}" for i in range(6)])
    for i in range(6):
        ids = tok.encode(small_file(i))
        got = draft_tokens(draft, i)
        if i in keep:
            assert got == ids[7:13], i  # correct after the rebuild moved the documents
            assert set(draft.maybe_source[i, :len(got)].tolist()) == {8}
        else:  # evicted: its own continuation is gone, whatever is drafted comes from the rest
            assert got != ids[7:13], i
            assert occurs_in(tuple(got), [tok.encode(small_file(j)) for j in keep] + [ids[:7]])
    for i in keep:  # the survivors are still known after the rebuild: re-reads are free
        assert store.add_workspace_file("T", f"f{i}.py", small_file(i)) == 0, i
    gone = min(set(range(6)) - set(keep))
    assert store.add_workspace_file("T", f"f{gone}.py", small_file(gone)) == sizes[gone]


def test_workspace_eviction_keeps_the_file_just_opened(tok):
    store = CorpusStore(tok, TierConfig(use_global=False, forms=RAW_ONLY,
                                        workspace_budget_tokens=300))
    store.add_workspace_file("T", "a.py", "x = 1\n" * 10)
    big = "def f(a, b):\n    return a + b\n" * 22  # 265 tokens: under the budget
    assert store.add_workspace_file("T", "b.py", big) > 0
    assert store.add_workspace_file("T", "b.py", big) == 0  # still there: re-read is free
    assert store.arena.num_tokens(ws_cid(store, "T")) > 0


def test_a_file_past_the_whole_workspace_budget_is_refused(tok):
    """Eviction keeps the newest file whole, so one file past the whole budget held the
    tier past it (169,100 tokens on a budget of 2,000). It is refused naming ``text``, with
    nothing added: the tier keeps its files and no tenant record is made."""
    store = CorpusStore(tok, TierConfig(use_global=False, forms=RAW_ONLY,
                                        workspace_budget_tokens=300))
    store.add_workspace_file("T", "a.py", "x = 1\n" * 10)
    held = store.arena.num_tokens(ws_cid(store, "T"))
    big = "def f(a, b):\n    return a + b\n" * 30  # 361 tokens
    for tenant in ("T", "U"):
        with pytest.raises(corpus_mod.BudgetExceeded,
                           match=r"text: 361 tokens in its 1 forms exceed "
                                 r"TierConfig.workspace_budget_tokens=300; nothing added"):
            store.add_workspace_file(tenant, "b.py", big)
    assert store.arena.num_tokens(ws_cid(store, "T")) == held and "U" not in store._tenants
    assert store.add_workspace_file("T", "b.py", big[:len(big) * 2 // 3]) > 0


def test_history_is_per_tenant_and_bounded(tok):
    docs = [tok.encode(small_file(i)) for i in range(4)]
    budget = len(docs[0]) + len(docs[1]) + len(docs[2]) // 2 + 2
    # evicting only what the budget needs (a low water of 1): exactly the oldest session
    store = CorpusStore(tok, TierConfig(use_global=False, history_budget_tokens=budget,
                                        history_low_water=1.0))
    d = chain_drafter(store, k=6)
    for i in range(2):
        d.open_session(f"h{i}", "T", prompt_ids=docs[i])
        d.close_session(f"h{i}")
    d.open_session("next", "T", prompt_ids=docs[1][:7])
    d.open_session("other", "U", prompt_ids=docs[1][:7])
    draft = d.propose(["next", "other"])
    assert draft_tokens(draft, 0) == docs[1][7:13]
    assert set(draft.maybe_source[0, :6].tolist()) == {int(CorpusTier.HISTORY) * 8}
    assert draft_tokens(draft, 1) == []  # U has no history of its own
    assert [t for t, _ in store.corpora_of("other")] == [CorpusTier.SESSION]
    # a third closed session overflows the budget: the oldest (h0) is dropped
    d.open_session("h2", "T", prompt_ids=docs[2])
    d.close_session("h2")
    hist = store.arena.corpus_tokens(store_corpora(store, "T")[-1][1]).tolist()
    assert hist == [-1] + docs[1] + [-1] + docs[2]
    assert len(hist) <= budget
    for i, expect in ((0, False), (1, True), (2, True)):
        d.open_session(f"p{i}", "T", prompt_ids=docs[i][:7])
        got = draft_tokens(d.propose([f"p{i}"]))
        assert (got == docs[i][7:13]) == expect, i
        d.close_session(f"p{i}")  # (joins the history too)


def test_a_full_history_is_reindexed_once_per_quarter_budget(tok, monkeypatch):
    """Past its budget the history evicts down to ``history_low_water`` (0.75) of it, so a
    full history is re-indexed once per quarter budget of closed sessions, not at every
    close (a low water of 1 did: the whole history indexed again per closed session)."""
    rebuilds = []
    rebuild = corpus_mod.DocumentCorpus._rebuild
    monkeypatch.setattr(corpus_mod.DocumentCorpus, "_rebuild",
                        lambda self: rebuilds.append(1) or rebuild(self))
    budget, size = 2000, 100
    store = CorpusStore(tok, TierConfig(use_global=False, history_budget_tokens=budget))
    held = []
    for i in range(60):
        store.open_session(f"s{i}", "T", [(7 * i + j) % 1000 for j in range(size)])
        store.close_session(f"s{i}")
        held.append(store._tenants["T"].hist.num_tokens)
    # 101 tokens a session (its separator): the 20th close overflows, evicts down to 14
    # sessions (1,414 tokens), and every 6th close after it again
    assert len(rebuilds) == 7
    assert max(held) <= budget and min(held[19:]) >= 0.75 * budget - (size + 1)
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="history_low_water"):
            TierConfig(history_low_water=bad)
    with pytest.raises(ValueError, match="workspace_low_water"):
        TierConfig(workspace_low_water=0.0)


def test_history_keeps_the_newest_session_even_over_budget(tok):
    store = CorpusStore(tok, TierConfig(use_global=False, history_budget_tokens=10))
    ids = tok.encode(SOURCE)
    store.open_session("s", "T", ids)
    store.close_session("s")
    assert store.arena.corpus_tokens(store_corpora(store, "T")[-1][1]).tolist() == [-1] + ids


def test_tier_switches(tok):
    store = CorpusStore(tok, TierConfig(use_workspace=False, use_history=False,
                                        use_global=False))
    assert store.add_workspace_file("T", PATH, SOURCE) == 0
    store.open_session("s", "T", [1, 2, 3])
    store.close_session("s")
    store.open_session("s2", "T", [1, 2, 3])
    assert [t for t, _ in store.corpora_of("s2")] == [CorpusTier.SESSION]
    with pytest.raises(ValueError, match="RAW"):
        TierConfig(forms=(EmissionForm.JSON,))
    with pytest.raises(ValueError, match="budget"):
        TierConfig(workspace_budget_tokens=0)


# ---------------------------------------------------------------- idle tenants
def test_idle_tenants_are_freed_least_recently_active_first(tok):
    """Past ``idle_budget_tokens``, the idle tenants (no open session) that were active
    longest ago are freed whole, as close_tenant frees one; a tenant with an open session,
    and the tenant just active, never are; a file joining an idle tenant makes it the
    most recently active. The budget counts the slots a corpus reserves (1,024 at least)."""
    size = 200  # 201 tokens of history per closed session (its separator), 1,024 slots
    store = CorpusStore(tok, TierConfig(use_global=False, idle_budget_tokens=3 * 1024))
    d = chain_drafter(store, k=8)
    d.open_session("busy", "Busy", prompt_ids=tok.encode(SOURCE))  # stays open throughout
    d.extend("busy", tok.encode("class SettingsCache:\n"))
    busy_draft = draft_tokens(d.propose(["busy"]))
    assert busy_draft

    def visit(tenant, i):
        d.open_session(f"{tenant}{i}", tenant,
                       prompt_ids=[(13 * i + j) % 1000 for j in range(size)])
        d.close_session(f"{tenant}{i}")

    for i, tenant in enumerate("ABC"):
        visit(tenant, i)
    assert store.num_evicted_tenants == 0 and sorted(store._tenants) == ["A", "B", "Busy", "C"]
    bytes_before = store.nbytes()
    store.add_workspace_file("A", PATH, "x = 1\n")  # A: idle but now the most recent
    assert store.num_evicted_tenants == 1 and "B" not in store._tenants  # B: the oldest
    cids_a = [c for _, c in store_corpora(store, "A")]
    assert len(cids_a) == 2  # its workspace and history
    visit("D", 3)
    assert store.num_evicted_tenants == 2 and "C" not in store._tenants
    assert sorted(store._tenants) == ["A", "Busy", "D"]
    idle = sum(store._tenants[t].num_slots for t in ("A", "D"))
    assert idle <= store.config.idle_budget_tokens
    assert store.nbytes(tenant="B") == store.nbytes(tenant="C") == 0
    assert store.nbytes() < bytes_before + store.nbytes(CorpusTier.WORKSPACE, tenant="A")
    with pytest.raises(KeyError, match="freed as idle"):
        store.close_tenant("B")
    # A freed later: its corpora leave the arena; a returning tenant starts empty
    visit("E", 4)
    visit("F", 5)
    assert "A" not in store._tenants
    for cid in cids_a:
        assert cid not in store.arena
    visit("A", 6)
    assert [t for t, _ in store_corpora(store, "A")] == [CorpusTier.HISTORY]
    assert store._tenants["A"].hist.num_tokens == size + 1
    # the busy tenant, least recently active of all, kept its session and drafts
    assert "Busy" in store._tenants
    assert draft_tokens(d.propose(["busy"])) == busy_draft



def test_many_tiny_idle_tenants_are_budgeted_by_the_memory_they_reserve(tok):
    """Counting the tokens they hold, 600 tenants each left with one 20-token session's
    history (21 tokens, 1,024 slots reserved) stayed under a 24,000-token budget while
    the arena grew to 5 MB; counting reserved slots, the oldest go once 23 are idle."""
    store = CorpusStore(tok, TierConfig(use_global=False, idle_budget_tokens=24_000))
    for i in range(600):
        store.open_session(f"s{i}", f"T{i}", list(range(i % 50, i % 50 + 20)))
        store.close_session(f"s{i}")
    assert len(store._tenants) == 23 and store.num_evicted_tenants == 577
    assert sum(t.num_slots for t in store._tenants.values()) <= 24_000
    assert store.arena.tokens.numel() <= 3 * 24_000

def test_a_tenant_larger_than_the_idle_budget_is_kept_while_just_active(tok):
    store = CorpusStore(tok, TierConfig(use_global=False, idle_budget_tokens=50))
    store.open_session("s", "T", list(range(100)))
    store.close_session("s")  # T alone is over budget: kept, it was just active
    assert store._tenants["T"].num_tokens == 101 and store.num_evicted_tenants == 0
    store.add_workspace_file("U", PATH, SOURCE)  # now T is the idle one to free
    assert "T" not in store._tenants and store.num_evicted_tenants == 1
    # without a history, a tenant that came and went holds nothing: its record goes too
    no_hist = CorpusStore(tok, TierConfig(use_global=False, use_history=False,
                                          idle_budget_tokens=50))
    for i in range(5):
        no_hist.open_session(f"s{i}", f"T{i}", list(range(100)))
        no_hist.close_session(f"s{i}")
    assert list(no_hist._tenants) == ["T4"] and no_hist.num_evicted_tenants == 4
    unbounded = CorpusStore(tok, TierConfig(use_global=False, idle_budget_tokens=None))
    for i in range(5):
        unbounded.open_session(f"s{i}", f"T{i}", list(range(100)))
        unbounded.close_session(f"s{i}")
    assert len(unbounded._tenants) == 5 and unbounded.num_evicted_tenants == 0
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="idle_budget_tokens"):
            TierConfig(idle_budget_tokens=bad)


def test_workspace_first_line_is_checked_before_anything_changes(tok):
    """``first_line`` is None or a 1-based line: 0, a negative, a bool, a str or a float is
    a ValueError naming it (an audit found them indexed silently), the tenant unchanged."""
    store = CorpusStore(tok, TierConfig(use_global=False, forms=RAW_ONLY))
    assert store.add_workspace_file("T", "a.py", small_file(0), first_line=3) > 0
    before = (store.epoch, store.arena.num_tokens(ws_cid(store, "T")))
    for bad in (0, -3, True, "x", 2.5):
        with pytest.raises(ValueError, match="first_line"):
            store.add_workspace_file("T", "a.py", small_file(1), first_line=bad)
    assert (store.epoch, store.arena.num_tokens(ws_cid(store, "T"))) == before
    assert store.add_workspace_file("T", "a.py", small_file(1), first_line=1) > 0
