"""Reference dispatch: deliver each rank's expert inputs already in the plan layout."""
from __future__ import annotations

import torch

from .plan import CombinePlan, count_assignments
from .reference import all_gather_counts, all_to_all, world


def exchange_counts(topk_ids: torch.Tensor, num_experts: int, group=None) -> torch.Tensor:
    """All-gather the routing counts: [W, E], entry [s, e] = assignments rank s sends to expert e."""
    return all_gather_counts(count_assignments(topk_ids, num_experts), group)


def dispatch_to_plan(x: torch.Tensor, topk_ids: torch.Tensor, plan: CombinePlan,
                     expert_counts: torch.Tensor, group=None, rows: int | None = None) -> torch.Tensor:
    """all_to_all_single the (token, k) rows of x to their experts' owners and place them in the
    plan layout: [rows, K], padding rows zero. rows defaults to the plan's padded row count."""
    rank, W = world(group)
    if (rank, W) != (plan.rank, plan.world_size):
        raise ValueError(f"plan is for rank {plan.rank} of {plan.world_size}, process group is "
                         f"rank {rank} of {W}")
    E, El = plan.num_experts, plan.experts_per_rank
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, then token, then k
    send = x.index_select(0, order // k)
    counts = expert_counts.to(torch.int64)
    counts_h = counts.tolist()
    in_splits = [sum(counts_h[rank][r * El:(r + 1) * El]) for r in range(W)]
    out_splits = [sum(counts_h[s][rank * El:(rank + 1) * El]) for s in range(W)]
    recv = torch.empty(sum(out_splits), x.shape[1], dtype=x.dtype, device=x.device)
    all_to_all(recv, send, out_splits, in_splits, group)
    # destination row of every received row: source-major, then local expert, then arrival order
    local = counts[:, rank * El:(rank + 1) * El]  # [W, El]
    n = local.reshape(-1)
    block_start = torch.cumsum(n, 0) - n
    blk = torch.repeat_interleave(torch.arange(n.numel(), device=x.device), n)
    j = torch.arange(blk.numel(), device=x.device) - block_start[blk]
    s, e = blk // El, blk % El
    dest = (plan.expert_row_start.long()[e] + plan.group_row_start.long()[e, s] + j)
    if rows is None:
        rows = int(plan.total_rows.item())
    out = torch.zeros(rows, x.shape[1], dtype=x.dtype, device=x.device)
    out[dest] = recv
    return out
