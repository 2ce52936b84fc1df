"""The headless core: GGUF reading, quant kernels, tokenizer, templates, model and expert cache.

Nothing in here imports textual, rich or plotext.
"""
