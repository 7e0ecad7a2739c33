"""Real BPE tokenizers behind one small interface.

`load_tokenizer("cl100k")` gives tiktoken's cl100k_base from the rank file shipped in
`agspec_gpu/data/` (no network); any other string is a Hugging Face tokenizer path or
name that `transformers.AutoTokenizer` loads from disk. Every tokenizer carries a
`fingerprint`: a corpus built with one tokenizer refuses to load under another.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from agspec_gpu.checks import check_text, is_int

CL100K_RANK_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
# tiktoken's cl100k_base split pattern and special tokens (tiktoken_ext/openai_public.py).
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_CL100K_SPECIAL = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer as the library uses it.

    Attributes:
        name: short name (``"cl100k"`` or the HF path).
        vocab_size: ids are in ``[0, vocab_size)``.
        eos_id: end-of-sequence id, or None.
        fingerprint: hex digest identifying the exact vocabulary and merges.
        byte_pieces: the ids of byte-fallback pieces (``<0x41>``: SentencePiece-style
            vocabularies, Llama-2, Mistral, Gemma), whose decoder turns a whole run of them
            into U+FFFD when the run's bytes are not valid UTF-8, so a run decodes only
            whole (:class:`~agspec_gpu.stops.StopMatcher` never cuts one); empty for
            byte-level vocabularies (cl100k, GPT-2, Llama-3, Qwen2).
        special_ids: the ids of special tokens (end of text, chat-template markers), which
            ``decode(ids, skip_special=True)`` leaves out.
        byte_fallback_decoder: its decoder is Hugging Face's ``ByteFallback`` (a run of
            byte pieces decodes as UTF-8 when its bytes are, else as one U+FFFD a piece),
            so :meth:`byte_value` gives the pieces' bytes.
    """

    name: str
    vocab_size: int
    eos_id: int | None
    fingerprint: str
    _impl: Any
    byte_pieces: frozenset[int] = frozenset()
    special_ids: frozenset[int] = frozenset()
    byte_fallback_decoder: bool = False

    def has_no_token(self, token_id: int) -> bool:
        """Whether the tokenizer has no token for ``token_id``, so its decoder never sees
        it: ids at or past ``vocab_size`` (a padded head's), cl100k's unused ids, a Hugging
        Face vocabulary's gaps. Such an id decodes to nothing wherever it stands."""
        if not 0 <= token_id < self.vocab_size:
            return True
        if isinstance(self._impl, _TiktokenImpl):
            return not self._impl.has_text(token_id)
        return self._impl.convert_ids_to_tokens(int(token_id)) is None

    def byte_value(self, token_id: int) -> int | None:
        """The byte a byte-fallback piece stands for (``<0xE4>``: 0xE4), where the decoder
        is ``ByteFallback`` (:attr:`byte_fallback_decoder`: stop strings then cut runs at
        characters); None for any other id, and for every id under another decoder (a
        slow SentencePiece one keeps the valid bytes around a bad one)."""
        if not self.byte_fallback_decoder or token_id not in self.byte_pieces:
            return None
        return int(self._impl.convert_ids_to_tokens(int(token_id))[3:5], 16)

    def encode(self, text: str) -> list[int]:
        """Tokenizes ``text`` as whole text; special-token strings are encoded as plain text.

        Raises:
            ValueError: ``text`` is not a ``str`` UTF-8 can encode (a lone surrogate).
        """
        return self._encode(check_text(text, "text"))

    def _encode(self, text: str) -> list[int]:
        if isinstance(self._impl, _TiktokenImpl):
            return self._impl.enc.encode_ordinary(text)
        return self._impl.encode(text, add_special_tokens=False, split_special_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` (cl100k on two threads).

        Raises:
            ValueError: ``texts`` is a single ``str`` or ``bytes``, or an item is not a
                ``str`` UTF-8 can encode (named by its index).
        """
        if isinstance(texts, (str, bytes)):
            raise ValueError(f"texts: expected a sequence of str, got one "
                             f"{type(texts).__name__} (wrap it in a list)")
        texts = [check_text(t, f"texts[{i}]") for i, t in enumerate(texts)]
        if isinstance(self._impl, _TiktokenImpl):
            return self._impl.enc.encode_ordinary_batch(texts, num_threads=2)
        return [self._encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids``. An id that holds no text decodes as nothing, as Hugging
        Face tokenizers decode ids they have no token for: cl100k's unused ids 100256 and
        100261-100275, and ids at or past ``vocab_size`` (the rows a model pads its output
        layer with), which a random or fine-tuned model may emit; stop strings and
        captured commands read the output around them. ``skip_special``: the ids of
        :attr:`special_ids` decode as nothing too (a generated message's end token, whose
        ``<|im_end|>`` would end a command's last line).

        Raises:
            ValueError: ``ids`` is not a sequence of non-negative ints.
        """
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"ids: expected a sequence of int, got {type(ids).__name__}")
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # a tensor or an array
        if not isinstance(ids, list):  # (a 0-d tensor or array: one number)
            raise ValueError(f"ids: expected a sequence of int, got a scalar {ids!r}")
        bad = next((i for i in ids if not is_int(i)
                    or i < 0), None)
        if bad is not None:
            raise ValueError(f"ids: expected non-negative ints, got {bad!r}")
        ids = [int(i) for i in ids if i < self.vocab_size
               and not (skip_special and i in self.special_ids)]
        if not isinstance(self._impl, _TiktokenImpl):
            return self._impl.decode(ids)
        try:
            return self._impl.enc.decode(ids)
        except KeyError:  # (the fast path raises on the first id without text)
            return self._impl.enc.decode([i for i in ids if self._impl.has_text(i)])


@dataclass(frozen=True)
class _TiktokenImpl:
    enc: Any

    def has_text(self, token_id: int) -> bool:
        try:
            self.enc.decode_single_token_bytes(token_id)
            return True
        except KeyError:
            return False


def _load_cl100k() -> Tokenizer:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = resources.files("agspec_gpu").joinpath("data/cl100k_base.tiktoken")
    with resources.as_file(path) as p:
        ranks = load_tiktoken_bpe(str(p), expected_hash=CL100K_RANK_SHA256)
    enc = tiktoken.Encoding(
        name="cl100k_base", pat_str=_CL100K_PAT, mergeable_ranks=ranks,
        special_tokens=_CL100K_SPECIAL,
    )
    fp = hashlib.sha256(("cl100k_base:" + CL100K_RANK_SHA256).encode()).hexdigest()
    return Tokenizer("cl100k", enc.n_vocab, _CL100K_SPECIAL["<|endoftext|>"], fp,
                     _TiktokenImpl(enc), special_ids=frozenset(_CL100K_SPECIAL.values()))


def _hf_fingerprint(tok: Any) -> str:
    """The digest of what maps text to ids as :meth:`Tokenizer.encode` runs it (no special
    tokens added, special-token text split as plain text): the backend's model,
    normalizer, pre-tokenizer and non-special added tokens. Not what changes no id of
    such an encoding: padding and truncation (a batched call changes them), the
    post-processor (``add_bos_token=False`` had refused a corpus built with the same
    vocabulary), the decoder, special tokens (adding a ``[PAD]``); nor how the
    ``tokenizers`` version spells merges (``"a b"`` or ``["a", "b"]``)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return _python_hf_fingerprint(tok)
    spec = json.loads(backend.to_str())
    spec = {k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer")} | {
        "added_tokens": [t for t in spec.get("added_tokens") or [] if not t.get("special")]}
    model = spec["model"]
    if isinstance(model, dict) and isinstance(model.get("merges"), list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m
                           for m in model["merges"]]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


# text whose ids tell apart a Python tokenizer's options (casing, accents, CJK and
# punctuation splitting, whitespace handling), which its vocabulary files do not record
_PROBE = ("Hello WORLD héllo Ünïcödé naïve 東京 x=1;  y\t= [a, b]\n\n  def f():\r\n"
          "    return 'it''s' # ok?! 12345 <unk> [UNK]")


def _python_hf_fingerprint(tok: Any) -> str:
    """The digest of a tokenizer without a Rust backend (transformers' Python tokenizers:
    CTRL, XLM, a legacy BERT, ...): its class, vocabulary and added tokens, the files its
    vocabulary saves as (merges, a sentencepiece model), and the ids of a probe text, which
    its init options (lower-casing, accent stripping, ...) change. Not where it was loaded
    from, which a loaded and a constructed copy record differently."""
    h = hashlib.sha256()
    probe = tok.encode(_PROBE, add_special_tokens=False)
    h.update(repr((type(tok).__name__, sorted(tok.get_vocab().items()),
                   sorted(tok.get_added_vocab().items()), probe)).encode())
    with tempfile.TemporaryDirectory() as d:
        try:
            files = tok.save_vocabulary(d)
        except NotImplementedError:
            files = ()
        for f in sorted(str(f) for f in files if f):
            h.update(Path(f).name.encode() + b"\0" + Path(f).read_bytes())
    return h.hexdigest()


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback piece's token string


def from_hf(tok: Any, name: str | None = None) -> Tokenizer:
    """Wraps a loaded Hugging Face tokenizer. Its ids are ``[0, highest id + 1)``: ``len``
    counts ids, and a vocabulary with a gap has an id past it."""
    vocab = tok.get_vocab()
    size = max(len(tok), max(vocab.values(), default=-1) + 1)
    return Tokenizer(name or getattr(tok, "name_or_path", "") or "hf", size, tok.eos_token_id,
                     _hf_fingerprint(tok), tok,
                     frozenset(i for t, i in vocab.items() if _BYTE_PIECE.fullmatch(t)),
                     _special_ids(tok), _byte_fallback_decoder(tok))


def _byte_fallback_decoder(tok: Any) -> bool:
    """Whether a Hugging Face tokenizer decodes with the fast backend's ``ByteFallback``
    (in its decoder chain)."""
    backend = getattr(tok, "backend_tokenizer", None)
    try:
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    except (AttributeError, TypeError, ValueError):
        return False
    return '"ByteFallback"' in json.dumps(decoder)


def _special_ids(tok: Any) -> frozenset[int]:
    """The ids of a Hugging Face tokenizer's special tokens: those its special-tokens map
    names and the added tokens its backend marks special (Llama-3.1's ``<|eom_id|>``
    ends a tool call's turn but is in no map)."""
    added = getattr(tok, "added_tokens_decoder", None) or {}
    return frozenset([i for i in tok.all_special_ids if is_int(i)] +
                     [i for i, t in added.items() if is_int(i) and getattr(t, "special", False)])


def load_tokenizer(spec: str | Tokenizer | Any) -> Tokenizer:
    """Returns a :class:`Tokenizer` for ``"cl100k"``, a local HF tokenizer folder (a ``str``
    or path-like), or a HF tokenizer object.

    Raises:
        ValueError: ``spec`` names no tokenizer that can be loaded offline.
    """
    if isinstance(spec, Tokenizer):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        if not (callable(getattr(spec, "encode", None)) and hasattr(spec, "eos_token_id")):
            raise ValueError(f"tokenizer: expected 'cl100k', a local Hugging Face tokenizer "
                             f"path or a loaded Hugging Face tokenizer, got "
                             f"{type(spec).__name__}")
        return from_hf(spec)
    if spec in ("cl100k", "cl100k_base"):
        return _load_cl100k()
    try:
        from transformers import AutoTokenizer

        return from_hf(AutoTokenizer.from_pretrained(spec, local_files_only=True), spec)
    except Exception as exc:  # noqa: BLE001 - rewrap with the argument's name
        raise ValueError(f"tokenizer: cannot load {spec!r} offline ({exc})") from exc
