"""Hugging Face tokenizers behind ``agspec_gpu.tokenizer.Tokenizer``: a byte-level BPE trained
here on this package's own sources (no network), wrapped as ``transformers`` wraps one. Its
fingerprint names what maps text to ids (not padding or truncation settings), special-token
text encodes as plain text (as cl100k's ``encode_ordinary``), and a vocabulary with a gap
counts its highest id."""

import functools
from pathlib import Path

import pytest

import agspec_gpu
from agspec_gpu.tokenizer import from_hf, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")


@functools.cache
def _bpe_json(vocab_size: int = 600) -> str:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted(Path(agspec_gpu.__file__).parent.glob("*.py"))]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return bpe.to_str()


def hf_tokenizer(vocab_size: int = 600):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(_bpe_json(vocab_size)),
        bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")


def test_fingerprint_ignores_padding_and_truncation_and_survives_a_save(tmp_path):
    tok = hf_tokenizer()
    fp = from_hf(tok).fingerprint
    tok(["def f(x):", "return"], padding=True, truncation=True, max_length=4)  # batching
    assert from_hf(tok).fingerprint == fp
    tok.save_pretrained(tmp_path / "t")
    loaded = load_tokenizer(str(tmp_path / "t"))
    assert loaded.fingerprint == fp and loaded.name == str(tmp_path / "t")
    assert load_tokenizer(tmp_path / "t").fingerprint == fp  # a pathlib.Path as well
    assert from_hf(hf_tokenizer(500)).fingerprint != fp  # another vocabulary
    assert from_hf(tok).name == "hf"  # built in memory: no path to name it by



def test_fingerprint_is_what_the_encoding_depends_on(tmp_path):
    """A global corpus is refused under another fingerprint: it changes with what changes
    an encoding's ids (a non-special added token), not with the post-processor
    (``add_bos_token=False`` had refused a corpus of the same vocabulary), the decoder or
    an added special token (a ``[PAD]``), which ``encode`` never runs or splits."""
    from tokenizers import decoders, processors

    base = hf_tokenizer()
    fp = from_hf(base).fingerprint
    bos = hf_tokenizer()
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    bos.backend_tokenizer.decoder = decoders.Fuse()
    bos.save_pretrained(tmp_path / "bos")
    no_bos = transformers.AutoTokenizer.from_pretrained(tmp_path / "bos", add_bos_token=False)
    pad = hf_tokenizer()
    pad.add_special_tokens({"additional_special_tokens": ["[PAD]"]})
    text = Path(agspec_gpu.__file__).read_text() + " [PAD] <|eos|>"
    for same in (bos, no_bos, pad):
        assert from_hf(same).encode(text) == from_hf(base).encode(text)
        assert from_hf(same).fingerprint == fp
    word = hf_tokenizer()
    word.add_tokens(["[PAD]"])
    assert from_hf(word).encode(text) != from_hf(base).encode(text)
    assert from_hf(word).fingerprint != fp

def test_special_token_text_encodes_as_plain_text():
    t = from_hf(hf_tokenizer())
    ids = t.encode("x = 1 <|eos|> y")
    assert t.eos_id not in ids and t.decode(ids) == "x = 1 <|eos|> y"
    assert t.encode_batch(["<|eos|>"]) == [t.encode("<|eos|>")]



def test_decode_can_leave_special_tokens_out():
    """``skip_special``: a generated message's end token (and chat markers) decode as
    nothing, for an HF tokenizer and for cl100k; without it they keep their text."""
    for t in (from_hf(hf_tokenizer()), load_tokenizer("cl100k")):
        ids = t.encode("cat a.py\n```") + [t.eos_id]
        assert t.eos_id in t.special_ids and t.decode(ids).endswith("```" + t.decode([t.eos_id]))
        assert t.decode(ids, skip_special=True) == "cat a.py\n```"
    assert from_hf(hf_tokenizer()).special_ids == {0, 1, 2}  # bos, eos, pad
    # an added token the backend marks special, in no special-tokens map (Llama-3.1's
    # <|eom_id|>, which ends a tool call's turn), is special too
    from tokenizers import AddedToken
    eom = hf_tokenizer()
    eom.backend_tokenizer.add_special_tokens([AddedToken("<|eom_id|>", special=True)])
    t = from_hf(eom)
    eom_id = eom.convert_tokens_to_ids("<|eom_id|>")
    assert eom_id not in eom.all_special_ids and eom_id in t.special_ids
    assert t.decode(t.encode("cat a.py") + [eom_id], skip_special=True) == "cat a.py"

def test_a_vocabulary_with_a_gap_counts_its_highest_id():
    import json

    spec = json.loads(_bpe_json())
    vocab = spec["model"]["vocab"]
    gone = next(k for k, v in vocab.items() if v == 400)
    del vocab[gone]  # ids 0-599 less 400: 599 of them, the highest 599
    # every merge that makes it or takes it as a part (a vocabulary trained on this
    # package's sources changes with them: the token may be either)
    pairs = [m if isinstance(m, list) else m.split() for m in spec["model"]["merges"]]
    spec["model"]["merges"] = [m for m in pairs if gone not in (*m, "".join(m))]
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(json.dumps(spec)),
        eos_token="<|eos|>")
    assert len(tok) == 599 and from_hf(tok).vocab_size == 600


def _ctrl(tmp_path, name: str, merges: str):
    """transformers' CTRL tokenizer: a Python BPE with no Rust backend."""
    import json

    ctrl = getattr(transformers, "CTRLTokenizer", None)
    if ctrl is None:
        pytest.skip("this transformers has no CTRLTokenizer")
    vocab = {"<unk>": 0, "l": 1, "o": 2, "w": 3, "lo": 6, "ow": 7, "low": 8, "w</w>": 11,
             "low</w>": 12}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / f"{name}.txt").write_text("#version: 0.2\n" + merges + "\n")
    return ctrl(str(tmp_path / "vocab.json"), str(tmp_path / f"{name}.txt"))


def test_python_tokenizers_fingerprint_their_merges_not_where_they_were_loaded(tmp_path):
    a = _ctrl(tmp_path, "a", "l o\nlo w</w>")
    b = _ctrl(tmp_path, "b", "o w</w>")  # the same vocabulary, other merges
    assert getattr(a, "backend_tokenizer", None) is None
    ta, tb = from_hf(a), from_hf(b)
    assert ta.encode("low") != tb.encode("low") and ta.fingerprint != tb.fingerprint
    a.save_pretrained(tmp_path / "A")
    a.save_pretrained(tmp_path / "elsewhere")
    loaded = [load_tokenizer(str(tmp_path / d)) for d in ("A", "elsewhere")]
    assert {t.fingerprint for t in loaded} == {ta.fingerprint}
    assert loaded[0].encode("low") == ta.encode("low")


@pytest.mark.parametrize("kind", ["cl100k", "hf"])
def test_bad_text_and_ids_are_refused_naming_the_argument(kind):
    t = load_tokenizer("cl100k") if kind == "cl100k" else from_hf(hf_tokenizer())
    for bad in (None, b"x", 5, ["a"]):
        with pytest.raises(ValueError, match="^text: expected a str"):
            t.encode(bad)
    with pytest.raises(ValueError, match="^text: .*lone surrogate"):
        t.encode("ok \ud800 text")
    with pytest.raises(ValueError, match="^texts: expected a sequence of str"):
        t.encode_batch("abc")  # one text, not three
    with pytest.raises(ValueError, match=r"^texts\[1\]: .*lone surrogate"):
        t.encode_batch(["ok", "\udcff"])
    with pytest.raises(ValueError, match=r"^texts\[0\]: expected a str"):
        t.encode_batch([None])
    ids = t.encode("x = 1")
    assert t.encode_batch(["x = 1", ""]) == [ids, []]
    for bad in (5, "ab", [1, -1], [1.0], [True]):
        with pytest.raises(ValueError, match="^ids: "):
            t.decode(bad)
    # ids at or past the vocabulary (a model's padded output rows) hold no text
    assert t.decode([*ids, t.vocab_size, 10**12]) == t.decode(ids) == "x = 1"
    import torch

    assert t.decode(torch.tensor(ids)) == "x = 1"
    with pytest.raises(ValueError, match="^ids: expected a sequence of int, got a scalar"):
        t.decode(torch.tensor(5))  # (a TypeError before)
