"""In-place fills (``Request.begin_fill`` / ``end_fill``, ``embcache/driver/fills.py``): an insert
whose bytes someone else writes, ended with the writer's outcome; and the fused lookups
(``open_lookup``, ``lookup_offsets``, ``offsets``). ``check_invariants()`` after every step."""

from __future__ import annotations

import pytest
import torch

from embcache import (
    ClosedError,
    EmbeddingCache,
    EntryState,
    InvalidArgumentError,
    InvalidTypeError,
    Item,
    RequestError,
    TransferOutcome,
)

OK, FAILED, UNKNOWN = TransferOutcome.OK, TransferOutcome.FAILED, TransferOutcome.UNKNOWN
ITEM = Item("k", (4, 16), torch.float16)  # 128 bytes


def cache(capacity: int = 1024) -> EmbeddingCache:
    return EmbeddingCache(capacity, pin_memory=False, auto_fence=None)


def write(c: EmbeddingCache, offset: int, tensor: torch.Tensor) -> None:
    """What the outside writer does: its bytes into the pool at ``offset``."""
    c.pool[offset : offset + tensor.nbytes].copy_(tensor.view(torch.uint8).flatten())


def test_a_fill_is_loading_until_its_writer_says_ok_then_ready_and_pinned() -> None:
    c = cache()
    tensor = torch.arange(64, dtype=torch.float16).view(4, 16)
    with c.request("r") as r:
        [offset] = r.begin_fill([ITEM])
        assert offset is not None and c.entry_state("k") is EntryState.LOADING
        c.check_invariants()
        with c.request("other") as other:  # not readable while LOADING: the other waits
            assert other.lookup([ITEM])[0].status.name == "LOADING"
        write(c, offset, tensor)
        assert r.end_fill(["k"], [OK], publish=False) == [True]
        c.check_invariants()
        assert c.entry_state("k") is EntryState.READY and c.stats().pinned_entries == 1
    with c.request("reader") as reader:
        assert reader.lookup_offsets([ITEM]) == [offset]
        view = reader.embeddings()[0]
        assert view is not None and torch.equal(view, tensor)
    c.check_invariants()
    assert c.stats().pinned_entries == 0


@pytest.mark.parametrize(
    ("outcome", "after"), [(FAILED, EntryState.ABSENT), (UNKNOWN, EntryState.QUARANTINED)]
)
def test_a_failed_fill_is_freed_and_an_unknown_one_quarantined_until_a_fence(
    outcome: TransferOutcome, after: EntryState
) -> None:
    c = cache()
    with c.request("r") as r:
        r.begin_fill([ITEM])
        assert r.end_fill(["k"], [outcome]) == [False]
        assert c.entry_state("k") is after
        c.check_invariants()
    assert c.fence() == (outcome is UNKNOWN)
    assert c.entry_state("k") is EntryState.ABSENT
    c.check_invariants()


def test_a_request_closed_with_a_fill_handed_out_quarantines_it() -> None:
    """The writer may still write (a rank that died mid-write): UNKNOWN, never freed."""
    c = cache()
    with c.request("r") as r:
        r.begin_fill([ITEM])
    assert c.entry_state("k") is EntryState.QUARANTINED
    c.check_invariants()
    assert c.stats().entries == 1  # held: neither free nor reused
    assert c.fence() == 1 and c.entry_state("k") is EntryState.ABSENT


def test_only_absent_keys_are_filled_and_only_handed_out_ones_ended() -> None:
    c = cache(512)
    with c.request("seed") as seed:
        seed.insert(["k"], [torch.zeros(4, 16, dtype=torch.float16)], publish=False)
    big = Item("big", (1024, 16), torch.float16)  # larger than the pool
    with c.request("r") as r:
        assert r.begin_fill([ITEM, big]) == [None, None]
        assert r.end_fill(["k"], [OK]) == [False]  # never handed out: left alone
        c.check_invariants()
    assert c.entry_state("k") is EntryState.READY


def test_bad_arguments_are_refused_and_change_nothing() -> None:
    c = cache()
    with c.request("r") as r:
        with pytest.raises(InvalidTypeError):
            r.begin_fill(ITEM)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            r.end_fill(["k", "j"], [OK])
        with pytest.raises(InvalidTypeError):
            r.end_fill(["k"], ["OK"])  # type: ignore[list-item]
        with pytest.raises(InvalidTypeError):
            r.lookup_offsets(ITEM)  # type: ignore[arg-type]
    with pytest.raises(ClosedError):
        r.begin_fill([ITEM])
    c.check_invariants()
    assert c.stats().entries == 0


def test_open_lookup_is_request_lookup_and_offsets_in_one() -> None:
    c = cache()
    with c.request("seed") as seed:
        seed.insert(["k"], [torch.ones(4, 16, dtype=torch.float16)], publish=False)
        [offset] = seed.lookup_offsets([ITEM]) or [None]
    other = Item("j", (4, 16), torch.float16)
    request, offsets = c.open_lookup("r", [ITEM, other])
    assert offsets == [offset, None] and c.stats().pinned_entries == 1
    with pytest.raises(RequestError):
        c.open_lookup("r", [ITEM])
    with c.request("filler") as filler:
        filler.begin_fill([other])
        assert request.lookup_offsets([other]) is None  # waits on the fill: pending
        assert not request.wait(0)
        filler.end_fill(["j"], [OK])
        assert request.wait(0) and request.offsets()[1] is not None
    request.close()
    c.check_invariants()
    assert c.stats().open_requests == 0 and c.stats().pinned_entries == 0
