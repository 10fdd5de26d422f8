"""The KV manager's integrity check: every invariant of docs/design.md, each failure an
IntegrityError naming the one broken. Run by tests after every step and by the engine after a
failed step (a cache that fails it drops its unreferenced hashes)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from prefixgate.cache.errors import IntegrityError
from prefixgate.cache.hashing import BlockHash
from prefixgate.cache.sequence import SequenceBlocks

if TYPE_CHECKING:
    from prefixgate.cache.manager import KVCacheManager

# NOTE: functions over the manager's state (named ``self`` as in its methods): the manager's
# check_integrity calls check_manager; nothing else here is public.


def check_manager(self: KVCacheManager) -> None:
    """Verify every invariant of docs/design.md; raises IntegrityError naming the broken one."""
    pool = self.pool
    queued = pool.free_pages()
    if len(queued) != pool.num_free_pages or len({p.page_id for p in queued}) != len(queued):
        raise IntegrityError("free queue length/uniqueness broken")
    if any(p.retain_until <= 0 or p.block_hash is None for p in pool.retained):
        raise IntegrityError("a retained free page without a deadline or a hash")
    _check_holds(self)
    if self.state is not None:
        self.state.check(self._seqs)
    for page in pool.pages:
        # a retention always names whose budget pays for it, and only a retention does
        if (page.retain_until > 0) != (page.retain_tenant is not None):
            raise IntegrityError(f"{page}: retention deadline {page.retain_until} but tenant "
                                 f"{page.retain_tenant!r}")
        if page.retain_until > 0 and page.block_hash is None:
            raise IntegrityError(f"{page}: retained without a hash")
    refs = [0] * self.num_pages
    for seq_id, entry in self._seqs.items():
        for page_id in entry.block_table:
            refs[page_id] += 1
        _check_sequence(self, seq_id, entry)
    for page in pool.pages:
        expected = refs[page.page_id] + (1 if page.pinned else 0)
        if page.ref_count != expected:
            raise IntegrityError(f"{page}: refcount {page.ref_count} != {expected} table refs + pin")
        if (page.ref_count == 0) != page.in_free_queue:
            raise IntegrityError(f"{page}: free-queue membership disagrees with refcount")
        if page.block_hash is not None:
            if pool.cached.get(page.block_hash) is not page:
                raise IntegrityError(f"{page}: hash not mapped back to it")
            recomputed = self.hasher.hash_block(page.parent_hash, page.token_bytes, page.extra_keys)
            if recomputed != page.block_hash:
                raise IntegrityError(f"{page}: stored tokens do not match its hash")
    if len(pool.cached) != sum(1 for p in pool.pages if p.block_hash is not None):
        raise IntegrityError("hash map holds pages that do not carry the hash")
    used = sum(1 for p in pool.pages if p.ref_count > 0)
    if used + pool.num_free_pages != self.num_pages:
        raise IntegrityError("pages not conserved: used + free != total")
    # Every registered block of a live sequence holds exactly the tokens its chain says.
    for seq_id, entry in self._seqs.items():
        hashes = entry.seq.block_hashes
        for b in range(entry.num_registered):
            page = pool.pages[entry.block_table[b]]
            if page.block_hash is not None and page.block_hash != hashes[b].block_hash:
                raise IntegrityError(f"{seq_id!r}: block {b} maps to a page of another hash")

def _check_sequence(self: KVCacheManager, seq_id: Hashable, entry: SequenceBlocks) -> None:
    """One live sequence's counts, and its chain: linked, and as long as registered."""
    seq = entry.seq
    if seq.seq_id != seq_id:
        raise IntegrityError(f"{seq_id!r}: its record's id is {seq.seq_id!r}")
    if not seq.num_computed <= len(seq.token_ids):
        raise IntegrityError(f"{seq_id!r}: computed {seq.num_computed} > tokens {len(seq.token_ids)}")
    if len(entry.block_table) * self.page_size < seq.num_computed:
        raise IntegrityError(f"{seq_id!r}: computed tokens beyond its pages")
    chain = seq.block_hashes
    if not entry.num_registered <= len(chain) <= len(seq.token_ids) // self.page_size:
        raise IntegrityError(f"{seq_id!r}: {len(chain)} block hashes for {len(seq.token_ids)} "
                             f"tokens and {entry.num_registered} registered blocks")
    parent = self.hasher.root
    for b, block in enumerate(chain):
        if block.parent_hash != parent:
            raise IntegrityError(f"{seq_id!r}: block hash {b} does not chain to block {b - 1}")
        parent = block.block_hash

def _check_holds(self: KVCacheManager) -> None:
    """Protected pages = free pages whose hash some waiting request holds."""
    counts: dict[BlockHash, int] = {}
    for hashes in self.kept.holds.values():
        for block_hash in hashes:
            counts[block_hash] = counts.get(block_hash, 0) + 1
    if counts != self.pool.held_counts():
        raise IntegrityError("hold counts disagree with the waiting requests' holds")
    for page in self.pool.pages:
        held = page.ref_count == 0 and page.block_hash is not None and page.block_hash in counts
        if page.protected != held:
            raise IntegrityError(f"{page}: protected={page.protected} but held free={held}")
    if sum(1 for _ in self.pool.protected) != self.pool.num_protected_pages:
        raise IntegrityError("protected queue length broken")
