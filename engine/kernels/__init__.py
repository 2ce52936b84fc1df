"""Compiled code: the quant blocks' vector code, the CPU kernels (numba), the device kernels (Triton). No model code."""
