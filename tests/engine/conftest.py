"""Fixtures of the engine tier (``bash .ci/test --engine``): the tiny model written on the spot,
the reference engine (no connector), and the world of real engines on one ``mooncake_master``.

The engines run in the engine environment's Python, ``EMBCACHE_ENGINE_PYTHON`` (what
``.ci/engine_env`` prints; ``.ci/test --engine`` sets it). Without it the engine tests skip,
except in CI (``CI`` set), where they fail. Everything a fixture starts, it stops.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from embcache.store.mooncake_master import MooncakeMaster
from tests.engine.checks import POOL_AB, POOL_D, Reference
from tests.support import ports
from tests.support.engines import (
    ROOT,
    EngineProcess,
    World,
    embcache_ec,
    mooncake_env,
    start_all,
)

D_ENGINE_ARGS = {"max_num_batched_tokens": 256}  # vLLM's own encoder cache: about 6 images
Builder = Callable[..., World]


@pytest.fixture(scope="session")
def engine_python() -> str:
    python = os.environ.get("EMBCACHE_ENGINE_PYTHON")
    if not python:
        message = "EMBCACHE_ENGINE_PYTHON is not set: run `bash .ci/test --engine`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def model_dir(engine_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llava")
    subprocess.run(
        [engine_python, "-m", "tests.engine.tiny_llava", str(out)],
        cwd=ROOT, check=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def build_world(engine_python: str, model_dir: Path, log_dir: Path) -> Iterator[Builder]:
    """Builds worlds (a master and engines A, B, D on it; ``connector`` names the class in
    ``module``), started together with ``extra`` engines; stops them all at the end."""
    built: list[World] = []

    def build(
        tag: str,
        *,
        names: str = "ABD",
        module: str = "embcache.integrations.vllm",
        connector: str = "EmbcacheECConnector",
        extra: tuple[EngineProcess, ...] = (),
    ) -> World:
        master = MooncakeMaster(log_dir=log_dir, ports=ports.server_ports(3))
        master.start()
        world = World(master)
        built.append(world)
        env = mooncake_env(master)
        common = {"mooncake_master": master.master_address, "mooncake_segment": 16 << 20}
        sizes = {
            "A": {"pool_bytes": POOL_AB, "staging_bytes": 1 << 20},
            "B": {"pool_bytes": POOL_AB, "staging_bytes": 1 << 20},
            "D": {"pool_bytes": POOL_D, "staging_bytes": 128 << 10},
        }
        for name in names:
            ec = embcache_ec(module=module, connector=connector, **common, **sizes[name])
            args = D_ENGINE_ARGS if name == "D" else {}
            world.engines[name] = EngineProcess(
                f"{tag}-{name}", engine_python, model_dir, log_dir, ec, env, args
            )
        start_all([*world.engines.values(), *extra])
        return world

    yield build
    for world in built:
        world.stop()  # the self-test's worlds are stopped already; stopping again is a no-op


@pytest.fixture(scope="session")
def reference_engine(engine_python: str, model_dir: Path, log_dir: Path) -> Iterator[EngineProcess]:
    """Engine C: no connector (started by the first world, with it)."""
    engine = EngineProcess("C", engine_python, model_dir, log_dir)
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def world(build_world: Builder, reference_engine: EngineProcess) -> World:
    """The world of the tests: A, B and D with EmbcacheECConnector, C beside them."""
    return build_world("real", extra=(reference_engine,))


@pytest.fixture(scope="session")
def reference(world: World, reference_engine: EngineProcess) -> Reference:
    return Reference(reference_engine)
