"""Memory of real MoE models on paper: host RAM, device memory and bytes read per decoded token.

    python bench/memory_on_paper.py [--ctx 32768] [--hit 0.8]

Geometries are the models' config.json values. Tensor types follow llama.cpp's rules for the named
mix, simplified as `qtype` says. The expert cache holds half of the experts; the KV cache is
float32, as moechat keeps it. tests/test_memory_on_paper.py writes GGUF files with these
geometries (two or three layers, the tensor data left sparse) and checks that `moechat inspect`
reports what `expert_layer_bytes`, `kv_bytes_per_token` and `linear_state_bytes` compute here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class Geometry:
    name: str
    arch: str
    mix: str  # "Q4_K_M" or "Q2_K"
    n_layers: int  # decoder layers (a file's NextN block not counted)
    n_embd: int
    vocab: int
    n_head: int
    n_kv: int
    head_dim: int
    ctx_train: int
    experts: int
    used: int
    ff_exp: int
    shared_ff: int  # the shared expert's width (0: none)
    dense_lead: int = 0
    dense_ff: int = 0
    full_every: int = 0  # > 0: linear attention except in every full_every-th layer
    linear: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # key heads, value heads, key dim, value dim, conv taps
    mla: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # q rank, latent rank, no-rope dim, rope dim, value dim
    nextn: int = 0

    def is_linear(self, i: int) -> bool:
        return self.full_every > 0 and (i + 1) % self.full_every != 0


MODELS = (
    Geometry("Qwen3.5-35B-A3B", "qwen35moe", "Q4_K_M", n_layers=40, n_embd=2048, vocab=248320, n_head=16, n_kv=2,
             head_dim=256, ctx_train=262144, experts=256, used=8, ff_exp=512, shared_ff=512, full_every=4,
             linear=(16, 32, 128, 128, 4), nextn=1),
    Geometry("GLM-4.5-Air", "glm4moe", "Q4_K_M", n_layers=46, n_embd=4096, vocab=151552, n_head=96, n_kv=8,
             head_dim=128, ctx_train=131072, experts=128, used=8, ff_exp=1408, shared_ff=1408, dense_lead=1,
             dense_ff=10944, nextn=1),
    Geometry("DeepSeek-V3", "deepseek2", "Q2_K", n_layers=61, n_embd=7168, vocab=129280, n_head=128, n_kv=1,
             head_dim=576, ctx_train=163840, experts=256, used=8, ff_exp=2048, shared_ff=2048, dense_lead=3,
             dense_ff=18432, mla=(1536, 512, 128, 64, 128), nextn=1),
)  # fmt: skip


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's layers that get a larger type for down projections and values in K-quant mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# Types for rows that are not a whole number of 256-weight blocks, as llama.cpp falls back.
_FALLBACK = {Q.Q2_K: Q.IQ4_NL, Q.Q3_K: Q.IQ4_NL, Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


def qtype(g: Geometry, kind: str, layer: int, row: int) -> Q:
    """The type of a matrix of `kind` in `layer` whose rows hold `row` weights.

    Q4_K_M: Q4_K, with down projections and attention values in Q6_K in llama.cpp's "more bits"
    layers and the output in Q6_K. Q2_K (simplified from llama.cpp's, which varies a few tensors
    more): experts' gate/up Q2_K and down Q3_K, the rest Q4_K, output Q6_K.
    """
    if kind in ("norm", "router", "vector", "conv"):
        return Q.F32
    if kind == "output":
        t = Q.Q6_K
    elif g.mix == "Q2_K" and kind in ("exp_gate_up", "exp_down"):
        t = Q.Q2_K if kind == "exp_gate_up" else Q.Q3_K
    elif kind in ("down", "exp_down", "value") and g.mix == "Q4_K_M" and more_bits(layer, g.n_layers):
        t = Q.Q6_K
    else:
        t = Q.Q4_K
    return t if row % 256 == 0 else _FALLBACK[t]


def nbytes(shape: tuple[int, ...], t: Q) -> int:
    block, size = GGML_QUANT_SIZES[t]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def layer_tensors(g: Geometry, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Layer i's tensors: (name, torch-order shape, kind for `qtype`)."""
    e, p = g.n_embd, f"blk.{i}."
    t: list[tuple[str, tuple[int, ...], str]] = [(p + "attn_norm.weight", (e,), "norm")]
    ffn_norm = "ffn_norm" if g.arch == "deepseek2" else "post_attention_norm"
    t.append((f"{p}{ffn_norm}.weight", (e,), "norm"))
    hd, h, kv = g.head_dim, g.n_head, g.n_kv
    if g.is_linear(i):
        hk, hv, dk, dv, taps = g.linear
        ch = 2 * hk * dk + hv * dv
        t += [(p + "attn_qkv.weight", (ch, e), "attn"), (p + "attn_gate.weight", (hv * dv, e), "attn"),
              (p + "ssm_beta.weight", (hv, e), "attn"), (p + "ssm_alpha.weight", (hv, e), "attn"),
              (p + "ssm_conv1d.weight", (ch, taps), "conv"), (p + "ssm_dt.bias", (hv,), "vector"),
              (p + "ssm_a", (hv,), "vector"), (p + "ssm_norm.weight", (dv,), "norm"),
              (p + "ssm_out.weight", (e, hv * dv), "attn")]  # fmt: skip
    elif g.mla[1]:
        q_rank, c, nope, rope, v = g.mla
        t += [(p + "attn_q_a.weight", (q_rank, e), "attn"), (p + "attn_q_a_norm.weight", (q_rank,), "norm"),
              (p + "attn_q_b.weight", (h * (nope + rope), q_rank), "attn"),
              (p + "attn_kv_a_mqa.weight", (c + rope, e), "attn"), (p + "attn_kv_a_norm.weight", (c,), "norm"),
              (p + "attn_k_b.weight", (h, c, nope), "attn"), (p + "attn_v_b.weight", (h, v, c), "value"),
              (p + "attn_output.weight", (e, h * v), "attn")]  # fmt: skip
    else:
        q_rows = h * hd * (2 if g.full_every else 1)  # Qwen3.5's query projection also yields the gate
        t += [
            (p + "attn_q.weight", (q_rows, e), "attn"),
            (p + "attn_k.weight", (kv * hd, e), "attn"),
            (p + "attn_v.weight", (kv * hd, e), "value"),
            (p + "attn_output.weight", (e, h * hd), "attn"),
        ]
        if g.full_every:
            t += [(p + "attn_q_norm.weight", (hd,), "norm"), (p + "attn_k_norm.weight", (hd,), "norm")]
        if g.arch == "glm4moe":
            t += [(p + f"attn_{n}.bias", (r,), "vector") for n, r in (("q", h * hd), ("k", kv * hd), ("v", kv * hd))]
    if i < g.dense_lead:
        f = g.dense_ff
        t += [(p + "ffn_gate.weight", (f, e), "gate_up"), (p + "ffn_up.weight", (f, e), "gate_up"),
              (p + "ffn_down.weight", (e, f), "down")]  # fmt: skip
        return t
    f, n = g.ff_exp, g.experts
    t += [
        (p + "ffn_gate_inp.weight", (n, e), "router"),
        (p + "ffn_gate_exps.weight", (n, f, e), "exp_gate_up"),
        (p + "ffn_up_exps.weight", (n, f, e), "exp_gate_up"),
        (p + "ffn_down_exps.weight", (n, e, f), "exp_down"),
    ]
    if g.shared_ff:
        s = g.shared_ff
        t += [(p + "ffn_gate_shexp.weight", (s, e), "gate_up"), (p + "ffn_up_shexp.weight", (s, e), "gate_up"),
              (p + "ffn_down_shexp.weight", (e, s), "down")]  # fmt: skip
    if g.arch == "qwen35moe":
        t.append((p + "ffn_gate_inp_shexp.weight", (e,), "vector"))
    if g.arch in ("glm4moe", "deepseek2"):
        t.append((p + "exp_probs_b.bias", (n,), "vector"))
    return t


def end_tensors(g: Geometry) -> list[tuple[str, tuple[int, ...], str]]:
    return [("token_embd.weight", (g.vocab, g.n_embd), "embd"), ("output_norm.weight", (g.n_embd,), "norm"),
            ("output.weight", (g.vocab, g.n_embd), "output")]  # fmt: skip


def typed(g: Geometry, i: int, name: str, shape: tuple[int, ...], kind: str) -> tuple[str, tuple[int, ...], Q]:
    return name, shape, qtype(g, kind, i, shape[-1])


# Closed forms, written apart from the tensor lists so that the test compares two computations.
def expert_layer_bytes(g: Geometry, i: int) -> int:
    """One MoE layer's routed experts: n x (gate + up + down) at the layer's types."""
    e, f = g.n_embd, g.ff_exp
    gate_up, down = qtype(g, "exp_gate_up", i, e), qtype(g, "exp_down", i, f)
    return g.experts * (2 * nbytes((f, e), gate_up) + nbytes((e, f), down))


def kv_bytes_per_token(g: Geometry) -> int:
    """float32 keys and values per position, full-attention layers only (MLA: one latent + rotary key)."""
    full = sum(not g.is_linear(i) for i in range(g.n_layers))
    per_layer = (g.mla[1] + g.mla[3]) if g.mla[1] else 2 * g.n_kv * g.head_dim
    return full * per_layer * 4


def linear_state_bytes(g: Geometry) -> int:
    """float32 conv inputs and delta-rule state of the linear-attention layers, whatever the context."""
    hk, hv, dk, dv, taps = g.linear
    per_layer = (taps - 1) * (2 * hk * dk + hv * dv) + hv * dk * dv
    return sum(g.is_linear(i) for i in range(g.n_layers)) * per_layer * 4


@dataclass(frozen=True)
class Paper:
    experts: int  # all routed experts of the decoder's layers
    dense: int  # everything else the device holds: attention, shared experts, dense layers, ends
    active: int  # routed expert bytes one token reads (used experts in every MoE layer)
    dense_read: int  # dense bytes one token reads (the embedding: one row)
    kv_token: int
    state: int


def paper(g: Geometry) -> Paper:
    experts = dense = active = embd = 0
    for i in range(g.n_layers):
        for name, shape, t in (typed(g, i, *x) for x in layer_tensors(g, i)):
            if "_exps." in name:
                experts += nbytes(shape, t)
                active += nbytes(shape, t) * g.used // g.experts
            else:
                dense += nbytes(shape, t)
    for name, shape, t in (typed(g, 0, *x) for x in end_tensors(g)):
        dense += nbytes(shape, t)
        if name == "token_embd.weight":
            embd = nbytes(shape, t)
    return Paper(experts, dense, active, dense - embd + embd // g.vocab, kv_bytes_per_token(g), linear_state_bytes(g))


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=32768, help="context for the KV cache (default 32768)")
    ap.add_argument("--hit", type=float, default=0.8, help="cache hit rate for the upload figure (default 0.8)")
    args = ap.parse_args()
    cols = ("model", "experts (host RAM)", "dense", "cache (half)", f"KV at {args.ctx}", "linear state",
            "device total", "read/token", "of it experts", f"uploaded/token at hit {args.hit:g}")  # fmt: skip
    print(" | ".join(cols))
    for g in MODELS:
        p = paper(g)
        cache = p.experts // 2
        kv = p.kv_token * args.ctx
        device = p.dense + cache + kv + p.state
        upload = (1 - args.hit) * p.active
        print(" | ".join((f"{g.name} {g.mix}", _gb(p.experts), _gb(p.dense), _gb(cache), _gb(kv), _gb(p.state),
                          _gb(device), _gb(p.dense_read + p.active), _gb(p.active), _gb(upload))))  # fmt: skip


if __name__ == "__main__":
    main()
