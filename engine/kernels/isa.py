"""Which vector instructions the CPU kernels build on: the CPU's own, capped by MOECHAT_CPU_ISA.

The block layouts (`qblocks`) name a few x86 instructions outright where LLVM would not find them
by itself (byte shuffles for the code books, byte and word products); everything else is plain
vector code that LLVM compiles for the machine's CPU. Four levels:

- `avx512`: AVX-512BW's 64-byte products, two 32-weight chunks per instruction, and with
  AVX512-VNNI where the CPU has it, byte products summed in fours in one instruction (vpdpbusd;
  LLVM also fuses the int16 products and their sums into vpdpwssd);
- `avx512-novnni`: the same without VNNI's instructions (what a CPU with AVX-512BW but not VNNI runs);
- `avx2`: the 32-byte forms of the same instructions;
- `generic`: no instruction named, for any CPU (ARM, older x86).

MOECHAT_CPU_ISA=avx512-novnni, =avx2 or =generic runs a lower level on a CPU that has a higher one: the tests run
every level on whatever host they run, and a user can rule out a path. The level is part of the
kernel cache's folder name (engine/kernels/jit.py), so kernels of one level never load for another.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import llvmlite.binding as llvm

LEVELS = ("generic", "avx2", "avx512-novnni", "avx512")
ENV = "MOECHAT_CPU_ISA"


def _cpu_level() -> str:
    if not llvm.get_process_triple().startswith(("x86_64", "amd64")):
        return "generic"
    features = llvm.get_host_cpu_features()
    if features.get("avx512bw"):
        return "avx512"
    return "avx2" if features.get("avx2") else "generic"


def _level() -> str:
    cap = os.environ.get(ENV, "")
    if cap and cap not in LEVELS:
        raise ValueError(f"{ENV} must be one of {', '.join(LEVELS)}, got '{cap}'")
    cpu = _cpu_level()
    return min(cpu, cap, key=LEVELS.index) if cap else cpu


LEVEL = _level()
X86 = llvm.get_process_triple().startswith(("x86_64", "amd64")) and LEVEL != "generic"
AVX2 = LEVEL in ("avx2", "avx512-novnni", "avx512")
AVX512 = LEVEL in ("avx512-novnni", "avx512")
_FEATURES = llvm.get_host_cpu_features()
VNNI = LEVEL == "avx512" and bool(_FEATURES.get("avx512vnni")) and bool(_FEATURES.get("avx512vl"))

# The activations' width the default mode ("fast") gives a few tokens (decode): int8 where the CPU
# multiplies bytes in one instruction (pmaddubsw; x86 with AVX2 or AVX-512), which reads the blocks
# 1.1 to 1.5x faster than int16 on the hosts measured; the generic code has no byte products and keeps
# int16. Both widths meet the quality bar on real weights (tests/test_quality_bar.py). A prompt's
# matrices of the super-block types run in integer tiles: int8 ones where the CPU has AVX512-VNNI
# (kernels/qtiles8.py; 1.2-1.6x the int16 tiles there), else int16 ones, which beat decoding to
# floats. A prompt's experts of the other types (MXFP4, Q8_0, ...: read a row at a time, four
# tokens a pass) take the few tokens' width: 1.7x faster in int8 than in int16 on MXFP4.
FAST_FEW_BITS = 8 if AVX2 else 16
FAST_PROMPT_BITS = 8 if VNNI else 16


class Widths(NamedTuple):
    """A kernel mode's activation bits (8 or 16) for each kind of call."""

    few: int  # a few tokens (decode)
    prompt: int  # a prompt's matrices that the integer tiles read (the super-block types)
    prompt_rows: int  # a prompt's experts of the other types (dense matrices of those decode to floats)


def activation_bits(mode: str, beside_float: bool = False) -> Widths:
    """A kernel mode's widths. `beside_float`: a device computes the rest in float32 (a GPU, or the
    device kernels): the default then keeps int16, so that the experts the CPU computes stay within
    the device's bound (cache on and off agree)."""
    if mode == "int8":
        return Widths(8, 8, 8)
    if mode == "fast" and not beside_float:
        return Widths(FAST_FEW_BITS, FAST_PROMPT_BITS, FAST_FEW_BITS)
    return Widths(16, 16, 16)


def describe() -> str:
    """The level in words, for `moechat inspect` and the benches."""
    capped = f", capped by {ENV}" if _cpu_level() != LEVEL else ""
    if FAST_FEW_BITS == 8:
        tiles = "; a prompt's tiles int8 too" if FAST_PROMPT_BITS == 8 else "; a prompt's tiles int16"
        fast = f"; by default decode, and a prompt's other experts, int8{tiles} (int16 beside a GPU)"
    else:
        fast = "; int16 activations"
    if AVX512:
        int8 = "vpdpbusd and pmaddubsw" if VNNI else "pmaddubsw"
        return f"AVX-512 ({'VNNI vpdpwssd' if VNNI else 'pmaddwd'} for int16, {int8} for int8){capped}{fast}"
    if AVX2:
        return f"AVX2 (pmaddwd for int16, pmaddubsw for int8){capped}{fast}"
    return f"generic vector code{capped}{fast}"
