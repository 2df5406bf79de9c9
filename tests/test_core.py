"""The pure core, driven step by step with no driver, no threads and no torch.

Also the shape of the package: the core imports no I/O, and no module of ``embcache`` takes
part in an import cycle (typing-only imports included).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from embcache.core import entry_actions as ea
from embcache.core import publishing as pub
from embcache.core import request_bodies as bodies
from embcache.core.cache_core import CacheCore
from embcache.core.entries import RequestState
from embcache.core.lifecycle import ABSENT, LOADING, QUARANTINED, READY
from embcache.core.lookup_flags import LookupFlags
from embcache.core.outcomes import ItemStatus, Reason, Status, TransferOutcome
from embcache.core.queries import StateQueries
from embcache.core.state import CoreState
from embcache.driver.trace import TraceLog
from embcache.errors import InvalidArgumentError, InvariantError, TransitionError
from tests.support.compiled import core_is_compiled

PACKAGE = Path(__file__).resolve().parents[1] / "embcache"
CORE = PACKAGE / "core"
CORE_MODULES = sorted(p.stem for p in CORE.glob("*.py") if p.stem != "__init__")
IO_MODULES = ("torch", "threading", "_thread", "asyncio", "concurrent", "time", "embcache.store")
ALIGN = 256
OK, FAILED, UNKNOWN = TransferOutcome.OK, TransferOutcome.FAILED, TransferOutcome.UNKNOWN


@dataclass(frozen=True)
class Thing:
    """An item as the core sees it: no torch needed."""

    key: str
    nbytes: int
    shape: tuple[int, ...] = (1,)
    dtype: str = "u8"


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, typing-only imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_modules_import_no_io_and_nothing_outside_the_core(module: str) -> None:
    imported = imports_of(CORE / f"{module}.py")
    bad = sorted(n for n in imported if any(n == m or n.startswith(m + ".") for m in IO_MODULES))
    assert not bad, f"embcache/core/{module}.py imports {bad}"
    outside = sorted(
        n for n in imported
        if n.split(".")[0] == "embcache"
        and not n.startswith(("embcache.core.", "embcache.errors"))
        and n not in ("embcache.core", "embcache")
    )
    assert not outside, f"embcache/core/{module}.py imports {outside} from outside the core"


def test_errors_the_core_shares_import_nothing() -> None:
    """``embcache.errors``, the one module the core shares with the driver, is a leaf."""
    assert not {n for n in imports_of(PACKAGE / "errors.py") if not n.startswith("__future__")}


def test_loading_the_core_loads_only_the_core_and_no_io() -> None:
    """Every module the core imports, transitively: loaded in a bare interpreter, the core pulls
    in no ``embcache`` module but its own and ``embcache.errors``, and no torch, threading,
    asyncio, clock or store."""
    # A bare package object, so that embcache/__init__.py (the driver, torch) does not run.
    code = (
        "import sys, types\n"
        "before = set(sys.modules)\n"
        f"pkg = types.ModuleType('embcache'); pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['embcache'] = pkg\n"
        f"for name in {CORE_MODULES!r}: __import__('embcache.core.' + name)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded = ast.literal_eval(out.stdout.strip())
    ours = {m for m in loaded if m.split(".")[0] == "embcache"}
    expected = {"embcache", "embcache.core", "embcache.errors"}
    expected |= {f"embcache.core.{m}" for m in CORE_MODULES}
    if core_is_compiled():
        expected.add("embcache.core.compiled__mypyc")  # the library the compiled modules share
    assert ours == expected, ours ^ expected
    io = [m for m in loaded if any(m == n or m.startswith(n + ".") for n in IO_MODULES)]
    assert not io, f"loading the core loads {io}"


def test_only_the_command_line_imports_the_tools() -> None:
    """``embcache/tools/`` (demo, metrics, encoders) sits on the cache; the cache never needs it."""
    users = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "tools" not in p.relative_to(PACKAGE).parts[:1]
        and any(n.startswith("embcache.tools") for n in imports_of(p))
    )
    assert users == ["__main__.py"], users


def test_no_import_cycle_in_the_package() -> None:
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph = {
        name: {n for n in imports_of(path) if n in modules and n != name}
        for name, path in modules.items()
    }
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycle = [*stack[stack.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            if dep != "embcache":  # the package itself re-exports; its modules never import it
                visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


# ------------------------------------------------------------------ the core, step by step
class Taken:
    """The trace the actions buffered, taken as the core would (``take_events``) when read."""

    def __init__(self, core: CoreState) -> None:
        self._core = core
        self._log = TraceLog()

    @property
    def events(self) -> list[dict[str, object]]:
        for event in self._core.take_events():
            self._log.append(event)
        return self._log.events


def make_core(
    units: int = 4, *, max_batch: int = 4, record_freed: bool = False
) -> tuple[CoreState, Taken]:
    """The core's state alone (``CacheCore`` holds it privately), traced, for the DESIGN
    actions (functions of ``embcache.core.entry_actions``, ``request_bodies``, ``publishing``)."""
    core = CoreState(
        units * ALIGN, ALIGN, max_batch, True, trace=True, record_freed=record_freed
    )
    return core, Taken(core)


def lookup(core: CoreState, rs: RequestState, item: Thing) -> ItemStatus:
    """Lookup(r, k) of one item."""
    return bodies.lookup_all(core, rs, [item])[0][0]


def state_of(core: CoreState) -> dict[str, tuple[str, int, list[str], list[str], bool]]:
    return {
        k: (e.state.name, e.offset, sorted(map(str, e.holders)), sorted(e.waiters), e.doomed)
        for k, e in core.entries.items()
    }


def test_a_store_load_walks_loading_ready_and_hands_off_its_waiters() -> None:
    core, trace = make_core()
    r1, r2 = bodies.open_request(core, "r1"), bodies.open_request(core, "r2")
    entry, reason = ea.begin_load(core, r1, Thing("a", ALIGN), from_store=True)
    assert entry is not None and reason is None
    assert state_of(core) == {"a": ("LOADING", 0, [], ["r1"], False)}
    assert lookup(core, r2, Thing("a", ALIGN)).status is Status.LOADING
    assert state_of(core) == {"a": ("LOADING", 0, [], ["r1", "r2"], False)}
    woken = ea.end_load(core, entry, OK, None)
    assert [rs.request_id for rs in woken] == ["r1", "r2"]
    assert state_of(core) == {"a": ("READY", 0, ["r1", "r2"], [], False)}
    assert list(core.order) == []  # pinned entries are not evictable
    bodies.release_all(core, r1, ["a"])
    bodies.release_all(core, r2, ["a"])
    assert list(core.order) == ["a"] and core.evictable_bytes == ALIGN
    StateQueries(core).check_invariants()
    actions = [e["action"] for e in trace.events]
    assert actions == ["Init", "OpenRequest", "OpenRequest", "BeginLoad", "Lookup", "EndLoad",
                       "Release", "Release"]  # fmt: skip


def test_an_illegal_action_raises_and_changes_nothing() -> None:
    core, trace = make_core()
    r1 = bodies.open_request(core, "r1")
    entry, _ = ea.begin_load(core, r1, Thing("a", ALIGN), from_store=True)
    assert entry is not None
    before, events = state_of(core), len(trace.events)
    with pytest.raises(TransitionError, match=r"BeginLoad .* not allowed in state LOADING"):
        ea.begin_load(core, r1, Thing("a", ALIGN), from_store=True)
    assert state_of(core) == before and len(trace.events) == events
    ea.end_load(core, entry, UNKNOWN, None)
    assert core.entries["a"].state is QUARANTINED
    with pytest.raises(TransitionError, match=r"EndLoad .* not allowed in state QUARANTINED"):
        ea.end_load(core, entry, OK, None)  # a second EndLoad of the same load
    assert core.entries["a"].state is QUARANTINED
    pub.fence(core, pub.begin_fence(core))
    with pytest.raises(InvariantError, match="whose entry is gone"):
        ea.end_load(core, entry, OK, None)  # a load that ended long ago
    assert core.entries == {} and core.allocator.allocated_bytes == 0
    StateQueries(core).check_invariants()


def test_begin_load_evicts_by_the_rule_or_fails_and_evicts_nothing() -> None:
    core, _ = make_core(units=2, max_batch=1)
    r1 = bodies.open_request(core, "r1")
    for key in ("a", "b"):
        entry, _ = ea.begin_load(core, r1, Thing(key, ALIGN), from_store=False)
        assert entry is not None
        ea.end_load(core, entry, OK, None)
    bodies.release_all(core, r1, ["a"])  # b stays pinned by r1
    assert list(core.order) == ["a"]
    entry, reason = ea.begin_load(core, r1, Thing("big", 2 * ALIGN), from_store=False)
    assert entry is None and reason is Reason.NO_SPACE
    assert set(core.entries) == {"a", "b"} and core.counts["evictions"] == 0
    entry, reason = ea.begin_load(core, r1, Thing("c", ALIGN), from_store=False)
    assert entry is not None and entry.offset == 0  # a's range, a evicted
    assert set(core.entries) == {"b", "c"} and core.counts["evictions"] == 1
    StateQueries(core).check_invariants()


def test_freed_ranges_are_queued_when_the_driver_asks() -> None:
    core, _ = make_core(record_freed=True)
    r1 = bodies.open_request(core, "r1")
    entry, _ = ea.begin_load(core, r1, Thing("a", 100), from_store=True)
    assert entry is not None
    ea.end_load(core, entry, FAILED, None)
    assert core.take_freed() == [(0, ALIGN)] and "a" not in core.entries
    assert core.take_freed() == []  # taken once
    unrecorded, _ = make_core()
    r2 = bodies.open_request(unrecorded, "r2")
    entry, _ = ea.begin_load(unrecorded, r2, Thing("a", 100), from_store=True)
    assert entry is not None
    ea.end_load(unrecorded, entry, FAILED, None)
    assert unrecorded.take_freed() == []


def test_remove_dooms_a_busy_entry_and_the_last_release_frees_it() -> None:
    core, _ = make_core()
    r1 = bodies.open_request(core, "r1")
    entry, _ = ea.begin_load(core, r1, Thing("a", ALIGN), from_store=False)
    assert entry is not None
    ea.end_load(core, entry, OK, None)
    assert ea.remove(core, "a") is True
    assert core.entries["a"].doomed and core.entries["a"].state is READY
    assert lookup(core, bodies.open_request(core, "r2"), Thing("a", ALIGN)).reason is Reason.BUSY
    bodies.release_all(core, r1, ["a"])
    assert "a" not in core.entries and core.allocator.allocated_bytes == 0
    StateQueries(core).check_invariants()


def test_a_publish_pin_and_an_unknown_publish_quarantine_then_fence_frees() -> None:
    core, _ = make_core()
    r1 = bodies.open_request(core, "r1")
    entry, _ = ea.begin_load(core, r1, Thing("a", ALIGN), from_store=False)
    assert entry is not None
    ea.end_load(core, entry, OK, None)
    assert pub.publish(core, r1, "a") is entry and entry.pins == 2
    assert pub.publish(core, r1, "a") is None  # one publish at a time
    pub.end_publish(core, "r1", entry, UNKNOWN)
    bodies.release_all(core, r1, ["a"])
    assert entry.state is QUARANTINED and core.quarantine == {entry.key: core.quarantine[entry.key]}
    assert pub.fence(core, pub.begin_fence(core)) == 1
    assert entry.state is ABSENT and core.allocator.allocated_bytes == 0
    StateQueries(core).check_invariants()


def test_request_steps_plan_an_insert_and_reject_a_mismatched_reservation() -> None:
    core = CacheCore(4 * ALIGN, ALIGN, 4, trace=True)
    state = core.queries
    looked = core.begin_lookup(
        "r1", [Thing("a", ALIGN)], LookupFlags(ask_store=False, reserve=True, serve=True)
    ).result
    r1 = looked.request  # opened by the lookup's own step
    assert looked.ask == [] and looked.statuses[0].status is Status.RESERVED
    assert [(i, e.key) for i, e in looked.fills] == [(0, "a")]  # the reservation to fill
    assert looked.served is not None and looked.served.ranges == [None]
    assert looked.served.reasons == [Reason.NOT_FOUND] and looked.served.final
    assert state.entries["a"].state is LOADING
    with pytest.raises(InvalidArgumentError, match="reserved as"):
        core.begin_insert([Thing("a", ALIGN, shape=(2,))], request=r1, hand_out=False)
    assert state.entries["a"].state is LOADING and r1.reserved == {"a"}
    twice = [Thing("a", ALIGN), Thing("a", ALIGN)]
    _, fills = core.begin_insert(twice, request=r1, hand_out=False).result
    assert [(i, e.key) for i, e in fills] == [(0, "a")]  # a duplicate key is filled once
    results = core.end_inserts(r1, fills, [OK], count=2, publish=False).result
    assert results == [True, False] and state.entries["a"].state is READY
    served = core.finish_lookup(r1, found=None, serve=True).result.served  # what it reads now
    offset = state.entries["a"].offset
    assert served is not None and served.ranges == [(offset, looked.request.items[0])]
    assert core.end_request(r1).wake == []
    assert state.requests == {} and state.eviction_order() == ["a"]
    state.check_invariants()


def test_request_state_pending_counts_only_loads_filled_by_others() -> None:
    rs = RequestState("r")
    rs.waits = {"a"}
    rs.reserved = {"a"}
    assert not rs.pending()  # its own reservation
    rs.waits.add("b")
    assert rs.pending()


def test_fence_is_due_past_the_byte_bound_or_at_the_age_bound() -> None:
    now = [10.0]
    core = CoreState(4 * ALIGN, ALIGN, 4, True, clock=lambda: now[0])
    r1 = bodies.open_request(core, "r1")
    assert StateQueries(core).fence_due(10.0, 0, 0.0) is False  # nothing quarantined
    entry, _ = ea.begin_load(core, r1, Thing("q", ALIGN), from_store=True)
    assert entry is not None
    ea.end_load(core, entry, UNKNOWN, None)  # quarantined at 10.0
    assert core.quarantine == {"q": 10.0}
    assert StateQueries(core).fence_due(14.9, ALIGN, 5.0) is False
    assert StateQueries(core).fence_due(15.0, ALIGN, 5.0) is True  # exactly max_age old
    assert StateQueries(core).fence_due(10.0, ALIGN - 1, 1e9) is True  # more bytes than the bound
    assert StateQueries(core).fence_due(10.0, ALIGN, 1e9) is False  # exactly the bound is not more
    pub.fence(core, pub.begin_fence(core))
    assert core.quarantine == {} and StateQueries(core).fence_due(1e9, 0, 0.0) is False


# ------------------------------------------------------------------ the read-only queries
def core_state_fingerprint(st: CoreState) -> object:
    """Everything a query could change, by value: the entries' fields, the requests' holds,
    waits and reservations, the allocator's blocks, the order, the counters, the pin times,
    the quarantine, the fences in flight, the interned shapes and the trace buffer."""
    return (
        {k: repr(e) for k, e in st.entries.items()},
        {
            r: (list(rs.items), dict(rs.holds), set(rs.waits), set(rs.reserved),
                dict(rs.fallbacks))
            for r, rs in st.requests.items()
        },
        st.allocator.allocations(), st.allocator.free_blocks(), st.allocator.allocated_bytes,
        list(st.order), st.evictable_bytes, dict(st.counts), dict(st.pinned_since),
        dict(st.quarantine), dict(st.fencing), dict(st.shapes), st.seq, list(st.events or ()),
        st.batches, st.fences_begun,
    )


def call_every_query(queries: object) -> list[str]:
    """Read every public property and call every public method of ``queries`` (with the
    arguments each takes); the names called."""
    args: dict[str, tuple[object, ...]] = {
        "stats": (5.0,), "fence_due": (5.0, 0, 0.0), "entry_state": ("a",),
    }  # fmt: skip
    called = []
    for name in sorted(n for n in dir(type(queries)) if not n.startswith("_")):
        value = getattr(queries, name)
        if callable(value):
            value = value(*args.get(name, ()))
        if isinstance(value, dict | list | set):
            value.clear()  # a copy it handed out: emptying it must change nothing
        called.append(name)
    return called


def busy_core() -> CoreState:
    """A state with an entry in each state: READY idle and pinned, LOADING with a waiter,
    QUARANTINED, a fence in flight, open requests holding and waiting (built by the actions
    themselves, as ``CacheCore``'s steps would)."""
    now = [1.0]
    st = CoreState(8 * ALIGN, ALIGN, 4, True, trace=True, clock=lambda: now[0])
    r1 = bodies.open_request(st, "r1")
    looked = bodies.lookup_request(
        st, r1, [Thing(k, ALIGN) for k in "abcq"], ask_store=False, reserve=True, serve=True
    )
    outcomes = [OK, OK, OK, UNKNOWN]
    bodies.end_fills(st, r1, looked.fills, outcomes, count=4, handed_out=False, work=None)
    bodies.end_request(st, r1)
    r2 = bodies.open_request(st, "r2")
    assert lookup(st, r2, Thing("b", ALIGN)).status is Status.HIT
    r3, r4 = bodies.open_request(st, "r3"), bodies.open_request(st, "r4")
    bodies.lookup_request(st, r3, [Thing("d", ALIGN)], ask_store=False, reserve=True, serve=True)
    assert lookup(st, r4, Thing("d", ALIGN)).status is Status.LOADING
    pub.begin_fence(st)
    return st


def test_every_query_leaves_the_state_unchanged() -> None:
    st = busy_core()
    queries = StateQueries(st)  # what ``CacheCore.queries`` is, over its own state
    assert {e.state for e in st.entries.values()} == {READY, LOADING, QUARANTINED}
    before = core_state_fingerprint(st)
    called = call_every_query(queries)
    assert core_state_fingerprint(st) == before
    assert {"entries", "stats", "check_invariants", "allocator_copy", "fence_due"} <= set(called)
    assert "allocator" not in called and "take_events" not in called  # nothing that hands out
    copy = queries.allocator_copy()
    assert copy is not st.allocator and copy.allocate(ALIGN) is not None  # a copy to spend
    assert core_state_fingerprint(st) == before
    with pytest.raises(TypeError):
        queries.entries["z"] = st.entries["a"]  # type: ignore[index]  # a read-only view
    assert isinstance(CacheCore(ALIGN, ALIGN, 1).queries, StateQueries)


def test_a_planted_query_that_takes_the_trace_is_found() -> None:
    """The check sees a query that changes state: ``take_events`` (which the old queries type
    carried) empties the trace buffer."""

    class Leaky:  # (a class of its own: the compiled StateQueries takes no subclass)
        @property
        def entries(self) -> object:
            return StateQueries(st).entries

        def take_events(self) -> list[dict[str, object]]:
            return st.take_events()

    st = busy_core()
    st.emit("Lookup", "r2", "b")  # an event buffered and not yet taken by a step
    before = core_state_fingerprint(st)
    call_every_query(Leaky())
    assert core_state_fingerprint(st) != before


def test_effects_are_busy_exactly_when_the_driver_has_more_than_the_result_to_carry_out() -> None:
    """``Effects.busy()`` is what lets ``StepRunner.run`` return at once (no request has a
    wake-up): false for a result alone, a closed request, or a request whose lookup ended with
    nothing pending; true for each thing the driver must carry out."""
    from embcache.core.effects import Effects, Writes
    from embcache.core.entries import Entry

    entry = Entry("k", (4,), "uint8", 0, 256)
    quiet, closed, done = Effects(1), Effects(None), Effects(None)
    closed.closed = done.waiting = RequestState("r")
    assert not any(fx.busy() for fx in (quiet, closed, done))
    own = RequestState("own")  # waits only on its own reservation: nothing pending
    own.waits.add("k")
    own.reserved.add("k")
    other = RequestState("other")  # waits on someone else's load
    other.waits.add("k")
    fields: list[tuple[str, object]] = [
        ("freed", [(0, 256)]), ("wake", [RequestState("w")]), ("events", [{"seq": 1}]),
        ("loads", [entry]), ("writes", Writes("r", [entry])), ("waiting", other),
    ]  # fmt: skip
    for name, value in fields:
        fx = Effects(None)
        setattr(fx, name, value)
        assert fx.busy(), name
    fx = Effects(None)
    fx.waiting = own
    assert not fx.busy()
