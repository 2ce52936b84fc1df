"""Writing GGUF files for tests with `gguf.GGUFWriter`: tiny models with real tokenizer metadata."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from .vocab import Vocab, qwen_vocab

Q = GGMLQuantizationType

# Byte offsets of the float16 scale fields in each block type: random blocks get sane scales there.
F16_SCALES: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


# About how large |scale * sub-scale * code| gets per unit of the f16 scale, for random bytes.
_CODE_MAGNITUDE: dict[GGMLQuantizationType, float] = {
    Q.Q4_0: 8, Q.Q4_1: 8, Q.Q5_0: 16, Q.Q5_1: 16, Q.Q8_0: 64, Q.Q2_K: 12, Q.Q3_K: 64,
    Q.Q4_K: 256, Q.Q5_K: 512, Q.Q6_K: 1024, Q.IQ4_NL: 64, Q.IQ4_XS: 1024,
}  # fmt: skip


def random_blocks(
    qtype: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator, weight: float = 0.05
) -> np.ndarray:
    """`[n_blocks, type_size]` random blocks with finite scales giving weights of about `weight`."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scale = weight / _CODE_MAGNITUDE.get(qtype, 64)
    for at in F16_SCALES.get(qtype, ()):
        d = (rng.uniform(0.5, 1.5, size=n_blocks) * scale).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.MXFP4:
        raw[:, 0] = rng.integers(118, 124, size=n_blocks, dtype=np.uint8)
    return raw


def quantized(shape: tuple[int, ...], qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random data for a tensor of torch-order `shape` in `qtype`, as the writer wants it."""
    if qtype == Q.F32:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if qtype == Q.F16:
        return (rng.standard_normal(shape) * 0.05).astype(np.float16)
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    return random_blocks(qtype, n_blocks, rng).reshape(*shape[:-1], shape[-1] // block * size)


def add_tokenizer(w: GGUFWriter, vocab: Vocab, template: str | None = None) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.specials["<|endoftext|>"])
    w.add_eos_token_id(vocab.specials["<|im_end|>"])
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template(template)


QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_gguf(
    path: Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, tuple[np.ndarray, GGMLQuantizationType]],
    *,
    vocab: Vocab | None = None,
    template: str | None = QWEN_TEMPLATE,
) -> Path:
    w = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    if vocab is not None:
        add_tokenizer(w, vocab, template)
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe", "gpt-oss", "glm4moe", "deepseek2", "qwen3next", "qwen35moe")
HYBRID = ("qwen3next", "qwen35moe")

# Gated DeltaNet (Qwen3-Next, Qwen3.5): key heads, value heads, key (state) dim, value dim, conv taps.
DELTA = {"k_heads": 2, "v_heads": 4, "dk": 64, "dv": 64, "taps": 4}  # llama.cpp needs dk == dv

# DeepSeek-style latent attention: query rank, latent rank, and per-head lengths (no-rope, rope, value).
MLA = {"q_lora": 256, "kv_lora": 128, "nope": 64, "rope": 32, "v": 64}


def tiny_moe(path: Path, *, template: str | None = QWEN_TEMPLATE, **kw: Any) -> Path:
    """`tiny_moe_parts(**kw)` written to a GGUF file at `path` (see there for the options)."""
    arch, meta, tensors, vocab = tiny_moe_parts(**kw)
    return write_gguf(path, arch, meta, tensors, vocab=vocab, template=template)


def tiny_moe_parts(
    *,
    arch: str = "qwen3moe",
    n_layers: int = 2,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int | None = None,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 256,
    expert_type: GGMLQuantizationType = Q.Q8_0,
    n_vocab: int = 1024,
    seed: int = 0,
    extra: Mapping[str, Any] | None = None,
    layer_expert_types: Mapping[int, GGMLQuantizationType] | None = None,
    logit_scale: float = 1.0,
    ends_type: GGMLQuantizationType = Q.F32,
    tied: bool = False,
    dense_type: GGMLQuantizationType = Q.F32,
    down_type: GGMLQuantizationType | None = None,
    output_type: GGMLQuantizationType | None = None,
    dense_layers: int = 0,
    mla_joint_kv_b: bool = False,
    legacy_ssm_in: bool = False,
) -> tuple[str, dict[str, Any], dict[str, tuple[np.ndarray, GGMLQuantizationType]], Vocab]:
    """A small MoE model of `arch` with random weights and a real (truncated) Qwen vocabulary:
    (architecture, metadata, tensors as GGUF stores them, vocabulary).

    The first `dense_layers` layers have a dense FFN (2 x `n_ff_exp` wide) instead of experts;
    `n_expert=0` makes every layer dense (a dense model).

    `ends_type` is the type of the token embedding and output projection (`output_type`, if
    given, of the output alone); `tied` leaves the output out, so the embedding serves as both
    (as Gemma's files do). `dense_type` is the type of the attention and shared-expert matrices,
    `down_type` that of the experts' down projections (default: `expert_type`): a Q4_K_M file
    has Q4_K attention and gate/up experts, Q6_K down projections and output.

    `mla_joint_kv_b` (deepseek2): write attention as files from before the split of `attn_kv_b`
    did (the same weights), with per-head key/value lengths and no *_mla keys.

    `legacy_ssm_in` (qwen3next): the linear attention's q|k|v|z and beta|alpha as the first
    converters wrote them, one matrix each, interleaved per key head (float dense matrices only).

    Each architecture gets the tensors its family has: QK norms (per head for qwen3moe, whole
    projection for olmoe), biases and a shared expert (qwen2moe), sinks, router and expert
    biases and a short sliding window (gpt-oss).
    """
    rng = np.random.default_rng(seed)
    vocab = qwen_vocab(n_vocab)
    v = len(vocab.tokens)
    hd = n_embd // n_head
    f32 = Q.F32
    if n_head_kv is None:
        n_head_kv = n_head if arch == "olmoe" else n_head // 2  # OLMoE has no grouped-query attention

    def vector(*shape: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return quantized(shape, f32, rng), f32

    def dense(*shape: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return quantized(shape, dense_type, rng), dense_type

    def norm(n: int) -> tuple[np.ndarray, GGMLQuantizationType]:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32), f32

    def experts(layer: int, *shape: int, down: bool = False) -> tuple[np.ndarray, GGMLQuantizationType]:
        qtype = (layer_expert_types or {}).get(layer, expert_type)
        if down and down_type is not None:
            qtype = down_type
        return quantized(shape, qtype, rng), qtype

    meta: dict[str, Any] = {
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.block_count": n_layers,
        f"{arch}.feed_forward_length": n_ff_exp,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_head_kv,
        f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 1_000_000.0 if arch != "gpt-oss" else 150_000.0,
    }
    if n_expert:
        meta |= {
            f"{arch}.expert_count": n_expert,
            f"{arch}.expert_used_count": n_expert_used,
            f"{arch}.expert_feed_forward_length": n_ff_exp,
        }
    else:
        dense_layers = n_layers
        meta[f"{arch}.feed_forward_length"] = 2 * n_ff_exp
    if arch == "qwen2moe":
        meta[f"{arch}.expert_shared_feed_forward_length"] = 2 * n_ff_exp
    nextn = 0
    if arch in ("glm4moe", "deepseek2"):  # DeepSeek-V3-style MoE: a dense lead layer, a shared expert, sigmoid
        dense_layers = max(dense_layers, 1)
        meta |= {
            f"{arch}.leading_dense_block_count": dense_layers,
            f"{arch}.feed_forward_length": 2 * n_ff_exp,
            f"{arch}.expert_shared_count": 1,
            f"{arch}.expert_gating_func": 2,
            f"{arch}.expert_weights_norm": True,
            f"{arch}.expert_weights_scale": 2.5,
        }
    if arch == "glm4moe":  # as convert_hf_to_gguf writes GLM-4.5: partial rotary, one NextN block
        nextn = 1
        meta |= {
            f"{arch}.block_count": n_layers + nextn,
            f"{arch}.nextn_predict_layers": nextn,
            f"{arch}.rope.dimension_count": hd // 2,
        }
    if arch == "deepseek2":  # as convert_hf_to_gguf writes DeepSeek-V3: MLA as one latent head, YaRN
        meta |= {
            f"{arch}.attention.head_count_kv": 1,
            f"{arch}.attention.q_lora_rank": MLA["q_lora"],
            f"{arch}.attention.kv_lora_rank": MLA["kv_lora"],
            f"{arch}.attention.key_length": MLA["kv_lora"] + MLA["rope"],
            f"{arch}.attention.value_length": MLA["kv_lora"],
            f"{arch}.attention.key_length_mla": MLA["nope"] + MLA["rope"],
            f"{arch}.attention.value_length_mla": MLA["v"],
            f"{arch}.rope.dimension_count": MLA["rope"],
            f"{arch}.expert_group_count": 4,
            f"{arch}.expert_group_used_count": 2,
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": 4.0,
            f"{arch}.rope.scaling.original_context_length": 128,
            f"{arch}.rope.scaling.yarn_log_multiplier": 0.1,  # 0.1 x mscale_all_dim (1.0)
        }
        if mla_joint_kv_b:
            del meta[f"{arch}.attention.key_length_mla"], meta[f"{arch}.attention.value_length_mla"]
            meta |= {
                f"{arch}.attention.head_count_kv": n_head,
                f"{arch}.attention.key_length": MLA["nope"] + MLA["rope"],
                f"{arch}.attention.value_length": MLA["v"],
            }
    if arch in HYBRID:  # as convert_hf_to_gguf writes them: linear attention in every other layer here
        d = DELTA
        meta |= {
            f"{arch}.expert_shared_feed_forward_length": n_ff_exp,
            f"{arch}.rope.dimension_count": hd // 4,
            f"{arch}.full_attention_interval": 2,
            f"{arch}.ssm.conv_kernel": d["taps"],
            f"{arch}.ssm.state_size": d["dk"],
            f"{arch}.ssm.group_count": d["k_heads"],
            f"{arch}.ssm.time_step_rank": d["v_heads"],
            f"{arch}.ssm.inner_size": d["v_heads"] * d["dv"],
        }
    if arch == "qwen35moe":  # one MTP block, and the multi-axis rotary sections
        nextn = 1
        meta |= {
            f"{arch}.block_count": n_layers + nextn,
            f"{arch}.nextn_predict_layers": nextn,
            f"{arch}.rope.dimension_sections": [hd // 24, hd // 24, hd // 8 - 2 * (hd // 24), 0],
        }
    if arch == "gpt-oss":
        meta |= {
            f"{arch}.attention.sliding_window": 8,
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": 32.0,
            f"{arch}.rope.scaling.original_context_length": 4096,
            f"{arch}.context_length": 131072,  # gpt-oss's real YaRN geometry: 4096 x 32
        }
    meta |= dict(extra or {})  # before the tensors: `extra` may change the layout (full_attention_interval)
    t: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {
        "token_embd.weight": (quantized((v, n_embd), ends_type, rng), ends_type),
        "output_norm.weight": norm(n_embd),
        "output.weight": (quantized((v, n_embd), output_type or ends_type, rng), output_type or ends_type),
    }
    if logit_scale != 1.0:
        if ends_type != f32:
            raise ValueError("logit_scale needs float ends")
        t["output.weight"] = (t["output.weight"][0] * logit_scale, f32)
    if tied:
        del t["output.weight"]
    biased = arch in ("qwen2moe", "qwen2", "gpt-oss", "glm4moe")
    for i in range(n_layers + nextn):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = norm(n_embd)
        if arch == "deepseek2":
            m = MLA
            t[b + "attn_q_a.weight"] = dense(m["q_lora"], n_embd)
            t[b + "attn_q_a_norm.weight"] = norm(m["q_lora"])
            t[b + "attn_q_b.weight"] = dense(n_head * (m["nope"] + m["rope"]), m["q_lora"])
            t[b + "attn_kv_a_mqa.weight"] = dense(m["kv_lora"] + m["rope"], n_embd)
            t[b + "attn_kv_a_norm.weight"] = norm(m["kv_lora"])
            # Rows shorter than a K-quant block: the converter keeps these in a 32-block type.
            small = dense_type if GGML_QUANT_SIZES[dense_type][0] <= 32 else Q.Q8_0
            t[b + "attn_k_b.weight"] = (quantized((n_head, m["kv_lora"], m["nope"]), small, rng), small)
            t[b + "attn_v_b.weight"] = (quantized((n_head, m["v"], m["kv_lora"]), small, rng), small)
            if mla_joint_kv_b:  # [H * (nope + v), kv_lora]: per head, its key rows then its value rows
                k_b, v_b = t.pop(b + "attn_k_b.weight")[0], t.pop(b + "attn_v_b.weight")[0]
                if small != f32:
                    raise ValueError("mla_joint_kv_b needs float dense matrices")
                joint = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, m["kv_lora"])
                t[b + "attn_kv_b.weight"] = (np.ascontiguousarray(joint), f32)
            t[b + "attn_output.weight"] = dense(n_embd, n_head * m["v"])
        elif arch in HYBRID and i < n_layers and (i + 1) % meta[f"{arch}.full_attention_interval"]:  # linear attention
            t |= _delta_net(b, n_embd, arch, dense, vector, norm, rng, legacy_ssm_in)
        elif arch in HYBRID:  # gated attention: per head [query, gate]
            t[b + "attn_q.weight"] = dense(n_head * hd * 2, n_embd)
            t[b + "attn_k.weight"] = dense(n_head_kv * hd, n_embd)
            t[b + "attn_v.weight"] = dense(n_head_kv * hd, n_embd)
            t[b + "attn_output.weight"] = dense(n_embd, n_head * hd)
            t[b + "attn_q_norm.weight"] = norm(hd)
            t[b + "attn_k_norm.weight"] = norm(hd)
        else:
            t[b + "attn_q.weight"] = dense(n_head * hd, n_embd)
            t[b + "attn_k.weight"] = dense(n_head_kv * hd, n_embd)
            t[b + "attn_v.weight"] = dense(n_head_kv * hd, n_embd)
            t[b + "attn_output.weight"] = dense(n_embd, n_head * hd)
        if biased:
            t[b + "attn_q.bias"] = vector(n_head * hd)
            t[b + "attn_k.bias"] = vector(n_head_kv * hd)
            t[b + "attn_v.bias"] = vector(n_head_kv * hd)
        if arch in ("qwen3moe", "qwen3"):
            t[b + "attn_q_norm.weight"] = norm(hd)
            t[b + "attn_k_norm.weight"] = norm(hd)
        if arch == "olmoe":
            t[b + "attn_q_norm.weight"] = norm(n_head * hd)
            t[b + "attn_k_norm.weight"] = norm(n_head_kv * hd)
        if arch == "gpt-oss":
            t[b + "attn_output.bias"] = vector(n_embd)
            t[b + "attn_sinks.weight"] = vector(n_head)
            t[b + "ffn_gate_inp.bias"] = vector(n_expert)
            t[b + "ffn_gate_exps.bias"] = vector(n_expert, n_ff_exp)
            t[b + "ffn_up_exps.bias"] = vector(n_expert, n_ff_exp)
            t[b + "ffn_down_exps.bias"] = vector(n_expert, n_embd)
        # gpt-oss and GLM files name the pre-FFN norm after the attention it follows.
        post_norm = arch in ("gpt-oss", "glm4moe", *HYBRID)
        t[b + ("post_attention_norm.weight" if post_norm else "ffn_norm.weight")] = norm(n_embd)
        if i >= n_layers:  # a NextN block: what decoding must not read
            t[b + "nextn.eh_proj.weight"] = dense(n_embd, 2 * n_embd)
            t[b + "nextn.enorm.weight"] = norm(n_embd)
            t[b + "nextn.hnorm.weight"] = norm(n_embd)
            t[b + "nextn.shared_head_norm.weight"] = norm(n_embd)
        if i < dense_layers:
            t[b + "ffn_gate.weight"] = dense(2 * n_ff_exp, n_embd)
            t[b + "ffn_up.weight"] = dense(2 * n_ff_exp, n_embd)
            t[b + "ffn_down.weight"] = dense(n_embd, 2 * n_ff_exp)
            continue
        t[b + "ffn_gate_inp.weight"] = vector(n_expert, n_embd)
        t[b + "ffn_gate_exps.weight"] = experts(i, n_expert, n_ff_exp, n_embd)
        t[b + "ffn_up_exps.weight"] = experts(i, n_expert, n_ff_exp, n_embd)
        t[b + "ffn_down_exps.weight"] = experts(i, n_expert, n_embd, n_ff_exp, down=True)
        if arch in ("qwen2moe", *HYBRID):  # a shared expert behind a sigmoid gate
            shared = 2 * n_ff_exp if arch == "qwen2moe" else n_ff_exp
            t[b + "ffn_gate_shexp.weight"] = dense(shared, n_embd)
            t[b + "ffn_up_shexp.weight"] = dense(shared, n_embd)
            t[b + "ffn_down_shexp.weight"] = dense(n_embd, shared)
            t[b + "ffn_gate_inp_shexp.weight"] = vector(n_embd)
        if arch in ("glm4moe", "deepseek2"):
            # The choice's correction bias, large enough to change which experts win.
            t[b + "exp_probs_b.bias"] = ((rng.standard_normal(n_expert) * 0.3).astype(np.float32), f32)
            t[b + "ffn_gate_shexp.weight"] = dense(n_ff_exp, n_embd)
            t[b + "ffn_up_shexp.weight"] = dense(n_ff_exp, n_embd)
            t[b + "ffn_down_shexp.weight"] = dense(n_embd, n_ff_exp)
    return arch, meta, t, vocab


class MemoryModel:
    """A model's metadata and tensors in memory, read as a GGUF file is (a `weights.Source`):
    a model is built and loaded from it without a file."""

    def __init__(self, arch: str, metadata: Mapping[str, Any],
                 tensors: Mapping[str, tuple[np.ndarray, GGMLQuantizationType]]) -> None:  # fmt: skip
        from moechat.engine.gguf.reader import TensorInfo

        self.path = "<memory>"
        self.metadata = {"general.architecture": arch, **metadata}
        self.architecture = arch
        self._data: dict[str, np.ndarray] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, (data, qtype) in tensors.items():
            raw = np.ascontiguousarray(data).view(np.uint8)
            raw = raw.reshape(*data.shape[:-1], -1) if data.ndim else raw
            block, size = GGML_QUANT_SIZES[qtype]
            shape = (*raw.shape[:-1], raw.shape[-1] // size * block)  # torch order: values, not bytes
            self.tensors[name] = TensorInfo(name, qtype, shape, raw.nbytes, 0, 0)
            self._data[name] = raw

    def tensor_data(self, name: str) -> np.ndarray:
        return self._data[name]


def _delta_net(b: str, n_embd: int, arch: str, dense: Any, vector: Any, norm: Any, rng: np.random.Generator,
               legacy: bool) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:  # fmt: skip
    """A Gated DeltaNet layer's tensors, laid out as the converter writes `arch`."""
    d = DELTA
    hk, hv, dk, dv = d["k_heads"], d["v_heads"], d["dk"], d["dv"]
    channels = 2 * hk * dk + hv * dv
    f32 = Q.F32
    t = {
        b + "attn_qkv.weight": dense(channels, n_embd),
        b + "attn_gate.weight": dense(hv * dv, n_embd),
        # A wider conv than the projections' 0.05, so that the state sees values of about 1.
        b + "ssm_conv1d.weight": ((rng.standard_normal((channels, d["taps"])) * 0.5).astype(np.float32), f32),
        b + "ssm_dt.bias": vector(hv),
        b + "ssm_a": ((-np.exp(rng.uniform(-1.0, 1.0, hv))).astype(np.float32), f32),  # -exp(A_log)
        b + "ssm_norm.weight": norm(dv),
        b + "ssm_out.weight": dense(n_embd, hv * dv),
    }
    if arch == "qwen35moe":
        t[b + "ssm_beta.weight"] = dense(hv, n_embd)
        t[b + "ssm_alpha.weight"] = dense(hv, n_embd)
    else:  # per key head [beta x ratio, alpha x ratio]
        t[b + "ssm_ba.weight"] = dense(2 * hv, n_embd)
    if legacy:
        qkv, z = t.pop(b + "attn_qkv.weight")[0], t.pop(b + "attn_gate.weight")[0]
        if qkv.dtype != np.float32:
            raise ValueError("legacy_ssm_in needs float dense matrices")
        r = hv // hk
        q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
        per_head = [q.reshape(hk, dk, -1), k.reshape(hk, dk, -1), v.reshape(hk, r * dv, -1), z.reshape(hk, r * dv, -1)]
        t[b + "ssm_in.weight"] = (np.ascontiguousarray(np.concatenate(per_head, axis=1).reshape(-1, n_embd)), f32)
    return t
