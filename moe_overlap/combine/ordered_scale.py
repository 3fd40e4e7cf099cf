"""Token-ordered scale: the reference of its ordering, and a simulator of its exposed time.

The owner's scale (``scale.py``) computes out[t] = sum_k w[t, k] * row(t, k) only after the last
arrival. The ordered scale (bench/NOTES.md, "Session 11") does token tiles in the order in which
their rows become available, each tile waiting for exactly the signals its rows need, so most of
the scale runs before the last arrival. This module is the CPU reference of what the device side
needs and of what it should gain:

- ``row_dependencies``: for every (t, k) of the owner's tokens, the signal that makes its row
  available: a remote row arrives with segment i of its expert's rank s (the owner rebuilds
  every sender's plan from the all-gathered counts: ``plan_combine`` is deterministic), a local
  row is final once band b of the owner's own y is (``band_ready``);
- ``dependency_times`` / ``flow_times``: the predicted time of each signal from a two-stage flow
  model (each rank's GEMM completes its bands in schedule order at the cost model's rate, its
  consumer ships segments in order at its copy rate once their bands are ready);
- ``token_tiles``: tokens sorted by completion (the time of their last dependency; ties by token
  id), cut into tiles of ``tile_tokens``; per tile the distinct dependencies (CSR), and the compact
  per-source maximum segment (informative only: a source's segments do not complete in order,
  its pieces are spread over the consumer's CTAs, so a tile waits on its list);
- ``seg_expected_inc``: rows of each sender's segment to the owner (what the owner's cumulative
  per-segment expectation advances by per call);
- ``simulate``: the call's predicted end for today's scale (after every arrival), design A (the
  ordered scale launched after the producer) and design B (A plus the consumer's CTAs as scale
  workers once their pieces are shipped), and each over the bound max(T_gemm, T_comm).

``OverlapCombine`` builds the tables with ``ordered_routes.ordered_routes_device`` (the same
values on the device, no host sync); ``ordered_routes`` here is its reference.

The order only affects speed: a tile waits for its own dependencies, so any order is correct.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .plan import plan_combine, recv_rows
from .tuning import CostModel

# tokens per tile: 4096 tokens make 256 tiles, about one per CTA of the ordered scale's grid
# (bench/NOTES.md, session 12: 32-token tiles left most of the grid idle)
DEFAULT_TILE_TOKENS = 16
# completion_keys' integer range: one bucket per thread of the device sort's CTA
KEY_BUCKETS = 1024

LOCAL, REMOTE = 0, 1


def sender_plans(expert_counts: torch.Tensor, tile_m: int = 128, mgb: int = 1,
                 layout: str = "auto", order: str = "remote_first") -> list:
    """Every rank's plan, as each rank builds it (exact rows, torch reference; the same tile_m,
    mgb, layout and order as the senders')."""
    W = expert_counts.shape[0]
    return [plan_combine(expert_counts, s, tile_m=tile_m, mgb=mgb, layout=layout, impl="torch",
                         order=order)
            for s in range(W)]


@dataclass
class RowDeps:
    """Per (t, k) of the owner's tokens (tensors [T, k], int64): kind (LOCAL / REMOTE), source
    (the expert's rank: the owner for local rows), index (the source's segment for remote rows,
    the owner's band id for local ones), row (receive row for remote, y row for local)."""
    kind: torch.Tensor
    source: torch.Tensor
    index: torch.Tensor
    row: torch.Tensor


def row_dependencies(topk_ids: torch.Tensor, expert_counts: torch.Tensor, rank: int,
                     plans: list) -> RowDeps:
    """Which signal makes each (t, k) row of this rank's tokens available (see the module doc).
    ``plans[s]``: rank s's plan (``sender_plans``); ``expert_counts[s]`` must be the counts of
    rank s's routing (``expert_counts[rank]`` those of ``topk_ids``)."""
    W, E = expert_counts.shape
    if len(plans) != W:
        raise ValueError(f"need the plans of all {W} ranks, got {len(plans)}")
    if not 0 <= rank < W:
        raise ValueError(f"rank={rank} out of range for world size {W}")
    El = E // W
    ids = topk_ids.long()
    mine = torch.bincount(ids.reshape(-1), minlength=E)
    if mine.numel() != E or not torch.equal(mine, expert_counts[rank].long()):
        raise ValueError("topk_ids do not match expert_counts[rank]")
    r = recv_rows(ids, E)  # receive row on the owner
    dest = ids // El
    kind = torch.where(dest == rank, LOCAL, REMOTE)
    index = torch.full_like(ids, -1)
    row = r.clone()
    # remote: the segment of sender dest whose receive range on this rank holds r
    for s in range(W):
        if s == rank:
            continue
        p = plans[s]
        ns = int(p.num_segments.item())
        sd = p.segment_dest[:ns].long()
        mine_seg = torch.nonzero(sd == rank).reshape(-1)
        m = dest == s
        if not bool(m.any()):
            continue
        lo = p.segment_dest_row[:ns].long()[mine_seg]
        order = torch.argsort(lo)
        lo_sorted, seg_sorted = lo[order], mine_seg[order]
        hi_sorted = lo_sorted + p.segment_rows[:ns].long()[seg_sorted]
        pos = torch.searchsorted(lo_sorted, r[m], right=True) - 1
        if bool((pos < 0).any()) or bool((r[m] >= hi_sorted[pos.clamp(min=0)]).any()):
            raise ValueError(f"rank {s}'s plan ships no segment holding some row of rank {rank}")
        index[m] = seg_sorted[pos]
    # local: y row (as routes.source_rows_torch) and its band
    p = plans[rank]
    cnt = expert_counts[rank].long()
    first = torch.cumsum(cnt, 0) - cnt
    el = (ids - rank * El).clamp(0, El - 1)
    yrow = (p.expert_row_start.long()[el] + p.group_row_start.long()[el, rank] + r - first[ids])
    loc = kind == LOCAL
    row[loc] = yrow[loc]
    index[loc] = yrow[loc] // p.tile_m
    return RowDeps(kind=kind, source=dest, index=index, row=row)


def seg_expected_inc(plans: list, rank: int, capacity: int | None = None) -> torch.Tensor:
    """[W, Sc] int64: rows of sender s's segment i to ``rank`` (0 for segments to other ranks and
    for the own rank): what the owner's cumulative per-segment expectation advances by per call.
    capacity: Sc (default: the largest plan's segment capacity)."""
    W = len(plans)
    Sc = max(p.segment_capacity for p in plans) if capacity is None else int(capacity)
    out = torch.zeros(W, Sc, dtype=torch.int64)
    for s, p in enumerate(plans):
        if s == rank:
            continue
        ns = int(p.num_segments.item())
        if ns > Sc:
            raise ValueError(f"rank {s}'s plan has {ns} segments > capacity {Sc}")
        to_me = p.segment_dest[:ns].long() == rank
        out[s, :ns] = torch.where(to_me, p.segment_rows[:ns].long(), 0)
    return out


def seg_counts(plans: list, rank: int) -> torch.Tensor:
    """int32 [W]: the valid prefix of each sender's row of ``seg_expected_inc`` (its plan's
    num_segments; 0 for ``rank``)."""
    return torch.tensor([0 if s == rank else int(p.num_segments.item())
                         for s, p in enumerate(plans)], dtype=torch.int32)


# ---- timing model --------------------------------------------------------------------------
@dataclass
class ScaleModel:
    """Rates of the ordered-scale simulation. ``cost``: GEMM and consumer rates (tuning.py).
    scale_tbs: the scale's HBM rate on every SM (measured 4.0: bench/NOTES.md, "Scale kernel");
    worker_gbps_per_sm: its rate per consumer SM (not measured yet: the unknown of design B);
    latency_us: wait + launch latency before a scale part starts; begin_us: the call's
    bookkeeping. gemm_ms / ship_gbps / gemm_all_ms: measured overrides (the GEMM on its SMs,
    the consumer's rate, the GEMM on every SM for the bound) in place of the cost model's."""
    cost: CostModel = field(default_factory=CostModel)
    scale_tbs: float = 4.0
    worker_gbps_per_sm: float = 60.0
    latency_us: float = 5.0
    begin_us: float = 5.0
    gemm_ms: float | None = None
    ship_gbps: float | None = None
    gemm_all_ms: float | None = None


def flow_times(plan, N: int, K: int, ccta: int, model: ScaleModel, t0: float = 0.0):
    """Predicted times (s) on one rank: (band_done [band_capacity] (inf for invalid bands),
    seg_arrival [num_segments], gemm_end, ship_end). Bands finish in schedule order at an even
    rate over the GEMM (every band is tile_m x N); segment i can leave once its last band is done
    and ships after segment i - 1 at the consumer's rate (one aggregate flow over its CTAs)."""
    nb, _, ns = plan.counts()
    rows = nb * plan.tile_m
    t_gemm = (model.gemm_ms * 1e-3 if model.gemm_ms is not None
              else model.cost.gemm_s(2.0 * rows * N * K, ccta))
    bw = (model.ship_gbps * 1e9 if model.ship_gbps is not None else model.cost.copy_bw(ccta))
    pos = torch.empty(plan.band_capacity, dtype=torch.float64).fill_(float("inf"))
    sched = plan.schedule[:nb].long()
    pos[sched] = torch.arange(1, nb + 1, dtype=torch.float64)
    band_done = t0 + pos / max(nb, 1) * t_gemm
    seg_arr = torch.zeros(ns, dtype=torch.float64)
    t = t0 + model.cost.signal_us * 1e-6
    starts = plan.segment_start[:ns].long()
    last = plan.schedule.long()[(starts + plan.segment_bands[:ns].long() - 1).clamp(min=0)]
    nbytes = plan.segment_rows[:ns].double() * N * 2
    for i in range(ns):
        t = max(t, float(band_done[last[i]])) + float(nbytes[i]) / bw
        seg_arr[i] = t
    return band_done, seg_arr, t0 + t_gemm, (t if ns else t0)


def dependency_times(deps: RowDeps, rank: int, band_done: list, seg_arrival: list):
    """[T, k] float64: time each row is available (its band's or segment's)."""
    t = torch.zeros(deps.kind.shape, dtype=torch.float64)
    loc = deps.kind == LOCAL
    t[loc] = band_done[rank][deps.index[loc]]
    for s in range(len(seg_arrival)):
        m = (deps.kind == REMOTE) & (deps.source == s)
        if bool(m.any()):
            t[m] = seg_arrival[s][deps.index[m]]
    return t


@dataclass
class TokenTiles:
    """The ordered scale's work list. order [T]: token ids in processing order; tile_start
    [n_tiles + 1]: tile j is order[tile_start[j]:tile_start[j + 1]]; key [n_tiles]: completion
    time of each tile (the max of its tokens'); deps CSR (dep_start [n_tiles + 1]; dep_kind,
    dep_source, dep_index): each tile's distinct (kind, source, index) dependencies;
    max_segment [n_tiles, W]: per source the largest segment index the tile needs (-1: none)."""
    order: torch.Tensor
    tile_start: torch.Tensor
    key: torch.Tensor
    dep_start: torch.Tensor
    dep_kind: torch.Tensor
    dep_source: torch.Tensor
    dep_index: torch.Tensor
    max_segment: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.tile_start.numel() - 1


def token_tiles(deps: RowDeps, row_time: torch.Tensor, tile_tokens: int = DEFAULT_TILE_TOKENS) -> TokenTiles:
    """Sort tokens by completion (the time of their last row; ties: token id) and cut them into
    tiles of ``tile_tokens``; each tile's distinct dependencies."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be an int >= 1, got {tile_tokens!r}")
    T, k = deps.kind.shape
    W = int(deps.source.max().item()) + 1 if T else 1
    done = row_time.max(1).values if T else torch.zeros(0, dtype=torch.float64)
    # stable sort by time: ties keep token order
    order = torch.sort(done, stable=True).indices
    starts = list(range(0, T, tile_tokens)) + [T]
    tile_start = torch.tensor(starts, dtype=torch.int64)
    n = len(starts) - 1
    key = torch.stack([done[order[a:b]].max() for a, b in zip(starts, starts[1:])]) if n \
        else torch.zeros(0, dtype=torch.float64)
    dep_start, dk, dsrc, didx = [0], [], [], []
    max_seg = torch.full((n, max(W, 1)), -1, dtype=torch.int64)
    for j, (a, b) in enumerate(zip(starts, starts[1:])):
        tok = order[a:b]
        trip = torch.stack([deps.kind[tok].reshape(-1), deps.source[tok].reshape(-1),
                            deps.index[tok].reshape(-1)], 1)
        u = torch.unique(trip, dim=0)  # sorted: kind, source, index
        dk.append(u[:, 0])
        dsrc.append(u[:, 1])
        didx.append(u[:, 2])
        dep_start.append(dep_start[-1] + u.shape[0])
        rem = u[u[:, 0] == REMOTE]
        if rem.numel():
            max_seg[j].scatter_reduce_(0, rem[:, 1], rem[:, 2], reduce="amax")
    cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64))
    return TokenTiles(order=order, tile_start=tile_start, key=key,
                      dep_start=torch.tensor(dep_start, dtype=torch.int64), dep_kind=cat(dk),
                      dep_source=cat(dsrc), dep_index=cat(didx), max_segment=max_seg)


def tile_tables(tiles: TokenTiles, device=None) -> dict:
    """The ordered scale kernel's tables (int32, contiguous, on ``device``): order, tile_start,
    dep_start, dep_kind, dep_source, dep_index (moe_overlap/combine/scale_ordered.py)."""
    names = ("order", "tile_start", "dep_start", "dep_kind", "dep_source", "dep_index")
    out = {}
    for n in names:
        t = getattr(tiles, n)
        if t.numel() and (int(t.max()) >= 2 ** 31 or int(t.min()) < -2 ** 31):
            raise ValueError(f"{n} does not fit int32")
        out[n] = t.to(device=device, dtype=torch.int32).contiguous()
    return out


# ---- simulation ------------------------------------------------------------------------------
def _run_queue(keys, work, phases):
    """Fluid in-order queue: tile j starts at max(its key, the end of tile j - 1) and drains
    work[j] bytes at the piecewise-constant rate of ``phases`` [(start time, bytes / s), ...]
    (ascending start times; nothing runs before the first). Returns the end of the last tile."""
    starts = [ts for ts, _ in phases]
    t = starts[0]
    for kj, wj in zip(keys, work):
        t = max(t, kj)
        left = wj
        while left > 0:
            i = max(i for i, ts in enumerate(starts) if ts <= t)
            rate = phases[i][1]
            nxt = starts[i + 1] if i + 1 < len(starts) else float("inf")
            if rate <= 0:
                t = nxt
            elif t + left / rate <= nxt:
                t, left = t + left / rate, 0.0
            else:
                left -= (nxt - t) * rate
                t = nxt
    return t


def simulate(topk_ids_all: list, expert_counts: torch.Tensor, N: int, K: int, ccta: int,
             tile_m: int = 128, mgb: int = 2, layout: str = "auto", tile_tokens: int = DEFAULT_TILE_TOKENS,
             model: ScaleModel | None = None) -> dict:
    """Predicted times (ms) of one call on every rank (topk_ids_all[s]: rank s's routing):
    per rank ``today`` (scale after every arrival and the GEMM), ``A`` (ordered, launched after
    the producer), ``B`` (A plus the consumer's CTAs as workers from the end of their shipping);
    the call is the slowest rank. ``bound`` = max(T_gemm on every SM, T_comm)."""
    model = model or ScaleModel()
    W = expert_counts.shape[0]
    plans = sender_plans(expert_counts, tile_m, mgb, layout)
    t0 = model.begin_us * 1e-6
    flows = [flow_times(p, N, K, ccta, model, t0) for p in plans]
    band_done = [f[0] for f in flows]
    seg_arr = [f[1] for f in flows]
    lat = model.latency_us * 1e-6
    full = model.scale_tbs * 1e12
    worker = model.worker_gbps_per_sm * 1e9 * ccta
    out = {"ranks": []}
    for o in range(W):
        deps = row_dependencies(topk_ids_all[o], expert_counts, o, plans)
        times = dependency_times(deps, o, band_done, seg_arr)
        tiles = token_tiles(deps, times, tile_tokens)
        T, k = deps.kind.shape
        per_tok = (k + 1) * N * 2.0  # k rows read, one written
        work = [per_tok * float(tiles.tile_start[j + 1] - tiles.tile_start[j])
                for j in range(tiles.num_tiles)]
        keys = [float(x) for x in tiles.key]
        gemm_end = flows[o][2]
        last_arrival = max([float(seg_arr[s][deps.index[(deps.kind == REMOTE)
                                                         & (deps.source == s)]].max())
                            for s in range(W) if s != o and bool(((deps.kind == REMOTE)
                                                                 & (deps.source == s)).any())]
                           or [t0])
        ship_end = flows[o][3]
        scale_full = per_tok * T / full
        today = max(gemm_end, last_arrival) + lat + scale_full
        a = _run_queue(keys, work, [(gemm_end + lat, full)]) if T else gemm_end
        # the consumer's CTAs help only where they finish shipping before the GEMM ends; from
        # the GEMM's end every SM works and the scale is HBM-bound at the full rate
        phases = ([(ship_end + lat, worker)] if ship_end < gemm_end else []) \
            + [(gemm_end + lat, full)]
        b = _run_queue(keys, work, phases) if T else gemm_end
        end_common = max(gemm_end, ship_end)
        out["ranks"].append({"today": max(today, end_common), "A": max(a, end_common),
                             "B": max(b, end_common), "gemm_end": gemm_end,
                             "ship_end": ship_end, "last_arrival": last_arrival,
                             "scale_full": scale_full, "tiles": tiles.num_tiles,
                             "deps_per_tile": (float(tiles.dep_start[-1]) / tiles.num_tiles
                                               if tiles.num_tiles else 0.0)})
    rows_all = [int(p.counts()[0]) * tile_m for p in plans]
    remote = [int(p.segment_rows[:p.counts()[2]].clamp(min=0).sum()) for p in plans]
    t_gemm_all = (model.gemm_all_ms * 1e-3 if model.gemm_all_ms is not None
                  else max(model.cost.gemm_s(2.0 * r * N * K, 0) for r in rows_all))
    bw = model.ship_gbps * 1e9 if model.ship_gbps is not None else model.cost.copy_bw(ccta)
    t_comm = max(r * N * 2 / bw for r in remote) + model.cost.signal_us * 1e-6 + t0
    bound = max(t_gemm_all, t_comm)
    res = {"bound": bound * 1e3, "t_gemm_all": t_gemm_all * 1e3, "t_comm": t_comm * 1e3}
    for name in ("today", "A", "B"):
        v = max(r[name] for r in out["ranks"])
        res[name] = v * 1e3
        res[name + "_over_bound"] = v / bound
    for key in ("gemm_end", "ship_end", "last_arrival", "scale_full", "deps_per_tile"):
        res[key] = max(r[key] for r in out["ranks"]) * (1 if key == "deps_per_tile" else 1e3)
    res["tiles"] = max(r["tiles"] for r in out["ranks"])
    return res


# ---- the host reference of OverlapCombine(scale="ordered")'s tables --------------------------
# (the device path, which OverlapCombine uses: combine/ordered_routes.py, bit for bit the same)
@dataclass
class OrderedRoutes:
    """What one routing needs for the ordered scale on the owner: the tiles (``token_tiles``;
    None from ``ordered_routes.ordered_routes_device``, which builds only the kernel's tables),
    their kernel tables (int32; ``tile_tables``, exact, on the host here; padded on the device
    path, see combine/ordered_routes.py), ``seg_inc`` int64 [W, Sc] (``seg_expected_inc``:
    what ``begin_call`` adds to the cumulative expectation) and ``seg_count`` int32 [W], the
    valid prefix of each sender's row of seg_inc (its plan's num_segments; 0 for the owner,
    whose own segments never come to it): ``begin_call`` adds only that prefix, and the kernel
    path writes nothing past it, so no step costs in proportion to the capacity Sc (the host
    and torch paths zero the rest)."""
    tiles: TokenTiles | None
    tables: dict
    seg_inc: torch.Tensor
    seg_count: torch.Tensor
    rows: torch.Tensor | None = None  # prepare_routes' rows where the kernel path made them


def completion_keys(deps: RowDeps, plans: list, rank: int) -> torch.Tensor:
    """[T, k] int64: a cheap stand-in of each row's availability time for the tile order (the
    order only affects speed), an integer in [0, KEY_BUCKETS): a local band's schedule position
    p over the owner's nb bands as (p * KEY_BUCKETS) // nb, a remote segment's index i over its
    sender's ns segments as (i * KEY_BUCKETS) // ns (both complete roughly in schedule order).
    Integers, so the device's stable sort of the tokens is a counting sort over KEY_BUCKETS
    values (combine/ordered_routes_kernel.py); keys closer than 1 / KEY_BUCKETS of a schedule
    share a bucket and keep token order."""
    key = torch.zeros(deps.kind.shape, dtype=torch.int64)
    p = plans[rank]
    nb = int(p.num_bands.item())
    pos = torch.zeros(max(p.band_capacity, 1), dtype=torch.int64)
    if nb:
        pos[p.schedule[:nb].long()] = torch.arange(nb, dtype=torch.int64) * KEY_BUCKETS // nb
    loc = deps.kind == LOCAL
    key[loc] = pos[deps.index[loc]]
    for s, q in enumerate(plans):
        m = (deps.kind == REMOTE) & (deps.source == s)
        if bool(m.any()):
            key[m] = deps.index[m] * KEY_BUCKETS // max(1, int(q.num_segments.item()))
    return key


def ordered_routes(topk_ids: torch.Tensor, expert_counts: torch.Tensor, rank: int, tile_m: int,
                   mgb: int, layout: str, seg_cap: int, tile_tokens: int = DEFAULT_TILE_TOKENS,
                   order: str = "remote_first") -> OrderedRoutes:
    """The owner's ordered-scale inputs for one routing, on the host (CPU tensors; the
    reference of ``ordered_routes.ordered_routes_device``): every sender's plan rebuilt from the
    all-gathered ``expert_counts`` [W, E] (as each rank builds it: same tile_m, mgb, layout,
    order), each row's signal, tiles in completion order and the per-segment increment of the
    expectation, with Sc = ``seg_cap`` (ValueError if a sender's plan has more segments).
    topk_ids: int [T, topk] this rank's routing; rank: this rank; tile_m, mgb, layout, order:
    the plans' (``plan_combine``); tile_tokens: tokens per tile."""
    counts = expert_counts.detach().to("cpu", torch.int64)
    ids = topk_ids.detach().to("cpu", torch.int64)
    plans = sender_plans(counts, tile_m=tile_m, mgb=mgb, layout=layout, order=order)
    deps = row_dependencies(ids, counts, rank, plans)
    tiles = token_tiles(deps, completion_keys(deps, plans, rank), tile_tokens=tile_tokens)
    return OrderedRoutes(tiles=tiles, tables=tile_tables(tiles),
                         seg_inc=seg_expected_inc(plans, rank, capacity=seg_cap),
                         seg_count=seg_counts(plans, rank))
