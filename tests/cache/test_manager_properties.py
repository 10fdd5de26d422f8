"""Random interleavings of cache operations, replayed on a shadow KV store.

The shadow store plays the runner: it applies copy-on-write pairs and writes each sequence's
token ids into the slots the manager hands out. After every step, every live sequence must read
back exactly its own tokens from its pages: sharing, forks, copies and evictions never corrupt
anyone's KV. check_integrity() must hold after every step too.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from prefixgate.cache import KVCacheManager, OutOfPagesError, make_extra_keys
from prefixgate.cache.sequence import TokenSequence

PAGE_SIZE = 3
NUM_PAGES = 24
RETENTION_BUDGET, TENANT_RETENTION_BUDGET = 12, 5  # pages
# Prompts are built from a few shared "system prompts" so prefixes really collide.
SYSTEMS = [[1] * 7, [2, 3] * 4, [1] * 6 + [5, 5]]
tokens_st = st.lists(st.integers(0, 6), min_size=0, max_size=8)


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(NUM_PAGES, PAGE_SIZE, watermark=0)
        self.now = 0.0
        self.m.pool.clock = lambda: self.now
        self.shadow = [[None] * PAGE_SIZE for _ in range(NUM_PAGES)]
        self.next_id = 0
        self.pinned_prompts = []

    def _write(self, seq_id, n):
        start = self.m.num_computed_tokens(seq_id)
        pairs = self.m.prepare_write(seq_id, n)
        for src, dst in pairs:
            self.shadow[dst] = list(self.shadow[src])
        table = self.m.block_table(seq_id)
        tokens = self.m.sequence(seq_id).token_ids
        for pos in range(start, start + n):
            page = table[pos // PAGE_SIZE]
            # NOTE: invariant 3 — a write never lands on a shared or cached page
            assert self.m.ref_count(page) == 1, f"write into shared page {page}"
            assert self.m.pool.pages[page].block_hash is None, f"write into cached page {page}"
            self.shadow[page][pos % PAGE_SIZE] = tokens[pos]
        self.m.commit_computed(seq_id, n)

    @rule(target=seqs, system=st.sampled_from(SYSTEMS), suffix=tokens_st, tenant=st.sampled_from(["a", "b"]),
          chunk=st.integers(1, 5))
    def allocate(self, system, suffix, tenant, chunk):
        prompt = system + suffix
        seq_id = self.next_id
        self.next_id += 1
        self.m.allocate(TokenSequence(seq_id, prompt, make_extra_keys("m", tenant), tenant))
        try:  # prefill in chunks, like the scheduler
            while self.m.num_computed_tokens(seq_id) < len(prompt):
                n = min(chunk, len(prompt) - self.m.num_computed_tokens(seq_id))
                self._write(seq_id, n)
        except OutOfPagesError:
            self.m.free(seq_id)
            return None
        return seq_id

    @rule(seq_id=seqs, token=st.integers(0, 6))
    def decode(self, seq_id, token):
        if seq_id is None or seq_id not in self.m:
            return
        self.m.sequence(seq_id).token_ids.append(token)
        if self.m.pages_needed(seq_id, 1) > self.m.num_free_pages:
            self.m.free(seq_id)  # preemption by recompute: release everything
            return
        self._write(seq_id, 1)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent is None or parent not in self.m:
            return None
        child = self.next_id
        self.next_id += 1
        record = self.m.sequence(parent)
        self.m.fork(parent, TokenSequence(child, list(record.token_ids), record.extra_keys, record.tenant))
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        if seq_id is not None and seq_id in self.m:
            self.m.free(seq_id)

    @rule(system=st.sampled_from(SYSTEMS), tenant=st.sampled_from(["a", "b"]))
    def pin(self, system, tenant):
        if self.m.pin(system, make_extra_keys("m", tenant)):
            self.pinned_prompts.append((system, tenant))

    @rule()
    def unpin_all(self):
        for system, tenant in self.pinned_prompts:
            self.m.unpin(system, make_extra_keys("m", tenant))
        self.pinned_prompts.clear()

    @rule()
    def reset(self):
        self.m.reset_cache()

    @rule(system=st.sampled_from(SYSTEMS), suffix=tokens_st, tenant=st.sampled_from(["a", "b"]),
          ttl=st.sampled_from([1.0, 5.0, 30.0]))
    def retain(self, system, suffix, tenant, ttl):
        other = "b" if tenant == "a" else "a"
        before = self.m.num_retained_pages(other)
        self.m.retain(system + suffix, make_extra_keys("m", tenant), ttl, RETENTION_BUDGET,
                      tenant=tenant, max_tenant_pages=TENANT_RETENTION_BUDGET)
        # a share is guaranteed: reclaiming never takes another tenant below its own
        assert self.m.num_retained_pages(other) >= min(before, TENANT_RETENTION_BUDGET)

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def advance_clock(self, seconds):
        self.now += seconds

    @invariant()
    def integrity(self):
        self.m.check_integrity()

    @invariant()
    def retention_stays_within_its_budgets(self):
        stats = self.m.stats()
        assert stats.pages_retained == self.m.num_retained_pages() <= RETENTION_BUDGET
        assert sum(stats.retained_per_tenant.values()) == stats.pages_retained
        for counter in (stats.total, *stats.per_tenant.values()):
            assert 0 <= counter.retention_hit_tokens <= counter.hit_tokens
            assert counter.retention_hits <= counter.requests

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for seq_id in self.m.sequence_ids():
            seq, table = self.m.sequence(seq_id), self.m.block_table(seq_id)
            for pos in range(seq.num_computed):
                page = table[pos // PAGE_SIZE]
                assert self.shadow[page][pos % PAGE_SIZE] == seq.token_ids[pos], (seq_id, pos)

    @invariant()
    def cached_pages_hold_their_tokens(self):
        for page in self.m.pool.cached.values():
            assert bytes(self._as_bytes(self.shadow[page.page_id])) == page.token_bytes

    @staticmethod
    def _as_bytes(slots):
        from prefixgate.cache.hashing import tokens_to_bytes

        return tokens_to_bytes(slots)

    def teardown(self):
        for seq_id in self.m.sequence_ids():
            self.m.free(seq_id)
        self.m.check_integrity()
        s = self.m.stats()
        assert s.pages_used == s.pages_pinned
        assert s.pages_free + s.pages_cached_free + s.pages_used == NUM_PAGES


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
