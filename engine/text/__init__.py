"""Text: tokenizers from GGUF metadata, and chat templates in a Jinja sandbox."""
