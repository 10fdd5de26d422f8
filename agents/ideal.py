"""Ideal hit rate: how many prompt tokens an infinite prefix cache could have reused.

For each request, in the order requests were sent, the ideal hit is the longest common token
prefix with anything sent earlier. An agent's previous turn counts with its generated tokens
appended (a cache that keeps decoded KV can reuse them), taken as they reappear in this
prompt, less the last one: a sampled token is never fed back, so it has no KV. The hit is capped one token short of the prompt (the last prompt token is always
computed, its logits are needed) and, at block level, rounded down to whole pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

_CHUNK = 32  # tokens per trie edge: trades dict size against the per-node scan


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixIndex:
    """Token-exact longest-common-prefix lookup against every sequence added so far.

    A trie whose edges are ``_CHUNK``-token tuples: a walk follows whole chunks by dict lookup,
    then scans the (few) distinct edges of the last node for the partial match.
    """

    def __init__(self) -> None:
        self._children: list[dict[tuple[int, ...], int]] = [{}]

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        """Longest common prefix of ``tokens`` with any sequence added so far."""
        node, pos = 0, 0
        while pos < len(tokens):
            chunk = tuple(tokens[pos:pos + _CHUNK])
            child = self._children[node].get(chunk)
            if child is not None and len(chunk) == _CHUNK:
                node, pos = child, pos + _CHUNK
                continue
            return pos + max((common_prefix(chunk, key) for key in self._children[node]),
                             default=0)
        return pos

    def add(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` (a trailing partial chunk becomes a leaf edge)."""
        node = 0
        for pos in range(0, len(tokens), _CHUNK):
            chunk = tuple(tokens[pos:pos + _CHUNK])
            child = self._children[node].get(chunk)
            if child is None:
                child = len(self._children)
                self._children.append({})
                self._children[node][chunk] = child
            node = child


class SentPrompt(NamedTuple):
    """One request as the ideal-cache model sees it."""

    tokens: Sequence[int]  # prompt token ids
    completion_tokens: int  # tokens the server generated for it (0 if unknown or failed)
    previous: int | None  # index of the same agent's previous request, if any


class IdealHits(NamedTuple):
    tokens: list[int]  # per request: reusable prompt tokens
    blocks: list[int]  # per request: the same, rounded down to whole pages


def ideal_hits(prompts: Sequence[SentPrompt], page_size: int = 1) -> IdealHits:
    """Per-request ideal cache hits, for ``prompts`` in the order they were sent.

    Args:
        prompts: every request of a run in send order; ``previous`` must point earlier.
        page_size: the block size for the block-level figure (1 = token level).

    Returns:
        ``IdealHits`` with one entry per prompt.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    index = PrefixIndex()
    tokens_hit: list[int] = []
    blocks_hit: list[int] = []
    for i, prompt in enumerate(prompts):
        if prompt.previous is not None:
            if not 0 <= prompt.previous < i:
                raise ValueError(f"prompt {i}: previous={prompt.previous} is not an earlier "
                                 "request")
            before = prompts[prompt.previous]
            # NOTE: the previous turn's generated tokens exist only as they reappear here.
            if common_prefix(before.tokens, prompt.tokens) == len(before.tokens):
                with_kv = max(before.completion_tokens - 1, 0)
                index.add(prompt.tokens[:len(before.tokens) + with_kv])
        hit = min(index.longest_prefix(prompt.tokens), max(len(prompt.tokens) - 1, 0))
        tokens_hit.append(hit)
        blocks_hit.append(hit // page_size * page_size)
        index.add(prompt.tokens)
    return IdealHits(tokens=tokens_hit, blocks=blocks_hit)
