"""Eviction orders and admission policies (DESIGN.md, "Eviction order and admission").

Theory of operation. The evictable entries (READY, no pins, not doomed, no quarantine pending)
form one *eviction order*, lowest value first; the contiguity rule takes its victims among the
first entries of that order. A policy decides where an entry enters the order (``add``, called
when it becomes evictable) and may refuse a ``BeginLoad`` that would have to evict (``admit``):
the item is then served from its fresh encoder output and not cached (reason
``not_admitted``), and nothing is evicted. The core calls ``record`` for every looked-up key
(hit, join or miss), ``forget`` when an entry is freed, and, for a policy that keeps encoder
work (``records_work``), ``note_work`` / ``note_encoded`` at the end of an insert given its
outputs' measured encoder seconds. Safety never depends on the policy:
the core enforces every invariant whatever the order says or admission answers. This module is
pure (no clock, no thread, no I/O, no torch); the caller holds the cache lock around every
call, and one policy object serves one cache.

Policies (``make_policy(name, **knobs)``):
- ``lru`` (the default): recency order, admits everything; exactly the seed's behaviour.
- ``tinylfu``: recency order and a TinyLFU admission filter: a candidate is admitted only if it
  was looked up more often, recently, than every one of its victims.
- ``adaptive``: ``tinylfu``'s counts, and admission by whichever expert (admit everything, as
  ``lru``; or ``tinylfu``'s filter behind a doorkeeper: a key seen once displaces nothing)
  has had more hits lately in a shadow cache of keys that follows it alone.
- ``adaptive-work``: ``adaptive`` whose filter weighs each key's recent lookups by its measured
  encoder seconds per byte (the driver passes each fresh output's encoder time to ``insert``;
  without it, ``adaptive`` exactly).

The policies live one a module (``embcache.core.policy_lru``, ``embcache.core.policy_tinylfu``,
``embcache.core.policy_adaptive``, ``embcache.core.policy_adaptive_work``); this module holds
what the core calls them through (``Policy``, ``WorkPolicy``, ``EvictionOrder``), the names
``make_policy`` knows, and the checks of a cache's ``policy`` and an insert's ``work``. Why
each policy is built as it is, with what was measured: docs/policies.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from embcache.core.entries import ItemLike
from embcache.core.policy_adaptive import AdaptivePolicy
from embcache.core.policy_adaptive_work import WorkAdaptivePolicy
from embcache.core.policy_lru import LruPolicy
from embcache.core.policy_tinylfu import TinyLfuPolicy
from embcache.errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "POLICIES",
    "AdaptivePolicy",
    "EvictionOrder",
    "LruPolicy",
    "Policy",
    "TinyLfuPolicy",
    "WorkAdaptivePolicy",
    "WorkPolicy",
    "as_policy",
    "checked_work",
    "make_policy",
]


class EvictionOrder(Protocol):
    """The evictable entries, first to evict first."""

    def add(self, key: str) -> None:
        """``key`` became evictable (Release to 0 pins, or EndLoad OK with no waiters)."""

    def discard(self, key: str) -> bool:
        """``key`` is no longer evictable (pinned, freed); whether it was in the order."""

    def __iter__(self) -> Iterator[str]:
        """Lowest value (first victim) first; lazy, the caller may stop early."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class Policy(Protocol):
    """Where entries enter the eviction order, and which inserts that must evict are taken."""

    name: str
    records_lookups: bool  # False: ``record`` does nothing, and the core skips the call

    def order(self) -> EvictionOrder:
        """The eviction order of one cache (called once per cache)."""

    def record(self, key: str) -> None:
        """``key`` was looked up (hit, join or miss)."""

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """Whether to insert ``key`` (``nbytes``) at the cost of evicting ``victims``."""

    def forget(self, key: str) -> None:
        """The entry of ``key`` was freed."""


class WorkPolicy(Policy, Protocol):
    """A policy that uses measured encoder work: at the end of an insert given its outputs'
    encoder seconds, the core calls ``note_work`` for each output now cached and
    ``note_encoded`` for each other one (a policy without ``records_work`` True is never
    called, and every caller may pass no work)."""

    records_work: bool

    def note_work(self, key: str, seconds: float, nbytes: int) -> None:
        """The entry of ``key`` (``nbytes`` of pool) is READY; its encoder output took
        ``seconds`` to compute (finite, >= 0)."""

    def note_encoded(self, key: str, seconds: float, nbytes: int) -> None:
        """``key``'s output (``nbytes`` aligned) took ``seconds`` but is not cached."""


POLICIES: dict[str, Callable[..., Policy]] = {
    "lru": LruPolicy,
    "tinylfu": TinyLfuPolicy,
    "adaptive": AdaptivePolicy,
    "adaptive-work": WorkAdaptivePolicy,
}


def checked_work(work: object, items: Sequence[ItemLike]) -> list[tuple[str, float, int]] | None:
    """``work`` (None: unknown; else one encoder time in seconds per item of ``items``) as
    ``(key, seconds, nbytes)`` per item, what ``CacheCore.end_inserts`` takes; raises
    ``InvalidTypeError`` (not a sequence of numbers) or ``InvalidArgumentError`` (another
    length, a value negative or not finite). O(items)."""
    if work is None:
        return None
    if isinstance(work, str | bytes) or not isinstance(work, Sequence):
        raise InvalidTypeError(
            f"work must be a list of encoder seconds, one per item, got {type(work).__name__}"
        )
    if len(work) != len(items):
        raise InvalidArgumentError(
            f"work has {len(work)} values for {len(items)} items: give one each"
        )
    out: list[tuple[str, float, int]] = []
    for item, seconds in zip(items, work, strict=True):
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise InvalidTypeError(
                f"work must be numbers of seconds, got {type(seconds).__name__} {seconds!r}"
            )
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidArgumentError(
                f"work must be finite seconds >= 0, got {seconds}: pass the encoder's measured time"
            )
        out.append((item.key, float(seconds), item.nbytes))
    return out


def make_policy(name: object = "lru", **knobs: Any) -> Policy:
    """A new policy called ``name`` (one of ``POLICIES``) with its ``knobs``.

    ``name`` and the policies' knobs are typed ``object`` and checked inside: compiled by mypyc
    (docs/setup.md, "A compiled core"), a parameter typed ``int`` or ``str`` rejects anything
    else with a plain ``TypeError`` and turns a bool into an int before our checks could raise
    ``InvalidTypeError``."""
    if not isinstance(name, str):
        raise InvalidTypeError(f"policy name must be a str, got {type(name).__name__} {name!r}")
    factory = POLICIES.get(name)
    if factory is None:
        raise InvalidArgumentError(
            f"unknown policy {name!r}: use one of {', '.join(sorted(POLICIES))}"
        )
    unknown = sorted(set(knobs) - set(inspect.signature(factory).parameters))
    if unknown:
        raise InvalidArgumentError(
            f"policy {name!r} has no knobs {unknown}: its knobs are "
            f"{sorted(inspect.signature(factory).parameters) or 'none'}"
        )
    return factory(**knobs)


def as_policy(policy: str | Policy) -> Policy:
    """``policy`` itself when it is a ``Policy`` object, else ``make_policy(policy)``: the one
    place a cache's ``policy`` argument is checked. Raises ``InvalidTypeError`` for anything
    else."""
    if isinstance(policy, str):
        return make_policy(policy)
    if not all(callable(getattr(policy, m, None)) for m in ("order", "record", "admit", "forget")):
        raise InvalidTypeError(f"policy must be a name or a Policy object, got {policy!r}")
    return policy
