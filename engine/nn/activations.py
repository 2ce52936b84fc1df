"""The gated activations between an FFN's gate/up and down, and which of them the compiled kernels apply.

A model registers each activation it uses with its kernel code (`codes.ACT_*`); an FFN whose
activation has a code runs in the kernels, any other on the exact torch path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels.codes import ACT_SILU

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_ACTS: dict[Callable[..., object], int] = {}


def register_activation(fn: Callable[..., object], code: int) -> None:
    """Declare that the kernels compute activation `fn` as `cpu_kernels.ACT_*` code `code`."""
    _ACTS[fn] = code


def activation_code(fn: Callable[..., object]) -> int | None:
    return _ACTS.get(fn)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


register_activation(swiglu, ACT_SILU)
