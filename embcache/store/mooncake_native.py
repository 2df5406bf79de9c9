"""Mooncake's native side: its result codes and what each means for a pool range, the client
binding (the only place an untyped Mooncake object enters), setting a client up, its C++ log,
and the batch calls ``MooncakeStore`` runs on a client."""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from embcache.driver.global_store import TransferOutcome
from embcache.errors import StoreUnavailableError

if TYPE_CHECKING:
    import torch

    from embcache.store.mooncake_config import MooncakeConfig

__all__ = ["CODES", "CodeInfo", "StoreCode", "quiet_native_logging"]

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

    def put_batch(self, keys: list[str], values: list[object]) -> int: ...

    def get_batch(self, keys: list[str]) -> list[bytes]: ...

    def batch_put_session_start(self, keys: list[str], sizes: list[int]) -> list[int]: ...

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]: ...

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


def setup_client(
    client: _Client, cfg: MooncakeConfig, segment_bytes: int, local_buffer_bytes: int
) -> _Client:
    """``client`` set up against ``cfg``'s master, lending ``segment_bytes`` to the global
    store; ``StoreUnavailableError`` when Mooncake refuses or raises."""
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


def register_pool(client: _Client, pool: torch.Tensor) -> None:
    """Register ``pool`` with ``client`` for transfers; ``StoreUnavailableError`` if refused."""
    try:
        status = client.register_buffer(pool.data_ptr(), pool.numel())
    except Exception as exc:
        raise StoreUnavailableError(f"Mooncake register_buffer raised: {exc}") from exc
    if status != 0:
        raise StoreUnavailableError(
            f"Mooncake register_buffer of {pool.numel()} bytes failed with {status}"
        )


def close_client(client: _Client) -> None:
    """Close ``client``, logging (never raising) what Mooncake raises."""
    try:
        client.close()
    except Exception:
        logger.warning("closing a Mooncake client raised", exc_info=True)


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


def _put_copies(client: _Client, names: list[str], values: list[object]) -> list[int]:
    """``put_batch`` of copies of ``values``: one code for the batch (0 also where a key was
    stored already: it keeps its object, measured on 0.3.13); when it fails, which keys are
    stored now (a failed batch stores none of its own: measured too)."""
    code = client.put_batch(names, values)
    if code == 0:
        return [0] * len(names)
    failed = code if code < 0 else StoreCode.BINDING_ERROR
    stored = client.batch_is_exist(names)
    return [0 if flag == 1 else flag if flag < 0 else failed for flag in stored]


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
