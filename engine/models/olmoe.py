"""OLMoE: QK norms over the whole q and k projections, softmax top-k without renormalisation."""

from ..nn.activations import swiglu
from .decoder import Family

FAMILY = Family(neox_rope=True, act=swiglu)
