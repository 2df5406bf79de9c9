"""Real engines for the engine tier: each ``EngineProcess`` runs ``tests/engine/host.py`` in the
engine environment's Python (``EMBCACHE_ENGINE_PYTHON``, made by ``.ci/engine_env``), in a
session of its own, with its log in a file. ``World`` is the set a check runs against: one
``mooncake_master`` on loopback and the engines that share it.

A call that gets no answer because the engine died raises ``EngineDied`` (an
``AssertionError``, with the end of the engine's log); an answer that says the call failed
raises ``EngineCallFailed`` (an ``AssertionError`` too).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embcache.store.mooncake_master import MooncakeMaster

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: the KV cache of one tiny engine, in GiB
MISS = "Encoder cache miss"  # what vLLM's model runner says when a promised item is missing

Prompt = dict[str, Any]  # {"words": [...], "images": [image numbers]}


class EngineDied(AssertionError):
    """The engine process ended (or closed its pipe) before answering."""


class EngineCallFailed(AssertionError):
    """The engine answered that the call raised."""


def embcache_ec(
    role: str = "ec_both",
    module: str = "embcache.integrations.vllm",
    connector: str = "EmbcacheECConnector",
    **extra: Any,
) -> dict[str, Any]:
    """An ``ec_transfer_config`` naming ``connector`` with ``extra`` options."""
    return {
        "ec_connector": connector,
        "ec_connector_module_path": module,
        "ec_role": role,
        "ec_connector_extra_config": extra,
    }


class EngineProcess:
    """One engine: ``start`` then ``wait_ready``; ``call``/``send``+``receive``; ``stop``."""

    def __init__(
        self,
        name: str,
        python: str,
        model: Path,
        log_dir: Path,
        ec: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        self.name, self.python, self.model, self.ec = name, python, model, ec
        self.log_path = log_dir / f"engine-{name}.log"
        self.env = env or {}
        self.engine_args = engine_args or {}
        self.process: subprocess.Popen[bytes] | None = None
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.ready: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self.process is not None, f"engine {self.name} was never started"
        return self.process.pid

    def start(self) -> None:
        """Start the process (returns at once; ``wait_ready`` waits for the engine)."""
        read_fd, write_fd = os.pipe()
        args = [self.python, "-m", "tests.engine.host", "--model", str(self.model),
                "--reply-fd", str(write_fd)]  # fmt: skip
        if self.ec is not None:
            args += ["--ec", json.dumps(self.ec)]
        if self.engine_args:
            args += ["--engine-args", json.dumps(self.engine_args)]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
            **MooncakeMaster.CLIENT_ENVIRONMENT,
            **self.env,
        }
        env.pop("VIRTUAL_ENV", None)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(write_fd,), cwd=ROOT, env=env, start_new_session=True,
            )  # fmt: skip
        os.close(write_fd)
        threading.Thread(target=self._read, args=(read_fd,), daemon=True).start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as answers:
            for line in answers:
                self._answers.put(json.loads(line))
        self._answers.put(None)

    def wait_ready(self) -> dict[str, Any]:
        """The engine's first answer (its pid and counters) once it serves; it must run the
        embcache of this checkout (the environment's editable install may name another)."""
        self.ready = self.receive(READY_TIMEOUT_S)
        where = Path(self.ready["embcache"]).resolve()
        assert where.is_relative_to(ROOT), f"engine {self.name} runs embcache from {where}"
        return self.ready

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send(self, op: str, **args: Any) -> None:
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise EngineDied(f"engine {self.name} is gone: {exc}\n{self.log_tail()}") from exc

    def receive(self, timeout: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"engine {self.name} did not answer in {timeout:g} s\n{self.log_tail()}"
            ) from None
        if answer is None:
            self._answers.put(None)  # every later receive sees the end too
            code = self.process.poll() if self.process else None
            raise EngineDied(f"engine {self.name} died (exit {code})\n{self.log_tail()}")
        if not answer.get("ok"):
            raise EngineCallFailed(f"engine {self.name}: {answer.get('error')}")
        return answer

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.receive(timeout)

    def generate(self, prompts: Sequence[Prompt], max_tokens: int = 6) -> dict[str, Any]:
        """Greedy answers (token ids) to ``prompts`` and what the engine counted doing so."""
        return self.call("generate", requests=list(prompts), max_tokens=max_tokens)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return f"-- last {lines} lines of {self.log_path}:\n" + "\n".join(
            self.log_text().splitlines()[-lines:]
        )

    def kill(self) -> None:
        """SIGKILL the engine's process (only it, as a crash would), and reap it."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Ask the engine to quit; then end whatever is left of its session (SIGKILL)."""
        if self.process is None:
            return
        if self.alive():
            with contextlib.suppress(AssertionError):
                self.call("quit", timeout=STOP_TIMEOUT_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_TIMEOUT_S)
        if self.process.stdin is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.process.stdin.close()


@dataclass
class World:
    """A master and the engines on it."""

    master: MooncakeMaster
    engines: dict[str, EngineProcess] = field(default_factory=dict)

    def __getitem__(self, name: str) -> EngineProcess:
        return self.engines[name]

    def stop(self) -> None:
        stop_all(list(self.engines.values()))
        self.master.stop()


def stop_all(engines: Sequence[EngineProcess]) -> None:
    """Stop ``engines`` together (each may take ``2 * STOP_TIMEOUT_S`` when it hangs)."""
    threads = [threading.Thread(target=engine.stop) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def start_all(engines: Sequence[EngineProcess]) -> None:
    """Start ``engines`` together and wait until each serves (one that fails is stopped)."""
    for engine in engines:
        engine.start()
    try:
        for engine in engines:
            engine.wait_ready()
    except BaseException:
        stop_all(engines)
        raise


def mooncake_env(master: MooncakeMaster) -> dict[str, str]:
    """The Mooncake client settings of an engine on ``master`` (loopback, TCP)."""
    return {
        "MOONCAKE_TE_META_DATA_SERVER": master.store_kwargs()["metadata_server"],
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
    }


def wait_for(what: str, predicate: Any, timeout: float = 60.0, every: float = 0.5) -> Any:
    """Poll ``predicate()`` until it returns something true; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def shm_paths_of(pid: int) -> set[str]:
    """The paths under /dev/shm that process ``pid`` has open or mapped."""
    paths: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    paths.add(target.removesuffix(" (deleted)"))
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                paths.add(fields[5].strip().removesuffix(" (deleted)"))
    return paths


def shm_entries() -> set[str]:
    """What /dev/shm holds now."""
    return {f"/dev/shm/{name}" for name in os.listdir("/dev/shm")}


def memfds_of(pid: int) -> set[str]:
    """The anonymous memory files (``memfd:NAME``) process ``pid`` has mapped."""
    found: set[str] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/memfd:"):
                found.add(fields[5].strip())
    return found
