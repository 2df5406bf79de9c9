"""``MooncakeConfig``: every ``MooncakeStore`` setting, from arguments or the environment,
checked and resolved before any connection is made."""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass

from embcache.errors import (
    StoreConfigError,
)

__all__ = ["MooncakeConfig"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Configuration


_ENV = {
    "master_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
}
_PROTOCOLS = ("tcp", "rdma")
_METADATA_SCHEMES = ("http", "etcd", "redis")
_P2P = "P2PHANDSHAKE"
_MIN_SEGMENT = 1 << 10
_MAX_SIZE = 1 << 40
_SIZE_RE = re.compile(r"^\s*(\d+)\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE)
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DEVICE_RE = re.compile(r"^[A-Za-z0-9_.,:\-]+$")


def _setting(name: str, value: object, default: object) -> object:
    """``value`` if given, else the environment variable for ``name`` if set and non-empty."""
    if value is not None:
        return value
    return os.environ.get(_ENV[name]) or default


def _where(name: str, given: object) -> str:
    return f"{name}=" if given is not None else f"${_ENV[name]}="


def _parse_address(name: str, value: str) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise StoreConfigError(
            f"{name}{value!r} is not host:port with a port in 1..65535; e.g. '10.0.0.5:50051'"
        )
    return host, int(port_text)


def _parse_size(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise StoreConfigError(f"{name}{value!r} is not a size: give bytes as an int or '512MB'")
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise StoreConfigError(f"{name}{value!r} is not a size: give bytes or e.g. '512MB'")
        value = int(match.group(1)) * _UNITS.get((match.group(2) or "").lower(), 1)
    if value != 0 and not minimum <= value <= _MAX_SIZE:
        raise StoreConfigError(
            f"{name}{value} is out of range: give 0 or {minimum}..{_MAX_SIZE} bytes"
        )
    return value


def _parse_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise StoreConfigError(f"{name}={value!r} must be a finite number of seconds")
    if value <= 0:
        raise StoreConfigError(f"{name}={value!r} must be > 0 seconds")
    return float(value)


def _parse_metadata(name: str, value: str) -> tuple[str, int] | None:
    """The host and port to probe for ``value``; None for P2P handshake (nothing to probe)."""
    if value == _P2P:
        return None
    parts = urllib.parse.urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in _METADATA_SCHEMES or not parts.hostname or port is None:
        raise StoreConfigError(
            f"{name}{value!r} is not a metadata server: give {_P2P!r} or a URL with a port, "
            "e.g. 'http://10.0.0.5:8080/metadata' (also etcd://host:port, redis://host:port)"
        )
    return parts.hostname, port


@dataclass(frozen=True)
class MooncakeConfig:
    """A validated Mooncake client configuration (see ``MooncakeStore`` for each field)."""

    master_address: str
    master_host: str
    master_port: int
    metadata_server: str
    metadata_probe: tuple[str, int] | None
    protocol: str
    device_name: str
    local_hostname: str
    global_segment_size: int
    local_buffer_size: int
    key_prefix: str
    connect_timeout_s: float
    reconnect_interval_s: float

    @classmethod
    def resolve(
        cls,
        master_address: str | None = None,
        *,
        metadata_server: str | None = None,
        protocol: str | None = None,
        device_name: str | None = None,
        local_hostname: str | None = None,
        global_segment_size: int | str | None = None,
        local_buffer_size: int | str | None = None,
        key_prefix: str = "embcache/",
        connect_timeout_s: float = 1.0,
        reconnect_interval_s: float = 1.0,
    ) -> MooncakeConfig:
        """Arguments, else environment, else defaults; raises ``StoreConfigError``. No I/O."""
        master = _setting("master_address", master_address, None)
        where = _where("master_address", master_address)
        if not isinstance(master, str) or not master.strip():
            raise StoreConfigError(
                "no Mooncake master address: pass master_address='host:port' or set "
                "MOONCAKE_MASTER=host:port"
            )
        master = master.strip()
        master_host, master_port = _parse_address(where, master)

        metadata = _setting("metadata_server", metadata_server, _P2P)
        if not isinstance(metadata, str):
            raise StoreConfigError(f"metadata_server={metadata!r} must be a str")
        probe = _parse_metadata(_where("metadata_server", metadata_server), metadata)

        proto = _setting("protocol", protocol, "tcp")
        if not isinstance(proto, str) or proto.lower() not in _PROTOCOLS:
            raise StoreConfigError(
                f"{_where('protocol', protocol)}{proto!r} is not supported: use 'tcp' or 'rdma'"
            )
        proto = proto.lower()

        device = _setting("device_name", device_name, "")
        if not isinstance(device, str):
            raise StoreConfigError(f"device_name={device!r} must be a str")
        if proto == "rdma" and not _DEVICE_RE.match(device):
            raise StoreConfigError(
                f"protocol 'rdma' needs an RDMA device, got {_where('device_name', device_name)}"
                f"{device!r}: give e.g. 'mlx5_0', a comma-separated list, or 'auto-discovery'"
            )

        hostname = _setting("local_hostname", local_hostname, None)
        if hostname is None:
            hostname = socket.gethostname()
        if not isinstance(hostname, str) or not hostname or any(c.isspace() for c in hostname):
            raise StoreConfigError(
                f"{_where('local_hostname', local_hostname)}{hostname!r} is not a host name: "
                "give the address other workers reach this one at, e.g. '10.0.0.7'"
            )

        segment = _parse_size(
            _where("global_segment_size", global_segment_size),
            _setting("global_segment_size", global_segment_size, 0),
            _MIN_SEGMENT,
        )
        local_buffer = _parse_size(
            _where("local_buffer_size", local_buffer_size),
            _setting("local_buffer_size", local_buffer_size, 16 << 20),
            0,
        )
        if not isinstance(key_prefix, str):
            raise StoreConfigError(f"key_prefix={key_prefix!r} must be a str")
        return cls(
            master_address=master,
            master_host=master_host,
            master_port=master_port,
            metadata_server=metadata,
            metadata_probe=probe,
            protocol=proto,
            device_name=device if proto == "rdma" else "",
            local_hostname=hostname,
            global_segment_size=segment,
            local_buffer_size=local_buffer,
            key_prefix=key_prefix,
            connect_timeout_s=_parse_seconds("connect_timeout_s", connect_timeout_s),
            reconnect_interval_s=_parse_seconds("reconnect_interval_s", reconnect_interval_s),
        )

    def no_space_advice(self) -> str:
        """What to set when the global store has no space for a put (logged once a store)."""
        if self.global_segment_size == 0:
            lent = (
                "this worker lends it no memory (global_segment_size=0, the default), so it "
                "holds only what other workers sharing the master lend"
            )
        else:
            lent = f"the memory lent to it is full (this worker lends {self.global_segment_size} B)"
        return (
            f"Mooncake (master {self.master_address}) has no space for a put (-200 "
            f"NO_AVAILABLE_HANDLE): {lent}. Set global_segment_size (or "
            "MOONCAKE_GLOBAL_SEGMENT_SIZE), e.g. '4GB', on this worker or another one sharing "
            "the master. Logged once; stats().publishes_failed counts the publishes that fail."
        )


def reachable(address: tuple[str, int], timeout_s: float) -> bool:
    """Whether a TCP connection to ``address`` can be opened within ``timeout_s``."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError:
        return False
    return True
