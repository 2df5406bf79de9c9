"""Eviction orders and admission policies (DESIGN.md, "Eviction order and admission").

Theory of operation. The evictable entries (READY, no pins, not doomed, no quarantine pending)
form one *eviction order*, lowest value first; the contiguity rule takes its victims among the
first entries of that order. A policy decides where an entry enters the order (``add``, called
when it becomes evictable) and may refuse a ``BeginLoad`` that would have to evict (``admit``):
the item is then served from its fresh encoder output and not cached (reason
``not_admitted``), and nothing is evicted. The core calls ``record`` for every looked-up key
(hit, join or miss) and ``forget`` when an entry is freed. Safety never depends on the policy:
the core enforces every invariant whatever the order says or admission answers. This module is
pure (no clock, no thread, no I/O, no torch); the caller holds the cache lock around every
call, and one policy object serves one cache.

Policies (``make_policy(name, **knobs)``):
- ``lru`` (the default): recency order, admits everything; exactly the seed's behaviour.
- ``tinylfu``: recency order and a TinyLFU admission filter: a candidate is admitted only if it
  was looked up more often, recently, than every one of its victims.
- ``adaptive``: ``tinylfu`` with an admission window: a share of the bytes the filter refuses
  is admitted anyway, and that share moves toward the answer (filter or window) that has been
  proving wrong less often, from LRU (share 1) to ``tinylfu`` (share 0).

Design notes on ``tinylfu`` (chosen by measurement, ``benchmarks/policy/bench_policy.py`` and
``benchmarks/policy/bench_policy_grid.py``). Counts are a count-min sketch (``FrequencySketch``: 4
rows of one-byte counters, conservative update, ``hash(key)`` once and the rows' indexes by double
hashing), saturating at 15 as TinyLFU's 4-bit counters do, and halved every ``sample_factor`` x
(resident entries) lookups, TinyLFU's sample of ten times the cache. Its width is the next power
of two >= 4 x a sample's lookups, grown (never shrunk) when a sample starts, so its memory is a
fixed function of the entries the pool holds, never of the keys seen (its sizing, measured:
``embcache.core.sketch``). Resident keys (those the order took in, not forgotten since) are
counted exactly instead, in a dict that holds only them: a resident key's count starts at its
estimate at its first lookup as a resident, halves and clears with the sketch, and goes back
into the sketch when its entry is freed (each of its counters raised to at least it). A hit is
then one dict lookup and store where a sketch update computes, reads and writes four counters
(``embcache.core.sketch``: the costs), and a victim's count (a resident's) is exact. The aging alone
follows a slow drift but not a sudden one: after the popularity is reshuffled, the stale
favourites keep high counts for several halvings and the filter refuses the new favourites (on
the drifting mix it saved 33.2% of encoder tokens where LRU saved 44.2%). Halving faster, or a
feedback on refusals that later proved wrong (ARC-like), traded the steady mix's gain away for
drift. So the policy detects the shift itself: it averages the counts of the keys looked up, per
block of ``shift_block`` lookups; a block whose mean falls below ``shift_drop`` x the running
mean of earlier blocks means the traffic moved to keys the counts do not know, and every count
is cleared (the filter then admits like LRU until the new counts build up). A steady mix never
drops that far (the mean rises as counts build up; each halving restarts the running mean).
Rejected: W-TinyLFU (a window of new entries dueling main's oldest): with byte-sized victims
chosen by contiguity it kept too little of the filter's refusals (+4 points on steady, not +10).

Design notes on ``adaptive`` (``benchmarks/policy/bench_policy_grid.py``). The spec lets a
policy choose where an entry enters the order and whether to admit, nothing else: an entry
never moves while it is in the order. So Caffeine's window (a segment whose overflow moves to
main, demoting main's protected entries) cannot be an order here; ours is a share of the
filter's refusals admitted anyway, into the same recency order. Caffeine tunes its window by
hill climbing on the hit ratio of consecutive samples (restart 0.05, step 6.25%, decay 0.98);
on the grid's runs (4000 requests, 10 to 40 samples) the sample-to-sample noise of a hit ratio
in bytes (sizes spread 64x) was larger than the effect of a step, and the share random-walked
(steady mix, 4 MiB: 60.9% tokens saved against tinylfu's 65.2%). The window moves instead on a
paired signal: the regret of each answer on the same stream, in the same period. A refused
candidate looked up again within the horizon regrets its bytes against the filter; a victim
evicted for a window admission looked up again regrets its share against the window. Sizes
are the candidates' bytes, which ``admit`` is given; victims share their candidate's bytes.
The share stays within [0.02, 0.98] so that both answers keep being measured. Ghosts (the keys
whose regret is pending) are pruned once per period, and bounded at 2 x (horizon + 1) x
max(resident, ``min_entries``), the oldest dropped (a memory bound): admissions asked with no
lookup (request-less inserts) end no period. On the grid they peak below 1.4 per resident entry, so
the bound never drops one there.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from embcache.core.recency import RecencyOrder, ResidentOrder
from embcache.core.sketch import DEPTH, MAX_COUNTER, Footprint, FrequencySketch, next_power_of_two
from embcache.errors import InvalidArgumentError, InvalidTypeError


class EvictionOrder(Protocol):
    """The evictable entries, first to evict first."""

    def add(self, key: str) -> None:
        """``key`` became evictable (Release to 0 pins, or EndLoad OK with no waiters)."""

    def discard(self, key: str) -> bool:
        """``key`` is no longer evictable (pinned, freed); whether it was in the order."""

    def __iter__(self) -> Iterator[str]:
        """Lowest value (first victim) first; lazy, the caller may stop early."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class Policy(Protocol):
    """Where entries enter the eviction order, and which inserts that must evict are taken."""

    name: str
    records_lookups: bool  # False: ``record`` does nothing, and the core skips the call

    def order(self) -> EvictionOrder:
        """The eviction order of one cache (called once per cache)."""

    def record(self, key: str) -> None:
        """``key`` was looked up (hit, join or miss)."""

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """Whether to insert ``key`` (``nbytes``) at the cost of evicting ``victims``."""

    def forget(self, key: str) -> None:
        """The entry of ``key`` was freed."""


class LruPolicy:
    """Least recently used first; admits every insert (the seed's behaviour)."""

    name = "lru"
    records_lookups = False

    def order(self) -> RecencyOrder:
        """A new recency order."""
        return RecencyOrder()

    def record(self, key: str) -> None:
        """Nothing to note: recency is the order itself."""

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """Always True."""
        return True

    def forget(self, key: str) -> None:
        """Nothing kept per key."""


def _int_knob(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    return value


def _fraction_knob(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0 <= value < 1:
        raise InvalidArgumentError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def _range_knob(name: str, value: object, top: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0 <= value <= top:
        raise InvalidArgumentError(f"{name} must be in [0, {top:g}], got {value}")
    return float(value)


class TinyLfuPolicy:
    """Recency order with a TinyLFU admission filter that follows a drifting mix.

    Knobs: ``sample_factor`` (counts halve every ``sample_factor`` x max(resident entries,
    ``min_entries``) lookups), ``max_count`` (counts saturate there, at most 255),
    ``shift_block`` and ``shift_drop`` (every count is cleared when the mean count of a block
    of ``shift_block`` looked-up keys falls below ``shift_drop`` x the running mean of the
    blocks before; 0 turns this off). Counts are a ``FrequencySketch`` whose width is, from
    the start of each sample, at least the next power of two >= ``COUNTERS_PER_LOOKUP`` x the
    sample's lookups (it grows, never shrinks), and for resident keys exact counts (a dict of
    at most the resident keys; see the module's design notes). ``record`` O(1) amortised (a
    halving is O(width + resident), once per sample); ``admit`` O(victims).
    """

    name = "tinylfu"
    records_lookups = True
    SMOOTHING = 0.3  # weight of the newest block in the running mean
    COUNTERS_PER_LOOKUP = 4  # sketch width per lookup of a sample (2: -0.35 point on a cell)

    def __init__(  # object: checked here, also when compiled (see make_policy)
        self,
        sample_factor: object = 10,
        min_entries: object = 16,
        max_count: object = 15,
        shift_block: object = 50,
        shift_drop: object = 0.6,
    ) -> None:
        self._sample_factor = _int_knob("sample_factor", sample_factor)
        self._min_entries = _int_knob("min_entries", min_entries)
        self._max_count = _int_knob("max_count", max_count)
        if self._max_count > MAX_COUNTER:
            raise InvalidArgumentError(
                f"max_count must be <= {MAX_COUNTER} (a counter is a byte), got {max_count}"
            )
        self._shift_block = _int_knob("shift_block", shift_block)
        self._shift_drop = _fraction_knob("shift_drop", shift_drop)
        self._resident: set[str] = set()
        self._counts: dict[str, int] = {}  # resident keys looked up while resident: exact
        self._has_order = False
        self._sketch = FrequencySketch(1, self._max_count)
        self._block_lookups = 0
        self._block_sum = 0
        self._running_mean: float | None = None
        self._span = self._left = self._samples = self._sample = 0
        self._start_sample()
        self._schedule()
        self.halvings = 0
        self.shifts = 0

    def order(self) -> RecencyOrder:
        """The recency order of this policy's cache; the keys that enter it are resident.

        raises: InvalidArgumentError on a second call (a policy's counts serve one cache)
        """
        if self._has_order:
            raise InvalidArgumentError(
                f"this {type(self).__name__} already serves a cache: give each cache its "
                f"own (make_policy({self.name!r}))"
            )
        self._has_order = True
        return ResidentOrder(self._resident)

    @property
    def sketch(self) -> FrequencySketch:
        """The counts (read it, do not change it)."""
        return self._sketch

    def estimate(self, key: str) -> int:
        """Recent lookups of ``key`` (saturating, halved once per sample): a resident key's
        exact count once looked up while resident, else the sketch's estimate. O(1)."""
        count = self._counts.get(key)
        return self._sketch.estimate(key) if count is None else count

    def record(self, key: str) -> None:
        """Count one lookup of ``key``; age the counts when a sample is full or a shift shows.
        A hit (a resident key) is one dict lookup and store: this runs on every lookup."""
        count = self._counts.get(key)
        if count is None:
            count = self._count_resident(key) if key in self._resident else self._sketch.add(key)
        elif count < self._max_count:
            self._counts[key] = count + 1
        self._block_sum += count
        self._left -= 1
        if not self._left:
            self._tick()

    def _count_resident(self, key: str) -> int:
        """Count the first lookup of resident ``key`` since it became resident: its exact count
        starts at its estimate (then counted, saturating). The count before."""
        before = self._sketch.estimate(key)
        self._counts[key] = before + 1 if before < self._max_count else before
        return before

    def _tick(self) -> None:
        """The lookup that ends a sample (halve) or else a block (look for a shift)."""
        self._samples += self._span
        self._block_lookups += self._span
        if self._samples == self._sample:
            self._halve()
        elif self._shift_drop and self._block_lookups == self._shift_block:
            self._end_block()
        self._schedule()

    def _schedule(self) -> None:
        """Lookups until the next end of a sample or (detector on) of a block."""
        self._span = self._sample - self._samples
        if self._shift_drop:
            self._span = min(self._span, self._shift_block - self._block_lookups)
        self._left = self._span

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """True iff ``key`` was looked up more often than each of ``victims``. O(victims)."""
        estimate = self.estimate
        count = estimate(key)
        return all(count > estimate(victim) for victim in victims)

    def forget(self, key: str) -> None:
        """``key`` is no longer resident: its exact count, if any, goes back into the sketch."""
        self._resident.discard(key)
        count = self._counts.pop(key, None)
        if count is not None:
            self._sketch.raise_to(key, count)

    def footprint(self) -> Footprint:
        """What this policy keeps now, each container counted. O(1)."""
        return Footprint(self._sketch.nbytes, len(self._resident), len(self._counts))

    def bound(self, entries: int) -> Footprint:
        """The most ``footprint()`` reaches in a cache that holds at most ``entries`` entries
        (a pool of ``capacity`` bytes holds at most ``capacity // alignment``): the resident
        keys and their exact counts are at most the entries, and the sketch is as wide as the
        widest sample asks. O(1)."""
        sample = self._sample_factor * max(entries, self._min_entries)
        sketch = DEPTH * next_power_of_two(self.COUNTERS_PER_LOOKUP * sample)
        return Footprint(sketch, entries, entries)

    def _entries(self) -> int:
        """The resident entries, or ``min_entries`` if more: what samples and bounds scale by."""
        return max(len(self._resident), self._min_entries)

    def _start_sample(self) -> None:
        """A new sample, sized by today's residents; the sketch at least
        ``COUNTERS_PER_LOOKUP`` x as wide as it has lookups."""
        self._samples = 0
        self._sample = self._sample_factor * self._entries()
        self._sketch.grow(next_power_of_two(self.COUNTERS_PER_LOOKUP * self._sample))

    def _halve(self) -> None:
        self._sketch.halve()
        self._counts = {key: count >> 1 for key, count in self._counts.items()}
        self._start_sample()
        self.halvings += 1
        self._restart_blocks()

    def _end_block(self) -> None:
        mean = self._block_sum / self._block_lookups
        self._block_sum = self._block_lookups = 0
        if self._running_mean is None:
            self._running_mean = mean
        elif mean < self._shift_drop * self._running_mean:
            self._sketch.clear()
            self._counts.clear()
            self._start_sample()
            self.shifts += 1
            self._restart_blocks()
        else:
            self._running_mean += self.SMOOTHING * (mean - self._running_mean)

    def _restart_blocks(self) -> None:
        self._block_sum = self._block_lookups = 0
        self._running_mean = None


class AdaptivePolicy(TinyLfuPolicy):
    """``tinylfu`` with an admission window: a share ``window`` of the bytes its filter refuses
    is admitted anyway (``window`` 1 is LRU, 0 is ``tinylfu``), and the share climbs toward
    whichever of the two answers has been proving wrong less often.

    Regret, in bytes, over a horizon of ``horizon`` x max(resident, ``min_entries``) lookups:
    a refused candidate looked up again counts its bytes against the filter; a victim evicted
    for a candidate the window let in, looked up again, counts its share of the candidate's
    bytes against the window. Every max(resident, ``min_entries``) lookups, ``window`` moves
    by ``step`` toward the side with the lower regret per byte decided (within
    [``low``, ``high``], so both sides keep being measured); no decision, no move.
    Ghosts (pending regrets) are at most ``GHOSTS_PER_ENTRY`` x (``horizon`` + 1) x
    max(resident, ``min_entries``), the oldest dropped. ``record`` O(1) amortised (expired
    regrets are dropped once per period), ``admit`` O(victims).
    """

    name = "adaptive"
    GHOSTS_PER_ENTRY = 2  # the grid's runs peak below 1.4 ghosts per resident entry

    def __init__(  # object: checked here, also when compiled (see make_policy)
        self,
        sample_factor: object = 10,
        min_entries: object = 16,
        max_count: object = 15,
        shift_block: object = 50,
        shift_drop: object = 0.6,
        window: object = 0.5,
        step: object = 0.1,
        low: object = 0.02,
        high: object = 0.98,
        horizon: object = 1,
    ) -> None:
        super().__init__(sample_factor, min_entries, max_count, shift_block, shift_drop)
        self._low = _range_knob("low", low, 1.0)
        self._high = _range_knob("high", high, 1.0)
        if self._low > self._high:
            raise InvalidArgumentError(f"low must be <= high, got low {low} > high {high}")
        self.window = _range_knob("window", window, 1.0)
        if not self._low <= self.window <= self._high:
            raise InvalidArgumentError(f"window must be in [low, high], got {window}")
        self._step = _range_knob("step", step, 1.0)
        self._horizon = _int_knob("horizon", horizon)
        self._credit = 0.0  # refused bytes times window, not yet spent on an admission
        self._now = 0  # lookups so far
        # key -> (last lookup that counts, bytes it regrets, True: refused / False: evicted),
        # oldest written first; at most ``_ghost_bound()``
        self._ghosts: OrderedDict[str, tuple[int, float, bool]] = OrderedDict()
        self._refused_bytes = self._admitted_bytes = 0  # decided by each side this period
        self._refused_regret = self._admitted_regret = 0.0
        self._period_end = self._min_entries  # the lookup that ends this period
        self.moves = 0

    def record(self, key: str) -> None:
        """Count one lookup of ``key``; a regret it settles; age, or move the window, when due.
        (``TinyLfuPolicy.record`` written out: this runs on every hit.)"""
        count = self._counts.get(key)
        if count is None:
            count = self._count_resident(key) if key in self._resident else self._sketch.add(key)
        elif count < self._max_count:
            self._counts[key] = count + 1
        self._block_sum += count
        self._left -= 1
        if not self._left:
            self._tick()
        now = self._now = self._now + 1
        if key in self._ghosts:
            self._settle(key)
        if now == self._period_end:
            self._move()

    def _settle(self, key: str) -> None:
        """``key`` was refused, or evicted for a window admission: regret it within the horizon."""
        last, nbytes, refused = self._ghosts.pop(key)
        if last >= self._now:
            if refused:
                self._refused_regret += nbytes
            else:
                self._admitted_regret += nbytes

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """The filter's answer, or True for a ``window`` share of the bytes it refuses."""
        if super().admit(key, nbytes, victims):
            return True
        self._credit += self.window * nbytes
        last = self._now + self._horizon * self._entries()
        if self._credit < nbytes:
            self._refused_bytes += nbytes
            self._haunt(key, (last, nbytes, True))
            return False
        self._credit -= nbytes
        self._admitted_bytes += nbytes
        share = nbytes / len(victims)  # not empty: with no victims the filter admits
        for victim in victims:
            self._haunt(victim, (last, share, False))
        return True

    def footprint(self) -> Footprint:
        """What this policy keeps now, each container counted. O(1)."""
        return Footprint(
            self._sketch.nbytes, len(self._resident), len(self._counts), len(self._ghosts)
        )

    def ghost_keys(self) -> list[str]:
        """The keys it remembers refusing or evicting for an admission (the ghosts
        ``footprint().ghosts`` counts), oldest first: a copy. O(ghosts)."""
        return list(self._ghosts)

    def bound(self, entries: int) -> Footprint:
        """``TinyLfuPolicy.bound``, and at most ``_ghost_bound()`` ghosts. O(1)."""
        ghosts = self.GHOSTS_PER_ENTRY * (self._horizon + 1) * max(entries, self._min_entries)
        return Footprint(super().bound(entries).sketch_bytes, entries, entries, ghosts)

    def _ghost_bound(self) -> int:
        """``GHOSTS_PER_ENTRY`` x (``horizon`` + 1) x max(resident, ``min_entries``): a ghost
        lives ``horizon`` periods and is pruned at the end of the next one."""
        return self.GHOSTS_PER_ENTRY * (self._horizon + 1) * self._entries()

    def _haunt(self, key: str, ghost: tuple[int, float, bool]) -> None:
        """Note ``ghost`` for ``key`` (replacing any, as the newest); drop the oldest ghosts
        beyond the bound. O(1) amortised."""
        ghosts = self._ghosts
        ghosts[key] = ghost
        ghosts.move_to_end(key)
        bound = self._ghost_bound()
        while len(ghosts) > bound:
            ghosts.popitem(last=False)

    def _move(self) -> None:
        """Move ``window`` a step toward the side that regretted less per byte it decided."""
        refused, admitted = self._refused_bytes, self._admitted_bytes
        if refused or admitted:
            against_filter = self._refused_regret / refused if refused else 0.0
            against_window = self._admitted_regret / admitted if admitted else 0.0
            if against_filter != against_window:
                up = against_filter > against_window
                moved = self.window + (self._step if up else -self._step)
                self.window = min(max(moved, self._low), self._high)
                self.moves += 1
        self._refused_bytes = self._admitted_bytes = 0
        self._refused_regret = self._admitted_regret = 0.0
        now = self._now
        self._ghosts = OrderedDict((k, g) for k, g in self._ghosts.items() if g[0] >= now)
        self._period_end = now + self._entries()


POLICIES: dict[str, Callable[..., Policy]] = {
    "lru": LruPolicy,
    "tinylfu": TinyLfuPolicy,
    "adaptive": AdaptivePolicy,
}


def make_policy(name: object = "lru", **knobs: Any) -> Policy:
    """A new policy called ``name`` (one of ``POLICIES``) with its ``knobs``.

    ``name`` and the policies' knobs are typed ``object`` and checked inside: compiled by mypyc
    (docs/setup.md, "A compiled core"), a parameter typed ``int`` or ``str`` rejects anything
    else with a plain ``TypeError`` and turns a bool into an int before our checks could raise
    ``InvalidTypeError``."""
    if not isinstance(name, str):
        raise InvalidTypeError(f"policy name must be a str, got {type(name).__name__} {name!r}")
    factory = POLICIES.get(name)
    if factory is None:
        raise InvalidArgumentError(
            f"unknown policy {name!r}: use one of {', '.join(sorted(POLICIES))}"
        )
    unknown = sorted(set(knobs) - set(inspect.signature(factory).parameters))
    if unknown:
        raise InvalidArgumentError(
            f"policy {name!r} has no knobs {unknown}: its knobs are "
            f"{sorted(inspect.signature(factory).parameters) or 'none'}"
        )
    return factory(**knobs)


def as_policy(policy: str | Policy) -> Policy:
    """``policy`` itself when it is a ``Policy`` object, else ``make_policy(policy)``: the one
    place a cache's ``policy`` argument is checked. Raises ``InvalidTypeError`` for anything
    else."""
    if isinstance(policy, str):
        return make_policy(policy)
    if not all(callable(getattr(policy, m, None)) for m in ("order", "record", "admit", "forget")):
        raise InvalidTypeError(f"policy must be a name or a Policy object, got {policy!r}")
    return policy
