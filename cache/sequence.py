"""The sequence record as the cache reads it, and the manager's own state of a live sequence.

One record per sequence (engine/sequence.py's ``Sequence`` in the engine) owns its
token ids and its block-hash chain; the manager reads it through :class:`CacheSequence` and
keeps only what is the cache's: the block table and how many blocks are registered. Writers:
  * the scheduler appends ``token_ids`` (sampled tokens, accepted drafts); never shrinks them;
  * the manager alone grows ``block_hashes`` (``KVCacheManager.block_hashes``, the one place
    the chain is extended) and sets ``num_computed`` while the sequence is live (allocate,
    commit_computed, fork); the owner zeroes it when it preempts the sequence.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixgate.cache.hashing import HashedBlock


class CacheSequence(Protocol):
    """What the cache manager reads (and the two fields it writes) of one sequence."""

    @property
    def seq_id(self) -> Hashable: ...

    @property
    def token_ids(self) -> Sequence[int]: ...  # prompt + generated tokens, append-only

    @property
    def extra_keys(self) -> bytes: ...  # from cache.hashing.make_extra_keys: enters block 0

    @property
    def tenant(self) -> str: ...  # stats label (isolation itself is in extra_keys)

    @property
    def agent(self) -> str | None: ...  # stats label

    # chained hashes of the leading full blocks of token_ids (maybe not all of them yet)
    block_hashes: list[HashedBlock]
    num_computed: int  # tokens whose K/V is written in the sequence's pages


@dataclass(slots=True, eq=False)
class TokenSequence:
    """A plain :class:`CacheSequence` for callers without an engine (tests, benchmarks, tools)."""

    seq_id: Hashable
    token_ids: list[int]
    extra_keys: bytes = b""
    tenant: str = "default"
    agent: str | None = None
    block_hashes: list[HashedBlock] = field(default_factory=list)
    num_computed: int = 0


@dataclass(slots=True, eq=False)
class SequenceBlocks:
    """The manager's state of one live sequence: its pages. Everything else is ``seq``'s.

    Invariants (checked by ``KVCacheManager.check_integrity``):
      seq.num_computed <= len(seq.token_ids); len(block_table) * page_size >= num_computed;
      blocks [0, num_registered) are full, computed and (if caching is on) looked up or
      registered; num_registered <= len(seq.block_hashes) <= full blocks of seq.token_ids.
    """

    seq: CacheSequence
    block_table: list[int] = field(default_factory=list)  # logical block -> page id, append-only
    num_registered: int = 0  # leading full blocks already matched or registered in the cache
