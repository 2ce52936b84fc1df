"""Qwen MoE: qwen3moe (per-head QK norm, normalised top-k) and qwen2moe (biases, shared expert, sigmoid gate)."""

from ..moe import swiglu
from .decoder import Family

FAMILY = Family(neox_rope=True, act=swiglu)
