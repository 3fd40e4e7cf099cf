"""On-device combine planner.

`plan_combine` turns the all-gathered routing counts into the layout, the band table, the compute
schedule and the transfer segments that the producer GEMM and the consumer kernel walk. Everything is
computed with vectorized tensor ops on the device of `expert_counts`; with `validate=False` and an
explicit `max_rows` it performs no host synchronization, so it can run inside a CUDA graph.

Layout of local expert e's input X_e (rows):
    [rows from source r0][rows from r1]...[rows from the local rank]   remote ranks ascending, local last
each source's rows in token order. ``aligned``: every (expert, source) group is padded with zero
rows to a multiple of `tile_m`, so a band (`tile_m` rows) has one destination. ``packed``: the
groups follow each other without padding and only each expert's total is padded, so a band may
hold the rows of several sources (fine-grained MoE has about one tile per group: aligned pads
~50 % of the rows there). A *cell* is the rows of one group inside one band; transfers are built
from cells, so both layouts share one meaning of every field. See docs/CONTRACTS.md.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields

import torch

from .checks import as_int, check_expert_ids
from .plan_closed_form import FP_KEY, FP_MUL1, FP_MUL2

SUPPORTED_TILE_M = (64, 128, 256)
LAYOUTS = ("auto", "aligned", "packed")
ORDERS = ("remote_first", "expert")  # plan_combine(order=): the schedule's band order

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass
class CombinePlan:
    """The plan of one MoE combine for one rank. Tensors are int32 on the counts' device.

    Tensors whose length is a capacity (`band_capacity`, `segment_capacity`) hold valid entries in
    a prefix given by the device scalars `num_bands` / `num_segments` / `num_local_cells`; the
    rest is -1.
    """

    # host facts
    world_size: int
    rank: int
    num_experts: int
    experts_per_rank: int
    tile_m: int
    mgb: int
    band_capacity: int
    segment_capacity: int
    layout: str  # as requested: "aligned", "packed" or "auto" (then `packed` says which)
    # layout
    packed: torch.Tensor  # [1] 1 where the rows are packed, 0 where aligned
    group_row_start: torch.Tensor  # [El, W]
    expert_rows: torch.Tensor  # [El]
    expert_row_start: torch.Tensor  # [El]
    recv_rows_per_rank: torch.Tensor  # [W] rows each rank receives back (sum_e counts[d, e])
    routed_counts: torch.Tensor  # [E] this rank's assignments per global expert (counts[rank]):
    # what MoECombine.forward(validate=True) checks topk_ids against
    # counts
    num_bands: torch.Tensor  # [1]
    num_remote_bands: torch.Tensor  # [1]
    num_segments: torch.Tensor  # [1]
    num_local_cells: torch.Tensor  # [1]
    total_rows: torch.Tensor  # [1] padded rows of all local experts
    valid_rows: torch.Tensor  # [1] rows carrying data
    counts_fingerprint: torch.Tensor  # [1] 32-bit fingerprint of the [W, E] counts (the same
    # in every rank's plan of one call): the call's identity in the epoch tags (consumer.py)
    # bands, indexed by band id (stacked row order)
    band_expert: torch.Tensor
    band_row: torch.Tensor
    band_src_row: torch.Tensor
    band_dest: torch.Tensor
    band_valid: torch.Tensor
    band_dest_row: torch.Tensor
    # compute order
    schedule: torch.Tensor
    # transfers (remote only, schedule order)
    segment_start: torch.Tensor
    segment_bands: torch.Tensor
    segment_dest: torch.Tensor
    segment_src_row: torch.Tensor
    segment_dest_row: torch.Tensor
    segment_rows: torch.Tensor
    # this rank's own rows: one cell per band holding any, in schedule order (capacity
    # band_capacity); the consumer's local copy walks them
    local_cell_band: torch.Tensor
    local_cell_src_row: torch.Tensor
    local_cell_dest_row: torch.Tensor
    local_cell_rows: torch.Tensor
    # the schedule's order (plan_combine(order=)): "remote_first" or "expert"
    order: str = "remote_first"
    # the [W, E] counts the plan was made from (the caller's tensor, not a copy; None where
    # unknown): what the validated calls agree on across ranks. Not one of `tensors()`.
    source_counts: torch.Tensor | None = None

    @property
    def row_capacity(self) -> int:
        """Rows the stacked expert input can span at most (band_capacity * tile_m)."""
        return self.band_capacity * self.tile_m

    @property
    def device(self) -> torch.device:
        return self.band_expert.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The plan's own tensors (not `source_counts`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "source_counts"}

    def to(self, device) -> "CombinePlan":
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                kw[k] = v.to(device)
        return CombinePlan(**kw)

    # ---- host views (these synchronize) -------------------------------------------------
    def counts(self) -> tuple[int, int, int]:
        """(num_bands, num_remote_bands, num_segments) as host ints."""
        v = torch.cat([self.num_bands, self.num_remote_bands, self.num_segments]).tolist()
        return int(v[0]), int(v[1]), int(v[2])

    def band_table(self) -> dict[str, list[int]]:
        """Valid bands as host lists (for debugging and tests)."""
        nb = self.counts()[0]
        names = ("band_expert", "band_row", "band_src_row", "band_dest", "band_valid",
                 "band_dest_row")
        return {n: getattr(self, n)[:nb].tolist() for n in names}

    def stats(self) -> dict[str, float]:
        """Summary numbers: padding overhead, remote fraction, band and segment counts."""
        nb, nr, ns = self.counts()
        total = int(self.total_rows.item())
        valid = int(self.valid_rows.item())
        remote_valid = valid - int(self.local_cell_rows.clamp(min=0).sum().item())
        return {
            "rows_valid": valid,
            "rows_padded": total,
            "padding_rows": total - valid,
            "padding_overhead": (total - valid) / valid if valid else 0.0,
            "remote_rows": remote_valid,
            "remote_fraction": remote_valid / valid if valid else 0.0,
            "bands": nb,
            "remote_bands": nr,
            "segments": ns,
        }


def _check_counts(expert_counts: torch.Tensor, rank, tile_m, mgb) -> tuple[int, int, int, int, int]:
    if not isinstance(expert_counts, torch.Tensor):
        raise TypeError(f"expert_counts must be a torch.Tensor, got {type(expert_counts).__name__}")
    if expert_counts.dtype not in _INT_DTYPES:
        raise TypeError(f"expert_counts must have an integer dtype, got {expert_counts.dtype}")
    if expert_counts.dim() != 2:
        raise ValueError(f"expert_counts must be 2-D [W, E], got shape {tuple(expert_counts.shape)}")
    W, E = expert_counts.shape
    if W < 1:
        raise ValueError("expert_counts must have at least one rank (W >= 1)")
    if E < 1 or E % W != 0:
        raise ValueError(f"the number of experts E={E} must be a positive multiple of the world "
                         f"size W={W} (experts are placed contiguously, E // W per rank)")
    rank = as_int("rank", rank)
    if not 0 <= rank < W:
        raise ValueError(f"rank={rank!r} out of range for world size {W}")
    if isinstance(tile_m, numbers.Integral) and not isinstance(tile_m, bool):
        tile_m = int(tile_m)
    if tile_m not in SUPPORTED_TILE_M:
        raise ValueError(f"tile_m={tile_m!r} not supported; use one of {SUPPORTED_TILE_M}")
    try:
        mgb = as_int("mgb", mgb, minimum=1)
    except ValueError:
        raise ValueError(f"mgb (bands per transfer) must be an int >= 1, got {mgb!r}") from None
    return W, E, rank, tile_m, mgb


def band_capacity_for(max_rows: int, experts_per_rank: int, world_size: int, tile_m: int) -> int:
    """Upper bound on the bands of one rank's plan when it receives at most `max_rows` rows.

    sum over groups of ceil(c / tile_m) <= floor(sum c / tile_m) + number of groups."""
    return max_rows // tile_m + experts_per_rank * world_size


# The counts fingerprint (the definition, and why it tells single-entry changes apart:
# plan_closed_form.py, FP_KEY)
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without an int64 overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def counts_fingerprint_torch(expert_counts: torch.Tensor) -> torch.Tensor:
    """int32 [1]: the counts fingerprint (plan_closed_form.py FP_KEY) with torch ops on the
    counts' device, no host sync; the uint32 value as the int32 of the same bits."""
    v = expert_counts.reshape(-1).to(torch.int64) & _M32
    i = torch.arange(v.numel(), dtype=torch.int64, device=v.device)
    x = v ^ _mul32(i, FP_KEY)
    x = x ^ (x >> 16)
    x = _mul32(x, FP_MUL1)
    x = x ^ (x >> 13)
    x = _mul32(x, FP_MUL2)
    x = x ^ (x >> 16)
    fp = (x.sum() & _M32).reshape(1)
    return torch.where(fp > 0x7FFFFFFF, fp - (1 << 32), fp).to(torch.int32)


IMPLS = ("auto", "torch", "kernel")


def _resolve_impl(impl, expert_counts: torch.Tensor) -> str:
    """"kernel" (the CuTe DSL planner, moe_overlap/combine/plan_kernel.py) or "torch". auto:
    the kernel for CUDA counts where CuTe DSL imports, torch otherwise (the CPU path, and the
    reference the kernel is tested against). MOE_OVERLAP_PLAN_IMPL sets the default of auto."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; choose from {IMPLS}")
    if impl == "auto":
        impl = os.environ.get("MOE_OVERLAP_PLAN_IMPL", "auto")
        if impl not in IMPLS:
            raise ValueError(f"MOE_OVERLAP_PLAN_IMPL={impl!r}; choose from {IMPLS}")
    if impl == "auto":
        from .plan_kernel import kernel_available
        return "kernel" if expert_counts.is_cuda and kernel_available() else "torch"
    if impl == "kernel" and not expert_counts.is_cuda:
        raise ValueError("impl='kernel' needs the counts on a CUDA device")
    return impl


def plan_combine(expert_counts: torch.Tensor, rank: int, tile_m: int = 128, mgb: int = 1,
                 max_rows: int | None = None, validate: bool = True,
                 layout: str = "auto", impl: str = "auto",
                 order: str = "remote_first") -> CombinePlan:
    """Plan one rank's MoE combine.

    expert_counts [W, E]: expert_counts[s, e] = (token, k) assignments source s sends to expert e.
    max_rows: most rows this rank can receive (sum over sources of its local experts' counts); sizes
        the band/segment tensors. None: the exact number, read from the counts (a host sync on CUDA).
    validate: check the counts' values (non-negative, within max_rows) on the host first. That reads
        the counts (a host sync on CUDA); pass False for a sync-free plan (CUDA graphs), where the
        caller vouches for the counts. Unchecked counts the capacities cannot hold give a plan
        of nothing, flagged by num_bands outside [0, band_capacity] (the producer refuses it;
        docs/CONTRACTS.md, "Device bounds").
    layout: "aligned" (every (expert, source) group padded to tile_m), "packed" (only each
        expert's total padded) or "auto" (packed where it lays out fewer rows than aligned,
        decided on the device: `plan.packed` says which, without a host sync).
    impl: "torch" (vectorized torch ops below: the reference, and the CPU path), "kernel" (one
        CuTe DSL launch, moe_overlap/combine/plan_kernel.py: the same tensors bit for bit, a
        few microseconds) or "auto" (the kernel on CUDA where CuTe DSL imports). The host checks
        here run before either.
    order: the schedule. "remote_first": every band holding a remote row before every band
        holding none (the transfers start as early as possible). "expert": the bands in stacked
        row order, i.e. expert by expert, each expert's remote rows first and its local-only band
        right after them: the producer reads each expert's weights about once, where
        remote-first reads them twice when much of an expert's rows are local (the timings:
        bench/NOTES.md, the producer in expert order), at the price of later remote rows. Both
        implementations build both orders (the kernel: a compiled variant each).
    """
    W, E, rank, tile_m, mgb = _check_counts(expert_counts, rank, tile_m, mgb)
    if max_rows is not None:
        max_rows = as_int("max_rows", max_rows)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; choose from {LAYOUTS}")
    if order not in ORDERS:
        raise ValueError(f"order={order!r}; choose from {ORDERS}")
    requested, by_expert = impl, order == "expert"
    impl = _resolve_impl(impl, expert_counts)
    El = E // W
    dev = expert_counts.device
    # int64 counts: no copy; the kernel reads the counts as given and needs these only to validate
    counts = expert_counts.to(torch.int64) if validate or max_rows is None or impl == "torch" \
        or expert_counts.dtype == torch.int64 else None
    local = None if counts is None else counts[:, rank * El:(rank + 1) * El].t()  # [El, W]
    if validate:
        if bool((counts < 0).any()):
            raise ValueError("expert_counts must be non-negative")
        if max_rows is not None:
            need = int(local.sum())
            if need > max_rows:
                raise ValueError(f"receive capacity exceeded: rank {rank} would receive {need} rows "
                                 f"but max_rows={max_rows}")
    if max_rows is None:
        max_rows = int(local.sum())  # sync on CUDA; the caller asked for an exact plan
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows}")
    B = band_capacity_for(max_rows, El, W, tile_m)
    if impl == "kernel":
        from .plan_kernel import PlanKernel, plan_tensors_kernel
        ok, why = PlanKernel.can_implement(W, E, torch.int32 if expert_counts.dtype not in (
            torch.int32, torch.int64) else expert_counts.dtype, B, B + El * W)
        if not ok and requested == "kernel":
            raise ValueError(f"impl='kernel' cannot plan this: {why}; use impl='torch'")
        if ok:
            return CombinePlan(world_size=W, rank=rank, num_experts=E, experts_per_rank=El,
                               tile_m=tile_m, mgb=mgb, band_capacity=B,
                               segment_capacity=B + El * W, layout=layout, order=order,
                               source_counts=expert_counts,
                               **plan_tensors_kernel(expert_counts, rank, tile_m, mgb, B, layout,
                                                     order))
        counts = expert_counts.to(torch.int64)  # auto, beyond the kernel's limits: torch
        local = counts[:, rank * El:(rank + 1) * El].t()
    C = B + El * W  # cells (band, source) of either layout: at most one per band and group
    i64 = dict(dtype=torch.int64, device=dev)

    # ---- layout: groups in order (remote ranks ascending, local last) --------------------
    jw = torch.arange(W, device=dev)
    group_src = torch.where(jw == W - 1, rank, torch.where(jw < rank, jw, jw + 1))  # group j -> src
    local_o = local[:, group_src]  # [El, W] counts in group order
    aligned_o = (local_o + tile_m - 1) // tile_m * tile_m  # padded group heights
    start_aligned = torch.cumsum(aligned_o, 1) - aligned_o
    rows_aligned = aligned_o.sum(1)
    start_packed = torch.cumsum(local_o, 1) - local_o
    rows_packed = (local_o.sum(1) + tile_m - 1) // tile_m * tile_m
    if layout == "aligned":
        packed = torch.zeros(1, dtype=torch.bool, device=dev)
    elif layout == "packed":
        packed = torch.ones(1, dtype=torch.bool, device=dev)
    else:
        packed = (rows_packed.sum() < rows_aligned.sum()).reshape(1)
    start_o = torch.where(packed, start_packed, start_aligned)  # group start in X_e
    expert_rows = torch.where(packed, rows_packed, rows_aligned)
    group_row_start = torch.empty_like(start_o)
    group_row_start[:, group_src] = start_o
    expert_row_start = torch.cumsum(expert_rows, 0) - expert_rows
    # receive buffer of rank d: rows ordered by global expert; recv_off[d, g] = first row of g
    recv_off = torch.cumsum(counts, 1) - counts  # [W, E]
    recv_rows_per_rank = counts.sum(1)

    # ---- overflow: counts (validate=False) this plan's capacities cannot hold -------------
    # a negative local count, one whose bands alone exceed B, or more bands than B in all.
    # Then no band, cell or segment is planned (every capacity field -1, the counts 0) and
    # num_bands says it (plan_kernel does the same): the bands needed, or -1 where that is
    # not a count (negative counts); outside [0, B] either way, which the producer refuses.
    need_bands = (expert_rows // tile_m).sum().reshape(1)
    overflow = ((local < 0).any() | (local // tile_m > B).any()).reshape(1) | (need_bands > B)
    fits = ~overflow
    overflow_bands = torch.where(need_bands > B, need_bands, torch.full_like(need_bands, -1))

    # ---- bands: tile_m rows of one expert, ids in stacked row order -----------------------
    expert_bands = torch.where(fits, expert_rows // tile_m, 0)
    band_base = torch.cumsum(expert_bands, 0) - expert_bands
    nb = expert_bands.sum().reshape(1)
    b = torch.arange(B, device=dev)
    valid_b = b < nb
    e = torch.searchsorted(torch.cumsum(expert_bands, 0), b, right=True).clamp(max=El - 1)
    band_row = (b - band_base[e]) * tile_m
    band_src_row = expert_row_start[e] + band_row

    # ---- cells: the rows of one group inside one band, in stacked row order ---------------
    # aligned: one cell per band; packed: a band holds the cells of every group it overlaps
    c_flat = torch.where(fits, local_o.reshape(-1), 0)
    st_flat = torch.where(fits, start_o.reshape(-1), 0)
    k0 = st_flat // tile_m  # first band of the group inside its expert
    n_cells = torch.where(c_flat > 0, (st_flat + c_flat - 1) // tile_m - k0 + 1, 0)
    cum_cells = torch.cumsum(n_cells, 0)
    num_cells = cum_cells[-1:]
    i = torch.arange(C, device=dev)
    valid_c = i < num_cells
    grp = torch.searchsorted(cum_cells, i, right=True).clamp(max=c_flat.numel() - 1)
    ce, cj = grp // W, grp % W
    cs = group_src[cj]  # the cell's source = its destination
    kb = k0[grp] + i - (cum_cells[grp] - n_cells[grp])  # band inside the expert
    g_lo, g_hi = st_flat[grp], st_flat[grp] + c_flat[grp]
    lo = torch.maximum(g_lo, kb * tile_m)
    cell_rows = torch.minimum(g_hi, (kb + 1) * tile_m) - lo
    cell_band = torch.where(valid_c, band_base[ce] + kb, B)  # B: after every band
    cell_src_row = expert_row_start[ce] + lo
    cell_dest_row = recv_off[cs, rank * El + ce] + lo - g_lo
    cell_remote = valid_c & (cs != rank)
    # per band: all its rows, and the destination of its first cell
    band_valid = torch.zeros(B + 1, **i64).index_add_(0, cell_band,
                                                      torch.where(valid_c, cell_rows, 0))[:B]
    band_remote = torch.zeros(B + 1, **i64).index_add_(0, cell_band, cell_remote.long())[:B] > 0
    first_cell = torch.searchsorted(cell_band, b).clamp(max=C - 1)
    band_dest = cs[first_cell]
    band_dest_row = cell_dest_row[first_cell]

    # ---- schedule: remote bands first, experts with more remote bands first --------------
    remote_bands_e = torch.zeros(El, **i64).index_add_(0, e, (band_remote & valid_b).long())
    exp_key = -remote_bands_e * El + torch.arange(El, device=dev)
    exp_pos = torch.empty_like(exp_key)
    exp_pos[torch.argsort(exp_key)] = torch.arange(El, device=dev)
    # bands of one expert are in row order already (b increases with the row)
    key = b if by_expert else ((~band_remote).long() * El + exp_pos[e]) * B + b
    key = torch.where(valid_b, key, 2 * El * B + b)
    schedule = torch.argsort(key)
    position = torch.empty_like(schedule)
    position[schedule] = b  # schedule position of each band
    num_remote = (band_remote & valid_b).sum().reshape(1)
    cell_pos = position[cell_band.clamp(max=B - 1)]

    # ---- segments: runs of one group's remote cells in schedule order, cut into <= mgb ----
    # cells; the first and the last remote cell ship alone (start early, end early)
    order_key = torch.where(cell_remote, cell_pos * C + i, B * C + i)
    rc = torch.argsort(order_key)  # remote cells in schedule order, then the rest
    R = cell_remote.sum()
    run_id = grp[rc]
    new_run = torch.ones(C, dtype=torch.bool, device=dev)
    new_run[1:] = run_id[1:] != run_id[:-1]
    run_start = torch.cummax(torch.where(new_run, i, torch.zeros_like(i)), 0).values
    kk = i - run_start - (run_start == 0).long()  # the first cell is cut off the first run
    is_seg_start = (i < R) & ((i == 0) | (i == R - 1) | (kk % mgb == 0))
    seg_q = torch.sort(torch.where(is_seg_start, i, C + i)).values  # starts first, ascending
    num_segments = is_seg_start.sum().reshape(1)
    S = C
    seg_valid = i < num_segments
    seg_q = torch.where(seg_valid, seg_q, torch.zeros_like(seg_q))
    nxt = torch.cat([seg_q[1:], seg_q[:1]])
    seg_end = torch.where(i + 1 < num_segments, nxt, R.expand(S))
    first = rc[seg_q]
    last = rc[(seg_end - 1).clamp(min=0)]
    seg_rows = cell_dest_row[last] + cell_rows[last] - cell_dest_row[first]

    # ---- local cells (this rank's own rows), in schedule order: the consumer's local copy --
    is_local = valid_c & (cs == rank)
    lc = torch.argsort(torch.where(is_local, cell_pos * C + i, B * C + i))[:B]
    num_local = is_local.sum().reshape(1)
    local_valid = b < num_local

    def finish(t, mask):
        return torch.where(mask, t, torch.full_like(t, -1)).to(torch.int32)

    sched_valid = b < nb
    return CombinePlan(
        world_size=W, rank=rank, num_experts=E, experts_per_rank=El, tile_m=tile_m, mgb=mgb,
        band_capacity=B, segment_capacity=S, layout=layout,
        order=order, source_counts=expert_counts,
        packed=packed.to(torch.int32),
        group_row_start=group_row_start.to(torch.int32),
        expert_rows=expert_rows.to(torch.int32),
        expert_row_start=expert_row_start.to(torch.int32),
        recv_rows_per_rank=recv_rows_per_rank.to(torch.int32),
        routed_counts=counts[rank].to(torch.int32),
        num_bands=torch.where(fits, nb, overflow_bands).to(torch.int32),
        num_remote_bands=num_remote.to(torch.int32),
        num_segments=num_segments.to(torch.int32),
        num_local_cells=num_local.to(torch.int32),
        total_rows=expert_rows.sum().reshape(1).to(torch.int32),
        valid_rows=local.sum().reshape(1).to(torch.int32),
        counts_fingerprint=counts_fingerprint_torch(counts),
        band_expert=finish(e, valid_b),
        band_row=finish(band_row, valid_b),
        band_src_row=finish(band_src_row, valid_b),
        band_dest=finish(band_dest, valid_b),
        band_valid=finish(band_valid, valid_b),
        band_dest_row=finish(band_dest_row, valid_b),
        schedule=finish(schedule, sched_valid),
        segment_start=finish(cell_pos[first], seg_valid),
        segment_bands=finish(cell_pos[last] - cell_pos[first] + 1, seg_valid),
        segment_dest=finish(cs[first], seg_valid),
        segment_src_row=finish(cell_src_row[first], seg_valid),
        segment_dest_row=finish(cell_dest_row[first], seg_valid),
        segment_rows=finish(seg_rows, seg_valid),
        local_cell_band=finish(cell_band[lc], local_valid),
        local_cell_src_row=finish(cell_src_row[lc], local_valid),
        local_cell_dest_row=finish(cell_dest_row[lc], local_valid),
        local_cell_rows=finish(cell_rows[lc], local_valid),
    )


def recv_rows(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Receive-buffer row of each (token, k) assignment on the token's owner.

    The receive buffer is ordered by global expert, then token, then k: a stable sort of the
    flattened ids by expert gives every assignment's row."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(flat.numel(), device=flat.device)
    return rows.view(topk_ids.shape)


def count_assignments(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] assignments of this rank's tokens to each global expert (int64). Ids outside
    [0, num_experts) raise ValueError (reads the ids: a host sync on CUDA)."""
    check_expert_ids(topk_ids, num_experts)
    return torch.bincount(topk_ids.reshape(-1).to(torch.int64), minlength=num_experts)
