"""Building blocks of a model: weights and their forms, quantized linear layers, norms, rotary, attention, KV cache."""
