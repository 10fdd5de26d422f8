"""Text <-> token ids with the ``tokenizers`` library, chat rendering, streaming detokenisation.

A :class:`Tokenizer` is built either from a GGUF vocabulary (:class:`GGUFVocab`, filled by
``loader/gguf.py``: byte-level BPE "gpt2" or sentencepiece-style "llama") or from a Hugging Face
``tokenizer.json``. ``transformers`` is not needed at run time; the tests use it as the oracle
(same ids, same rendered chat).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from prefixgate.gateway.engine.chat_template import ChatTemplate, ChatTemplateError
from prefixgate.gateway.engine.template_sandbox import OutputTooLongError

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Texts llama.cpp treats as end-of-generation when they are special tokens; a chat model stops
# on any of them even if the file names only one as EOS.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "</s>",
        "<|end_of_text|>",
        "<｜end▁of▁sentence｜>",
    }
)

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


class PromptTooLongError(ValueError):
    """The text cannot fit ``max_tokens`` tokens, known without tokenizing it: every token
    spells at most ``max_token_bytes`` UTF-8 bytes of it."""

    def __init__(self, num_bytes: int, max_tokens: int, max_token_bytes: int):
        super().__init__(
            f"the prompt is {num_bytes} bytes or more; {max_tokens} tokens of this model spell at "
            f"most {max_tokens * max_token_bytes} bytes ({max_token_bytes} bytes a token)")
        self.num_bytes = num_bytes
        self.max_tokens = max_tokens


# pre-tokenizers that split text without dropping any of it (so tokens cover every byte)
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts", "Sequence"})


def _keeps_every_byte(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return False
    return all(_keeps_every_byte(p) for p in pre.get("pretokenizers", ()))


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


# Harmony (gpt-oss, o200k_harmony): a turn is several messages, each closed by ``<|end|>``
# (analysis, then final or a call), so ``<|end|>`` does not end generation there; ``<|return|>``
# (the answer) and ``<|call|>`` (a tool call) do. The markers stay in decoded text: the output's
# channels and the call's recipient are only in them (tools/formats/harmony.py reads them).
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                   "<|call|>", "<|return|>")
HARMONY_END_OF_GENERATION = frozenset({"<|return|>", "<|call|>", "<|endoftext|>"})


def _is_harmony(backend: BackendTokenizer) -> bool:
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    return "<|channel|>" in specials and "<|message|>" in specials and "<|call|>" in specials


def _end_of_generation_ids(
    backend: BackendTokenizer, declared: Sequence[int | None]
) -> tuple[int, ...]:
    """Declared EOS-like ids first, then every special token spelled like an end marker."""
    ends = END_OF_GENERATION_TEXTS
    ids: list[int] = [i for i in declared if i is not None]
    if _is_harmony(backend):
        ends = HARMONY_END_OF_GENERATION
        end_id = backend.token_to_id("<|end|>")  # a GGUF may declare it as its EOT
        ids = [i for i in ids if i != end_id]
    for token_id, added in sorted(backend.get_added_tokens_decoder().items()):
        if added.special and added.content in ends and token_id not in ids:
            ids.append(token_id)
    return tuple(dict.fromkeys(ids))


# Marks where a special-token string sat in message text while the template renders: two
# noncharacters, which no API surface accepts in text (gateway/server/fields.py).
_MARK_OPEN, _MARK_CLOSE = "\ufdd0", "\ufdd1"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


class _TextMarker:
    """Replaces every special-token string inside message text (contents, tool arguments,
    names, results: every string and key) by a marker, and back."""

    def __init__(self, specials: re.Pattern[str]):
        self._specials = specials
        self.found: list[str] = []

    def mark(self, value: Any) -> Any:
        if isinstance(value, str):
            if _MARK_OPEN in value or _MARK_CLOSE in value:
                raise ValueError("message text may not contain U+FDD0 or U+FDD1 (noncharacters)")
            return self._specials.sub(self._marker, value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        return value

    def _marker(self, match: re.Match[str]) -> str:
        self.found.append(match.group())
        return f"{_MARK_OPEN}{len(self.found) - 1}{_MARK_CLOSE}"

    def unmark(self, text: str) -> str:
        return _MARK.sub(lambda m: self.found[int(m.group(1))], text)


class Tokenizer:
    """Encode/decode plus the model's chat template. Satisfies ``api.TokenizerLike``.

    Special tokens of a chat come only from the template's own text: a special-token string
    inside a message (``<|im_start|>system`` pasted by a user or a tool result) is tokenised
    as plain text, unless ``parse_special_tokens`` is set (how vLLM and llama.cpp do it, which
    lets anyone forge a turn).

    Args:
        backend: a ready ``tokenizers.Tokenizer`` (special tokens registered as added tokens;
            its post-processor adds BOS/EOS when ``encode(add_special_tokens=True)``).
        eos_token_ids: ids that end generation, the model's EOS first.
        bos_token / eos_token: their strings (chat templates read them).
        chat_template: the model's template, or None (then chat rendering raises).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        eos_token_ids: tuple[int, ...],
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        if not eos_token_ids:
            raise TokenizerError("the tokenizer defines no end-of-sequence token")
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.parse_special_tokens = False  # --parse-special-tokens: the old, forgeable way
        # special tokens decoded as text even when the others are skipped (harmony's markers)
        self.visible_special_ids: frozenset[int] = frozenset()
        if _is_harmony(backend):
            self.visible_special_ids = frozenset(
                i for t in HARMONY_MARKERS if (i := backend.token_to_id(t)) is not None)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_vocab(cls, vocab: GGUFVocab) -> Tokenizer:
        """Build from the ``tokenizer.ggml.*`` metadata of a GGUF file."""
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
        tokens = vocab.tokens

        def text(token_id: int | None) -> str | None:
            return (
                tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
            )

        bos, eos = text(vocab.bos_token_id), text(vocab.eos_token_id)
        backend.post_processor = _bos_eos_processor(
            bos if vocab.add_bos else None,
            vocab.bos_token_id,
            eos if vocab.add_eos else None,
            vocab.eos_token_id,
        )
        template = None
        if vocab.chat_template:
            extra = {
                name: value
                for name, value in (
                    ("unk_token", text(vocab.unk_token_id)),
                    ("pad_token", text(vocab.pad_token_id)),
                )
                if value is not None
            }
            template = ChatTemplate(
                vocab.chat_template, bos_token=bos, eos_token=eos, extra_tokens=extra
            )
        eos_ids = _end_of_generation_ids(
            backend, (vocab.eos_token_id, vocab.eot_token_id, vocab.eom_token_id)
        )
        return cls(
            backend, eos_token_ids=eos_ids, bos_token=bos, eos_token=eos, chat_template=template
        )

    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: str,
        *,
        tokenizer_config: dict[str, Any] | None = None,
        generation_eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Build from a Hugging Face ``tokenizer.json`` (path) and ``tokenizer_config.json``.

        ``chat_template`` overrides the config's (e.g. a ``chat_template.jinja`` file).
        """
        backend = BackendTokenizer.from_file(tokenizer_json)
        config = tokenizer_config or {}

        def token_text(name: str) -> str | None:
            value = config.get(name)
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            return value if isinstance(value, str) else None

        bos, eos = token_text("bos_token"), token_text("eos_token")
        eos_id = backend.token_to_id(eos) if eos is not None else None
        eos_ids = _end_of_generation_ids(backend, (*generation_eos_ids, eos_id))
        source = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
            named = {entry.get("name"): entry.get("template") for entry in source}
            source = named.get("default")
        template = None
        if source:
            extra = {
                name: value
                for name in ("unk_token", "pad_token")
                if (value := token_text(name)) is not None
            }
            template = ChatTemplate(source, bos_token=bos, eos_token=eos, extra_tokens=extra)
        return cls(
            backend, eos_token_ids=eos_ids, bos_token=bos, eos_token=eos, chat_template=template
        )

    # ---- TokenizerLike ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False,
               max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids.

        ``add_special_tokens`` adds what the model's post-processor adds (BOS for llama2...).
        ``max_tokens``: raise :class:`PromptTooLongError` without tokenizing when ``text``
        provably needs more tokens than that.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        self.check_fits(text, max_tokens)
        # NOTE: encode_batch releases the GIL while it works, encode holds it throughout (a
        # long prompt would stall the server's event loop for its whole tokenization)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of input one token can stand for, or None when the pipeline
        gives no such bound (a normalizer, a pre-tokenizer that drops text, fused unknowns)."""
        spec = json.loads(self.backend.to_str())
        model = spec.get("model") or {}
        if (spec.get("normalizer") is not None or not _keeps_every_byte(spec.get("pre_tokenizer"))
                or model.get("type") != "BPE"
                or (model.get("fuse_unk") and not model.get("byte_fallback"))):
            return None
        pre = json.dumps(spec.get("pre_tokenizer"))
        byte_level = '"ByteLevel"' in pre

        def spelled(token: str) -> int:
            if byte_level:
                return len(token)  # one character of the byte alphabet per byte
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                return 1
            return len(token.replace("▁", " ").encode())

        longest = max(map(spelled, model.get("vocab") or {"": 0}))
        added = max((len(t["content"].encode()) for t in spec.get("added_tokens") or ()), default=1)
        return max(longest, added, 1)

    def check_fits(self, text: str, max_tokens: int | None) -> None:
        """Raise :class:`PromptTooLongError` when ``text`` cannot fit ``max_tokens`` tokens."""
        bound = self.max_token_bytes
        if max_tokens is None or bound is None or len(text) <= max_tokens:
            return  # (a token spells at least one character)
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > max_tokens * bound:
            raise PromptTooLongError(num_bytes, max_tokens, bound)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (invalid UTF-8 becomes U+FFFD); ``visible_special_ids`` are
        text even when ``skip_special_tokens``."""
        ids = list(token_ids)
        if skip_special_tokens and self.visible_special_ids:
            ids = [i for i in ids if i in self.visible_special_ids or i not in self._special_ids]
            skip_special_tokens = False
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items()
                         if t.special)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as stored (byte-level spelling for BPE)."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text of a conversation, rendered by the model's own chat template."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template; send a plain prompt (completions) instead"
            )
        return self.chat_template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        max_prompt_tokens: int | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of :meth:`render_chat`: special tokens only where the template wrote them,
        the messages' own text as plain text (see the class docstring).

        ``max_prompt_tokens``: raise :class:`PromptTooLongError` as soon as the prompt provably
        needs more (while rendering, or before tokenizing).
        """
        max_tokens = max_prompt_tokens
        if max_tokens is not None and self.max_token_bytes is not None:
            # the render stops as soon as its text cannot fit (characters <= bytes)
            template_kwargs["max_output_chars"] = max_tokens * self.max_token_bytes
        specials = self._special_pattern
        if self.parse_special_tokens or specials is None:
            return self.encode(
                self._render(messages, tools, add_generation_prompt, template_kwargs),
                max_tokens=max_tokens)
        marker = _TextMarker(specials)
        marked_messages, marked_tools = marker.mark(messages), marker.mark(tools)
        text = self._render(marked_messages, marked_tools, add_generation_prompt, template_kwargs)
        if not marker.found:  # nothing to tell apart: every special token is the template's
            return self.encode(text, max_tokens=max_tokens)
        self.check_fits(marker.unmark(text), max_tokens)
        return self._encode_marked(text, marker)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> str:
        try:
            return self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        except OutputTooLongError as exc:
            raise PromptTooLongError(exc.limit + 1, exc.limit // (self.max_token_bytes or 1),
                                     self.max_token_bytes or 1) from exc

    def _encode_marked(self, text: str, marker: _TextMarker) -> list[int]:
        """``text`` split at the template's special tokens; the runs between them (the markers
        turned back into their strings) encoded with special tokens read as text. The whole
        text's encoding splits at added tokens first too, so a run encodes the same way."""
        pieces = self._special_pattern.split(text)  # text, special, text, special, ..., text
        runs = [marker.unmark(p) for p in pieces[0::2]]
        encoded = self._plain_backends[0].encode_batch(runs[:1], add_special_tokens=False)
        if len(runs) > 1:
            encoded += self._plain_backends[1].encode_batch(runs[1:], add_special_tokens=False)
        ids: list[int] = list(encoded[0].ids)
        for special, run in zip(pieces[1::2], encoded[1:], strict=True):
            ids.append(self.backend.token_to_id(special))
            ids.extend(run.ids)
        return ids

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        """The special tokens' strings, longest first (None when there are none)."""
        texts = sorted({t.content for t in self.backend.get_added_tokens_decoder().values()
                        if t.special and t.content}, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None

    @functools.cached_property
    def _plain_backends(self) -> tuple[BackendTokenizer, BackendTokenizer]:
        """Copies of the backend that read special-token text as text: one for the start of
        the prompt, one for a run after a special token (a sentencepiece "first" prefix space
        belongs to the very start only)."""
        spec = json.loads(self.backend.to_str())
        first = BackendTokenizer.from_str(json.dumps(spec))
        pre = spec.get("pre_tokenizer") or {}
        if pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first":
            pre["prepend_scheme"] = "never"
        rest = BackendTokenizer.from_str(json.dumps(spec))
        for backend in (first, rest):
            backend.encode_special_tokens = True
        return first, rest

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh streaming detokeniser for one output."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


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


class IncrementalDecoder:
    """Streaming detokenisation: feed ids one at a time, get text only once it is complete.

    Decoding a growing window and diffing (the vLLM/TGI way) keeps the tokenizer's own rules for
    spaces (sentencepiece strips a leading one) and never emits half of a multi-byte character:
    while the window's text ends in U+FFFD the bytes are held back. :meth:`flush` emits whatever
    is still held (a genuinely invalid byte sequence at the very end).
    """

    # if U+FFFD persists this long it is not a partial character but invalid output
    _MAX_HELD_TOKENS = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: decoded for context only
        self._read_offset = 0  # ids before this were emitted

    @property
    def token_ids(self) -> list[int]:
        """Every id fed so far."""
        return list(self._ids)

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is partial)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens
        )
        new_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        held = len(self._ids) - self._read_offset
        if new_text.endswith("\ufffd") and held < self._MAX_HELD_TOKENS:
            return ""
        if len(new_text) <= len(prefix_text):
            # e.g. a skipped special token: nothing to show, but it is consumed
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text of ids still held back (only non-empty when the output ends mid-character)."""
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens
        )
        new_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
