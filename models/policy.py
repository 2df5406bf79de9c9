"""Reference models of ``embcache.core.policy``: lists and plain loops, each line obviously right.

The eviction order is a list (oldest first); counts are a count-min sketch kept as a list of
rows of ints, each key's counter in row ``r`` at ``(hash + r * step) % width``, except those of
resident keys looked up while resident: exact, in a dict, written back when forgotten; the
running mean of the shift detector is recomputed from the list of block means every time; ghosts
are a list, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


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
        mean = sum(self.block) / len(self.block)
        self.block = []
        if self.block_means and mean < self.shift_drop * self.running_mean():
            self.sketch.clear()
            self.counts = {}
            self.start_sample()
        else:
            self.block_means.append(mean)

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
    """The adaptive policy as its docstring says it: TinyLFU's counts and filter; a refused
    candidate is admitted when ``window`` x the bytes refused since the last such admission
    (minus the bytes that admission spent) reach its bytes; ghosts are a list of
    (key, last lookup, bytes, side), one per key (a new one replaces the key's old one), the
    oldest dropped beyond 2 x (horizon + 1) x max(resident, min_entries), pruned once per
    period."""

    name = "adaptive"

    def __init__(
        self,
        sample_factor: int = 10,
        min_entries: int = 16,
        max_count: int = 15,
        shift_block: int = 50,
        shift_drop: float = 0.6,
        window: float = 0.5,
        step: float = 0.1,
        low: float = 0.02,
        high: float = 0.98,
        horizon: int = 1,
    ) -> None:
        super().__init__(sample_factor, min_entries, max_count, shift_block, shift_drop)
        self.window, self.step, self.low, self.high = window, step, low, high
        self.horizon = horizon
        self.credit = 0.0
        self.now = 0
        self.ghosts: list[tuple[str, int, float, bool]] = []
        self.decided: list[tuple[bool, int]] = []  # (refused?, bytes) this period
        self.regrets: list[tuple[bool, float]] = []  # (refused?, bytes) settled this period
        self.period = min_entries

    def record(self, key: str) -> None:
        super().record(key)
        self.now += 1
        mine = [g for g in self.ghosts if g[0] == key]
        if mine:
            _, last, nbytes, refused = mine[0]
            self.ghosts = [g for g in self.ghosts if g[0] != key]
            if last >= self.now:
                self.regrets.append((refused, nbytes))
        self.period -= 1
        if self.period == 0:
            self.move()

    def move(self) -> None:
        refused = sum(n for side, n in self.decided if side)
        admitted = sum(n for side, n in self.decided if not side)
        if refused or admitted:
            against_filter = (
                sum(n for side, n in self.regrets if side) / refused if refused else 0.0
            )
            against_window = (
                sum(n for side, n in self.regrets if not side) / admitted if admitted else 0.0
            )
            if against_filter > against_window:
                self.window = min(self.window + self.step, self.high)
            elif against_filter < against_window:
                self.window = max(self.window - self.step, self.low)
        self.decided, self.regrets = [], []
        self.ghosts = [g for g in self.ghosts if g[1] >= self.now]
        self.period = self.entries()

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        if super().admit(key, nbytes, victims):
            return True
        self.credit += self.window * nbytes
        last = self.now + self.horizon * self.entries()
        if self.credit < nbytes:
            self.decided.append((True, nbytes))
            self.haunt((key, last, nbytes, True))
            return False
        self.credit -= nbytes
        self.decided.append((False, nbytes))
        for victim in victims:
            self.haunt((victim, last, nbytes / len(victims), False))
        return True

    def haunt(self, ghost: tuple[str, int, float, bool]) -> None:
        self.ghosts = [g for g in self.ghosts if g[0] != ghost[0]] + [ghost]
        while len(self.ghosts) > 2 * (self.horizon + 1) * self.entries():
            self.ghosts.pop(0)


MODELS = {"lru": ModelLru, "tinylfu": ModelTinyLfu, "adaptive": ModelAdaptive}
