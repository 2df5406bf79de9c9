"""``tinylfu``: the recency order and a TinyLFU admission filter that follows a drifting mix.

Contract. ``TinyLfuPolicy`` takes a ``BeginLoad`` that must evict only if its key was looked up
more often, recently, than every victim (``admit``); the order is ``lru``'s. ``record`` counts
every lookup: keys not resident in a ``FrequencySketch`` (``embcache.core.sketch``: 4 rows of
one-byte counters, saturating at ``max_count``), resident keys exactly in a dict that holds
only them (a hit is one dict lookup and store; the count goes back into the sketch at
``forget``). Every count halves once per sample (``sample_factor`` x max(resident entries,
``min_entries``) lookups), and every count is cleared when the traffic shifts: when the mean
count of the keys seen before, per block of ``shift_block`` lookups, falls below
``shift_drop`` x the running mean of the blocks before. Memory is a fixed function of the
entries the pool holds, never of the keys seen (``bound``). Pure (no clock, no thread, no I/O);
the caller holds the cache lock; one policy object serves one cache (``order`` once).

Why each rule, and what was measured and rejected: docs/policies.md, "tinylfu".
"""

from __future__ import annotations

from collections.abc import Sequence

from mypy_extensions import mypyc_attr

from embcache.core.recency import RecencyOrder, ResidentOrder
from embcache.core.sketch import DEPTH, MAX_COUNTER, Footprint, FrequencySketch, next_power_of_two
from embcache.errors import InvalidArgumentError, InvalidTypeError


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


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled: the tests' planted bugs extend it
class TinyLfuPolicy:
    """Recency order with a TinyLFU admission filter that follows a drifting mix.

    Knobs: ``sample_factor`` (counts halve every ``sample_factor`` x max(resident entries,
    ``min_entries``) lookups), ``max_count`` (counts saturate there, at most 255),
    ``shift_block`` and ``shift_drop`` (every count is cleared when the mean count of the keys
    seen before among a block of ``shift_block`` lookups falls below ``shift_drop`` x the
    running mean of the blocks before; first-seen keys are left out; 0 turns this off).
    Counts are a ``FrequencySketch`` whose width is, from the start of each sample, at least
    the next power of two >= ``COUNTERS_PER_LOOKUP`` x the sample's lookups (it grows, never
    shrinks), and for resident keys exact counts (a dict of at most the resident keys;
    docs/policies.md, "tinylfu"). ``record`` O(1) amortised (a halving is O(width +
    resident), once per sample); ``admit`` O(victims).
    """

    name = "tinylfu"
    records_lookups = True
    records_work = False  # True: ``note_work`` is kept, and the core calls it (WorkPolicy)
    SMOOTHING = 0.3  # weight of the newest block in the running mean
    COUNTERS_PER_LOOKUP = 4  # sketch width per lookup of a sample (2: -0.35 point on a cell)

    def __init__(  # object: checked here, also when compiled (see policy.make_policy)
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
        # Resident keys: those in the order, and ``_resident``, those out of it (pinned) and not
        # forgotten (``ResidentOrder``): an idle entry's key costs no table of the policy's.
        self._resident: set[str] = set()
        self._order = ResidentOrder(self._resident)
        self._counts: dict[str, int] = {}  # resident keys looked up while resident: exact
        self._has_order = False
        self._sketch = FrequencySketch(1, self._max_count)
        self._block_lookups = 0
        self._block_sum = 0
        self._block_seen = 0  # the block's lookups of keys seen before (count above 0)
        self._running_mean: float | None = None
        self._span = self._left = self._samples = self._sample = 0
        self._ticked = 0  # lookups up to the last tick (``lookups``: the ones since too)
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
        return self._order

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
            count = self._count_resident(key) if self._is_resident(key) else self._sketch.add(key)
        elif count < self._max_count:
            self._counts[key] = count + 1
        if count:
            self._block_sum += count
            self._block_seen += 1
        self._left -= 1
        if not self._left:
            self._tick()

    def _is_resident(self, key: str) -> bool:
        """Whether ``key`` entered the order and was not forgotten since. O(1)."""
        return key in self._order or key in self._resident

    def _count_resident(self, key: str) -> int:
        """Count the first lookup of resident ``key`` since it became resident: its exact count
        starts at its estimate (then counted, saturating). The count before."""
        before = self._sketch.estimate(key)
        self._counts[key] = before + 1 if before < self._max_count else before
        return before

    def lookups(self) -> int:
        """Lookups recorded so far (counted per tick, so a lookup costs nothing more). O(1)."""
        return self._ticked + self._span - self._left

    def _tick(self) -> None:
        """The lookup that ends a sample (halve) or else a block (look for a shift)."""
        self._ticked += self._span
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
        return Footprint(self._sketch.nbytes, self._residents(), len(self._counts))

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
        return max(self._residents(), self._min_entries)

    def _residents(self) -> int:
        """How many keys are resident (in the order, or out of it and not forgotten). O(1)."""
        return len(self._order) + len(self._resident)

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
        """The mean count of the block's keys seen before (a first-seen key, count 0, is
        left out: a scan's one-offs are no shift until they come back); a block of first-seen
        keys only is no evidence either way."""
        total, seen = self._block_sum, self._block_seen
        self._block_sum = self._block_lookups = self._block_seen = 0
        if not seen:
            return
        mean = total / seen
        if self._running_mean is None:
            self._running_mean = mean
        elif mean < self._shift_drop * self._running_mean:
            self._sketch.clear()
            self._counts.clear()
            self._start_sample()
            self.shifts += 1
            self._restart_blocks()
            self._shifted()
        else:
            self._running_mean += self.SMOOTHING * (mean - self._running_mean)

    def _restart_blocks(self) -> None:
        self._block_sum = self._block_lookups = self._block_seen = 0
        self._running_mean = None

    def _shifted(self) -> None:
        """A shift was detected at this lookup (every count just cleared): nothing more here."""
