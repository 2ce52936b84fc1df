"""Every setting is declared once (app/settings.py) and every command reads it through that declaration."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from moechat.app.cli import build_parser
from moechat.app.repl import SETTINGS as CHAT
from moechat.app.settings import (
    APP,
    ENGINE,
    SAMPLING,
    SERVE,
    SPEC,
    Settings,
    env_name,
    flag_name,
    from_args,
    resolve,
    sampling_params,
)
from moechat.app.tune_cmd import TUNE_SETTINGS

# A valid value other than the default for every setting, as text (what a flag or variable holds).
OTHER = {
    "device": "cpu", "moe_cache_mib": "3.5", "moe_cache_cpu_share": "0.25", "moe_cache_trace": "t.jsonl",
    "moe_cache_policy": "protect", "moe_cache_prefetch": "next-layer",
    "load_mode": "pinned", "emulate_link_gbps": "16", "emulate_device_mib": "512", "cpu_dequant_mib": "64",
    "ram_cache_mib": "2048", "emulate_host_mib": "8192",
    "cpu_kernels": "exact", "threads": "1",
    "ctx_size": "512", "chat_template": "t.jinja", "n_predict": "7", "temp": "0.2", "top_k": "5", "top_p": "0.5",
    "min_p": "0.1", "repeat_penalty": "1.2", "seed": "11", "system": "Be brief.", "refresh_ms": "500",
    "theme": "nord", "parallel": "4",
}  # fmt: skip
COMMANDS = {"chat": CHAT, "run": (*SAMPLING, *ENGINE), "tune": TUNE_SETTINGS, "serve": (*SAMPLING, *ENGINE, *SERVE)}


def test_the_declaration_covers_every_setting_and_each_value_differs_from_its_default() -> None:
    names = [f.name for f in dataclasses.fields(Settings) if f.name != "sources"]
    assert sorted(SPEC) == sorted(names) == sorted(OTHER)
    for name, raw in OTHER.items():
        value = SPEC[name].kind(raw)
        assert SPEC[name].check(value) and value != getattr(Settings(), name), name


def _argv(command: str, names: tuple[str, ...], values: dict[str, str]) -> list[str]:
    argv = [command, "m.gguf"] + (["-p", "hi"] if command == "run" else [])
    for name in names:
        argv += [flag_name(name), values[name]]
    return argv


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_takes_its_settings_from_flag_env_and_config_alike(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = COMMANDS[command]
    parser = build_parser()
    config = tmp_path / "config.toml"
    config.write_text("")
    for name in SPEC:
        monkeypatch.delenv(env_name(name), raising=False)
    # Flags: every setting the command takes, under the declared flag name.
    args = parser.parse_args([*_argv(command, names, OTHER), "--config", str(config)])
    s, _, _ = from_args(args, names)
    for name in names:
        assert getattr(s, name) == SPEC[name].kind(OTHER[name]), (command, name)
        assert s.source(name) == f"flag {flag_name(name)}"
    # The same values from MOECHAT_* variables, and from config.toml, with no flags.
    for name in names:
        monkeypatch.setenv(env_name(name), OTHER[name])
    s, _, _ = from_args(parser.parse_args([*_argv(command, (), OTHER), "--config", str(config)]), names)
    assert all(getattr(s, n) == SPEC[n].kind(OTHER[n]) and s.source(n) == f"env {env_name(n)}" for n in names)
    for name in names:
        monkeypatch.delenv(env_name(name))
    lines = [f"{n} = {OTHER[n]!r}" if SPEC[n].kind is str else f"{n} = {OTHER[n]}" for n in names]
    config.write_text("\n".join(lines) + "\n")
    s, _, _ = from_args(parser.parse_args([*_argv(command, (), OTHER), "--config", str(config)]), names)
    assert all(getattr(s, n) == SPEC[n].kind(OTHER[n]) and s.source(n) == str(config) for n in names)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_flag_value_is_one_line_naming_the_setting_and_flag(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moechat.app.cli import main

    config = tmp_path / "config.toml"
    config.write_text("")
    assert main([*_argv(command, ("ctx_size",), {"ctx_size": "8"}), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == "moechat: error: ctx_size from flag --ctx-size: 8 must be in 16..1048576\n"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_warns_of_a_config_that_is_not_toml(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moechat.app.cli import main

    config = tmp_path / "config.toml"
    config.write_text("moe_cache_mib = = 3\n")
    argv = _argv(command, (), {})
    argv[1] = str(tmp_path / "none.gguf")  # the command gets as far as opening the model
    assert main([*argv, "--config", str(config)]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"moechat: warning: {config} is not valid TOML") and "defaults" in warning
    assert error.startswith("moechat: error: ") and "none.gguf" in error
    assert config.read_text() == "moe_cache_mib = = 3\n"  # left as it is


def test_seed_reaches_the_sampler() -> None:
    assert sampling_params(Settings(seed=11)).seed == 11
    assert sampling_params(Settings()).seed is None  # -1: a new seed each reply
    with pytest.raises(ValueError, match="seed"):
        from moechat.app.settings import resolve

        resolve({"seed": -5}, {}, None)


def test_the_app_replies_with_the_settings_seed_and_sampling(tmp_path: Path) -> None:
    from moechat.app.paths import AppPaths
    from moechat.app.tui import MoechatApp
    from testkit.fake_engine import FakeEngine
    from testkit.pilot import ready, say

    engine = FakeEngine(["The", " sea", "."])
    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    settings = Settings(seed=11, temp=0.2, top_k=5)
    app = MoechatApp(lambda progress: engine, settings, paths=paths)

    async def run() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await say(pilot, await ready(pilot), "hi")

    asyncio.run(run())
    got: Any = engine.params[-1]
    assert (got.seed, got.temperature, got.top_k) == (11, 0.2, 5)


def test_the_usage_page_lists_every_setting() -> None:
    """docs/usage.md's one list of settings is the declaration's, no more and no fewer."""
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    start = usage.index("Settings come from flags")
    listed = re.findall(r"`([a-z_]+)`", usage[start : usage.index("--help` lists each", start)])
    assert sorted(n for n in listed if n not in ("chat", "run", "serve", "tune")) == sorted(SPEC)


def test_the_groups_hold_every_setting_once() -> None:
    groups = (*ENGINE, *SAMPLING, *APP, *SERVE)
    assert sorted(groups) == sorted(SPEC) and len(set(groups)) == len(groups)


def test_an_engine_parameter_error_names_the_setting_flag() -> None:
    """The engine says what is wrong in its words; the command line names its own flag for it."""
    from moechat.app.settings import ENGINE_PARAMETERS, error_line
    from moechat.engine.cache.settings import CacheError, CacheSettings

    assert set(ENGINE_PARAMETERS.values()) <= set(SPEC)
    with pytest.raises(CacheError) as info:
        CacheSettings(mib=1, cpu_share=2.0).validate()
    assert error_line(info.value) == "--moe-cache-cpu-share: the CPU share must be in [0, 1] or auto, got 2.0"
    hinted = CacheError("mib", "a cache of 9 MiB: no room", suggestion=4)
    assert error_line(hinted) == "--moe-cache-mib: a cache of 9 MiB: no room; try --moe-cache-mib 4"
    assert error_line(ValueError("plain\nsecond line")) == "plain"


def test_tuned_settings_apply_to_their_model_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the wizard or `tune --save` kept for one model file applies when that file runs, above
    config.toml and below variables and flags; another model keeps the user's defaults."""
    import argparse

    from moechat.app.paths import app_paths
    from moechat.app.tuned import file_identity, save_tuned
    from testkit.ggufgen import tiny_moe

    tuned = tiny_moe(tmp_path / "tuned.gguf", n_vocab=300)
    other = tiny_moe(tmp_path / "other.gguf", n_vocab=300, n_expert=4)
    config = app_paths().config / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("moe_cache_mib = 7.0\n")
    kept = save_tuned(file_identity(tuned), tuned.name, 2.5, 0.75)

    def settings(model: Path, **flags: Any) -> Settings:
        args = argparse.Namespace(model=str(model), config=None, **flags)
        return from_args(args, ENGINE)[0]

    s = settings(tuned)
    assert (s.moe_cache_mib, s.moe_cache_cpu_share) == (2.5, 0.75)
    assert s.source("moe_cache_mib") == f"tuned for this model ({kept})"
    assert settings(other).moe_cache_mib == 7.0  # another model: config.toml, the user's default
    assert settings(tuned, moe_cache_mib=4.0).moe_cache_mib == 4.0  # a flag wins
    monkeypatch.setenv("MOECHAT_MOE_CACHE_CPU_SHARE", "0.25")
    assert settings(tuned).moe_cache_cpu_share == 0.25  # a variable wins
    kept.write_text("moe_cache_mib = -3\n")  # a bad kept value is left out, with the user's default instead
    assert settings(tuned).moe_cache_mib == 7.0


@pytest.mark.parametrize(
    ("low", "high"),
    [
        ("default", "config"),
        ("default", "env"),
        ("default", "flag"),
        ("config", "env"),
        ("config", "flag"),
        ("env", "flag"),
    ],
)
def test_settings_layers(tmp_path: Path, low: str, high: str) -> None:
    config = tmp_path / "config.toml"
    values = {"default": None, "config": 0.3, "env": 0.6, "flag": 0.9}
    if "config" in (low, high):
        config.write_text(f"moe_cache_cpu_share = {values['config']}\n")
    env = {"MOECHAT_MOE_CACHE_CPU_SHARE": str(values["env"])} if "env" in (low, high) else {}
    flags = {"moe_cache_cpu_share": values["flag"]} if "flag" in (low, high) else {}
    s, warnings = resolve(flags, env, config)
    assert not warnings
    assert s.moe_cache_cpu_share == values[high]
    assert s.source("moe_cache_cpu_share").startswith({"config": str(config), "env": "env", "flag": "flag"}[high])


def test_the_demo_has_its_own_defaults_below_anything_the_user_set(tmp_path: Path) -> None:
    from moechat.app.settings import DEMO_DEFAULTS, for_demo, mib_words

    config = tmp_path / "config.toml"
    config.write_text("moe_cache_mib = 8\n")
    s = for_demo(resolve({}, {"MOECHAT_MOE_CACHE_CPU_SHARE": "0.25"}, config)[0], None)
    assert (s.moe_cache_mib, s.source("moe_cache_mib")) == (8.0, str(config))
    assert (s.moe_cache_cpu_share, s.source("moe_cache_cpu_share")) == (0.25, "env MOECHAT_MOE_CACHE_CPU_SHARE")
    s = for_demo(resolve({}, {}, config)[0], None)
    assert s.moe_cache_cpu_share == DEMO_DEFAULTS["smollm2"]["moe_cache_cpu_share"] > 0
    assert s.source("moe_cache_cpu_share") == "the demo's default"
    # No setting at all: the demo runs with a cache, so the dashboard has something to show.
    d = for_demo(Settings(), None)
    assert d.moe_cache_mib == DEMO_DEFAULTS["smollm2"]["moe_cache_mib"] > 0 and d.cpu_kernels == "fast"
    # The second demo has its own size; the user's own model gets the plain defaults.
    assert for_demo(Settings(), "demo:gemma").moe_cache_mib == DEMO_DEFAULTS["gemma"]["moe_cache_mib"]
    assert DEMO_DEFAULTS["gemma"]["moe_cache_mib"] != DEMO_DEFAULTS["smollm2"]["moe_cache_mib"]
    # The user's own model gets the plain defaults: a cache sized by itself (auto).
    assert for_demo(Settings(), "m.gguf") == Settings() and mib_words(Settings().moe_cache_mib) == "auto"


def test_bad_settings_name_the_setting_and_source(tmp_path: Path) -> None:
    from moechat.app.settings import SettingError, save_config

    with pytest.raises(SettingError, match=r"moe_cache_mib from env MOECHAT_MOE_CACHE_MIB: -1.0 must be >= 0"):
        resolve({}, {"MOECHAT_MOE_CACHE_MIB": "-1"}, None)
    with pytest.raises(SettingError, match=r"moe_cache_cpu_share from flag --moe-cache-cpu-share"):
        resolve({"moe_cache_cpu_share": 1.5}, {}, None)
    config = tmp_path / "config.toml"
    config.write_text('device = "tpu"\n')
    with pytest.raises(SettingError, match=rf"device from {config}"):
        resolve({}, {}, config)
    # A corrupt file: a warning, the defaults, the file untouched; saving sets it aside.
    config.write_text("moe_cache_mib = = 3\n")
    s, warnings = resolve({}, {}, config)
    assert s == Settings() and warnings and "not valid TOML" in warnings[0]
    assert config.read_text() == "moe_cache_mib = = 3\n"
    save_config(config, {"theme": "nord"})
    aside = list(tmp_path.glob("config.toml.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == "moe_cache_mib = = 3\n"
    assert resolve({}, {}, config)[0].theme == "nord"
