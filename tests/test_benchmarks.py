"""The benchmark suite keeps working: ``benchmarks/run.py --quick`` completes and emits
well-formed rows. Nothing here asserts a speed: these machines are shared and noisy, and a
missed target is a result, not a failure.

Every benchmark runs in a child process (``python -m benchmarks...``, from the repository
root) and is judged by what it writes; what tests and benchmarks share (the row check, the
baselines, the mixes, callgrind's output) is imported from ``tests/support``."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from embcache.driver.allocator import RangeAllocator
from tests.support import mixes
from tests.support.baselines import ScanLRUCache, half_freed
from tests.support.callgrind import Unavailable, per_operation, total
from tests.support.rows import check_row, json_row

ROOT = Path(__file__).resolve().parents[1]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
ENTRY_BYTES = 256  # the scan-LRU baseline's entries, as its benchmark sizes them


# ---------------------------------------------------------------------------- the children
# The module's benchmark runs start together, at its first test, in two child processes: the
# whole ``--quick`` suite, and every other run one after another in one more process
# (``python -m benchmarks.run --calls``: each command line as ``python -m`` would run it, with
# its own variables, output and exit status), which pays for torch's import once and runs on
# the second core while the suite runs. Only the runs the selected tests use are started.
def path_without_a_master() -> str:
    """PATH without the folders that hold a ``mooncake_master``."""
    return os.pathsep.join(
        folder
        for folder in os.environ.get("PATH", "").split(os.pathsep)
        if folder and not (Path(folder) / "mooncake_master").exists()
    )


def fake_master(folder: Path) -> str:
    """PATH with a ``mooncake_master`` in ``folder`` first that exits at once, saying boom."""
    fake = folder / "bin" / "mooncake_master"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    fake.chmod(0o755)
    return f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"


CALLS = (
    "listed",
    "skipped_mooncake",
    "raising_mooncake",
    "instruction_child",
    "cold_request",
    "tiny_grid",
)


def calls(out: Path) -> dict[str, dict[str, Any]]:
    """The runs of the ``--calls`` process by the fixture that gives each: its command line
    (``python -m`` 's arguments; ``{out}`` is its folder, where it writes) and the variables it
    runs with. A folder in ``out`` holds the fake master."""
    return {
        "listed": {"command": "benchmarks.run --list"},
        "skipped_mooncake": {
            "command": "benchmarks.run --quick --only 7 --json {out}/rows.json",
            "env": {"PATH": path_without_a_master()},
        },
        "raising_mooncake": {
            "command": "benchmarks.run --quick --only 7 --json {out}/rows.json "
            "--markdown {out}/RESULTS.md",
            "env": {"PATH": fake_master(out / "raising_mooncake")},
        },
        "instruction_child": {
            "command": "benchmarks.peers.bench_instructions --child --entries=64 --low=1 --high=3",
        },
        "cold_request": {
            "command": "benchmarks.micro.cold_request --rounds 3 --json {out}/steps.json",
        },
        "tiny_grid": {
            "command": "benchmarks.policy.bench_policy_grid --tiny --json {out}/grid.json",
        },
    }


class Children:
    """The module's two child processes; each result is waited for when a test first needs it,
    within the time each run had on its own when it was a process of its own (120 s each, 280
    s for the suite)."""

    def __init__(self, out: Path, quick: bool, wanted: list[str]) -> None:
        self.out = out
        self.processes: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
        if quick:
            command = ["benchmarks.run", "--quick", "--json", str(out / "quick" / "rows.json")]
            command += ["--markdown", str(out / "quick" / "RESULTS.md")]
            if HAS_MATPLOTLIB:
                command += ["--plots", str(out / "quick" / "plots")]
            self._start("quick", command, 280)
        if wanted:
            table = calls(out)
            assert list(table) == list(CALLS)
            batch = []
            for name in wanted:
                call = table[name]
                folder = out / name
                argv = [arg.replace("{out}", str(folder)) for arg in call["command"].split()]
                batch.append({"argv": argv, "env": call.get("env", {}), "out": str(folder)})
            (out / "calls.json").write_text(json.dumps(batch, indent=1))
            command = ["benchmarks.run", "--calls", str(out / "calls.json")]
            self._start("calls", command, 120 * len(wanted))

    def _start(self, name: str, argv: list[str], timeout: float) -> None:
        folder = self.out / name
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "stdout", "wb") as stdout, open(folder / "stderr", "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", *argv], cwd=ROOT, stdout=stdout, stderr=stderr
            )
        self.processes[name] = (process, time.monotonic() + timeout)

    def _wait(self, name: str) -> None:
        process, deadline = self.processes[name]
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise

    def result(self, name: str) -> subprocess.CompletedProcess[str]:
        """A run's exit status, stdout and stderr, as ``subprocess.run`` would give them."""
        folder = self.out / name
        if name == "quick":
            self._wait("quick")
            status = self.processes["quick"][0].returncode
        else:
            self._wait("calls")
            calls_done = self.out / "calls" / "stderr"
            assert (folder / "status").exists(), calls_done.read_text()[-4000:]
            status = int((folder / "status").read_text())
        return subprocess.CompletedProcess(
            [], status, (folder / "stdout").read_text(), (folder / "stderr").read_text()
        )

    def close(self) -> None:
        for process, _ in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def children(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Children]:
    mine = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    uses = {name for item in mine for name in getattr(item, "fixturenames", ())}
    wanted = [name for name in CALLS if name in uses]
    started = Children(tmp_path_factory.mktemp("bench"), "quick_run" in uses, wanted)
    yield started
    started.close()


@pytest.fixture(scope="module")
def listed(children: Children) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.run --list``."""
    return children.result("listed")


@pytest.fixture(scope="module")
def skipped_mooncake(children: Children) -> dict[str, Any]:
    """``benchmarks.run --quick --only 7 --json OUT`` with no ``mooncake_master`` on PATH."""
    return {"done": children.result("skipped_mooncake"), "out": children.out / "skipped_mooncake"}


@pytest.fixture(scope="module")
def raising_mooncake(children: Children) -> dict[str, Any]:
    """``benchmarks.run --quick --only 7 --json OUT --markdown PAGE`` with a ``mooncake_master``
    first on PATH that exits at once."""
    return {"done": children.result("raising_mooncake"), "out": children.out / "raising_mooncake"}


@pytest.fixture(scope="module")
def instruction_child(children: Children) -> subprocess.CompletedProcess[str]:
    """``benchmarks.peers.bench_instructions --child --entries=64 --low=1 --high=3``."""
    return children.result("instruction_child")


@pytest.fixture(scope="module")
def cold_request(children: Children) -> dict[str, Any]:
    """``benchmarks.micro.cold_request --rounds 3 --json OUT``."""
    return {"done": children.result("cold_request"), "out": children.out / "cold_request"}


@pytest.fixture(scope="module")
def tiny_grid(children: Children) -> dict[str, Any]:
    """``benchmarks.policy.bench_policy_grid --tiny --json OUT``."""
    return {"done": children.result("tiny_grid"), "out": children.out / "tiny_grid"}


@pytest.fixture(scope="module")
def items(listed: subprocess.CompletedProcess[str]) -> list[str]:
    """The suite's items as ``benchmarks.run --list`` prints them (``N title``)."""
    done = listed
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [str(n) for n in range(1, len(lines) + 1)]
    return lines


@pytest.fixture(scope="module")
def quick_run(children: Children) -> dict[str, Any]:
    """One ``--quick`` run of the whole suite as CI runs it: a script, from the repo root."""
    return {"done": children.result("quick"), "out": children.out / "quick"}


def test_quick_run_completes(quick_run: dict[str, Any], items: list[str]) -> None:
    done = quick_run["done"]
    assert done.returncode == 0, done.stderr[-4000:]
    assert "benchmark" in done.stdout and "ratio" in done.stdout
    assert len(items) >= 9
    for number in range(1, len(items) + 1):  # progress of every item on stderr
        assert f"] {number}. " in done.stderr


def test_quick_run_rows_are_well_formed(quick_run: dict[str, Any]) -> None:
    rows = json.loads((quick_run["out"] / "rows.json").read_text())
    assert isinstance(rows, list) and rows
    for row in rows:
        check_row(row)
    assert not [r for r in rows if "ERROR" in r["name"]]


def test_quick_run_rows_count_like_with_like(quick_run: dict[str, Any]) -> None:
    """The rows whose contenders must have done the work they are compared on. Fragmentation
    and the paged pool check every tally against their mix (each lookup and its tokens, an
    attempt per miss, failures within attempts: ``check_counts``, else an ERROR row); here:
    both sides saved some tokens and not all, the paged pool uses its victims' pages first,
    and the minimal best fit served every allocate+free pair it was timed on."""
    rows = {r["name"]: r for r in json.loads((quick_run["out"] / "rows.json").read_text())}
    saved = rows["encoder tokens saved, LRU-to-fit"]
    assert 0 < saved["ours"] < 100 and 0 < saved["baseline"] < 100
    assert rows["evicted for nothing, paged 256 KiB"]["baseline"] == 0
    best_fit = [r for n, r in rows.items() if n.startswith("allocator pair vs minimal best fit")]
    assert len(best_fit) == 2 and all(r["ours"] > 0 and r["baseline"] > 0 for r in best_fit)


def test_quick_run_markdown_covers_every_item(quick_run: dict[str, Any], items: list[str]) -> None:
    text = (quick_run["out"] / "RESULTS.md").read_text()
    assert "## Machine" in text and "- date: " in text
    numbers = {
        line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")
    } - {"#"}
    assert numbers == {str(n) for n in range(1, len(items) + 1)}


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed")
def test_quick_run_plots(quick_run: dict[str, Any]) -> None:
    plots = sorted(p.name for p in (quick_run["out"] / "plots").glob("*.png"))
    for name in ("allocator.png", "eviction.png", "hitpath.png", "copy.png", "fragmentation.png"):
        assert name in plots
    for path in (quick_run["out"] / "plots").glob("*.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- the runner
def _row(**changes: Any) -> dict[str, Any]:
    row = {
        "name": "x",
        "ours": 1.0,
        "baseline": 2.0,
        "unit": "us",
        "ratio": 2.0,
        "target": ">= 1x",
        "met": True,
    }
    row.update(changes)
    return row


@pytest.mark.parametrize(
    "bad",
    [
        {"name": ""},
        {"ours": "1"},
        {"ratio": float("nan")},
        {"met": 1},
        {"met": True, "target": ""},
        {"unit": None},
    ],
)
def test_check_row_rejects_malformed_rows(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        check_row(_row(**bad))


def test_check_row_rejects_missing_or_extra_keys() -> None:
    row = _row()
    del row["met"]
    with pytest.raises(ValueError):
        check_row(row)
    with pytest.raises(ValueError):
        check_row(_row(item=3))


def test_infinite_ratio_is_null_in_json() -> None:
    row = json_row(_row(ratio=float("inf")))
    assert row["ratio"] is None
    check_row(row)
    json.dumps(row, allow_nan=False)


def test_mooncake_row_is_skipped_without_a_master(skipped_mooncake: dict[str, Any]) -> None:
    done, out = skipped_mooncake["done"], skipped_mooncake["out"] / "rows.json"
    assert done.returncode == 0, done.stderr[-4000:]  # no item raised
    (row,) = json.loads(out.read_text())
    check_row(row)
    assert "skipped" in row["name"] and row["met"] is None and row["ours"] is None


def test_a_benchmark_that_raises_becomes_an_error_row(raising_mooncake: dict[str, Any]) -> None:
    """A ``mooncake_master`` on PATH that exits at once: the mooncake item raises, and the run
    goes on to give its error row, the table's MISSED, the error in RESULTS.md, exit status 1."""
    done = raising_mooncake["done"]
    out, page = raising_mooncake["out"] / "rows.json", raising_mooncake["out"] / "RESULTS.md"
    assert done.returncode == 1, done.stderr[-4000:]
    (row,) = json.loads(out.read_text())
    check_row(row)
    assert row["name"] == "mooncake: ERROR StoreUnavailableError"
    assert row["met"] is False and row["ours"] is None and row["target"] == "runs"
    assert "MISSED" in done.stdout
    text = page.read_text()
    assert "## Errors" in text
    assert "- item 7 (mooncake): StoreUnavailableError: mooncake_master exited at start" in text
    assert "boom" in text  # the master's own words, from its log


# ---------------------------------------------------------------------------- the layout
def benchmark_imports(folder: Path) -> dict[str, set[str]]:
    """Each module of ``folder`` (a ``benchmarks/``), by its dotted name inside it
    (``micro.bench_allocator``) -> the modules of it that it imports, wherever the import
    stands (top level, in a function, under TYPE_CHECKING)."""
    modules = {
        ".".join(path.relative_to(folder).with_suffix("").parts)
        for path in folder.rglob("*.py")
        if path.name != "__init__.py"
    }

    def module_in(name: str) -> str | None:  # the longest prefix of name that is a module
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules:
                return ".".join(parts[:n])
        return None

    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        path = folder.joinpath(*name.split(".")).with_suffix(".py")
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
                "benchmarks"
            ):
                base = (node.module or "").removeprefix("benchmarks").removeprefix(".")
                targets |= {f"{base}.{a.name}".strip(".") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {
                    a.name.removeprefix("benchmarks.")
                    for a in node.names
                    if a.name.startswith("benchmarks.")
                }
        graph[name] = {m for t in targets if (m := module_in(t)) is not None}
    return graph


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports in ``graph`` (its modules in order, the first repeated), or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            circle = visit(target, [*path, name])
            if circle:
                return circle
        done.add(name)
        return None

    for name in sorted(graph):
        circle = visit(name, [])
        if circle:
            return circle
    return None


def test_benchmark_imports_form_no_circle() -> None:
    graph = benchmark_imports(ROOT / "benchmarks")
    assert {"common", "run", "plots", "peers.bench_peers", "micro.bench_metadata"} <= set(graph)
    assert import_circle(graph) is None, " -> ".join(import_circle(graph) or [])
    assert graph["common"] == set()  # the shared helpers depend on no benchmark


def test_import_circle_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from benchmarks import b\n")
    (tmp_path / "b.py").write_text("def f() -> None:\n    from benchmarks.c import g\n")
    (tmp_path / "c.py").write_text("import benchmarks.a\n")
    (tmp_path / "d.py").write_text("from benchmarks import a\n")
    graph = benchmark_imports(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circle(graph) == ["a", "b", "c", "a"]
    graph["c"].clear()
    assert import_circle(graph) is None


# ---------------------------------------------------------------------------- instruction counts
def test_callgrind_totals_are_read_from_its_output(tmp_path: Path) -> None:
    dump = tmp_path / "cg.1.1-01"
    dump.write_text("version: 1\nevents: Ir\nfn=(1) f\n3 5\ntotals: 1234\n")
    assert total(dump) == 1234
    dump.write_text("version: 1\nevents: Ir\nsummary: 99\n")
    assert total(dump) == 99
    dump.write_text("version: 1\nevents: Ir\n")
    with pytest.raises(Unavailable, match="no totals"):
        total(dump)


def test_instruction_count_is_the_difference_over_the_extra_operations() -> None:
    order = ["ours hit", "ours hit", "sglang hit", "sglang hit"]
    per_op = per_operation(order, [5_000, 105_000, 7_000, 57_000], 100)
    assert per_op == {"ours hit": 1_000.0, "sglang hit": 500.0}


def test_both_sides_of_the_instruction_count_do_their_work(
    instruction_child: subprocess.CompletedProcess[str],
) -> None:
    """The counted process's own run, outside valgrind (the toggles do nothing there): every
    side is set up, runs, and passes its check of the work done (hits, evictions, pins)."""
    from tests.support import sglang_wheel

    done = instruction_child
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    sides = ["ours hit", "ours hit in two steps", "ours evicting insert"]
    sides.append("ours request-less insert")
    try:
        sglang_wheel.load_controller_module()
    except sglang_wheel.SGLangUnavailable:
        assert report["sglang_missing"]
    else:
        sides += ["sglang hit", "sglang evicting insert"]
        assert report["sglang_missing"] is None
    assert report["order"] == [side for side in sides for _ in range(2)]


# ---------------------------------------------------------------------------- the baselines
def test_scan_lru_baseline_evicts_the_oldest_idle_entry() -> None:
    cache = ScanLRUCache(3 * ENTRY_BYTES)
    tensor = torch.zeros(ENTRY_BYTES // 2, dtype=torch.bfloat16)
    for key in ("a", "b", "c"):
        assert cache.insert(key, tensor)
    cache.release("b")
    cache.release("c")
    assert cache.insert("d", tensor)  # "a" is older but pinned: "b" goes
    assert set(cache.entries) == {"a", "c", "d"}
    cache.release("a")
    cache.release("d")
    assert cache.insert("e", tensor)  # recency: c (released first), then a, then d
    assert set(cache.entries) == {"a", "d", "e"}


def test_scan_lru_baseline_fails_when_everything_is_pinned() -> None:
    cache = ScanLRUCache(ENTRY_BYTES)
    tensor = torch.zeros(ENTRY_BYTES // 2, dtype=torch.bfloat16)
    assert cache.insert("a", tensor)
    assert not cache.insert("b", tensor)


def test_drifting_mix_reshuffles_popularity_between_phases() -> None:
    steady = mixes.make_workload(quick=True)
    drifting = mixes.make_workload(quick=True, drifting=True)
    every = mixes.drift_every(quick=True)
    assert [len(r) for r in steady.requests] == [len(r) for r in drifting.requests]
    assert all(len(set(r)) == len(r) for r in drifting.requests)
    assert steady.requests != drifting.requests  # the first shuffle already moves the ranks
    top = [
        Counter(i for r in drifting.requests[p : p + every] for i in r).most_common(1)[0][0]
        for p in range(0, len(drifting.requests), every)
    ]
    assert len(set(top)) > 1, "the favourite image never changed between phases"


def test_cold_request_probe_times_every_step(cold_request: dict[str, Any]) -> None:
    done, out = cold_request["done"], cold_request["out"] / "steps.json"
    assert done.returncode == 0, done.stderr[-4000:]
    steps = json.loads(out.read_text())
    for name in ("open", "lookup", "embeddings", "close"):
        cold, warm = steps[name]
        assert cold > 0 and warm > 0
    assert steps["copy out of the fresh view"][0] > 0
    assert steps["copy out of a view made beforehand"][0] > 0


# ---------------------------------------------------------------------------- SGLang's controller
@pytest.fixture(scope="module")
def sglang_module() -> Any:
    from tests.support import sglang_wheel

    try:
        return sglang_wheel.load_controller_module()
    except sglang_wheel.SGLangUnavailable as exc:
        pytest.skip(f"the sglang wheel cannot be had here: {exc}")


def test_sglang_controller_runs_from_the_wheel_and_leaves_no_stand_ins(sglang_module: Any) -> None:
    from tests.support import sglang_wheel

    assert sglang_module.__file__.endswith(sglang_wheel.MODULE_FILE)
    assert ".whl/" in sglang_module.__file__  # read out of the wheel, not a copy in the repo
    assert "sglang" not in sys.modules and "sgl_kernel" not in sys.modules
    controller = sglang_wheel.make_controller(64 * 1024, 16, torch.uint8, page_bytes=1024)
    sglang_wheel.stop_io(controller)
    pool = controller.vision_pool
    assert pool.page_bytes == 1024 and pool.num_pages == 64
    image = sglang_wheel.image_modality()
    # Two 32-page entries fill the pool; a third evicts the least recently used idle one.
    for key in ("a", "b", "c"):
        controller.prefetch(key, [key], [32 * pool.page_size], image)
        controller._finish_get(controller.prefetch_queue.get_nowait(), [True])
    assert sorted(controller.entries) == ["b", "c"]
    views = controller.get_pool_views(["b", "x"])
    assert views[1] is None and sum(v.shape[0] for v in views[0]) == 32 * pool.page_size
    controller.prefetch("d", ["d"], [32 * pool.page_size], image)  # "b" is pinned: "c" goes
    assert sorted(controller.entries) == ["b", "d"]


def test_sglang_unavailable_says_why_and_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support import sglang_wheel

    monkeypatch.setenv(sglang_wheel.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # real pip, which finds nothing to download
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(sglang_wheel.SGLangUnavailable) as caught:
        sglang_wheel.wheel_path()
    message = str(caught.value)
    assert f"sglang=={sglang_wheel.VERSION}" in message and "failed" in message
    assert f"pip download sglang=={sglang_wheel.VERSION} --no-deps -d {tmp_path}" in message
    assert sglang_wheel.CACHE_ENV in message


def test_sglang_peer_insert_copies_into_pages_and_evicts_the_oldest_idle(
    sglang_module: Any,
) -> None:
    from tests.support.sglang_wheel import SGLangPeer

    peer = SGLangPeer(8 * 1024, 64, torch.bfloat16, 1024)  # 8 pages of 8 tokens
    assert (peer.pool.num_pages, peer.pool.page_size) == (8, 8)
    tensors = {
        key: torch.full((24, 64), float(n), dtype=torch.bfloat16) for n, key in enumerate("abcd")
    }
    for key in "abc":  # 3 pages each: a, b fit; c evicts a (b is pinned)
        assert peer.insert(key, tensors[key])
        if key == "b":
            (views,) = peer.get(["b"])
    assert sorted(peer.controller.entries) == ["b", "c"]
    assert torch.equal(torch.cat(views), tensors["b"])
    (views,) = peer.get(["c"])
    assert torch.equal(torch.cat(views), tensors["c"])
    assert not peer.insert("d", tensors["d"])  # 2 free pages, b and c pinned: skipped
    peer.release(["b", "c"])
    assert peer.exists(["b", "c"]) == [True, True]
    assert peer.insert("d", tensors["d"])  # evicts b, the least recently used
    assert sorted(peer.controller.entries) == ["c", "d"]


def test_original_pr_controller_evicts_to_bytes_past_pinned_entries() -> None:
    from tests.support.baselines import OriginalPRController

    pr = OriginalPRController(4 * 256, 256)
    one = torch.ones(128, dtype=torch.bfloat16)
    for key in "abcd":
        assert pr.insert(key, one)
    pr.get_pool_views(["a", "c"])  # pinned: a, c; idle: b, d
    # 512 bytes: b and d are evicted, but they are not adjacent, so the insert fails anyway
    assert not pr.insert("e", torch.ones(256, dtype=torch.bfloat16))
    assert sorted(pr.entries) == ["a", "c"] and pr.free_bytes == 2 * 256
    assert pr.insert("f", one)  # first fit: the lowest hole
    assert pr.entries["f"][0] == 256 and pr.allocator.free_list == [[768, 256]]
    (view,) = pr.get_pool_views(["f"])
    assert view is not None and view.shape == (128,) and bool((view == 1).all())
    assert pr.batch_is_exist(["c", "f", "b"]) == [True, True, False]


def test_minimal_best_fit_gives_the_offsets_of_the_range_allocator() -> None:
    from tests.support.baselines import MinimalBestFit

    ours, base = half_freed(RangeAllocator, 500, seed=3), half_freed(MinimalBestFit, 500, seed=3)
    assert ours.free_blocks() == [(o, s) for o, s in base.by_offset.items()]  # type: ignore[attr-defined]
    rng = random.Random(5)
    live: list[tuple[int, int]] = []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            a, b = live.pop(rng.randrange(len(live)))
            assert ours.free(a) == base.free(b)
        else:
            size = 256 * rng.randint(1, 8)
            a, b = ours.allocate(size), base.allocate(size)
            assert a == b
            if a is not None:
                live.append((a, b))  # type: ignore[arg-type]
    for size in (256 * rng.randint(1, 8) for _ in range(10)):  # allocate+free pairs, as timed
        a, b = ours.allocate(size), base.allocate(size)
        assert a == b and b is not None
        assert ours.free(a) == base.free(b)  # type: ignore[arg-type]


def test_grid_optimum_evicts_the_entry_needed_furthest_ahead() -> None:
    """Room for two entries of 256 B. Lookups a b c a b c a: c is next needed (at 5) later
    than a (3) and b (4), so it is not cached (refused) and a, b keep hitting; the last c is
    never needed again (bypassed). Lookups a b c b c a: c (next at 4) evicts a (next at 5)."""
    specs = [mixes.SmallSpec(k, 64, torch.bfloat16, 4) for k in "abc"]  # 256 B each
    load = mixes.Workload(specs, [[0], [1], [2], [0], [1], [2], [0]], inflight=0)
    result = mixes.optimum(load, 512)
    assert (result.hits, result.refused, result.evictions) == (3, 1, 0)
    load = mixes.Workload(specs, [[0], [1], [2], [1], [2], [0]], inflight=0)
    result = mixes.optimum(load, 512)
    assert (result.hits, result.refused, result.evictions) == (2, 0, 1)


def test_tiny_grid_reports_every_cell(tiny_grid: dict[str, Any]) -> None:
    """The CI smoke run of the grid: a target row per cell, the optimum's and the churn rows,
    and the heatmap's values read back from the rows."""
    done, out = tiny_grid["done"], tiny_grid["out"] / "grid.json"
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    cells = result["cells"]
    drifts = [f"4MiB drift {p} z{s}" for p in (100, 500) for s in ("0.8", "1.2")]
    assert [c["label"] for c in cells] == [*drifts, "4MiB steady", "4MiB scan"]
    rows = result["rows"]
    for row in rows:
        check_row(row)
    targets = [r for r in rows if "vs best baseline" in r["name"]]
    assert len(targets) == len(cells)
    contenders = {"LRU-to-fit", "LRU-to-bytes", "paged", "lru", "tinylfu", "adaptive"}
    contenders |= {"optimum", "optimum-cost"}  # Belady on bytes, and weighed by tokens per byte
    for cell in cells:
        assert all(0 <= v <= 100 for v in cell["saved"].values())
        assert set(cell["saved"]) == contenders
    heat = {(label, skew): pair for label, skew, *pair in result["heat"]["4MiB"]}
    steady = cells[-2]
    assert heat[("steady / scan", 0.0)][0] == pytest.approx(steady["margin"])


@pytest.mark.parametrize(
    ("checks", "seconds"),
    [
        # the policy grid's ``--variant`` runs and oracles
        pytest.param("benchmarks/policy/test_policy_grid.py", 840, marks=pytest.mark.timeout(900)),
        # the server replay: every token accounted for, each image encoded once with room for
        # all, one mix replaying bench_server's trace, bad flags
        pytest.param("benchmarks/server/test_replay.py", 280, marks=pytest.mark.timeout(300)),
        # the SGLang adapter's run waits for SGLang's PUTs on its own signal (and, planted, on
        # time: a hit request finds a miss); skipped where SGLang's wheel cannot be had
        pytest.param(
            "benchmarks/peers/test_bench_sglang_adapter.py", 280, marks=pytest.mark.timeout(300)
        ),
    ],
)
def test_a_benchmarks_own_checks_pass(checks: str, seconds: int) -> None:
    """The checks that live beside a benchmark (they import it, which no test here may), run
    by pytest in a child process."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", checks],
        cwd=ROOT, capture_output=True, text=True, timeout=seconds, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
