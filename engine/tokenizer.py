"""Text <-> token ids with the ``tokenizers`` library, and chat rendering.

A :class:`Tokenizer` is built either from a GGUF vocabulary (:class:`GGUFVocab`, filled by
``loader/gguf.py``; the backend it makes is in gguf_vocab.py) or from a Hugging Face
``tokenizer.json``. Which tokens end generation: end_of_generation.py; streaming
detokenisation: detokenizer.py. ``transformers`` is not needed at run time; the tests use it as the oracle
(same ids, same rendered chat).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from prefixgate.engine.chat_template import ChatTemplate, ChatTemplateError
from prefixgate.engine.detokenizer import IncrementalDecoder
from prefixgate.engine.end_of_generation import (
    HARMONY_MARKERS,
    end_of_generation_ids,
    is_harmony,
)
from prefixgate.engine.gguf_vocab import GGUFVocab, TokenizerError, build_backend
from prefixgate.engine.template_sandbox import OutputTooLongError

# TokenizerError (raised here too) and IncrementalDecoder (what incremental_decoder returns) are
# part of this module's interface
__all__ = ["IncrementalDecoder", "PromptTooLongError", "Tokenizer", "TokenizerError"]


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
        if is_harmony(backend):
            self.visible_special_ids = frozenset(
                i for t in HARMONY_MARKERS if (i := backend.token_to_id(t)) is not None)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_vocab(cls, vocab: GGUFVocab) -> Tokenizer:
        """Build from the ``tokenizer.ggml.*`` metadata of a GGUF file."""
        backend = build_backend(vocab)
        bos, eos = vocab.token_text(vocab.bos_token_id), vocab.token_text(vocab.eos_token_id)
        template = None
        if vocab.chat_template:
            extra = {
                name: value
                for name, value in (
                    ("unk_token", vocab.token_text(vocab.unk_token_id)),
                    ("pad_token", vocab.token_text(vocab.pad_token_id)),
                )
                if value is not None
            }
            template = ChatTemplate(
                vocab.chat_template, bos_token=bos, eos_token=eos, extra_tokens=extra
            )
        eos_ids = end_of_generation_ids(
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
        eos_ids = end_of_generation_ids(backend, (*generation_eos_ids, eos_id))
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
