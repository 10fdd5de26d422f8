"""Chained block hashing.

    h_i = H(h_{i-1} ‖ token ids of block i ‖ extra_i)      H = xxh3_128 with a fixed seed

``h_{-1}`` is a root derived from the seed. ``extra_0`` carries the extra keys (model id, tenant
salt, cache_salt, adapter id); later blocks inherit them through the chain, so two tenants never
share a single block. Only FULL blocks are hashed; a partial tail has no hash.

Why the seed is fixed and configurable: replicas of one fleet must compute identical hashes so
the router can look a prompt's chain up in the shared Redis index. For a single replica a
per-process random seed is safer: an attacker who can predict hashes can search for colliding
token blocks offline. Collisions cannot hand out wrong KV here (every hit is verified against
the stored token ids and parent hash, see block_pool.py), but they could evict or shadow
entries. The tenant salt protects against the prefix-cache timing side channel (vLLM
CVE-2025-46570): without it, one tenant could learn whether another tenant recently sent a given
prompt by measuring time-to-first-token. ``cache_salt`` narrows sharing further within a tenant.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

import xxhash

BlockHash = bytes  # 16-byte digest
HashFn = Callable[[bytes], bytes]

_TOKEN_TYPECODE = "I"  # uint32: every vocabulary we serve is < 2**32
assert array(_TOKEN_TYPECODE).itemsize == 4


def xxh3_128_hash_fn(seed: int) -> HashFn:
    """The production hash: xxh3_128 digest with a fixed seed."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"hash seed must be in [0, 2**64), got {seed}")

    def hash_fn(data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data, seed=seed)

    return hash_fn


def make_extra_keys(
    model_id: str = "",
    tenant_salt: str = "",
    cache_salt: str | None = None,
    adapter_id: str | None = None,
) -> bytes:
    """Encode the extra keys that enter the first block's hash (length-prefixed, unambiguous)."""
    out = bytearray()
    for field in (model_id, tenant_salt, cache_salt or "", adapter_id or ""):
        encoded = field.encode("utf-8")
        out += len(encoded).to_bytes(4, "little")
        out += encoded
    return bytes(out)


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (what is hashed and stored for verification)."""
    try:
        return array(_TOKEN_TYPECODE, token_ids).tobytes()
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None


class HashedBlock(NamedTuple):
    block_hash: BlockHash
    parent_hash: BlockHash
    token_bytes: bytes  # the block's token ids, stored on the cached page to verify hits
    extra_keys: bytes  # non-empty only for block 0


class BlockHasher:
    """Hashes full blocks of a token sequence into a chain.

    Args:
        page_size: tokens per block.
        seed: fixed seed shared by every replica of a fleet.
        hash_fn: override of the digest function (tests force collisions with it).
    """

    def __init__(self, page_size: int, seed: int = 0, hash_fn: HashFn | None = None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.seed = seed
        self._custom_hash = hash_fn
        self._hash = hash_fn or xxh3_128_hash_fn(seed)
        self.root: BlockHash = xxh3_128_hash_fn(seed)(b"prefixgate-root")

    def hash_block(self, parent: BlockHash, token_bytes: bytes, extra_keys: bytes = b"") -> BlockHash:
        return self._hash(parent + token_bytes + extra_keys)

    def extend(self, chain: list[HashedBlock], token_ids: Sequence[int],
               extra_keys: bytes = b"") -> list[HashedBlock]:
        """Append to ``chain`` the hashes of ``token_ids``' full blocks it does not hold yet.

        NOTE: the one place a sequence's chain grows (``KVCacheManager.block_hashes`` calls
        it): ``chain`` must hold the hashes of ``token_ids``' first ``len(chain)`` blocks.
        Returns:
            ``chain`` itself, extended in place.
        """
        if len(token_ids) // self.page_size > len(chain):
            parent = chain[-1].block_hash if chain else None
            chain += self.hash_blocks(token_ids, extra_keys, start_block=len(chain), parent=parent)
        return chain

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        extra_keys: bytes = b"",
        *,
        start_block: int = 0,
        parent: BlockHash | None = None,
    ) -> list[HashedBlock]:
        """Hash every FULL block of ``token_ids`` from ``start_block`` on.

        Args:
            token_ids: the whole sequence (blocks before ``start_block`` are not re-hashed).
            extra_keys: from :func:`make_extra_keys`; enters block 0 only.
            start_block: first block to hash; ``parent`` must then be block start_block-1's hash.
            parent: hash of the block before ``start_block`` (root when start_block == 0).
        Returns:
            One :class:`HashedBlock` per full block, in order.
        """
        ps = self.page_size
        num_full = len(token_ids) // ps
        if start_block > num_full:
            return []
        if parent is None:
            if start_block != 0:
                raise ValueError("parent hash is required when start_block > 0")
            parent = self.root
        data = tokens_to_bytes(token_ids[start_block * ps : num_full * ps])
        stride = ps * 4
        out: list[HashedBlock] = []
        # Hot path (runs on every request): locals, and tuple.__new__ skips NamedTuple's
        # Python-level __new__ (~30% of the loop).
        new, record = tuple.__new__, HashedBlock
        if self._custom_hash is None:
            digest, seed = xxhash.xxh3_128_digest, self.seed
        else:
            custom = self._custom_hash
            digest, seed = (lambda data, _seed: custom(data)), 0
        begin = 0
        if start_block == 0 and num_full > 0:
            chunk = data[:stride]
            h = digest(parent + chunk + extra_keys, seed)
            out.append(new(record, (h, parent, chunk, extra_keys)))
            parent, begin = h, 1
        for i in range(begin, num_full - start_block):
            chunk = data[i * stride : (i + 1) * stride]
            h = digest(parent + chunk, seed)
            out.append(new(record, (h, parent, chunk, b"")))
            parent = h
        return out
