"""``FrequencySketch``, the fixed-size record of recent lookups that ``tinylfu`` and
``adaptive`` admit by (``embcache.core.policy_tinylfu``), and ``Footprint``, what a policy
keeps per key (DESIGN.md, "Memory bounds"). Pure: no clock, no thread, no I/O; the caller
holds the lock.

Design notes. Exact counts in a dict keyed by every key of a sample window cost a record about
0.2 us against the sketch's 0.6 us (best of 9 on the 2-core machine; 3,450 against 8,540
instructions under callgrind) but keep a key and a count per key seen; so the policies count
here only the keys that are not resident, and count resident keys (at most the entries held)
exactly in a dict, which makes a hit's record a dict lookup and store (an 8-item all-hit
request at about 1.1x lru's, where a sketch update per hit made it 1.3x). Measured on the
policy grid against exact counts for every key: with 4 counters per lookup (the policy's
``COUNTERS_PER_LOOKUP``) no cell lost more than 0.11 point (none with two of three hash seeds);
with 1 or 2 per lookup cells lost up to 1.3 and 0.35 points, and with 2 rows of 8 per lookup
(0.25 us a record) up to 0.5. Counters take a byte, not a nibble: packing two a byte cost 60%
more per record for half the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

DEPTH = 4  # rows of the frequency sketch
HALF = bytes(count >> 1 for count in range(256))  # bytearray.translate: every counter halved
MAX_COUNTER = 255  # a counter is one byte


@dataclass(frozen=True)
class Footprint:
    """What a policy keeps per key, one field per container: bytes of sketch, resident keys,
    exact counts (resident keys looked up while resident), ghosts, present keys whose encoder
    work is remembered and work ghosts (DESIGN.md, "Memory bounds"). ``within(bound)``: no
    field above ``bound``'s."""

    sketch_bytes: int
    resident: int
    counts: int = 0
    ghosts: int = 0
    work: int = 0
    work_ghosts: int = 0

    def within(self, bound: Footprint) -> bool:
        """Every field at most ``bound``'s."""
        return (
            self.sketch_bytes <= bound.sketch_bytes
            and self.resident <= bound.resident
            and self.counts <= bound.counts
            and self.ghosts <= bound.ghosts
            and self.work <= bound.work
            and self.work_ghosts <= bound.work_ghosts
        )


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


class FrequencySketch:
    """A count-min sketch of recent lookups: ``DEPTH`` rows of ``width`` one-byte counters
    (``width`` a power of two), saturating at ``max_count``, with conservative update.

    ``hash(key)`` is taken once; row ``r`` counts the key at ``(a + r * b) & (width - 1)``, with
    ``a`` its low bits and ``b`` (odd) its bits from 32 up (double hashing, Kirsch and
    Mitzenmacher). An estimate is the smallest of the key's ``DEPTH`` counters: never below the
    key's true count (saturated, halved), above it only when every row collides. Collisions,
    hence a few answers at the margin, depend on the interpreter's hash seed (PYTHONHASHSEED).
    ``grow`` doubles the width by repeating every row, which leaves every estimate unchanged
    (the new index of a key is its old one or that plus the old width). Memory: ``DEPTH`` x
    ``width`` bytes, nothing per key.
    """

    __slots__ = ("mask", "max_count", "rows")

    def __init__(self, width: int, max_count: int) -> None:
        self.rows = tuple(bytearray(width) for _ in range(DEPTH))
        self.mask = width - 1
        self.max_count = max_count

    @property
    def width(self) -> int:
        """Counters per row."""
        return self.mask + 1

    @property
    def nbytes(self) -> int:
        """Bytes of counters (the sketch's whole per-key memory)."""
        return DEPTH * self.width

    def estimate(self, key: str) -> int:
        """Recent lookups of ``key`` (saturating, halved with the sketch). O(1)."""
        h, mask = hash(key), self.mask
        i0 = h & mask
        b = ((h >> 32) & mask) | 1
        i1 = (i0 + b) & mask
        i2 = (i1 + b) & mask
        r0, r1, r2, r3 = self.rows
        least = r0[i0]  # compared in line: min() of four was a third of this call, compiled
        count = r1[i1]
        if count < least:
            least = count
        count = r2[i2]
        if count < least:
            least = count
        count = r3[(i2 + b) & mask]
        return count if count < least else least

    def add(self, key: str) -> int:
        """Count one lookup of ``key``: raise those of its counters that hold its estimate (the
        smallest), unless saturated; the estimate before. O(1), no loop: runs on every lookup."""
        h, mask = hash(key), self.mask
        i0 = h & mask
        b = ((h >> 32) & mask) | 1
        i1 = (i0 + b) & mask
        i2 = (i1 + b) & mask
        i3 = (i2 + b) & mask
        r0, r1, r2, r3 = self.rows
        c0, c1, c2, c3 = r0[i0], r1[i1], r2[i2], r3[i3]
        before = c0 if c0 < c1 else c1
        if c2 < before:
            before = c2
        if c3 < before:
            before = c3
        if before < self.max_count:
            after = before + 1
            if c0 == before:
                r0[i0] = after
            if c1 == before:
                r1[i1] = after
            if c2 == before:
                r2[i2] = after
            if c3 == before:
                r3[i3] = after
        return before

    def raise_to(self, key: str, count: int) -> None:
        """Every counter of ``key`` at least ``count`` (at most ``max_count``): its estimate is
        then at least ``count``. O(1)."""
        h, mask = hash(key), self.mask
        index = h & mask
        b = ((h >> 32) & mask) | 1
        count = min(count, self.max_count)
        for row in self.rows:
            if row[index] < count:
                row[index] = count
            index = (index + b) & mask

    def halve(self) -> None:
        """Every counter halved (rounded down), in C. O(width)."""
        for row in self.rows:
            row[:] = row.translate(HALF)

    def clear(self) -> None:
        """Every counter 0. O(width)."""
        for row in self.rows:
            row[:] = bytes(len(row))

    def grow(self, width: int) -> None:
        """At least ``width`` counters a row (a power of two); never shrinks. O(new width)."""
        while self.mask + 1 < width:
            for row in self.rows:
                row.extend(row)
            self.mask = 2 * self.mask + 1
