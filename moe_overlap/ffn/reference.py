"""References for the tensor-parallel FFN: the float64 truth of the unsplit layer, the
plain-torch TP baseline (the ``reference`` backend of ``FusedFFN`` / ``ShardedExperts`` and the fair
baseline of ``bench/bench_ffn.py``).

Layer (math layout, row-major): ``X [T, P]``, ``W1 [P, O]``, ``b1 [O]``, ``W2 [O, N]``, ``b2 [N]``::

    Y = act2(act1(X W1 + b1) W2 + b2)
      = act2(sum_g act1(X W1[:, cols_g] + b1[cols_g]) W2[rows_g, :] + b2)

with rank g of G holding the column slice ``cols_g = [g O/G, (g+1) O/G)`` of W1/b1 and the matching
row slice of W2, and the full b2.
"""
from __future__ import annotations

import torch

from ..runtime import collectives
from .activations import activation, activation_
from .parallel import copy_to_group, reduce_from_group, tracks_grad


# ---------------------------------------------------------------- float64 truth
def ffn_truth(x, w1, b1, w2, b2, act1: str, act2: str = "none") -> torch.Tensor:
    """Unsplit layer in float64 on the CPU (the truth the tests compare against)."""
    d = dict(dtype=torch.float64, device="cpu")
    h = x.to(**d) @ w1.to(**d)
    if b1 is not None:
        h = h + b1.to(**d)
    y = activation(h, act1) @ w2.to(**d)
    if b2 is not None:
        y = y + b2.to(**d)
    return activation(y, act2)


def experts_truth(x, rows_per_expert, w_in, w_out, b_in=None, b_out=None,
                  act: str = "silu") -> torch.Tensor:
    """Unsplit experts in float64: rows of expert e (contiguous in x) -> act(x W_in[e] + b_in[e])
    W_out[e] + b_out[e]; rows past sum(rows_per_expert) are zero."""
    d = dict(dtype=torch.float64, device="cpu")
    out = torch.zeros(x.shape[0], w_out.shape[2], **d)
    start = 0
    for e, n in enumerate(rows_per_expert):
        if n:
            h = x[start:start + n].to(**d) @ w_in[e].to(**d)
            if b_in is not None:
                h = h + b_in[e].to(**d)
            y = activation(h, act) @ w_out[e].to(**d)
            if b_out is not None:
                y = y + b_out[e].to(**d)
            out[start:start + n] = y
        start += n
    return out


def rel_err(a: torch.Tensor, truth: torch.Tensor) -> float:
    """Relative Frobenius error of a against truth (float64)."""
    a = a.detach().to(torch.float64).cpu()
    t = truth.detach().to(torch.float64).cpu()
    den = t.norm().item()
    num = (a - t).norm().item()
    return num / den if den > 0 else num


def tolerance(dtype: torch.dtype, hidden: int = 0) -> float:
    """Relative (Frobenius) error bound of a layer computed in ``dtype`` against the float64 truth:
    a few roundings of H and of the partial outputs (bf16 measures ~3e-3)."""
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.5e-2}.get(dtype, 1e-10)


# ---------------------------------------------------------------- plain-torch TP baseline
def ffn_tp_reference(x, w1, b1, w2, b2, act1: str, act2: str, group=None, world: int = 1,
                     rank: int = 0, out: torch.Tensor | None = None,
                     inplace: bool = True) -> torch.Tensor:
    """This rank's share of the layer, then the all-reduce: the best plain-torch TP FFN.

    Inference (autograd not recording: ``torch.no_grad()``, ``inference_mode``, or nothing
    requires grad):

    - GEMM1 with the bias fused (``addmm``), activation in place (``inplace=True``);
    - GEMM2 writes the partial; rank 0 fuses b2 into it (``addmm``), the others use ``mm``, so b2
      is added exactly once and needs no extra pass after the all-reduce;
    - one in-place ``all_reduce`` (NCCL on CUDA, gloo on CPU) of the partial in the layer's dtype,
      as Megatron-style TP does;
    - act2 in place.

    Training (grad mode on and any of x / weights requiring grad): the same GEMMs with
    out-of-place activations, X through ``copy_to_group`` (all-reduce of dX in backward) and the
    partial through ``reduce_from_group`` (all-reduce in forward, identity in backward), b2 added
    after the reduce on every rank, so every rank gets the full gradient of x and b2 and the exact
    gradient of its slices. Assumes the upstream gradient dY is the same on every rank (see
    ``moe_overlap.ffn.parallel``). ``out=`` is refused there (out= ops are not differentiable).

    ``w1 [P, O/G]``, ``b1 [O/G]`` (or None), ``w2 [O/G, N]``, ``b2 [N]`` (or None)."""
    if tracks_grad(x, w1, b1, w2, b2):
        if out is not None:
            raise ValueError("ffn_tp_reference: out= cannot be used while autograd records "
                             "(grad mode on and an input requires grad)")
        if world > 1:
            x = copy_to_group(x, group)
        h = torch.addmm(b1, x, w1) if b1 is not None else torch.mm(x, w1)
        h = activation(h, act1)
        y = torch.mm(h, w2)
        if world > 1:
            y = reduce_from_group(y, group)
        if b2 is not None:
            y = y + b2
        return activation(y, act2)
    h = torch.addmm(b1, x, w1) if b1 is not None else torch.mm(x, w1)
    act = activation_ if inplace else activation
    h = act(h, act1)
    if b2 is not None and rank == 0:
        y = torch.addmm(b2, h, w2, out=out) if out is not None else torch.addmm(b2, h, w2)
    else:
        y = torch.mm(h, w2, out=out) if out is not None else torch.mm(h, w2)
    if world > 1:
        collectives.all_reduce(y, group=group)
    return act(y, act2)


def experts_tp_reference(x, rows_per_expert, w_in, w_out, b_in, b_out, act: str, group=None,
                         world: int = 1, rank: int = 0, inplace: bool = True) -> torch.Tensor:
    """Sharded experts, plain torch: per-expert GEMM pair on this rank's slices into one output
    buffer, one all-reduce. ``w_in [E, P, O/G]``, ``w_out [E, O/G, N]``.

    Inference (autograd not recording): in-place activations (``inplace=True``), GEMM2 written
    straight into the output rows, ``b_out`` fused into rank 0's addmm, one in-place all-reduce.
    Training: as ``ffn_tp_reference`` (``copy_to_group`` on x, ``reduce_from_group`` on the
    stacked partials, ``b_out[e]`` added to expert e's rows after the reduce on every rank; the
    same assumption on dY). Rows past ``sum(rows_per_expert)`` are zero and get zero gradient."""
    if tracks_grad(x, w_in, w_out, b_in, b_out):
        return _experts_tp_autograd(x, rows_per_expert, w_in, w_out, b_in, b_out, act, group,
                                    world)
    y = torch.empty(x.shape[0], w_out.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(rows_per_expert):
        if n:
            xe = x[start:start + n]
            h = torch.addmm(b_in[e], xe, w_in[e]) if b_in is not None else torch.mm(xe, w_in[e])
            h = activation_(h, act) if inplace else activation(h, act)
            ye = y[start:start + n]
            if b_out is not None and rank == 0:
                torch.addmm(b_out[e], h, w_out[e], out=ye)
            else:
                torch.mm(h, w_out[e], out=ye)
        start += n
    if start < x.shape[0]:
        y[start:].zero_()
    if world > 1:
        collectives.all_reduce(y, group=group)
    return y


def _experts_tp_autograd(x, rows_per_expert, w_in, w_out, b_in, b_out, act, group, world):
    """experts_tp_reference while autograd records (out-of-place throughout)."""
    R, N = x.shape[0], w_out.shape[2]
    if world > 1:
        x = copy_to_group(x, group)
    parts, biases, start = [], [], 0
    for e, n in enumerate(rows_per_expert):
        if n:
            xe = x[start:start + n]
            h = torch.addmm(b_in[e], xe, w_in[e]) if b_in is not None else torch.mm(xe, w_in[e])
            parts.append(torch.mm(activation(h, act), w_out[e]))
            if b_out is not None:
                biases.append(b_out[e].expand(n, N))
        start += n
    tail = R - start
    if tail:
        parts.append(x.new_zeros(tail, N))
        biases.append(x.new_zeros(tail, N))
    if not parts:
        return x.new_zeros(R, N)
    y = torch.cat(parts) if len(parts) > 1 else parts[0]
    if world > 1:
        y = reduce_from_group(y, group)
    if b_out is not None:
        y = y + torch.cat(biases)
    return y
