"""Baselines that reproduce the naive designs embcache replaces, for side-by-side benchmarks,
the fragmented state the allocator baselines are compared in (``half_freed``), and the pin
counts that baselines and simulations of the cache keep (``Pins``)."""

from __future__ import annotations

import math
import random
import threading
from collections import Counter, OrderedDict
from typing import Any

import torch
from sortedcontainers import SortedDict, SortedList

from embcache.driver.allocator import RangeAllocator


class Pins(Counter[str]):
    """Pins per key, only pinned keys kept (a missing key has 0). ``pin`` and ``release`` say
    when a key's first pin came and its last went: when it leaves and re-enters the recency
    structure of its holder (``ScanLRUCache``, ``bench_policy.Simulated``)."""

    def pin(self, key: str) -> bool:
        """One more pin of ``key``; whether it is its first."""
        self[key] += 1
        return self[key] == 1

    def release(self, key: str) -> bool:
        """One pin of ``key`` fewer; whether that was its last."""
        self[key] -= 1
        if self[key]:
            return False
        del self[key]
        return True


class NaiveAllocator:
    """First fit by linear scan of an address-sorted free list; free re-sorts and re-merges."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        self.alignment = alignment
        self.free_list: list[list[int]] = [[0, capacity]]
        self.allocated: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        size = -(-nbytes // self.alignment) * self.alignment
        for i, block in enumerate(self.free_list):
            if block[1] >= size:
                offset = block[0]
                if block[1] == size:
                    del self.free_list[i]
                else:
                    block[0] += size
                    block[1] -= size
                self.allocated[offset] = size
                return offset
        return None

    def free(self, offset: int) -> int:
        size = self.allocated.pop(offset)
        self.free_list.append([offset, size])
        self.free_list.sort()
        merged: list[list[int]] = []
        for block in self.free_list:
            if merged and merged[-1][0] + merged[-1][1] == block[0]:
                merged[-1][1] += block[1]
            else:
                merged.append(block)
        self.free_list = merged
        return size

    @property
    def largest_free_block(self) -> int:
        return max((b[1] for b in self.free_list), default=0)


class MinimalBestFit:
    """Best fit at its barest: free blocks in two sortedcontainers indexes (by offset, to
    coalesce; by (size, offset), to find the smallest fit), allocations in a dict. No argument
    checks, no lock, no invariant checks: the floor for ``RangeAllocator``'s cost."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        self.alignment = alignment
        self.by_offset = SortedDict({0: capacity})
        self.by_size = SortedList([(capacity, 0)])
        self.allocated: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        size = -(-nbytes // self.alignment) * self.alignment
        index = self.by_size.bisect_left((size, -1))
        if index == len(self.by_size):
            return None
        block, offset = self.by_size.pop(index)
        del self.by_offset[offset]
        if block > size:
            self.by_offset[offset + size] = block - size
            self.by_size.add((block - size, offset + size))
        self.allocated[offset] = size
        return int(offset)

    def free(self, offset: int) -> int:
        size = self.allocated.pop(offset)
        start, end = offset, offset + size
        index = self.by_offset.bisect_left(start)
        if index:
            before, before_size = self.by_offset.peekitem(index - 1)
            if before + before_size == start:
                del self.by_offset[before]
                self.by_size.remove((before_size, before))
                start = before
        after_size = self.by_offset.pop(end, None)
        if after_size is not None:
            self.by_size.remove((after_size, end))
            end += after_size
        self.by_offset[start] = end - start
        self.by_size.add((end - start, start))
        return size


class OriginalPRController:
    """The controller of the original pull request, re-implemented with SGLang's method names:
    first fit (``NaiveAllocator``), one recency ``OrderedDict`` of every entry (newest last),
    reference counts, one lock around each call. An insert that finds no fitting block evicts
    from the head of the recency list, skipping pinned entries, until enough bytes are free
    (whether or not they are adjacent), then allocates once and may still fail.

    No global store: ``prefetch`` and ``check_prefetch_progress`` only touch local entries."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        self.pool = torch.empty(capacity, dtype=torch.uint8)
        self.allocator = NaiveAllocator(capacity, alignment)
        self.free_bytes = capacity
        self.entries: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self.refs: dict[str, int] = {}
        self.recency: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()

    def batch_is_exist(self, keys: list[str]) -> list[bool]:
        """Which keys are cached; touches the present ones."""
        with self.lock:
            found = [key in self.entries for key in keys]
            for key, present in zip(keys, found, strict=True):
                if present:
                    self.recency.move_to_end(key)
            return found

    def prefetch(self, request_id: str, keys: list[str]) -> None:
        """Touch the present keys (a real one would also start loads of the others)."""
        with self.lock:
            for key in keys:
                if key in self.entries:
                    self.recency.move_to_end(key)

    def check_prefetch_progress(self, request_id: str) -> bool:
        """Whether the request's loads ended: always, as none are started."""
        with self.lock:
            return True

    def get_pool_views(self, keys: list[str]) -> list[torch.Tensor | None]:
        """Pin each present key and view its bytes (None for the absent ones)."""
        views: list[torch.Tensor | None] = []
        with self.lock:
            for key in keys:
                entry = self.entries.get(key)
                if entry is None:
                    views.append(None)
                    continue
                offset, shape, dtype = entry
                self.refs[key] += 1
                self.recency.move_to_end(key)
                nbytes = math.prod(shape) * dtype.itemsize
                views.append(self.pool[offset : offset + nbytes].view(dtype).view(shape))
        return views

    def release_pool_views(self, keys: list[str]) -> None:
        """Unpin each key."""
        with self.lock:
            for key in keys:
                if key in self.refs:
                    self.refs[key] -= 1

    def insert(self, key: str, tensor: torch.Tensor) -> bool:
        """Copy ``tensor`` in under ``key`` (idle once copied); False when no space was found."""
        size = tensor.nbytes
        with self.lock:
            if key in self.entries:
                return False
            offset = self.allocator.allocate(size)
            if offset is None:
                rounded = -(-size // self.allocator.alignment) * self.allocator.alignment
                victims, freed = [], self.free_bytes
                for victim in self.recency:  # oldest first, past the pinned ones
                    if freed >= rounded:
                        break
                    if not self.refs[victim]:
                        victims.append(victim)
                        freed += self.allocator.allocated[self.entries[victim][0]]
                for victim in victims:
                    del self.recency[victim], self.refs[victim]
                    self.free_bytes += self.allocator.free(self.entries.pop(victim)[0])
                offset = self.allocator.allocate(size)
                if offset is None:
                    return False
            self.free_bytes -= self.allocator.allocated[offset]
            self.entries[key] = (offset, tuple(tensor.shape), tensor.dtype)
            self.refs[key] = 1  # held while the bytes are copied in
            self.recency[key] = None
        self.pool[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        with self.lock:
            self.refs[key] -= 1
        return True


class ScanLRUCache:
    """Baseline: one recency list of all entries; eviction scans it from the head, skipping
    pinned entries (O(pinned) per victim)."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        self.allocator = RangeAllocator(capacity, alignment)
        self.pool = torch.empty(capacity, dtype=torch.uint8)
        self.entries: dict[str, tuple[int, int]] = {}
        self.pins = Pins()
        self.recency: OrderedDict[str, None] = OrderedDict()  # every entry, oldest first

    def insert(self, key: str, tensor: torch.Tensor) -> bool:
        """Insert ``key`` pinned (the caller releases it); evict idle entries from the head."""
        size = self.allocator.rounded(tensor.nbytes)
        offset = self.allocator.allocate(size)
        while offset is None:
            victim = next((k for k in self.recency if not self.pins[k]), None)
            if victim is None:
                return False
            del self.recency[victim]
            self.allocator.free(self.entries.pop(victim)[0])
            offset = self.allocator.allocate(size)
        self.pool[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(
            tensor
        )
        self.entries[key] = (offset, size)
        self.recency[key] = None
        self.pins.pin(key)
        return True

    def release(self, key: str) -> None:
        if self.pins.release(key):
            self.recency.move_to_end(key)


def half_freed(make: Any, live: int, seed: int, align: int = 256) -> Any:
    """An allocator from ``make(capacity, align)`` filled by ``live`` blocks of 1..8 ``align``
    units, then a random half of them freed (the same holes for every allocator class)."""
    rng = random.Random(seed)
    sizes = [align * rng.randint(1, 8) for _ in range(live)]
    alloc = make(sum(sizes), align)
    offsets = [alloc.allocate(s) for s in sizes]
    for offset in rng.sample(offsets, live // 2):
        assert offset is not None
        alloc.free(offset)
    return alloc
