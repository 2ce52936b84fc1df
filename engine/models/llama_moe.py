"""Llama, dense or with experts (Mixtral): GGUF stores q/k permuted for adjacent-pair rotary
embeddings, and Mixtral's files leave implicit that its routers renormalise the top-k weights."""

from ..nn.activations import swiglu
from .decoder import Family

FAMILY = Family(neox_rope=False, act=swiglu, metadata={"expert_weights_norm": True})
