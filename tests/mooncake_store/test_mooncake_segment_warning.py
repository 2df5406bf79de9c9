"""Workers that lend the global store no memory are told so, once.

Against a real ``mooncake_master`` of this test alone (no other worker's segment mounted): two
caches with the default ``global_segment_size=0`` share it, so every publish fails for lack of
space; each store logs one warning naming ``global_segment_size``, and once a third worker
lends memory, publishing works.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pytest
import torch

from embcache import EmbeddingCache
from embcache.store.mooncake import MooncakeStore
from tests.support.helpers import item_of, payload, wait_until

if TYPE_CHECKING:
    from embcache.store.mooncake_master import MooncakeMaster

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(90)]


def publish(cache: EmbeddingCache, key: str, seed: int) -> None:
    tensor = payload((64, 64), torch.float32, seed)
    with cache.request(f"publish-{key}") as req:
        req.lookup([item_of(key, tensor)], reserve_misses=True)
        req.insert([key], [tensor], publish=True)


def publishes_ended(cache: EmbeddingCache) -> int:
    s = cache.stats()
    return s.publishes_ok + s.publishes_failed + s.publishes_unknown


def warnings_about_segment(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "embcache.store.mooncake" and "global_segment_size" in r.getMessage()
    ]


def test_workers_lending_no_memory_publish_nothing_and_say_what_to_set(
    private_mooncake_master: MooncakeMaster, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="embcache.store.mooncake")
    kwargs = {**private_mooncake_master.store_kwargs(), "key_prefix": key_prefix}
    caches = [
        EmbeddingCache(1 << 20, store=MooncakeStore(**kwargs), pin_memory=False, republish=None)  # type: ignore[arg-type]
        for _ in range(2)  # (no retries of the failed publishes: each one counted once)
    ]
    lender: MooncakeStore | None = None
    try:
        for worker, cache in enumerate(caches):
            for i in range(3):
                publish(cache, f"w{worker}-{i}", seed=10 * worker + i)
            wait_until(lambda c=cache: publishes_ended(c) == 3, "the publishes to end")  # type: ignore[misc]
            s = cache.stats()
            assert (s.publishes_ok, s.publishes_failed) == (0, 3), "no memory, no publish"
        logged = warnings_about_segment(caplog)
        assert len(logged) == 2, f"one warning per store, not per put: {logged}"
        for message in logged:
            assert "global_segment_size=0" in message and "NO_AVAILABLE_HANDLE" in message
            assert "MOONCAKE_GLOBAL_SEGMENT_SIZE" in message
            assert private_mooncake_master.master_address in message

        # Doing what the warning says: one worker lends memory; now publishes succeed.
        lender = MooncakeStore(**kwargs, global_segment_size=64 << 20)  # type: ignore[arg-type]
        lender.connect()
        publish(caches[0], "after-lending", seed=99)
        wait_until(lambda: publishes_ended(caches[0]) == 4, "the publish to end")
        assert caches[0].stats().publishes_ok == 1
        assert len(warnings_about_segment(caplog)) == 2
    finally:
        for cache in caches:
            cache.close()
        if lender is not None:
            lender.close()
