"""Reference models of ``embcache.core.policy``: lists and plain loops, each line obviously right.

The eviction order is a list (oldest first); counts are a dict rebuilt by comprehension; the
running mean of the shift detector is recomputed from the list of block means every time.
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
        self.counts: dict[str, int] = {}
        self.start_sample()

    def start_sample(self) -> None:
        """A new sample of lookups: its size from today's residents, no blocks yet."""
        self.sample = self.sample_factor * max(len(self.resident), self.min_entries)
        self.lookups = 0
        self.block: list[int] = []  # the counts that the block's keys had when looked up
        self.block_means: list[float] = []  # of the blocks ended since the sample started

    def order(self) -> ModelOrder:
        return ModelOrder(self.resident)

    def estimate(self, key: str) -> int:
        return self.counts.get(key, 0)

    def record(self, key: str) -> None:
        before = self.estimate(key)
        self.counts[key] = min(before + 1, self.max_count)
        self.lookups += 1
        if self.lookups == self.sample:
            self.counts = {k: c // 2 for k, c in self.counts.items() if c // 2 > 0}
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


MODELS = {"lru": ModelLru, "tinylfu": ModelTinyLfu}
