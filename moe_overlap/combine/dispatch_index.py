"""The overlapped dispatch's receive-slot layout and a host mirror of its index math (pure torch,
no CuTe DSL): what dispatch_send.py and dispatch_expand.py compute on the device, step by step in
the kernels' order, so the design can be checked against `MoEDispatch`'s reference on any
machine (tests/test_dispatch_index_cpu.py).

Receive slot of one call on owner rank d (one of the CommBuffer's two slots, parity epoch & 1),
bytes from the slot's start, for W sources, T_max = max_tokens_per_rank, D columns of bf16 and
top-k ids:

- token rows: source s's i-th token at ``(s * T_max + i) * D * 2`` (row i < n_s),
- ids rows: its top-k ids (int32) at ``ids_offset + (s * T_max + i) * k * 4``,
- counts: n_s (int32) at ``count_offset + s * 4``: the tokens source s sent to d this call.

Send (per source): token t goes to every rank d owning any of its top-k experts (ids in
[0, E); others are ignored), at row i = the number of tokens t' < t that also go to d (token
order, compacted per destination). The kernel walks the tokens in batches of NT (a thread per
token): per-warp ballots of "goes to d", their popcounts summed over the warps before, plus the
running count of the earlier batches.

Expand (per owner): for each local expert e (global g = rank * El + e) and source s, the
(i, j) with ids[s, i, j] == g in (i, j) order make the rows ``expert_row_start[e] +
group_row_start[e, s] + 0, 1, ...`` (`dispatch_to_plan`'s layout); every other row of
[0, rows) is zero: per group, the gap from its end to the next non-empty group's start (or its
expert's end, ``expert_row_start[e] + expert_rows[e]``), the gap before an expert's first
group, and [total_rows, rows).
"""
from __future__ import annotations

import torch


def _up16(n: int) -> int:
    return (n + 15) // 16 * 16


def slot_layout(world_size: int, max_tokens_per_rank: int, hidden: int, topk: int) -> dict:
    """Byte offsets of the dispatch's receive slot (see the module doc): ``row_bytes``,
    ``ids_offset``, ``count_offset`` and ``slot_bytes`` (the whole, a multiple of 16)."""
    W, Tm = int(world_size), int(max_tokens_per_rank)
    row_bytes = int(hidden) * 2
    if row_bytes % 16:
        raise ValueError(f"hidden={hidden}: the bf16 token row must be a multiple of 16 bytes "
                         "(hidden % 8 == 0)")
    ids_offset = W * Tm * row_bytes
    count_offset = ids_offset + _up16(W * Tm * int(topk) * 4)
    return {"row_bytes": row_bytes, "ids_offset": ids_offset, "count_offset": count_offset,
            "slot_bytes": count_offset + _up16(W * 4)}


def send_host(topk_ids: torch.Tensor, experts_per_rank: int, world_size: int,
              threads: int = 256):
    """The send kernel's compaction, batch by batch as the kernel does it: (slot_row [T, W]
    int64, -1 where token t does not go to rank d; n_to [W]). Ids outside [0, E) are ignored."""
    El, W = int(experts_per_rank), int(world_size)
    ids = topk_ids.to(torch.int64).cpu()
    T = ids.shape[0]
    E = El * W
    goes = torch.zeros(T, W, dtype=torch.bool)
    ok = (ids >= 0) & (ids < E)
    rows_, cols_ = ok.nonzero(as_tuple=True)
    goes[rows_, ids[rows_, cols_] // El] = True
    slot_row = torch.full((T, W), -1, dtype=torch.int64)
    base = torch.zeros(W, dtype=torch.int64)
    for b0 in range(0, T, threads):
        g = goes[b0:b0 + threads]
        n = g.shape[0]
        # per warp: ballot -> lanes below; warps before: their popcounts
        lane_rank = torch.zeros(n, W, dtype=torch.int64)
        warp_before = torch.zeros(n, W, dtype=torch.int64)
        run = torch.zeros(W, dtype=torch.int64)
        for w0 in range(0, n, 32):
            gw = g[w0:w0 + 32].to(torch.int64)
            lane_rank[w0:w0 + 32] = torch.cumsum(gw, 0) - gw
            warp_before[w0:w0 + 32] = run
            run = run + gw.sum(0)
        r = base + warp_before + lane_rank
        slot_row[b0:b0 + n] = torch.where(g, r, torch.full_like(r, -1))
        base = base + run
    return slot_row, base


def expand_host(recv_tokens, recv_ids, n_from, plan, counts, rank: int, rows: int,
                threads: int = 256):
    """The expand kernel's output [rows, D] on owner ``rank`` from its receive slot: recv_tokens
    [W, T_max, D], recv_ids [W, T_max, k] (int32), n_from [W] (tokens each source sent), the
    plan and the [W, E] counts it was made from. Raises ValueError where the kernel records an
    error (a received count outside [0, T_max], more or fewer rows for a group than counts)."""
    W, Tm, D = recv_tokens.shape
    El = plan.experts_per_rank
    ers = plan.expert_row_start.long().cpu()
    grs = plan.group_row_start.long().cpu()
    erows = plan.expert_rows.long().cpu()
    total = int(plan.total_rows.item())
    cnt = counts.long().cpu()
    out = torch.full((rows, D), float("nan"), dtype=recv_tokens.dtype)  # every row is written
    ids = recv_ids.long().cpu()
    for e in range(El):
        g = rank * El + e
        starts = [int(ers[e] + grs[e, s]) for s in range(W)]
        sizes = [int(cnt[s, g]) for s in range(W)]
        end_e = int(ers[e] + erows[e])
        for s in range(W):
            n = int(n_from[s])
            if not 0 <= n <= Tm:
                raise ValueError(f"source {s}: received count {n} outside [0, {Tm}]")
            a, c = starts[s], sizes[s]
            run = 0
            for b0 in range(0, n, threads):  # batches of NT received tokens: a CTA scan
                m = (ids[s, b0:min(n, b0 + threads)] == g)
                before = torch.cumsum(m.sum(1), 0) - m.sum(1)
                for t in range(m.shape[0]):
                    k_seen = 0
                    for j in range(m.shape[1]):
                        if m[t, j]:
                            r = run + int(before[t]) + k_seen
                            k_seen += 1
                            if r >= c or a + r >= rows:
                                raise ValueError(f"expert {e}, source {s}: row {r} outside its "
                                                 f"group of {c}")
                            out[a + r] = recv_tokens[s, b0 + t]
                run += int(m.sum())
            if run != c:
                raise ValueError(f"expert {e}, source {s}: {run} rows received, counts say {c}")
            # the gap after the group, to the next non-empty group's start or the expert's end
            nxt = min([x for x, y in zip(starts, sizes) if y > 0 and x >= a + c] + [end_e])
            out[min(a + c, rows):min(nxt, rows)] = 0
            if s == 0:  # the gap before the expert's first non-empty group
                first = min([x for x, y in zip(starts, sizes) if y > 0] + [end_e])
                out[min(int(ers[e]), rows):min(first, rows)] = 0
    out[min(total, rows):] = 0
    return out


def dispatch_host(xs, topk_ids_per_rank, plans, counts, max_tokens_per_rank: int, rows,
                  threads: int = 256):
    """Every rank's overlapped-dispatch result, computed on the host from all ranks' inputs:
    the send compaction into each owner's slot (NaN-poisoned, as a stale slot would be), then
    each owner's expansion. xs / topk_ids_per_rank / plans: per rank; rows: per rank."""
    W = len(xs)
    El = plans[0].experts_per_rank
    D, k = xs[0].shape[1], topk_ids_per_rank[0].shape[1]
    tok = torch.full((W, W, max_tokens_per_rank, D), float("nan"), dtype=xs[0].dtype)
    ids = torch.full((W, W, max_tokens_per_rank, k), -7, dtype=torch.int32)
    n_from = torch.zeros(W, W, dtype=torch.int64)
    for s in range(W):
        slot_row, n_to = send_host(topk_ids_per_rank[s], El, W, threads)
        for d in range(W):
            t = (slot_row[:, d] >= 0).nonzero(as_tuple=True)[0]
            tok[d, s, slot_row[t, d]] = xs[s][t]
            ids[d, s, slot_row[t, d]] = topk_ids_per_rank[s][t].to(torch.int32)
            n_from[d, s] = n_to[d]
    return [expand_host(tok[d], ids[d], n_from[d], plans[d], counts, d, rows[d], threads)
            for d in range(W)]


ARRIVAL_ORDERS = ("arrival", "expert")  # arrival_schedule(order=)


def arrival_schedule(plan, counts: torch.Tensor, order: str = "arrival") -> torch.Tensor:
    """The up-projection's band order for the per-source expand (``MoEDispatch(expand_wait=
    "per_source")``): int32 [plan.band_capacity], the bands past ``num_bands`` last.
    order="arrival": the plan's bands by the farthest rank distance ``(s - rank) mod W`` of the
    sources with rows in the band (this rank's own rows first: they need no transfer; a band
    goes when its last source has), then by band id, which is the order in which the expand's
    items (distance by distance, experts ascending) raise the flags.
    order="expert": by expert first, then as "arrival" within the expert: every band of an
    expert side by side, so that the GEMM's band groups (bands at equal n tiles) read each
    weight slice once; the first tiles then wait for every source of the first expert.
    ``counts`` [W, E]: the routing counts the plan was made from. Torch ops on the plan's
    device, no host sync (capturable with the plan).

    Why not the plan's own schedule: "remote_first" puts every band holding a remote row before
    the local-only ones (the combine ships remote bands early: the opposite of what arrives
    first), and the plan's order="expert" takes each expert's bands in band-id order, sources
    interleaved (this function's "expert" takes them by arrival within the expert).
    Why "expert" exists: in "arrival" order consecutive positions hold other experts (one or two
    bands per (expert, source) at W = 8), so a band group shares no weights and every band reads
    its expert's whole [D, 2K] slice from DRAM: about bands x weight bytes of traffic where an
    expert's weights do not stay in L2 (the count against the measurements: bench/NOTES.md)."""
    if order not in ARRIVAL_ORDERS:
        raise ValueError(f"order={order!r}; choose from {ARRIVAL_ORDERS}")
    W, r, El, tm = plan.world_size, plan.rank, plan.experts_per_rank, plan.tile_m
    B = plan.band_capacity
    dev = plan.band_expert.device
    b = torch.arange(B, device=dev)
    valid = b < plan.num_bands.to(dev).long()
    e = plan.band_expert.long().clamp(0, El - 1)
    lo = plan.band_src_row.long()[:, None]  # [B, 1] the band's first row
    g_lo = plan.expert_row_start.long()[e][:, None] + plan.group_row_start.long()[e]  # [B, W]
    c = counts.to(dev).long()[:, r * El:(r + 1) * El].t()[e]  # [B, W] rows of (e, s)
    meets = (c > 0) & (g_lo < lo + tm) & (g_lo + c > lo)
    dist = (torch.arange(W, device=dev) - r) % W
    far = torch.where(meets, dist[None, :], torch.full_like(c, -1)).amax(1).clamp(min=0)
    key = far * B + b
    if order == "expert":
        key = e * (W * B) + key
    key = torch.where(valid, key, El * W * B + b)
    return torch.argsort(key).to(torch.int32)
