"""Qwen MoE and dense Qwen: qwen3moe (per-head QK norms, renormalised top-k weights), qwen2moe
(q/k/v biases, a shared expert behind a sigmoid gate, top-k weights as the softmax gives them),
and the dense qwen3 and qwen2 on the same decoder. The features come from the tensors a file
holds; what the files leave implicit is the renormalisation, which Qwen3's routers do."""

from ..nn.activations import swiglu
from .decoder import Family

QWEN2 = Family(neox_rope=True, act=swiglu)
QWEN3 = Family(neox_rope=True, act=swiglu, metadata={"expert_weights_norm": True})
