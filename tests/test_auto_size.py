"""--moe-cache-mib auto: the cache sized from the device's memory, on an emulated device memory (CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moechat.app.cli import build_parser
from moechat.app.settings import SPEC, Settings, env_name, from_args
from moechat.engine.cache import auto_size
from moechat.engine.cache.settings import AUTO_MIB, CacheError, CacheSettings
from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import LoadedModel, load_model
from testkit.ggufgen import tiny_moe

N_CTX = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("auto") / "m.gguf", n_expert=16, n_layers=2)


def _parts(lm: LoadedModel) -> auto_size.Fit:
    """The model's parts as auto counts them (an emulated memory too small for any slot)."""
    return auto_size.fit(lm.gguf, lm.config, N_CTX, CacheSettings(mib=AUTO_MIB, emulate_device_mib=1.0))


def _largest_that_loads(lm: LoadedModel, emulated: float) -> float:
    """The largest explicit cache size the emulated memory takes (bisection on the load's refusal)."""
    lo, hi = 0.0, 2 * emulated
    for _ in range(30):
        mid = (lo + hi) / 2
        try:
            lm.set_cache(CacheSettings(mib=mid, emulate_device_mib=emulated))
            lo = mid
        except CacheError:
            hi = mid
    lm.set_cache(None)
    return lo


def _decodes(lm: LoadedModel, n: int = 6) -> list[int]:
    kv = lm.new_cache()
    tokens = [int(prefill(lm.model, [1, 5, 9, 2], kv).argmax())]
    for _ in range(n):
        tokens.append(int(decode_one(lm.model, tokens[-1], kv).argmax()))
    return tokens


def test_auto_is_off_on_the_cpu_device_and_says_why(model: Path) -> None:
    lm = load_model(model, n_ctx=N_CTX, cache=CacheSettings(mib=AUTO_MIB))
    assert lm.cache is None
    assert lm.fit is not None and lm.fit.cache == 0
    (line,) = lm.fit.lines()
    assert line.startswith("expert cache (auto): off:") and "CPU device" in line and "--emulate-device-mib" in line
    lm.close()


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_auto_takes_what_the_emulated_memory_leaves_and_never_more(model: Path, fraction: float) -> None:
    """With an emulated device of the dense part, the KV cache, the activations and `fraction` of the experts,
    auto is within 5% of the largest cache that loads, loads itself and decodes the same tokens as no cache."""
    lm = load_model(model, n_ctx=N_CTX)
    parts = _parts(lm)
    emulated = parts.dense + parts.kv + parts.activations + fraction * parts.experts
    largest = _largest_that_loads(lm, emulated)
    assert largest == pytest.approx(fraction * parts.experts, rel=1e-3)
    plain = _decodes(lm)
    cache = lm.set_cache(CacheSettings(mib=AUTO_MIB, emulate_device_mib=emulated))
    assert lm.fit is not None and cache is not None
    auto = cache.settings.mib
    assert 0.95 * largest <= auto <= min(largest, parts.experts)  # within 5%, and no over-commit
    assert auto == lm.fit.cache
    slots = sum(g.info.n_slots * g.info.expert_bytes for g in cache.groups) / 2**20
    assert 0 < slots <= auto
    assert _decodes(lm) == plain
    with pytest.raises(CacheError, match="does not fit the emulated device"):
        lm.set_cache(CacheSettings(mib=1.05 * largest, emulate_device_mib=emulated))
    lm.close()


def test_auto_caps_at_every_expert(model: Path) -> None:
    lm = load_model(model, n_ctx=N_CTX)
    parts = _parts(lm)
    cache = lm.set_cache(CacheSettings(mib=AUTO_MIB, emulate_device_mib=4 * (parts.dense + parts.experts)))
    assert cache is not None and cache.settings.mib == parts.experts
    assert lm.fit is not None and lm.fit.note == "every expert fits"
    lm.close()


def test_auto_is_the_default_and_reads_from_flag_env_and_config(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    assert Settings().moe_cache_mib == AUTO_MIB
    config = tmp_path / "config.toml"
    config.write_text('moe_cache_mib = "auto"\n')
    for name in SPEC:
        monkeypatch.delenv(env_name(name), raising=False)
    parser = build_parser()
    for argv, env in ((["--moe-cache-mib", "12"], None), ([], "7.5"), ([], None)):
        if env is not None:
            monkeypatch.setenv(env_name("moe_cache_mib"), env)
        s, _, _ = from_args(parser.parse_args(["run", "m.gguf", "-p", "x", "--config", str(config), *argv]),
                            ("moe_cache_mib",))  # fmt: skip
        want = 12.0 if argv else 7.5 if env else AUTO_MIB
        assert s.moe_cache_mib == want
        monkeypatch.delenv(env_name("moe_cache_mib"), raising=False)


def test_a_bad_size_or_emulation_is_one_line(tmp_path: Path) -> None:
    for args, words in ((["--moe-cache-mib", "lots"], "moe-cache-mib"), (["--moe-cache-mib", "-1"], ">= 0 or auto"),
                        (["--emulate-device-mib", "-5"], "emulate-device-mib")):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "moechat", "run", str(tmp_path / "none.gguf"), "-p", "x", *args],
                           capture_output=True, text=True)  # fmt: skip
        assert r.returncode != 0
        assert words in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_inspect_fit_prints_the_plan(model: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "moechat", "inspect", str(model), "--fit", "-c", str(N_CTX),
                        "--emulate-device-mib", "40"], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "40 MiB emulated" in out and "margin" in out and "expert slots per MoE layer of 16" in out
    lm = load_model(model, n_ctx=N_CTX)
    f = auto_size.fit(lm.gguf, lm.config, N_CTX, CacheSettings(mib=AUTO_MIB, emulate_device_mib=40))
    lm.close()
    assert f"expert cache (auto): {f.cache:,.1f} MiB" in out
    assert "experts" in out and "all in RAM" in out  # the RAM tier's line: this model's experts fit


torch.set_grad_enabled(False)


def test_a_stage_of_a_split_model_sizes_its_cache_from_its_own_layers(tmp_path: Path) -> None:
    """Each host of a split model holds its own layers: auto counts their weights, KV cache and experts
    (and the embedding and head on the stage from layer 0), not the whole model's."""
    path = tiny_moe(tmp_path / "m4.gguf", n_expert=16, n_layers=4)
    whole = load_model(path, n_ctx=N_CTX)
    parts = _parts(whole)
    emulated = parts.dense + parts.kv + parts.activations + 0.25 * parts.experts
    one_host = auto_size.fit(whole.gguf, whole.config, N_CTX, CacheSettings(mib=AUTO_MIB, emulate_device_mib=emulated))
    fits = []
    for layers in (range(0, 2), range(2, 4)):
        lm = load_model(path, n_ctx=N_CTX, own_layers=layers,
                        cache=CacheSettings(mib=AUTO_MIB, emulate_device_mib=emulated))  # fmt: skip
        assert lm.fit is not None and lm.cache is not None and lm.own_layers == layers
        stage = lm.fit
        own = auto_size.expert_bytes(lm.gguf, lm.config.n_layers, layers)[0] / 2**20
        assert stage.experts == pytest.approx(own) and own == pytest.approx(parts.experts / 2)
        assert stage.kv == pytest.approx(parts.kv / 2, rel=0.01) and stage.dense < parts.dense
        # Half the experts and part of the dense weights in the same memory: a larger share of its experts
        # cached than the whole model would have on one host.
        assert stage.cache / stage.experts > one_host.cache / one_host.experts > 0
        # The stage's cache holds its own layers only, and what auto gave it.
        assert {layer for g in lm.cache.groups for layer in g.info.layers} <= set(layers)
        fits.append(stage)
        lm.close()
    first, second = fits
    assert first.dense > second.dense  # the stage from layer 0 holds the embedding and the head
    whole.close()
