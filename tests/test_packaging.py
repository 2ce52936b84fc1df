"""The install layout, the headless core's imports, and the basic CLI flags."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


def _py(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_one_import_root_and_no_generic_top_level_names(tmp_path: Path) -> None:
    ok = _py("import moechat.engine, moechat.app, moechat.tuner, moechat.widgets, moechat.demo; print('ok')", tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "ok"
    for generic in ("engine", "app", "tuner", "widgets", "demo"):
        r = _py(f"import {generic}", tmp_path)
        assert r.returncode != 0, f"'import {generic}' must fail outside the checkout"
        assert "ModuleNotFoundError" in r.stderr


@pytest.mark.slow
def test_headless_core_imports_no_ui_libraries(tmp_path: Path) -> None:
    code = (
        "import sys, pkgutil, importlib\n"
        "import moechat.engine, moechat.tuner\n"
        "for pkg in (moechat.engine, moechat.tuner):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('textual', 'rich', 'plotext'))\n"
        "print(len([n for n in sys.modules if n.startswith('moechat.engine.')]), bad)\n"
    )
    r = _py(code, tmp_path)
    assert r.returncode == 0, r.stderr
    count, bad = r.stdout.strip().split(" ", 1)
    assert int(count) >= 6, "the walk must have imported the engine's modules"
    assert bad == "[]"


def _moechat(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moechat", *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env
    )


def test_version_and_help(tmp_path: Path) -> None:
    import moechat

    r = _moechat("--version", cwd=tmp_path)
    assert r.returncode == 0
    assert r.stdout.strip() == f"moechat {moechat.__version__}"
    r = _moechat("--help", cwd=tmp_path)
    assert r.returncode == 0
    assert "inspect" in r.stdout and "--paths" in r.stdout


def test_help_and_version_load_no_engine(tmp_path: Path) -> None:
    """--help and --version answer at once: torch, numba, gguf and textual load only when a command runs."""
    code = (
        "import sys\n"
        "from moechat.app.cli import main\n"
        "for argv in (['--version'], ['--help'], ['run', '--help'], ['tune', '--help'], ['chat', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'numba', 'textual', 'gguf'))\n"
        "print('loaded:', heavy)\n"
    )
    r = _py(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("loaded: []"), r.stdout[-500:]


def test_paths_prints_four_directories(tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "MOECHAT_HOME"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    env["XDG_DATA_HOME"] = str(tmp_path / "dat")
    env["XDG_CACHE_HOME"] = str(tmp_path / "cch")
    env["XDG_STATE_HOME"] = str(tmp_path / "st")
    r = _moechat("--paths", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.strip().splitlines())
    assert set(lines) == {"config", "data", "cache", "log"}
    assert lines["config"] == str(tmp_path / "cfg" / "moechat")
    assert lines["cache"] == str(tmp_path / "cch" / "moechat")
    assert lines["data"].startswith(str(tmp_path / "dat"))
    assert lines["log"].startswith(str(tmp_path / "st"))


@pytest.mark.slow
def test_inspect_without_a_model_builds_and_shows_the_demo(tmp_path: Path, smollm2_gguf: Path) -> None:
    import os
    import shutil

    cache = Path(os.environ["MOECHAT_HOME"]) / "cache"
    (cache / "sources").mkdir(parents=True)
    # The source as the first start leaves it (fetched once per test cache, not once per test).
    try:
        os.link(smollm2_gguf, cache / "sources" / smollm2_gguf.name)
    except OSError:  # another file system
        shutil.copyfile(smollm2_gguf, cache / "sources" / smollm2_gguf.name)
    stale = cache / "moechat-demo-smollm2-0123456789ab.gguf"  # an earlier recipe's build
    stale.write_bytes(b"GGUF")
    r = _moechat("inspect", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "16 per layer" in r.stdout and "shared experts" in r.stdout
    assert not stale.exists()
    (demo,) = cache.glob("moechat-demo-smollm2-*.gguf")
    stamp = demo.stat().st_mtime_ns
    r = _moechat("inspect", cwd=tmp_path)  # the second time reuses the built file
    assert r.returncode == 0 and demo.stat().st_mtime_ns == stamp
    # The second demo, by name: built from the Gemma package's chunks.
    r = _moechat("inspect", "demo:gemma", cwd=tmp_path)
    assert r.returncode == 0 and "gemma3moe" in r.stdout, r.stderr
    assert (cache / "sources" / "gemma-3-270m-q4_k_m.gguf").stat().st_size == 253113024
    r = _moechat("inspect", "demo:nope", cwd=tmp_path)
    assert r.returncode == 2 and "no demo named 'nope' (demos: smollm2, gemma)" in r.stderr


def test_inspect_without_the_demo_package_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from moechat.app.cli import main
    from moechat.demo.source import GEMMA_PACKAGE

    monkeypatch.setitem(sys.modules, GEMMA_PACKAGE, None)  # import now fails, as if not installed
    assert main(["inspect", "demo:gemma"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'moechat[demo]'" in err[0] and "or pass a model path" in err[0]


def test_malloc_tuning_applies_on_glibc() -> None:
    from moechat.engine.malloc import tune_malloc

    assert tune_malloc() is True


def _options(parser: object) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}  # type: ignore[attr-defined]


def test_every_flag_the_docs_name_exists_where_they_say() -> None:
    """Command lines in the code blocks of the README and docs/usage.md use flags of their subcommand;
    flags in their prose exist somewhere."""
    import argparse

    from moechat.app.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {name: _options(p) for name, p in sub.choices.items()}
    top = _options(parser)
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text() + (root / "docs" / "usage.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    checked = 0
    for line in (ln for b in blocks for ln in b.splitlines() if ln.startswith("moechat")):
        words = line.split("#")[0].split()
        command = words[1] if len(words) > 1 and words[1] in COMMANDS else "chat"
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", " ".join(words[1:])):
            assert flag in flags[command] | top, f"docs: `{line}`: {command} has no {flag}"
            checked += 1
    assert checked >= 10
    everywhere = set().union(*flags.values()) | top
    for flag in re.findall(r"`(--[a-z][\w-]*)", readme):
        assert flag in everywhere, f"the docs name {flag}, which no command has"


def test_the_readmes_first_screen_says_how_to_set_up_run_and_test() -> None:
    """A newcomer's first screen (40 lines): the two set-up commands, then the test commands, the ones CI
    runs."""
    root = Path(__file__).resolve().parent.parent
    first = "\n".join((root / "README.md").read_text().splitlines()[:40])
    blocks = [b.strip().splitlines() for b in re.findall(r"```bash\n(.*?)```", first, re.S)]
    assert blocks[0] == ["pip install .", "moechat"]  # a user's install: no test tools
    assert blocks[1] == ['pip install -e ".[demo,test]"', "python -m pytest -q -n 2"]
    ci = (root / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == blocks[1][1] and 'python -m pip install -q -e ".[demo,test]"' in ci
