"""Every setting, declared once: its flag, MOECHAT_* variable, config.toml key, default, check and help.

A value comes from the highest of four layers: flag > MOECHAT_* env > config.toml > default, and
knows its source. `moechat chat`, `run` and `tune`, the full-screen app and the engine process
all read settings through this module: the flags are made from the declaration (`add_flags`),
resolved by `from_args`, and turned into the engine's objects by `cache_settings` and
`sampling_params`.

A bad value names the setting and where it came from. A config.toml that is not valid TOML
gives a warning and the defaults; the file is left untouched, and set aside (renamed, never
deleted) only when the app saves a new one over it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib
from moechat.app.atomic import write_atomic
from moechat.engine.cache.policy import POLICIES as CACHE_POLICIES
from moechat.engine.cache.settings import AUTO_MIB, AUTO_SHARE
from moechat.engine.errors import ParameterError
from moechat.engine.kernels.modes import KERNEL_MODES
from moechat.engine.kernels.modes import describe as describe_kernel_modes

if TYPE_CHECKING:  # the engine (torch) loads when a command runs, not for --help
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.events import SamplingParams

logger = logging.getLogger(__name__)


class SettingError(ValueError):
    """A setting with a value that cannot work; the message names the setting and its source."""


def _nonneg(x: float) -> bool:
    return x >= 0 and math.isfinite(x)


def _unit(x: float) -> bool:
    return 0 <= x <= 1


def _any(_: object) -> bool:
    return True


class _Auto(float):
    """ "auto" for the cache's size and CPU share: the engine's AUTO_MIB and AUTO_SHARE (both -1), told apart
    from a -1 a user wrote (which is refused)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Auto, (float(self),))


AUTO = _Auto(AUTO_MIB)
AUTO_CPU_SHARE = _Auto(AUTO_SHARE)


def _number_or(auto: _Auto, what: str) -> Callable[[Any], float]:
    """A parse function for a number or "auto" (then `auto`, resolved at load)."""

    def parse(raw: Any) -> float:
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return auto
        if isinstance(raw, bool):
            raise TypeError(f"{what} is a number or auto")
        return float(raw)

    return parse


cache_mib = _number_or(AUTO, "a cache size")  # MiB, or auto: sized at load from the device's memory
cache_share = _number_or(AUTO_CPU_SHARE, "a CPU share")  # [0, 1], or auto: from the link's and the CPU's speeds


def _cache_size(x: float) -> bool:
    return isinstance(x, _Auto) or _nonneg(x)


def _cache_share(x: float) -> bool:
    return isinstance(x, _Auto) or _unit(x)


def mib_words(mib: float) -> str:
    """A cache size or CPU share setting as a user writes it."""
    return "auto" if isinstance(mib, _Auto) else f"{mib:g}"


@dataclass(frozen=True)
class Spec:
    """One setting's declaration: its type and check (`want`: what a good value is) and its flag."""

    kind: Callable[[Any], Any]  # a type, or a parse function (cache_mib)
    check: Callable[[Any], bool]
    want: str
    help: str
    short: str | None = None  # e.g. "-n"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    words: Callable[[Any], str] | None = None  # a value as a user writes it, where str() would not say it


def _one_of(choices: tuple[str, ...], help: str) -> Spec:
    """A setting that takes one of `choices`: the check, what a good value is and the flag's metavar from them."""
    want = ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]
    return Spec(str, lambda v: v in choices, want, help, choices=choices)


def _setting(default: Any, group: str, spec: Spec) -> Any:
    """A field of `Settings` with its declaration: one place names a setting, its group and its check."""
    return field(default=default, metadata={"group": group, "spec": spec})


@dataclass(frozen=True)
class Settings:
    """Every setting: a field each, declared with its default, its group (engine, sampling, app) and its spec.
    The flags, variables, config keys, groups and docs/usage.md's list all come from these fields."""

    device: str = _setting("auto", "engine", _one_of(("auto", "cpu", "cuda"), "where the model runs"))
    moe_cache_mib: float = _setting(
        AUTO,
        "engine",
        Spec(cache_mib, _cache_size, ">= 0 or auto",
             "device expert cache in MiB, fractions allowed; 0 = off; auto = what the device's memory leaves "
             "after the rest of the model (off on the CPU device unless --emulate-device-mib)",
             metavar="N|auto", words=mib_words),
    )  # fmt: skip
    moe_cache_cpu_share: float = _setting(
        AUTO_CPU_SHARE,
        "engine",
        Spec(cache_share, _cache_share, "in [0, 1] or auto",
             "share of the misses computed on the CPU once the cache is full; auto = 1 - link/CPU speed, "
             "measured at the first load on this machine (0 on the CPU device unless --emulate-link-gbps)",
             metavar="F|auto", words=mib_words),
    )  # fmt: skip
    moe_cache_trace: str = _setting(
        "", "engine", Spec(str, _any, "a file path", "write every expert lookup to this file", metavar="PATH")
    )
    moe_cache_policy: str = _setting(
        "classlru",
        "engine",
        _one_of(
            CACHE_POLICIES,
            "which misses the full cache admits (the rest run on the CPU): classlru all; second-use those used in "
            "the last 256 tokens; upload-cap at most one per token; protect those used more than what they evict",
        ),
    )
    moe_cache_prefetch: str = _setting(
        "auto",
        "engine",
        _one_of(
            ("auto", "off", "next-layer"),
            "next-layer: at each MoE layer, predict the next MoE layer's experts with its router and upload the "
            "predicted misses (or read them from the disk, with a RAM tier) while this layer computes; auto: on "
            "where a miss waits for a GPU's link, an emulated link or the disk",
        ),
    )
    load_mode: str = _setting(
        "mmap",
        "engine",
        _one_of(
            ("mmap", "pinned"),
            "CUDA: keep the host experts memory-mapped (fast start) or copy them to pinned memory "
            "(uploads at full link speed, slower start, locked RAM)",
        ),
    )
    emulate_link_gbps: float = _setting(
        0.0,
        "engine",
        Spec(
            float,
            _nonneg,
            ">= 0",
            "CPU device: make each upload also cost bytes / X GB/s, like a PCIe link; 0 = off",
            metavar="X",
        ),
    )
    emulate_device_mib: float = _setting(
        0.0,
        "engine",
        Spec(float, _nonneg, ">= 0",
             "CPU device: give the device this much memory (MiB), as a GPU has, for --moe-cache-mib auto and the "
             "slots' room; 0 = off", metavar="N"),
    )  # fmt: skip
    ram_cache_mib: float = _setting(
        AUTO,
        "engine",
        Spec(cache_mib, _cache_size, ">= 0 or auto",
             "experts kept in RAM (MiB) for a model whose experts do not fit; the rest are read from the file as "
             "used; auto = what the memory available at load leaves after the rest of the model (all experts "
             "when they fit); 0 = off (read through the file's map)", metavar="N|auto", words=mib_words),
    )  # fmt: skip
    emulate_host_mib: float = _setting(
        0.0,
        "engine",
        Spec(float, _nonneg, ">= 0",
             "size the RAM tier (--ram-cache-mib auto) as if the model had only this much memory (MiB), so a small "
             "model uses it; 0 = off", metavar="N"),
    )  # fmt: skip
    cpu_dequant_mib: float = _setting(
        0.0,
        "engine",
        Spec(float, _nonneg, ">= 0", "with --cpu-kernels exact: keep up to N MiB of dequantized experts", metavar="N"),
    )
    cpu_kernels: str = _setting(
        "fast", "engine", _one_of(tuple(KERNEL_MODES), "CPU matmuls. " + describe_kernel_modes())
    )
    threads: int = _setting(
        0,
        "engine",
        Spec(
            int,
            lambda v: 0 <= v <= 1024,
            "in 0..1024 (0: one per core)",
            "CPU threads for the engine; 0 = one per core, fewer while other processes keep cores busy",
            short="-t",
            metavar="N",
        ),
    )
    ctx_size: int = _setting(
        4096,
        "engine",
        Spec(int, lambda v: 16 <= v <= 1 << 20, "in 16..1048576", "context size in tokens", short="-c", metavar="N"),
    )
    chat_template: str = _setting(
        "", "engine", Spec(str, _any, "a file path", "Jinja chat template overriding the GGUF's", metavar="FILE")
    )
    n_predict: int = _setting(
        512, "sampling", Spec(int, lambda v: v > 0, "> 0", "most tokens per reply", short="-n", metavar="N")
    )
    temp: float = _setting(0.7, "sampling", Spec(float, _nonneg, ">= 0", "temperature; 0 = greedy", metavar="T"))
    top_k: int = _setting(
        40, "sampling", Spec(int, lambda v: v >= 0, ">= 0", "sample from the K likeliest tokens; 0 = all", metavar="K")
    )
    top_p: float = _setting(
        0.95, "sampling", Spec(float, lambda v: 0 < v <= 1, "in (0, 1]", "nucleus sampling", metavar="P")
    )
    min_p: float = _setting(
        0.05,
        "sampling",
        Spec(float, lambda v: 0 <= v < 1, "in [0, 1)", "drop tokens below P x the likeliest", metavar="P"),
    )
    repeat_penalty: float = _setting(
        1.0,
        "sampling",
        Spec(float, lambda v: v > 0, "> 0 (1 = off)", "penalty on the last 64 tokens; 1 = off", metavar="X"),
    )
    seed: int = _setting(
        -1,
        "sampling",
        Spec(
            int,
            lambda v: v >= -1,
            ">= -1 (-1: a new one each reply)",
            "same seed, same reply; -1 = a new one each reply",
            metavar="N",
        ),
    )
    parallel: int = _setting(
        1,
        "serve",
        Spec(
            int,
            lambda v: 1 <= v <= 64,
            "in 1..64",
            "requests a server decodes together, each on a KV slot of its own (its conversation kept there)",
            short="-np",
            metavar="N",
        ),
    )
    system: str = _setting("", "app", Spec(str, _any, "text", "system prompt", metavar="TEXT"))
    refresh_ms: int = _setting(
        250,
        "app",
        Spec(int, lambda v: 50 <= v <= 10_000, "in 50..10000", "dashboard refresh interval in ms", metavar="MS"),
    )
    theme: str = _setting(
        "textual-dark", "app", Spec(str, bool, "a theme name", "Textual theme (remembered in config.toml)")
    )
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def values(self) -> dict[str, Any]:
        """Every setting's value, without where it came from: what session files and exports record."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}


SPEC: dict[str, Spec] = {f.name: f.metadata["spec"] for f in fields(Settings) if "spec" in f.metadata}


def _group(group: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(Settings) if f.metadata.get("group") == group)


ENGINE = _group("engine")
SAMPLING = _group("sampling")
APP = _group("app")
SERVE = _group("serve")


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


def coerce(name: str, raw: Any, source: str) -> Any:
    """`raw` (text from a flag, variable or dialog, or a TOML value) as the setting's type, checked."""
    spec = SPEC[name]
    kind, check, want = spec.kind, spec.check, spec.want
    try:
        if (kind is float and isinstance(raw, bool)) or (kind is int and isinstance(raw, bool)):
            raise TypeError
        value = kind(raw) if not (kind is int and isinstance(raw, float) and not raw.is_integer()) else None
        if value is None:
            raise TypeError
    except (TypeError, ValueError):
        raise SettingError(
            f"{name} from {source}: {raw!r} is not "
            + ("text" if kind is str else "a number" if kind in (int, float) else "a number or auto")
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
            values[name], sources[name] = coerce(name, raw, src), src
    for name in SPEC:
        raw = env.get(env_name(name))
        if raw is not None and raw != "":
            src = f"env {env_name(name)}"
            values[name], sources[name] = coerce(name, raw, src), src
    for name, raw in (flags or {}).items():
        if raw is not None and name in SPEC:
            src = f"flag {flag_name(name)}"
            values[name], sources[name] = coerce(name, raw, src), src
    return replace(Settings(), **values, sources=sources), warnings


def save_config(path: Path, updates: Mapping[str, Any]) -> Path:
    """Merge `updates` into config.toml atomically. A corrupt file is renamed aside, never overwritten."""
    for name, value in updates.items():
        coerce(name, value, "the value to save")
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


def add_flags(p: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """A flag for each named setting, from its declaration; flags default to None (the next layer)."""
    for name in names:
        spec = SPEC[name]
        default = getattr(Settings(), name)
        shown = (
            spec.words(default) if spec.words else (default or "none") if spec.kind is str
            else f"{default:g}" if spec.kind is float else str(default)
        )  # fmt: skip
        flags = (spec.short, flag_name(name)) if spec.short else (flag_name(name),)
        # A parse function of the setting's own (cache_mib) reads the flag's text in `coerce`, for its one-line error.
        typed: dict[str, Any] = {"type": spec.kind} if spec.kind in (int, float) else {}
        # A value outside the choices gets the one-line error of any bad value (`coerce`), not argparse's usage.
        metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else spec.metavar
        p.add_argument(*flags, dest=name, default=None, metavar=metavar,
                       help=f"{spec.help} (default {shown}; env {env_name(name)})", **typed)  # fmt: skip


def from_args(args: argparse.Namespace, names: Iterable[str]) -> tuple[Settings, list[str], Path]:
    """The settings a command runs with: its flags over env, config.toml (`--config` or the config
    dir's) and the defaults, a built-in demo's own defaults where nothing else set a value.

    Returns (settings, warnings, the config.toml path)."""
    from moechat.app.paths import app_paths

    given = getattr(args, "config", None)
    config = Path(given) if given else app_paths().config / "config.toml"
    if given and not config.is_file():
        raise ValueError(f"--config {config}: no such file")
    settings, warnings = resolve({n: getattr(args, n, None) for n in names}, config_path=config)
    model = getattr(args, "model", None)
    settings = for_demo(settings, model)
    path = model_file(model)
    return (for_model(settings, path) if path is not None else settings), warnings, config


def check_model_file(model: str | None) -> None:
    """A model file named on the command line, checked before anything heavy loads (torch, the kernels,
    the app): a missing, empty-named, truncated or foreign file is a one-line error at once. The
    header parser validates every count and extent against the file, as loading would."""
    if model is None or demo_name(model) is not None:
        return
    if not model.strip():
        raise ValueError("the model path is empty")
    from moechat.engine.gguf.reader import GGUFFile

    GGUFFile(model).close()


def model_file(model: str | None) -> Path | None:
    """The file a model argument names: the path given, or a built-in demo's built file (None before its
    first build). Found without loading the engine."""
    from moechat.app.paths import app_paths

    name = demo_name(model)
    if name is None:
        return Path(str(model))
    built = sorted(app_paths().cache.glob(f"moechat-demo-{name}-*.gguf"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else None


def for_model(settings: Settings, model: Path) -> Settings:
    """The values tuned for `model` (app/tuned.py), where neither a flag nor a variable set them:
    config.toml's and the defaults give way. A tuned value that does not pass its check is ignored."""
    from moechat.app.tuned import identity_of, read_tuned

    identity = identity_of(model)
    found = read_tuned(identity) if identity else None
    if found is None:
        return settings
    raw, path = found
    changes = {}
    for name, value in raw.items():
        if settings.source(name).startswith(("flag", "env")):
            continue
        try:
            changes[name] = coerce(name, value, str(path))
        except SettingError:
            logger.warning("%s: %s = %r is not a valid value; ignored", path, name, value)
    if not changes:
        return settings
    sources = {**settings.sources, **dict.fromkeys(changes, f"tuned for this model ({path})")}
    return replace(settings, **changes, sources=sources)


# The engine names its parameters in its own words (engine.errors.ParameterError): the setting of each.
ENGINE_PARAMETERS = {
    "mib": "moe_cache_mib", "cpu_share": "moe_cache_cpu_share", "emulate_link_gbps": "emulate_link_gbps",
    "emulate_device_mib": "emulate_device_mib",
    "load_mode": "load_mode", "policy": "moe_cache_policy", "device": "device", "kernels": "cpu_kernels",
    "dequant_mib": "cpu_dequant_mib", "threads": "threads", "ram_cache_mib": "ram_cache_mib",
    "emulate_host_mib": "emulate_host_mib",
}  # fmt: skip


def error_line(e: BaseException) -> str:
    """An error as the one line a user reads: an engine parameter's error names the setting's flag (and the
    flag's value to try, where the engine proposes one)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if not isinstance(e, ParameterError) or e.parameter not in ENGINE_PARAMETERS:
        return text
    flag = flag_name(ENGINE_PARAMETERS[e.parameter])
    hint = f"; try {flag} {e.suggestion:g}" if e.suggestion is not None else ""
    return f"{flag}: {text}{hint}"


def print_warnings(warnings: Iterable[str]) -> None:
    """A command line's settings warnings (a config.toml that is not TOML), one line each on stderr."""
    for w in warnings:
        print(f"moechat: warning: {w}", file=sys.stderr)


def cache_settings(settings: Settings, warm_start: Path | None = None) -> CacheSettings:
    """The expert cache's settings, checked; an unusable device names where it was set."""
    from moechat.app import paths
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.loader import resolve_device

    try:
        device = resolve_device(settings.device)
    except ValueError as e:
        raise ValueError(f"device from {settings.source('device')}: {e}") from None
    cache = CacheSettings(
        mib=settings.moe_cache_mib, cpu_share=settings.moe_cache_cpu_share, device=device,
        emulate_link_gbps=settings.emulate_link_gbps, emulate_device_mib=settings.emulate_device_mib,
        trace=Path(settings.moe_cache_trace) if settings.moe_cache_trace
        else None, load_mode=settings.load_mode, warm_start=warm_start, policy=settings.moe_cache_policy,
        speeds_file=paths.app_paths().speeds,
        prefetch=settings.moe_cache_prefetch,
    )  # fmt: skip
    cache.validate()
    return cache


def sampling_params(settings: Settings) -> SamplingParams:
    from moechat.engine.events import SamplingParams

    params = SamplingParams(temperature=settings.temp, top_k=settings.top_k, top_p=settings.top_p,
                            min_p=settings.min_p, repeat_penalty=settings.repeat_penalty,
                            seed=settings.seed if settings.seed >= 0 else None)  # fmt: skip
    params.validate()
    return params
