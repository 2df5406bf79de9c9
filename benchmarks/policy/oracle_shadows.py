"""``adaptive`` with shadows sized in bytes: an oracle that measures what sizes would be worth.

Run it in place of ``adaptive`` on a stored grid (``bench_policy_grid --variant
benchmarks.policy.oracle_shadows:ByteShadows --against JSON``; ``--five`` for the five mixes).
It reads what no policy is told today, each item's bytes and the pool's, from the workload
(``ORACLE``: ``bench_policy_grid.variant_saved`` then makes it with the workload and the pool's
capacity). It measures the change that issue 41's notes guessed at, shadows that count bytes
and not entries, before the core is asked to tell a policy an item's bytes at every lookup
(``record``) and the pool's capacity: the design is in docs/policies.md.

Each shadow holds keys up to the pool's bytes (aligned sizes), oldest first. The LRU shadow
takes every key looked up, dropping its oldest until the bytes fit; the filter's shadow takes a
key only if its count is above that of each key it would displace (its oldest, until the key
fits), as the real filter answers ``admit``. A shadow hit adds the key's bytes (a proxy for the
tokens a hit saves); hits decay and the experts duel as in ``AdaptivePolicy``. Not a policy to
ship: it keeps a size per key of the catalogue.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from embcache.core.policy import AdaptivePolicy, TinyLfuPolicy
from tests.support import mixes


class ByteShadows(AdaptivePolicy):
    """``AdaptivePolicy`` whose shadows hold bytes, with sizes and capacity known in advance."""

    ORACLE: ClassVar[bool] = True  # made with (workload, capacity), not with no arguments

    def __init__(self, workload: mixes.Workload, capacity: int) -> None:
        super().__init__()
        self._bytes_of = {spec.key: mixes.aligned(spec.nbytes) for spec in workload.specs}
        self._capacity = capacity
        self._lru_bytes = self._filter_bytes = 0
        self._lru_sized: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest first
        self._filter_sized: OrderedDict[str, int] = OrderedDict()

    def record(self, key: str) -> None:
        """Count the lookup (``TinyLfuPolicy.record``), play it in both byte shadows, and
        follow the shadow whose hits, in bytes, are more."""
        TinyLfuPolicy.record(self, key)
        size = self._bytes_of[key]
        if key in self._lru_sized:
            self._lru_sized.move_to_end(key)
            self._lru_hits += size
        else:
            self._enter_lru_sized(key, size)
        if key in self._filter_sized:
            self._filter_sized.move_to_end(key)
            self._filter_hits += size
        else:
            self._enter_filter_sized(key, size)
        self._period_left -= 1
        if not self._period_left:
            self._lru_hits *= self._decay
            self._filter_hits *= self._decay
            self._period_left = self._entries()
        use_filter = self._filter_hits * self._favour >= self._lru_hits
        if use_filter is not self.use_filter:
            self.use_filter = use_filter
            self.switches += 1

    def _enter_lru_sized(self, key: str, size: int) -> None:
        shadow = self._lru_sized
        shadow[key] = size
        self._lru_bytes += size
        while self._lru_bytes > self._capacity:
            self._lru_bytes -= shadow.popitem(last=False)[1]

    def _enter_filter_sized(self, key: str, size: int) -> None:
        shadow, room = self._filter_sized, self._capacity - self._filter_bytes
        victims: list[str] = []
        for victim, victim_size in shadow.items():
            if room >= size:
                break
            victims.append(victim)
            room += victim_size
        if room < size:
            return  # larger than the pool
        count = self.estimate(key)
        if all(count > self.estimate(victim) for victim in victims):
            for victim in victims:
                self._filter_bytes -= shadow.pop(victim)
            shadow[key] = size
            self._filter_bytes += size

    def shadow_bytes(self) -> tuple[int, int]:
        """The bytes each shadow holds (LRU, filter). O(1)."""
        return self._lru_bytes, self._filter_bytes
