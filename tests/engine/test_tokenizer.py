"""Tokenizer built from the GGUF metadata vs transformers' tokenizer for the same file."""

from __future__ import annotations

import pytest

from prefixgate.engine.api import TokenizerLike
from prefixgate.engine.gguf_vocab import GGUFVocab
from prefixgate.engine.tokenizer import Tokenizer, TokenizerError

pytestmark = pytest.mark.slow

VARIED_TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\n\nmany",
    "Numbers: 3.14159, 2024-11-29, 1,000,000 and 007",
    "Unicode: café, naïve, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "Emoji: 👋🏽 🧑‍💻 🇫🇷 ✨",
    "def f(x):\n    return {\"a\": [1, 2, 3], 'b': x ** 2}  # comment\n",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "Special tokens inline: <|im_start|>user\nhi<|im_end|><|endoftext|>",
    "don't won't I'm they're we've you'll he'd",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "",
    " ",
    "a" * 300,
    "mixed   spaces\t\t and \n\t indentation",
]


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(
        text, add_special_tokens=True
    )


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_decode_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    # byte-level BPE round-trips every string exactly
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_digits_split_one_by_one(tokenizer):
    # SmolLM's pre-tokenizer isolates every digit
    ids = tokenizer.encode("12345")
    assert len(ids) == 5
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


def test_special_tokens_and_eos(tokenizer, hf_tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.eos_token_ids[0] == hf_tokenizer.eos_token_id == im_end
    # <|endoftext|> also ends generation (llama.cpp marks it end-of-generation too)
    assert tokenizer.token_to_id("<|endoftext|>") in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert tokenizer.encode("<|im_start|>") == [tokenizer.token_to_id("<|im_start|>")]
    assert tokenizer.decode([im_end], skip_special_tokens=True) == ""
    assert tokenizer.decode([im_end], skip_special_tokens=False) == "<|im_end|>"


def test_satisfies_tokenizer_protocol(tokenizer):
    def accepts(t: TokenizerLike) -> tuple[int, ...]:
        return t.eos_token_ids

    assert accepts(tokenizer) == tokenizer.eos_token_ids
    with pytest.raises(TypeError, match="takes a str"):
        tokenizer.encode(["not", "text"])  # type: ignore[arg-type]


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens)
    pieces = [decoder.feed(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


@pytest.mark.parametrize(
    "text",
    [
        "Emoji: 👋🏽 🧑‍💻 🇫🇷 ✨ done",
        "日本語のテキストと한국어",
        "plain ascii text, streamed",
        "<|im_start|>assistant\nÇa va? 😀<|im_end|>",
    ],
)
def test_incremental_decoder_never_splits_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    # these texts contain multi-byte characters that byte-level BPE cuts across tokens
    pieces = _stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)
    pieces = _stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False)


def test_incremental_decoder_holds_partial_character(tokenizer):
    ids = tokenizer.encode("🧑‍💻")
    assert len(ids) > 1  # one emoji, several byte tokens
    decoder = tokenizer.incremental_decoder()
    assert decoder.feed(ids[0]) == ""  # an incomplete UTF-8 sequence is held back
    rest = "".join(decoder.feed(i) for i in ids[1:])
    assert rest == "🧑‍💻"
    assert decoder.flush() == ""


def test_incremental_decoder_flushes_truncated_output(tokenizer):
    ids = tokenizer.encode("ok 😀")
    decoder = tokenizer.incremental_decoder()
    shown = "".join(decoder.feed(i) for i in ids[:-1])  # stop mid-emoji
    assert shown in ("ok", "ok ")  # the space may share a token with the emoji's first byte
    rest = decoder.flush()  # whatever is held comes out at the end, invalid bytes and all
    assert "\ufffd" in rest
    assert shown + rest == tokenizer.decode(ids[:-1])


def test_unsupported_gguf_tokenizer_model_is_named():
    vocab = GGUFVocab(model="rwkv", tokens=["a", "b"])
    with pytest.raises(TokenizerError, match="'rwkv'.*gpt2, llama"):
        Tokenizer.from_gguf_vocab(vocab)


def test_sentencepiece_vocab_without_merges_derives_them():
    # a tiny sentencepiece-style vocabulary: merges come from scores
    tokens = ["<unk>", "<s>", "</s>", "▁", "h", "e", "l", "o", "▁h", "ll", "▁he", "llo", "▁hello"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -2.0, -0.5, -0.6, -0.4, -0.3, -0.1]
    scores += [0.0] * 256
    vocab = GGUFVocab(
        model="llama",
        tokens=tokens,
        scores=scores,
        token_types=[2, 3, 3] + [1] * (len(tokens) - 3),
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
        add_bos=True,
    )
    tok = Tokenizer.from_gguf_vocab(vocab)
    assert tok.encode("hello") == [tokens.index("▁hello")]
    assert tok.encode("hello", add_special_tokens=True) == [1, tokens.index("▁hello")]
    assert tok.decode(tok.encode("hello hi")) == "hello hi"
    assert "é" in tok.decode(tok.encode("é"))  # byte fallback round-trips unknown characters
    ids = tok.encode("hello hé hello")
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "hello hé hello"
    assert tok.eos_token_ids == (2,)


@pytest.mark.parametrize("text", [*VARIED_TEXTS, "#" * 5000, "\n" + " " * 5000, "日本語" * 999])
def test_max_token_bytes_bounds_every_text(tokenizer, text):
    """The refusal before tokenizing (Tokenizer.check_fits) rests on this: no token spells more
    than max_token_bytes bytes of the input, so bytes / max_token_bytes <= tokens."""
    from prefixgate.engine.tokenizer import PromptTooLongError

    bound = tokenizer.max_token_bytes
    assert bound is not None and 16 <= bound <= 128
    tokens = len(tokenizer.encode(text))
    assert len(text.encode()) <= tokens * bound
    tokenizer.check_fits(text, tokens)  # it fits its own token count
    if len(text.encode()) > bound:
        limit = len(text.encode()) // bound - 1
        with pytest.raises(PromptTooLongError):
            tokenizer.encode(text, max_tokens=limit)
