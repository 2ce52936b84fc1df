"""--moe-cache-cpu-share auto: the closed form over the link's and the CPU's speeds, measured once per machine."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from moechat.app.cli import build_parser
from moechat.app.settings import SPEC, SettingError, Settings, coerce, env_name, from_args, mib_words
from moechat.engine.cache import share_auto
from moechat.engine.cache.policy import closed_form_share
from moechat.engine.cache.settings import AUTO_SHARE, CacheSettings
from moechat.engine.loader import load_model
from moechat.tuner.time_model import forecast
from testkit.ggufgen import tiny_moe

N_CTX = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("share") / "m.gguf", n_expert=16, n_layers=2)


def test_the_closed_form_is_one_less_link_over_cpu() -> None:
    assert closed_form_share(10.0, 20.0) == 0.5 and math.isclose(closed_form_share(4.0, 25.0), 0.84)
    assert closed_form_share(30.0, 20.0) == 0.0  # the link is faster: no share
    assert closed_form_share(math.inf, 20.0) == 0.0  # no link to wait on
    assert closed_form_share(0.0, 20.0) == 1.0
    assert closed_form_share(10.0, 0.0) == 0.0  # no CPU speed known


def test_a_load_measures_once_and_keeps_the_speeds_per_machine(model: Path, tmp_path: Path) -> None:
    kept = tmp_path / "speeds.json"
    settings = CacheSettings(mib=1.0, cpu_share=AUTO_SHARE, emulate_link_gbps=2.0, speeds_file=kept)
    lm = load_model(model, n_ctx=N_CTX, cache=settings)
    first = lm.speeds
    assert first is not None and first.measured and first.link_gbps == 2.0 and first.cpu_gbps > 0
    assert lm.cache is not None and lm.cache.settings.cpu_share == closed_form_share(2.0, first.cpu_gbps)
    assert lm.cache.settings.cpu_share != AUTO_SHARE
    lm.close()
    (entry,) = json.loads(kept.read_text())["cpu"].values()
    assert entry == first.cpu_gbps
    # The next load reads the kept speed: no probe (a probe would not give the same float twice)
    lm = load_model(model, n_ctx=N_CTX, cache=settings)
    assert lm.speeds is not None and not lm.speeds.measured and lm.speeds.cpu_gbps == first.cpu_gbps
    assert "measured earlier on this machine" in lm.speeds.line()
    lm.close()


def test_the_share_follows_the_link_against_the_cpu(model: Path, tmp_path: Path) -> None:
    lm = load_model(model, n_ctx=N_CTX)
    host, k = lm.model.host_experts, lm.config.n_expert_used
    try:
        for link, want in ((5.0, 0.75), (40.0, 0.0), (0.5, 0.975)):
            settings = CacheSettings(mib=1.0, cpu_share=AUTO_SHARE, emulate_link_gbps=link,
                                     speeds_file=tmp_path / f"{link}.json")  # fmt: skip
            s = share_auto.speeds(settings, host, k, measure_cpu=lambda h, n: 20.0)
            assert s.share == pytest.approx(want)
        # A remeasure measures even where a speed is kept
        kept = tmp_path / "5.0.json"
        settings = CacheSettings(mib=1.0, cpu_share=AUTO_SHARE, emulate_link_gbps=5.0, speeds_file=kept)
        again = share_auto.speeds(settings, host, k, remeasure=True)
        assert again.measured and again.cpu_gbps != 20.0
    finally:
        lm.close()


def test_no_link_to_wait_on_or_no_cache_means_no_share(model: Path, tmp_path: Path) -> None:
    kept = tmp_path / "speeds.json"
    lm = load_model(model, n_ctx=N_CTX, cache=CacheSettings(mib=1.0, cpu_share=AUTO_SHARE, speeds_file=kept))
    assert lm.cache is not None and lm.cache.settings.cpu_share == 0.0
    assert lm.speeds is not None and math.isinf(lm.speeds.link_gbps) and "no emulated link" in lm.speeds.line()
    lm.close()
    lm = load_model(model, n_ctx=N_CTX, cache=CacheSettings(mib=0.0, cpu_share=AUTO_SHARE, emulate_link_gbps=1.0,
                                                            speeds_file=kept))  # fmt: skip
    assert lm.cache is None and lm.speeds is None
    lm.close()
    assert not kept.exists()  # nothing was measured


def test_auto_is_the_default_and_a_flag_or_variable_sets_a_number(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    assert Settings().moe_cache_cpu_share == AUTO_SHARE and mib_words(Settings().moe_cache_cpu_share) == "auto"
    config = tmp_path / "config.toml"
    config.write_text('moe_cache_cpu_share = "auto"\n')
    for name in SPEC:
        monkeypatch.delenv(env_name(name), raising=False)
    parser = build_parser()
    flag = "--moe-cache-cpu-share"
    # (flag value, variable value, what wins): the flag over the variable over config.toml's auto
    cases = (("0.25", None, 0.25), (None, "0.5", 0.5), (None, None, AUTO_SHARE), ("auto", "0.5", AUTO_SHARE))
    for given, env, want in cases:
        if env is not None:
            monkeypatch.setenv(env_name("moe_cache_cpu_share"), env)
        argv = [flag, given] if given else []
        s, _, _ = from_args(parser.parse_args(["run", "m.gguf", "-p", "x", "--config", str(config), *argv]),
                            ("moe_cache_cpu_share",))  # fmt: skip
        assert s.moe_cache_cpu_share == want, (given, env)
        monkeypatch.delenv(env_name("moe_cache_cpu_share"), raising=False)
    for bad in ("-1", "1.5", "most"):
        with pytest.raises(SettingError, match="in \\[0, 1\\] or auto|is not"):
            coerce("moe_cache_cpu_share", bad, "a flag")


def test_a_tuned_share_wins_over_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moechat.app.settings import for_model
    from moechat.app.tuned import identity_of, save_tuned

    monkeypatch.setenv("MOECHAT_HOME", str(tmp_path / "home"))
    path = tiny_moe(tmp_path / "t.gguf")
    identity = identity_of(path)
    assert identity is not None
    save_tuned(identity, "t", 3.0, 0.4)
    tuned = for_model(Settings(), path)
    assert tuned.moe_cache_cpu_share == 0.4 and tuned.source("moe_cache_cpu_share").startswith("tuned")
    flagged = for_model(replace(Settings(), sources={"moe_cache_cpu_share": "flag"}), path)
    assert flagged.moe_cache_cpu_share == AUTO_SHARE  # a flag wins over the tuned value (here: auto)


@pytest.mark.slow
def test_run_with_an_auto_share_writes_what_no_cache_writes(model: Path, tmp_path: Path) -> None:
    """`moechat run` on an emulated GPU (memory and link): the cache and the auto share, as the log says,
    and the greedy text of no cache."""
    env = {**os.environ, "MOECHAT_HOME": str(tmp_path / "home")}

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "moechat", "-v", "run", str(model), "-p", "Once upon a time", "-n", "24",
               "--temp", "0", "--ignore-eos", "-c", str(N_CTX), *flags]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    on = run("--emulate-device-mib", "7", "--emulate-link-gbps", "1")  # 4.2 MiB of dense weights and the rest
    off = run("--moe-cache-mib", "0")
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    assert "CPU share (auto): " in on.stderr and "measured now" in on.stderr, on.stderr[-2000:]
    assert on.stdout == off.stdout and on.stdout.strip()
    assert (tmp_path / "home" / "data" / "speeds.json").exists()


def test_inspect_fit_prints_the_share_and_remeasures(model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "MOECHAT_HOME": str(tmp_path / "home")}

    def fit(*flags: str) -> str:
        cmd = [sys.executable, "-m", "moechat", "inspect", str(model), "--fit", "-c", str(N_CTX),
               "--emulate-device-mib", "7", *flags]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return " ".join(r.stdout.split())

    assert "CPU share (auto): 0: on the CPU device with no emulated link" in fit()
    first = fit("--emulate-link-gbps", "1")
    assert "CPU share (auto): " in first and "link 1.0 GB/s" in first and "measured now" in first
    predicted = re.search(r"predicted decode: ([\d.]+) t/s .*?(\d+)% hits", first)
    assert predicted is not None and float(predicted.group(1)) > 0 and 0 < int(predicted.group(2)) <= 100
    assert "measured earlier on this machine" in fit("--emulate-link-gbps", "1")
    assert "measured now" in fit("--emulate-link-gbps", "1", "--remeasure")


def test_the_forecast_follows_the_traffic() -> None:
    """The time model before any run: on the CPU device a measured token plus the uploads over the link; on a
    device the bytes it reads at its speed, the uploads over the link and the CPU's share at the CPU's."""
    mib = 2**20
    per_layer = [4 * mib] * 4  # 4 layers of 16 experts of 4 MiB, top-2
    every = forecast(0, per_layer, 2, 16, 16 * 16 * mib, 0.0, link_gbps=1, cpu_gbps=1, token_ms=10)
    assert every.tps == pytest.approx(100.0) and every.hit_rate == 1.0 and every.upload_mib == 0
    half = forecast(0, per_layer, 2, 16, 16 * 8 * mib, 0.0, link_gbps=1, cpu_gbps=1, token_ms=10)
    assert half.hit_rate == pytest.approx(0.5)
    assert half.upload_mib == pytest.approx(4 * 2 * 0.5 * 4)  # layers x k x misses x MiB
    assert half.tps == pytest.approx(1000 / (10 + 1000 * half.upload_mib * mib / 1e9))
    # A device: the CPU's share runs while the rest is uploaded, so the fastest share has both take as long.
    kw = {"link_gbps": 10.0, "cpu_gbps": 20.0, "device_gbps": 1000.0}
    tps = {s / 100: forecast(mib, per_layer, 2, 16, 16 * 4 * mib, s / 100, **kw).tps for s in range(101)}
    best = max(tps, key=tps.__getitem__)
    assert best == pytest.approx(2 / 3, abs=0.015)  # (1 - s) / 10 = s / 20
    assert tps[0.0] < tps[best] and tps[1.0] < tps[best]


def test_the_cpu_probe_calls_each_kind_of_layer_before_its_clock_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer whose experts are of other types runs kernels of its own: their first call (a compile on a
    first start) must not be timed as the CPU's speed."""
    from gguf import GGMLQuantizationType as Q

    path = tiny_moe(tmp_path / "mixed.gguf", n_layers=3, n_expert=8, layer_expert_types={1: Q.Q4_K})
    lm = load_model(path, n_ctx=N_CTX)
    host = lm.model.host_experts
    started: list[bool] = []
    timed: list[tuple[int, bool]] = []  # (layer, whether the probe's clock had started)

    class Watched:
        layers = host.layers

        def __call__(self, layer: int, *args: object) -> object:
            timed.append((layer, bool(started)))
            return host(layer, *args)

    clock = share_auto.time.perf_counter

    def perf_counter() -> float:
        started.append(True)
        return clock()

    monkeypatch.setattr(share_auto.time, "perf_counter", perf_counter)
    try:
        assert share_auto.cpu_gbps(Watched(), 2, seconds=0.05) > 0
    finally:
        lm.close()
    before = {layer for layer, t in timed if not t}
    assert {0, 1} <= before  # Q8_0's layer and Q4_K's, each called before the clock started
    assert any(t for _, t in timed)
