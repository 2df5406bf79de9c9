"""Turning the controller on inside SGLang: ``install()`` and the ``.pth`` hook, in fresh
interpreters and in a spawned child (as SGLang's TP ranks are), against SGLang 0.5.23's own
controller module read from the wheel, on a stand-in SGLang package tree.

The hook is written into the site-packages folder of a fresh virtual environment made for the
test (``python -m venv --without-pip``), which every interpreter of that environment processes
at start, spawned children included, as a real installation's would be. (A user site-packages
folder would not do: an interpreter running in a virtual environment, as CI's does, ignores
it.) The environment finds this interpreter's packages through ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from embcache.integrations.sglang_install import (
    ENV,
    MODULE,
    PTH_LINE,
    PTH_NAME,
    SGLangIntegrationError,
    install,
    main,
)
from tests.support.sglang_wheel import MODULE_FILE, SGLangUnavailable, wheel_path

pytestmark = pytest.mark.timeout(600)  # a first run downloads the wheel (about 40 MB)
ROOT = Path(__file__).resolve().parents[2]

STAND_INS = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/schedule_batch.py": (
        "import enum\n\n\nclass Modality(enum.Enum):\n"
        "    IMAGE = 1\n    MULTI_IMAGES = 2\n    VIDEO = 3\n    AUDIO = 4\n"
    ),
    "sglang/srt/mem_cache/__init__.py": "",
    "sglang/srt/mem_cache/embedding_store.py": "class EmbeddingStore:\n    pass\n",
    "sglang/srt/runtime_context.py": (
        "from types import SimpleNamespace as N\n\n\ndef get_parallel():\n"
        "    return N(tp_size=1, tp_rank=0, tp_group=N(cpu_group=None))\n"
    ),
}

# What a rank does: MMEncoder's lazy import, then one controller built the way it builds it.
RANK = """
import multiprocessing, sys
import torch
from embcache.testing import FaultInjectingStore

def rank(name):
    from sglang.srt.mem_cache.embedding_cache_controller import EmbeddingCacheController
    from sglang.srt.managers.schedule_batch import Modality
    if EmbeddingCacheController.__module__ != "embcache.integrations.sglang":
        print(name, EmbeddingCacheController.__module__)  # SGLang's pins memory: needs CUDA
        return
    controller = EmbeddingCacheController(
        embedding_store=FaultInjectingStore(), hidden_dims={Modality.IMAGE: 8},
        all_rank_get=False, dtype=torch.bfloat16, max_pool_size_gb=1 / 1024,
    )
    print(name, type(controller).__module__, controller.get_embedding_dim(Modality.IMAGE))
    controller.close()

if __name__ == "__main__":
    rank("parent")
    child = multiprocessing.get_context("spawn").Process(target=rank, args=("child",))
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


@pytest.fixture(scope="module")
def controller_source() -> str:
    try:
        with zipfile.ZipFile(wheel_path()) as archive:
            return archive.read(MODULE_FILE).decode()
    except SGLangUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the sglang 0.5.23 wheel must be had in CI: {exc}")
        pytest.skip(f"sglang 0.5.23's wheel cannot be had here: {exc}")


def sglang_tree(root: Path, controller: str) -> Path:
    """A stand-in SGLang package with ``controller`` as its controller module."""
    for name, text in {**STAND_INS, MODULE_FILE: controller}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def run(script: str, tmp_path: Path, tree: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by the test's virtual environment (made by ``hook_site`` if needed)."""
    hook_site(tmp_path)
    (tmp_path / "script.py").write_text(script)
    packages = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    environment = {
        **{k: v for k, v in os.environ.items() if k not in (ENV, "VIRTUAL_ENV")},
        "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT), *dict.fromkeys(packages)]),
        **env,
    }
    return subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), str(tmp_path / "script.py")],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tmp_path,
        timeout=120,
    )


def hook_site(tmp_path: Path) -> Path:
    """The site-packages folder of a virtual environment made in ``tmp_path`` (once)."""
    venv = tmp_path / "venv"
    if not venv.exists():
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return venv / "lib" / version / "site-packages"


def test_the_hook_patches_every_rank_only_when_the_variable_is_set(
    tmp_path: Path, controller_source: str
) -> None:
    tree = sglang_tree(tmp_path / "tree", controller_source)
    hooks = hook_site(tmp_path)
    enable = [sys.executable, "-m", MODULE, "enable", "--site-dir", str(hooks)]
    subprocess.run(enable, check=True, capture_output=True, timeout=120, cwd=ROOT)
    assert (hooks / PTH_NAME).read_text() == PTH_LINE

    on = run(RANK, tmp_path, tree, **{ENV: "1"})
    assert on.returncode == 0, on.stderr
    assert on.stdout.split("\n")[:2] == [
        "parent embcache.integrations.sglang 8",
        "child embcache.integrations.sglang 8",
    ], on.stdout

    off = run(RANK, tmp_path, tree)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split("\n")[:2] == [
        "parent sglang.srt.mem_cache.embedding_cache_controller",
        "child sglang.srt.mem_cache.embedding_cache_controller",
    ], off.stdout

    assert main(["disable", "--site-dir", str(hooks)]) == 0
    assert not (hooks / PTH_NAME).exists()
    unhooked = run(RANK, tmp_path, tree, **{ENV: "1"})
    assert "parent sglang.srt.mem_cache.embedding_cache_controller" in unhooked.stdout


def test_install_replaces_the_class_and_uninstall_puts_it_back(
    tmp_path: Path, controller_source: str
) -> None:
    tree = sglang_tree(tmp_path / "tree", controller_source)
    script = textwrap.dedent(
        """
        import sglang.srt.mem_cache.embedding_cache_controller as module
        from embcache.integrations import sglang_install
        from embcache.integrations.sglang import EmbeddingCacheController
        original = module.EmbeddingCacheController
        assert sglang_install.install() is original
        assert module.EmbeddingCacheController is EmbeddingCacheController
        assert sglang_install.install() is original  # idempotent
        sglang_install.uninstall()
        assert module.EmbeddingCacheController is original
        print("ok")
        """
    )
    done = run(script, tmp_path, tree)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def test_another_interface_fails_loudly_naming_the_method(
    tmp_path: Path, controller_source: str
) -> None:
    changed = controller_source + textwrap.dedent(
        """

        def _views(self, mm_hashes, page_size):
            return []


        EmbeddingCacheController.get_pool_views = _views
        """
    )
    tree = sglang_tree(tmp_path / "tree", changed)
    script = textwrap.dedent(
        """
        from embcache.integrations.sglang_install import SGLangIntegrationError, install
        try:
            install()
        except SGLangIntegrationError as exc:
            print(exc)
        """
    )
    done = run(script, tmp_path, tree)
    assert done.returncode == 0, done.stderr
    assert "get_pool_views: SGLang has (self, mm_hashes, page_size)" in done.stdout
    assert "Install sglang==0.5.23 or unset EMBCACHE_SGLANG" in done.stdout

    hooks = hook_site(tmp_path)
    main(["enable", "--site-dir", str(hooks)])
    hooked = run(RANK, tmp_path, tree, **{ENV: "1"})
    assert hooked.returncode != 0
    assert "SGLangIntegrationError" in hooked.stderr and "get_pool_views" in hooked.stderr


def test_install_without_sglang_says_what_to_do() -> None:
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: this test needs an environment without it")
    with pytest.raises(SGLangIntegrationError, match=r"pip install 'sglang==0.5.23'"):
        install()
