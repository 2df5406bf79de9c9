"""Entry states and the one transition table that drives every state change.

Rules of this module (after h11's ``_state.py``):
- An entry is in exactly one ``EntryState``. The cache never assigns a state directly: it
  names the ``Step`` it is taking and ``transition`` looks the next state up in
  ``TRANSITIONS``. A step the table does not list raises ``TransitionError`` and the caller
  changes nothing.
- A ``Step`` is one DESIGN.md action refined by the guard that decides its effect (``EndLoad``
  with outcome OK on an entry that is not doomed is ``END_LOAD_OK``; with outcome OK on a doomed
  one it is ``END_LOAD_DOOMED``). ``Step.action`` is the action's shared name, the one the model,
  the TLA+ spec and the traces use.
- Self-loops are listed too (a hit pins a READY entry and leaves it READY), so the table is the
  complete list of what may happen to an entry in each state.
"""

from __future__ import annotations

import enum

from embcache.errors import TransitionError


class EntryState(enum.Enum):
    """Life of one cache entry; ABSENT means there is no entry."""

    ABSENT = "ABSENT"
    LOADING = "LOADING"
    READY = "READY"
    QUARANTINED = "QUARANTINED"

    __hash__ = object.__hash__  # members are singletons: identity hashing keeps lookups cheap


class Step(enum.Enum):
    """A guarded action: the unit the transition table is keyed by. Its value is the DESIGN.md
    action and one line on what the step does (which also keeps the steps of one action apart)."""

    BEGIN_LOAD = ("BeginLoad", "allocate a range; the first waiter is the loader")
    LOOKUP_JOIN = ("Lookup", "join the waiters of a load in flight")
    LOOKUP_HIT = ("Lookup", "pin a READY entry")
    END_LOAD_OK = ("EndLoad", "bytes valid: waiters become pin holders")
    END_LOAD_DOOMED = ("EndLoad", "load OK but the entry was removed: free it")
    END_LOAD_FAILED = ("EndLoad", "nothing in flight any more: free the range")
    END_LOAD_UNKNOWN = ("EndLoad", "a transfer may still touch the range: quarantine it")
    RELEASE_WAIT = ("Release", "a waiter leaves a load in flight")
    RELEASE_PIN = ("Release", "drop a pin; others remain, or the entry goes to the LRU tail")
    RELEASE_LAST_DOOMED = ("Release", "last pin of a removed entry: free it")
    RELEASE_LAST_TAINTED = ("Release", "last pin after an UNKNOWN publish: quarantine it")
    EVICT = ("Evict", "free an idle READY entry chosen by the eviction rule")
    REMOVE_IDLE = ("Remove", "free an idle READY entry")
    REMOVE_BUSY = ("Remove", "mark a busy entry doomed; freed when it becomes idle")
    PUBLISH = ("Publish", "a write to the global store starts under its own pin")
    END_PUBLISH = ("EndPublish", "the publish pin is dropped (see RELEASE_* for the last pin)")
    FENCE = ("Fence", "the store is fenced: free a quarantined range")

    __hash__ = object.__hash__  # members are singletons: identity hashing keeps lookups cheap

    @property
    def action(self) -> str:
        """The DESIGN.md action name this step belongs to."""
        return self.value[0]


ABSENT, LOADING, READY, QUARANTINED = (
    EntryState.ABSENT,
    EntryState.LOADING,
    EntryState.READY,
    EntryState.QUARANTINED,
)

TRANSITIONS: dict[tuple[EntryState, Step], EntryState] = {
    (ABSENT, Step.BEGIN_LOAD): LOADING,
    (LOADING, Step.LOOKUP_JOIN): LOADING,
    (LOADING, Step.END_LOAD_OK): READY,
    (LOADING, Step.END_LOAD_DOOMED): ABSENT,
    (LOADING, Step.END_LOAD_FAILED): ABSENT,
    (LOADING, Step.END_LOAD_UNKNOWN): QUARANTINED,
    (LOADING, Step.RELEASE_WAIT): LOADING,
    (LOADING, Step.REMOVE_BUSY): LOADING,
    (READY, Step.LOOKUP_HIT): READY,
    (READY, Step.RELEASE_PIN): READY,
    (READY, Step.RELEASE_LAST_DOOMED): ABSENT,
    (READY, Step.RELEASE_LAST_TAINTED): QUARANTINED,
    (READY, Step.EVICT): ABSENT,
    (READY, Step.REMOVE_IDLE): ABSENT,
    (READY, Step.REMOVE_BUSY): READY,
    (READY, Step.PUBLISH): READY,
    (READY, Step.END_PUBLISH): READY,
    (QUARANTINED, Step.FENCE): ABSENT,
}


def transition(state: EntryState, step: Step) -> EntryState:
    """The state after ``step``; raises ``TransitionError`` if the table does not allow it.

    raises: TransitionError
    post: (state, step) in TRANSITIONS
    post: __return__ == TRANSITIONS[(state, step)]
    """
    next_state = TRANSITIONS.get((state, step))
    if next_state is None:
        allowed = sorted(s.name for (st, s) in TRANSITIONS if st is state)
        raise TransitionError(
            f"{step.action} ({step.name}) is not allowed in state {state.name}; "
            f"allowed there: {', '.join(allowed) or 'nothing'}"
        )
    return next_state
