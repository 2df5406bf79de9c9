"""``EvictionIndex`` chooses exactly what ``choose_victims`` chooses fed the whole eviction order
(and, on small pools, what the brute-force reference ``models.eviction`` chooses), search after
search, while entries are pinned, released, freed, inserted and evicted between searches as the
core does them; and it examines fewer candidates than the scan on a pool that keeps evicting."""

from __future__ import annotations

import random

import pytest

from embcache.core.allocator import BestFitAllocator, Block
from embcache.core.entries import Entry
from embcache.core.eviction import EvictionIndex, choose_victims
from embcache.core.recency import RecencyOrder
from models import eviction as reference

ALIGN = 256


class Pool:
    """The core's eviction state in miniature: an allocator, the entries, the order (the
    evictable ones) and the index, changed as ``embcache.core.actions`` changes them."""

    def __init__(self, units: int, max_batch: int, index: bool = True) -> None:
        self.allocator = BestFitAllocator(units * ALIGN, ALIGN)
        self.order = RecencyOrder()
        self.entries: dict[str, Entry] = {}
        self.max_batch = max_batch
        self.index = EvictionIndex(self.allocator, self.order, self.entries, max_batch)
        self.use_index = index
        self.made = 0
        self.scanned = 0  # candidates the scan was fed, over every search
        self.searches = 0

    def expected(self, need: int) -> tuple[tuple[int, ...], int, int, int] | None:
        """What the scan chooses over the whole order (counting the candidates it is fed)."""
        fed: list[Block] = []

        def candidates():  # type: ignore[no-untyped-def]
            for key in self.order:
                entry = self.entries[key]
                fed.append(Block(entry.offset, entry.size, False))
                yield fed[-1]

        a = self.allocator
        window = choose_victims(need, candidates(), self.max_batch, a.block_before, a.block_at)
        self.scanned += len(fed)
        return None if window is None else tuple(window)  # type: ignore[return-value]

    def search(self, need: int, brute: bool) -> list[str] | None:
        """The index's choice, checked against the scan (and the reference when ``brute``)."""
        self.searches += 1
        want = self.expected(need)
        if brute:
            layout = sorted(
                [(o, s, False) for o, s in self.allocator.allocations()]
                + [(o, s, True) for o, s in self.allocator.free_blocks()]
            )
            offsets = [self.entries[key].offset for key in self.order]
            model = reference.choose_victims(need, offsets, self.max_batch, layout)
            assert want == (None if model is None else tuple(model))
        if not self.use_index:
            return None if want is None else [self.at(offset) for offset in want[0]]
        got = self.index.search(need)
        assert (None if got is None else tuple(got[0])) == want, need
        if got is None:
            return None
        keys = [entry.key for entry in got[1]]
        assert keys == [self.at(offset) for offset in got[0].victims]
        return keys

    def at(self, offset: int) -> str:
        return next(key for key, entry in self.entries.items() if entry.offset == offset)

    def free(self, key: str) -> None:
        entry = self.entries.pop(key)
        self.order.discard(key)
        size = self.allocator.free(entry.offset)
        self.index.gone(entry.offset, size, False)

    def insert(self, units: int, brute: bool) -> str | None:
        """A new pinned entry of ``units``, evicting the victims the rule chooses if needed."""
        size = units * ALIGN
        offset = self.allocator.allocate(size)
        if offset is None:
            victims = self.search(size, brute)
            if victims is None:
                return None
            for key in victims:
                self.free(key)
            offset = self.allocator.allocate(size)
            assert offset is not None
        self.made += 1
        key = f"e{self.made}"
        self.entries[key] = Entry(key, (size,), "uint8", offset, size)
        return key


def run(seed: int, units: int, max_batch: int, steps: int, brute: bool) -> Pool:
    rng = random.Random(seed)
    pool = Pool(units, max_batch)
    for _ in range(steps):
        pinned = [key for key in pool.entries if key not in pool.order]
        roll = rng.random()
        if roll < 0.35:
            pool.insert(rng.choice([1, 1, 2, 3, 5, 8]), brute)
        elif roll < 0.6 and pinned:
            pool.order.add(rng.choice(pinned))  # its last pin released: the newest candidate
        elif roll < 0.72 and pool.order:
            pool.order.discard(rng.choice(list(pool.order)))  # pinned again (a hit)
        elif roll < 0.78 and pinned:
            pool.free(rng.choice(pinned))  # doomed, removed or fenced while pinned
        elif roll < 0.82 and pool.order:
            pool.free(rng.choice(list(pool.order)))  # removed while idle
        else:
            pool.search(rng.randint(1, units // 3 + 1) * ALIGN, brute)  # a search, no eviction
    return pool


@pytest.mark.parametrize("seed", range(30))
def test_same_victims_as_the_scan_and_the_reference_on_small_pools(seed: int) -> None:
    pool = run(seed, units=24, max_batch=1 + seed % 4, steps=300, brute=True)
    assert pool.searches > 50


@pytest.mark.parametrize("seed", range(6))
def test_same_victims_as_the_scan_on_larger_pools(seed: int) -> None:
    pool = run(seed, units=400, max_batch=(3, 8, 100)[seed % 3], steps=2_000, brute=False)
    assert pool.searches > 200


def test_examines_fewer_candidates_than_the_scan_on_a_pool_that_keeps_evicting() -> None:
    rng = random.Random(7)
    pool = Pool(600, 100)
    open_keys: list[str] = []
    for _ in range(3_000):
        key = pool.insert(rng.choice([1, 2, 3, 5, 8, 13]), brute=False)
        if key is not None:
            open_keys.append(key)
        if len(open_keys) > 4:  # a few requests hold their entries; the rest are idle
            pool.order.add(open_keys.pop(0))
    assert pool.index.searches > 500
    per_search = pool.index.examined / pool.index.searches
    print(per_search, pool.index.walked / pool.index.searches, pool.scanned / pool.searches)
    assert per_search * 2 < pool.scanned / pool.searches, (per_search, pool.scanned)


def evict_through_a_cache(monkeypatch: pytest.MonkeyPatch, index_from: int) -> list[object]:
    """A real cache (lru, 64 KiB) fed 1,500 requests of one fresh item of 1-17 units each,
    some held open across the next requests (pinned entries: barriers); with the core's
    threshold for the index at ``index_from``. Returns what it evicted and what it holds."""
    import torch

    from embcache import EmbeddingCache, Item
    from embcache.core import state

    monkeypatch.setattr(state, "INDEX_FROM", index_from)
    rng = random.Random(56)
    seen: list[object] = []
    with EmbeddingCache(64 << 10, pin_memory=False, policy="lru") as cache:
        held = []
        for n in range(1_500):
            nbytes = rng.randint(1, 17) * ALIGN - rng.randint(0, ALIGN - 1)
            request = cache.request(f"r{n}")
            request.lookup([Item(f"k{n}", (nbytes,), torch.uint8)])
            request.insert([f"k{n}"], [torch.zeros((nbytes,), dtype=torch.uint8)])
            held.append(request)
            if len(held) > 3 or rng.random() < 0.5:
                held.pop(rng.randrange(len(held))).close()
            stats = cache.stats()
            seen.append((stats.evictions, stats.evicted_bytes, stats.entries))
        for request in held:
            request.close()
        cache.check_invariants()
        snapshot = cache.snapshot()
        entries = snapshot.entries
        seen.append(sorted((key, entries[key].offset) for key in entries))
        seen.append(snapshot.eviction_order)
    return seen


def test_the_core_with_the_index_evicts_what_it_evicts_with_the_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The core searching with the index from its first candidate (``INDEX_FROM`` 0) and with
    the scan only (a threshold no pool reaches): the same evictions, request after request,
    and the same entries at the end."""
    indexed = evict_through_a_cache(monkeypatch, 0)
    scanned = evict_through_a_cache(monkeypatch, 1 << 40)
    assert indexed == scanned
    assert indexed[-3][0] > 1_000  # type: ignore[index]  # (evictions: the pool churned)
