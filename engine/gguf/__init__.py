"""The GGUF file: its reader, the protocols a model is read from, the quant types and their torch dequantizers."""
