"""The real allocator and the reference model get the same calls; results must match exactly.

Tiny capacities (a shrink knob in the spirit of sortedcontainers) make splits, merges, full
pools and best-fit ties happen on most steps.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from embcache.driver.allocator import RangeAllocator
from models.allocator import ModelAllocator


def outcome(call: Any) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except Exception as exc:  # compared by type: the model predicts the exception class
        return ("error", type(exc))


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(units=st.integers(1, 24), alignment=st.sampled_from([1, 8, 256]))
    def setup(self, units: int, alignment: int) -> None:
        self.real = RangeAllocator(units * alignment, alignment)
        self.model = ModelAllocator(units * alignment, alignment)

    def capacity(self) -> int:
        return self.model.capacity

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        nbytes = data.draw(st.integers(1, self.capacity()))
        assert outcome(lambda: self.real.allocate(nbytes)) == outcome(
            lambda: self.model.allocate(nbytes)
        )

    @rule(nbytes=st.one_of(st.integers(-3, 0), st.just(True), st.floats(1, 9), st.just(10**12)))
    def allocate_bad(self, nbytes: Any) -> None:
        assert outcome(lambda: self.real.allocate(nbytes)) == outcome(
            lambda: self.model.allocate(nbytes)
        )

    @rule(data=st.data())
    def free_live(self, data: st.DataObject) -> None:
        if self.model.allocated:
            offset = data.draw(st.sampled_from(sorted(self.model.allocated)))
            assert self.real.free(offset) == self.model.free(offset)

    @rule(offset=st.one_of(st.integers(-1, 24 * 256 + 1), st.just(None), st.just(False)))
    def free_any(self, offset: Any) -> None:
        assert outcome(lambda: self.real.free(offset)) == outcome(lambda: self.model.free(offset))

    @rule(offset=st.integers(0, 24 * 256))
    def size_of(self, offset: int) -> None:
        assert outcome(lambda: self.real.size_of(offset)) == outcome(
            lambda: self.model.size_of(offset)
        )

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "real"):
            return
        self.real.check_invariants()
        assert self.real.allocations() == sorted(self.model.allocated.items())
        assert self.real.free_blocks() == self.model.free_blocks()
        assert self.real.allocated_bytes == self.model.allocated_bytes
        assert self.real.free_bytes == self.model.free_bytes
        assert self.real.largest_free_block == self.model.largest_free_block


TestAllocatorMachine = AllocatorMachine.TestCase
