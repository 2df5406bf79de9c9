"""The SGLang controller call by call on one rank: SGLang's per-hash pin counts over embcache
requests (``sglang_holds``), single flight, skipped stores, expiry, dtypes, bad arguments."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from embcache import EntryState
from embcache.errors import InvalidArgumentError
from embcache.integrations.sglang import EmbeddingCacheController
from embcache.testing import FaultInjectingStore
from tests.support.helpers import raw, wait_until
from tests.support.sglang_mmencoder import DIM, DTYPE, Modality, embedding

IMAGE = Modality.IMAGE


@pytest.fixture
def store() -> Iterator[FaultInjectingStore]:
    s = FaultInjectingStore(delay_seconds=0.005)
    yield s
    s.release_holds()


@pytest.fixture
def ctl(store: FaultInjectingStore) -> Iterator[EmbeddingCacheController]:
    controller = EmbeddingCacheController(
        store, max_pool_size_gb=(64 << 10) / (1 << 30), hidden_dims={IMAGE: DIM}, dtype=DTYPE
    )
    yield controller
    controller.close()


def stats(ctl: EmbeddingCacheController) -> tuple[int, int]:
    """(pinned entries, open requests)."""
    s = ctl.cache.stats()
    return s.pinned_entries, s.open_requests


def insert(ctl: EmbeddingCacheController, keys: list[str], tokens: list[int]) -> None:
    tensors = [embedding(k, n) for k, n in zip(keys, tokens, strict=True)]
    handles = ctl.store_to_pool_async(keys, tensors, IMAGE)
    ctl.wait_store_to_pool(handles)
    ctl.insert_batch(keys, IMAGE)
    wait_until(lambda: ctl.cache.stats().publishes_started == ctl.cache.stats().publishes_ok)


def prefetch(
    ctl: EmbeddingCacheController, req_id: str, keys: list[str], tokens: list[int]
) -> None:
    ctl.prefetch(req_id, keys, tokens, IMAGE)
    wait_until(lambda: ctl.check_prefetch_progress(req_id), "the prefetch")


def idle(ctl: EmbeddingCacheController) -> None:
    ctl.cache.check_invariants()
    assert stats(ctl) == (0, 0)


def test_reads_count_like_sglang_and_the_last_release_frees_the_pins(
    ctl: EmbeddingCacheController,
) -> None:
    insert(ctl, ["a"], [3])
    prefetch(ctl, "r", ["a"], [3])
    assert ctl.has_local_embedding("a")
    first, second = ctl.get_pool_views(["a"]), ctl.get_pool_views(["a"])
    assert first[0] is not None and second[0] is not None
    assert first[0][0] is not second[0][0]  # new view objects per call
    assert raw(first[0][0]) == raw(embedding("a", 3))
    ctl.release_pool_views(["a"])
    assert stats(ctl) == (1, 1)  # the second read still holds it
    ctl.release_pool_views(["a"])
    idle(ctl)
    assert not ctl.has_local_embedding("a")
    ctl.release_pool_views(["a"])  # an extra release changes nothing
    idle(ctl)


def test_two_requests_for_one_hash_interleaved(ctl: EmbeddingCacheController) -> None:
    insert(ctl, ["a", "b"], [3, 2])
    prefetch(ctl, "r1", ["a", "b"], [3, 2])
    prefetch(ctl, "r2", ["a"], [3])
    views1 = ctl.get_pool_views(["a", "b"])
    views2 = ctl.get_pool_views(["a"])
    ctl.release_pool_views(["a", "b"])  # r1 done: r2's read of "a" keeps it pinned
    # A prefetch's pins end together (one request): r1's "b" waits for "a"'s last reader.
    assert stats(ctl) == (2, 2)
    assert views2[0] is not None and raw(views2[0][0]) == raw(embedding("a", 3))
    assert views1[1] is not None
    ctl.release_pool_views(["a"])
    idle(ctl)


def test_a_release_without_a_read_ends_the_prefetch_pin(ctl: EmbeddingCacheController) -> None:
    insert(ctl, ["a", "b"], [3, 2])
    prefetch(ctl, "r", ["a", "b"], [3, 2])
    assert stats(ctl) == (2, 1)
    ctl.release_pool_views(["a"])  # MMEncoder's finally, after a failed read
    assert stats(ctl) == (2, 1)  # a prefetch's pins end together, with its last hash
    assert not ctl.has_local_embedding("a") and ctl.has_local_embedding("b")
    ctl.release_pool_views(["b"])
    idle(ctl)


def test_a_prefetch_with_a_repeated_hash_and_a_miss_serves_each_hit_once(
    ctl: EmbeddingCacheController,
) -> None:
    insert(ctl, ["a", "b"], [3, 2])
    prefetch(ctl, "r", ["a", "zz", "b", "a"], [3, 4, 2, 3])  # "zz": nowhere, no load
    assert [ctl.has_local_embedding(k) for k in ("a", "zz", "b")] == [True, False, True]
    views = ctl.get_pool_views(["a", "b", "zz"])
    assert views[0] is not None and raw(views[0][0]) == raw(embedding("a", 3))
    assert views[1] is not None and raw(views[1][0]) == raw(embedding("b", 2))
    assert views[2] is None
    ctl.release_pool_views(["a", "b", "zz"])
    idle(ctl)
    assert ctl.get_stats()["holds"] == dict.fromkeys(
        ("running", "tickets", "readers", "backing", "live"), 0
    )


def test_unheld_hashes_get_nothing(ctl: EmbeddingCacheController) -> None:
    insert(ctl, ["a"], [3])  # READY but never prefetched
    assert not ctl.has_local_embedding("a")
    assert ctl.get_pool_views(["a", "zz"]) == [None, None]
    assert ctl.load_to_device_async("a", torch.empty(3, DIM, dtype=DTYPE), 0) is None
    assert asyncio.run(ctl.batch_is_exist(["a", "zz"])) == [True, False]
    idle(ctl)


def test_a_device_copy_lands_at_its_offset_and_its_wait_frees_the_pin(
    ctl: EmbeddingCacheController,
) -> None:
    insert(ctl, ["a"], [3])
    prefetch(ctl, "r", ["a"], [3])
    out = torch.zeros(5, DIM, dtype=DTYPE)
    handle = ctl.load_to_device_async("a", out, 2)
    assert handle is not None and handle.is_complete()
    assert stats(ctl) == (1, 1)
    ctl.wait_load_to_device([handle])
    assert raw(out[2:]) == raw(embedding("a", 3)) and not out[:2].any()
    idle(ctl)


def test_a_failed_device_copy_gives_its_pin_back(ctl: EmbeddingCacheController) -> None:
    insert(ctl, ["a"], [3])
    prefetch(ctl, "r", ["a"], [3])
    with pytest.raises(RuntimeError):
        ctl.load_to_device_async("a", torch.empty(3, DIM + 1, dtype=DTYPE), 0)
    idle(ctl)


def test_a_prefetch_joins_a_staged_insert_instead_of_encoding_again(
    ctl: EmbeddingCacheController,
) -> None:
    handles = ctl.store_to_pool_async(["a"], [embedding("a", 3)], IMAGE)
    assert len(handles) == 1 and ctl.cache.entry_state("a") is EntryState.LOADING
    ctl.prefetch("r", ["a"], [3], IMAGE)
    assert not ctl.check_prefetch_progress("r")  # it waits for the insert
    assert ctl.store_to_pool_async(["a"], [embedding("a", 3)], IMAGE) == []  # being filled
    ctl.wait_store_to_pool(handles)
    wait_until(lambda: ctl.check_prefetch_progress("r"), "the joined prefetch")
    assert ctl.has_local_embedding("a")
    views = ctl.get_pool_views(["a"])
    assert views[0] is not None and raw(views[0][0]) == raw(embedding("a", 3))
    ctl.release_pool_views(["a"])
    wait_until(lambda: ctl.cache.stats().publishes_ok == 1, "the publish")
    idle(ctl)


def test_store_skips_what_sglang_skips_and_takes_cpu_tensors_of_any_dtype(
    ctl: EmbeddingCacheController, store: FaultInjectingStore
) -> None:
    insert(ctl, ["present"], [2])
    store.delete("present")  # the global store lost it: staging it pushes it again
    fresh = embedding("fresh", 4).float().unsqueeze(0)  # (1, tokens, dim), float32, on the CPU
    wide = torch.zeros(2, DIM + 1, dtype=DTYPE)
    keys = ["present", "wide", "fresh"]
    handles = ctl.store_to_pool_async(keys, [embedding("present", 2), wide, fresh], IMAGE)
    assert [h.key for h in handles] == ["fresh"]
    assert stats(ctl) == (1, 1)  # one request: "fresh" reserved, "present" pinned until the wait
    ctl.wait_store_to_pool(handles)
    assert ctl.cache.entry_state("wide") is EntryState.ABSENT
    wait_until(lambda: store.object("fresh") is not None, "the publish")
    assert store.object("fresh") == raw(embedding("fresh", 4).float().to(DTYPE))
    wait_until(lambda: store.object("present") is not None, "the second publish")
    assert store.object("present") == raw(embedding("present", 2))
    assert ctl.store_to_pool_async(["x"], [embedding("x", 2)], Modality.MULTI_IMAGES) == []
    idle(ctl)


def test_abandoned_holds_expire_but_a_reader_keeps_its_pin(ctl: EmbeddingCacheController) -> None:
    insert(ctl, ["a", "b"], [3, 2])
    ctl.hold_timeout_s = 0.05
    prefetch(ctl, "r", ["a", "b"], [3, 2])
    views = ctl.get_pool_views(["a"])  # a reader of "a"; "b" is never read
    staged = ctl.store_to_pool_async(["c"], [embedding("c", 2)], IMAGE)
    time.sleep(0.1)
    ctl.store_to_pool_async([], [], IMAGE)  # any later call expires what is due
    # "a" for its reader, and "b" with it (a prefetch's pins end together); "c" is gone
    assert stats(ctl) == (2, 1) and not ctl.has_local_embedding("b")
    assert ctl.cache.entry_state("c") is EntryState.ABSENT
    ctl.wait_store_to_pool(staged)  # expired: nothing is inserted, nothing raised
    assert ctl.cache.entry_state("c") is EntryState.ABSENT
    assert views[0] is not None and raw(views[0][0]) == raw(embedding("a", 3))
    ctl.release_pool_views(["a"])
    idle(ctl)


def test_a_second_prefetch_of_one_req_id_replaces_the_first(
    ctl: EmbeddingCacheController, store: FaultInjectingStore
) -> None:
    store.put_object("held", raw(embedding("held", 2)))
    from embcache.testing import Fault

    store.inject("held", Fault.HOLD)
    ctl.prefetch("r", ["held"], [2], IMAGE)
    ctl.prefetch("r", ["held"], [2], IMAGE)
    assert stats(ctl) == (0, 1)  # the first one was closed
    store.release_holds()
    wait_until(lambda: ctl.check_prefetch_progress("r"), "the prefetch")
    ctl.release_pool_views(["held"])
    idle(ctl)


def test_bad_arguments_raise_and_change_nothing(ctl: EmbeddingCacheController) -> None:
    with pytest.raises(InvalidArgumentError, match="2 mm_hashes but 1 expected_tokens"):
        ctl.prefetch("r", ["a", "b"], [3], IMAGE)
    with pytest.raises(InvalidArgumentError, match="2 mm_hashes but 1 tensors"):
        ctl.store_to_pool_async(["a", "b"], [embedding("a", 3)], IMAGE)
    with pytest.raises(InvalidArgumentError, match="no embedding dim for modality"):
        ctl.get_embedding_dim(Modality.MULTI_IMAGES)
    ctl.prefetch("r", ["a"], [3], Modality.MULTI_IMAGES)  # SGLang: no pool, nothing happens
    assert ctl.check_prefetch_progress("r") and not ctl.has_local_embedding("a")
    with pytest.raises(InvalidArgumentError, match="gives no pool"):
        EmbeddingCacheController(
            FaultInjectingStore(), max_pool_size_gb=0.0, hidden_dims={IMAGE: 8}
        )
    idle(ctl)


def test_an_unknown_modality_warns_once_per_modality_and_caches_nothing(
    ctl: EmbeddingCacheController, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="embcache.integrations.sglang")
    multi, other = Modality.MULTI_IMAGES, "POINT_CLOUD"
    for _ in range(3):
        ctl.prefetch("r", ["a"], [3], multi)
        assert ctl.store_to_pool_async(["a"], [embedding("a", 3)], multi) == []
        ctl.insert_batch(["a"], multi)
    ctl.store_to_pool_async(["b"], [embedding("b", 3)], other)
    ctl.prefetch("r2", ["b"], [3], other)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("prefetch: unknown modality <Modality.MULTI_IMAGES")
    assert warnings[1].startswith("store_to_pool_async: unknown modality 'POINT_CLOUD'")
    assert all("fall back to the encoder" in w and "IMAGE" in w for w in warnings)
    assert not ctl.has_local_embedding("a") and not ctl.has_local_embedding("b")
    assert ctl.cache.stats().entries == 0
    insert(ctl, ["c"], [2])  # a known modality still caches, and warns about nothing
    prefetch(ctl, "r3", ["c"], [2])
    assert ctl.has_local_embedding("c")
    ctl.release_pool_views(["c"])
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    idle(ctl)


def test_dims_per_modality_follow_sglang(store: FaultInjectingStore) -> None:
    ctl = EmbeddingCacheController(
        store, max_pool_size_gb=1 / 1024, hidden_dims={Modality.VIDEO: 12}, dtype=DTYPE
    )
    try:
        assert ctl.get_embedding_dim(IMAGE) == 12  # vision: IMAGE, else VIDEO
        assert ctl.get_embedding_dim(Modality.AUDIO) == 12  # audio falls back to vision
        stats_dict = ctl.get_stats()
        assert stats_dict["num_cached"] == 0 and stats_dict["total_mb"] == 1.0
        assert stats_dict["embcache"]["capacity_bytes"] == 1 << 20
    finally:
        ctl.close()


def test_concurrent_requests_over_shared_keys_serve_the_right_bytes(
    store: FaultInjectingStore,
) -> None:
    """MMEncoder serves requests concurrently on rank 0: 4 threads, overlapping keys, a pool
    that holds a third of them (evictions, no space, joins of each other's staged inserts)."""
    import random
    import threading

    from tests.support.sglang_mmencoder import Encoder, serve

    ctl = EmbeddingCacheController(
        store, max_pool_size_gb=(2 << 10) / (1 << 30), hidden_dims={IMAGE: DIM}, dtype=DTYPE
    )
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for n in range(25):
                keys = rng.sample([f"c{i}" for i in range(24)], 3)
                tokens = [4 + int(k[1:]) % 5 for k in keys]
                served = serve(
                    ctl,
                    0,
                    1,
                    f"w{seed}-{n}",
                    keys,
                    tokens,
                    Encoder(),
                    gpu_output=bool(n % 2),
                    prefetch_timeout_s=10,
                )
                want = torch.cat([embedding(k, t) for k, t in zip(keys, tokens, strict=True)])
                assert served.output is not None and raw(served.output) == raw(want)
                served.finish()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert not errors, errors[0]
        wait_until(lambda: ctl.cache.stats().publishes_ok == ctl.cache.stats().publishes_started)
        idle(ctl)
        s = ctl.cache.stats()
        assert s.evictions > 0 and s.hits > 0, s
    finally:
        ctl.close()


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_a_subclass_picks_the_cache_policy(store: FaultInjectingStore, policy: str) -> None:
    class Controller(EmbeddingCacheController):
        cache_policy = policy

    two = 2 * 8 * DIM * DTYPE.itemsize  # a pool of two 8-token entries
    ctl = Controller(store, max_pool_size_gb=two / (1 << 30), hidden_dims={IMAGE: DIM}, dtype=DTYPE)
    try:
        insert(ctl, ["a", "b"], [8, 8])
        for n in range(3):
            prefetch(ctl, f"r{n}", ["a", "b"], [8, 8])
            ctl.release_pool_views(["a", "b"])
        insert(ctl, ["c"], [8])  # evicts a read entry under lru, refused under tinylfu
        held = {k for k in "abc" if ctl.cache.entry_state(k) is EntryState.READY}
        assert held == ({"b", "c"} if policy == "lru" else {"a", "b"})
        assert ctl.cache.stats().admissions_refused == (policy == "tinylfu")
        idle(ctl)
    finally:
        ctl.close()


def test_legacy_insert_batch_pushes_present_keys_too(store: FaultInjectingStore) -> None:
    from embcache.integrations.sglang_legacy import LegacyEmbeddingCacheController

    ctl = LegacyEmbeddingCacheController(
        0, 1, 1 / 1024, {IMAGE: DIM}, embedding_store=store, dtype=DTYPE
    )
    try:
        assert ctl.insert_batch(["a"], [embedding("a", 3)]) == [True]
        wait_until(lambda: store.object("a") is not None, "the publish")
        store.delete("a")  # lost by the global store
        assert ctl.insert_batch(["a", "b"], [embedding("a", 3), embedding("b", 2)]) == [False, True]
        wait_until(lambda: None not in (store.object("a"), store.object("b")), "the publishes")
        assert store.object("a") == raw(embedding("a", 3))
        assert ctl.cache.stats().publishes_ok == 3
        idle(ctl)  # type: ignore[arg-type]
    finally:
        ctl.close()


def test_has_local_embedding_answers_for_the_callers_own_prefetch(
    ctl: EmbeddingCacheController,
) -> None:
    """A request whose prefetch missed a hash must not be told it is local because another
    request's prefetch pins it: that request may read and release it before this one reads."""
    import contextvars

    late, early = contextvars.Context(), contextvars.Context()
    late.run(prefetch, ctl, "late", ["k"], [3])  # k not cached yet: a miss
    insert(ctl, ["k"], [3])
    early.run(prefetch, ctl, "early", ["k"], [3])
    assert not late.run(ctl.has_local_embedding, "k")  # was True: the other request's ticket
    assert early.run(ctl.has_local_embedding, "k")
    assert early.run(ctl.get_pool_views, ["k"])[0] is not None
    early.run(ctl.release_pool_views, ["k"])
    idle(ctl)


def test_a_reader_takes_its_own_prefetchs_pin_first(ctl: EmbeddingCacheController) -> None:
    """Two requests pin the same hash; the second reads and releases first. The first request's
    pin must still be there for its own read (it was the one used up by the other's read)."""
    import contextvars

    insert(ctl, ["k"], [3])
    first, second = contextvars.Context(), contextvars.Context()
    first.run(prefetch, ctl, "first", ["k"], [3])
    second.run(prefetch, ctl, "second", ["k"], [3])
    assert first.run(ctl.has_local_embedding, "k") and second.run(ctl.has_local_embedding, "k")
    assert second.run(ctl.get_pool_views, ["k"])[0] is not None
    second.run(ctl.release_pool_views, ["k"])
    assert first.run(ctl.has_local_embedding, "k")
    views = first.run(ctl.get_pool_views, ["k"])[0]
    assert views is not None and raw(views[0]) == raw(embedding("k", 3))
    first.run(ctl.release_pool_views, ["k"])
    idle(ctl)


class GatedStore(FaultInjectingStore):
    """A store whose ``exists`` waits (10 s at most) until ``gate`` is set, and records the keys
    asked and whether it was let go (True) or gave up (False)."""

    def __init__(self) -> None:
        super().__init__(delay_seconds=0.005)
        self.asked = threading.Event()
        self.gate = threading.Event()
        self.let_go: list[bool] = []
        self.asked_keys: list[list[str]] = []

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.asked_keys.append(list(keys))
        self.asked.set()
        self.let_go.append(self.gate.wait(10))
        return super().exists(keys)


def test_batch_is_exist_asks_the_store_off_the_event_loop() -> None:
    """While the global store answers ``exists``, the event loop that awaits ``batch_is_exist``
    runs other tasks: here the store's answer waits for a task on that loop to let it go. A
    query run on the loop's thread would block the loop until the store gave up (10 s), the
    task would not run in time, and ``let_go`` would read [False]."""
    store = GatedStore()
    ctl = EmbeddingCacheController(
        store, max_pool_size_gb=(64 << 10) / (1 << 30), hidden_dims={IMAGE: DIM}, dtype=DTYPE
    )
    try:
        insert(ctl, ["a"], [3])
        store.put_object("g", raw(embedding("g", 2)))

        async def query() -> list[bool]:
            asking = asyncio.ensure_future(ctl.batch_is_exist(["a", "g", "zz"]))
            while not store.asked.is_set():  # runs only while the loop is free
                await asyncio.sleep(0.001)
            store.gate.set()
            return await asking

        assert asyncio.run(query()) == [True, True, False]
        assert store.let_go == [True], "the store's call blocked the event loop"
        assert store.asked_keys == [["g", "zz"]], "the local hit is not asked of the store"
        idle(ctl)
    finally:
        ctl.close()
