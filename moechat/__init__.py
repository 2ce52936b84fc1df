"""moechat: chat with a local Mixture-of-Experts GGUF model whose experts live in host RAM."""

__version__ = "0.1.0"
