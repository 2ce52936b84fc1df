"""GLM-4.5 / 4.6 / 4.7 (glm4moe): GLM's MoE decoder.

Its quirks, all read from the file: biased q/k/v projections; rotary embedding on the first half
of each head (`rope.dimension_count`), halves rotated (NeoX); per-head QK norms in some sizes;
leading dense layers (their FFN has no router); sigmoid routing where a per-expert correction
bias steers the choice but not the weights, renormalised and scaled (`expert_weights_scale`); a
shared expert added without a gate; the pre-FFN norm named `post_attention_norm`. Trailing
NextN/MTP blocks (`nextn_predict_layers`) are neither run nor loaded, nor cached.
"""

from ..nn.activations import swiglu
from .decoder import Family

FAMILY = Family(neox_rope=True, act=swiglu, ffn_norm="post_attention_norm")
