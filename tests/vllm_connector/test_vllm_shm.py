"""The shared pool of the vLLM connector: mode 0600, a name nobody can guess, nothing in
/dev/shm while it lives, after a shutdown or after its owner is SIGKILLed; and the
``EmbeddingCache(pool=...)`` argument it rests on."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import stat
from collections.abc import Callable
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, InvalidArgumentError, InvalidTypeError, StoreUnavailableError
from tests.vllm_connector.vllm_replay import pool_owner_main

pytestmark = pytest.mark.timeout(300)
SMALL = {"pool_bytes": 64 * 1024}


def shm_names_with(token: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if token in name or "embcache" in name]


def handle_of(connector: Any) -> Any:
    from tests.support.vllm_wheel import SchedulerOutput

    return connector.build_connector_meta(SchedulerOutput()).pool


def test_the_pool_is_private_unguessable_and_never_in_dev_shm(
    make_scheduler: Callable[..., Any],
) -> None:
    from embcache.integrations.vllm.shm import attach

    first, second = make_scheduler(SMALL), make_scheduler(SMALL)
    one, two = handle_of(first), handle_of(second)
    assert re.fullmatch("[0-9a-f]{32}", one.token) and one.token != two.token
    assert os.readlink(one.path).startswith(f"/memfd:embcache-vllm-{one.token}")
    assert stat.S_IMODE(os.stat(one.path).st_mode) == 0o600
    assert one.size == SMALL["pool_bytes"]  # the pool is all: no staging area
    assert shm_names_with(one.token) == []
    mapped = attach(one)
    mapped[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert first.scheduler_side.cache.pool[:4].tolist() == [1, 2, 3, 4]  # the same memory
    first.shutdown()
    assert shm_names_with(one.token) == []
    with pytest.raises(StoreUnavailableError, match="cannot map the scheduler's shared pool"):
        attach(one)
    forged = type(two)(two.pid, two.fd, one.token, two.size)  # another pool's token
    with pytest.raises(StoreUnavailableError, match="not the pool"):
        attach(forged)


def test_a_sigkilled_owner_leaves_nothing_behind(vllm_base: Any) -> None:
    from embcache.integrations.vllm.shm import attach

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    owner = ctx.Process(target=pool_owner_main, args=(child, SMALL))
    owner.start()
    try:
        assert conn.poll(120), "the owner process did not start"
        handle = conn.recv()
        mapped = attach(handle)
        mapped[-1] = 7
        os.kill(handle.pid, signal.SIGKILL)
        owner.join(30)
        assert owner.exitcode == -signal.SIGKILL
        assert int(mapped[-1]) == 7  # a rank's mapping outlives the owner; the name does not
        assert shm_names_with(handle.token) == []
        with pytest.raises(StoreUnavailableError, match=f"process {handle.pid} must be alive"):
            attach(handle)
    finally:
        if owner.is_alive():
            owner.kill()
            owner.join(30)


def test_a_cache_runs_on_a_pool_it_is_given() -> None:
    pool = torch.zeros(4096, dtype=torch.uint8)
    with EmbeddingCache(4096, pool=pool) as cache:
        assert cache.pool is pool
        with cache.request("r") as r:
            r.insert(["k"], [torch.full((4,), 3.0)], publish=False)
        assert pool[:16].view(torch.float32).tolist() == [3.0] * 4


@pytest.mark.parametrize(
    ("pool", "error", "words"),
    [
        (bytearray(4096), InvalidTypeError, "pool must be a torch.Tensor or None, got bytearray"),
        (torch.zeros(4096, dtype=torch.int8), InvalidArgumentError, "torch.int8 of shape"),
        (torch.zeros(64, 64, dtype=torch.uint8), InvalidArgumentError, r"shape \(64, 64\)"),
        (torch.zeros(8192, dtype=torch.uint8)[::2], InvalidArgumentError, "contiguous"),
        (torch.zeros(2048, dtype=torch.uint8), InvalidArgumentError, "got 2048 bytes on cpu"),
    ],
)
def test_a_pool_that_cannot_be_the_pool_is_refused(pool: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        EmbeddingCache(4096, pool=pool)
