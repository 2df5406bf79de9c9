"""What Mooncake offers for an atomic create, measured on a real ``mooncake_master``.

The fleet's claims (``embcache.pipeline.claims``, ``MooncakeStore.claim``) stand on these
answers of Mooncake 0.3.13's Python binding; a Mooncake upgrade that changes any of them fails
here first. Raw binding
clients, no embcache code in between: three clients play three workers (A and B lend a
segment, C lends none). The master's ``--put_start_discard_timeout_sec`` is 2 s here.

Found (and asserted):
- ``batch_put_from`` of a key that exists, or whose put is in progress, answers 0 and stores
  nothing: the first creator's bytes stay. Two racing puts both answer 0. A put is no claim:
  it cannot tell the winner.
- ``batch_put_session_start`` is an atomic create with a winner: of two racing starts exactly
  one answers 0, the other ``OBJECT_ALREADY_EXISTS`` (-705); a start on a key whose put is in
  progress or done answers -705. A started, unended put is invisible (``batch_is_exist`` 0,
  a read ``REPLICA_IS_NOT_READY`` -703).
- Its lease is the master's: a started put nobody ends blocks other starts for
  ``put_start_discard_timeout_sec``; the first start after that wins, and the first starter's
  ``_end``/``_revoke`` then answer ``ILLEGAL_CLIENT`` (-601): it learns it lost the key.
- ``_revoke`` ends a started put at once (a second revoke: ``INVALID_PARAMS`` -600); the next
  start wins. ``batch_upsert_from`` overwrites a stored key (and takes an in-progress one).
- ``batch_remove`` without force answers ``OBJECT_HAS_LEASE`` (-706) for a key read in the last
  ``default_kv_lease_ttl``; with force it removes.
- With the master gone, a start answers ``RPC_FAIL`` (-900) at once.
- ``put_batch`` (copies host buffers, no registered memory; ``MooncakeStore.put_copies``)
  answers one code for the batch: 0 also where a key is stored (its first bytes stay); a batch
  with an empty value answers ``INVALID_PARAMS`` and stores none of its keys. ``get_batch``
  (``get_copies``) answers empty bytes for a key not stored or whose put is in progress, and
  answers a key repeated in one call out of order.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from embcache.store.mooncake_master import MooncakeMaster, find_master_binary
from tests.support import ports

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

LEASE_S = 2
OK = 0
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
REPLICA_IS_NOT_READY = -703
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
RACES = 100


class Client:
    """A raw Mooncake client with an 8-byte buffer of its own, registered."""

    def __init__(self, master: MooncakeMaster, segment: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.raw: Any = MooncakeDistributedStore()
        status = self.raw.setup(
            "127.0.0.1", master.metadata_server, segment, 16 << 20, "tcp", "",
            master.master_address,
        )  # fmt: skip
        assert status == 0, f"setup answered {status}"
        self.buf = torch.zeros(8, dtype=torch.uint8)
        assert self.raw.register_buffer(self.buf.data_ptr(), 8) == 0

    def put(self, key: str, fill: int) -> int:
        self.buf.fill_(fill)
        return int(self.raw.batch_put_from([key], [self.buf.data_ptr()], [8])[0])

    def upsert(self, key: str, fill: int) -> int:
        self.buf.fill_(fill)
        return int(self.raw.batch_upsert_from([key], [self.buf.data_ptr()], [8])[0])

    def read(self, key: str) -> tuple[int, int]:
        """The read's code and the first byte read."""
        self.buf.zero_()
        code = int(self.raw.batch_get_into([key], [self.buf.data_ptr()], [8])[0])
        return code, int(self.buf[0])

    def exists(self, key: str) -> int:
        return int(self.raw.batch_is_exist([key])[0])

    def start(self, key: str) -> int:
        return int(self.raw.batch_put_session_start([key], [8])[0])

    def end(self, key: str) -> int:
        return int(self.raw.batch_put_session_end([key])[0])

    def revoke(self, key: str) -> int:
        return int(self.raw.batch_put_session_revoke([key])[0])


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[MooncakeMaster, Client, Client, Client]]:
    pytest.importorskip("mooncake.store")
    log_dir: Path = tmp_path_factory.mktemp("create")
    master = MooncakeMaster(find_master_binary(), log_dir, ports.server_ports(3), LEASE_S)
    os.environ.update(MooncakeMaster.CLIENT_ENVIRONMENT)
    with master:
        a, b, c = Client(master, 64 << 20), Client(master, 64 << 20), Client(master, 0)
        yield master, a, b, c
        for client in (a, b, c):
            client.raw.close()


def race(first: Any, second: Any) -> tuple[int, int]:
    """Run the two calls at once (a barrier before each); their answers."""
    answers = [0, 0]
    barrier = threading.Barrier(2)

    def run(n: int, call: Any) -> None:
        barrier.wait()
        answers[n] = call()

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers[0], answers[1]


def test_a_put_of_a_stored_key_answers_ok_and_keeps_the_first_bytes(fleet: Any) -> None:
    _, a, b, c = fleet
    assert a.put("put-after", 1) == OK
    assert b.put("put-after", 2) == OK, "a put of a stored key answers 0"
    assert c.read("put-after") == (8, 1), "the first creator's bytes stay"
    assert c.exists("put-after") == 1 and c.exists("never-put") == 0


def test_two_racing_puts_both_answer_ok_and_one_object_is_stored(fleet: Any) -> None:
    _, a, b, c = fleet
    for n in range(RACES):
        key = f"put-race-{n}"
        assert race(lambda k=key: a.put(k, 1), lambda k=key: b.put(k, 2)) == (OK, OK)
        code, first = c.read(key)
        assert code == 8 and first in (1, 2)


def test_two_racing_starts_have_exactly_one_winner(fleet: Any) -> None:
    _, a, b, _ = fleet
    for n in range(RACES):
        key = f"start-race-{n}"
        answers = race(lambda k=key: a.start(k), lambda k=key: b.start(k))
        assert sorted(answers) == [OBJECT_ALREADY_EXISTS, OK], answers
        winner = a if answers[0] == OK else b
        assert winner.revoke(key) == OK


def test_a_started_put_is_invisible_and_blocks_other_creators(fleet: Any) -> None:
    _, a, b, c = fleet
    assert a.start("started") == OK
    assert c.exists("started") == 0, "a started put is not visible"
    assert c.read("started")[0] == REPLICA_IS_NOT_READY
    assert b.start("started") == OBJECT_ALREADY_EXISTS
    assert b.put("started", 2) == OK, "a put answers 0 and stores nothing"
    assert c.exists("started") == 0
    assert a.revoke("started") == OK
    assert a.revoke("started") == INVALID_PARAMS, "a second revoke"
    assert b.start("started") == OK, "after a revoke the next start wins"
    assert b.revoke("started") == OK


def test_a_start_on_a_stored_key_loses(fleet: Any) -> None:
    _, a, b, _ = fleet
    assert a.put("stored", 1) == OK
    assert b.start("stored") == OBJECT_ALREADY_EXISTS


def test_an_abandoned_start_blocks_for_the_masters_lease_then_the_next_start_wins(
    fleet: Any,
) -> None:
    _, a, b, c = fleet
    assert a.start("abandoned") == OK
    began = time.monotonic()
    while (answer := b.start("abandoned")) == OBJECT_ALREADY_EXISTS:
        assert time.monotonic() - began < LEASE_S + 3, "the lease never ended"
        time.sleep(0.05)
    took = time.monotonic() - began
    assert answer == OK
    assert took >= LEASE_S - 0.5, f"another start won after {took:.2f} s, before the lease"
    assert a.end("abandoned") == ILLEGAL_CLIENT, "the first starter learns it lost the key"
    assert a.revoke("abandoned") == ILLEGAL_CLIENT
    assert c.exists("abandoned") == 0
    assert b.revoke("abandoned") == OK


def test_upsert_overwrites_and_remove_needs_force_after_a_read(fleet: Any) -> None:
    _, a, b, c = fleet
    assert a.put("upserted", 1) == OK
    assert b.upsert("upserted", 2) == OK
    assert c.read("upserted") == (8, 2), "upsert replaces a stored key's bytes"
    assert c.raw.batch_remove(["upserted"], False) == [OBJECT_HAS_LEASE], "read: leased"
    assert c.raw.batch_remove(["upserted"], True) == [OK]
    assert c.exists("upserted") == 0
    assert a.start("upsert-takes") == OK
    assert b.upsert("upsert-takes", 3) == OK, "an upsert takes a key whose put is in progress"
    assert c.read("upsert-takes") == (8, 3)
    assert a.end("upsert-takes") == ILLEGAL_CLIENT


def test_put_batch_copies_and_get_batch_read_copies(fleet: Any) -> None:
    _, a, _, c = fleet
    one, two = bytes([1]) * 8, bytes([2]) * 8
    assert c.raw.put_batch(["copy-1", "copy-2"], [one, two]) == OK
    assert c.raw.put_batch(["copy-1", "copy-3"], [two, two]) == OK, "one code; a stored key: 0"
    assert c.read("copy-1") == (8, 1) and c.read("copy-3") == (8, 2), "the first bytes stay"
    assert c.raw.put_batch(["copy-4", "copy-5"], [one, b""]) == INVALID_PARAMS
    assert c.exists("copy-4") == 0 and c.exists("copy-5") == 0, "a failed batch stores none"
    assert a.start("copy-started") == OK
    got = c.raw.get_batch(["copy-1", "copy-2", "never-put", "copy-started"])
    assert [bytes(b) for b in got] == [one, two, b"", b""]
    repeated = [bytes(b) for b in c.raw.get_batch(["copy-2", "copy-1", "copy-1"])]
    assert repeated != [two, one, one], "a repeated key is answered out of order"
    assert a.revoke("copy-started") == OK


def test_with_the_master_gone_a_start_fails_at_once(fleet: Any) -> None:
    master, a, _, _ = fleet
    master.kill()
    began = time.monotonic()
    assert a.start("no-master") == RPC_FAIL
    assert time.monotonic() - began < 2.0
