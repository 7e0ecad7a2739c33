"""StopMatcher against the reference it replaces: decode the whole output after every token
and end at the first token after which a stop string appears (real cl100k tokens of real
agent sessions, plus multi-byte text, byte-fragment tokens and periodic text)."""

import functools
import os
import random
from pathlib import Path

import pytest

from agspec_gpu.stops import StopMatcher
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_sessions

DEV = Path("/work/shared/data/trajectories/dev")


@functools.cache
def tok():
    return load_tokenizer("cl100k")


def reference(tokens, stops) -> int | None:
    """The number of tokens up to the one after which a stop string first appears."""
    for k in range(1, len(tokens) + 1):
        text = tok().decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return None


def matched(tokens, stops) -> int | None:
    m = StopMatcher(tok().decode, stops)
    for k, t in enumerate(tokens, 1):
        if m.push(t):
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
    """Each token decodes a window sized by the longest stop string, not the output."""
    lengths = []
    m = StopMatcher(lambda ids: (lengths.append(len(ids)), tok().decode(ids))[1], ["\x00"])
    for t in tok().encode("\n".join(session_texts()))[:1000]:
        assert not m.push(t)
    assert max(lengths) == len("\x00".encode()) + 8


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


def seeded(tokens, stops, k) -> int | None:
    """``matched`` for a matcher seeded with ``tokens[:k]`` (an own loop's message so far)
    that takes the rest: the count includes the seeded tokens."""
    m = StopMatcher(tok().decode, stops)
    m.seed(tokens[:k])
    for j, t in enumerate(tokens[k:], k + 1):
        if m.push(t):
            return j
    return None


def reference_after(tokens, stops, k) -> int | None:
    """The reference for a request that goes on after ``tokens[:k]``: the first ``j > k``
    whose whole decoded output holds a stop string ending past the text ``tokens[:k]``
    decodes to (past where the two texts first differ)."""
    seed = tok().decode(tokens[:k])
    for j in range(k + 1, len(tokens) + 1):
        text = tok().decode(tokens[:j])
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
