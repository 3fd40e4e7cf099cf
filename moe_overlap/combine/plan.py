"""On-device combine planner.

`plan_combine` turns the all-gathered routing counts into the layout, the band table, the compute
schedule and the transfer segments that the producer GEMM and the consumer kernel walk. Everything is
computed with vectorized tensor ops on the device of `expert_counts`; with `validate=False` and an
explicit `max_rows` it performs no host synchronization, so it can run inside a CUDA graph.

Layout of local expert e's input X_e (rows):
    [group of source r0][group of r1]...[group of the local rank]   remote ranks ascending, local last
each group padded with zero rows to a multiple of `tile_m`. Row bands are `tile_m` rows; every band
belongs to exactly one (expert, source) group, so it has one destination. See docs/CONTRACTS.md.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

import torch

from .checks import as_int, check_expert_ids

SUPPORTED_TILE_M = (64, 128, 256)

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass
class CombinePlan:
    """The plan of one MoE combine for one rank. Tensors are int32 on the counts' device.

    Tensors whose length is a capacity (`band_capacity`, `segment_capacity`) hold valid entries in
    a prefix given by the device scalars `num_bands` / `num_segments`; the rest is -1.
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
    # layout
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
    total_rows: torch.Tensor  # [1] padded rows of all local experts
    valid_rows: torch.Tensor  # [1] rows carrying data
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

    @property
    def row_capacity(self) -> int:
        """Rows the stacked expert input can span at most (band_capacity * tile_m)."""
        return self.band_capacity * self.tile_m

    @property
    def device(self) -> torch.device:
        return self.band_expert.device

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

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
        remote_valid = int(self.band_valid[:nb][self.band_dest[:nb] != self.rank].sum().item()) \
            if nb else 0
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


def plan_combine(expert_counts: torch.Tensor, rank: int, tile_m: int = 128, mgb: int = 1,
                 max_rows: int | None = None, validate: bool = True) -> CombinePlan:
    """Plan one rank's MoE combine.

    expert_counts [W, E]: expert_counts[s, e] = (token, k) assignments source s sends to expert e.
    max_rows: most rows this rank can receive (sum over sources of its local experts' counts); sizes
        the band/segment tensors. None: the exact number, read from the counts (a host sync on CUDA).
    validate: check the counts' values (non-negative, within max_rows) on the host first. That reads
        the counts (a host sync on CUDA); pass False for a sync-free plan (CUDA graphs), where the
        caller vouches for the counts.
    """
    W, E, rank, tile_m, mgb = _check_counts(expert_counts, rank, tile_m, mgb)
    if max_rows is not None:
        max_rows = as_int("max_rows", max_rows)
    El = E // W
    dev = expert_counts.device
    counts = expert_counts.to(torch.int64)
    local = counts[:, rank * El:(rank + 1) * El].t()  # [El, W]: rows expert e receives from s
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
    S = B

    # ---- layout: groups in order (remote ranks ascending, local last) --------------------
    jw = torch.arange(W, device=dev)
    order = torch.where(jw == W - 1, rank, torch.where(jw < rank, jw, jw + 1))  # group j -> source
    local_o = local[:, order]  # [El, W] counts in group order
    bands_o = (local_o + tile_m - 1) // tile_m  # bands per group
    padded_o = bands_o * tile_m
    start_o = torch.cumsum(padded_o, 1) - padded_o  # group start in X_e, group order
    group_row_start = torch.empty_like(start_o)
    group_row_start[:, order] = start_o
    expert_rows = padded_o.sum(1)
    expert_row_start = torch.cumsum(expert_rows, 0) - expert_rows
    # receive buffer of rank d: rows ordered by global expert; recv_off[d, g] = first row of g
    recv_off = torch.cumsum(counts, 1) - counts  # [W, E]
    recv_rows_per_rank = counts.sum(1)

    # ---- bands: enumerate a static-size index space -------------------------------------
    flat_bands = bands_o.reshape(-1)  # expert-major, group order
    cum = torch.cumsum(flat_bands, 0)
    nb = cum[-1:].clone()  # [1]
    b = torch.arange(B, device=dev)
    grp = torch.searchsorted(cum, b, right=True)
    valid_b = grp < flat_bands.numel()
    grp = grp.clamp(max=flat_bands.numel() - 1)
    e = grp // W
    j = grp % W
    s = order[j]
    k = b - (cum[grp] - flat_bands[grp])  # band index within its group
    band_row = start_o[e, j] + k * tile_m
    c = local_o[e, j]
    band_valid = (c - k * tile_m).clamp(0, tile_m)
    band_dest_row = recv_off[s, rank * El + e] + k * tile_m
    band_src_row = expert_row_start[e] + band_row
    is_remote = s != rank

    # ---- schedule: remote bands first, experts with more remote bands first --------------
    remote_bands_e = bands_o[:, :W - 1].sum(1)  # local group is the last column
    exp_key = -remote_bands_e * El + torch.arange(El, device=dev)
    exp_pos = torch.empty_like(exp_key)
    exp_pos[torch.argsort(exp_key)] = torch.arange(El, device=dev)
    # bands of one expert are in row order already (b increases with the row)
    key = ((~is_remote).long() * El + exp_pos[e]) * B + b
    key = torch.where(valid_b, key, 2 * El * B + b)
    schedule = torch.argsort(key, stable=True)
    num_remote = (is_remote & valid_b).sum().reshape(1)

    # ---- segments: runs of one (expert, dest) cut into <= mgb bands ----------------------
    p = torch.arange(B, device=dev)
    sb = schedule
    run_id = e[sb] * W + s[sb]
    new_run = torch.ones(B, dtype=torch.bool, device=dev)
    new_run[1:] = run_id[1:] != run_id[:-1]
    run_start = torch.cummax(torch.where(new_run, p, torch.zeros_like(p)), 0).values
    kk = p - run_start - (run_start == 0).long()  # the first band is cut off the first run
    in_remote = p < num_remote
    is_seg_start = in_remote & ((p == 0) | (p == num_remote - 1) | (kk % mgb == 0))
    seg_key = torch.where(is_seg_start, p, B + p)
    seg_pos = torch.sort(seg_key).values  # starts first (ascending), then the rest
    num_segments = is_seg_start.sum().reshape(1)
    q = torch.arange(S, device=dev)
    seg_valid = q < num_segments
    seg_start = torch.where(seg_valid, seg_pos, torch.zeros_like(seg_pos))
    nxt = torch.cat([seg_start[1:], seg_start[:1]])
    seg_end = torch.where(q + 1 < num_segments, nxt, num_remote.expand(S))
    seg_bands = seg_end - seg_start
    first_band = sb[seg_start]
    last_band = sb[(seg_end - 1).clamp(min=0)]
    seg_rows = (band_dest_row[last_band] + band_valid[last_band]) - band_dest_row[first_band]

    def finish(t, mask):
        return torch.where(mask, t, torch.full_like(t, -1)).to(torch.int32)

    sched_valid = p < nb
    return CombinePlan(
        world_size=W, rank=rank, num_experts=E, experts_per_rank=El, tile_m=tile_m, mgb=mgb,
        band_capacity=B, segment_capacity=S,
        group_row_start=group_row_start.to(torch.int32),
        expert_rows=expert_rows.to(torch.int32),
        expert_row_start=expert_row_start.to(torch.int32),
        recv_rows_per_rank=recv_rows_per_rank.to(torch.int32),
        routed_counts=counts[rank].to(torch.int32),
        num_bands=nb.to(torch.int32),
        num_remote_bands=num_remote.to(torch.int32),
        num_segments=num_segments.to(torch.int32),
        total_rows=expert_rows.sum().reshape(1).to(torch.int32),
        valid_rows=local.sum().reshape(1).to(torch.int32),
        band_expert=finish(e, valid_b),
        band_row=finish(band_row, valid_b),
        band_src_row=finish(band_src_row, valid_b),
        band_dest=finish(s, valid_b),
        band_valid=finish(band_valid, valid_b),
        band_dest_row=finish(band_dest_row, valid_b),
        schedule=finish(schedule, sched_valid),
        segment_start=finish(seg_start, seg_valid),
        segment_bands=finish(seg_bands, seg_valid),
        segment_dest=finish(s[first_band], seg_valid),
        segment_src_row=finish(band_src_row[first_band], seg_valid),
        segment_dest_row=finish(band_dest_row[first_band], seg_valid),
        segment_rows=finish(seg_rows, seg_valid),
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
