"""A model is built, then loaded: two steps.

The build (`models.build_model`) reads the config and the layout of the tensors (names, types,
shapes: a file's index, or one a test writes in memory) and makes every module, each weight a
`Pending` slot naming its tensor and the form it takes. The load (`load_weights`) fills the
slots from a source's bytes (the GGUF file, or tensors in memory) and then lets each module
derive what it computes from its weights (`on_load`). So a model can be built, and inspected,
without a file, and loaded from any source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..gguf.quant_types import CPU, supports
from ..gguf.reader import GGUFError
from ..gguf.sources import Layout, Source

DENSE, LINEAR, ROWS = "dense", "linear", "rows"


@dataclass(frozen=True)
class Pending:
    """A weight the load step fills: `name`'s tensor as float32 (DENSE), kept as the file's bytes
    for the CPU kernels (LINEAR: a `QLinear`), or looked up row by row (ROWS: a `QuantRows`)."""

    name: str
    form: str = DENSE


def want(layout: Layout, name: str, form: str = DENSE) -> Any:
    """A slot for tensor `name` (a one-line error if the layout lacks it).

    `LINEAR` becomes `DENSE` where no kernel reads the tensor's type (or it is not a matrix): the
    build knows then what the load makes. Typed Any: the module's attribute holds the weight once loaded.
    """
    t = layout.tensors.get(name)
    if t is None:
        raise GGUFError(f"{layout.path}: tensor '{name}' is missing")
    if form == LINEAR and not (supports(t.qtype, CPU) and len(t.shape) == 2):
        form = DENSE
    return Pending(name, form)


def maybe(layout: Layout, name: str, form: str = DENSE) -> Any:
    """`want` for an optional tensor: None when the layout has none."""
    return want(layout, name, form) if name in layout.tensors else None


def linear_form(quantized: bool) -> str:
    """The form of a matrix the kernels may read from the file's bytes (`quantized`) or as float32."""
    return LINEAR if quantized else DENSE


def load_weights(model: nn.Module, source: Source) -> None:
    """Fill every Pending slot of `model`'s modules from `source`, then call each module's `on_load(source)`
    (its submodules' first).

    A tensor two slots name alike (a tied embedding and output) is read once, and shared.
    """
    from .layers import QuantRows, load_weight
    from .qlinear import QLinear

    loaded: dict[Pending, Any] = {}
    modules = list(model.modules())
    for module in modules:
        for attr, value in list(vars(module).items()):
            if isinstance(value, Pending):
                if value not in loaded:
                    if value.form == LINEAR:
                        loaded[value] = QLinear(source.tensor_data(value.name), source.tensors[value.name].qtype)
                    elif value.form == ROWS:
                        loaded[value] = QuantRows(source, value.name)
                    else:
                        loaded[value] = load_weight(source, value.name)
                setattr(module, attr, loaded[value])
    for module in reversed(modules):  # a module's parts are loaded, and derived, before it
        hook = getattr(module, "on_load", None)
        if callable(hook):
            hook(source)


def pending(model: nn.Module) -> list[str]:
    """The tensors a built model still waits for (none once loaded)."""
    return sorted({v.name for m in model.modules() for v in vars(m).values() if isinstance(v, Pending)})
