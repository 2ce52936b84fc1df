"""`moechat inspect MODEL.gguf`: what a model file holds, as a table."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from moechat.engine.cache.auto_size import expert_bytes
from moechat.engine.config import ModelConfig
from moechat.engine.distributed.plan import Plan, plan_split, this_hosts_memory
from moechat.engine.gguf.reader import GGUFFile
from moechat.engine.kernels import isa
from moechat.engine.models.decoder import is_moe_layer
from moechat.engine.models.opening import open_model, quant_histogram
from moechat.engine.nn.layers import kv_cache_bytes, recurrent_state_bytes
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from moechat.engine.cache import auto_size, share_auto
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.loader import LoadedModel
    from moechat.tuner.time_model import Forecast


def layer_kinds(gguf: GGUFFile, cfg: ModelConfig) -> str:
    """The decoder's layers by kind: attention (full or sliding window), FFN (dense or MoE), skipped."""
    sliding = sum(cfg.swa_layers[: cfg.n_layers]) if cfg.sliding_window else 0
    moe = sum(is_moe_layer(gguf, i) for i in range(cfg.n_layers))
    linear = sum(cfg.is_recurrent(i) for i in range(cfg.n_layers))
    full = "latent attention" if cfg.kv_lora_rank else "full attention"
    parts = [f"{cfg.n_layers - sliding - linear} {full}"] + ([f"{sliding} sliding window"] if sliding else [])
    parts += [f"{linear} linear attention"] if linear else []
    parts += [f"{cfg.n_layers - moe} dense FFN", f"{moe} MoE"]
    if cfg.n_layers_skipped:
        parts.append(f"{cfg.n_layers_skipped} NextN skipped")
    return ", ".join(parts)


def attention_heads(cfg: ModelConfig) -> str:
    if cfg.kv_lora_rank:  # MLA: what the cache holds per position, and the heads' own lengths
        return (f"{cfg.n_head}, latent (cached: latent {cfg.kv_lora_rank} + rotary key {cfg.rope_dim}; "
                f"head dim {cfg.head_dim_mla}, value {cfg.head_dim_v_mla})")  # fmt: skip
    return f"{cfg.n_head} (kv {max(cfg.n_head_kv)}, head dim {cfg.head_dim})"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summary_rows(gguf: GGUFFile, cfg: ModelConfig) -> list[tuple[str, str]]:
    total_exp, per_layer = expert_bytes(gguf, cfg.n_layers)
    hist = quant_histogram(gguf)
    kv_token = kv_cache_bytes(cfg, 1)
    rows = [
        ("file", f"{gguf.path.name} ({_mib(gguf.file_size)})"),
        ("name", cfg.name),
        ("architecture", cfg.arch),
        ("layers", f"{cfg.n_layers}: {layer_kinds(gguf, cfg)}"),
        ("embedding", str(cfg.n_embd)),
        ("attention heads", attention_heads(cfg)),
        ("context (trained)", str(cfg.n_ctx_train)),
        (
            "KV cache (float32)",
            f"{kv_token / 2**10:,.1f} KiB per token, {_mib(kv_token * cfg.n_ctx_train)} at {cfg.n_ctx_train} tokens",
        ),
        ("vocabulary", str(cfg.n_vocab)),
    ]
    if cfg.recurrent:
        state = _mib(recurrent_state_bytes(cfg))
        rows.insert(-1, ("linear attention state", f"{state} at any context (float32); {cfg.ssm_k_heads} key heads, "
                         f"{cfg.ssm_v_heads} value heads, state {cfg.ssm_state} x {cfg.ssm_inner // cfg.ssm_v_heads}, "
                         f"conv {cfg.ssm_conv_kernel}"))  # fmt: skip
    if cfg.is_moe:
        one = max(per_layer.values()) if per_layer else 0
        span = sorted({b * cfg.n_expert for b in per_layer.values()})  # bytes of one MoE layer's experts
        per = _mib(span[0]) if len(span) == 1 else f"{_mib(span[0])} to {_mib(span[-1])}"
        rows += [
            ("experts", f"{cfg.n_expert} per layer, {cfg.n_expert_used} used per token, FFN {cfg.n_ff_exp}"),
            ("shared experts", str(cfg.n_expert_shared)),
            ("expert bytes", f"{_mib(total_exp)} total, {per} per MoE layer, {_mib(one)} per expert"),
        ]
    else:
        rows.append(("experts", f"none (dense FFN {cfg.n_ff})"))
    rows += [
        ("quant types", ", ".join(f"{k} x{v}" for k, v in hist.most_common())),
        ("tokenizer", str(gguf.metadata.get("tokenizer.ggml.model", "none"))),
        ("CPU kernels", isa.describe()),
        ("chat template", "yes" if gguf.metadata.get("tokenizer.chat_template") else "no"),
    ]
    return rows


def plan_table(plan: Plan) -> Table:
    table = Table(title=Text(f"a split over {len(plan.hosts)} hosts, context {plan.n_ctx}"))
    for col in ("rank", "layers", "maps", "KV / state", "needs", "memory", "fits"):
        table.add_column(col, justify="left" if col in ("layers", "fits") else "right")
    for h in plan.hosts:
        ends = " + embedding, head" if h.rank == 0 else ""
        span = f"{h.first}" if h.end == h.first + 1 else f"{h.first}-{h.end - 1}"
        what = f"{span}{ends}" if h.end > h.first else f"none{ends}"
        table.add_row(str(h.rank), what, _gib(h.weight_bytes), _gib(h.state_bytes), _gib(h.need_bytes),
                      _gib(h.memory_bytes), "yes" if h.fits else "NO")  # fmt: skip
    return table


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else _mib(n)


def run_inspect(path: str, console: Console, hosts: int = 1, host_memory: list[float] | None = None,
                n_ctx: int = 4096) -> int:  # fmt: skip
    """The file's summary; with `hosts` > 1 the plan of a split over that many hosts too (exit 1
    when a host's share does not fit its memory)."""
    gguf, cfg = open_model(path)
    with gguf:
        # The values come from the file (its name, its metadata): rich Text, so that rich never
        # reads them as markup ("[/x]" would raise, "[link=...]" would make a link).
        table = Table(title=Text(f"moechat inspect: {gguf.path.name}"), show_header=False)
        table.add_column("property", style="bold")
        table.add_column("value")
        for key, value in summary_rows(gguf, cfg):
            table.add_row(key, Text(value))
        console.print(table)
        if hosts == 1 and host_memory is None:
            return 0
        sizes = [int(g * 2**30) for g in host_memory] if host_memory else [this_hosts_memory()]
        plan = plan_split(gguf, cfg, sizes * hosts if len(sizes) == 1 else sizes, min(n_ctx, cfg.n_ctx_train))
    console.print(plan_table(plan))
    console.print(f"on the wire per decode token: {plan.wire_bytes_per_token:,} bytes "
                  f"({len(plan.hosts) if len(plan.hosts) > 1 else 0} hops of the hidden state, "
                  f"{plan.n_embd} x float32)", markup=False, highlight=False)  # fmt: skip
    bad = plan.misfit()
    if bad is not None:
        console.print(f"host {bad.rank} needs {_gib(bad.need_bytes)} and has {_gib(bad.memory_bytes)}: "
                      "this split does not fit; more hosts or more memory", markup=False, highlight=False)  # fmt: skip
        return 1
    return 0


def run_fit(path: str, console: Console, device: str, emulate_device_mib: float, n_ctx: int,
            emulate_link_gbps: float = 0.0, remeasure: bool = False) -> int:  # fmt: skip
    """`moechat inspect MODEL --fit`: where the parts go on the cache's device and what auto gives the cache
    (engine.cache.auto_size), the slots that makes per layer, and the CPU share auto gives it
    (engine.cache.share_auto: the speeds kept on this machine, measured on a load of the model where
    there are none, or with `remeasure`)."""
    from moechat.app.paths import app_paths
    from moechat.engine.cache import auto_size, ram_size
    from moechat.engine.cache.settings import AUTO_MIB, AUTO_SHARE, CacheSettings
    from moechat.engine.loader import resolve_device

    settings = CacheSettings(mib=AUTO_MIB, cpu_share=AUTO_SHARE, device=resolve_device(device),
                             emulate_device_mib=emulate_device_mib, emulate_link_gbps=emulate_link_gbps,
                             speeds_file=app_paths().speeds)  # fmt: skip
    settings.validate()
    gguf, cfg = open_model(path)
    n_ctx = min(n_ctx, cfg.n_ctx_train or n_ctx)
    with gguf:
        total, per_layer = auto_size.expert_bytes(gguf, cfg.n_layers)
        dense = sum(t.n_bytes for t in gguf.tensors.values()) - total
        # What a decode token reads of them: one row of its own embedding where the head is another matrix.
        read = dense - (gguf.tensors["token_embd.weight"].n_bytes if "output.weight" in gguf.tensors else 0)
        free = None
        if settings.device == "cuda":  # the dense weights are not there yet: what they will leave
            import torch
            from moechat.engine.cache.device_memory import device_free_bytes

            free = (device_free_bytes(torch.device("cuda")) - dense) / 2**20
        f = auto_size.fit(gguf, cfg, n_ctx, settings, free)
        ram = ram_size.plan(gguf, cfg, n_ctx, AUTO_MIB)  # the RAM tier, where the experts do not fit in RAM
    for line in f.lines():
        console.print(line, markup=False, highlight=False)
    console.print(ram.line(), markup=False, highlight=False)
    if f.cache > 0 and per_layer:
        slots = int(f.cache * 2**20 // (sum(per_layer.values()) / len(per_layer)))
        console.print(f"about {slots // len(per_layer)} expert slots per MoE layer of {cfg.n_expert} "
                      f"({slots} in all)", markup=False, highlight=False)  # fmt: skip
        speeds, token_ms = _speeds(path, replace(settings, mib=f.cache), n_ctx, remeasure)
        console.print(speeds.line(), markup=False, highlight=False)
        if speeds.cpu_gbps > 0:  # (measured: there is a link to trade against)
            line = _forecast(cfg, read, per_layer, f, speeds, settings.device, token_ms).line()
            console.print(line, markup=False, highlight=False)
    return 0


def _forecast(cfg: ModelConfig, read_bytes: int, per_layer: dict[int, int], f: auto_size.Fit,
              speeds: share_auto.Speeds, device: str, token_ms: float) -> Forecast:  # fmt: skip
    """The time model's t/s at the auto size and share, from the speeds alone (`tuner.time_model.forecast`):
    `read_bytes` of dense weights a token reads, one expert's bytes per MoE layer."""
    from moechat.engine.cache import share_auto
    from moechat.tuner.time_model import forecast

    on_device = {} if device == "cpu" else {"device_gbps": share_auto.device_gbps(device, speeds.cpu_gbps)}
    return forecast(read_bytes, [per_layer[i] for i in sorted(per_layer)], cfg.n_expert_used, cfg.n_expert,
                    f.cache * 2**20, speeds.share, link_gbps=speeds.link_gbps, cpu_gbps=speeds.cpu_gbps,
                    token_ms=token_ms, **on_device)  # fmt: skip


def _speeds(path: str, settings: CacheSettings, n_ctx: int, remeasure: bool) -> tuple[share_auto.Speeds, float]:
    """What the auto CPU share comes from, and on the CPU device a decode token's ms with the cache off (the
    forecast's base there). The CPU's speed needs this model's experts, so the model is loaded (its experts
    stay in the file map) unless the CPU device has no link to trade against."""
    from moechat.engine.cache import share_auto
    from moechat.engine.loader import load_model

    if share_auto.no_link(settings):
        return share_auto.NO_LINK, 0.0
    lm = load_model(path, n_ctx=n_ctx)
    try:
        speeds = share_auto.speeds(settings, lm.model.host_experts, lm.config.n_expert_used, remeasure=remeasure)
        return speeds, token_ms(lm) if settings.device == "cpu" else 0.0
    finally:
        lm.close()


def token_ms(lm: LoadedModel, tokens: int = 8) -> float:
    """A decode token's median ms on this model with the cache off, after as many warm-up tokens."""
    import statistics
    import time

    from moechat.engine.generate import decode_one, prefill

    kv = lm.new_cache()
    tok = int(prefill(lm.model, [1, 2, 3, 4], kv).argmax())
    times = []
    for i in range(2 * tokens):
        t0 = time.perf_counter()
        tok = int(decode_one(lm.model, tok, kv).argmax())
        if i >= tokens:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)
