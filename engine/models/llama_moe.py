"""Llama with experts (Mixtral): GGUF stores q/k permuted for adjacent-pair rotary embeddings."""

from ..moe import swiglu
from .decoder import Family

FAMILY = Family(neox_rope=False, act=swiglu)
