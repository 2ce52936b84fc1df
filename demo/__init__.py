"""The demo models: built on first use from a small public GGUF and a recipe in assets/ (not engine code)."""
