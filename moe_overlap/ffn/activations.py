"""Activation functions of the FFN layers by name (act1; act2 also takes "none"), in torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")  # act1; act2 also takes "none"
ACT2 = ("none",) + ACTIVATIONS


def check_activation(name, *, allow_none: bool, what: str) -> str:
    """Normalize an activation name (None -> "none" when allowed); raises ValueError otherwise."""
    if name is None and allow_none:
        return "none"
    choices = ACT2 if allow_none else ACTIVATIONS
    if not isinstance(name, str) or name not in choices:
        raise ValueError(f"{what}={name!r}: choose from {choices}")
    return name


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """Out-of-place activation (any dtype, float64 included)."""
    if name == "none":
        return x
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {name!r}")


def activation_(x: torch.Tensor, name: str) -> torch.Tensor:
    """In place (``x`` is overwritten and returned): the same elementwise kernels as
    ``activation`` writing into their input, so the results are bitwise the same and a
    baseline's peak memory holds H once, not H and its activated copy. Not for tensors that
    autograd saves (the callers use ``activation`` while it records)."""
    if name == "none":
        return x
    if name == "relu":
        return F.relu_(x)
    if name == "silu":
        return F.silu(x, inplace=True)
    if name == "gelu":  # F.gelu has no inplace flag; aten's in-place overload is the same kernel
        return torch.ops.aten.gelu_(x)
    if name == "gelu_tanh":
        return torch.ops.aten.gelu_(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")
