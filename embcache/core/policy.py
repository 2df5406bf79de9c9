"""Eviction orders and admission policies (DESIGN.md, "Eviction order and admission").

Theory of operation. The evictable entries (READY, no pins, not doomed, no quarantine pending)
form one *eviction order*, lowest value first; the contiguity rule takes its victims among the
first entries of that order. A policy decides where an entry enters the order (``add``, called
when it becomes evictable) and may refuse a ``BeginLoad`` that would have to evict (``admit``):
the item is then served from its fresh encoder output and not cached (reason
``not_admitted``), and nothing is evicted. The core calls ``record`` for every looked-up key
(hit, join or miss), ``forget`` when an entry is freed, and, for a policy that keeps encoder
work (``records_work``), ``note_work`` / ``note_encoded`` at the end of an insert given its
outputs' measured encoder seconds. Safety never depends on the policy:
the core enforces every invariant whatever the order says or admission answers. This module is
pure (no clock, no thread, no I/O, no torch); the caller holds the cache lock around every
call, and one policy object serves one cache.

Policies (``make_policy(name, **knobs)``):
- ``lru`` (the default): recency order, admits everything; exactly the seed's behaviour.
- ``tinylfu``: recency order and a TinyLFU admission filter: a candidate is admitted only if it
  was looked up more often, recently, than every one of its victims.
- ``adaptive``: ``tinylfu``'s counts, and admission by whichever expert (admit everything, as
  ``lru``; or ``tinylfu``'s filter behind a doorkeeper: a key seen once displaces nothing)
  has had more hits lately in a shadow cache of keys that follows it alone.
- ``adaptive-work``: ``adaptive`` whose filter weighs each key's recent lookups by its measured
  encoder seconds per byte (the driver passes each fresh output's encoder time to ``insert``;
  without it, ``adaptive`` exactly).

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
drift. So the policy detects the shift itself: it averages the counts of the keys looked up
that it has seen before (a first-seen key, count 0, is left out), per block of ``shift_block``
lookups; a block whose mean falls below ``shift_drop`` x the running mean of earlier blocks
means the traffic moved to keys the counts barely know, and every count is cleared (the filter
then admits like LRU until the new counts build up). A steady mix never drops that far (the
mean rises as counts build up; each halving restarts the running mean). First-seen keys are
left out because a scan's one-offs are first-seen too: averaged in, the server benchmark's
scan mix (steady traffic, a quarter of the requests all new images) looked like 6 to 8 shifts
in 2,000 requests, each clearing every favourite's count, and ``adaptive`` re-encoded 10% more
(``benchmarks.server.replay``, seeds 0 and 1: 1.025x / 0.985x the original PR's encoder time,
0.893x / 0.893x without them). New favourites that were never seen still show: their second
lookups (count 1) pull the mean down a block later; a block of first-seen keys only is no
evidence either way. On the grid it costs ``tinylfu`` 0.57 point of mean tokens saved (47.66
against 48.23; ``adaptive`` 49.17 against 49.08); a confirmation over two blocks instead
(the mean over every lookup) lost 1-2 points on slow drift.
Rejected: W-TinyLFU (a window of new entries dueling main's oldest): with byte-sized victims
chosen by contiguity it kept too little of the filter's refusals (+4 points on steady, not +10).

Design notes on ``adaptive`` (``benchmarks/policy/bench_policy_grid.py``, its ``--five`` mixes,
issue 41). ``lru`` wins on fast drift (the popularity reshuffled every 100-250 requests: up to
6 points over ``tinylfu``), ``tinylfu`` on steady, scan and slow drift (up to 12 points over
``lru``); an adaptive policy should follow whichever wins now. The spec lets a policy choose
where an entry enters the order and whether to admit, nothing else (an entry never moves
while in the order), so the two experts differ only in admission: admit everything, or the
filter's answer. Tried, on the grid's cells (seed 1) and the five mixes:
- a share of the filter's refusals admitted anyway, the share moved by the regret of each
  answer (a refused key looked up again; a victim of an admission looked up again), in steps
  of 0.1 per period (the previous ``adaptive``): it settled between the experts, 1 to 3.7
  points behind ``tinylfu`` on steady, scan and slow drift and up to 1.5 behind ``lru`` on
  fast drift, ahead of both on none; larger steps (0.25), a longer horizon (3 periods) or a
  share free to reach 0 and 1 traded one side for the other; a fixed share of 0.02 was within
  0.5 point of ``tinylfu`` where it wins and 5 points behind ``lru`` on fast drift;
- Caffeine's hill climbing on the hit ratio of consecutive samples: rejected before (the
  sample-to-sample noise of a hit ratio in bytes, sizes spread 64x, exceeded a step's effect);
- LeCaR-like regret needs each expert's own evictions; here both experts share one eviction
  order, so what differs is which keys each would hold: a duel of shadow caches (this
  policy). Two lists of keys, one per expert, each as many entries as the cache holds,
  decayed hit counts, the expert whose shadow hits more answers. Measured on the 44 cells
  (seed 1; lead: points over the best of ``lru``, ``tinylfu`` and the paged pool): the old
  ``adaptive`` was more than 0.3 point behind on 31 cells (mean lead -1.17); the duel with
  ``favour`` 1.0 and ``decay`` 0.5 on 22 (-0.40), 1.02 and 0.6 on 20 (-0.46), 1.02 and 0.7 on
  20 (-0.37: chosen). ``favour`` 1.05 or 1.1 lost up to 5.8 points to ``lru`` on fast drift; a
  hysteresis (switch when one side leads by 5%) stuck to LRU on slow drift (-3.3 points);
  choosing the expert only at a period's end (a cheaper hit) lost 2.4 and 3.8 points on drift
  every 100 requests at skew 1.2. No variant led the best contender by a point on any cell:
  the duel at best follows the better expert, it does not beat it.
Tried next (``bench_policy_grid --variant`` against the stored runs, 2 seeds, grid and five
mixes: ``benchmarks/policy/results/variants_2026-12-03.md``), none kept:
- sampled shadows (keys chosen by hash, as SHARDS samples, to cheapen the hit path): with at
  least 128 sampled keys 22 cells behind (-0.41 mean lead), with 64 or 32 worse (24, 34): the
  grid's caches hold 150-500 entries, too few to sample; and the hit path could not reach
  1.1x ``lru``'s anyway: ``tinylfu``'s count alone is 1.099x (callgrind, instructions of an
  8-item all-hit request; ``adaptive`` 1.230x, sampled 1 key in 4: 1.191x);
- switching to the LRU expert on a detected shift (resetting the filter shadow's hits, or
  both shadows', or no shadows and LRU for 1-10 x entries lookups after a shift): worse (the
  detector misses the low-skew reshuffles: -6 points on 1GiB drift 100 z0.6); ``favour``
  1.0 (19 cells behind, mean -0.33) or ``decay`` 0.8 (23, -0.39) about today's, ``favour``
  0.98 (22, -0.78) and ``decay`` 0.5 (24, -0.45) worse;
- shadows that hold bytes, not entries, with hits weighed by bytes, as the real pool holds
  and saves (``benchmarks.policy.oracle_shadows``): with every item's bytes and the pool's
  capacity given (an oracle) 16 cells behind, mean lead -0.25, worst -1.06 (today 20, -0.37,
  -2.61), the five mixes' worst -2.39 to -1.02; still no cell a point ahead. Both halves
  matter (byte capacities with counted hits: -0.42; entries with weighed hits: -0.55). A
  policy cannot build it: ``record`` gets no size, and sizes learned from ``admit`` (only
  inserts that must evict reach it) left the entries stored before the pool filled unknown,
  the capacity estimated 1.8x too big and scan 10 points behind. With ``record(key, nbytes)``
  from the core (the capacity then the bytes of the resident entries) the oracle measured 15
  cells behind, mean -0.26, worst -1.82 (1GiB scan): the change to ask for first.
The doorkeeper (session 16, kept). On the server benchmark's scan mix the original PR's
first-fit controller, which refuses large inserts by accident, re-encoded fewer images than
``adaptive`` (replayed without threads, ``benchmarks.server.replay``: ``adaptive`` 1.050x and
1.009x its encoder time on seeds 0 and 1), and the extra encodes were of small and middle
images (64 to 576 tokens: 3,030 encodes against 2,614 on seed 0) while large ones came out
even: the pool held one-off images that the filter let in because their victims' counts had
aged to 0 (the filter is asked only when an insert must evict, and "a count above each
victim's" is 1 > 0 for a key seen once). Tried in the replay first, none of which helped:
GreedyDual-Size-Frequency as the eviction order (worse on every mix: steady 1.02-1.09x, scan
1.05-1.09x), shadows in bytes with hits weighed by bytes or by encoder cost (no better than
today's), a size cap on admission (hurts steady and drift, scan unchanged). What helped is
TinyLFU's own doorkeeper: a key must have been looked up twice to displace anything. It is
played in the filter's shadow as well (else the duel misjudges the filter on fast drift), and
sleeps for max(resident, ``min_entries``) lookups after a detected shift: always awake, fast
drift gained (the duel turns to LRU sooner) but slow drift lost 1 to 2.4 points (each new
favourite one more miss after every reshuffle); asleep until the next halving, the scans, which
the detector also takes for shifts, went through with the doorkeeper asleep (the server's scan
gain gone). Sleeps of 0.5x, 0.75x, 1x and 3x the entries were measured (on the variant below),
1x chosen: the grid's and the five mixes' best. Rerun with every contender
(``benchmarks/policy/results/{grid,five}_doorkeeper.md``, 2 seeds each; lead over the best
other contender, the old ``adaptive`` against the same contenders in brackets): grid mean lead
-0.31 (-0.44), worst -1.16 (-2.68), 24 cells more than 0.3 behind (22), 1 a point ahead (0);
five mixes mean -0.04 (-0.55), worst -0.95 (-2.49), 4 behind (5), 1 ahead (0). Server replay,
encoder time against the original PR, seeds 0 / 1: steady 0.902 / 0.927 (0.908 / 0.948),
drifting 0.664 / 0.668 (0.659 / 0.666), scan 1.029 / 0.987 (1.050 / 1.009); ``adaptive-work``
scan 1.029 / 0.991 (1.077 / 1.052). A variant that skips the shadow's trim when the doorkeeper
refuses (so the filter's shadow may stay longer than the residents after they shrink) measured
better still against the stored runs (grid 18 behind, mean -0.20, where the kept rule gave 21,
-0.27; five mixes 3, -0.11, against 5, -0.22), but breaks the shadows' stated bound: not kept.
Shadows count entries, not bytes (``record`` gets no size), and share the real counts.
Cost model of ``tinylfu`` and ``adaptive``: every lookup of a cached key saves one encoder run
of that key; admission compares lookups per key (the filter) and hits per shadow entry (the
duel), not encoder time per byte.

Design notes on ``adaptive-work`` (issue 41, point 2; ``benchmarks.policy.cost_grid``, where
each image's encoder work is its tokens x a factor log-uniform in [1/4, 4], its bytes
unchanged). Cost model: a hit of k saves work(k) encoder seconds, holding k costs its aligned
bytes b(k), so with f(k) its recent lookups k is worth f(k) x work(k) / b(k) per byte, and the
filter admits a candidate only if its worth is above each victim's (with work proportional to
bytes: ``tinylfu``'s rule). As an oracle that reads each image's work from the workload
(``adaptive-cost``), this led the best contender by +0.47 point on average on the grid (a
point or more on 14 of 44 cells) and by +0.64 on the five mixes; the same rule given tokens in
place of work saved what ``adaptive`` saves: the gain is the information. The product cannot
read the future: work is measured when a key is encoded (the encode pipeline times each
encoder call and shares it among the call's items by rows), admission comes at ``BeginLoad``,
before the candidate is encoded (a pipeline reserves its misses at lookup), so the policy
prices a key by what it remembers of it, else by the running mean seconds per byte. What to
remember was measured (five mixes, simulated with only reservations inserted, one hash seed,
mean work saved: ``adaptive`` 52.34, the oracle 53.61): the present keys' work and the freed
keys' (as many ghosts as entries) 52.70; with 4 ghosts an entry 52.86; with the work of outputs
encoded but not cached (refused, no space: the pipeline inserts every output it encoded, and
the core tells the policy) 53.08, and both 53.38: kept (``GHOSTS`` = 4, about 0.65 KB more
metadata an entry than ``adaptive``). Measured as the pipeline drives it
(``benchmarks/policy/results/cost_*_2026-12-03-real.md``): the grid's mean work saved 50.69
(``adaptive`` 50.04, the oracle 51.01), a point or more ahead of the best contender on 9 of 44
cells, more than 0.3 behind on 15 (fast drift, as ``adaptive``); the five mixes 53.52 (52.19,
53.70), 4 of 10 a point ahead, 1 behind (docs/benchmarks.md).
"""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from embcache.core.entries import ItemLike
from embcache.core.recency import RecencyOrder, ResidentOrder
from embcache.core.sketch import DEPTH, MAX_COUNTER, Footprint, FrequencySketch, next_power_of_two
from embcache.errors import InvalidArgumentError, InvalidTypeError

_T = TypeVar("_T")

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # installed with mypy; only the compiled build (mypyc) reads the decorator

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[_T], _T]:
        return lambda cls: cls


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


class WorkPolicy(Policy, Protocol):
    """A policy that uses measured encoder work: at the end of an insert given its outputs'
    encoder seconds, the core calls ``note_work`` for each output now cached and
    ``note_encoded`` for each other one (a policy without ``records_work`` True is never
    called, and every caller may pass no work)."""

    records_work: bool

    def note_work(self, key: str, seconds: float, nbytes: int) -> None:
        """The entry of ``key`` (``nbytes`` of pool) is READY; its encoder output took
        ``seconds`` to compute (finite, >= 0)."""

    def note_encoded(self, key: str, seconds: float, nbytes: int) -> None:
        """``key``'s output (``nbytes`` aligned) took ``seconds`` but is not cached."""


class LruPolicy:
    """Least recently used first; admits every insert (the seed's behaviour)."""

    name = "lru"
    records_lookups = False
    records_work = False

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


def _open_fraction_knob(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0 < value < 1:
        raise InvalidArgumentError(f"{name} must be in (0, 1), got {value}")
    return float(value)


def _range_knob(name: str, value: object, top: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0 <= value <= top:
        raise InvalidArgumentError(f"{name} must be in [0, {top:g}], got {value}")
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
    shrinks), and for resident keys exact counts (a dict of at most the resident keys; see the
    module's design notes). ``record`` O(1) amortised (a halving is O(width + resident), once
    per sample); ``admit`` O(victims).
    """

    name = "tinylfu"
    records_lookups = True
    records_work = False  # True: ``note_work`` is kept, and the core calls it (WorkPolicy)
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
        if count:
            self._block_sum += count
            self._block_seen += 1
        self._left -= 1
        if not self._left:
            self._tick()

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


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled: the tests' planted bugs extend it
class AdaptivePolicy(TinyLfuPolicy):
    """``tinylfu``'s counts, and two experts on admission that duel in shadow: ``lru`` (admit
    every insert) and TinyLFU's filter. ``admit`` answers as the expert whose shadow cache has
    had more hits lately.

    Each expert has a shadow: the keys (no bytes, no entry) that a cache of max(resident
    entries, ``min_entries``) entries would hold had it followed that expert alone, newest
    last. Every lookup plays in both: a key in a shadow is that shadow's hit (and its newest
    key); a key not in it enters it, the LRU shadow dropping its oldest key, the filter's
    dropping its oldest only if the key's count is above that key's (else the key is refused
    there). Each shadow's hits are multiplied by ``decay`` at the end of every period of
    max(resident, ``min_entries``) lookups; after every lookup, the filter answers if its
    shadow's hits x ``favour`` >= the LRU shadow's, else every insert is admitted. Shadows
    count entries, not bytes: the policy sees an entry's bytes only when asked to admit it.

    The filter has a doorkeeper: a key looked up fewer than ``DOORKEEPER`` (2) times recently,
    this lookup counted, displaces nothing, in ``admit`` and in the filter's shadow alike
    (a one-off image never evicts a victim, however stale), except while the doorkeeper
    sleeps: for the max(resident, ``min_entries``) lookups counted from a detected shift,
    when every count was just cleared and the new favourites have been seen once or twice
    (module notes: one cache's worth of lookups measured best).
    Cost model: a hit saves one encoder run of its key, whatever its bytes (module notes).
    ``record`` O(1) amortised, ``admit`` O(victims); memory: 2 x max(resident,
    ``min_entries``) shadow keys (``footprint().ghosts``).
    """

    name = "adaptive"
    DOORKEEPER = 2  # lookups a key needs before it may displace anything under the filter

    def __init__(  # object: checked here, also when compiled (see make_policy)
        self,
        sample_factor: object = 10,
        min_entries: object = 16,
        max_count: object = 15,
        shift_block: object = 50,
        shift_drop: object = 0.6,
        decay: object = 0.7,
        favour: object = 1.02,
    ) -> None:
        super().__init__(sample_factor, min_entries, max_count, shift_block, shift_drop)
        self._decay = _open_fraction_knob("decay", decay)
        self._favour = _range_knob("favour", favour, 2.0)
        if self._favour < 0.5:
            raise InvalidArgumentError(f"favour must be in [0.5, 2], got {favour}")
        self._lru_shadow: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._filter_shadow: OrderedDict[str, None] = OrderedDict()
        self._lru_hits = self._filter_hits = 0.0  # each shadow's hits, decayed every period
        self._period_left = self._min_entries  # lookups until the period ends
        self.use_filter = True  # the expert admit follows now
        self.switches = 0
        self._quiet_until = 0  # the doorkeeper sleeps until this many lookups (a shift's)

    def shadow_hits(self) -> tuple[float, float]:
        """The LRU shadow's and the filter shadow's hits, as decayed so far. O(1)."""
        return self._lru_hits, self._filter_hits

    def record(self, key: str) -> None:
        """Count one lookup of ``key`` (``TinyLfuPolicy.record`` written out: this runs on
        every hit), play it in both shadows, and follow the shadow with more hits."""
        count = self._counts.get(key)
        if count is None:
            count = self._count_resident(key) if key in self._resident else self._sketch.add(key)
        elif count < self._max_count:
            self._counts[key] = count + 1
        if count:
            self._block_sum += count
            self._block_seen += 1
        self._left -= 1
        if not self._left:
            self._tick()
        try:  # a hit in the shadow (the common case: no membership test first)
            self._lru_shadow.move_to_end(key)
            self._lru_hits += 1.0
        except KeyError:
            self._enter_lru_shadow(key)
        try:
            self._filter_shadow.move_to_end(key)
            self._filter_hits += 1.0
        except KeyError:
            self._enter_filter_shadow(key)
        self._period_left -= 1
        if not self._period_left:
            self._lru_hits *= self._decay
            self._filter_hits *= self._decay
            self._period_left = self._entries()
        use_filter = self._filter_hits * self._favour >= self._lru_hits
        if use_filter is not self.use_filter:
            self.use_filter = use_filter
            self.switches += 1

    def _enter_lru_shadow(self, key: str) -> None:
        """``key`` missed the LRU shadow: it enters as the newest; the oldest keys beyond the
        entries leave."""
        lru, cap = self._lru_shadow, self._entries()
        lru[key] = None
        while len(lru) > cap:
            lru.popitem(last=False)

    def _enter_filter_shadow(self, key: str) -> None:
        """``key`` missed the filter's shadow: it enters if there is room, or if its count is
        above the oldest key's (which leaves); the shadow then trims to the entries."""
        shadow, cap = self._filter_shadow, self._entries()
        if len(shadow) < cap:
            shadow[key] = None
            return
        oldest = next(iter(shadow))
        if self._past_doorkeeper(key) and self.worth(key) > self.worth(oldest):
            del shadow[oldest]
            shadow[key] = None
        while len(shadow) > cap:
            shadow.popitem(last=False)

    def _past_doorkeeper(self, key: str) -> bool:
        """Whether ``key`` may displace anything under the filter: looked up at least
        ``DOORKEEPER`` times recently (this lookup counted), or the doorkeeper sleeps: for
        max(resident, ``min_entries``) lookups after a detected shift. O(1)."""
        return self.estimate(key) >= self.DOORKEEPER or self.lookups() < self._quiet_until

    def _shifted(self) -> None:
        """A detected shift puts the doorkeeper to sleep for max(resident, ``min_entries``)
        lookups, counted from this one (already ticked)."""
        self._quiet_until = self._ticked + self._entries()

    def worth(self, key: str) -> float:
        """What the filter ranks ``key`` by: its recent lookups (``estimate``). O(1)."""
        return self.estimate(key)

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """True under the LRU expert; under the filter, past the doorkeeper and the filter's
        answer. O(victims)."""
        if not self.use_filter:
            return True
        return self._past_doorkeeper(key) and super().admit(key, nbytes, victims)

    def footprint(self) -> Footprint:
        """What this policy keeps now, each container counted (ghosts: both shadows' keys).
        O(1)."""
        ghosts = len(self._lru_shadow) + len(self._filter_shadow)
        return Footprint(self._sketch.nbytes, len(self._resident), len(self._counts), ghosts)

    def shadow_keys(self) -> tuple[list[str], list[str]]:
        """The keys of the LRU shadow and of the filter's, oldest first: copies. O(entries)."""
        return list(self._lru_shadow), list(self._filter_shadow)

    def bound(self, entries: int) -> Footprint:
        """``TinyLfuPolicy.bound``, and 2 x max(``entries``, ``min_entries``) shadow keys. O(1)."""
        shadows = 2 * max(entries, self._min_entries)
        return Footprint(super().bound(entries).sketch_bytes, entries, entries, shadows)


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled: the tests' planted bugs extend it
class WorkAdaptivePolicy(AdaptivePolicy):
    """``adaptive`` whose filter (and the filter's shadow) ranks keys by their worth per byte
    of pool: recent lookups x measured encoder seconds per byte (behind ``adaptive``'s
    doorkeeper, which counts lookups alone).

    Cost model: a hit of key k saves one encoder run of k, ``work(k)`` seconds as measured the
    last time k was encoded here (the driver's measure: the encode pipeline times each encoder
    call and shares a call's seconds among its items by rows, i.e. it assumes one call costs
    the same per row for every item in it); holding k costs its aligned bytes ``b(k)``. With
    ``f(k)`` its recent lookups (``estimate``), k is worth f(k) x work(k) / b(k) per byte, and
    under the filter expert a candidate displaces its victims only if its worth is above each
    victim's (strictly; with work proportional to bytes this is ``tinylfu``'s rule). A key
    with no remembered work is taken to cost the running mean seconds per byte of every
    encoding measured here (a mean of the per-item values: the plain mean of the first
    ``MEAN_WINDOW``, then a moving mean of weight 1 / ``MEAN_WINDOW``). Before any
    measurement every key costs the same, and the policy is ``adaptive`` exactly (as it stays
    when no caller passes work: the SGLang adapter, the vLLM connector, ``insert`` without
    ``work``). Admission happens at ``BeginLoad``, before the candidate is encoded (a pipeline
    reserves its misses at lookup), so a candidate's own work is what is remembered of it (an
    earlier encoding), else the mean.

    What is remembered: ``note_work`` (the core, at the EndLoad of a fresh output that became
    READY) keeps a present key's seconds per byte until ``forget``, which moves it among the
    ghosts; ``note_encoded`` (the core, for an output given with its work that was not
    cached: refused, no space, present already as another load) puts it among the ghosts
    directly. Ghosts are the ``GHOSTS`` x max(resident, ``min_entries``) most recently
    noted, oldest dropped first. Memory: at most entries + ``GHOSTS`` x max(entries,
    ``min_entries``) keys and floats (``footprint().work`` and ``work_ghosts``, ``bound``).
    ``note_work``,
    ``note_encoded`` O(1) amortised; ``record`` as ``adaptive``'s; ``admit`` O(victims).
    """

    name = "adaptive-work"
    records_work = True
    MEAN_WINDOW = 1024  # measurements in the running mean's window
    GHOSTS = 4  # ghosts per entry (1: -0.1 to -0.5 point on steady and scan, cost_grid --five)

    def __init__(  # object: checked here, also when compiled (see make_policy)
        self,
        sample_factor: object = 10,
        min_entries: object = 16,
        max_count: object = 15,
        shift_block: object = 50,
        shift_drop: object = 0.6,
        decay: object = 0.7,
        favour: object = 1.02,
    ) -> None:
        super().__init__(sample_factor, min_entries, max_count, shift_block, shift_drop, decay,
                         favour)  # fmt: skip
        self._work: dict[str, float] = {}  # present keys noted -> seconds per byte
        self._ghost_work: OrderedDict[str, float] = OrderedDict()  # not present, oldest first
        self._mean = 1.0  # seconds per byte of a key with no remembered work (1.0: none yet)
        self._measured = 0

    def note_work(self, key: str, seconds: float, nbytes: int) -> None:
        """The entry of ``key`` (``nbytes`` of pool, > 0) is READY, its encoding measured at
        ``seconds`` (finite, >= 0: the driver checks). O(1)."""
        per_byte = self._measure(seconds, nbytes)
        self._ghost_work.pop(key, None)
        self._work[key] = per_byte

    def note_encoded(self, key: str, seconds: float, nbytes: int) -> None:
        """``key`` (``nbytes`` aligned, > 0) was encoded in ``seconds`` but is not cached: it
        becomes the newest ghost. O(1) amortised."""
        self._haunt(key, self._measure(seconds, nbytes))

    def _measure(self, seconds: float, nbytes: int) -> float:
        """Seconds per byte of one encoding, counted into the running mean."""
        per_byte = seconds / nbytes
        self._measured += 1
        if self._measured == 1:
            self._mean = per_byte
        else:
            self._mean += (per_byte - self._mean) / min(self._measured, self.MEAN_WINDOW)
        return per_byte

    def _haunt(self, key: str, per_byte: float) -> None:
        """``key``'s work joins the ghosts as the newest; the oldest beyond ``GHOSTS`` x
        max(resident, ``min_entries``) leave."""
        ghosts, cap = self._ghost_work, self.GHOSTS * self._entries()
        ghosts.pop(key, None)
        ghosts[key] = per_byte
        while len(ghosts) > cap:
            ghosts.popitem(last=False)

    def work_per_byte(self, key: str) -> float:
        """``key``'s remembered encoder seconds per byte, else the running mean. O(1)."""
        per_byte = self._work.get(key)
        if per_byte is None:
            per_byte = self._ghost_work.get(key)
            if per_byte is None:
                return self._mean
        return per_byte

    def worth(self, key: str) -> float:
        """Recent lookups x encoder seconds per byte of ``key``. O(1)."""
        return self.estimate(key) * self.work_per_byte(key)

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """True under the LRU expert; else iff ``key``'s worth is above each victim's.
        O(victims)."""
        if not self.use_filter:
            return True
        if not self._past_doorkeeper(key):
            return False
        worth = self.worth
        mine = worth(key)
        return all(mine > worth(victim) for victim in victims)

    def forget(self, key: str) -> None:
        """``adaptive``'s ``forget``; ``key``'s work, if noted, joins the ghosts."""
        super().forget(key)
        per_byte = self._work.pop(key, None)
        if per_byte is not None:
            self._haunt(key, per_byte)

    def footprint(self) -> Footprint:
        """``adaptive``'s, and the keys whose work is remembered: present, and ghosts. O(1)."""
        mine = super().footprint()
        return Footprint(
            mine.sketch_bytes, mine.resident, mine.counts, mine.ghosts, len(self._work),
            len(self._ghost_work),
        )  # fmt: skip

    def bound(self, entries: int) -> Footprint:
        """``adaptive``'s, and the work of at most ``entries`` present keys and ``GHOSTS`` x
        max(``entries``, ``min_entries``) ghosts. O(1)."""
        mine = super().bound(entries)
        ghosts = self.GHOSTS * max(entries, self._min_entries)
        return Footprint(
            mine.sketch_bytes, mine.resident, mine.counts, mine.ghosts, entries, ghosts
        )


POLICIES: dict[str, Callable[..., Policy]] = {
    "lru": LruPolicy,
    "tinylfu": TinyLfuPolicy,
    "adaptive": AdaptivePolicy,
    "adaptive-work": WorkAdaptivePolicy,
}


def checked_work(work: object, items: Sequence[ItemLike]) -> list[tuple[str, float, int]] | None:
    """``work`` (None: unknown; else one encoder time in seconds per item of ``items``) as
    ``(key, seconds, nbytes)`` per item, what ``CacheCore.end_inserts`` takes; raises
    ``InvalidTypeError`` (not a sequence of numbers) or ``InvalidArgumentError`` (another
    length, a value negative or not finite). O(items)."""
    if work is None:
        return None
    if isinstance(work, str | bytes) or not isinstance(work, Sequence):
        raise InvalidTypeError(
            f"work must be a list of encoder seconds, one per item, got {type(work).__name__}"
        )
    if len(work) != len(items):
        raise InvalidArgumentError(
            f"work has {len(work)} values for {len(items)} items: give one each"
        )
    out: list[tuple[str, float, int]] = []
    for item, seconds in zip(items, work, strict=True):
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise InvalidTypeError(
                f"work must be numbers of seconds, got {type(seconds).__name__} {seconds!r}"
            )
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidArgumentError(
                f"work must be finite seconds >= 0, got {seconds}: pass the encoder's measured time"
            )
        out.append((item.key, float(seconds), item.nbytes))
    return out


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
