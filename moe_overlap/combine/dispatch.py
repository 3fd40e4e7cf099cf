"""Reference dispatch: deliver each rank's expert inputs already in the plan layout."""
from __future__ import annotations

import torch

from ..kernels.host_checks import require_tensors
from .checks import (agree_on_call, as_int, backward_agreement, check_routing_matches,
                     error_of)
from .plan import CombinePlan, count_assignments
from .reference import all_gather_counts, exchange, world


def exchange_counts(topk_ids: torch.Tensor, num_experts: int, group=None,
                    validate: bool = True, comm_buffer=None,
                    timeout_s: float = 10.0) -> torch.Tensor:
    """All-gather the routing counts: [W, E], entry [s, e] = assignments rank s sends to expert e.

    Collective. Ids outside [0, num_experts) raise ValueError on every rank, naming the rank and
    the bad id, and ranks with another num_experts (or device type) raise RankMismatchError
    naming them, before the counts are exchanged (validate=False: no check, no extra collective
    and no host synchronization; the caller vouches for the ids: ids outside [0, num_experts)
    are not counted).

    comm_buffer: None (the reference: a host all-gather through the process group, which a
    CUDA graph captures only on NCCL) or a ``CommBuffer`` of this group with a counts table
    (``CommBuffer.exchange_counts``: the counts all-gathered on the device through its
    symmetric memory, bitwise the same result; with validate=False no host collective at all,
    so the call is captured on any process group). validate=True keeps its host checks and
    agreement first either way. timeout_s: the device exchange's bounded wait for each rank's
    counts."""
    if comm_buffer is not None and comm_buffer.group is not group:
        raise ValueError("comm_buffer must be a CommBuffer of this process group")
    if not validate:
        local = _count_unchecked(topk_ids, num_experts)
        if comm_buffer is not None:
            return comm_buffer.exchange_counts(local, timeout_s)
        return all_gather_counts(local, group)
    result = {}

    def local():
        n = as_int("num_experts", num_experts, minimum=1)
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be a [tokens, topk] tensor, got "
                             f"{getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
        result["counts"] = count_assignments(topk_ids, n)
        result["fields"] = {"num_experts": n, "device type": topk_ids.device.type}

    err = error_of(local)
    agree_on_call("exchange_counts", result.get("fields"), err, group)
    if comm_buffer is not None:
        return comm_buffer.exchange_counts(result["counts"].to(torch.int64), timeout_s)
    return all_gather_counts(result["counts"], group)


def _count_unchecked(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 counts by a scatter-add into E + 1 bins, the last one taking the ids outside
    [0, E) (torch.bincount reads its maximum on the host, which a CUDA graph cannot capture)."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    idx = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    bins = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    return bins.scatter_add_(0, idx, torch.ones_like(idx))[:num_experts]


def _check_dispatch(x, topk_ids, plan, expert_counts, group, rows):
    rank, W = world(group)
    if not isinstance(plan, CombinePlan):
        raise TypeError(f"plan must be a CombinePlan, got {type(plan).__name__}")
    if (rank, W) != (plan.rank, plan.world_size):
        raise ValueError(f"plan is for rank {plan.rank} of {plan.world_size}, process group is "
                         f"rank {rank} of {W}")
    require_tensors(dict(x=x, topk_ids=topk_ids, expert_counts=expert_counts))
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, topk], got {tuple(topk_ids.shape)}")
    if x.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"x must be [tokens={topk_ids.shape[0]}, features] like topk_ids, got "
                         f"{tuple(x.shape)}")
    E = plan.num_experts
    if tuple(expert_counts.shape) != (W, E):
        raise ValueError(f"expert_counts has shape {tuple(expert_counts.shape)}, expected "
                         f"[{W}, {E}]")
    mine = count_assignments(topk_ids, E)
    check_routing_matches(mine, expert_counts[rank], f"expert_counts[{rank}]",
                          "counts from another routing?")
    made_from = plan.source_counts
    if made_from is not None and (tuple(made_from.shape) != tuple(expert_counts.shape) or not
                                  torch.equal(made_from.to(expert_counts.device, torch.int64),
                                              expert_counts.to(torch.int64))):
        raise ValueError("the plan was made from other counts than expert_counts (a plan of "
                         "another step?)")
    if rows is not None:
        need = int(plan.total_rows.item())
        if as_int("rows", rows) < need:
            raise ValueError(f"rows={rows} < the plan's {need} rows")
    # what every rank must pass alike; the counts are agreed on separately (routing)
    return mine, {"num_experts": E, "x features (K)": x.shape[1], "x dtype": x.dtype,
                  "device type": x.device.type,
                  "autograd (backward is collective)": torch.is_grad_enabled() and
                  x.requires_grad}


def plan_gather_index(plan: CombinePlan, expert_counts: torch.Tensor, rank: int, n_recv: int,
                      rows: int) -> torch.Tensor:
    """The received row each plan row reads, int64 [rows]: the dispatch's received rows
    (source-major, then this rank's local expert, then arrival order; n_recv of them, the
    exchange's split sizes summed) at their plan rows, and n_recv (the zero row placed after
    the received ones) at every padding row. It needs only the counts and the plan, so a layer
    can make it beside the exchange (bench/bench_moe_layer.py does, on the plan's side stream);
    the placement is then one ``recv.index_select(0, index)``.

    expert_counts: [W, E] int, every rank's routing counts (the plan's). Device-only (n_recv
    and rows from the host, so no sync)."""
    El = plan.experts_per_rank
    dev = plan.expert_row_start.device
    local = expert_counts[:, rank * El:(rank + 1) * El].to(dev, torch.int64)  # [W, El]
    n = local.reshape(-1)
    block_start = torch.cumsum(n, 0) - n
    blk = torch.repeat_interleave(torch.arange(n.numel(), device=dev), n, output_size=n_recv)
    j = torch.arange(n_recv, device=dev) - block_start[blk]
    s, e = blk // El, blk % El
    dest = plan.expert_row_start.long()[e] + plan.group_row_start.long()[e, s] + j
    # a gather (every plan row reads its received row or the zero row): a scatter of the rows
    # into a zeroed buffer is a zero fill plus an indexed write, several times one
    # permutation's time on the GPU (bench/NOTES.md, the row placement)
    src = torch.full((rows,), n_recv, dtype=torch.long, device=dev)
    src.index_copy_(0, dest, torch.arange(n_recv, device=dev))
    return src


def dispatch_to_plan(x: torch.Tensor, topk_ids: torch.Tensor, plan: CombinePlan,
                     expert_counts: torch.Tensor, group=None, rows: int | None = None,
                     validate: bool = True) -> torch.Tensor:
    """all_to_all_single the (token, k) rows of x to their experts' owners and place them in the
    plan layout: [rows, K], padding rows zero. rows defaults to the plan's padded row count.

    Collective and differentiable (the gradient of the result flows back to x; backward is
    collective too). validate: check shapes, expert ids, that topk_ids match this rank's row
    of expert_counts and that the plan was made from expert_counts, agreed over the group first
    together with the call, K, the dtype and the whole counts matrix (every rank's row must be
    that rank's counts of its topk_ids), so bad or mismatching input on one rank raises on every
    rank (naming that rank) instead of leaving the others in the exchange; the backward agrees
    too. validate=False: the caller vouches for all of that."""
    if validate:
        result = {}

        def check():
            result["row"], result["fields"] = _check_dispatch(x, topk_ids, plan, expert_counts,
                                                              group, rows)

        err = error_of(check)
        agree_on_call("dispatch_to_plan", result.get("fields"), err, group,
                      routing=None if err else (result["row"], expert_counts, "expert_counts"))
    rank, W = world(group)
    El = plan.experts_per_rank
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, then token, then k
    send = x.index_select(0, order // k)
    counts = expert_counts.to(torch.int64)
    # the split sizes (and, without rows, the plan's row count) in one device-to-host copy
    host = torch.cat([counts.reshape(-1), plan.total_rows.to(counts.device, torch.int64)]
                     if rows is None else [counts.reshape(-1)]).tolist()
    counts_h = [host[i * counts.shape[1]:(i + 1) * counts.shape[1]] for i in range(W)]
    in_splits = [sum(counts_h[rank][r * El:(r + 1) * El]) for r in range(W)]
    out_splits = [sum(counts_h[s][rank * El:(rank + 1) * El]) for s in range(W)]
    n_recv = sum(out_splits)
    # one zero row after the received ones: the source of the plan's padding rows
    recv = exchange(send, out_splits, in_splits, group, zero_rows=1,
                    backward_check=backward_agreement("backward of dispatch_to_plan", group)
                    if validate else None)
    if rows is None:
        rows = host[-1]
    src = plan_gather_index(plan, counts, rank, n_recv, int(rows))
    return recv.index_select(0, src)
