"""The connector's options: vLLM's ``ec_connector_extra_config``, checked one by one.

=================  =========================================================================
option             meaning (default)
=================  =========================================================================
pool_bytes         the cache's pool in shared memory (1 GiB)
staging_bytes      ignored: there is no staging area any more (rank 0 writes fresh outputs
                   into the pool ranges the scheduler reserves); accepted so that configs
                   that set it still load
mooncake_master    "host:port" of a Mooncake master; absent: no global tier (the pool is all)
mooncake_segment   bytes this engine lends the Mooncake store (0)
key_prefix         namespace of the keys in the global store ("embcache/vllm/")
policy             eviction order and admission: a name ``EmbeddingCache(policy=...)`` takes
                   ("adaptive-work", the cache's default; checked by ``EmbeddingCache``
                   when the scheduler starts)
hold_timeout_s     how long after a request ends its missing acks are awaited before its
                   ranges are quarantined: held until the late acks come or the owing
                   rank's worker process is seen gone, never freed on the timeout (30.0)
embed_width        embedding width; absent: the producer's measured width per modality,
                   else the model's hidden size
=================  =========================================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from embcache.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["ConnectorOptions", "parse_options"]


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """The checked options (module docstring)."""

    pool_bytes: int = 1 << 30
    staging_bytes: int = 64 << 20
    mooncake_master: str | None = None
    mooncake_segment: int = 0
    key_prefix: str = "embcache/vllm/"
    policy: str = "adaptive-work"
    hold_timeout_s: float = 30.0
    embed_width: int | None = None


def parse_options(extra: object) -> ConnectorOptions:
    """``ConnectorOptions`` from ``extra``; ``InvalidArgumentError``/``InvalidTypeError``
    naming the option, the value and what to pass instead."""
    if not isinstance(extra, Mapping):
        raise InvalidTypeError(f"ec_connector_extra_config must be a dict, got {extra!r}")
    known = set(ConnectorOptions.__dataclass_fields__)
    unknown = sorted(set(map(str, extra)) - known)
    if unknown:
        raise InvalidArgumentError(
            f"unknown ec_connector_extra_config option(s) {unknown}: known are {sorted(known)}"
        )
    values: dict[str, object] = {}
    for name in ("pool_bytes", "staging_bytes", "mooncake_segment", "embed_width"):
        if name in extra:
            values[name] = _count(name, extra[name], zero_ok=name == "mooncake_segment")
    for name in ("mooncake_master", "key_prefix", "policy"):
        if name in extra:
            values[name] = _text(name, extra[name])
    master = values.get("mooncake_master")
    if isinstance(master, str) and not _host_port(master):
        raise InvalidArgumentError(
            f"ec_connector_extra_config mooncake_master={master!r}: pass 'host:port'"
        )
    if "hold_timeout_s" in extra:
        timeout = extra["hold_timeout_s"]
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise InvalidTypeError(
                f"ec_connector_extra_config hold_timeout_s must be seconds, got {timeout!r}"
            )
        if not math.isfinite(timeout) or timeout <= 0:
            raise InvalidArgumentError(
                f"ec_connector_extra_config hold_timeout_s must be finite and > 0, got {timeout}"
            )
        values["hold_timeout_s"] = float(timeout)
    return ConnectorOptions(**values)  # type: ignore[arg-type]


def _count(name: str, value: object, *, zero_ok: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"ec_connector_extra_config {name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise InvalidArgumentError(
            f"ec_connector_extra_config {name} must be > 0{' or 0' if zero_ok else ''}, got {value}"
        )
    return value


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidTypeError(
            f"ec_connector_extra_config {name} must be a non-empty str, got {value!r}"
        )
    return value


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
