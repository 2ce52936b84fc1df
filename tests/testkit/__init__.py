"""Helpers that write the test suite's own GGUF files and vocabularies."""
