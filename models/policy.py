"""Reference models of ``embcache.core.policy``: lists and plain loops, each line obviously right.

The eviction order is a list (oldest first); counts are a count-min sketch kept as a list of
rows of ints, each key's counter in row ``r`` at ``(hash + r * step) % width``, except those of
resident keys looked up while resident: exact, in a dict, written back when forgotten; the
running mean of the shift detector is recomputed from the list of block means every time; the
adaptive policy's shadows are lists, oldest first; ``adaptive-work``'s remembered work is a
dict of present keys, a list of ghosts (oldest first, trimmed) and a running mean.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class ModelOrder:
    """A list of keys, first victim first; add moves a key to the end."""

    def __init__(self, on_add: set[str] | None = None) -> None:
        self.keys: list[str] = []
        self.on_add = on_add

    def add(self, key: str) -> None:
        if key in self.keys:
            self.keys.remove(key)
        self.keys.append(key)
        if self.on_add is not None:
            self.on_add.add(key)

    def discard(self, key: str) -> bool:
        if key in self.keys:
            self.keys.remove(key)
            return True
        return False

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.keys))

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)


class ModelLru:
    name = "lru"

    def order(self) -> ModelOrder:
        return ModelOrder()

    def record(self, key: str) -> None:
        pass

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        return True

    def forget(self, key: str) -> None:
        pass

    def estimate(self, key: str) -> int:
        return 0


DEPTH = 4


class ModelSketch:
    """``DEPTH`` rows of ``width`` counters; a key's estimate is the least of its counters."""

    def __init__(self, max_count: int) -> None:
        self.max_count = max_count
        self.rows: list[list[int]] = [[0] for _ in range(DEPTH)]

    def columns(self, key: str) -> list[int]:
        width = len(self.rows[0])
        start = hash(key) % width
        step = (hash(key) >> 32) % width // 2 * 2 + 1  # odd
        return [(start + r * step) % width for r in range(DEPTH)]

    def estimate(self, key: str) -> int:
        return min(row[c] for row, c in zip(self.rows, self.columns(key), strict=True))

    def add(self, key: str) -> None:
        """Conservative update: no counter of the key ends below its new estimate."""
        after = min(self.estimate(key) + 1, self.max_count)
        for row, c in zip(self.rows, self.columns(key), strict=True):
            row[c] = max(row[c], after)

    def raise_to(self, key: str, count: int) -> None:
        """No counter of the key below ``count``."""
        for row, c in zip(self.rows, self.columns(key), strict=True):
            row[c] = max(row[c], count)

    def halve(self) -> None:
        self.rows = [[c // 2 for c in row] for row in self.rows]

    def clear(self) -> None:
        self.rows = [[0] * len(row) for row in self.rows]

    def grow(self, width: int) -> None:
        """Double every row (each repeated) until it has at least ``width`` counters."""
        while len(self.rows[0]) < width:
            self.rows = [row + row for row in self.rows]


class ModelTinyLfu:
    """TinyLFU as its docstring says it, step by step."""

    name = "tinylfu"
    SMOOTHING = 0.3

    def __init__(
        self,
        sample_factor: int = 10,
        min_entries: int = 16,
        max_count: int = 15,
        shift_block: int = 50,
        shift_drop: float = 0.6,
    ) -> None:
        self.sample_factor = sample_factor
        self.min_entries = min_entries
        self.max_count = max_count
        self.shift_block = shift_block
        self.shift_drop = shift_drop
        self.resident: set[str] = set()  # keys ever added to the order, not forgotten since
        # resident keys looked up since they became resident -> their exact counts
        self.counts: dict[str, int] = {}
        self.sketch = ModelSketch(max_count)
        self.start_sample()

    def entries(self) -> int:
        return max(len(self.resident), self.min_entries)

    def start_sample(self) -> None:
        """A new sample of lookups: its size from today's residents, no blocks yet; the
        sketch's rows at least 4 x as long as the sample (a power of two)."""
        self.sample = self.sample_factor * self.entries()
        width = 1
        while width < 4 * self.sample:
            width *= 2
        self.sketch.grow(width)
        self.lookups = 0
        self.block: list[int] = []  # the counts that the block's keys had when looked up
        self.block_means: list[float] = []  # of the blocks ended since the sample started

    def order(self) -> ModelOrder:
        return ModelOrder(self.resident)

    def estimate(self, key: str) -> int:
        if key in self.counts:
            return self.counts[key]
        return self.sketch.estimate(key)

    def record(self, key: str) -> None:
        before = self.estimate(key)
        if key in self.resident:
            self.counts[key] = min(before + 1, self.max_count)
        else:
            self.sketch.add(key)
        self.lookups += 1
        if self.lookups == self.sample:
            self.sketch.halve()
            self.counts = {k: c // 2 for k, c in self.counts.items()}
            self.start_sample()
            return
        if self.shift_drop == 0:
            return
        self.block.append(before)
        if len(self.block) < self.shift_block:
            return
        seen = [count for count in self.block if count > 0]  # first-seen keys left out
        self.block = []
        if not seen:
            return  # first-seen keys only: no evidence
        mean = sum(seen) / len(seen)
        if self.block_means and mean < self.shift_drop * self.running_mean():
            self.sketch.clear()
            self.counts = {}
            self.start_sample()
            self.shifted()
        else:
            self.block_means.append(mean)

    def shifted(self) -> None:
        """A shift was detected (the counts were just cleared)."""

    def running_mean(self) -> float:
        running = self.block_means[0]
        for mean in self.block_means[1:]:
            running = running + self.SMOOTHING * (mean - running)
        return running

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        return all(self.estimate(victim) < self.estimate(key) for victim in victims)

    def forget(self, key: str) -> None:
        self.resident.discard(key)
        if key in self.counts:
            self.sketch.raise_to(key, self.counts.pop(key))


class ModelAdaptive(ModelTinyLfu):
    """The adaptive policy as its docstring says it: TinyLFU's counts and filter, and two
    shadows (lists of keys, oldest first, at most max(resident, min_entries) long): the LRU
    shadow takes every key looked up, the filter's takes one only where there is room or its
    count is above the oldest key's; each shadow's hits decay at the end of every period of
    max(resident, min_entries) lookups; after every lookup, admit follows the filter if its
    hits x favour are at least the LRU shadow's, else admits everything. Under the filter a
    key must also pass the doorkeeper (looked up at least twice, this lookup counted) to
    displace anything, in admit and in the filter's shadow alike, except for the
    max(resident, min_entries) lookups that follow a detected shift (counted from it)."""

    name = "adaptive"

    def __init__(
        self,
        sample_factor: int = 10,
        min_entries: int = 16,
        max_count: int = 15,
        shift_block: int = 50,
        shift_drop: float = 0.6,
        decay: float = 0.7,
        favour: float = 1.02,
    ) -> None:
        super().__init__(sample_factor, min_entries, max_count, shift_block, shift_drop)
        self.decay, self.favour = decay, favour
        self.lru_shadow: list[str] = []
        self.filter_shadow: list[str] = []
        self.lru_hits = self.filter_hits = 0.0  # decayed every period
        self.period = min_entries
        self.use_filter = True
        self.looked_up = 0  # every lookup recorded
        self.asleep_until = 0  # the doorkeeper sleeps while looked_up < this

    def shifted(self) -> None:
        self.asleep_until = self.looked_up + self.entries()

    def past_doorkeeper(self, key: str) -> bool:
        return self.estimate(key) >= 2 or self.looked_up < self.asleep_until

    def record(self, key: str) -> None:
        self.looked_up += 1
        super().record(key)
        cap = self.entries()
        if key in self.lru_shadow:
            self.lru_hits += 1
            self.lru_shadow.remove(key)
            self.lru_shadow.append(key)
        else:
            self.lru_shadow = [*self.lru_shadow, key][-cap:]
        if key in self.filter_shadow:
            self.filter_hits += 1
            self.filter_shadow.remove(key)
            self.filter_shadow.append(key)
        elif len(self.filter_shadow) < cap:
            self.filter_shadow.append(key)
        else:
            oldest = self.filter_shadow[0]
            if self.past_doorkeeper(key) and self.shadow_rank(key) > self.shadow_rank(oldest):
                self.filter_shadow = [*self.filter_shadow[1:], key]
            self.filter_shadow = self.filter_shadow[max(len(self.filter_shadow) - cap, 0) :]
        self.period -= 1
        if self.period == 0:
            self.lru_hits *= self.decay
            self.filter_hits *= self.decay
            self.period = self.entries()
        self.use_filter = self.filter_hits * self.favour >= self.lru_hits

    def shadow_rank(self, key: str) -> float:
        """What the filter's shadow keeps the larger of: a key's count."""
        return self.estimate(key)

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        if not self.use_filter:
            return True
        return self.past_doorkeeper(key) and super().admit(key, nbytes, victims)


class ModelWorkAdaptive(ModelAdaptive):
    """``adaptive-work`` as its docstring says it: ``adaptive`` whose filter (``admit`` under
    the filter expert, and the filter's shadow) compares worth = estimate x seconds per byte;
    a key's seconds per byte is its last note while present, else its last among the ghosts
    (the ``ghosts`` x max(resident, min_entries) most recently noted keys not present: freed
    with a note, or encoded and not cached), else the running mean of every note (the plain
    mean of the first ``window`` notes, then a moving mean of weight 1 / ``window``; 1.0
    before any note)."""

    name = "adaptive-work"
    window = 1024
    ghosts = 4

    def __init__(self, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.work: dict[str, float] = {}  # present keys noted
        self.ghost: list[tuple[str, float]] = []  # oldest first
        self.mean = 1.0
        self.notes = 0

    def measure(self, seconds: float, nbytes: int) -> float:
        per_byte = seconds / nbytes
        self.notes += 1
        if self.notes == 1:
            self.mean = per_byte
        else:
            self.mean = self.mean + (per_byte - self.mean) / min(self.notes, self.window)
        return per_byte

    def haunt(self, key: str, per_byte: float) -> None:
        self.ghost = [(k, w) for k, w in self.ghost if k != key] + [(key, per_byte)]
        self.ghost = self.ghost[max(len(self.ghost) - self.ghosts * self.entries(), 0) :]

    def note_work(self, key: str, seconds: float, nbytes: int) -> None:
        per_byte = self.measure(seconds, nbytes)
        self.ghost = [(k, w) for k, w in self.ghost if k != key]
        self.work[key] = per_byte

    def note_encoded(self, key: str, seconds: float, nbytes: int) -> None:
        self.haunt(key, self.measure(seconds, nbytes))

    def work_per_byte(self, key: str) -> float:
        if key in self.work:
            return self.work[key]
        for k, w in self.ghost:
            if k == key:
                return w
        return self.mean

    def worth(self, key: str) -> float:
        return self.estimate(key) * self.work_per_byte(key)

    def shadow_rank(self, key: str) -> float:
        """``adaptive``'s record, with the filter's shadow taking a key by worth, not count."""
        return self.worth(key)

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        if not self.use_filter:
            return True
        if not self.past_doorkeeper(key):
            return False
        return all(self.worth(victim) < self.worth(key) for victim in victims)

    def forget(self, key: str) -> None:
        super().forget(key)
        if key in self.work:
            self.haunt(key, self.work.pop(key))


MODELS = {
    "lru": ModelLru,
    "tinylfu": ModelTinyLfu,
    "adaptive": ModelAdaptive,
    "adaptive-work": ModelWorkAdaptive,
}
