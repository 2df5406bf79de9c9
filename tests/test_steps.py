"""Few steps per request (embcache/DESIGN.md, "Steps"; docs/architecture.md): the funnel calls
(``StepRunner.run``, each a lock, a core step and its ``Effects``) one request costs end to
end, through ``Request``, the pipeline and the SGLang adapter's MMEncoder sequence. An all-hit
request takes at most two (the lookup that serves the views, the close), one with misses at
most three (the lookup that reserves, the insert, the close). The ends of store transfers
(``end_loads``, ``end_publishes``) run on the cache's I/O threads, not the request's, and are
counted apart. A planted extra step is caught."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item, Request, Status
from embcache.integrations.sglang import EmbeddingCacheController
from embcache.testing import FaultInjectingStore
from tests.support.funnel import Funnel, replace_funnel
from tests.support.sglang_mmencoder import DIM, DTYPE, Encoder, serve

SHAPE = (4, 16)
IO_STEPS = {"end_loads", "end_publishes"}  # a transfer's end, on an I/O thread


class Steps:
    """Counts the funnel calls of ``cache`` by step name, from every thread: ``request`` (the
    steps of the requests themselves) and ``io`` (the transfers' ends)."""

    def __init__(self, cache: EmbeddingCache) -> None:
        self.names: list[str] = []
        self._lock = threading.Lock()
        def wrap(run: Funnel) -> Funnel:
            def counting(step: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    self.names.append(step.__name__)
                return run(step, *args, **kwargs)

            return counting

        replace_funnel(cache, wrap)

    def take(self) -> tuple[list[str], list[str]]:
        """The request steps and the I/O steps since the last call."""
        with self._lock:
            names, self.names = self.names, []
        return [n for n in names if n not in IO_STEPS], [n for n in names if n in IO_STEPS]


def tensor(key: str) -> torch.Tensor:
    return torch.full(SHAPE, float(len(key)), dtype=torch.float16)


def items(*keys: str) -> list[Item]:
    return [Item(k, SHAPE, torch.float16) for k in keys]


@pytest.fixture
def cache() -> Iterator[EmbeddingCache]:
    with EmbeddingCache(1 << 16, auto_fence=None, pin_memory=False) as c:
        with c.request("seed") as seed:
            seed.insert(["a", "b"], [tensor("a"), tensor("b")], publish=False)
        yield c


def read_everything(request: Request) -> None:
    """What a caller reads after its lookup: views, mask, reasons, offsets."""
    request.embeddings()
    request.fallback_list()
    request.fallback_reasons()
    request.offsets()


def all_hit_request(cache: EmbeddingCache) -> None:
    request, statuses = cache.lookup("hit", items("a", "b"), reserve_misses=True)
    with request:
        assert [s.status for s in statuses] == [Status.HIT, Status.HIT]
        read_everything(request)


def request_with_misses(cache: EmbeddingCache) -> None:
    request, statuses = cache.lookup("miss", items("a", "x", "y"), reserve_misses=True)
    with request:
        assert [s.status for s in statuses] == [Status.HIT, Status.RESERVED, Status.RESERVED]
        read_everything(request)
        assert request.fallback_list() == [0, 1, 1]
        assert request.insert(["x", "y"], [tensor("x"), tensor("y")]) == [True, True]


@pytest.mark.parametrize(
    ("request_of", "names"),
    [
        (all_hit_request, ["begin_lookup", "end_request"]),
        (request_with_misses, ["begin_lookup", "end_inserts", "end_request"]),
    ],
    ids=["all hits: two steps", "with misses: three steps"],
)
def test_a_request_takes_two_steps_and_one_more_with_misses(
    cache: EmbeddingCache, request_of: Callable[[EmbeddingCache], None], names: list[str]
) -> None:
    steps = Steps(cache)
    request_of(cache)
    assert steps.take() == (names, [])


def test_a_request_opened_first_adds_its_open_step(cache: EmbeddingCache) -> None:
    """``cache.request(id)`` keeps its contract (a taken id raises there, before any lookup),
    so it is a step of its own: the fused ``cache.lookup`` is the two-step form."""
    steps = Steps(cache)
    with cache.request("r") as request:
        request.lookup(items("a", "b"))
        read_everything(request)
    assert steps.take() == (["open_request", "begin_lookup", "end_request"], [])


def test_a_planted_extra_step_is_counted(
    cache: EmbeddingCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug: the views asked of the core again, though the lookup served them."""
    embeddings = Request.embeddings

    def asking(self: Request) -> list[torch.Tensor | None]:
        # private: the planted bug forgets what the lookup's step handed back
        self._served = None
        return embeddings(self)

    monkeypatch.setattr(Request, "embeddings", asking)
    steps = Steps(cache)
    all_hit_request(cache)
    names, _ = steps.take()
    assert len(names) == 3 and "finish_lookup" in names, names


class Doubler:
    device = torch.device("cpu")

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x * 2 for x in inputs]


def test_the_pipeline_takes_two_steps_to_serve_hits_and_three_with_misses(
    cache: EmbeddingCache,
) -> None:
    pipeline = EncodePipeline(cache, Doubler())
    inputs = [tensor("p"), tensor("q")]
    steps = Steps(cache)
    pipeline.encode("first", items("p", "q"), inputs)  # misses: encoded, inserted
    assert steps.take() == (["begin_lookup", "end_inserts", "end_request"], [])
    pipeline.encode("again", items("p", "q"), inputs)  # hits
    assert steps.take() == (["begin_lookup", "end_request"], [])


def test_the_sglang_adapter_serves_mmencoder_in_two_steps_and_three_with_misses() -> None:
    store = FaultInjectingStore()
    controller = EmbeddingCacheController(
        store, max_pool_size_gb=(64 << 10) / (1 << 30), hidden_dims={"IMAGE": DIM}, dtype=DTYPE
    )
    try:
        steps = Steps(controller.cache)
        keys, tokens = ["m1", "m2"], [4, 4]
        first = serve(controller, 0, 1, "r1", keys, tokens, Encoder())  # misses, stored
        first.finish()
        deadline = time.monotonic() + 10  # the publish ends on an I/O thread: wait for it
        while time.monotonic() < deadline:
            stats = controller.cache.stats()
            ended = stats.publishes_ok + stats.publishes_failed + stats.publishes_unknown
            if stats.publishes_started and ended == stats.publishes_started:
                break
            time.sleep(0.01)
        names, io = steps.take()
        assert names == ["begin_lookup", "end_inserts", "end_request"], names
        assert io == ["end_publishes"], io  # the publish's end, on an I/O thread
        again = serve(controller, 0, 1, "r2", keys, tokens, Encoder())  # hits
        again.finish()
        assert again.fallback_mask == [0, 0]
        assert steps.take() == (["begin_lookup", "end_request"], [])
    finally:
        controller.close()
        store.release_holds()

