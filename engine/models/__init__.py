"""One module per architecture family."""
