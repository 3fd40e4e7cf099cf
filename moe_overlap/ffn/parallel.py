"""Autograd-aware collectives of the tensor-parallel FFN (Megatron's conjugate pair ``f`` / ``g``).

The layer is ``Y = sum_r f_r(X)`` with X replicated on every rank r of the group and f_r this
rank's column-parallel GEMM1 + activation + row-parallel GEMM2. Its backward needs two collectives
that the forward alone does not show:

- ``copy_to_group`` (Megatron's ``f``), applied to X before GEMM1: identity in forward; in backward
  the all-reduce (SUM) of dX, since ``dL/dX = sum_r (df_r/dX)^T dY`` and rank r only knows its own
  term.
- ``reduce_from_group`` (Megatron's ``g``), applied to the partial output after GEMM2: all-reduce
  (SUM) in forward; identity in backward, since each partial enters the sum linearly.

Both assume what Megatron assumes: the upstream gradient dY is the same on every rank (the loss is
computed from the replicated Y identically on every rank, as any replicated continuation of the
network does). If each rank instead backpropagates a different dY, the gradients are wrong.

Every rank of the group must run the backward too (the all-reduce of dX is collective), which it
does when the forward was collective and X requires grad on every rank alike.
"""
from __future__ import annotations

import torch

from ..runtime import collectives


def tracks_grad(*tensors) -> bool:
    """True when autograd records an op on these tensors: grad mode on and any of them (None
    allowed) requires grad. Inference mode turns grad mode off, so it is False there."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # a private contiguous copy: the collective works in place, and the incoming gradient
        # may be shared with another branch of the graph
        g = grad.clone(memory_format=torch.contiguous_format)
        collectives.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        if partial.is_contiguous():
            # in place (no extra [T, N] buffer); mark_dirty makes autograd raise, rather than
            # compute garbage, if another op saved the partial for its backward
            collectives.all_reduce(partial, group=group)
            ctx.mark_dirty(partial)
            return partial
        y = partial.contiguous()  # a copy: the collective needs dense memory
        collectives.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce (SUM) of the gradient over ``group`` in backward. Apply to the
    replicated input of a column-parallel GEMM (see the module docstring for the dY assumption)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(partial: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (SUM) over ``group`` in forward (in place where ``partial`` is contiguous),
    identity in backward. Apply to the partial output of a row-parallel GEMM; add a replicated
    bias after it, on every rank, so its gradient is the full one on every rank."""
    return _ReduceFromGroup.apply(partial, group)
