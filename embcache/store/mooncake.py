"""``MooncakeStore``: the ``GlobalStore`` protocol over a Mooncake distributed store.

Theory of operation. One *transfer client* (``MooncakeDistributedStore`` with no global
segment) has the pool registered and runs every ``batch_get_into`` / ``batch_put_from`` /
``batch_is_exist``, straight between pool ranges and the store: no staging copy. If the store
is asked to contribute memory to the global store (``global_segment_size > 0``), a second,
long-lived *segment client* holds that memory and does nothing else. They are separate so
that ``fence`` can tear the transfer client down without unmounting this worker's share of
the store (closing a client drops every object stored in its segment).

``fence`` builds a new transfer client and registers the pool with it, routes new calls to it,
waits until every call on the old client has returned, then closes the old client. Closing
destroys its transfer engine, so a transfer it abandoned (Mooncake gives up waiting after
60 s and reports ``TRANSFER_FAIL`` while the bytes may still move) can no longer land.

Failures are values, not exceptions: every transfer method returns one code per item and
``classify`` maps a code to the outcome the cache acts on (the table ``CODES``, below). Only a
malformed call (sequences of different lengths, a bad pool) raises.

Mooncake's client blocks a long time when the master is gone: ``setup`` about 90 s, each
call about 4.5 s until its own reconnect loop notices. So the store never calls into
Mooncake when it knows better: it connects lazily, only after a TCP probe of the master (and
of an HTTP metadata server) succeeds; after any item fails with ``RPC_FAIL`` it treats the
master as down and fails items at once with ``MASTER_UNREACHABLE`` until a probe (at most one
per ``reconnect_interval_s``) reaches the master again. Mooncake's client reconnects to a
restarted master and remounts its segment by itself; the store reconnects on its own only when
it has no client (the master was down at the first call, or a ``fence`` could not set up).

Threads. The cache calls in from several I/O threads at once; Mooncake's client is
thread-safe and releases the GIL. ``_lock`` guards the current session and the in-flight
counts and is never held across a Mooncake call. ``_swap_lock`` serializes connect, fence,
register and close, and is held across their slow setup and teardown, but never by a
transfer: a transfer that finds no client tries the lock without blocking and, if a swap is
under way, fails its items with ``NOT_CONNECTED``. ``_lock`` may be taken while holding
``_swap_lock``, never the reverse. Both rank below the cache's locks: every public method that
may block checks (``assert_unlocked``) that its caller holds no cache or allocator lock.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Protocol

import torch

from embcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    StoreConfigError,
    StoreUnavailableError,
)
from embcache.locks import assert_unlocked
from embcache.store.base import TransferOutcome

__all__ = [
    "CODES",
    "MooncakeConfig",
    "MooncakeStore",
    "StoreCode",
]

logger = logging.getLogger(__name__)

OK = TransferOutcome.OK
FAILED = TransferOutcome.FAILED
UNKNOWN = TransferOutcome.UNKNOWN


class StoreCode:
    """Codes this module returns itself. None of them comes from a transfer that was started."""

    NOT_CONNECTED = -20001
    STORE_CLOSED = -20002
    NO_BUFFER = -20003
    BAD_ITEM = -20004
    MASTER_UNREACHABLE = -20005
    BINDING_ERROR = -20006


class CodeInfo(NamedTuple):
    """One row of the code table: the name, the outcome for the range, and why."""

    name: str
    outcome: TransferOutcome
    why: str


_BEFORE_TRANSFER = "answered before any transfer is submitted"
_MASTER_REFUSED = "the master refused the request; nothing was submitted"

#: Mooncake's ``ErrorCode`` (mooncake-store ``types.h``) and this module's own codes. FAILED
#: means no transfer into or out of the range is or will be in flight; anything not listed,
#: and anything listed UNKNOWN, may still be moving bytes and must be quarantined until fence.
CODES: dict[int, CodeInfo] = {
    0: CodeInfo("OK", OK, "the transfer completed"),
    -1: CodeInfo("INTERNAL_ERROR", UNKNOWN, "raised anywhere, also after a submit"),
    -10: CodeInfo("BUFFER_OVERFLOW", FAILED, "size arithmetic checked " + _BEFORE_TRANSFER),
    -100: CodeInfo("SHARD_INDEX_OUT_OF_RANGE", FAILED, _MASTER_REFUSED),
    -101: CodeInfo("SEGMENT_NOT_FOUND", FAILED, _MASTER_REFUSED),
    -102: CodeInfo("SEGMENT_ALREADY_EXISTS", FAILED, _MASTER_REFUSED),
    -103: CodeInfo("CLIENT_NOT_FOUND", FAILED, _MASTER_REFUSED),
    -200: CodeInfo("NO_AVAILABLE_HANDLE", FAILED, "no space in the store; put never started"),
    -300: CodeInfo("INVALID_VERSION", FAILED, _MASTER_REFUSED),
    -400: CodeInfo("INVALID_KEY", FAILED, _MASTER_REFUSED),
    -500: CodeInfo("WRITE_FAIL", UNKNOWN, "an engine write failed part-way"),
    -600: CodeInfo("INVALID_PARAMS", FAILED, "e.g. buffer too small: " + _BEFORE_TRANSFER),
    -601: CodeInfo("ILLEGAL_CLIENT", FAILED, _MASTER_REFUSED),
    -700: CodeInfo("INVALID_WRITE", UNKNOWN, "an engine operation failed; may be mid-way"),
    -701: CodeInfo("INVALID_READ", UNKNOWN, "an engine operation failed; may be mid-way"),
    -702: CodeInfo("INVALID_REPLICA", UNKNOWN, "an engine operation failed; may be mid-way"),
    -703: CodeInfo("REPLICA_IS_NOT_READY", FAILED, _BEFORE_TRANSFER),
    -704: CodeInfo("OBJECT_NOT_FOUND", FAILED, _BEFORE_TRANSFER),
    -705: CodeInfo("OBJECT_ALREADY_EXISTS", FAILED, _BEFORE_TRANSFER),
    -706: CodeInfo("OBJECT_HAS_LEASE", FAILED, _MASTER_REFUSED),
    -707: CodeInfo("LEASE_EXPIRED", FAILED, "checked after the transfer completed"),
    -708: CodeInfo("OBJECT_HAS_REPLICATION_TASK", FAILED, _MASTER_REFUSED),
    -709: CodeInfo("OBJECT_NO_REPLICATION_TASK", FAILED, _MASTER_REFUSED),
    -710: CodeInfo("REPLICA_NOT_FOUND", FAILED, _BEFORE_TRANSFER),
    -711: CodeInfo("REPLICA_ALREADY_EXISTS", FAILED, _MASTER_REFUSED),
    -712: CodeInfo("REPLICA_IS_GONE", FAILED, _BEFORE_TRANSFER),
    -800: CodeInfo("TRANSFER_FAIL", UNKNOWN, "includes the 60 s wait timeout: bytes may move"),
    -900: CodeInfo(
        "RPC_FAIL",
        FAILED,
        "master RPCs run before a transfer is submitted or after every transfer is joined",
    ),
    -1010: CodeInfo("UNAVAILABLE_IN_CURRENT_STATUS", FAILED, _MASTER_REFUSED),
    -1011: CodeInfo("UNAVAILABLE_IN_CURRENT_MODE", FAILED, _MASTER_REFUSED),
    StoreCode.NOT_CONNECTED: CodeInfo("NOT_CONNECTED", FAILED, "no client; nothing was called"),
    StoreCode.STORE_CLOSED: CodeInfo("STORE_CLOSED", FAILED, "store closed; nothing was called"),
    StoreCode.NO_BUFFER: CodeInfo("NO_BUFFER", FAILED, "no pool registered; nothing was called"),
    StoreCode.BAD_ITEM: CodeInfo(
        "BAD_ITEM", FAILED, "empty key or range outside the pool; nothing was called"
    ),
    StoreCode.MASTER_UNREACHABLE: CodeInfo(
        "MASTER_UNREACHABLE", FAILED, "master known down; nothing was called"
    ),
    StoreCode.BINDING_ERROR: CodeInfo(
        "BINDING_ERROR", UNKNOWN, "the Mooncake call raised or answered malformed"
    ),
}

_RPC_FAIL = -900
_OBJECT_ALREADY_EXISTS = -705
_NO_AVAILABLE_HANDLE = -200

_INSTALL_HINT = (
    "install the extra: pip install 'embcache[mooncake]' (CPU hosts, package "
    "mooncake-transfer-engine-non-cuda), or on GPU hosts pip install mooncake-transfer-engine "
    "(the CUDA build); it also needs the system libraries libibverbs1 librdmacm1 libnuma1"
)


class _Client(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` this module uses."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...

    def batch_remove(self, keys: list[str], force: bool) -> list[int]: ...

    def close(self) -> int: ...


def _load_binding() -> Callable[[], _Client]:
    """The Mooncake client class; the only place an untyped Mooncake object enters."""
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise StoreUnavailableError(
            f"MooncakeStore cannot import mooncake.store ({exc}): {_INSTALL_HINT}"
        ) from exc
    factory: Callable[[], _Client] = module.MooncakeDistributedStore
    return factory


# ---------------------------------------------------------------------------------------------
# Mooncake's native log

_GLOG_FATAL = 3
_GLOG_MINLOGLEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's int32 FLAGS_minloglevel


def quiet_native_logging() -> None:
    """Keep Mooncake's C++ log (glog) off stderr in this process; call before the first store.

    Sets Mooncake's own knob ``MC_LOG_LEVEL=ERROR`` (read when its library loads), loads the
    library, then raises glog's ``minloglevel`` to FATAL, which also drops the errors Mooncake
    logs for normal events (``http=404 metadata not found`` while a client registers). Store
    failures still reach the cache as codes (``CODES``) and show in ``stats()``. Does nothing
    when ``MC_LOG_LEVEL`` is already set (the caller chose) or Mooncake is not installed;
    without this call Mooncake logs at INFO on stderr. Idempotent.
    """
    if "MC_LOG_LEVEL" in os.environ:
        return
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    try:
        importlib.import_module("mooncake.store")
    except ImportError:
        return
    for path in _loaded_libraries("libglog"):
        try:
            flag = ctypes.c_int32.in_dll(ctypes.CDLL(path), _GLOG_MINLOGLEVEL)
        except (OSError, ValueError):
            continue
        flag.value = max(flag.value, _GLOG_FATAL)


def _loaded_libraries(name: str) -> list[str]:
    """Paths of the shared libraries of this process whose file name starts with ``name``."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(name))


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


def _reachable(address: tuple[str, int], timeout_s: float) -> bool:
    """Whether a TCP connection to ``address`` can be opened within ``timeout_s``."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The store


@dataclass(eq=False)
class _Session:
    """One transfer client and the calls now running on it (guarded by the store's lock)."""

    client: _Client
    inflight: int = 0
    retired: bool = False


_Op = Callable[[_Client, list[str], list[int], list[int]], list[int]]


class MooncakeStore:
    """A ``GlobalStore`` over a Mooncake master (module docstring: theory and threads).

    Every argument left None is read from the environment variable Mooncake's own tools use:
    ``master_address`` (``MOONCAKE_MASTER``, host:port, required), ``metadata_server``
    (``MOONCAKE_TE_META_DATA_SERVER``: ``P2PHANDSHAKE`` (default), ``http://host:port/path``,
    ``etcd://host:port`` or ``redis://host:port``), ``protocol`` (``MOONCAKE_PROTOCOL``: ``tcp``
    (default) or ``rdma``), ``device_name`` (``MOONCAKE_DEVICE``, RDMA only, required there),
    ``local_hostname`` (``MOONCAKE_LOCAL_HOSTNAME``, default this host's name),
    ``global_segment_size`` (``MOONCAKE_GLOBAL_SEGMENT_SIZE``: bytes this worker lends to the
    global store, default 0: none), ``local_buffer_size`` (``MOONCAKE_LOCAL_BUFFER_SIZE``,
    Mooncake's staging buffer, default 16 MiB; the pool itself is registered, not staged).
    ``key_prefix`` namespaces every key. ``connect_timeout_s`` bounds each reachability probe;
    ``reconnect_interval_s`` spaces probes and connection attempts.

    The constructor validates (``StoreConfigError``) and imports Mooncake
    (``StoreUnavailableError``); it touches no network. Connecting is lazy (``connect`` forces
    it). A transfer method never raises for a store failure: it returns codes.
    """

    def __init__(
        self,
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
    ) -> None:
        self._config = MooncakeConfig.resolve(
            master_address,
            metadata_server=metadata_server,
            protocol=protocol,
            device_name=device_name,
            local_hostname=local_hostname,
            global_segment_size=global_segment_size,
            local_buffer_size=local_buffer_size,
            key_prefix=key_prefix,
            connect_timeout_s=connect_timeout_s,
            reconnect_interval_s=reconnect_interval_s,
        )
        self._new_client = _load_binding()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._swap_lock = threading.Lock()
        # Guarded by _lock:
        self._session: _Session | None = None
        self._pool: torch.Tensor | None = None
        self._closed = False
        self._master_down = False
        self._next_probe = 0.0
        self._next_connect = 0.0
        self._warned_no_space = False
        # Guarded by _swap_lock:
        self._segment_client: _Client | None = None

    @property
    def config(self) -> MooncakeConfig:
        """The validated configuration. O(1)."""
        return self._config

    # -- lifecycle ------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect now if not connected; raise ``StoreUnavailableError`` saying why not."""
        assert_unlocked("MooncakeStore.connect")
        with self._swap_lock:
            with self._lock:
                if self._closed:
                    raise StoreUnavailableError("MooncakeStore is closed: create a new one")
                if self._session is not None:
                    return
                pool = self._pool
            self._install(self._open_session(pool))

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register the pool (contiguous uint8, kept alive here) once; connects if it can."""
        assert_unlocked("MooncakeStore.register_buffer")
        if not isinstance(buffer, torch.Tensor):
            raise InvalidTypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.numel() == 0:
            raise InvalidArgumentError(
                f"buffer must be a non-empty contiguous uint8 tensor, got dtype {buffer.dtype}, "
                f"shape {tuple(buffer.shape)}, contiguous={buffer.is_contiguous()}"
            )
        with self._swap_lock:
            with self._lock:
                if self._pool is not None:
                    if self._pool is buffer:
                        return
                    raise InvalidArgumentError(
                        "a different pool is already registered: one MooncakeStore serves one pool"
                    )
                self._pool = buffer
                session = self._session
            if session is not None:
                self._register(session.client, buffer)
        if session is None:
            self._connect_if_due()

    def fence(self) -> None:
        """Return once no transfer started before the call can touch the pool.

        Builds a new transfer client (if the master is reachable), routes new calls to it,
        waits for every call on the old one to return (up to Mooncake's 60 s transfer
        timeout), then closes the old one. If the new client cannot be set up, the store is
        left unconnected and reconnects on a later call. Never raises for a store failure.
        """
        assert_unlocked("MooncakeStore.fence")
        with self._swap_lock:
            with self._lock:
                if self._closed:
                    return
                pool = self._pool
            try:
                fresh: _Session | None = self._open_session(pool)
            except StoreUnavailableError as exc:
                logger.warning(
                    "MooncakeStore.fence: no new client yet (%s); reconnecting later", exc
                )
                fresh = None
            self._retire(self._install(fresh))

    def close(self) -> None:
        """Wait for running calls, close both clients; later calls fail their items. Idempotent.

        The two clients close concurrently (each takes a second or two; with a mounted segment
        and no master, about ten).
        """
        assert_unlocked("MooncakeStore.close")
        with self._swap_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            old = self._install(None)
            self._drain(old)
            clients = [c for c in (self._segment_client, old and old.client) if c is not None]
            self._segment_client = None
            closers = [threading.Thread(target=self._close_client, args=(c,)) for c in clients]
            for closer in closers:
                closer.start()
            for closer in closers:
                closer.join()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the GlobalStore protocol ----------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (an empty key never is). One master RPC.

        Raises ``StoreUnavailableError`` when the store could not check any key (not
        connected, master down, closed, a failed call): the cache then reports store errors
        instead of misses. A key whose check alone failed is reported not stored.
        """
        assert_unlocked("MooncakeStore.exists")
        valid, names = self._names(keys)
        found = [False] * len(keys)
        if valid:
            codes = self._call(len(valid), lambda c: c.batch_is_exist(names))
            if all(code < 0 for code in codes):
                info = CODES.get(codes[0])
                raise StoreUnavailableError(
                    f"Mooncake could not check {len(codes)} keys: "
                    f"{codes[0]} ({'unlisted' if info is None else info.name})"
                )
            for i, code in zip(valid, codes, strict=True):
                found[i] = code == 1
        return found

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """``batch_get_into`` straight into pool ranges; per key bytes read or a code < 0.

        An object larger than its range fails with INVALID_PARAMS (-600) and writes nothing; a
        smaller one returns its own length, which the cache counts as a short read (FAILED).
        """
        assert_unlocked("MooncakeStore.get_into")
        return self._batch(keys, offsets, sizes, _get_into)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """``batch_put_from`` out of pool ranges; a stored key is skipped (0). Per key 0 or < 0."""
        assert_unlocked("MooncakeStore.put_from")
        codes = self._batch(keys, offsets, sizes, _put_missing)
        if _NO_AVAILABLE_HANDLE in codes:
            self._warn_no_space()
        return codes

    def _warn_no_space(self) -> None:
        """Log the first put that found no space in the global store, once per store."""
        with self._lock:
            if self._warned_no_space:
                return
            self._warned_no_space = True
        cfg = self._config
        if cfg.global_segment_size == 0:
            lent = (
                "this worker lends it no memory (global_segment_size=0, the default), so it "
                "holds only what other workers sharing the master lend"
            )
        else:
            lent = f"the memory lent to it is full (this worker lends {cfg.global_segment_size} B)"
        logger.warning(
            "Mooncake (master %s) has no space for a put (-200 NO_AVAILABLE_HANDLE): %s. Set "
            "global_segment_size (or MOONCAKE_GLOBAL_SEGMENT_SIZE), e.g. '4GB', on this worker "
            "or another one sharing the master. Logged once; stats().publishes_failed counts "
            "the publishes that fail.",
            cfg.master_address,
            lent,
        )

    def classify(self, code: int) -> TransferOutcome:
        """The outcome ``code`` means for its range (table ``CODES``; unlisted: UNKNOWN). O(1)."""
        info = CODES.get(code)
        return UNKNOWN if info is None else info.outcome

    def remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """Remove objects (``force`` also inside a read lease); per key 0 or a code < 0."""
        assert_unlocked("MooncakeStore.remove")
        valid, names = self._names(keys)
        codes = [StoreCode.BAD_ITEM] * len(keys)
        if valid:
            got = self._call(len(valid), lambda c: c.batch_remove(names, force))
            for i, code in zip(valid, got, strict=True):
                codes[i] = code
        return codes

    # -- transfers -----------------------------------------------------------------------

    def _names(self, keys: Sequence[object]) -> tuple[list[int], list[str]]:
        """The indices of the usable keys (non-empty str) and their prefixed names."""
        prefix = self._config.key_prefix
        valid = [i for i, key in enumerate(keys) if isinstance(key, str) and key]
        return valid, [prefix + str(keys[i]) for i in valid]

    def _batch(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int], op: _Op
    ) -> list[int]:
        if not len(keys) == len(offsets) == len(sizes):
            raise InvalidArgumentError(
                "keys, offsets and sizes differ in length: "
                f"{len(keys)}, {len(offsets)}, {len(sizes)}"
            )
        pool = self._pool
        if pool is None:
            return [StoreCode.NO_BUFFER] * len(keys)
        base, capacity = pool.data_ptr(), pool.numel()
        codes = [StoreCode.BAD_ITEM] * len(keys)
        valid, names = self._names(
            [
                key if _in_pool(offset, size, capacity) else None
                for key, offset, size in zip(keys, offsets, sizes, strict=True)
            ]
        )
        if valid:
            ptrs = [base + offsets[i] for i in valid]
            lens = [sizes[i] for i in valid]
            got = self._call(len(valid), lambda c: op(c, names, ptrs, lens))
            for i, code in zip(valid, got, strict=True):
                codes[i] = code
        return codes

    def _call(self, n: int, fn: Callable[[_Client], list[int]]) -> list[int]:
        """``fn`` on the current client, counted in flight; ``n`` codes whatever happens."""
        lease = self._acquire()
        if isinstance(lease, int):
            return [lease] * n
        codes = [StoreCode.BINDING_ERROR] * n
        try:
            answer = fn(lease.client)
            if len(answer) == n:
                codes = [int(code) for code in answer]
            else:
                logger.warning("Mooncake answered %d results for %d items", len(answer), n)
        except Exception:
            logger.warning("a Mooncake call raised; its items are UNKNOWN", exc_info=True)
        finally:
            self._release(lease, _RPC_FAIL in codes)
        return codes

    def _acquire(self) -> _Session | int:
        """The session to run a call on, counted in flight; or the code failing every item."""
        with self._lock:
            if self._closed:
                return StoreCode.STORE_CLOSED
            connected = self._session is not None
            master_down = self._master_down
        if not connected and not self._connect_if_due():
            return StoreCode.NOT_CONNECTED
        if connected and master_down and not self._master_is_back():
            return StoreCode.MASTER_UNREACHABLE
        with self._lock:
            session = self._session
            if self._closed:
                return StoreCode.STORE_CLOSED
            if session is None:
                return StoreCode.NOT_CONNECTED
            session.inflight += 1
            return session

    def _release(self, session: _Session, saw_rpc_fail: bool) -> None:
        with self._lock:
            session.inflight -= 1
            if saw_rpc_fail and not self._master_down:
                self._master_down = True
                self._next_probe = time.monotonic() + self._config.reconnect_interval_s
            if session.retired and session.inflight == 0:
                self._drained.notify_all()

    def _master_is_back(self) -> bool:
        """Probe the master at most once per interval; clears the down mark when it answers."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + self._config.reconnect_interval_s
        cfg = self._config
        if not _reachable((cfg.master_host, cfg.master_port), cfg.connect_timeout_s):
            return False
        with self._lock:
            self._master_down = False
        return True

    # -- sessions ------------------------------------------------------------------------

    def _connect_if_due(self) -> bool:
        """Try to connect without waiting on a swap and at most once per interval."""
        if not self._swap_lock.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if self._closed:
                    return False
                if self._session is not None:
                    return True
                now = time.monotonic()
                if now < self._next_connect:
                    return False
                self._next_connect = now + self._config.reconnect_interval_s
                pool = self._pool
            try:
                self._install(self._open_session(pool))
            except StoreUnavailableError as exc:
                logger.warning("MooncakeStore not connected: %s", exc)
                return False
            return True
        finally:
            self._swap_lock.release()

    def _open_session(self, pool: torch.Tensor | None) -> _Session:
        """A new transfer client with the pool registered (caller holds ``_swap_lock``)."""
        cfg = self._config
        if not _reachable((cfg.master_host, cfg.master_port), cfg.connect_timeout_s):
            raise StoreUnavailableError(
                f"Mooncake master {cfg.master_address} refuses connections: start "
                "mooncake_master there or fix MOONCAKE_MASTER"
            )
        if cfg.metadata_probe is not None and not _reachable(
            cfg.metadata_probe, cfg.connect_timeout_s
        ):
            raise StoreUnavailableError(
                f"metadata server {cfg.metadata_server} refuses connections: start it (e.g. "
                "mooncake_master --enable_http_metadata_server=true) or fix the address"
            )
        if cfg.global_segment_size and self._segment_client is None:
            self._segment_client = self._setup_client(cfg.global_segment_size, 0)
        client = self._setup_client(0, cfg.local_buffer_size)
        if pool is not None:
            try:
                self._register(client, pool)
            except StoreUnavailableError:
                self._close_client(client)
                raise
        with self._lock:
            self._master_down = False
        return _Session(client)

    def _setup_client(self, segment_bytes: int, local_buffer_bytes: int) -> _Client:
        cfg = self._config
        client = self._new_client()
        try:
            status = client.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                segment_bytes,
                local_buffer_bytes,
                cfg.protocol,
                cfg.device_name,
                cfg.master_address,
            )
        except Exception as exc:
            raise StoreUnavailableError(f"Mooncake client setup raised: {exc}") from exc
        if status != 0:
            raise StoreUnavailableError(
                f"Mooncake client setup failed with {status} (master {cfg.master_address}, "
                f"metadata {cfg.metadata_server}, protocol {cfg.protocol}); see Mooncake's log"
            )
        return client

    @staticmethod
    def _register(client: _Client, pool: torch.Tensor) -> None:
        try:
            status = client.register_buffer(pool.data_ptr(), pool.numel())
        except Exception as exc:
            raise StoreUnavailableError(f"Mooncake register_buffer raised: {exc}") from exc
        if status != 0:
            raise StoreUnavailableError(
                f"Mooncake register_buffer of {pool.numel()} bytes failed with {status}"
            )

    def _install(self, session: _Session | None) -> _Session | None:
        """Make ``session`` current; return the previous one, now retired."""
        with self._lock:
            old, self._session = self._session, session
            if old is not None:
                old.retired = True
        return old

    def _retire(self, old: _Session | None) -> None:
        """Wait until no call runs on ``old``, then close it (caller holds ``_swap_lock``)."""
        self._drain(old)
        if old is not None:
            self._close_client(old.client)

    def _drain(self, old: _Session | None) -> None:
        """Wait until no call runs on the retired session ``old``."""
        if old is not None:
            with self._lock:
                self._drained.wait_for(lambda: old.inflight == 0)

    @staticmethod
    def _close_client(client: _Client) -> None:
        try:
            client.close()
        except Exception:
            logger.warning("closing a Mooncake client raised", exc_info=True)


def _in_pool(offset: object, size: object, capacity: int) -> bool:
    return (
        isinstance(offset, int)
        and isinstance(size, int)
        and not isinstance(offset, bool)
        and not isinstance(size, bool)
        and offset >= 0
        and size > 0
        and offset + size <= capacity
    )


def _get_into(client: _Client, names: list[str], ptrs: list[int], lens: list[int]) -> list[int]:
    return client.batch_get_into(names, ptrs, lens)


def _put_missing(client: _Client, names: list[str], ptrs: list[int], lens: list[int]) -> list[int]:
    """Put the objects not yet stored; a stored one (before or during the put) counts as 0.

    A key whose existence check failed (a code < 0: the master did not answer) is not put.
    """
    stored = client.batch_is_exist(names)
    codes = [0 if flag >= 0 else flag for flag in stored]
    todo = [i for i, flag in enumerate(stored) if flag == 0]
    if todo:
        put = client.batch_put_from(
            [names[i] for i in todo], [ptrs[i] for i in todo], [lens[i] for i in todo]
        )
        for i, code in zip(todo, put, strict=True):
            codes[i] = 0 if code == _OBJECT_ALREADY_EXISTS else code
    return codes
