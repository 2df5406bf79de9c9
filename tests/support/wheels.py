"""Peer wheels (SGLang's, vLLM's) fetched with ``pip download --no-deps`` into a cache folder,
so benchmarks and tests can run the peers' own code without installing them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cache_dir(name: str, env: str) -> Path:
    """The folder that holds ``name``'s wheel: ``$env`` or ~/.cache/embcache/``name``."""
    folder = os.environ.get(env)
    return Path(folder) if folder else Path.home() / ".cache" / "embcache" / name


def how_to_get_it(name: str, version: str, env: str, folder: Path) -> str:
    """The advice an error ends with: the pip command, or the variable naming a folder."""
    return (
        f"get it with `{sys.executable} -m pip download {name}=={version} --no-deps -d {folder}` "
        f"(or put the wheel in a folder and name it in ${env})"
    )


def fetch_wheel(
    name: str, version: str, env: str, unavailable: type[Exception], timeout: float
) -> Path:
    """The ``name``==``version`` wheel in ``cache_dir``, downloaded there with pip if it is not
    there yet. Raises ``unavailable`` (saying why, and how to get it) when pip cannot fetch it."""
    folder = cache_dir(name, env)
    pattern = f"{name}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps"]
    advice = how_to_get_it(name, version, env, folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [*command, "--disable-pip-version-check", "-d", str(folder)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        message = f"pip download of {name}=={version} did not run ({exc}); {advice}"
        raise unavailable(message) from exc
    found = sorted(folder.glob(pattern))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise unavailable(
            f"pip download of {name}=={version} failed (exit {done.returncode}: "
            f"{' / '.join(tail) or 'no output'}); {advice}"
        )
    return found[0]
