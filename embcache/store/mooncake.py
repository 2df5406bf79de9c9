"""``MooncakeStore``: the ``GlobalStore`` protocol over a Mooncake distributed store.

Theory of operation. One *transfer client* (``MooncakeDistributedStore`` with no global
segment) has the pool registered and runs every ``batch_get_into`` / ``batch_put_from`` /
``batch_is_exist``, straight between pool ranges and the store: no staging copy. If the store
is asked to contribute memory to the global store (``global_segment_size > 0``), a second,
long-lived *segment client* holds that memory and does nothing else. They are separate so
that ``fence`` can tear the transfer client down without unmounting this worker's share of
the store (closing a client drops every object stored in its segment). ``fence`` builds a new
transfer client and registers the pool with it, routes new calls to it, waits until every call
on the old client has returned, then closes the old client. Closing
destroys its transfer engine, so a transfer it abandoned (Mooncake gives up waiting after
60 s and reports ``TRANSFER_FAIL`` while the bytes may still move) can no longer land.

Failures are values: one code per item, which ``classify`` maps to an outcome (``CODES``, in
``mooncake_native``); only a malformed call (a bad pool, lengths that differ) raises.

Mooncake's client blocks a long time when the master is gone: ``setup`` about 90 s, each
call about 4.5 s until its own reconnect loop notices. So the store never calls into
Mooncake when it knows better: it connects lazily, only after a TCP probe of the master (and
of an HTTP metadata server) succeeds; after any item fails with ``RPC_FAIL`` it treats the
master as down and fails items at once with ``MASTER_UNREACHABLE`` until a probe (at most one
per ``reconnect_interval_s``) reaches the master again. Mooncake's client reconnects to a
restarted master and remounts its segment by itself; the store reconnects on its own only when
it has no client (the master was down at the first call, or a ``fence`` could not set up).

Claims (``ClaimingStore``): a claim on ``key`` is a started (``batch_put_session_start``: the
one atomic create), never-ended put of ``key#claim``; ``release`` revokes it; its lease is the
master's ``--put_start_discard_timeout_sec`` = ``claim_lease_s`` (embcache/DESIGN.md, "Claims").
``put_copies``/``get_copies`` (``CopyingStore``) are ``put_batch``/``get_batch``: host copies.

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

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import torch

from embcache.driver.global_store import TransferOutcome
from embcache.driver.locks import assert_unlocked
from embcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    StoreUnavailableError,
)
from embcache.store.mooncake_config import MooncakeConfig, reachable
from embcache.store.mooncake_native import (
    _NO_AVAILABLE_HANDLE,
    _RPC_FAIL,
    CODES,
    UNKNOWN,
    StoreCode,
    _Client,
    _get_into,
    _in_pool,
    _load_binding,
    _put_copies,
    _put_missing,
    close_client,
    quiet_native_logging,
    register_pool,
    setup_client,
)

__all__ = [
    "CODES",
    "MooncakeConfig",
    "MooncakeStore",
    "StoreCode",
    "quiet_native_logging",
]

logger = logging.getLogger(__name__)

#: Mooncake's default ``--put_start_discard_timeout_sec``: the lease of a claim.
DEFAULT_CLAIM_LEASE_S = 30.0
CLAIM_SUFFIX = "#claim"


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
    ``reconnect_interval_s`` spaces probes and connection attempts. ``client_factory`` makes
    each Mooncake client (default: ``mooncake.store.MooncakeDistributedStore``); a wrapper of
    it can observe or fail the binding's calls. ``claim_lease_s`` is the lease of a claim: the
    master's ``--put_start_discard_timeout_sec`` (module docstring, "Claims").

    The constructor validates (``StoreConfigError``) and, without ``client_factory``, imports
    Mooncake (``StoreUnavailableError``); it touches no network. Connecting is lazy
    (``connect`` forces it). A transfer method never raises for a store failure: it returns codes.
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
        client_factory: Callable[[], _Client] | None = None,
        claim_lease_s: float = DEFAULT_CLAIM_LEASE_S,
    ) -> None:
        if isinstance(claim_lease_s, bool) or not isinstance(claim_lease_s, int | float):
            raise InvalidTypeError(f"claim_lease_s must be seconds, got {claim_lease_s!r}")
        if not 0 < claim_lease_s < float("inf"):
            raise InvalidArgumentError(f"claim_lease_s must be > 0 and finite, got {claim_lease_s}")
        self._claim_lease_s = float(claim_lease_s)
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
        self._new_client = client_factory or _load_binding()
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

    @contextlib.contextmanager
    def setup_paused(self) -> Iterator[None]:
        """Hold off every client setup (connect, fence, reconnect, close) while the block runs,
        for whoever stops or restarts the master on purpose: Mooncake's setup holds the GIL
        while it waits on the master, so a setup that starts against a master going down
        freezes the whole process. Reads and writes go on. Waits for a setup running now."""
        assert_unlocked("MooncakeStore.setup_paused")
        with self._swap_lock:
            yield

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
                register_pool(session.client, buffer)
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
            closers = [threading.Thread(target=close_client, args=(c,)) for c in clients]
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

    def put_copies(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[int]:
        """``put_batch`` of copies of ``values`` (``CopyingStore``: contiguous CPU tensors, no
        registered memory needed); a stored key keeps its object (0). Per key 0 or a code < 0;
        an empty value or key is BAD_ITEM. One put (two master RPCs and the copy), plus one
        ``batch_is_exist`` when the batch fails. Raises only for a malformed call."""
        assert_unlocked("MooncakeStore.put_copies")
        if isinstance(keys, str) or isinstance(values, torch.Tensor) or len(keys) != len(values):
            raise InvalidArgumentError("put_copies takes a list of keys and as many tensors")
        buffers = [_host_bytes(value) for value in values]
        valid, names = self._names(
            [key if value.nbytes else None for key, value in zip(keys, values, strict=True)]
        )
        first = {name: i for i, name in reversed(list(zip(valid, names, strict=True)))}
        codes = [StoreCode.BAD_ITEM] * len(keys)
        if first:  # (each key once, its first value: the first put of a key stays)
            unique = list(first)
            mine = [buffers[first[name]] for name in unique]
            got = dict(zip(unique, self._call(len(unique), lambda c: _put_copies(c, unique, mine)),
                           strict=True))  # fmt: skip
            for i, name in zip(valid, names, strict=True):
                codes[i] = got[name]
        if _NO_AVAILABLE_HANDLE in codes:
            self._warn_no_space()
        return codes

    def get_copies(self, keys: Sequence[str], sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """``get_batch`` (``CopyingStore``): a new CPU uint8 tensor of each object stored with
        exactly ``size`` bytes, else None (Mooncake answers empty bytes for a key not stored,
        a put in progress or a failure). One read; raises only for a malformed call."""
        assert_unlocked("MooncakeStore.get_copies")
        if isinstance(keys, str) or len(keys) != len(sizes):
            raise InvalidArgumentError("get_copies takes a list of keys and as many sizes")
        valid, names = self._names(keys)
        unique = list(dict.fromkeys(names))  # (0.3.13's get_batch misorders a repeated key)
        got: list[bytes] = []

        def read(client: _Client) -> list[int]:
            got.extend(client.get_batch(unique))
            return [len(data) for data in got]

        lengths = self._call(len(unique), read) if unique else []
        found = {name: n for n, (name, length) in enumerate(zip(unique, lengths, strict=True))
                 if length > 0}  # fmt: skip
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, name in zip(valid, names, strict=True):
            n = found.get(name)
            if n is not None and len(got[n]) == sizes[i]:
                out[i] = torch.frombuffer(bytearray(got[n]), dtype=torch.uint8)
        return out

    def _warn_no_space(self) -> None:
        """Log the first put that found no space in the global store, once per store."""
        with self._lock:
            if self._warned_no_space:
                return
            self._warned_no_space = True
        logger.warning("%s", self._config.no_space_advice())

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

    # -- claims (ClaimingStore) -----------------------------------------------------------

    @property
    def claim_lease_s(self) -> float:
        """The lease of a claim (the master's ``--put_start_discard_timeout_sec``). O(1)."""
        return self._claim_lease_s

    def claim(self, keys: Sequence[str]) -> list[int]:
        """Start the claim put of each key: 0 held, OBJECT_ALREADY_EXISTS (-705) another's
        live claim, another code < 0 nothing claimed. One master RPC."""
        assert_unlocked("MooncakeStore.claim")
        return self._claims(
            keys, lambda c, names: c.batch_put_session_start(names, [1] * len(names))
        )

    def release(self, keys: Sequence[str]) -> list[int]:
        """Revoke this store's claim puts: 0 ended, ILLEGAL_CLIENT (-601) taken by another
        after its lease, INVALID_PARAMS (-600) not started. One master RPC."""
        assert_unlocked("MooncakeStore.release")
        return self._claims(keys, lambda c, names: c.batch_put_session_revoke(names))

    def _claims(
        self, keys: Sequence[str], op: Callable[[_Client, list[str]], list[int]]
    ) -> list[int]:
        valid, names = self._names(keys)
        codes = [StoreCode.BAD_ITEM] * len(keys)
        if valid:
            claims = [name + CLAIM_SUFFIX for name in names]
            got = self._call(len(valid), lambda c: op(c, claims))
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
        if not reachable((cfg.master_host, cfg.master_port), cfg.connect_timeout_s):
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
        if not reachable((cfg.master_host, cfg.master_port), cfg.connect_timeout_s):
            raise StoreUnavailableError(
                f"Mooncake master {cfg.master_address} refuses connections: start "
                "mooncake_master there or fix MOONCAKE_MASTER"
            )
        if cfg.metadata_probe is not None and not reachable(
            cfg.metadata_probe, cfg.connect_timeout_s
        ):
            raise StoreUnavailableError(
                f"metadata server {cfg.metadata_server} refuses connections: start it (e.g. "
                "mooncake_master --enable_http_metadata_server=true) or fix the address"
            )
        if cfg.global_segment_size and self._segment_client is None:
            self._segment_client = setup_client(self._new_client(), cfg, cfg.global_segment_size, 0)
        client = setup_client(self._new_client(), cfg, 0, cfg.local_buffer_size)
        if pool is not None:
            try:
                register_pool(client, pool)
            except StoreUnavailableError:
                close_client(client)
                raise
        with self._lock:
            self._master_down = False
        return _Session(client)

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
            close_client(old.client)

    def _drain(self, old: _Session | None) -> None:
        """Wait until no call runs on the retired session ``old``."""
        if old is not None:
            with self._lock:
                self._drained.wait_for(lambda: old.inflight == 0)


def _host_bytes(value: object) -> object:
    """The bytes of a contiguous CPU tensor as a buffer, without a copy (for ``put_copies``)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(f"put_copies takes tensors, got {type(value).__name__}")
    if value.device.type != "cpu" or not value.is_contiguous():
        raise InvalidArgumentError(
            f"put_copies takes contiguous CPU tensors, got one on {value.device} "
            f"(contiguous={value.is_contiguous()}): copy it to the host first"
        )
    return value.detach().reshape(-1).view(torch.uint8).numpy()
