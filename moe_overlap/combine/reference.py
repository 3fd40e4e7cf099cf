"""Reference paths: the truth the tests and benchmarks compare against.

- `sequential_dispatch` / `sequential_combine`: the seed's sequential baseline, written without the
  plan: all_to_all_single, grouped matmul, all_to_all_single back, top-k weighted sum. Its expert
  inputs use the *compact* layout: local expert major, then source rank ascending, then the order the
  source sent them (token, then k), no padding.
- `reference_combine`: executes a `CombinePlan` (segments, local cells, destination rows) with torch ops
  and one process-group exchange; this is MoECombine's `reference` backend on CPU and GPU.
"""
from __future__ import annotations

import torch

from ..runtime import collectives
from .checks import world  # noqa: F401  (re-exported: callers import it from here)
from .plan import CombinePlan, recv_rows


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group=None):
    """all_to_all_single that also works without a process group (world size 1). No autograd:
    see `exchange`."""
    if world(group)[1] == 1:
        out.copy_(inp)
        return out
    collectives.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """all_to_all_single whose backward sends the output's gradient back the way it came (the
    same exchange with the splits swapped). Collective in backward too: every rank of the group
    must run the backward. backward_check(grad_out), if given, runs first (the caller's
    agreement across ranks, so a rank that skipped the backward is named)."""

    @staticmethod
    def forward(ctx, inp, out_splits, in_splits, group, zero_rows, backward_check):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        ctx.backward_check = backward_check
        n = sum(out_splits)
        out = inp.new_empty(n + zero_rows, *inp.shape[1:])
        out[n:].zero_()
        all_to_all(out[:n], inp.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.backward_check is not None:
            ctx.backward_check(grad_out)
        grad_in = grad_out.new_empty(sum(ctx.in_splits), *grad_out.shape[1:])
        all_to_all(grad_in, grad_out[:sum(ctx.out_splits)].contiguous(), ctx.in_splits,
                   ctx.out_splits, ctx.group)
        return grad_in, None, None, None, None, None


def exchange(inp: torch.Tensor, out_splits, in_splits, group=None,
             zero_rows: int = 0, backward_check=None) -> torch.Tensor:
    """all_to_all_single of the rows of inp (in_splits rows to each rank, out_splits rows from
    each rank), differentiable: gradients of the result flow back to inp across the ranks.
    zero_rows: that many zero rows after the received ones (no gradient flows from them).
    backward_check: called with the gradient at the start of the backward, on every rank (a
    validated caller's agreement, e.g. `checks.agree_on_call`)."""
    out_splits = [int(n) for n in out_splits]
    in_splits = [int(n) for n in in_splits]
    if sum(in_splits) != inp.shape[0]:
        raise ValueError(f"exchange: in_splits sum to {sum(in_splits)}, input has "
                         f"{inp.shape[0]} rows")
    return _Exchange.apply(inp, out_splits, in_splits, group, int(zero_rows), backward_check)


def all_gather_counts(local_counts: torch.Tensor, group=None) -> torch.Tensor:
    """[W, E] matrix of every rank's per-expert assignment counts."""
    _, W = world(group)
    if W == 1:
        return local_counts.unsqueeze(0).clone()
    parts = [torch.empty_like(local_counts) for _ in range(W)]
    collectives.all_gather(parts, local_counts.contiguous(), group=group)
    return torch.stack(parts)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or float64 for float64 data."""
    return torch.promote_types(dtype, torch.float32)


def expert_matmul(h_e: torch.Tensor, w_e: torch.Tensor) -> torch.Tensor:
    """h_e @ w_e with fp32 accumulation (float64 for float64), rounded to h's dtype (as the GPU
    kernels do)."""
    if h_e.is_cuda and h_e.dtype in (torch.bfloat16, torch.float16):
        return h_e @ w_e  # cuBLAS accumulates in fp32
    acc = _acc(h_e.dtype)
    return (h_e.to(acc) @ w_e.to(acc)).to(h_e.dtype)


def grouped_matmul(h: torch.Tensor, w: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
    """Stacked per-expert products: rows of expert e times w[e], experts contiguous in h.
    Experts with no rows too: their empty products keep the result in the autograd graph of w
    on a rank that has no rows at all (its exchanges' backward is collective)."""
    out = torch.empty(h.shape[0], w.shape[2], dtype=h.dtype, device=h.device)
    start = 0
    for e, n in enumerate(rows_per_expert):
        out[start:start + n] = expert_matmul(h[start:start + n], w[e])
        start += n
    if start < h.shape[0]:
        out[start:] = 0
    return out


def weighted_sum(recv: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * recv[rows[t, k]], in fp32 (float64 for float64 data)."""
    T, k = rows.shape
    acc = _acc(recv.dtype)
    gathered = recv.index_select(0, rows.reshape(-1)).to(acc).view(T, k, recv.shape[1])
    return (gathered * topk_weights.to(acc).unsqueeze(-1)).sum(1).to(out_dtype)


# ---------------------------------------------------------------- sequential baseline
def sequential_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, group=None):
    """Send each (token, k) row of x to its expert's owner.

    Returns (x_compact [R, K], expert_counts [W, E]); x_compact is in the compact layout."""
    rank, W = world(group)
    El = num_experts // W
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by global expert, then token, then k
    send = x.index_select(0, order // k)
    local_counts = torch.bincount(flat, minlength=num_experts)
    counts = all_gather_counts(local_counts, group)
    counts_h = counts.tolist()
    in_splits = [sum(counts_h[rank][r * El:(r + 1) * El]) for r in range(W)]
    out_splits = [sum(counts_h[s][rank * El:(rank + 1) * El]) for s in range(W)]
    recv = exchange(send, out_splits, in_splits, group)
    # source-major -> expert-major (compact layout)
    perm = source_to_expert_major(counts_h, rank, El)
    return recv.index_select(0, torch.tensor(perm, device=x.device, dtype=torch.long)), counts


def source_to_expert_major(counts_h, rank, El) -> list[int]:
    """perm such that compact[i] = source_major[perm[i]]."""
    W = len(counts_h)
    src_off = {}
    off = 0
    for s in range(W):
        for e in range(El):
            src_off[s, e] = off
            off += counts_h[s][rank * El + e]
    perm = []
    for e in range(El):
        for s in range(W):
            o = src_off[s, e]
            perm.extend(range(o, o + counts_h[s][rank * El + e]))
    return perm


def sequential_combine(h_compact: torch.Tensor, w_down: torch.Tensor, expert_counts: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor, group=None) -> torch.Tensor:
    """Baseline combine: grouped matmul, all_to_all_single back to the token owners, weighted sum."""
    rank, W = world(group)
    E = expert_counts.shape[1]
    El = E // W
    counts_h = expert_counts.tolist()
    rows_e = [sum(counts_h[s][rank * El + e] for s in range(W)) for e in range(El)]
    y = grouped_matmul(h_compact, w_down, rows_e)
    perm = source_to_expert_major(counts_h, rank, El)
    inv = torch.empty(len(perm), dtype=torch.long, device=y.device)
    inv[torch.tensor(perm, dtype=torch.long, device=y.device)] = torch.arange(
        len(perm), device=y.device)
    send = y.index_select(0, inv)  # back to source-major
    in_splits = [sum(counts_h[s][rank * El:(rank + 1) * El]) for s in range(W)]
    out_splits = [sum(counts_h[rank][r * El:(r + 1) * El]) for r in range(W)]
    recv = exchange(send, out_splits, in_splits, group)
    # recv is ordered by global expert, then token, then k: invert that stable sort
    T, k = topk_ids.shape
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device)
    return weighted_sum(recv, rows.view(T, k), topk_weights, h_compact.dtype)


# ---------------------------------------------------------------- plan executor
def reference_combine(h: torch.Tensor, w_down: torch.Tensor, plan: CombinePlan,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, group=None,
                      backward_check=None) -> torch.Tensor:
    """Execute the plan with torch ops: per-expert GEMM, the remote segments and the local cells
    into per-rank send buffers at their destination rows (as the consumer ships them), one
    all_to_all, weighted sum at the token owners. backward_check: see `exchange`."""
    rank, W = plan.rank, plan.world_size
    dev = h.device
    y = grouped_matmul(h[: int(plan.total_rows.item())], w_down, plan.expert_rows.tolist())
    ns, nl = plan.counts()[2], int(plan.num_local_cells.item())
    seg = {k: getattr(plan, "segment_" + k)[:ns].tolist() for k in
           ("dest", "src_row", "dest_row", "rows")}
    loc = {k: getattr(plan, "local_cell_" + k)[:nl].tolist() for k in
           ("src_row", "dest_row", "rows")}
    pieces = list(zip(seg["dest"], seg["src_row"], seg["dest_row"], seg["rows"])) + \
        [(rank, s, d, n) for s, d, n in zip(loc["src_row"], loc["dest_row"], loc["rows"])]
    # rows this rank sends to each destination and where they start in its receive buffer
    send_rows = [0] * W
    base = [None] * W
    for d, _, row, n in pieces:
        send_rows[d] += n
        base[d] = row if base[d] is None else min(base[d], row)
    send_off = [sum(send_rows[:d]) for d in range(W)]
    # the send buffers as a gather of y's rows: in y's autograd graph also when empty (a rank
    # that ships nothing still takes part in the exchange's collective backward)
    src = torch.zeros(sum(send_rows), dtype=torch.long, device=dev)
    written = torch.zeros(src.shape[0], dtype=torch.int32, device=dev)
    for d, src_row, dest_row, n in pieces:
        at = send_off[d] + dest_row - base[d]
        src[at:at + n] = torch.arange(src_row, src_row + n, device=dev)
        written[at:at + n] += 1
    if not bool((written == 1).all()):
        raise RuntimeError(f"rank {rank}: the plan's destination rows do not cover the send "
                           "buffers exactly once")
    send = y.index_select(0, src)
    # receive: from owner r, my assignments to r's experts (a contiguous block of my buffer)
    owner = topk_ids.reshape(-1) // plan.experts_per_rank
    recv_splits = torch.bincount(owner, minlength=W).tolist()
    recv = exchange(send, recv_splits, send_rows, group, backward_check=backward_check)
    return weighted_sum(recv, recv_rows(topk_ids, plan.num_experts), topk_weights, h.dtype)
