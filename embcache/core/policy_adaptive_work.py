"""``adaptive-work``: ``adaptive`` whose filter weighs each key's recent lookups by its
measured encoder seconds per byte of pool (without measurements, ``adaptive`` exactly).

Contract. ``WorkAdaptivePolicy`` extends ``AdaptivePolicy`` (``embcache.core.policy_adaptive``)
and is a ``WorkPolicy`` (``embcache.core.policy``): at the end of an insert given its outputs'
encoder seconds the core calls ``note_work`` for each output now cached and ``note_encoded``
for each other one; the policy remembers the work of the present keys and of at most
``GHOSTS`` x max(resident entries, ``min_entries``) others (``bound``), and prices a key it
remembers nothing of at the running mean. Pure; the caller holds the cache lock; one policy
object serves one cache.

The cost model and what was measured: docs/policies.md, "adaptive-work".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mypy_extensions import mypyc_attr

from embcache.core.policy_adaptive import AdaptivePolicy
from embcache.core.sketch import Footprint


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
