"""Loading a model for generation: file, config, weights, tokenizer and chat template together."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import auto_size, ram_size, share_auto
from .cache.expert_cache import ExpertCache
from .cache.ram_tier import RamTier
from .cache.settings import AUTO_MIB, CacheSettings
from .cache.stats import summary_lines
from .config import ModelConfig
from .errors import ParameterError
from .gguf.reader import GGUFFile
from .kernels.isa import activation_bits
from .kernels.jit import compile_notes
from .models import build_model, compile_ahead
from .models.decoder import MoeDecoder
from .models.first_start import EagerModel, FirstStart, dequant_budget_mib
from .models.gemma3 import Gemma3
from .models.opening import open_model
from .nn.eager import eager_only
from .nn.layers import KVCache, kv_cache_bytes, recurrent_state_bytes
from .nn.weights import load_weights
from .text.chat_template import ChatTemplate, load_chat_template
from .text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    gguf: GGUFFile
    config: ModelConfig
    model: MoeDecoder | Gemma3
    tokenizer: Tokenizer
    template: ChatTemplate
    n_ctx: int
    cache: ExpertCache | None = None
    cpu_dequant_mib: float = 0.0  # as loaded: the tuner's arms reuse the model and key their runs on these
    cpu_kernels: str = "fast"
    fit: auto_size.Fit | None = None  # how auto sized the cache, when it did
    speeds: share_auto.Speeds | None = None  # what an auto CPU share came from, when it did
    own_layers: range | None = None  # a split model's stage: auto sizes its cache from its own layers' needs
    ram_tier: RamTier | None = None  # the experts' RAM tier, where they do not all fit in RAM
    ram_fit: ram_size.RamFit | None = None
    first_start: FirstStart[LoadedModel] | None = None  # the exact path serving a first start while the kernels compile

    @property
    def runner(self) -> MoeDecoder | Gemma3 | EagerModel:
        """What generation calls: the model, or on a first start's exact path its forward with torch's ops only."""
        return EagerModel(self.model) if self.first_start is not None else self.model

    def close(self) -> None:
        if self.first_start is not None:
            self.first_start.close()
        if self.cache is not None:
            for line in summary_lines(self.cache.snapshot()):
                logger.info("%s", line)
            self.cache.close()
        if self.ram_tier is not None:
            for line in self.ram_tier.snapshot().lines():
                logger.info("%s", line)
            self.ram_tier.close()
        self.gguf.close()

    def set_cache(self, settings: CacheSettings | None) -> ExpertCache | None:
        """Replace the expert cache (None or 0 MiB: no cache) between generations; returns the new one.

        The old cache's slots are freed first, so a device only ever holds one bank of slots.
        """
        apply_widths(self.model, self.cpu_kernels, settings)
        if not self.config.is_moe or not self.model.host_experts.layers:  # (a stage without MoE layers)
            return None
        old, self.cache = self.cache, None
        self.model.experts = self.ram_tier or self.model.host_experts
        if old is not None:
            old.close()
            del old
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()
        if settings is not None:
            settings, self.fit = auto_size.resolve(self.gguf, self.config, self.n_ctx, settings,
                                                   layers=self.own_layers)  # fmt: skip
            if self.fit is not None:
                for line in self.fit.lines():
                    logger.info("%s", line)
            settings, self.speeds = share_auto.resolve(settings, self.model.host_experts, self.config.n_expert_used)
            if self.speeds is not None:
                logger.info("%s", self.speeds.line())
        if settings is not None and settings.mib > 0 and self.ram_tier is not None:
            logger.warning("the device expert cache does not yet sit over the RAM tier: experts run from the RAM tier")
            return None
        if settings is not None and settings.mib > 0:
            self.cache = ExpertCache(self.model.host_experts, self.config.n_expert_used, settings)
            self.model.experts = self.cache
        return self.cache

    def new_cache(self) -> KVCache:
        return KVCache(self.config, self.n_ctx, device=self.model.device)

    def chat_prompt(self, user_text: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_text}
        ]
        return self.chat_tokens(messages)

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the chat template, ready for the assistant's turn."""
        text = self.template.render(messages, add_generation_prompt=True)
        # The rendered template already holds its own BOS if it wants one.
        add_bos = not (self.tokenizer.special.bos is not None and text.startswith(self.template.bos_token or "\0"))
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=True)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ParameterError("device", f"the device must be auto, cpu or cuda, got '{name}'")
    if name == "cuda" and not torch.cuda.is_available():
        raise ParameterError("device", "cuda: torch sees no CUDA device")
    return name


def set_threads(n: int) -> int:
    """The engine's CPU threads (torch's intra-op threads and the kernels' threads) for this
    thread: n > 0 sets them, 0 keeps torch's default (one per core). Returns the count in use.
    Fewer than the cores leaves room for other work (the app's UI), at the engine's cost."""
    from .kernels.jit import set_kernel_threads
    from .kernels.threads import ThreadGovernor, govern

    if n < 0:
        raise ParameterError("threads", f"the thread count must be >= 0, got {n}")
    # The kernels' thread pool first: starting it resets the OpenMP thread count torch reads too.
    n_max = n if n > 0 else torch.get_num_threads()
    set_kernel_threads(n_max)
    torch.set_num_threads(n_max)
    # The default count gives way to other processes' work (kernels.threads); a set count is kept.
    govern(ThreadGovernor(n_max, on_change=torch.set_num_threads) if n == 0 else None)
    logger.info("%d intra-op threads%s", n_max, " (fewer while other processes keep cores busy)" if n == 0 else "")
    return n_max


class ContextTooLarge(ValueError):
    """The KV cache of the asked context does not fit in the device's memory."""


def check_context(cfg: ModelConfig, n_ctx: int, device: torch.device) -> None:
    from .cache.device_memory import device_free_bytes

    need = kv_cache_bytes(cfg, n_ctx) + recurrent_state_bytes(cfg)
    free = device_free_bytes(device)
    if need > 0.8 * free:
        fits = int(n_ctx * 0.8 * free / need) // 256 * 256
        raise ContextTooLarge(
            f"context size {n_ctx} needs {need / 2**20:.0f} MiB of KV cache but {device} has "
            f"{free / 2**20:.0f} MiB free; try a context of {max(fits, 16)}"
        )


def check_fit(gguf: GGUFFile, cfg: ModelConfig, model: MoeDecoder | Gemma3, tok: Tokenizer,
              layers: range | None = None) -> None:  # fmt: skip
    """Refuse a file whose tensors do not fit its metadata, before a user's prompt finds out.

    Each tensor may be well formed on its own and still not fit the others (a hostile or broken
    file): the vocabulary must fit the embedding and the output, and one token must go through
    every layer (`layers`: every layer of this stage of a split model). Errors become one ValueError
    naming the file.
    """
    rows = min(model.embed.shape[0], model.output.shape[0])
    if tok.n_vocab > rows:
        raise ValueError(
            f"{gguf.path}: the vocabulary has {tok.n_vocab} tokens but the embedding or output has {rows} rows"
        )
    if cfg.is_moe:
        for layer, lx in model.host_experts.layers.items():
            counts = {t.raw.shape[0] for t in (lx.gate, lx.up, lx.down)}
            if counts != {cfg.n_expert} or lx.gate.raw.shape[1] != lx.up.raw.shape[1]:
                raise ValueError(
                    f"{gguf.path}: layer {layer}: expert tensors hold {sorted(counts)} experts of mismatched shapes; "
                    f"the metadata says {cfg.n_expert}"
                )
    try:
        with torch.inference_mode():
            if layers is None:
                logits = model(torch.tensor([tok.n_vocab - 1]), 0, KVCache(cfg, 1, device=model.device))
            else:  # a stage: its own layers, from the embedding if it is the first
                first = layers.start == 0
                x = model.embed_tokens(torch.tensor([tok.n_vocab - 1])) if first else torch.zeros(1, cfg.n_embd)
                x = model.run_blocks(x, 0, KVCache(cfg, 1, device=model.device), layers.start, layers.stop)
                logits = model.head(x) if first else torch.zeros(1, tok.n_vocab)
    except (RuntimeError, IndexError, TypeError, ZeroDivisionError) as e:
        raise ValueError(
            f"{gguf.path}: the model's tensors do not fit its metadata ({str(e).splitlines()[0]})"
        ) from None
    if logits.shape[-1] < tok.n_vocab:
        raise ValueError(f"{gguf.path}: the output gives {logits.shape[-1]} logits for {tok.n_vocab} tokens")


def _answer_first(fs: FirstStart[LoadedModel], load_exact: Callable[[], LoadedModel],
                  progress: Callable[[str], None] | None) -> LoadedModel:  # fmt: skip
    """A first start's exact path, loaded with torch's ops only while `fs`'s helper compiles the kernels."""
    if progress is not None:
        progress("first start: answering from the exact path while the kernels compile in the background")
    # The helper keeps a core busy: torch's pool on all of them would take turns with it (kernels.threads);
    # `fs` gives the core back when the fast model takes over.
    torch.set_num_threads(max(1, fs.threads - 1))
    with eager_only():
        lm = load_exact()
    lm.first_start = fs
    return lm


def apply_widths(model: MoeDecoder | Gemma3, cpu_kernels: str, settings: CacheSettings | None) -> None:
    """The CPU kernels' activation widths for a model run with these cache settings: the default's
    int8 only where nothing computes in float32 beside it (kernels.isa.activation_bits)."""
    beside_float = model.device.type != "cpu" or (
        settings is not None and settings.mib != 0 and settings.device_kernels == "triton"
    )
    model.set_activation_bits(*activation_bits(cpu_kernels, beside_float))


def load_model(
    path: str | os.PathLike[str],
    *,
    n_ctx: int = 4096,
    chat_template: str | Path | None = None,
    cache: CacheSettings | None = None,
    cpu_dequant_mib: float = 0.0,
    cpu_kernels: str = "fast",
    progress: Callable[[str], None] | None = None,
    own_layers: range | None = None,
    ram_cache_mib: float = AUTO_MIB,
    emulate_host_mib: float = 0.0,
    first_start: bool = False,
) -> LoadedModel:
    """The model at `path`, checked and ready. `progress` hears what a first start does at length: each CPU
    kernel compiled for this machine (later starts load them from the disk cache and say nothing).
    `own_layers`: the layers this process runs (a split model's stage; from layer 0 it also runs the
    embedding and head): only their pages are mapped ahead and only they are tried at load.
    `ram_cache_mib`: the experts' RAM tier (cache.ram_size: auto, all experts when they fit; 0 off);
    `emulate_host_mib`: the memory auto sizes from, in place of what the host has available.
    `first_start`: where this model's kernels were never compiled here, answer at once from the exact path
    while a helper compiles them (engine.models.first_start); the caller takes the fast model from
    `lm.first_start` when it is ready. Only on the CPU, for one process's whole model, without a RAM tier
    or a trace, where the float32 copies fit."""
    if n_ctx < 16:
        raise ValueError(f"context size must be at least 16, got {n_ctx}")
    gguf, cfg = open_model(path)
    helper = None
    tier: RamTier | None = None
    try:
        fit = ram_size.plan(gguf, cfg, n_ctx, ram_cache_mib, emulate_host_mib, own_layers)
        if fit.tier or fit.experts > fit.usable:
            logger.info("%s", fit.line())
        on_cpu = (cache.device if cache is not None else "cpu") == "cpu"
        # A first start compiles the kernels on a second core too, from the far end of the forward.
        model_kind = compile_ahead.kind(gguf, cfg, cpu_kernels)
        if (first_start and on_cpu and cpu_kernels != "exact" and own_layers is None and not fit.tier
                and (cache is None or cache.trace is None) and not compile_ahead.compiled(model_kind)):  # fmt: skip
            budget = dequant_budget_mib(gguf)
            if budget is not None:
                busy = compile_ahead.compiling_elsewhere(model_kind)  # another start's helper compiles it
                helper = None if busy else compile_ahead.start(gguf.path, n_ctx, cpu_kernels, model_kind, alone=True)
                if helper is not None or busy:
                    gguf.close()

                    def load_fast() -> LoadedModel:
                        return load_model(path, n_ctx=n_ctx, chat_template=chat_template, cache=cache,
                                          cpu_dequant_mib=cpu_dequant_mib, cpu_kernels=cpu_kernels,
                                          ram_cache_mib=ram_cache_mib, emulate_host_mib=emulate_host_mib)  # fmt: skip

                    def load_exact() -> LoadedModel:
                        return load_model(path, n_ctx=n_ctx, chat_template=chat_template, cpu_dequant_mib=budget,
                                          cpu_kernels="exact", ram_cache_mib=ram_cache_mib,
                                          emulate_host_mib=emulate_host_mib)  # fmt: skip

                    return _answer_first(FirstStart(helper, model_kind, load_fast, torch.get_num_threads()),
                                         load_exact, progress)  # fmt: skip
        if on_cpu and cpu_kernels != "exact":
            helper = compile_ahead.start(gguf.path, n_ctx, cpu_kernels, model_kind)
        # The file's pages mapped ahead of decode (a first touch in decode is a page fault), while the
        # model is built and its kernels load, when they fit in memory: a larger file is read as used.
        from .cache.device_memory import device_free_bytes

        if fit.tier:  # the experts are read into the tier, never through the map
            experts = set(ram_size.expert_tensors(gguf))
            own = gguf.layer_tensors(own_layers) if own_layers is not None else gguf.tensors
            gguf.prefault([n for n in own if n not in experts])
        elif own_layers is not None:
            gguf.prefault(gguf.layer_tensors(own_layers))
        elif gguf.size < device_free_bytes(torch.device("cpu")):
            gguf.prefault()
        device = cache.device if cache is not None else "cpu"
        check_context(cfg, n_ctx, torch.device(device))
        tok = Tokenizer.from_metadata(gguf.metadata, str(gguf.path))
        sp = tok.special
        template = load_chat_template(
            gguf.metadata,
            override=chat_template,
            bos_token=tok.tokens[sp.bos] if sp.bos is not None else "",
            eos_token=tok.tokens[sp.eos] if sp.eos is not None else "",
        )
        # The dense matrices stay the file's bytes: on the CPU under the CPU kernels, on a GPU under
        # the device kernels where they read the type (else dequantized once to float32 there).
        on_gpu_kernels = not on_cpu and cache is not None and cache.device_kernels != "torch"
        model = build_model(gguf, cfg, n_ctx, quantized=(on_cpu or on_gpu_kernels) and cpu_kernels != "exact",
                            kernels=cpu_kernels, dequant_mib=cpu_dequant_mib)  # fmt: skip
        if own_layers is not None:  # a stage's experts (and so its expert cache) are its own layers' only
            model.moe_layers = [i for i in model.moe_layers if i in own_layers]
        load_weights(model, gguf)
        if not on_cpu:
            model.to_device(torch.device(device))
        if fit.tier and model.host_experts.layers:
            tier = RamTier(model.host_experts, gguf, cfg.n_expert_used, fit.tier / 2**20,
                           prefetch=cache is None or cache.prefetch != "off")  # fmt: skip
            model.experts = tier
        apply_widths(model, cpu_kernels, cache)  # the widths it will run with: the kernels compiled next are those
        with compile_notes(progress) as compiled:  # one token through every layer: the kernels compile here
            check_fit(gguf, cfg, model, tok, own_layers)
            if on_cpu:
                compile_ahead.warm_prompt_kernels(model)  # a prompt's dense matrices, before a first reply waits
            if on_cpu and cfg.is_moe:
                compile_ahead.warm_expert_kernels(model)  # the prompt's path, before a first reply waits for it
            if cache is not None and cache.mib != 0:
                compile_ahead.warm_policy()  # the cache's lookup, before a first reply waits for it
        compile_ahead.stop(helper)
        compile_ahead.mark_compiled(model_kind, compiled.started)
        lm = LoadedModel(gguf, cfg, model, tok, template, n_ctx, None, cpu_dequant_mib, cpu_kernels,
                         own_layers=own_layers, ram_tier=tier, ram_fit=fit)  # fmt: skip
        lm.set_cache(cache)  # the one place the executor is swapped for the cache
    except BaseException:
        compile_ahead.stop(helper)
        if tier is not None:
            tier.close()
        gguf.close()
        raise
    logger.info("loaded %s: %s, %d layers, context %d", gguf.path.name, cfg.arch, cfg.n_layers, n_ctx)
    return lm
