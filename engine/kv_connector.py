"""The connector: everything that is not a resident page, behind one interface.

The second KV tier (host memory or disk, ``kv_tier.KVTier`` over ``cache.tier.HostTier``; the
fleet's Redis, ``gateway/scaleout/kv_tier_redis.py``) and a hybrid model's state checkpoints in
host memory (``state_tier.StateTier``, the state group's ``tier`` hook) sit behind it. The
scheduler asks it one question per waiting request (vLLM v1's KVConnector, simpler):

* ``match(seq, blocks, hit)`` -> ``ConnectorMatch(num_tokens, ready)``: how many tokens right
  after the pool's hit it can supply, and whether they are ready (False: the request waits in
  the queue while a load runs; the step does not);
* ``install(seq, blocks, hit, loads)``: in the step that admits the request, its finished load
  gets pages (registered like a pool hit, invariant 8) and a ``PageLoad`` to write;
* ``release(seq)``: the request left the queue (admitted, aborted, preempted, unschedulable).

and the engine calls ``start_step(out)`` once per step, before anything writes: evicted pages
are spilled, the step's loads written into their pages. The per-request state lives here, not
on the ``Sequence``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Hashable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from prefixgate.cache import HashedBlock, KVCacheManager, PrefixMatch

logger = logging.getLogger("prefixgate.engine")


class TierLoader(Protocol):
    """The second KV tier as the connector drives it (kv_tier.KVTier)."""

    def may_contain(self, block: HashedBlock) -> bool | None: ...

    def request(self, key: Hashable, start_block: int, blocks: Seq[HashedBlock]) -> None: ...

    def poll(self, key: Hashable) -> Any: ...  # TierLoad | None while in flight

    def cancel(self, key: Hashable) -> None: ...


class TierProbe(enum.StrEnum):
    """Where a waiting sequence stands with the second tier (equal to its value as a string)."""

    NONE = ""  # not looked up yet (or looked up again after a preemption)
    LOADING = "loading"  # a load is in flight
    HELD = "held"  # a load finished; it waits for the step that admits the sequence
    DONE = "done"  # looked up while the pool matched ``probe_blocks`` blocks


@dataclass(slots=True)
class _Probe:
    """One waiting sequence's state with the tier."""

    state: TierProbe = TierProbe.NONE
    load: Any = None  # the finished TierLoad while HELD
    probe_blocks: int = -1  # the pool's hit (blocks) at the last look


class ConnectorMatch(NamedTuple):
    """The connector's answer for one waiting request."""

    num_tokens: int  # tokens a finished load supplies right after the pool's hit
    ready: bool  # False: a load runs (or is about to): the request waits for it


@dataclass(frozen=True, slots=True)
class PageLoad:
    """Write blocks ``offset ..`` of a tier load's ``payload`` into ``page_ids`` before the
    forward."""

    page_ids: tuple[int, ...]
    payload: Any
    offset: int


class KVConnector:
    """The second tier of one engine (KV pages, and a hybrid's state checkpoints).

    Args:
        cache: the scheduler's KV manager (evictions, installs).
        tier: the KV tier (kv_tier.KVTier, or a stand-in in scheduling tests).
        state_tier: a hybrid model's checkpoint tier (state_tier.StateTier), or None.
    """

    def __init__(self, cache: KVCacheManager, tier: TierLoader, state_tier: Any = None) -> None:
        self.cache = cache
        self.tier = tier
        cache.tier_pages.capture()
        if state_tier is not None:
            cache.attach_state_tier(state_tier)
        self._probes: dict[int, _Probe] = {}
        # pages of loads in flight or held, per sequence: at most a pool's worth (a held
        # load is host memory the size of its pages)
        self.load_pages: dict[int, int] = {}
        self.num_waits = 0  # admissions deferred while their load ran
        self.tokens_loaded = 0  # prompt tokens written from the tier instead of recomputed

    def probe(self, seq: Any) -> TierProbe:
        """Where ``seq`` stands with the tier."""
        probe = self._probes.get(seq.seq_id)
        return probe.state if probe is not None else TierProbe.NONE

    # ------------------------------------------------------------------ the scheduler's side

    def match(self, seq: Any, blocks: list[HashedBlock], hit: PrefixMatch) -> ConnectorMatch:
        """How far the tier continues ``seq``'s pool hit ``hit``, and whether it is ready.

        A finished load is held for the sequence and installed only in the step that admits
        it (:meth:`install`): installed early, its pages would sit free in the pool while the
        request waits for room, and the traffic it waits behind would evict them again. The
        tier is looked up again whenever the pool's hit has changed since the last look:
        pages evicted while the request waited went to the tier too.
        """
        probe = self._probes.setdefault(seq.seq_id, _Probe())
        first = len(hit.page_ids)
        if probe.state is TierProbe.LOADING:
            load = self.tier.poll(seq.seq_id)
            if load is None:
                return self._wait()
            probe.state, probe.load = TierProbe.HELD, load
        if probe.state is TierProbe.HELD:
            load = probe.load
            skip = first - load.start_block
            if load.blocks and 0 <= skip < len(load.blocks):
                return ConnectorMatch((len(load.blocks) - skip) * self.cache.page_size, True)
            # empty (a miss, late or doubtful), overtaken by the pool, or the pool lost blocks
            # before the load's start while it waited (those went to the tier: look again)
            lost = bool(load.blocks) and skip < 0
            self._drop(seq.seq_id)
            probe.state, probe.probe_blocks = TierProbe.DONE, -1 if lost else first
        if probe.state is TierProbe.DONE and probe.probe_blocks == first:
            return ConnectorMatch(0, True)
        return self._look_up(seq, probe, blocks, first)

    def _look_up(self, seq: Any, probe: _Probe, blocks: list[HashedBlock], first: int) -> ConnectorMatch:
        # a full hit stops one token short anyway: a last block alone is not worth a load
        wanted = blocks[first : (len(seq.token_ids) - 1) // self.cache.page_size]
        if any(self.cache.tier_pages.evicted_since_taken(b.block_hash) for b in wanted):
            # evicted by this very schedule(): spilled once it returns, looked up next step
            probe.state, probe.probe_blocks = TierProbe.DONE, -1
            return self._wait()
        probe.state, probe.probe_blocks = TierProbe.DONE, first
        if not wanted or self.tier.may_contain(wanted[0]) is False:
            return ConnectorMatch(0, True)
        if sum(self.load_pages.values()) + len(wanted) > self.cache.num_pages:
            return ConnectorMatch(0, True)  # loads already hold a pool's worth: recompute
        self.tier.request(seq.seq_id, first, wanted)
        self.load_pages[seq.seq_id] = len(wanted)
        probe.state = TierProbe.LOADING
        return self._wait()

    def _wait(self) -> ConnectorMatch:
        self.num_waits += 1
        return ConnectorMatch(0, False)

    def install(self, seq: Any, blocks: list[HashedBlock], hit: PrefixMatch,
                loads: list[PageLoad]) -> PrefixMatch:
        """Give ``seq``'s held load pages right before it is allocated; returns the new hit."""
        probe = self._probes[seq.seq_id]
        load = probe.load
        skip = len(hit.page_ids) - load.start_block
        self.release(seq)
        page_ids = self.cache.tier_pages.install(load.blocks[skip:], len(load.blocks) - skip,
                                                 keep=hit.page_ids)
        if not page_ids:
            return hit
        loads.append(PageLoad(tuple(page_ids), load.payload, skip))
        return self.cache.find_prefix(seq.token_ids, seq.extra_keys, blocks=blocks)

    def release(self, seq: Any) -> None:
        """Forget ``seq``'s load (cancel it in flight, release a held one); the last look's
        result stays (a request that waits on is looked up again when its hit changes)."""
        probe = self._probes.get(seq.seq_id)
        if probe is None:
            return
        self._drop(seq.seq_id)
        if probe.state in (TierProbe.LOADING, TierProbe.HELD):
            probe.state = TierProbe.DONE

    def forget(self, seq: Any) -> None:
        """``seq`` left the queue for good, or was preempted (its evicted pages may be in the
        tier by the time it returns: it is looked up afresh)."""
        self._drop(seq.seq_id)
        self._probes.pop(seq.seq_id, None)

    def _drop(self, seq_id: int) -> None:
        probe = self._probes.get(seq_id)
        if probe is not None and probe.state is TierProbe.LOADING:
            self.tier.cancel(seq_id)
        if probe is not None:
            probe.load = None
        self.load_pages.pop(seq_id, None)

    # ------------------------------------------------------------------ the engine's side

    def start_step(self, page_loads: Iterable[PageLoad]) -> set[Hashable]:
        """Before anything writes this step: copy evicted pages out to the tier, then write the
        loads into their fresh pages (an evicted page may be a load's destination). Returns the
        sequences holding a load that failed to write (their pages are un-cached: fail them)."""
        tier: Any = self.tier
        evicted = self.cache.tier_pages.take_evicted()
        if evicted:
            try:
                tier.spill(evicted)
            except Exception:  # noqa: BLE001 - a lost spill costs a recompute later, nothing else
                logger.exception("spilling %d evicted pages to the kv tier failed; dropped", len(evicted))
                tier.count_dropped(len(evicted))
        failed: set[Hashable] = set()
        for load in page_loads:
            try:
                tier.write(load.page_ids, load.payload, load.offset)
            except Exception:  # their pages must never be read: un-cache them, fail holders
                logger.exception("writing a kv tier load failed; recomputing those blocks")
                failed |= self.cache.tier_pages.forget_pages(load.page_ids)
            else:
                self.tokens_loaded += len(load.page_ids) * self.cache.page_size
        self.cache.tier_pages.loads_written()
        return failed

    def wait_for_loads(self, timeout_s: float = 0.005) -> None:
        """Sleep until a load lands (a few ms at most): the engine has nothing else to do, and
        must not spin and starve the load worker of the GIL."""
        done = getattr(self.tier, "load_done", None)
        if done is not None:
            done.wait(timeout_s)
            done.clear()

    def stats(self, seconds_per_token: float) -> dict[str, Any]:
        """The tier's counters plus the recompute it saved (``seconds_per_token``: the moving
        average of prefill-sized steps' time per token)."""
        tier: Any = self.tier
        return {
            **tier.stats().as_dict(),
            "tokens_loaded": self.tokens_loaded,
            "recompute_seconds_saved": round(self.tokens_loaded * seconds_per_token, 6),
            "load_waits": self.num_waits,
        }

    def load_discount(self, seconds_per_token: float) -> float | None:
        """How much of a recompute a tier hit saves, per token: 1 - (load seconds per token /
        prefill seconds per token), clipped to [0, 1]. None until both have been measured.

        The router scores the fleet tier's blocks by this. Read without the engine lock: two
        floats and two counters, each exact at some recent instant.
        """
        tier: Any = self.tier
        if not seconds_per_token:
            return None
        load_per_token = tier.load_seconds_per_token(self.cache.page_size)
        if load_per_token is None:
            return None
        return min(1.0, max(0.0, 1.0 - load_per_token / seconds_per_token))
