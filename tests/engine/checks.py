"""The engine tier's checks, each a function of a ``World`` and the ``Reference``
answers: the tests run them on engines with ``EmbcacheECConnector``, the self-test on engines
with ``tests/engine/liar.py``'s ``LyingECConnector``, where each must raise AssertionError.

Each check uses images of its own (numbers in disjoint ranges), so the checks can share
engines and run in any order, with one exception: ``sigkill_leaves_nothing`` kills engine A.

Engines: A and B (``ec_both``, a pool that holds every image of a check, on one master), D
(``ec_both``, a pool of three images, on the same master, vLLM's own encoder cache cut to a
few images so that the connector is asked again and again).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.support.engines import (
    MISS,
    EngineProcess,
    Prompt,
    World,
    memfds_of,
    shm_entries,
    shm_paths_of,
    wait_for,
)

ITEM_BYTES = 37 * 128 * 4  # one image: 37 rows (36 patches and CLS) x 128 float32
POOL_AB = 4 << 20
POOL_D = 64 << 10  # three images
PUBLISH_TIMEOUT_S = 60.0


def prompt(images: Sequence[int], salt: int = 0) -> Prompt:
    """A prompt with ``images`` and three words chosen by ``images`` and ``salt``."""
    base = sum(images) * 7 + salt * 13
    return {"words": [f"w{(base + 31 * j) % 200}" for j in range(3)], "images": list(images)}


class Reference:
    """Answers of the engine without a connector, computed once per prompt."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self._answers: dict[str, list[int]] = {}

    def __call__(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        missing = [p for p in prompts if _key(p) not in self._answers]
        if missing:
            got = self.engine.generate(missing)["tokens"]
            self._answers.update(zip(map(_key, missing), got, strict=True))
        return [self._answers[_key(p)] for p in prompts]


def _key(p: Prompt) -> str:
    return f"{p['words']}|{p['images']}"


def served(engine: EngineProcess, prompts: Sequence[Prompt], ref: Reference) -> dict[str, Any]:
    """``engine``'s answers to ``prompts``, checked against the reference's."""
    out = engine.generate(prompts)
    want = ref(prompts)
    wrong = [i for i, (a, b) in enumerate(zip(out["tokens"], want, strict=True)) if a != b]
    assert not wrong, f"engine {engine.name}: answers {wrong} differ from the reference's"
    return out


def published(engine: EngineProcess, at_least: int) -> dict[str, Any]:
    """Wait until ``engine``'s cache has published ``at_least`` items in all."""
    stats = wait_for(
        f"engine {engine.name} to publish {at_least} items",
        lambda: (s := engine.stats())["cache"]["publishes_ok"] >= at_least and s,
        PUBLISH_TIMEOUT_S,
    )
    return stats  # type: ignore[no-any-return]


def healthy(*engines: EngineProcess) -> None:
    """Each engine alive, its connector's invariants hold, no encoder cache miss in its log."""
    for engine in engines:
        assert engine.alive(), f"engine {engine.name} died\n{engine.log_tail()}"
        engine.call("check")
        assert MISS not in engine.log_text(), f"engine {engine.name} logged '{MISS}'"


def b_loads_what_a_encoded(world: World, ref: Reference) -> None:
    """A encodes and publishes twelve images; B serves eight of them in other prompts with its
    encoder idle for all of them, and every answer is the reference's."""
    a, b = world["A"], world["B"]
    before = a.stats()["cache"]["publishes_ok"]
    first = [prompt([i]) for i in range(10)] + [prompt([10, 11])]
    out_a = served(a, first, ref)
    assert len(set(out_a["encoded"])) == 12 and out_a["vision_images"] == 12, out_a
    published(a, before + 12)
    loads = b.stats()["connector"]["loads"]
    second = [prompt(g, salt=1) for g in ([0, 1], [2], [3, 4], [5], [6, 7], [1], [4, 0])]
    out_b = served(b, second, ref)
    assert out_b["encoded"] == [] and out_b["vision_images"] == 0, (
        f"B's encoder ran for images A had published: {out_b['encoded']}"
    )
    assert out_b["connector"]["loads"] - loads >= 8, out_b["connector"]
    healthy(a, b)


def b_survives_the_master(world: World, ref: Reference) -> None:
    """The master is killed while B serves: B goes on answering right, encoding what it can no
    longer load; no engine dies; after a restart B publishes again and A loads what B
    published then."""
    a, b, master = world["A"], world["B"], world.master
    before = a.stats()["cache"]["publishes_ok"]
    served(a, [prompt([i]) for i in range(100, 110)], ref)
    published(a, before + 10)
    during = [prompt([100, 101], salt=2), prompt([102], salt=2)]
    b.send("generate", requests=during, max_tokens=6)
    time.sleep(0.2)
    master.kill()
    out = b.receive()
    assert out["tokens"] == ref(during), "B's answers while the master died"
    down = [prompt([i], salt=2) for i in range(103, 108)] + [prompt([0, 2], salt=2)]
    out = served(b, down, ref)
    assert out["vision_images"] >= 5, f"B cannot load 103..107 with no master: {out}"
    served(a, [prompt([108, 109], salt=2), prompt([110])], ref)
    healthy(a, b)
    master.start()
    from_b = publishing_resumed(b, range(120, 140), ref)
    publishing_resumed(a, range(140, 160), ref)  # A's client is back on the master too
    out_a = served(a, [prompt([i], salt=4) for i in from_b], ref)
    assert out_a["vision_images"] == 0, f"A encoded what B published after the restart: {out_a}"
    healthy(a, b)


def publishing_resumed(
    engine: EngineProcess, images: Sequence[int], ref: Reference, want: int = 2
) -> list[int]:
    """Serve one new image at a time until ``want`` of them were published (the store
    reconnects within its probe interval; what failed to publish meanwhile is retried from
    the backlog: each image is served once the backlog is empty, so its publish is the one
    that ends)."""
    done = []
    for image in images:
        before = wait_for(
            f"engine {engine.name}'s publish backlog to empty",
            lambda: (c := engine.stats()["cache"])["publish_backlog"] == 0 and c,
            PUBLISH_TIMEOUT_S,
        )
        served(engine, [prompt([image], salt=3)], ref)
        after = wait_for(
            f"engine {engine.name}'s publish of image {image} to end",
            lambda started=before["publishes_started"]: _settled(engine, started),
            PUBLISH_TIMEOUT_S,
        )
        if after["publishes_ok"] > before["publishes_ok"]:
            done.append(image)
            if len(done) == want:
                return done
        time.sleep(0.5)
    raise AssertionError(f"engine {engine.name} published {done} of images {images}")


def _settled(engine: EngineProcess, started: int) -> dict[str, Any] | None:
    """``engine``'s cache stats once a publish after the first ``started`` ended, else None."""
    cache: dict[str, Any] = engine.stats()["cache"]
    ended = cache["publishes_ok"] + cache["publishes_failed"] + cache["publishes_unknown"]
    return (
        cache
        if cache["publishes_started"] > started and ended == cache["publishes_started"]
        else None
    )


def sigkill_leaves_nothing(world: World, ref: Reference) -> None:
    """A is SIGKILLed: nothing it had in /dev/shm is left there (its pool is a memfd, which
    dies with it), and B serves on, right. (What other processes leave in /dev/shm meanwhile
    is not A's: only the paths A had open or mapped are checked.)"""
    a, b = world["A"], world["B"]
    before = a.stats()["cache"]["publishes_ok"]
    served(a, [prompt([i]) for i in range(200, 204)], ref)
    published(a, before + 4)
    mine = shm_paths_of(a.pid)
    pools = memfds_of(a.pid)
    assert pools, f"A maps no memfd: where is its pool? ({mine})"
    a.kill()
    left = sorted(p for p in mine if p in shm_entries())
    assert not left, f"A left {left} in /dev/shm"
    served(b, [prompt([i], salt=5) for i in range(200, 205)] + [prompt([0, 3], salt=5)], ref)
    healthy(b)


def tiny_pool_200_requests(world: World, ref: Reference) -> None:
    """D, whose pool holds three of its 40 images, serves 200 requests of one or two of them
    in batches of 50: no encoder cache miss, the reference's answers, and the connector both
    evicted and loaded."""
    d = world["D"]
    rng = random.Random(30)
    prompts = []
    for n in range(200):
        images = rng.sample(range(300, 340), rng.choice((1, 1, 2)))
        prompts.append(prompt(images, salt=n % 3))
    for start in range(0, 200, 50):
        served(d, prompts[start : start + 50], ref)
    stats = d.stats()
    assert stats["cache"]["evictions"] > 0 and stats["connector"]["loads"] > 0, stats
    healthy(d)


def outage_publishes_come_back(world: World, ref: Reference) -> None:
    """The master is killed; A serves eight new images (it encodes them, their publishes fail
    and wait in its backlog); the master restarts and, with no request to A, A's backlog is
    written; then B (once its own client is back on the master) serves A's prompts: B
    encodes none of the images A encoded during the outage and still holds."""
    a, b, master = world["A"], world["B"], world.master
    ok_before = a.stats()["cache"]["publishes_ok"]
    master.kill()
    outage = [prompt([i], salt=5) for i in range(400, 408)]
    out_a = served(a, outage, ref)
    encoded = set(out_a["encoded"])
    assert len(encoded) == 8, f"A did not encode the new images: {out_a['encoded']}"
    cache = wait_for(
        "A's failed publishes to wait in its backlog",
        lambda: (c := a.stats()["cache"])["publish_backlog"] >= 8 and c,
        PUBLISH_TIMEOUT_S,
    )
    master.start()
    cache = wait_for(
        "A's backlog to be written after the restart",
        lambda: (c := a.stats()["cache"])["publish_backlog"] == 0 and c,
        PUBLISH_TIMEOUT_S,
    )
    assert cache["publish_backlog_dropped"] == cache["publish_backlog_stale"] == 0, cache
    assert cache["publishes_ok"] >= ok_before + 8, cache
    publishing_resumed(b, range(420, 440), ref, want=1)  # B's client is back on the master
    out_b = served(b, outage, ref)
    assert not encoded & set(out_b["encoded"]), (
        f"B encoded what A encoded during the outage and holds: {out_b['encoded']}"
    )
    healthy(a, b)


CHECKS: tuple[Callable[[World, Reference], None], ...] = (
    b_loads_what_a_encoded,
    b_survives_the_master,
    outage_publishes_come_back,
    sigkill_leaves_nothing,
    tiny_pool_200_requests,
)
