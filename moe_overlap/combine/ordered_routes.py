"""The ordered scale's per-routing tables, on the device, without host synchronization.

``OverlapCombine.prepare`` with ``scale="ordered"`` needs, per routing, the tile tables of the
ordered scale (combine/scale_ordered.py) and the per-segment increment of the owner's expectation.
``ordered_scale.ordered_routes`` is their reference: on the host, every sender's plan rebuilt
exactly, Python loops over senders and tiles and data-dependent sizes (``torch.unique``, boolean
masks, ``.item()``). ``ordered_routes_device`` computes the same values with torch ops on the
inputs' device: a number of launches fixed by (W, T, topk, tile_tokens), no host read, no output
whose size depends on data, so it can run inside a CUDA graph:

1. the senders' segments: ``plan_combine(counts, s, max_rows=M, validate=False, impl=)`` for every
   s != rank, where M gives the owner's plan's capacities (every rank plans at the same max_rows,
   ``MoECombine.plan``), so each rebuilt plan is the sender's own plan; plan_combine's valid
   prefix does not depend on max_rows, so its segments are the reference's exact plans' too.
   Only each plan's segment count and (dest, dest row, rows) per segment are kept ([W, 1 + 3 Sc],
   one copy per sender); the owner's plan is the one passed in (its bands and layout).
2. row -> signal: the receive row r of each (t, k) (``plan.recv_rows``). A remote row's segment
   is the segment to this rank with the largest first row <= r: the segments to one owner cover
   disjoint row ranges (one sender's cells are disjoint, senders' experts are), so one scatter-amax
   of (first row, segment id) keys over the owner's R = T * topk receive rows and a cummax find it
   for every row at once. A local row's band: its y row // tile_m (as ``row_dependencies``).
3. order: the reference's completion key (``completion_keys``, the same integer expressions) and
   its stable sort of every token's largest key; tiles are the fixed cuts of ``tile_tokens``.
4. each tile's distinct (kind, source, index), ascending (``torch.unique(dim=0)``'s order): one
   sort of (tile, kind, source, index) keys over all R assignments; a tile's keys occupy a fixed
   range of the sorted array (its tokens x topk), so its first distinct entry is the number of
   distinct keys before that range (an inclusive cumsum read at fixed places), and the distinct
   keys are gathered into a fixed capacity by a searchsorted on that cumsum.
5. ``seg_inc[s, i]`` = rows of sender s's segment i if it goes to this rank, else 0, and
   ``seg_count[s]`` = sender s's num_segments (0 for this rank): the valid prefix of row s
   (``add_seg_inc`` reads nothing past it; the kernel path writes nothing past it).

Padded-table contract (what ``OrderedScale`` may be given): ``order [T]``, ``tile_start`` and
``dep_start`` ``[n_tiles + 1]`` are exact (n_tiles = ceil(T / tile_tokens): the tiles are fixed
cuts, so ``tile_start`` is the same on both paths); ``dep_kind``, ``dep_source`` and ``dep_index``
have the capacity T * topk (a tile has at most tile_tokens * topk distinct signals), their valid
prefix is ``dep_start[n_tiles]`` long and the rest is -1. The kernel takes n_tiles from
``tile_start``'s length and reads tile j's entries ``dep_start[j] .. dep_start[j + 1]`` only, so it
never reads the padding (and an entry of -1 would be a remote signal of source -1, which it reports
as ERR_PLAN_BOUNDS instead of waiting). ``OrderedScale.check`` checks the lengths that are host
facts (dep_start as long as tile_start, the three dependency arrays equally long).

Errors: the reference raises ValueError for inconsistent inputs (topk_ids not matching
expert_counts[rank], a sender's plan not shipping a row, segments beyond the capacity). Raising
needs a host read, so here they are checked with ``validate=True`` only (a host sync, as
``plan_combine(validate=)``); with ``validate=False`` the caller vouches for the inputs, bad ones
give wrong tables (never an out-of-bounds access: every gathered index is clamped). Segments beyond
the capacity cannot happen on this path: the rebuilt plans have the owner's segment capacity.
"""
from __future__ import annotations

import torch

from .checks import as_int, check_expert_ids
from .ordered_scale import (DEFAULT_TILE_TOKENS, KEY_BUCKETS, LOCAL, REMOTE, OrderedRoutes,
                            RowDeps)
from .plan import CombinePlan, IMPLS, plan_combine, recv_rows

# OverlapCombine.prepare(ordered_impl=): "device" (this module: sync-free, CUDA-graph
# capturable) or "host" (ordered_scale.ordered_routes: the reference, which checks its inputs)
ORDERED_IMPLS = ("device", "host")

# ordered_routes_device(impl=): the torch ops of this module, the kernels of
# combine/ordered_routes_kernel.py, or "auto" (the kernels where they can run)
TABLES_IMPLS = ("auto", "torch", "kernel")

TABLE_NAMES = ("order", "tile_start", "dep_start", "dep_kind", "dep_source", "dep_index")


def _use_kernel(impl, topk_ids, expert_counts, k, tile_tokens, return_deps) -> bool:
    """Whether ordered_routes_device takes the kernel path (impl resolved, once per call)."""
    if impl == "torch":
        return False
    from .ordered_routes_kernel import OrderedRoutesKernel
    from .plan_kernel import kernel_available
    ok, why = OrderedRoutesKernel.can_implement(expert_counts.shape[1], k, tile_tokens,
                                                topk_ids.dtype, expert_counts.dtype)
    if impl == "auto":
        return topk_ids.is_cuda and not return_deps and ok and kernel_available()
    if return_deps:
        raise ValueError("return_deps=True needs impl='torch' (the kernel keeps no row signals)")
    if not topk_ids.is_cuda:
        raise ValueError(f"impl='kernel' needs CUDA tensors, got {topk_ids.device}")
    if not ok:
        raise ValueError(f"impl='kernel' cannot run this: {why}")
    return True


def sender_max_rows(plan: CombinePlan) -> int:
    """The largest max_rows whose plans have ``plan``'s capacities (band_capacity_for: max_rows //
    tile_m + El * W bands): the senders' plans rebuilt with it are sized as the owner's."""
    return (plan.band_capacity - plan.experts_per_rank * plan.world_size + 1) * plan.tile_m - 1


def _check_host_facts(topk_ids, expert_counts, plan, tile_tokens):
    """Shapes, dtypes, devices and sizes (no data read). Returns (W, E, T, k, tile_tokens)."""
    if not isinstance(plan, CombinePlan):
        raise TypeError(f"plan must be a CombinePlan, got {type(plan).__name__}")
    for name, t in (("topk_ids", topk_ids), ("expert_counts", expert_counts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    W, E = plan.world_size, plan.num_experts
    if tuple(expert_counts.shape) != (W, E):
        raise ValueError(f"expert_counts must be [W={W}, E={E}] (the plan's), got "
                         f"{tuple(expert_counts.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [tokens, topk >= 1], got {tuple(topk_ids.shape)}")
    devs = {topk_ids.device, expert_counts.device, plan.device}
    if len(devs) != 1:
        raise ValueError(f"topk_ids, expert_counts and the plan must be on one device, got "
                         f"{sorted(map(str, devs))}")
    try:
        tile_tokens = as_int("tile_tokens", tile_tokens, minimum=1)
    except ValueError:
        raise ValueError(f"tile_tokens must be an int >= 1, got {tile_tokens!r}") from None
    T, k = topk_ids.shape
    # every table entry (tokens, receive rows, segment / band ids, dependency counts) < 2^31
    if T * k >= 2 ** 31 or plan.segment_capacity >= 2 ** 31:
        raise ValueError(f"T * topk = {T * k} or segment capacity {plan.segment_capacity} does "
                         f"not fit the int32 tables")
    return W, E, T, k, tile_tokens


def _validate_inputs(topk_ids, expert_counts, plan, max_rows, plan_impl):
    """The reference's checks of the inputs the tables are made from (reads data: a host sync
    on CUDA): ids in range and counted by expert_counts[rank], the owner's plan made from these
    counts at these capacities."""
    W, E = expert_counts.shape
    check_expert_ids(topk_ids, E)
    mine = torch.zeros(E, dtype=torch.int64, device=topk_ids.device).index_add_(
        0, topk_ids.reshape(-1).long(), torch.ones(topk_ids.numel(), dtype=torch.int64,
                                                   device=topk_ids.device))
    if not torch.equal(mine, expert_counts[plan.rank].long()):
        raise ValueError("topk_ids do not match expert_counts[rank]")
    own = plan_combine(expert_counts, plan.rank, tile_m=plan.tile_m, mgb=plan.mgb,
                       max_rows=max_rows, validate=True, layout=plan.layout, impl=plan_impl,
                       order=plan.order)
    for name, t in own.tensors().items():
        if not torch.equal(t, getattr(plan, name)):
            raise ValueError(f"the plan is not rank {plan.rank}'s plan of expert_counts (its "
                             f"{name} differs): pass the plan made from these counts")


def _sender_segments(expert_counts, plan, max_rows, plan_impl, validate):
    """int32 [W, 1 + 3 Sc]: per rank s != plan.rank its plan's num_segments, then segment_dest,
    segment_dest_row and segment_rows (Sc each; -1 past num_segments, as the plan); the owner's
    row is -1 (its own segments never go to itself)."""
    W, Sc, rank = plan.world_size, plan.segment_capacity, plan.rank
    segs = torch.full((W, 1 + 3 * Sc), -1, dtype=torch.int32, device=expert_counts.device)
    for s in range(W):
        if s == rank:
            continue
        p = plan_combine(expert_counts, s, tile_m=plan.tile_m, mgb=plan.mgb, max_rows=max_rows,
                         validate=validate, layout=plan.layout, impl=plan_impl, order=plan.order)
        # one copy per sender; the plan (one buffer on the kernel path) is freed right after
        torch.cat([p.num_segments, p.segment_dest, p.segment_dest_row, p.segment_rows],
                  out=segs[s])
    return segs


def _row_dependencies(ids, expert_counts, plan, segs, validate):
    """RowDeps of the owner's (t, k) (``ordered_scale.row_dependencies``) from its plan and the
    senders' segment tables (``_sender_segments``)."""
    W, E = expert_counts.shape
    El, rank, Sc, B, tile_m = E // W, plan.rank, plan.segment_capacity, plan.band_capacity, \
        plan.tile_m
    dev = ids.device
    R = ids.numel()  # the owner's receive rows: one per (t, k) assignment
    idc = ids.clamp(0, E - 1)  # in range for the gathers below (validate checks the ids)
    r = recv_rows(ids, E)
    dest = idc // El
    local = dest == rank
    # remote: the segment to this rank whose first row is the largest <= r, as one int64 key
    # (first row, segment id) per segment, scatter-max'ed at its first row, forward-filled
    sdst, slo, srows = (segs[:, 1 + f * Sc:1 + (f + 1) * Sc].long() for f in range(3))
    to_me = (sdst == rank) & (slo >= 0) & (slo < R)
    sid = torch.arange(W * Sc, dtype=torch.int64, device=dev)
    mark = torch.full((R + 1,), -1, dtype=torch.int64, device=dev).scatter_reduce_(
        0, torch.where(to_me, slo, R).reshape(-1),
        torch.where(to_me.reshape(-1), slo.reshape(-1) * (W * Sc) + sid, -1), reduce="amax")
    hit = torch.cummax(mark[:R], 0).values[r.reshape(-1)].view(ids.shape)  # -1: no segment <= r
    seg = (hit % (W * Sc)).clamp(min=0)  # s * Sc + i (0 where hit < 0)
    remote_index = torch.where(hit >= 0, seg % Sc, -1)
    if validate:  # every remote row inside a segment of its expert's rank to this rank
        lo, n = slo.reshape(-1)[seg], srows.reshape(-1)[seg]
        covered = (hit >= 0) & (seg // Sc == dest) & (r >= lo) & (r < lo + n)
        bad = ~local & ~covered
        if bool(bad.any()):
            s = int(dest[bad][0])
            raise ValueError(f"rank {s}'s plan ships no segment holding some row of rank {rank}")
    # local: the y row (routes.source_rows_torch) and its band
    cnt = expert_counts[rank].long()
    first = torch.cumsum(cnt, 0) - cnt
    el = (idc - rank * El).clamp(0, El - 1)
    yrow = (plan.expert_row_start.long()[el] + plan.group_row_start.long()[el, rank] + r
            - first[idc])
    band = (yrow // tile_m).clamp(0, B - 1)
    return RowDeps(kind=torch.where(local, LOCAL, REMOTE), source=dest,
                   index=torch.where(local, band, remote_index), row=torch.where(local, yrow, r))


def _completion_keys(deps, plan, segs):
    """[T, k] int64: ``ordered_scale.completion_keys`` (the same integer expressions): a local
    band's (schedule position * KEY_BUCKETS) // num_bands, a remote segment's (index *
    KEY_BUCKETS) // its sender's num_segments (at least 1)."""
    B = plan.band_capacity
    dev = deps.kind.device
    pos_b = torch.arange(B, dtype=torch.int64, device=dev)
    nb = plan.num_bands.long()
    sched = plan.schedule.long()
    valid = (pos_b < nb) & (sched >= 0) & (sched < B)
    # the key of each scheduled band (distinct bands: amax over one value; invalid schedule
    # slots go to the extra entry B)
    pos = torch.zeros(B + 1, dtype=torch.int64, device=dev).scatter_reduce_(
        0, torch.where(valid, sched, B), pos_b * KEY_BUCKETS // nb.clamp(min=1), reduce="amax")
    nseg = segs[:, 0].long().clamp(min=1)
    local_key = pos[deps.index.clamp(0, B)]
    remote_key = deps.index.clamp(min=0) * KEY_BUCKETS // nseg[deps.source]
    return torch.where(deps.kind == LOCAL, local_key, remote_key)


def _tile_tables(deps, key, tile_tokens, W, Sc):
    """The kernel's tables (int32, padded as the module doc says) from the row signals and their
    completion keys."""
    T, k = deps.kind.shape
    dev = deps.kind.device
    R = T * k
    n = -(-T // tile_tokens)
    # tokens by completion, ties by token id (token_tiles: a stable sort of the same keys)
    order = torch.sort(key.max(1).values, stable=True).indices
    j = torch.arange(n + 1, dtype=torch.int64, device=dev)
    tile_start = (j * tile_tokens).clamp(max=T)
    # one int64 key per (t, k) in processing order: tile, then (kind, source, index + 1)
    span = Sc + 1  # index in [-1, Sc)
    per_tile = 2 * W * span
    code = ((deps.kind * W + deps.source) * span + deps.index.clamp(-1, Sc - 1) + 1)[order]
    tile_of = torch.arange(T, dtype=torch.int64, device=dev) // tile_tokens
    sk = torch.sort((tile_of[:, None] * per_tile + code).reshape(-1)).values
    new = torch.ones(R, dtype=torch.bool, device=dev)
    new[1:] = sk[1:] != sk[:-1]
    distinct = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev),
                          torch.cumsum(new.long(), 0)])  # [R + 1]: distinct keys before i
    dep_start = distinct[(j * tile_tokens * k).clamp(max=R)]
    # slot d of the dependency arrays: the (d + 1)-th distinct key (first i with distinct[i + 1]
    # >= d + 1); slots from distinct[R] on are padding
    d = torch.arange(R, dtype=torch.int64, device=dev)
    at = torch.searchsorted(distinct[1:], d + 1).clamp(max=max(R - 1, 0))
    valid = d < distinct[R:]
    c = sk[at] % per_tile if R else sk
    kind, src, idx = c // (W * span), (c // span) % W, c % span - 1

    def pad(t):
        return torch.where(valid, t, -1).to(torch.int32)
    return {"order": order.to(torch.int32), "tile_start": tile_start.to(torch.int32),
            "dep_start": dep_start.to(torch.int32), "dep_kind": pad(kind),
            "dep_source": pad(src), "dep_index": pad(idx)}


def ordered_routes_device(topk_ids: torch.Tensor, expert_counts: torch.Tensor, plan: CombinePlan,
                          tile_tokens: int = DEFAULT_TILE_TOKENS, plan_impl: str = "auto",
                          validate: bool = True, return_deps: bool = False, impl: str = "auto",
                          rows: torch.Tensor | None = None) -> OrderedRoutes:
    """The owner's ordered-scale inputs for one routing (``ordered_scale.ordered_routes``'s
    values) on the device of the inputs; no host sync with ``validate=False``.

    topk_ids: int [T, topk] this rank's routing (int32 or int64).
    expert_counts: int [W, E] the all-gathered counts the plans of every rank were made from.
    plan: this rank's ``CombinePlan`` of those counts, made with the max_rows every rank plans
        with (``MoECombine.plan``: W x max_tokens_per_rank x topk); its tile_m, mgb, layout, order
        and capacities are the senders' too. Sc = ``plan.segment_capacity``.
    tile_tokens: tokens per tile (int >= 1).
    plan_impl: ``plan_combine(impl=)`` of the senders' rebuilt plans ("auto": the planner kernel
        on CUDA where CuTe DSL imports, torch otherwise; all give the same tensors).
    validate: run the reference's input checks first (ValueError for ids out of range or not
        matching expert_counts[rank], a plan not made from these counts, a sender receiving more
        rows than the capacity, a remote row no segment ships): reads data, a host sync on CUDA.
        False: sync-free (CUDA graphs); the caller vouches for the inputs.
    return_deps: also return the row signals (``RowDeps``, int64 [T, topk] each) for tests
        (the torch path only: impl="kernel" is refused with it).
    impl: "torch" (the steps of the module doc as torch ops, ~200 launches), "kernel"
        (combine/ordered_routes_kernel.py: six launches plus prepare_routes' two when ``rows``
        is None; CUDA and CuTe DSL) or "auto" (the kernel where it can run, else torch).
    rows: int32 [T, topk], optional: ``prepare_routes(topk_ids, E, W, rank, local_copy=False,
        plan)`` of this routing, if already computed. The kernel path needs them: None makes
        it compute them (on the current stream, the senders' plans on a side stream under
        them) and return them as ``OrderedRoutes.rows`` (None on the torch path).

    Returns ``OrderedRoutes`` with ``tiles=None`` (the kernel needs only the tables), ``tables``:
    int32 on the device, padded as the module doc says (order [T], tile_start / dep_start
    [n_tiles + 1], dep_kind / dep_source / dep_index [T * topk]), ``seg_inc``: int64 [W, Sc]
    (what ``begin_call`` adds to the cumulative per-segment expectation, ``add_seg_inc``) valid
    up to ``seg_count`` int32 [W] per row (0 past it on the torch path, unwritten on the
    kernel path); with return_deps, (that, RowDeps)."""
    W, E, T, k, tile_tokens = _check_host_facts(topk_ids, expert_counts, plan, tile_tokens)
    if plan_impl not in IMPLS:
        raise ValueError(f"plan_impl={plan_impl!r}; choose from {IMPLS}")
    if impl not in TABLES_IMPLS:
        raise ValueError(f"impl={impl!r}; choose from {TABLES_IMPLS}")
    max_rows = sender_max_rows(plan)
    if validate:
        _validate_inputs(topk_ids, expert_counts, plan, max_rows, plan_impl)
    use_kernel = _use_kernel(impl, topk_ids, expert_counts, k, tile_tokens, return_deps)
    if use_kernel:
        from .ordered_routes_kernel import ordered_tables_kernel
        if rows is not None and (tuple(rows.shape) != (T, k) or rows.device != topk_ids.device):
            raise ValueError(f"rows must be [T={T}, topk={k}] on {topk_ids.device} (prepare_"
                             f"routes' rows of this routing), got {tuple(rows.shape)} on "
                             f"{rows.device}")
        tables, seg_inc, seg_count, rows = ordered_tables_kernel(topk_ids, expert_counts, plan,
                                                                 tile_tokens, rows)
        return OrderedRoutes(tiles=None, tables=tables, seg_inc=seg_inc, seg_count=seg_count,
                             rows=rows)
    segs = _sender_segments(expert_counts, plan, max_rows, plan_impl, validate)
    deps = _row_dependencies(topk_ids.long(), expert_counts, plan, segs, validate)
    key = _completion_keys(deps, plan, segs)
    Sc = plan.segment_capacity
    tables = _tile_tables(deps, key, tile_tokens, W, Sc)
    sdst = segs[:, 1:1 + Sc]
    srows = segs[:, 1 + 2 * Sc:]
    seg_inc = torch.where(sdst == plan.rank, srows.long(), 0)
    out = OrderedRoutes(tiles=None, tables=tables, seg_inc=seg_inc,
                        seg_count=segs[:, 0].clamp(min=0))
    return (out, deps) if return_deps else out


def add_seg_inc(seg_expected: torch.Tensor, seg_inc: torch.Tensor,
                seg_count: torch.Tensor) -> None:
    """``seg_expected[s, :seg_count[s]] += seg_inc[s, :seg_count[s]]`` in place, on the current
    stream, no host sync: the owner's per-call advance of its cumulative per-segment expectation
    (``OverlapCombine.begin_call``). Only the routing's segments are read and written (one
    kernel on CUDA, ``ordered_routes_kernel``), not the table's capacity; the rest of
    ``seg_expected`` is left as it is (no sender's consumer counts arrivals there this call).

    seg_expected: int64 [W, Sc], contiguous; seg_inc: int64 [W, Sc] (``OrderedRoutes.seg_inc``,
    anything past the prefix); seg_count: int [W] (``OrderedRoutes.seg_count``, clamped to
    [0, Sc]). All on one device."""
    W, Sc = seg_expected.shape
    if (seg_expected.dtype != torch.int64 or seg_inc.dtype != torch.int64
            or tuple(seg_inc.shape) != (W, Sc) or tuple(seg_count.shape) != (W,)
            or not seg_expected.is_contiguous()
            or len({seg_expected.device, seg_inc.device, seg_count.device}) != 1):
        raise ValueError(f"add_seg_inc: seg_expected and seg_inc int64 [W={W}, Sc={Sc}] (the "
                         f"first contiguous) and seg_count [W] on one device; got "
                         f"{seg_inc.dtype} {tuple(seg_inc.shape)}, seg_count "
                         f"{tuple(seg_count.shape)}")
    if seg_expected.is_cuda:
        from .ordered_routes_kernel import seg_add
        seg_add(seg_expected, seg_inc.contiguous(), seg_count.to(torch.int32).contiguous())
        return
    valid = torch.arange(Sc, device=seg_count.device)[None, :] < seg_count.long()[:, None]
    seg_expected.add_(torch.where(valid, seg_inc, 0))
