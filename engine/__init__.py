"""The headless core: GGUF reading, quant kernels, tokenizer, templates, model and expert cache.

Its subpackages and the rule of which may import which: docs/architecture.md (checked by
tests/test_architecture.py). Nothing in here imports textual, rich or plotext.
"""
