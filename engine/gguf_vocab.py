"""A ``tokenizers`` backend built from a GGUF vocabulary (``tokenizer.ggml.*`` metadata):
byte-level BPE ("gpt2", with llama.cpp's pre-tokenizer split rules) or sentencepiece-style
BPE ("llama"), the file's special and user-defined tokens, its BOS/EOS post-processing."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# How llama.cpp's GGUF ``tokenizer.ggml.pre`` names split text before byte-level BPE. These are
# the split rules of the original tokenizer.json files. Absent = GPT-2's rule.
_GPT2_SPLIT = None  # ByteLevel(use_regex=True) applies GPT-2's regex itself
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: letters run on through combining marks (\p{M})
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, gpt-oss's o200k_harmony): tiktoken's pattern, llama.cpp's "gpt-4o"
_O200K_SPLIT = "|".join((
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
))  # fmt: skip
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "gpt-4o": _O200K_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}
_GPT2_STYLE_PRE = frozenset({"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact"})


class TokenizerError(ValueError):
    """The vocabulary cannot be turned into a tokenizer (unknown model type, bad data...)."""


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer as a GGUF file describes it (``tokenizer.ggml.*`` metadata)."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece-style BPE)
    tokens: Sequence[str]
    pre: str | None = None
    token_types: Sequence[int] | None = None
    merges: Sequence[str] | None = None
    scores: Sequence[float] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    eot_token_id: int | None = None
    eom_token_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True  # sentencepiece only
    chat_template: str | None = None

    def token_text(self, token_id: int | None) -> str | None:
        """The text of a token id, or None for no (or an out-of-range) id."""
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


SUPPORTED_GGUF_TOKENIZERS = ("gpt2", "llama")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE tokens spell)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _derive_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Sentencepiece files carry scores, not merges: every split of a token into two tokens of the
    vocabulary is a merge, ranked by the merged token's score (best first)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, vocab[left], vocab[right], left, right))
    candidates.sort()
    return [(left, right) for _, _, _, left, right in candidates]



def _add_gguf_tokens(backend: BackendTokenizer, vocab: GGUFVocab) -> None:
    """Register the file's control tokens (and its bos/eos/unk/pad/eot/eom) as special and its
    user-defined tokens as added tokens, so neither is split by the model."""
    tokens = vocab.tokens
    types = vocab.token_types or ()
    spelled = set(_byte_alphabet().values()) if vocab.model == "gpt2" else None
    special_ids = {
        i
        for i in (
            vocab.bos_token_id,
            vocab.eos_token_id,
            vocab.unk_token_id,
            vocab.pad_token_id,
            vocab.eot_token_id,
            vocab.eom_token_id,
        )
        if i is not None
    }
    special: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for index, token in enumerate(tokens):
        kind = types[index] if index < len(types) else None
        if kind == TOKEN_TYPE_CONTROL or index in special_ids:
            # NOTE: in a byte-level vocabulary a "control" token spelled outside the byte
            # alphabet is a llama.cpp mislabel; adding it would grow the vocabulary
            if spelled is not None and not set(token) <= spelled:
                continue
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED and backend.token_to_id(token) == index:
            # (a user-defined token respelled into the byte alphabet stays a plain token)
            user_defined.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        # duplicate token strings in the file collapse; ids stay as the file numbers them
        logger.warning(
            "tokenizer has %d distinct tokens, the GGUF file lists %d",
            backend.get_vocab_size(with_added_tokens=True),
            len(tokens),
        )

def _build_byte_level(vocab: GGUFVocab) -> BackendTokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # tokens outside the byte alphabet (a user-defined token with a real space, say) are stored
    # as plain text; the BPE model needs them in the byte spelling
    token_to_id = {
        (token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode())): index
        for index, token in enumerate(vocab.tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges or ()]
    backend = BackendTokenizer(
        models.BPE(
            token_to_id,
            merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    pre = (vocab.pre or "default").lower()
    if pre in _PRE_TOKENIZER_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in _GPT2_STYLE_PRE:
            logger.warning("unknown GGUF pre-tokenizer %r; splitting text the GPT-2 way", pre)
        steps: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":
            # SmolLM's tokenizer.json splits digits one by one before the GPT-2 rule
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _build_sentencepiece(vocab: GGUFVocab) -> BackendTokenizer:
    token_to_id = {token: index for index, token in enumerate(vocab.tokens)}
    if vocab.merges:
        merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    elif vocab.scores is not None:
        merges = _derive_merges(vocab.tokens, vocab.scores)
    else:
        raise TokenizerError("a sentencepiece GGUF vocabulary needs merges or scores")
    unk = vocab.tokens[vocab.unk_token_id] if vocab.unk_token_id is not None else None
    backend = BackendTokenizer(
        models.BPE(token_to_id, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if vocab.add_space_prefix else "never", split=False
    )
    steps: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _bos_eos_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
) -> processors.TemplateProcessing:
    single, pair, specials = "$A", "$A $B", []
    if bos is not None and bos_id is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        specials.append((bos, bos_id))
    if eos is not None and eos_id is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, eos_id))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_backend(vocab: GGUFVocab) -> BackendTokenizer:
    """The ``tokenizers`` backend of a GGUF vocabulary: its model, its special tokens, and BOS /
    EOS added as the file asks.

    Raises:
        TokenizerError: an unsupported tokenizer model or unusable data.
    """
    if vocab.model == "gpt2":
        backend = _build_byte_level(vocab)
    elif vocab.model == "llama":
        backend = _build_sentencepiece(vocab)
    else:
        raise TokenizerError(
            f"GGUF tokenizer model {vocab.model!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_TOKENIZERS)}"
        )
    _add_gguf_tokens(backend, vocab)
    bos, eos = vocab.token_text(vocab.bos_token_id), vocab.token_text(vocab.eos_token_id)
    backend.post_processor = _bos_eos_processor(
        bos if vocab.add_bos else None,
        vocab.bos_token_id,
        eos if vocab.add_eos else None,
        vocab.eos_token_id,
    )
    return backend
