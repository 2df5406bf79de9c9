"""The scheduler role: owns the cache over the shared pool and decides, step by step, what
every rank loads and saves (embcache/DESIGN.md, "vLLM: the scheduler/worker split").

Theory of operation. One embcache ``Request`` per vLLM request holds that request's pins.
``ensure`` looks its items up (store reads start, the request is deferred while one runs) and
looks up again the items that arrived since (streamed media); ``has_item`` is True only for an
item the current request holds; ``alloc`` turns a held item into a load every rank must ack,
or, in a producer role, reserves a pool range (``Request.begin_fill``: a LOADING entry of the
request) that rank 0 writes the fresh output into; ``build`` hands the step's transfers out;
``absorb`` counts acks, ends each acked save's fill (OK, or FAILED when the tensor did not
match) and closes a finished request once nothing of it is outstanding. The scheduler copies
no payload byte: it only changes state.

A request that finished with acks missing past ``hold_timeout_s`` is quarantined: its pins are
held (a slow rank may still read them); its fills end UNKNOWN (their waiters encode instead of
waiting) and stay ``writing``: the cache's fence frees nothing while one is (``fence_gate``), as
a slow rank 0 may still write it. A timeout says nothing about death, so it frees nothing.
Only a late ack, or the owing rank's known death, ends that hold: ``ranks.RankWatch`` learns it
from the rank's worker process (announced in its first acks, watched by pidfd; vLLM's own
failure path learns it from the same exit). A dead rank owes nothing more (it reads nothing);
a dead rank 0 writes nothing more: its fills end UNKNOWN and none is ``writing`` any more.
Known-dead ranks are owed no new acks.

vLLM calls all of this from its one scheduler thread; nothing here takes a lock of its own.
Every container is bounded by the requests vLLM has open (plus the finished ones whose acks
are owed or lost) or by one step (embcache/DESIGN.md, "Memory bounds", "vLLM connector").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from embcache import (
    EmbeddingCache,
    EntryState,
    GlobalStore,
    InvalidArgumentError,
    InvariantError,
    Item,
    Request,
    TransferOutcome,
)
from embcache.integrations.vllm.options import ConnectorOptions
from embcache.integrations.vllm.protocol import (
    EmbcacheECMetadata,
    EmbcacheECWorkerMetadata,
    StepKey,
    Transfer,
)
from embcache.integrations.vllm.ranks import RankWatch
from embcache.integrations.vllm.shm import SharedPool

__all__ = ["RankDeath", "SchedulerSide", "SchedulerStats"]
log = logging.getLogger(__name__)

NOTHING: frozenset[str] = frozenset()
OK, FAILED, UNKNOWN = TransferOutcome.OK, TransferOutcome.FAILED, TransferOutcome.UNKNOWN


@dataclass(eq=False, slots=True)
class _Held:
    """What the scheduler keeps for one vLLM request."""

    request: Request
    items: list[Item]  # by vLLM item index
    looked: list[str]  # the keys looked up, in lookup order (each once)
    present: dict[str, int] | None = None  # key -> pool offset of what it holds; None: pending
    loads: set[StepKey] = field(default_factory=set)  # awaiting acks of every rank
    saves: set[StepKey] = field(default_factory=set)  # awaiting rank 0's ack
    finished_at: float | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters of the scheduler role (a snapshot)."""

    steps: int
    deferred: int
    loads: int
    saves: int
    saves_skipped: int  # no pool range could be reserved: the item is encoded, not cached
    inserts: int
    open_requests: int
    outstanding_loads: int
    outstanding_saves: int
    quarantined_requests: int
    quarantined_bytes: int


@dataclass(frozen=True, slots=True)
class RankDeath:
    """How and when the scheduler learned that a rank's worker process is gone
    (``SchedulerSide.deaths``): what the death ended, and what a fence may free from then on.

    ``how`` is ``"process exit"`` (its pidfd was readable, or its pid was gone when it
    announced: ``ranks.RankWatch``) or ``"engine"`` (``rank_died`` was called: the engine's
    failure path). ``pid`` is the process the rank announced (None: never announced on this
    machine). ``learned_at`` is the scheduler's clock then (``time.monotonic`` unless one was
    given), ``step`` the steps built by then (``stats().steps``). ``loads_released`` counts
    the loads no longer awaiting its ack; ``fills_ended`` are the keys of the fills it owed
    (rank 0), ended UNKNOWN by the death; ``fills_unfenced`` the keys of the fills that had
    ended UNKNOWN on the hold timeout and stayed unfreed (``writing``) until this death: from
    now on a fence may free their ranges."""

    rank: int
    pid: int | None
    how: str
    learned_at: float
    step: int
    loads_released: int
    fills_ended: tuple[str, ...]
    fills_unfenced: tuple[str, ...]


class SchedulerSide:
    """The scheduler role over ``options``; ``ranks`` workers ack every load."""

    def __init__(
        self,
        options: ConnectorOptions,
        ranks: int,
        *,
        consumer: bool,
        producer: bool,
        store: GlobalStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0:
            raise InvalidArgumentError(f"the engine's world size must be > 0, got {ranks!r}")
        self._ranks = ranks
        self._all_ranks = (1 << ranks) - 1  # a load's missing acks: one bit per rank
        self._live = self._all_ranks  # the ranks not known dead: the acks a new load awaits
        self._watch = RankWatch(ranks)
        self._writing: set[StepKey] = set()  # fills ended UNKNOWN that rank 0 may still write
        self._consumer, self._producer = consumer, producer
        self._clock = clock
        self._hold_timeout = options.hold_timeout_s
        self._shared = SharedPool(options.pool_bytes)
        self._own_store = store is None
        self._store = store_from_options(options) if store is None else store
        try:
            self._cache = EmbeddingCache(
                options.pool_bytes,
                store=self._store,
                policy=options.policy,
                pool=self._shared.tensor,
                fence_gate=self._no_fill_writing,
            )
        except BaseException:
            self._close_store()
            raise
        self._held: dict[str, _Held] = {}
        self._current: _Held | None = None
        self.has_item: Callable[[str], bool] = NOTHING.__contains__
        self._step = 0
        self._step_loads: dict[str, Transfer] = {}
        self._step_saves: dict[str, Transfer] = {}
        self._load_acks: dict[StepKey, tuple[str, int]] = {}  # -> (request, ranks missing)
        self._save_acks: dict[StepKey, tuple[str, str, int]] = {}  # -> (request, key, offset)
        self._finishing: dict[
            str, float
        ] = {}  # finished, acks owed: when it finished (oldest first)
        self._quarantined: set[str] = set()
        self._deaths: list[RankDeath] = []  # at most one per rank
        self._counts = dict.fromkeys(("deferred", "loads", "saves", "saves_skipped", "inserts"), 0)

    @property
    def cache(self) -> EmbeddingCache:
        """The cache this role owns."""
        return self._cache

    # -- vLLM's calls, in its order ------------------------------------------------------
    def ensure_known(self, request_id: str, count: int) -> bool | None:
        """``ensure_cache_available`` for a request seen before whose ``count`` items were all
        looked up: as ``ensure``; None when it must go through ``ensure`` (new, or more
        items than before). O(1) once its lookup is over."""
        held = self._held.get(request_id)
        if held is None or count > len(held.items) or held.finished_at is not None:
            return None
        return self._settle(held) if held.present is None else self._make_current(held)

    def ensure(self, request_id: str, items: Sequence[Item]) -> bool:
        """``ensure_cache_available`` for the request's ``items`` (by vLLM item index): open
        and look up on first sight, and look up the items that arrived since the last call;
        False (defer) while a store read for one of its items runs. O(items)."""
        held = self._held.get(request_id)
        if held is None or held.finished_at is not None:
            if held is not None:  # vLLM reuses the id of a request it finished: a new one
                self._rename(held)
            unique = list({it.key: it for it in items}.values()) if len(items) > 1 else items
            request, offsets = self._cache.open_lookup(request_id, unique, prefetch=self._consumer)
            held = _Held(request, list(items), [it.key for it in unique])
            self._held[request_id] = held
            self._note_present(held, offsets)
        elif len(items) > len(held.items):  # media that arrived after its first lookup
            new = list(items[len(held.items) :])
            held.items.extend(new)
            self._look_up(held, new)
        self._current = None
        self.has_item = NOTHING.__contains__
        return self._settle(held) if held.present is None else self._make_current(held)

    def alloc(self, request_id: str, index: int) -> None:
        """``update_state_after_alloc``: a held item becomes a load; otherwise a producer
        reserves a pool range that rank 0 fills in place. O(1), O(log entries) to reserve."""
        held = self._held.get(request_id)
        if held is None or held.present is None or not 0 <= index < len(held.items):
            return
        item = held.items[index]
        key = item.key
        offset = held.present.get(key)
        if offset is not None:
            if self._consumer and key not in self._step_loads:
                step_key = (self._step, key)
                self._step_loads[key] = Transfer(key, offset, item.shape, item.dtype)
                if self._live:
                    self._load_acks[step_key] = (request_id, self._live)
                    held.loads.add(step_key)
                self._counts["loads"] += 1
        elif self._producer and key not in self._step_saves and self._live & 1:
            reserved = held.request.begin_fill([item])[0]
            if reserved is None:
                self._counts["saves_skipped"] += 1  # present (not for it), a fill owed, no space
                return
            step_key = (self._step, key)
            self._step_saves[key] = Transfer(key, reserved, item.shape, item.dtype)
            self._save_acks[step_key] = (request_id, key, reserved)
            held.saves.add(step_key)
            self._counts["saves"] += 1

    def build(self) -> EmbcacheECMetadata:
        """``build_connector_meta``: the step's transfers; the next step begins. O(transfers)."""
        meta = EmbcacheECMetadata(
            self._step,
            self._shared.handle,
            list(self._step_loads.values()),
            list(self._step_saves.values()),
        )
        self._step += 1
        if self._step_loads:
            self._step_loads = {}
        if self._step_saves:
            self._step_saves = {}
        self._current = None
        self.has_item = NOTHING.__contains__
        if self._finishing or self._quarantined or self._writing:
            self._expire()
        return meta

    def absorb(self, acks: EmbcacheECWorkerMetadata) -> None:
        """``update_connector_output``: count acks, end acked fills, close what is done.
        Unknown or repeated acks are ignored. O(acks)."""
        for rank, who in acks.alive.items():
            if self._watch.announce(rank, who):
                self._rank_died(rank, "process exit")
        load_acks, held_by = self._load_acks, self._held
        for rank, done in acks.loaded.items():
            bit = 1 << rank
            for step_key in done:
                entry = load_acks.get(step_key)
                if entry is None:
                    continue
                request_id, missing = entry
                missing &= ~bit
                if missing:
                    load_acks[step_key] = (request_id, missing)
                    continue
                del load_acks[step_key]
                held = held_by[request_id]
                loads = held.loads
                loads.discard(step_key)
                if not loads and held.finished_at is not None and not held.saves:
                    self._close(request_id, held)  # its last ack: nothing of it is owed
        if acks.saved:
            self._absorb_saves(acks.saved)
        if self._finishing or self._quarantined or self._writing:
            self._expire()

    def _absorb_saves(self, saved: dict[StepKey, bool]) -> None:
        """Rank 0's save acks: end each acked fill (OK, or FAILED when the tensor did not
        match), one ``end_fill`` per request; close a finished request owing nothing more."""
        ended: dict[str, list[tuple[StepKey, str, int, TransferOutcome]]] = {}
        for step_key, ok in saved.items():
            self._writing.discard(step_key)  # a late ack: that write is over
            acked = self._save_acks.pop(step_key, None)
            if acked is not None:
                request_id, key, offset = acked
                ended.setdefault(request_id, []).append(
                    (step_key, key, offset, OK if ok else FAILED)
                )
        for request_id, saves in ended.items():
            self._end_saves(request_id, saves)
            self._close_if_done(request_id)

    def rank_died(self, rank: int) -> None:
        """Rank ``rank``'s worker process is gone (the engine's failure path says so; never
        a timeout): it reads and writes nothing any more. The loads it owes are owed no more
        (a finished request owing nothing else closes); rank 0's fills end UNKNOWN (the cache
        quarantines their ranges until a fence frees them); no new load awaits its ack, and
        without rank 0 no fill is reserved. ``ranks.RankWatch`` learns the same from the
        process's exit by itself. Recorded in ``deaths``. Raises ``InvalidArgumentError`` for a
        rank out of range. O(outstanding transfers)."""
        self._rank_died(rank, "engine")

    def deaths(self) -> tuple[RankDeath, ...]:
        """The ranks known dead, in the order their deaths were learned (``RankDeath``: how,
        when, what each death ended and let the fence free). O(ranks)."""
        return tuple(self._deaths)

    def workers(self) -> dict[int, int]:
        """The worker process (pid) of each rank that announced one on this machine and is
        watched for its exit (a rank known dead is absent). O(ranks)."""
        return self._watch.watched()

    def _rank_died(self, rank: int, how: str) -> None:
        if not self._watch.mark_dead(rank) and not self._live >> rank & 1:
            return
        bit = 1 << rank
        self._live &= ~bit
        touched: list[str] = []
        released = 0
        for step_key, (request_id, missing) in list(self._load_acks.items()):
            if missing & bit:
                released += 1
                if missing & ~bit:
                    self._load_acks[step_key] = (request_id, missing & ~bit)
                    continue
                del self._load_acks[step_key]
                self._held[request_id].loads.discard(step_key)
                touched.append(request_id)
        unfenced: tuple[str, ...] = ()
        if rank == 0:
            unfenced = tuple(key for _, key in sorted(self._writing))
            self._writing.clear()
        ended_keys: tuple[str, ...] = ()
        if rank == 0 and self._save_acks:
            ended: dict[str, list[tuple[StepKey, str, int, TransferOutcome]]] = {}
            for step_key, (request_id, key, offset) in sorted(self._save_acks.items()):
                ended.setdefault(request_id, []).append((step_key, key, offset, UNKNOWN))
            ended_keys = tuple(key for saves in ended.values() for _, key, _, _ in saves)
            self._save_acks.clear()
            for request_id, saves in ended.items():
                self._end_saves(request_id, saves)
                touched.append(request_id)
        self._deaths.append(RankDeath(rank, self._watch.pid(rank), how, self._clock(), self._step,
                                      released, ended_keys, unfenced))  # fmt: skip
        log.error("rank %d's worker process is gone (%s): %d holds no longer wait for it",
                  rank, how, len(touched))  # fmt: skip
        for request_id in touched:
            self._close_if_done(request_id)

    def finish(self, request_id: str) -> None:
        """``request_finished``: close now, or once every ack came. O(1)."""
        held = self._held.get(request_id)
        if held is None or held.finished_at is not None:
            return
        held.finished_at = self._clock()
        if self._current is held:
            self._current = None
            self.has_item = NOTHING.__contains__
        if held.loads or held.saves:
            self._finishing[request_id] = held.finished_at
        else:
            self._close(request_id, held)

    # -- the rest ------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """A snapshot of the counters. O(requests)."""
        quarantined = [self._held[r] for r in self._quarantined]
        pinned = {
            it.key: it.nbytes for h in quarantined for it in h.items if it.key in (h.present or ())
        }
        return SchedulerStats(
            steps=self._step,
            open_requests=len(self._held),
            outstanding_loads=len(self._load_acks),
            outstanding_saves=len(self._save_acks),
            quarantined_requests=len(quarantined),
            quarantined_bytes=sum(pinned.values()),
            **self._counts,
        )

    def sizes(self) -> dict[str, int]:
        """How much each of the role's containers holds (embcache/DESIGN.md, "Memory bounds",
        "vLLM connector"), for watching memory: ``held`` (open requests), ``finishing`` (finished
        with an ack owed), ``quarantined`` (an ack lost), ``load_acks`` and ``save_acks``
        (transfers awaiting acks), ``writing`` (overdue fills rank 0 may still write),
        ``step_loads`` and ``step_saves`` (this step's, emptied by ``build``), ``deaths`` (the
        ranks known dead: at most the world size). O(1)."""
        return {
            "held": len(self._held),
            "finishing": len(self._finishing),
            "quarantined": len(self._quarantined),
            "load_acks": len(self._load_acks),
            "save_acks": len(self._save_acks),
            "writing": len(self._writing),
            "step_loads": len(self._step_loads),
            "step_saves": len(self._step_saves),
            "deaths": len(self._deaths),
        }

    def holds(self) -> dict[str, str]:
        """Each vLLM request whose embcache request is open, and why: ``"running"`` (vLLM has
        not finished it), ``"finishing"`` (finished, an ack owed for at most
        ``hold_timeout_s``) or ``"quarantined"`` (an ack lost: its pins held until it comes).
        O(requests)."""
        holds = dict.fromkeys(self._held, "running")
        holds.update(dict.fromkeys(self._finishing, "finishing"))
        holds.update(dict.fromkeys(self._quarantined, "quarantined"))
        return holds

    def check_invariants(self) -> None:
        """The cache's invariants, then the connector's: every outstanding load or save belongs
        to an open request that lists it; an outstanding save's entry is LOADING (its range
        reserved, unreadable); a request is open only while vLLM runs it or an ack is
        outstanding; the finishing and quarantined requests are open ones. O(n log n)."""
        self._cache.check_invariants()
        for step_key, (request_id, missing) in self._load_acks.items():
            held = self._held.get(request_id)
            if held is None or step_key not in held.loads or not 0 < missing <= self._all_ranks:
                raise InvariantError(f"load {step_key} of {request_id!r}: not held by its request")
        for step_key, (request_id, key, _) in self._save_acks.items():
            held = self._held.get(request_id)
            if held is None or step_key not in held.saves:
                raise InvariantError(f"save {step_key} of {request_id!r}: not held by its request")
            if self._cache.entry_state(key) is not EntryState.LOADING:
                raise InvariantError(
                    f"save {step_key}: its entry is {self._cache.entry_state(key)}"
                )
        for request_id, held in self._held.items():
            owed = held.loads | held.saves
            if owed - self._load_acks.keys() - self._save_acks.keys():
                raise InvariantError(f"request {request_id!r} lists acks nobody owes")
            if held.finished_at is not None and not owed:
                raise InvariantError(f"request {request_id!r} finished, acked, still open")
            waiting = request_id in self._finishing or request_id in self._quarantined
            if (held.finished_at is not None) != waiting:
                raise InvariantError(f"request {request_id!r}: finished_at and its hold disagree")
        if self._finishing.keys() & self._quarantined:
            raise InvariantError(
                f"{self._finishing.keys() & self._quarantined} finishing and quarantined"
            )

    def close(self) -> None:
        """Release everything (the ranks are gone), close the cache and the shared pool."""
        for held in self._held.values():
            held.request.close()
        self._held.clear()
        self._finishing.clear()
        self._quarantined.clear()
        self._load_acks.clear()
        self._save_acks.clear()
        self._watch.close()
        self._writing.clear()
        self._cache.close()
        self._close_store()

    def _look_up(self, held: _Held, items: list[Item]) -> None:
        """Look up ``items`` not looked up before (media that arrived since)."""
        seen = set(held.looked)
        unique = [it for it in {it.key: it for it in items}.values() if it.key not in seen]
        held.looked += [it.key for it in unique]
        self._note_present(held, held.request.lookup_offsets(unique, prefetch=self._consumer))

    def _settle(self, held: _Held) -> bool:
        """A request whose lookup waits on a load: False (defer) while it does, else note what
        it holds and make it current."""
        if not held.request.wait(0):
            self._counts["deferred"] += 1
            return False
        self._note_present(held, held.request.offsets())
        return self._make_current(held)

    def _note_present(self, held: _Held, offsets: list[int | None] | None) -> None:
        """What ``held`` holds, from the offsets of its looked-up items (None: pending)."""
        if offsets is None:
            held.present = None
        else:
            pairs = zip(held.looked, offsets, strict=True)
            held.present = {k: o for k, o in pairs if o is not None}

    def _make_current(self, held: _Held) -> bool:
        """``held`` is the request vLLM schedules now: ``has_item`` answers for it."""
        assert held.present is not None
        self._current = held
        self.has_item = held.present.__contains__ if self._consumer else NOTHING.__contains__
        return True

    def _close_store(self) -> None:
        try:
            if self._own_store and self._store is not None:
                self._store.close()
        finally:
            self._shared.close()

    def _end_saves(
        self, request_id: str, saves: list[tuple[StepKey, str, int, TransferOutcome]]
    ) -> None:
        """End the fills of ``saves`` (step key, key, offset, outcome) of one request."""
        held = self._held[request_id]
        for step_key, *_ in saves:
            held.saves.discard(step_key)
        cached = held.request.end_fill([s[1] for s in saves], [s[3] for s in saves])
        for (_, key, offset, _), ok in zip(saves, cached, strict=True):
            if ok:
                self._counts["inserts"] += 1
                if held.present is not None:  # it pins the fresh entry: a resumed request loads it
                    held.present[key] = offset

    def _close_if_done(self, request_id: str) -> None:
        held = self._held.get(request_id)
        if held is not None and held.finished_at is not None and not (held.loads or held.saves):
            self._close(request_id, held)

    def _close(self, request_id: str, held: _Held) -> None:
        held.request.close()
        del self._held[request_id]
        self._finishing.pop(request_id, None)
        self._quarantined.discard(request_id)

    def _rename(self, held: _Held) -> None:
        """vLLM reuses the id of a finished request whose acks are still owed: the old one
        keeps its hold under a name of its own."""
        old = held.request.request_id
        alias = f"{old}#step{self._step}"
        self._held[alias] = self._held.pop(old)
        for step_key, (request_id, missing) in self._load_acks.items():
            if request_id == old:
                self._load_acks[step_key] = (alias, missing)
        for step_key, (request_id, key, offset) in self._save_acks.items():
            if request_id == old:
                self._save_acks[step_key] = (alias, key, offset)
        self._finishing = {alias if r == old else r: t for r, t in self._finishing.items()}
        if old in self._quarantined:
            self._quarantined.discard(old)
            self._quarantined.add(alias)

    def _expire(self) -> None:
        """Quarantine the finished requests whose acks are overdue (oldest first): their pins
        and fills stay (a slow rank is not a dead one); then end what the ranks whose worker
        process exited owed (``rank_died``)."""
        now, timeout = self._clock(), self._hold_timeout
        overdue = []  # oldest first; the rest finished later
        for request_id, finished_at in self._finishing.items():
            if now - finished_at < timeout:
                break
            overdue.append(request_id)
        for request_id in overdue:
            del self._finishing[request_id]
            held = self._held[request_id]
            unknown = []
            for step_key in sorted(held.saves):
                _, key, offset = self._save_acks.pop(step_key)
                unknown.append((step_key, key, offset, UNKNOWN))
                self._writing.add(step_key)
            if unknown:
                self._end_saves(request_id, unknown)
            if not held.loads:
                self._close(request_id, held)
                continue
            self._quarantined.add(request_id)
            ranks = range(self._ranks)
            missing = {r for k in held.loads for r in ranks if self._load_acks[k][1] >> r & 1}
            log.warning(
                "request %s: no ack from ranks %s after %g s; its %d bytes stay held until "
                "they ack or their process is gone",
                request_id,
                sorted(missing),
                self._hold_timeout,
                self._held_bytes(held),
            )
        for rank in self._watch.dead_now():
            self._rank_died(rank, "process exit")

    def _no_fill_writing(self) -> bool:
        """The cache's fence gate: no fill ended UNKNOWN that rank 0 may still write."""
        return not self._writing

    def _held_bytes(self, held: _Held) -> int:
        present = held.present or {}
        return sum(it.nbytes for it in {i.key: i for i in held.items}.values() if it.key in present)


def store_from_options(options: ConnectorOptions) -> GlobalStore | None:
    """The Mooncake store ``options`` names; None (no global tier) when it names no master."""
    if options.mooncake_master is None:
        return None
    from embcache.store.mooncake import MooncakeStore

    return MooncakeStore(
        options.mooncake_master,
        global_segment_size=options.mooncake_segment,
        key_prefix=options.key_prefix,
    )
