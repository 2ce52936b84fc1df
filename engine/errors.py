"""Errors the engine raises for a value it cannot use, said in the engine's own words.

The engine knows its parameters (a `CacheSettings` field, an argument of `load_model` or
`set_threads`), not the flags, variables or config keys a front end sets them with: an error
names the parameter, and the front end says which of its settings that was (app/settings.py).
"""

from __future__ import annotations


class ParameterError(ValueError):
    """`parameter`'s value cannot work; `suggestion`, where there is one, is a value that would."""

    def __init__(self, parameter: str, message: str, suggestion: float | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.suggestion = suggestion
