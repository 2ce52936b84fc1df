"""The non-linear 4-bit code books of GGUF's quant types, written once for every path that decodes them
(the torch dequantizer, the CPU kernels' block code, the device kernels)."""

from __future__ import annotations

# IQ4_NL and IQ4_XS: a 4-bit index picks one of these, times the block's scale.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4: e2m1 codes, doubled so that they are integers (the scale is halved to match).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
