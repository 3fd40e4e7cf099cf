"""Host-side argument checks shared by the kernels' wrappers (run before any launch, on any
machine: torch only, no CuTe DSL)."""
from __future__ import annotations

import torch


def require_tensors(tensors: dict) -> None:
    """Every value a torch.Tensor; TypeError naming the first argument that is not."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_tensors(tensors: dict, like: torch.Tensor, need_cuda: bool) -> None:
    """Every value a contiguous torch.Tensor on ``like``'s device (a CUDA one if need_cuda);
    TypeError / ValueError naming the argument otherwise."""
    require_tensors(tensors)
    for name, t in tensors.items():
        if need_cuda and t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device}, x on {like.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def chained_gemm_dims(x: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor) -> tuple[int, int, int, int]:
    """(M, P, hidden, N) of x [M, P] @ w1 [P, hidden] -> @ w2 [hidden, N] (the FFN kernels'
    operands); ValueError on a rank or size mismatch or an empty x."""
    if x.dim() != 2 or w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(f"expected x [M, P], w1 [P, hidden], w2 [hidden, N]; got "
                         f"{tuple(x.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}")
    M, P = x.shape
    Pw, hidden = w1.shape
    hw, N = w2.shape
    if M < 1:
        raise ValueError("x needs at least one row")
    if Pw != P:
        raise ValueError(f"P mismatch: x has P={P}, w1 has {Pw} rows")
    if hw != hidden:
        raise ValueError(f"hidden mismatch: w1 has {hidden} columns, w2 has {hw} rows")
    return M, P, hidden, N
