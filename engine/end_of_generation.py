"""Which special tokens end generation: the ids a model declares, and every special token spelled
like an end marker (llama.cpp's list); Harmony's own rule for gpt-oss."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as BackendTokenizer

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

# Harmony (gpt-oss, o200k_harmony): a turn is several messages, each closed by ``<|end|>``
# (analysis, then final or a call), so ``<|end|>`` does not end generation there; ``<|return|>``
# (the answer) and ``<|call|>`` (a tool call) do. The markers stay in decoded text: the output's
# channels and the call's recipient are only in them (tools/formats/harmony.py reads them).
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                   "<|call|>", "<|return|>")
HARMONY_END_OF_GENERATION = frozenset({"<|return|>", "<|call|>", "<|endoftext|>"})


def is_harmony(backend: BackendTokenizer) -> bool:
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    return "<|channel|>" in specials and "<|message|>" in specials and "<|call|>" in specials


def end_of_generation_ids(
    backend: BackendTokenizer, declared: Sequence[int | None]
) -> tuple[int, ...]:
    """Declared EOS-like ids first, then every special token spelled like an end marker."""
    ends = END_OF_GENERATION_TEXTS
    ids: list[int] = [i for i in declared if i is not None]
    if is_harmony(backend):
        ends = HARMONY_END_OF_GENERATION
        end_id = backend.token_to_id("<|end|>")  # a GGUF may declare it as its EOT
        ids = [i for i in ids if i != end_id]
    for token_id, added in sorted(backend.get_added_tokens_decoder().items()):
        if added.special and added.content in ends and token_id not in ids:
            ids.append(token_id)
    return tuple(dict.fromkeys(ids))
