"""``adaptive``: ``tinylfu``'s counts, and admission by whichever of two experts (admit
everything, as ``lru``; or ``tinylfu``'s filter behind a doorkeeper) has had more hits lately
in a shadow cache of keys that follows it alone.

Contract. ``AdaptivePolicy`` extends ``TinyLfuPolicy`` (``embcache.core.policy_tinylfu``):
the order and the counts are its; ``record`` also plays each lookup in both shadows, and
``admit`` answers as the expert whose shadow leads. A key seen fewer than ``DOORKEEPER``
times recently displaces nothing under the filter, except for one cache's worth of lookups
after a detected shift. Each shadow holds at most max(resident entries, ``min_entries``)
keys (``bound``). Pure; the caller holds the cache lock; one policy object serves one cache.

Why the duel, the doorkeeper and the knobs' defaults, and what was measured and rejected:
docs/policies.md, "adaptive" and "The doorkeeper".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mypy_extensions import mypyc_attr

from embcache.core.policy_tinylfu import TinyLfuPolicy
from embcache.core.sketch import Footprint
from embcache.errors import InvalidArgumentError, InvalidTypeError


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
    (docs/policies.md, "The doorkeeper": one cache's worth of lookups measured best).
    Cost model: a hit saves one encoder run of its key, whatever its bytes (docs/policies.md).
    ``record`` O(1) amortised, ``admit`` O(victims); memory: 2 x max(resident,
    ``min_entries``) shadow keys (``footprint().ghosts``).
    """

    name = "adaptive"
    DOORKEEPER = 2  # lookups a key needs before it may displace anything under the filter

    def __init__(  # object: checked here, also when compiled (see policy.make_policy)
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
            count = self._count_resident(key) if self._is_resident(key) else self._sketch.add(key)
        elif count < self._max_count:
            self._counts[key] = count + 1
        if count:
            self._block_sum += count
            self._block_seen += 1
        self._left -= 1
        if not self._left:
            self._tick()
        # A membership test first, not a KeyError caught: a miss raised two exceptions (a cache
        # of 100k entries looked up at random: mostly shadow misses, 6k of 13k instructions).
        lru, shadow = self._lru_shadow, self._filter_shadow
        if key in lru:
            lru.move_to_end(key)
            self._lru_hits += 1.0
        else:
            self._enter_lru_shadow(key)
        if key in shadow:
            shadow.move_to_end(key)
            self._filter_hits += 1.0
        else:
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
        return Footprint(self._sketch.nbytes, self._residents(), len(self._counts), ghosts)

    def shadow_keys(self) -> tuple[list[str], list[str]]:
        """The keys of the LRU shadow and of the filter's, oldest first: copies. O(entries)."""
        return list(self._lru_shadow), list(self._filter_shadow)

    def bound(self, entries: int) -> Footprint:
        """``TinyLfuPolicy.bound``, and 2 x max(``entries``, ``min_entries``) shadow keys. O(1)."""
        shadows = 2 * max(entries, self._min_entries)
        return Footprint(super().bound(entries).sketch_bytes, entries, entries, shadows)
