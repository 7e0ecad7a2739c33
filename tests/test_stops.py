"""StopMatcher against the reference it replaces: decode the whole output after every token
and end at the first token after which a stop string appears (real cl100k tokens of real
agent sessions, plus multi-byte text, byte-fragment tokens and periodic text)."""

import functools
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from agspec_gpu.stops import StopMatcher
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_sessions

DEV = Path("/work/shared/data/trajectories/dev")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_stops  # noqa: E402  (bench/ is not a package)


@functools.cache
def tok():
    return load_tokenizer("cl100k")


def reference(tokens, stops, t=None) -> int | None:
    """The number of tokens up to the one after which a stop string first appears (``t``:
    the tokenizer, cl100k by default)."""
    t = t or tok()
    for k in range(1, len(tokens) + 1):
        text = t.decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return None


def matched(tokens, stops, t=None) -> int | None:
    t = t or tok()
    m = StopMatcher.for_tokenizer(t, stops)
    for k, x in enumerate(tokens, 1):
        if m.push(x):
            return k
    return None


@functools.cache
def session_texts() -> tuple[str, ...]:
    texts = []
    for path in sorted(DEV.glob("*.jsonl.gz"))[:3]:
        for s in load_sessions(path, limit=2):
            texts += [m.content for m in s.messages if m.role == "assistant" and
                      len(m.content) > 200][:3]
    return tuple(texts)


def stops_from(text: str, rng: random.Random, n: int) -> list[list[str]]:
    """Stop-string sets drawn from ``text``: substrings of 1-40 chars at random places (many
    cross token boundaries, some are whitespace), alone or next to a string not in it."""
    out = []
    for _ in range(n):
        a = rng.randrange(len(text))
        s = text[a:a + rng.choice([1, 2, 3, 5, 8, 13, 40])]
        out.append([s] if rng.random() < 0.5 else ["\x00never\x00", s])
    return out


def check(tokens, stop_sets):
    for stops in stop_sets:
        assert matched(tokens, stops) == reference(tokens, stops), stops


def test_real_agent_text():
    rng = random.Random(0)
    texts = session_texts()
    assert len(texts) >= 6
    for text in texts:
        tokens = tok().encode(text)[:400]
        check(tokens, stops_from(tok().decode(tokens), rng, 6))


def test_multibyte_characters_split_across_tokens():
    text = ("def 函数(参数):  # 返回 ✓ — naïve café 🦀🐍 x̃ \u200b ok\n"
            "    return '日本語テキスト' + \"🙂🙃\" * 3\n") * 4
    tokens = tok().encode(text)
    assert len(tokens) < len(text.encode())  # some tokens are several bytes ...
    pieces = [tok().decode([t]) for t in tokens]
    assert any("\ufffd" in p for p in pieces)  # ... and some are parts of one character
    rng = random.Random(1)
    check(tokens, stops_from(text, rng, 12) + [["🐍"], ["語テ"], ["✓ —"], [" ok\n    r"]])


def test_byte_fragment_tokens_and_replacement_characters():
    rng = random.Random(2)
    vocab = tok().vocab_size - 100  # ordinary ranks: many are single bytes of a character
    for _ in range(4):
        tokens = [rng.randrange(vocab) for _ in range(120)]
        text = tok().decode(tokens)
        check(tokens, stops_from(text, rng, 6) + [["\ufffd"], ["\ufffd\ufffd"]])


def test_periodic_and_repeated_text():
    for text, stops in [("ab" * 300, [["ba"], ["abababab"], ["bb"]]),
                        ("\n" * 200 + "x", [["\n\n\n"], ["\nx"], ["x"]]),
                        ("    " * 100 + "}\n", [["  }"], ["}\n"]]),
                        ("aaaa " * 80, [["a a"], [" " * 2]])]:
        check(tok().encode(text), stops)


def test_stop_far_into_a_long_output():
    text = "\n".join(session_texts())
    tokens = tok().encode(text)[:2500]
    head = tok().decode(tokens[:2000])
    target = next(t for t in (tok().decode(tokens[j:j + 8]) for j in range(2000, 2400))
                  if t not in head)
    assert matched(tokens, [target]) == reference(tokens, [target]) > 2000
    assert matched(tokens, ["\x00"]) is None


def test_window_decodes_stay_short():
    """Each token decodes a window sized by the longest stop string, not the output: back
    to its ``bytes + 8``-th last token with text other than whitespace, or its twice as
    many-th with any text, whichever is nearer; a run of whitespace (a model stuck on
    newlines) costs no more."""
    lengths = []
    m = StopMatcher(lambda ids: (lengths.append(len(ids)), tok().decode(ids))[1], ["\x00"])
    tokens = tok().encode("\n".join(session_texts()))[:1000]
    for t in tokens:
        assert not m.push(t)
    n = len("\x00".encode()) + 8
    want = 0
    for p in range(len(tokens)):
        seen = with_text = 0
        start = p + 1
        while start > 0 and seen < n and with_text < 2 * n:
            start -= 1
            seen += bool(tok().decode([tokens[start]]).strip())
            with_text += 1
        want = max(want, p - start + 1)
    assert max(lengths) == want <= 2 * n
    lengths.clear()
    m = StopMatcher(lambda ids: (lengths.append(len(ids)), tok().decode(ids))[1], ["\x00"])
    newline = tok().encode("\n")
    for _ in range(2000):
        assert not m.push(newline[0])
    assert max(lengths) == 2 * n


def test_ids_without_text():
    """cl100k's ids without text (100256, 100261-100275: a model's output layer covers
    them) decode as nothing, as a Hugging Face tokenizer decodes ids it has no token for;
    stop strings are matched across them."""
    hello, world = tok().encode("hello"), tok().encode(" world")
    assert tok().decode(hello + [100256] + world + [100264, 100275]) == "hello world"
    assert tok().decode([100257]) == "<|endoftext|>"
    tokens = tok().encode("x = 1\n") + [100261] + tok().encode("y = 2\n") + [100256] * 3
    check(tokens, [["1\ny"], ["= 2"], ["\n"], ["never"]])
    # more of them inside a stop string's span than the window's margin: the window counts
    # tokens with text only (it counted every token: 9 or more ids without text hid "1\ny")
    for n in (7, 9, 30):
        spread = tok().encode("x = 1") + [100261 + k % 15 for k in range(n)] + \
            tok().encode("\ny = 2")
        check(spread, [["1\ny"], ["x = 1\ny"], ["= 2"]])
        assert matched(spread, ["1\ny"]) == len(tok().encode("x = 1")) + n + 2


def test_no_stops_and_bad_stops():
    m = StopMatcher(tok().decode, [])
    assert not any(m.push(t) for t in tok().encode("anything at all"))
    for bad in ([""], ["x", ""], [3], [None]):
        with pytest.raises(ValueError, match="stops"):
            StopMatcher(tok().decode, bad)


def seeded(tokens, stops, k, t=None) -> int | None:
    """``matched`` for a matcher seeded with ``tokens[:k]`` (an own loop's message so far)
    that takes the rest: the count includes the seeded tokens."""
    t = t or tok()
    m = StopMatcher.for_tokenizer(t, stops)
    m.seed(tokens[:k])
    for j, x in enumerate(tokens[k:], k + 1):
        if m.push(x):
            return j
    return None


def reference_after(tokens, stops, k, t=None) -> int | None:
    """The reference for a request that goes on after ``tokens[:k]``: the first ``j > k``
    whose whole decoded output holds a stop string ending past the text ``tokens[:k]``
    decodes to (past where the two texts first differ)."""
    t = t or tok()
    seed = t.decode(tokens[:k])
    for j in range(k + 1, len(tokens) + 1):
        text = t.decode(tokens[:j])
        new = len(os.path.commonprefix([seed, text]))
        if any(text.find(s, max(0, new - len(s) + 1)) >= 0 for s in stops):
            return j
    return None


def test_a_seeded_matcher_ends_where_the_reference_does():
    """Seeded with an output cut anywhere (inside a multi-byte character, between ids
    without text, far into a long output, after a stop string it already holds), then
    given the rest: the token the whole-output reference ends at, counting only stop
    strings that end in the new text; without a stop in the seed, the plain reference's."""
    rng = random.Random(5)
    cases = [tok().encode(t)[:300] for t in session_texts()[:4]]
    cases.append(tok().encode("def 函数(参数):  # 返回 ✓ — naïve café 🦀🐍 ok\n" * 3))
    cases.append(tok().encode("🦀🐍 日本語 " * 12))
    cases.append(tok().encode("x = 1") + [100261 + k % 15 for k in range(12)] +
                 tok().encode("\ny = 2\n") * 3)
    vocab = tok().vocab_size - 100
    cases.append([rng.randrange(vocab) for _ in range(150)])
    for tokens in cases:
        text = tok().decode(tokens)
        for stops in stops_from(text, rng, 5) + [["\ufffd"], ["\ufffd\ufffd"], ["1\ny"],
                                                 ["🐍 o"]]:
            plain = reference(tokens, stops)
            for k in sorted({0, 1, len(tokens) // 2, len(tokens) - 1,
                             rng.randrange(len(tokens)), rng.randrange(len(tokens))}):
                want = reference_after(tokens, stops, k)
                assert seeded(tokens, stops, k) == want, (stops, k)
                if plain is None or plain > k:  # nothing to hold back: the plain reference
                    assert want == plain, (stops, k)


def test_a_stop_string_the_seed_holds_does_not_end_the_request():
    """An own loop that went on past a stop string (or never asked for it) and asks for it
    now: only a new occurrence ends the request, however near the old one is."""
    head = tok().encode("done STOP")
    for gap in (0, 1, 3, 24):
        tail = tok().encode(" x" * gap) + tok().encode(" more STOP again")
        tokens = head + tail
        k = len(head) + gap
        got = seeded(tokens, ["STOP"], k)
        assert got == reference_after(tokens, ["STOP"], k) == \
            len(head) + len(tok().encode(" x" * gap) + tok().encode(" more STOP")), gap


def test_seeding_a_long_output_decodes_a_window_of_it():
    decoded = []
    m = StopMatcher(lambda ids: (decoded.append(len(ids)), tok().decode(ids))[1], ["\x00"])
    m.seed(tok().encode("\n".join(session_texts()))[:3000])
    assert len(m.tokens) <= 2 * (len("\x00".encode()) + 8) + 20 and len(decoded) < 100
    assert not m.push(tok().encode(" x")[0])
    with pytest.raises(ValueError, match="seed"):
        m.seed([1, 2])


# ------------------------------------------------------------ SentencePiece-style decoders
def byte_fallback_tokenizer(cleanup: bool = False):
    """:func:`bench_stops.byte_fallback_tokenizer` (a Llama-2 / Mistral style vocabulary:
    ``ByteFallback`` turns a run of byte pieces whose bytes are not valid UTF-8 into one
    U+FFFD per piece; its ``<pad>`` decodes to nothing and ends a run). ``cleanup``:
    ``decode`` cleans up tokenization spaces (``" ."`` -> ``"."``), as transformers does
    for a tokenizer that asks (it ignores the flag for BPE ones)."""
    t = bench_stops.byte_fallback_tokenizer()
    return _CleanedUp(t) if cleanup else t


class _CleanedUp:
    """A tokenizer whose ``decode`` cleans up tokenization spaces afterwards, with
    transformers' replacements (``clean_up_tokenization``)."""

    _RULES = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
              (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids):
        text = self._tokenizer.decode(ids)
        for a, b in self._RULES:
            text = text.replace(a, b)
        return text


def test_runs_of_byte_pieces_are_never_cut():
    """A byte-fallback decoder decodes a run of byte pieces only whole (a run cut inside a
    character is all U+FFFD): the window and a seeded tail start where a run starts. Before,
    a stop that a character's last byte completed ("中" after six "文" as 21 pieces) was
    missed, and a tail cut mid-run confirmed a U+FFFD the output does not hold."""
    t = byte_fallback_tokenizer()
    assert t.byte_pieces == frozenset(range(3, 259)) and not tok().byte_pieces
    pieces = lambda text: [3 + b for b in text.encode()]  # noqa: E731
    tokens = pieces("文" * 6 + "中")
    assert t.decode(tokens[-11:]) == "\ufffd" * 11  # the window cut a character
    assert matched(tokens, ["中"], t) == reference(tokens, ["中"], t) == 21
    X = t.encode("X")[-1]
    tokens = pieces("文" * 10 + "a") + [X]  # the whole output holds no U+FFFD
    assert seeded(tokens, ["\ufffdX"], len(tokens) - 1, t) is None
    # seeded mid-character, the last piece makes the run valid: text from the run's first
    # piece on appears, and a stop ending in it starts before the run (a window counted
    # back from the last piece missed it)
    zwj = "\u0301👨\u200d👩\u200d👧"
    tokens = t.encode("中a") + pieces(zwj)
    assert t.decode(tokens[:-1]).endswith("\ufffd" * 19) and t.decode(tokens).endswith(zwj)
    stop = ["中a\u0301👨"]
    assert matched(tokens, stop, t) == reference(tokens, stop, t) == 9
    assert seeded(tokens, stop, len(tokens) - 1, t) == len(tokens)
    for k in range(len(tokens)):
        assert seeded(tokens, stop, k, t) == reference_after(tokens, stop, k, t), k
    rng = random.Random(11)
    alphabet = ["文", "中", "é", "🦀", "a", " a", ".", "X", " b", "b"]
    plain = list(range(259, len(t._impl.get_vocab())))
    for case in range(150):
        tokens = []
        for _ in range(rng.randrange(1, 30)):  # pieces of whole text, or a stray piece
            r = rng.random()
            tokens += pieces(rng.choice(alphabet)) if r < 0.6 else \
                [rng.choice(plain)] if r < 0.9 else [3 + rng.randrange(256)]
        text = t.decode(tokens)
        for stops in stops_from(text, rng, 2) + [["\ufffd"], ["中"], ["a."]]:
            assert matched(tokens, stops, t) == reference(tokens, stops, t), (case, stops)
            k = rng.randrange(len(tokens))
            assert seeded(tokens, stops, k, t) == reference_after(tokens, stops, k, t), \
                (case, stops, k)




@pytest.mark.parametrize("cleanup", [False, True])
def test_long_runs_of_byte_pieces_cost_a_bounded_window(cleanup):
    """A run of byte pieces decodes only whole, so the window reached back to the run's
    first piece and each push decoded the whole run: 4,000 pieces of text a vocabulary
    lacks (CJK, emoji), or of bytes that are not UTF-8, took 10-16 s. With the pieces'
    bytes known (``byte_value``), a window starts at a character's first byte, and a
    piece that leaves the run decoding as U+FFFD is decoded once per run. Stops are still
    found where the whole output first holds them: across runs, across ``<pad>`` (which
    ends a run), a U+FFFD stop, a " ." that the cleanup turns into "." while the run after
    it decodes whole, and a space that a decoder strips at the output's end until a run
    that decodes as U+FFFD follows it (the first such push is decoded)."""
    t = byte_fallback_tokenizer(cleanup)
    assert t.byte_value(3 + 0xE4) == 0xE4 and t.byte_value(t.encode("X")[-1]) is None
    assert t.decode(t.encode("a .")) == ("a." if cleanup else "a .")
    pieces = lambda text: [3 + b for b in text.encode()]  # noqa: E731
    rng = random.Random(5)
    runs = {"cjk": pieces("".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(1000))),
            "emoji": pieces("🦀" * 750),
            "not utf-8": [3 + 0xFF] + [3 + rng.randrange(256) for _ in range(2999)]}
    for name, tokens in runs.items():
        lengths = []
        m = StopMatcher.for_tokenizer(t, ["never"])
        m._decode = lambda ids: (lengths.append(len(ids)), t.decode(ids))[1]
        assert not any(m.push(x) for x in t.encode("a b") + tokens)
        assert sum(lengths) < 60 * len(tokens), (name, sum(lengths))  # (was len**2 / 2)
    rstrip = lambda ids: t.decode(ids).rstrip(" ")  # noqa: E731
    tokens = t.encode("X")[-1:] + [t._impl.get_vocab()["▁"], 3 + 0xE4, 3 + 0xB8]
    assert rstrip(tokens[:2]) == "X" and rstrip(tokens[:3]) == "X \ufffd"
    m = StopMatcher(rstrip, ["X "], t.byte_pieces, t.has_no_token, t.byte_value)
    assert [m.push(x) for x in tokens[:3]] == [False, False, True]
    # a window that starts past a run's bad byte: the run's part in it must decode as
    # U+FFFD too, though its bytes from there are ASCII
    tokens = [3 + 0xFF] + pieces("abcdefghijklmnopqrstuvwxyz") + t.encode("X")[-1:]
    assert t.decode(tokens).endswith("\ufffdX")
    assert matched(tokens, ["\ufffdX"], t) == reference(tokens, ["\ufffdX"], t) == 28
    pad = t._impl.get_vocab()["<pad>"]
    assert t.decode([3 + 0xE4, pad, 3 + 0xB8, 3 + 0xAD]) == "\ufffd" * 3
    alphabet = ["文", "中", "é", "🦀", "a", " a", ".", " .", "X", " b", "b", "\u0301"]
    plain = list(range(259, len(t._impl.get_vocab())))
    for case in range(120):
        tokens = []
        for _ in range(rng.randrange(1, 40)):  # pieces of text, or a stray piece or pad
            r = rng.random()
            tokens += pieces(rng.choice(alphabet)) if r < 0.7 else \
                [rng.choice(plain)] if r < 0.85 else [pad] if r < 0.9 else \
                [3 + rng.randrange(256)]
        text = t.decode(tokens) or "a"
        for stops in stops_from(text, rng, 2) + [["\ufffd"], ["中"], ["a."], ["a ."]]:
            assert matched(tokens, stops, t) == reference(tokens, stops, t), (case, stops)
            k = rng.randrange(len(tokens))
            assert seeded(tokens, stops, k, t) == reference_after(tokens, stops, k, t), \
                (case, stops, k)



def test_byte_values_only_under_a_byte_fallback_decoder():
    """The pieces' bytes (which let a window cut a run and skip a run decoding as U+FFFD)
    are given only where the decoder is ``ByteFallback``: a vocabulary of ``<0xNN>``
    pieces decoded otherwise (here, as their text) keeps the whole-run window, and its
    stops are found where the whole output first holds them (with the bytes, a stop
    "<0xB8>" was found a token late)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from agspec_gpu.tokenizer import from_hf
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "a": 257}
    bpe = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    bpe.decoder = decoders.Fuse()
    t = from_hf(PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>"), "literal")
    assert t.byte_pieces and not t.byte_fallback_decoder and t.byte_value(1 + 0xE4) is None
    assert byte_fallback_tokenizer().byte_fallback_decoder
    tokens = [1 + b for b in "中".encode()]
    assert t.decode(tokens) == "<0xE4><0xB8><0xAD>"
    for stops in (["<0xB8>"], ["<0xE4><0xB8>"], ["AD>"]):
        assert matched(tokens, stops, t) == reference(tokens, stops, t), stops

def test_ids_that_add_no_text_cost_no_window():
    """A model stuck on an id the tokenizer has no token for (a padded head's id, cl100k's
    unused ones: ``has_no_token``) had every push decode the run since the last token
    with text (2,000 pads: 1.5 s, 8,000: 30 s); such ids are left out of the window. A
    SentencePiece "▁", nothing alone under a Strip decoder, is a space in context and
    counts toward the window (2,000 of them had taken 3.9 s). A CTC decoder's pad, which
    has a token and keeps two equal tokens apart ("a <pad> a" is "aa"), stays in the
    window. Stops across all of them are found where the whole output first holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from agspec_gpu.tokenizer import from_hf
    bf = byte_fallback_tokenizer()
    space = bf._impl.get_vocab()["▁"]
    assert bf.decode([space]) == "" and bf.decode([space, space]) == " "
    ctc = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "a": 2, "b": 3, "|": 4},
                                     unk_token="<unk>"))
    ctc.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    ctc.decoder = decoders.CTC(pad_token="<pad>", word_delimiter_token="|")
    ctc = from_hf(PreTrainedTokenizerFast(tokenizer_object=ctc, unk_token="<unk>"))
    assert ctc.decode([2, 0, 2]) == "aa" and ctc.decode([0, 0]) == "" and \
        not ctc.has_no_token(0) and ctc.has_no_token(ctc.vocab_size)
    for t, first, stuck, bounded in ((tok(), tok().encode("x")[0], tok().vocab_size + 5, 1),
                                     (tok(), tok().encode("x")[0], 100256, 1),
                                     (bf, bf.encode("a")[-1], space, 1), (ctc, 2, 0, 0)):
        lengths = []
        m = StopMatcher(lambda ids, t=t: (lengths.append(len(ids)), t.decode(ids))[1],
                        ["never"], t.byte_pieces, t.has_no_token)
        assert not m.push(first)
        assert not any(m.push(stuck) for _ in range(3000 if bounded else 300))
        assert not bounded or (max(lengths) <= 2 * (len("never") + 8) + 2 and
                               sum(lengths) < 200_000)
        tokens = [first] + [stuck] * 40 + [first] + t.encode("ab")
        text = t.decode(tokens)
        for stops in ([text[-2:]], [text[:2]], [text[:3]], [text[1:12]], [text], ["never"]):
            assert matched(tokens, stops, t) == reference(tokens, stops, t), stops
            for k in (0, 1, 20, 41, 42):
                assert seeded(tokens, stops, k, t) == reference_after(tokens, stops, k, t)

def test_whitespace_that_cleanup_removes_does_not_count_toward_the_window():
    """A decoder that cleans up tokenization spaces (``" ."`` -> ``"."``: transformers does
    for Unigram / WordPiece vocabularies that ask for it) adds nothing for a "▁" token
    before a ".": the window counts tokens with text other than whitespace (it counted
    every token with text, and missed "a" followed by forty dots)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from agspec_gpu.tokenizer import from_hf
    pieces = [("<unk>", 0.0), ("</s>", 0.0), ("a", -1.0), ("▁", -1.0), (".", -1.0)]
    uni = Tokenizer(models.Unigram(pieces, unk_id=0))
    uni.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    t = from_hf(PreTrainedTokenizerFast(tokenizer_object=uni, eos_token="</s>",
                                        unk_token="<unk>", clean_up_tokenization_spaces=True))
    tokens = [2] + [3, 4] * 40
    assert t.decode([3]) == " " and t.decode(tokens[:5]) == "a.."
    for stops in (["a" + "." * 40], ["a" + "." * 20], ["." * 39]):
        assert matched(tokens, stops, t) == reference(tokens, stops, t), stops


def test_generate_ends_where_the_whole_output_first_holds_a_stop(monkeypatch):
    """``SpecDecoder`` hands its tokenizer's byte pieces and ``has_no_token`` to the stop
    strings (``generate``, ``submit`` and ``commit`` alike): a tiny random Llama over the
    byte-fallback vocabulary (mostly byte pieces, so its output is runs of them), its
    greedy output ended at stop
    strings drawn from the decoded text equals the plain output cut where the whole
    decoded output first holds one."""
    import agspec_gpu.requests
    from agspec_gpu import SpecDecoder
    given = []

    class Recorded(StopMatcher):
        def __init__(self, decode, stops, byte_pieces=frozenset(), void=None,
                     byte_value=None):
            given.append((byte_pieces, void, byte_value))
            super().__init__(decode, stops, byte_pieces, void, byte_value)

    monkeypatch.setattr(agspec_gpu.requests, "StopMatcher", Recorded)
    from agspec_gpu.runners.hf import greedy_generate
    from tiny_models import tiny_model
    t = byte_fallback_tokenizer()
    model = tiny_model("llama", "sdpa", t.vocab_size)
    prompt = t.encode("中a 中b") + [3 + b for b in "文é".encode()]
    g = greedy_generate(model, prompt, 40)
    text = t.decode(g)
    rng = random.Random(3)
    stops = [s for s in sum(stops_from(text, rng, 12), []) if s != "\x00never\x00"]
    dec = SpecDecoder(model, t)
    for stop in stops + ["\ufffd"]:
        want = reference(g, [stop], t)
        sid = dec.open_session("t0", "coder", prompt)
        out = dec.generate([sid], max_new_tokens=40, eos_id=None, stop=[stop])
        assert out == [g[:want or 40]], (stop, want)
        dec.close_session(sid)
    sid = dec.open_session("t0", "coder", prompt)
    dec.submit(sid, max_new_tokens=2, stop=["x"])
    own = [dec.open_session("t0", "coder", prompt)]
    draft = dec.propose(own)
    dec.commit(own, draft, torch.zeros(1, 1 + draft.max_nodes, t.vocab_size), stop="x")
    assert len(given) == len(stops) + 3 and \
        all(b == t.byte_pieces and v == t.has_no_token and bv == t.byte_value
            for b, v, bv in given)
