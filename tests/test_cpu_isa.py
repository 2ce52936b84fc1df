"""Every instruction level of the CPU kernels on whatever host the tests run (engine/kernels/isa.py).

The default level (the CPU's own) runs in the rest of the suite; here each lower one runs in a
process of its own, capped by MOECHAT_CPU_ISA, against gguf-py's dequantizer within the stated
bounds of test_cpu_kernels, on the layouts and widths whose code that level changes (`CASES`):
plain and super-block types (MXFP4 four blocks at a time with AVX-512), signed and unsigned
integers, int16 and int8 activations, one token and five (the prompt tiles: the same bits as one at
a time).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from moechat.engine.kernels import isa
from testkit.ggufgen import tiny_moe

CHECK = """
import ast
import sys
import numpy as np
from gguf.quants import dequantize
from moechat.engine.kernels import cpu, isa
from testkit.ggufgen import Q, quantized

print(isa.LEVEL, isa.describe())
rng = np.random.default_rng(0)
BOUND = {16: 1e-4, 8: 1e-2}
for name, k, bits in ast.literal_eval(sys.argv[1]):
    qtype = Q[name]
    raw = quantized((37, k), qtype, rng)
    w = dequantize(raw, qtype).reshape(37, k).astype(np.float64)
    x = rng.standard_normal((5, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T
    got = cpu.dense(raw, qtype, x, bits)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= BOUND[bits], (qtype.name, bits, err)
    # five tokens take the prompt tiles where the type has them: the same bits as one at a time
    assert all(np.array_equal(got[i], cpu.dense(raw, qtype, x[i : i + 1], bits)[0]) for i in range(5))
print("ok")
"""

# What each level's instructions change, so what its run checks: (type, row length, activation bits).
# Each (type, bits) compiles a kernel of its own, the test's cost. Generic code takes no intrinsic: every
# layout (integer super-blocks unsigned and signed, IQ4's table, one scale a block), both widths. AVX2
# changes int8 products everywhere and IQ4's lookup, and int16 ones only in blocks of one scale
# (AVX-512 holds their 16 lanes in one register); VNNI changes only the int8 products of blocks of one
# scale (MXFP4 four blocks at a time with AVX-512: 23 blocks a row take the quads, then a pair, then
# one; Q4_0 one at a time). The host's own level runs in the rest of the suite.
ONE_SCALE_INT8 = [("Q4_0", 512, 8), ("MXFP4", 512, 8), ("MXFP4", 736, 8)]
CASES = {
    "generic": [("Q4_K", 512, 8), ("Q6_K", 512, 8), ("IQ4_XS", 512, 8), *ONE_SCALE_INT8, ("Q4_K", 512, 16),
                ("Q4_0", 512, 16)],
    "avx2": [("Q4_K", 512, 8), ("IQ4_XS", 512, 8), *ONE_SCALE_INT8, ("Q4_0", 512, 16)],
    "avx512-novnni": ONE_SCALE_INT8,
}  # fmt: skip


def _run(level: str, cache: Path, code: str = CHECK) -> list[str]:
    env = {**os.environ, "MOECHAT_CPU_ISA": level, "NUMBA_CACHE_DIR": str(cache),
           "PYTHONPATH": str(Path(__file__).parent)}  # fmt: skip
    cmd = [sys.executable, "-c", code, repr(CASES.get(level, []))]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("level", ["generic", "avx2", "avx512-novnni"])
def test_a_lower_level_computes_within_the_bounds(level: str, tmp_path: Path) -> None:
    expected = min(level, isa.LEVEL, key=isa.LEVELS.index)
    if expected == isa.LEVEL:
        # A cap at or above this CPU's level runs its own kernels, which the rest of the suite checks
        # (compiling them again here took minutes): only the level the cap leads to is checked.
        out = _run(level, tmp_path / "kernels", "from moechat.engine.kernels import isa; print(isa.LEVEL)")
        assert out == [isa.LEVEL]
        return
    out = _run(level, tmp_path / "kernels")
    # A cap never raises the level: a CPU without AVX2 runs generic code however it is capped.
    assert out[0].split()[0] == expected, out
    assert out[-1] == "ok"


def test_a_bad_level_is_refused_in_one_line(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf")
    env = {**os.environ, "MOECHAT_CPU_ISA": "sse9", "NUMBA_CACHE_DIR": str(tmp_path / "kernels")}
    cmd = [sys.executable, "-m", "moechat", "inspect", str(model)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    levels = "generic, avx2, avx512-novnni, avx512"
    assert r.stderr.strip() == f"moechat: error: MOECHAT_CPU_ISA must be one of {levels}, got 'sse9'"


def test_inspect_says_which_instructions_the_kernels_use(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf")
    r = subprocess.run([sys.executable, "-m", "moechat", "inspect", str(model)], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "CPU kernels" in r.stdout and isa.describe().split(" (")[0] in r.stdout
