"""Shared fixtures: the suite writes its own GGUF models; the Gemma file comes from its package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit.ggufgen import tiny_moe

# Files that are slow to make and never change between runs (the assembled Gemma GGUF,
# reference tokenizers) are kept here; everything the tests write goes to tmp dirs.
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
    from moechat.engine.demo_source import source_gguf

    return source_gguf(test_cache / "sources")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No test reads or writes the user's real config, data or cache folders.
    monkeypatch.setenv("MOECHAT_HOME", str(tmp_path / "moechat-home"))
