"""Settings from four layers: flag > MOECHAT_* env > config.toml > defaults, each value knowing its source.

A bad value names the setting and where it came from. A config.toml that is not valid TOML
gives a warning and the defaults; the file is left untouched, and set aside (renamed, never
deleted) only when the app saves a new one over it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib
from moechat.engine.kernel_modes import KERNEL_MODES

from .atomic import write_atomic

logger = logging.getLogger(__name__)


class SettingError(ValueError):
    """A setting with a value that cannot work; the message names the setting and its source."""


def _nonneg(x: float) -> bool:
    return x >= 0 and math.isfinite(x)


def _unit(x: float) -> bool:
    return 0 <= x <= 1


# name: (type, check, what a good value is)
SPEC: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "device": (str, lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda"),
    "moe_cache_mib": (float, _nonneg, ">= 0"),
    "moe_cache_cpu_share": (float, _unit, "in [0, 1]"),
    "emulate_link_gbps": (float, _nonneg, ">= 0"),
    "cpu_dequant_mib": (float, _nonneg, ">= 0"),
    "cpu_kernels": (str, lambda v: v in KERNEL_MODES, " or ".join(KERNEL_MODES)),
    "threads": (int, lambda v: 0 <= v <= 1024, "in 0..1024 (0: one per core)"),
    "ctx_size": (int, lambda v: 16 <= v <= 1 << 20, "in 16..1048576"),
    "n_predict": (int, lambda v: v > 0, "> 0"),
    "temp": (float, _nonneg, ">= 0"),
    "top_k": (int, lambda v: v >= 0, ">= 0"),
    "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (float, lambda v: 0 <= v < 1, "in [0, 1)"),
    "repeat_penalty": (float, lambda v: v > 0, "> 0 (1 = off)"),
    "system": (str, lambda v: True, "text"),
    "refresh_ms": (int, lambda v: 50 <= v <= 10_000, "in 50..10000"),
    "theme": (str, lambda v: bool(v), "a theme name"),
}


@dataclass(frozen=True)
class Settings:
    device: str = "auto"
    moe_cache_mib: float = 0.0
    moe_cache_cpu_share: float = 0.0
    emulate_link_gbps: float = 0.0
    cpu_dequant_mib: float = 0.0
    cpu_kernels: str = "fast"
    threads: int = 0  # torch's intra-op threads for the engine; 0: torch's default
    ctx_size: int = 4096
    n_predict: int = 512
    temp: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    system: str = ""
    refresh_ms: int = 250
    theme: str = "textual-dark"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")


# Half of each demo's routed experts, so hits, uploads and CPU-computed misses all show on the
# dashboard once the cache has filled. SmolLM2 at 135M loops without a repeat penalty (greedy, 20
# held-out prompts: 75% of the dense model's replies end on their own within 256 tokens); with
# llama-cpp-python's default of 1.1 every one did, dense and demo (bench/demo_chat.py).
DEMO_DEFAULTS: dict[str, dict[str, float]] = {
    "smollm2": {"moe_cache_mib": 137.0, "moe_cache_cpu_share": 0.5, "temp": 0.3, "repeat_penalty": 1.1},
    "gemma": {"moe_cache_mib": 138.0, "moe_cache_cpu_share": 0.5},
}
DEMO_PREFIX = "demo:"
MODEL_HELP = "path to a .gguf model (first shard of a split one); default: the built-in demo (demo:gemma: the second)"


def demo_name(model: str | None) -> str | None:
    """The built-in demo a model argument names: none given is the default demo, `demo:NAME` another."""
    if model is None:
        return "smollm2"
    return model[len(DEMO_PREFIX) :] if model.startswith(DEMO_PREFIX) else None


def for_demo(settings: Settings, model: str | None) -> Settings:
    """A built-in demo's own defaults (DEMO_DEFAULTS) for what the user did not set."""
    name = demo_name(model)
    if name not in DEMO_DEFAULTS:
        return settings
    changes = {k: value for k, value in DEMO_DEFAULTS[name].items() if settings.source(k) == "default"}
    if not changes:
        return settings
    sources = {**settings.sources, **dict.fromkeys(changes, "the demo's default")}
    return replace(settings, **changes, sources=sources)  # type: ignore[arg-type]


def env_name(name: str) -> str:
    return "MOECHAT_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _coerce(name: str, raw: Any, source: str) -> Any:
    kind, check, want = SPEC[name]
    try:
        if (kind is float and isinstance(raw, bool)) or (kind is int and isinstance(raw, bool)):
            raise TypeError
        value = kind(raw) if not (kind is int and isinstance(raw, float) and not raw.is_integer()) else None
        if value is None:
            raise TypeError
    except (TypeError, ValueError):
        raise SettingError(
            f"{name} from {source}: {raw!r} is not {'a number' if kind is not str else 'text'}"
        ) from None
    if not check(value):
        raise SettingError(f"{name} from {source}: {value!r} must be {want}")
    return value


def read_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """The settings in config.toml, and a warning if the file could not be used (then no settings)."""
    if not path.is_file():
        return {}, None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return {}, f"{path} is not valid TOML ({e}); using the defaults, the file is left as it is"
    for key in list(data):
        if key not in SPEC:
            logger.warning("%s: unknown setting %r ignored", path, key)
            del data[key]
    return data, None


def resolve(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> tuple[Settings, list[str]]:
    """Settings with each value from the highest layer that has it; returns (settings, warnings)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    warnings = []
    if config_path is not None:
        config, warning = read_config(config_path)
        if warning:
            warnings.append(warning)
        for name, raw in config.items():
            src = f"{config_path}"
            values[name], sources[name] = _coerce(name, raw, src), src
    for name in SPEC:
        raw = env.get(env_name(name))
        if raw is not None and raw != "":
            src = f"env {env_name(name)}"
            values[name], sources[name] = _coerce(name, raw, src), src
    for name, raw in (flags or {}).items():
        if raw is not None and name in SPEC:
            src = f"flag {flag_name(name)}"
            values[name], sources[name] = _coerce(name, raw, src), src
    return replace(Settings(), **values, sources=sources), warnings


def save_config(path: Path, updates: Mapping[str, Any]) -> Path:
    """Merge `updates` into config.toml atomically. A corrupt file is renamed aside, never overwritten."""
    for name, value in updates.items():
        _coerce(name, value, "the value to save")
    current: dict[str, Any] = {}
    if path.is_file():
        current, warning = read_config(path)
        if warning:
            aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            logger.warning("%s was not valid TOML: kept as %s", path, aside)
    current.update(updates)
    lines = ["# moechat settings (flags and MOECHAT_* variables override these)"]
    for name in SPEC:
        if name in current:
            lines.append(f"{name} = {_toml_value(current[name])}")
    return write_atomic(path, "\n".join(lines) + "\n")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def names() -> list[str]:
    return [f.name for f in fields(Settings) if f.name != "sources"]
