"""What a request step of ``CacheCore`` tells its driver to do next: small records, no behaviour.

The driver does each effect with no lock held (a store call, a copy, a wake-up) and reports the
outcome back through the next step.
"""

from __future__ import annotations

from typing import NamedTuple

from embcache.core.entries import Entry, RequestState
from embcache.core.outcomes import ItemStatus


class LookupStart(NamedTuple):
    """``begin_lookup``'s answer: a status per item, and the keys to ask the store about
    (sorted; empty: the lookup is over, else call ``finish_lookup`` with the answer)."""

    statuses: list[ItemStatus]
    ask: list[str]


class LookupEnd(NamedTuple):
    """``finish_lookup``'s answer: the final status per item, and the entries whose ranges the
    driver must now read from the store (then report through ``end_loads``)."""

    statuses: list[ItemStatus]
    loads: list[Entry]


class Fill(NamedTuple):
    """One range an insert must fill: ``items[item]``'s bytes into ``entry``'s range."""

    item: int
    entry: Entry


class InsertEnd(NamedTuple):
    """``finish_insert``'s answer: per item whether it is cached now, and the requests whose
    wait may have ended (wake them)."""

    results: list[bool]
    wake: list[RequestState]
