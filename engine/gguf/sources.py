"""What a model is read from: the protocols a GGUF file and a model held in memory both meet."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .reader import TensorInfo


class Layout(Protocol):
    """What a build reads: the tensors' names, types and shapes, and a name for messages."""

    @property
    def path(self) -> Path | str: ...

    @property
    def tensors(self) -> Mapping[str, TensorInfo]: ...


class Source(Layout, Protocol):
    """What a load reads: a layout and each tensor's bytes, shaped [..., row_bytes]."""

    def tensor_data(self, name: str) -> np.ndarray: ...


class ModelFile(Source, Protocol):
    """A GGUF file, or a model in memory that reads as one: metadata, architecture, tensors."""

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def architecture(self) -> str: ...
