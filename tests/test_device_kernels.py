"""The device kernels (Triton), run on CPU tensors in Triton's interpreter: numerics and launch counts.

Stated bound: relative error (max |error| / max |reference|) <= 1e-5 against gguf-py's
dequantizer in float64, for every type, with float32 activations and accumulation (measured
1e-7 to 4e-7). On a machine without triton (it is in the test extra on Linux x86-64 only) every
test here shows as skipped. Tests marked `cuda` need a GPU: bench/gpu.py runs them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from moechat.engine.cache.expert_cache import ExpertCache
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.kernels import device as device_kernels
from moechat.engine.loader import LoadedModel, load_model
from testkit.ggufgen import Q, quantized, tiny_moe
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

pytestmark = pytest.mark.skipif(not device_kernels.available(), reason="triton is not installed")

BOUND = 1e-5
TYPES = sorted(device_kernels.TYPES, key=lambda t: t.name)
ACTS = {Q.MXFP4: 2, Q.Q6_K: 1}  # gpt-oss's clamped SwiGLU with biases; Gemma's GeLU; the rest SiLU
PROMPT = "The lighthouse keeper counted the ships that passed"


def _silu(g: np.ndarray) -> np.ndarray:
    return g / (1 + np.exp(-g))


def _act(code: int, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    if code == 0:
        return _silu(g) * u
    if code == 1:
        return 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u
    g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    return (u + 1) * g / (1 + np.exp(-1.702 * g))


def _case(qtype: Q, n_tok: int, seed: int) -> dict[str, Any]:
    """Experts of `qtype` in slots (down in Q8_0 where `qtype`'s 256-weight blocks cannot span F = 96),
    routing where ids repeat across tokens, some slots stay empty and some experts are the CPU's."""
    rng = np.random.default_rng(seed)
    big = GGML_QUANT_SIZES[qtype][0] == 256
    e_dim, f_dim, n_exp, k, n_slots = (512 if big else 288), 96, 6, 3, 8
    down_t = Q.Q8_0 if big else qtype
    mats = [quantized((n_exp, f_dim, e_dim), qtype, rng) for _ in range(2)]
    mats.append(quantized((n_exp, e_dim, f_dim), down_t, rng))
    slot_of = np.array([5, 0, -1, 2, 7, 3])  # expert 2 has no slot; slots 1, 4, 6 are empty
    on_device = slot_of >= 0
    banks = [np.zeros((n_slots, *m.shape[1:]), np.uint8) for m in mats]
    for e, s in enumerate(slot_of):
        for bank, m in zip(banks, mats, strict=True):
            if s >= 0:
                bank[s] = m[e]
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(n_tok)])
    ids[0, :2] = [2, 4]  # every case has a CPU pair and a device pair
    x = rng.standard_normal((n_tok, e_dim)).astype(np.float32)
    w = rng.random((n_tok, k)).astype(np.float32)
    act = ACTS.get(qtype, 0)
    biases = [rng.standard_normal((n_exp, n)).astype(np.float32) * 0.1 for n in (f_dim, f_dim, e_dim)]
    if act != 2:
        biases = []
    return dict(qtypes=(qtype, qtype, down_t), mats=mats, banks=banks, slot_of=slot_of, on_device=on_device,
                ids=ids, x=x, w=w, act=act, biases=biases)  # fmt: skip


def _reference(c: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(per-pair contributions [T*k, E], the layer's output [T, E]) in float64, summed in expert order."""
    ids, x, w = c["ids"], c["x"].astype(np.float64), c["w"]
    deq = [
        [gguf_dequantize(m[e], t).astype(np.float64) for e in range(m.shape[0])]
        for m, t in zip(c["mats"], c["qtypes"], strict=True)
    ]
    n_tok, k = ids.shape
    contrib = np.zeros((n_tok * k, x.shape[1]))
    for t in range(n_tok):
        for j, e in enumerate(ids[t]):
            g, u = deq[0][e] @ x[t], deq[1][e] @ x[t]
            if c["biases"]:
                g, u = g + c["biases"][0][e], u + c["biases"][1][e]
            y = deq[2][e] @ _act(c["act"], g, u)
            if c["biases"]:
                y = y + c["biases"][2][e]
            contrib[t * k + j] = w[t, j] * y
    out = np.stack([contrib[t * k : (t + 1) * k][np.argsort(ids[t], kind="stable")].sum(0) for t in range(n_tok)])
    return contrib, out


def _run(c: dict[str, Any], host_rows: np.ndarray | None) -> np.ndarray:
    table, n_pairs = device_kernels.pair_table(c["ids"], c["slot_of"], c["on_device"])
    biases = tuple(torch.from_numpy(b) for b in c["biases"]) if c["biases"] else (None, None, None)
    banks = tuple(torch.from_numpy(b) for b in c["banks"])
    host = None if host_rows is None else torch.from_numpy(host_rows.astype(np.float32))
    out = device_kernels.run_layer(
        (banks[0], banks[1], banks[2]), c["qtypes"], (biases[0], biases[1], biases[2]), c["act"],
        torch.from_numpy(c["x"]), torch.from_numpy(c["w"]), torch.from_numpy(table), n_pairs, c["ids"].shape[1],
        lambda: host,
    )  # fmt: skip
    return out.numpy()


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.parametrize("n_tok", [1, 2, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layer_kernels_match_gguf_py(qtype: Q, n_tok: int) -> None:
    c = _case(qtype, n_tok, seed=n_tok)
    contrib, ref = _reference(c)
    # The CPU's rows come from the reference; the device's rows of that buffer are NaN, so taking one
    # from the wrong side shows.
    cpu_rows = ~c["on_device"][c["ids"].reshape(-1)]
    host_rows = np.where(cpu_rows[:, None], contrib, np.nan)
    got = _run(c, host_rows)
    assert np.isfinite(got).all()
    assert _rel(got, ref) <= BOUND, (qtype.name, n_tok, _rel(got, ref))


@pytest.mark.slow
def test_down_of_256_weight_types_and_all_pairs_on_device() -> None:
    """The K-quants as the down projection (F = 256 columns), every selected expert in a slot."""
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS):
        rng = np.random.default_rng(1)
        e_dim, f_dim, n_exp = 256, 256, 3
        mats = [quantized((n_exp, f_dim, e_dim), qtype, rng) for _ in range(2)]
        mats.append(quantized((n_exp, e_dim, f_dim), qtype, rng))
        c = dict(qtypes=(qtype,) * 3, mats=mats, banks=[m[::-1].copy() for m in mats], slot_of=np.array([2, 1, 0]),
                 on_device=np.ones(n_exp, bool), ids=np.array([[2, 0]]), x=rng.standard_normal((1, e_dim)).astype(
                     np.float32), w=np.array([[0.7, 0.3]], np.float32), act=0, biases=[])  # fmt: skip
        _, ref = _reference(c)
        assert _rel(_run(c, None), ref) <= BOUND, qtype.name


def test_pair_table_codes_rows_in_expert_order() -> None:
    ids = np.array([[3, 1, 4], [1, 5, 9]])
    slot_of = np.full(10, -1)
    slot_of[[1, 3, 9]] = [0, 2, 1]
    table, n_pairs = device_kernels.pair_table(ids, slot_of, slot_of >= 0)
    pairs = table[: 3 * n_pairs].reshape(-1, 3)
    assert n_pairs == 4 and pairs.tolist() == [[0, 2, 3], [1, 0, 1], [3, 0, 1], [5, 1, 9]]
    codes = table[3 * n_pairs :].reshape(2, 3)
    # token 0: experts 1 (row 1, device), 3 (row 0, device), 4 (row 2, CPU); token 1: 1, 5 (CPU), 9
    assert codes.tolist() == [[2, 0, 5], [6, 9, 10]]


# -- in the expert cache -------------------------------------------------------------------------


def _triton_model(path: Path, share: float, kernels: str = "triton", cpu_kernels: str = "fast") -> LoadedModel:
    total = sum(lx.bytes_per_expert for lx in load_model(path, n_ctx=64).model.host_experts.layers.values())
    settings = CacheSettings(mib=total * 3 / 2**20, cpu_share=share, device_kernels=kernels)  # 3 experts a layer
    return load_model(path, n_ctx=64, cache=settings, cpu_kernels=cpu_kernels)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "qtype"), [("qwen3moe", Q.Q4_K), ("gpt-oss", Q.MXFP4)], ids=["qwen3moe", "gpt-oss"])
def test_cache_on_triton_kernels_computes_what_the_cache_off_does(arch: str, qtype: Q, tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf", arch=arch, expert_type=qtype, down_type=Q.Q6_K if qtype == Q.Q4_K else None)
    # Cache off as on a GPU, where the host's experts keep int16 beside the device's float32
    # (kernels.isa.activation_bits): on the CPU device the default would take int8.
    plain = load_model(path, n_ctx=64, cpu_kernels="int16")
    lm = _triton_model(path, share=0.5)
    assert lm.cache is not None and all(lm.cache.triton.values())
    assert lm.model.host_experts.bits == 16  # the default beside the device kernels
    ids = plain.tokenizer.encode(PROMPT)[:10]
    c1, c2 = plain.new_cache(), lm.new_cache()
    with torch.inference_mode():
        for t in ids:
            a = plain.model(torch.tensor([t]), c1.pos, c1)
            b = lm.model(torch.tensor([t]), c2.pos, c2)
            # The device kernels' float32 products against the CPU's int16 ones, one scale per 256: within
            # the CPU kernels' MoE bound (test_cpu_kernels.MOE_BOUND, 2e-4) carried through the model.
            assert _rel(b.numpy(), a.numpy()) <= 3e-4
    total = lm.cache.snapshot().total
    assert total.hits > 0 and total.cpu > 0 and total.uploads > 0

    def tokens(m: LoadedModel) -> list[int]:
        events = generate(m.model, m.tokenizer, ids, m.new_cache(), max_tokens=12, params=GREEDY, ignore_eos=True)
        return [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]

    assert tokens(_triton_model(path, share=0.5)) == tokens(plain)


def test_types_without_kernels_fall_back_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_moe(tmp_path / "m.gguf", expert_type=Q.Q4_1)
    with caplog.at_level("INFO", logger="moechat.engine.cache.expert_cache"):
        lm = _triton_model(path, share=0.0)
    assert lm.cache is not None and not any(lm.cache.triton.values())
    assert "no device kernel for Q4_1" in caplog.text


# -- launches per MoE layer ------------------------------------------------------------------------

_VIEWS = {"empty", "empty_like", "view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze",
          "expand", "t", "transpose", "reshape", "permute", "alias", "detach", "lift_fresh"}  # fmt: skip


class _Ops(TorchDispatchMode):
    """Counts the aten ops that do work on the device, by name: not views, not allocations (no kernel
    runs; CUDA's caching allocator serves them), not ops that return their input unchanged (a `.to`
    of a tensor already of that type and device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name not in _VIEWS and not (args and out is args[0]):
            self.ops[name] += 1
        return out


def _expert_ops_per_layer(path: Path, kernels: str, monkeypatch: pytest.MonkeyPatch) -> tuple[float, float, Counter]:
    """(device ops, kernel launches) per MoE layer and decode token inside the expert cache, and the ops."""
    # "torch" on the CPU device with the exact CPU kernels: the eager dequantize-and-matmul path a GPU got.
    lm = _triton_model(path, share=0.0, kernels=kernels, cpu_kernels="exact" if kernels == "torch" else "fast")
    assert lm.cache is not None
    launches = Counter[str]()
    real_launch = device_kernels.launch

    def counted(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        launches[kernel.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's own tensor handling is not the device's work
            real_launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(device_kernels, "launch", counted)
    mode = _Ops()
    real_call = ExpertCache.__call__
    calls = 0

    def call(self: ExpertCache, *args: Any, **kw: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        with mode:
            return real_call(self, *args, **kw)

    ids = lm.tokenizer.encode(PROMPT)[:6]
    kv = lm.new_cache()
    with torch.inference_mode():
        for t in ids[:3]:  # warm the slots first
            lm.model(torch.tensor([t]), kv.pos, kv)
        launches.clear()
        monkeypatch.setattr(ExpertCache, "__call__", call)
        for t in ids[3:]:
            lm.model(torch.tensor([t]), kv.pos, kv)
    monkeypatch.undo()
    # Uploads into slots are copies of the file's bytes, one per matrix per missed expert; not compute.
    ops = Counter({n: c for n, c in mode.ops.items() if n != "copy_"})
    return sum(ops.values()) / calls, sum(launches.values()) / calls, ops


# Device ops + launches per MoE layer and decode token, for any k: the three kernels, and on CUDA the
# pair table's copy to the device and the activations' casts (measured here: 3 launches, no other op;
# the eager path: 148 ops at k = 2, 294 at k = 4).
LAUNCH_BOUND = 6


@pytest.mark.slow
def test_a_fixed_number_of_launches_per_moe_layer_whatever_k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {}
    for k in (2, 4):
        path = tiny_moe(tmp_path / f"k{k}.gguf", expert_type=Q.Q4_K, down_type=Q.Q6_K, n_expert=16, n_expert_used=k)
        ops, launches, names = _expert_ops_per_layer(path, "triton", monkeypatch)
        assert launches == 3, names
        assert ops + launches <= LAUNCH_BOUND, names
        counts[k] = ops + launches
        eager, _, _ = _expert_ops_per_layer(path, "torch", monkeypatch)
        assert eager > 4 * LAUNCH_BOUND  # what the eager path costs, for scale (grows with k)
        counts[-k] = eager
    assert counts[2] == counts[4]
    assert counts[-4] > counts[-2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.py runs these)")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_compiled_kernels_on_the_gpu(qtype: Q) -> None:
    c = _case(qtype, 8, seed=3)
    contrib, ref = _reference(c)
    cpu_rows = ~c["on_device"][c["ids"].reshape(-1)]
    table, n_pairs = device_kernels.pair_table(c["ids"], c["slot_of"], c["on_device"])
    dev = torch.device("cuda")
    biases: list[torch.Tensor | None] = [torch.from_numpy(b).to(dev) for b in c["biases"]] or [None, None, None]
    banks = [torch.from_numpy(b).to(dev) for b in c["banks"]]
    host = torch.from_numpy(np.where(cpu_rows[:, None], contrib, np.nan).astype(np.float32)).to(dev)
    out = device_kernels.run_layer(
        (banks[0], banks[1], banks[2]), c["qtypes"], (biases[0], biases[1], biases[2]), c["act"],
        torch.from_numpy(c["x"]).to(dev), torch.from_numpy(c["w"]).to(dev), torch.from_numpy(table).to(dev),
        n_pairs, c["ids"].shape[1], lambda: host,
    )  # fmt: skip
    assert _rel(out.cpu().numpy(), ref) <= BOUND


@pytest.mark.parametrize("n_tok", [1, 3, 17])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dense_matrices_on_the_device_match_gguf_py(qtype: Q, n_tok: int) -> None:
    """Attention projections and the output head on the device: the file's bytes under the dense kernel
    (few tokens) or decoded once into a GEMM (many), both against gguf-py."""
    from moechat.engine.nn.qlinear import DeviceQLinear, QLinear

    rng = np.random.default_rng(n_tok)
    k_dim = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 288
    raw = quantized((37, k_dim), qtype, rng)  # rows not a multiple of a tile
    x = rng.standard_normal((n_tok, k_dim)).astype(np.float32)
    ref = x.astype(np.float64) @ gguf_dequantize(raw, qtype).astype(np.float64).T
    w = DeviceQLinear(torch.from_numpy(raw), qtype, (37, k_dim))
    assert _rel(w(torch.from_numpy(x)).numpy(), ref) <= BOUND
    assert QLinear(raw, qtype).moved_to(torch.device("cpu")).__class__ is QLinear  # the CPU keeps its kernels


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.py runs these)")
def test_gpu_cache_with_device_kernels_keeps_the_greedy_tokens(tmp_path: Path) -> None:
    """On a GPU: experts from the slots and dense matrices from their bytes, under the compiled kernels."""
    from moechat.engine.nn.qlinear import DeviceQLinear

    path = tiny_moe(tmp_path / "m.gguf", expert_type=Q.Q4_K, down_type=Q.Q6_K, dense_type=Q.Q8_0)
    plain = load_model(path, n_ctx=64)
    ids = plain.tokenizer.encode(PROMPT)[:10]

    def tokens(m: LoadedModel) -> list[int]:
        events = generate(m.model, m.tokenizer, ids, m.new_cache(), max_tokens=16, params=GREEDY, ignore_eos=True)
        return [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]

    total = sum(lx.bytes_per_expert for lx in plain.model.host_experts.layers.values())
    for share in (0.0, 0.5):
        lm = load_model(path, n_ctx=64, cache=CacheSettings(mib=total * 3 / 2**20, cpu_share=share, device="cuda"))
        assert lm.cache is not None and all(lm.cache.triton.values())
        assert any(isinstance(v, DeviceQLinear) for m in lm.model.modules() for v in vars(m).values())
        assert tokens(lm) == tokens(plain)
        lm.close()
