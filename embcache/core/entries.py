"""What the core keeps per key, per request and per fence: ``Entry``, ``RequestState`` and
``FenceSnapshot``.

All are plain records, changed only by the core's actions (``embcache.core.entry_actions``,
``embcache.core.request_bodies``, through the transitions of embcache/DESIGN.md) under their
driver's lock.
Items are duck-typed (``ItemLike``), so nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from embcache.core.lifecycle import LOADING, EntryState
from embcache.core.outcomes import ItemStatus, Reason

Holder = str | tuple[str, str]  # a request id, or ("publish", request id) for a publish pin
NOBODY: frozenset[Any] = frozenset()  # shared: an idle entry carries no set of its own


class ItemLike(Protocol):
    """What the core needs of an item (``embcache.Item`` is one)."""

    @property
    def key(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> Hashable: ...
    @property
    def nbytes(self) -> int: ...


class Entry:
    """One key's entry: what it holds (``key``, ``shape``, ``dtype``), where, and who uses it.

    Compact on purpose (100k entries are common): the item's fields are kept, not the item;
    the time its pins began lives in the core's state (``CoreState.pinned_since``), for
    pinned entries only; a load in flight is from the store exactly when no request must fill
    it. Written out with ``__slots__`` rather than as a ``dataclass(slots=True)``, whose class
    swap the compiled build (``docs/setup.md``) cannot follow; compared by identity."""

    __slots__ = (
        "doomed",
        "dtype",
        "filler",
        "holders",
        "key",
        "offset",
        "publishing",
        "shape",
        "size",
        "state",
        "tainted",
        "waiters",
    )  # fmt: skip

    def __init__(
        self, key: str, shape: tuple[int, ...], dtype: Hashable, offset: int, size: int,
        state: EntryState = LOADING, holders: frozenset[Holder] = NOBODY,
        waiters: frozenset[str] = NOBODY, filler: str | None = None, doomed: bool = False,
        tainted: bool = False, publishing: bool = False,
    ) -> None:  # fmt: skip
        self.key = key
        self.shape = shape
        self.dtype = dtype
        self.offset = offset
        self.size = size  # allocated bytes (rounded up to the alignment)
        self.state = state
        self.holders = holders  # immutable values; every empty one is NOBODY
        self.waiters = waiters
        self.filler = filler  # the request that must fill a LOADING entry not from the store
        self.doomed = doomed
        self.tainted = tainted  # a publish ended UNKNOWN: quarantine when the last pin goes
        self.publishing = publishing

    @property
    def pins(self) -> int:
        return len(self.holders)

    def copy(self) -> Entry:
        """A copy with the same fields (they are immutable values: nothing is shared)."""
        return Entry(
            self.key, self.shape, self.dtype, self.offset, self.size, self.state, self.holders,
            self.waiters, self.filler, self.doomed, self.tainted, self.publishing,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"Entry(key={self.key!r}, shape={self.shape!r}, dtype={self.dtype!r}, "
            f"offset={self.offset}, size={self.size}, state={self.state!r}, "
            f"holders={self.holders!r}, waiters={self.waiters!r}, filler={self.filler!r}, "
            f"doomed={self.doomed}, tainted={self.tainted}, publishing={self.publishing})"
        )


@dataclass(eq=False)
class RequestState:
    """A request's holds, waits, reservations and fallbacks, as the core sees them (one per open
    request: not slotted, as the compiled build cannot compile ``dataclass(slots=True)``). Made
    with its id alone: every container starts empty (one is opened per request, so the
    ``__init__`` is written out: a dataclass's default factories cost twice as much)."""

    request_id: str
    items: list[ItemLike] = field(init=False)
    holds: dict[str, None] = field(init=False)  # the keys it pins, in pin order
    waits: set[str] = field(init=False)
    reserved: set[str] = field(init=False)
    filling: set[str] = field(init=False)  # reserved, handed out to an outside writer
    fallbacks: dict[str, Reason] = field(init=False)
    # A lookup between its two passes: its items, their statuses so far, and ``reserve``.
    lookup_pending: tuple[list[ItemLike], list[ItemStatus], bool] | None = field(init=False)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.items = []
        self.holds = {}
        self.waits = set()
        self.reserved = set()
        self.filling = set()
        self.fallbacks = {}
        self.lookup_pending = None

    def copy(self) -> RequestState:
        """A copy whose containers are its own (the items in them are shared)."""
        rs = RequestState(self.request_id)
        rs.items, rs.holds, rs.waits = list(self.items), dict(self.holds), set(self.waits)
        rs.reserved, rs.filling = set(self.reserved), set(self.filling)
        rs.fallbacks, rs.lookup_pending = dict(self.fallbacks), self.lookup_pending
        return rs

    def pending(self) -> bool:
        """Whether it waits on a load that someone else fills (a store read or another's insert)."""
        return bool(self.waits) and not self.waits <= self.reserved

    def release_order(self) -> list[str]:
        """The keys it pins, in the order it looked them up, then the others (its own inserts)
        in the order it pinned them: released in this order, the last looked up ends newest."""
        holds = self.holds
        if not self.items:  # (a request that only inserted: its pins in the order it took them)
            return list(holds)
        order: list[str] = []
        looked: set[str] = set()
        for item in self.items:  # (a loop, not ``dict.fromkeys``: a C loop in the compiled core)
            key = item.key
            if key in holds and key not in looked:
                looked.add(key)
                order.append(key)
        if len(order) < len(holds):  # it also pins keys it inserted without looking them up
            order += [key for key in holds if key not in looked]
        return order

    def fallback_reason(self, item: ItemLike) -> Reason | None:
        """Why ``item``, looked up and not served, must be encoded."""
        if item.key in self.holds:
            return Reason.MISMATCH
        if item.key in self.reserved:
            return Reason.NOT_FOUND  # reserved for this request: a miss it must encode
        if item.key in self.waits:
            return Reason.TIMEOUT
        return self.fallbacks.get(item.key)


@dataclass(frozen=True)
class FenceSnapshot:
    """What a fence in flight took at ``BeginFence``: its id and the QUARANTINED entries then.

    The entries themselves, not their keys: a key may be freed by another fence and be
    QUARANTINED again before this one ends, and that new entry is not this fence's to free."""

    fence: int
    entries: tuple[Entry, ...]


def matches(entry: Entry, item: ItemLike) -> bool:
    """Whether ``entry`` holds ``item``'s shape and dtype (the one place this is decided)."""
    return entry.shape == item.shape and entry.dtype == item.dtype
