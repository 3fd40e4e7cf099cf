"""Producer grouped GEMM: y[band] = x[band] @ w[band_expert[band]], one persistent launch.

This module is the host side, importable without CuTe DSL: the ``GroupedGemm`` wrapper (option
checks, argument checks, compile cache, launch), the torch reference and the tile-order mirror.
The device kernel is ``combine.grouped_gemm_sm90.GroupedGemmKernel``, a subclass of the shared
Hopper base ``kernels.gemm_sm90.GemmSm90`` (TMA loads into a multi-stage shared-memory ring, one
producer warp, WGMMA in one or two consumer warpgroups with fp32 accumulators, stmatrix + TMA
store epilogue, a per-band "ready" flag written with release semantics once all N/tile_n tiles
of the band are globally visible).

Tensors (all CUDA, no host synchronization anywhere in the call path):
    x            [rows, K]        bf16, row-major (stacked plan-layout input)
    w            [E_local, K, N]  bf16, N contiguous (the w_down layout; used as is, MN-major B)
    y            [rows, N]        bf16, row-major
    band_expert  [B_cap] int32    expert of band b
    band_src_row [B_cap] int32    first row of band b in x / y (a multiple of tile_m)
    schedule     [B_cap] int32    band ids in compute order
    num_bands    [1]     int32    valid prefix length of schedule
    band_ready   [B_cap] int32    persistent flags: band_ready[b] = epoch[0] when band b is final
    band_counter [B_cap] int32    persistent scratch, all zero between calls (we reset it)
    epoch        [1]     int32    read at kernel start
    err          [8]     int64    error word (the combine's; ``kernels/errors.py``)

Device bounds (a validate=False plan, or a plan for other buffers): the kernel checks each band
once per tile (``band_faults`` is the host mirror, ``grouped_gemm_reference`` follows it):
num_bands outside [0, B_cap] computes nothing; a schedule entry outside [0, num_bands),
band_expert outside [0, E_local), or band rows [r, r + tile_m) not a tile of x / y (r < 0,
r + tile_m > rows, r % tile_m != 0) skips that band: no load, no store to y, no count, no flag.
Each records ERR_PRODUCER_BOUNDS (code 9: schedule position, field, value, bound) in ``err``.
A skipped band's flag never comes; the consumer's band wait polls the error word and stops.

Work: linear tile t over (schedule position p in [0, num_bands), n tile); persistent CTA i takes
t = i, i + G, i + 2G, ... with G = number of SMs - ccta (a launch argument, not a recompile).
With the default cluster_n=2 (even N/tile_n), CTAs 2c and 2c+1 form a cluster that takes tiles
t, t+1 (same band) and shares the band's A tile by TMA multicast; G is rounded down to even.
tile_fetch="dynamic": CTA i's first tile is still i, but each next unit of cluster_n tiles comes
from a global counter (``kernels.tile_scheduler.ClusterTileFetch``: one atomic per unit by the
cluster's leader, handed to its walkers through shared memory), so a cluster that starts late
(its SMs busy with the consumer) takes only the tiles left instead of its 1/G share; the counter
is zeroed on the launch stream before each launch. Which CTA computes a tile changes, not the
tile: the output and the flags are bitwise the static ones.

Flags: each finished tile is counted on band_counter[b] (acq_rel atomic, gpu scope) once its TMA
stores are complete (wait_group 0 + fence.proxy.async.global); the tile that completes the band
resets the counter and stores band_ready[b] = epoch with release semantics.  The previous tile's
stores are waited for by the first consumer warp in the middle of the next tile's k loop (long
finished, so no stall); by default (flag_warp) that warp then hands the band to warp 2 of the
producer warpgroup, which does the atomic: its GPU-scope fence (MEMBAR.ALL.GPU) would otherwise
stall a WGMMA warpgroup.  See primitives.count_band_after_bulk_stores /
relay_band_after_bulk_stores for the memory-ordering argument.

Tile order (``kernels.tile_scheduler.BandTileScheduler``, mirrored by ``tile_order_reference``):
groups of band_group (default 8) schedule positions walk the n tiles together, one cluster of
tiles per band in turn, so the CTAs computing the same weight columns for up to 8 bands run side
by side and each weight slice is read from DRAM about once per group (band-major order streams a
whole expert's weights per wave, more than L2 holds at K=4096). Timings: bench/NOTES.md.
group_by="expert" reads each position's group from two per-position tables instead
(``combine.band_groups``: runs of one expert along the schedule, cut evenly where longer than
band_group, short runs packed by aligned windows of band_group positions), so that a group holds
whole experts where fixed groups cut across 2-3 of them; the tables are built on the device from
the plan's schedule / band_expert (one one-CTA launch per call on the call's stream, or passed
in as ``band_groups``), and every band's tiles are the same as with fixed groups (only their
order changes, not any tile's K reduction: the output is bitwise the same).
"""

import torch

from ..kernels.errors import (ERR_WORDS, PRF_EXPERT, PRF_NUM_BANDS, PRF_SCHEDULE,
                              PRF_SRC_ROW)
from ..kernels.host_checks import check_tensors
from ..runtime.device import num_sms
from .band_groups import GROUP_BY, WORKSPACE_TABLES, band_groups, check_group

__all__ = ["ARRIVAL_SCOPES", "TILE_FETCH", "GroupedGemm", "band_faults", "deinterleave_gate_up",
           "grouped_gemm_reference", "interleave_gate_up", "prepare_weights", "split_gate_up",
           "tile_order_reference", "up_projection_reference"]

ARRIVAL_SCOPES = ("gpu", "sys")  # scope of the arrival wait's acquire (wait_arrival=True)
DEFAULT_ARRIVAL_TIMEOUT_NS = 10_000_000_000
TILE_FETCH = ("static", "dynamic")  # how a persistent CTA finds its next tile (tile_fetch=)


# --------------------------------------------------------------------------------------------
# Plain torch reference (the truth the tests use)
# --------------------------------------------------------------------------------------------
def grouped_gemm_reference(x, w, y, band_expert, band_src_row, schedule, num_bands, tile_m,
                           band_ready=None, epoch=None, acc_dtype=torch.float32):
    """Reference semantics, in place on ``y`` (host-synchronizing; for tests only).

    for p in range(num_bands): b = schedule[p]; r = band_src_row[b]
        y[r:r+tile_m] = x[r:r+tile_m] @ w[band_expert[b]]  (fp32 accumulation, cast to y.dtype)
    and, if band_ready/epoch are given, band_ready[b] = epoch[0]; the positions ``band_faults``
    names (bad entries of a validate=False plan) are skipped, as the kernel skips them.
    """
    faults = band_faults(band_expert, band_src_row, schedule, num_bands, tile_m, x.shape[0],
                         w.shape[0], y.shape[0])
    if faults and faults[0][0] < 0:
        return y  # num_bands outside the tables: no band
    skip = {p for p, _, _, _ in faults}
    nb = int(num_bands.reshape(-1)[0].item())
    sched = schedule[:nb].tolist()
    be = band_expert.tolist()
    bs = band_src_row.tolist()
    for p, b in enumerate(sched):
        if p in skip:
            continue
        r, e = bs[b], be[b]
        y[r:r + tile_m] = (x[r:r + tile_m].to(acc_dtype) @ w[e].to(acc_dtype)).to(y.dtype)
        if band_ready is not None:
            band_ready[b] = epoch.reshape(-1)[0]
    return y


def band_faults(band_expert, band_src_row, schedule, num_bands, tile_m, x_rows, n_experts,
                y_rows=None):
    """The kernel's bounds checks in plain Python: [(schedule position, field, value, bound)]
    for every entry it refuses (fields: ``kernels.errors.PRODUCER_FIELDS``), in position order;
    [] for a valid plan. num_bands outside [0, len(schedule)] gives the one entry
    (-1, PRF_NUM_BANDS, num_bands, len(schedule)) (no band is computed). A band fails on the
    first of: its id outside [0, num_bands), its expert outside [0, n_experts), its rows
    [r, r + tile_m) outside [0, min(x_rows, y_rows)) or r not a multiple of tile_m. The kernel
    records one of them (whichever CTA gets there first)."""
    cap = len(schedule)
    nb = int(num_bands.reshape(-1)[0].item()) if hasattr(num_bands, "reshape") else int(num_bands)
    if not 0 <= nb <= cap:
        return [(-1, PRF_NUM_BANDS, nb, cap)]
    rows = x_rows if y_rows is None else min(x_rows, y_rows)
    sched = [int(v) for v in schedule[:nb].tolist()]
    be = [int(v) for v in band_expert.tolist()]
    bs = [int(v) for v in band_src_row.tolist()]
    out = []
    for p, b in enumerate(sched):
        if not 0 <= b < nb:
            out.append((p, PRF_SCHEDULE, b, nb))
        elif not 0 <= be[b] < n_experts:
            out.append((p, PRF_EXPERT, be[b], n_experts))
        elif not (0 <= bs[b] <= rows - tile_m and bs[b] % tile_m == 0):
            out.append((p, PRF_SRC_ROW, bs[b], rows))
    return out


def tile_order_reference(num_bands, n_tiles, cluster=1, group=1, tables=None):
    """The kernel's tile order (``kernels.tile_scheduler.BandTileScheduler.coords``) in plain
    Python: [(schedule position, n tile)] for linear tiles t = 0 .. num_bands * n_tiles - 1. For
    tests of the arithmetic. tables: (group_first, group_size) lists (group_by="expert",
    ``BandTileScheduler.walk``): the group of p0 = t // n_tiles is read from them (group unused;
    the kernel's checks of the entries are not mirrored here)."""
    out = []
    for t in range(num_bands * n_tiles):
        p, n = t // n_tiles, t % n_tiles
        if tables is not None:
            s0, g = tables[0][p], tables[1][p]
            u = t - s0 * n_tiles
            q = u // cluster
            p = s0 + q % g
            n = (q // g) * cluster + (u - q * cluster)
        elif group >= 2:
            s0 = (t // (group * n_tiles)) * group
            g = min(group, num_bands - s0)
            u = t - s0 * n_tiles
            q = u // cluster
            p = s0 + q % g
            n = (q // g) * cluster + (u - q * cluster)
        out.append((p, n))
    return out


def interleave_gate_up(w_gate_up, tile_n):
    """The SwiGLU kernel's weight layout: w_gate_up [E, K, 2I] (gate half first, as
    ``MoELayer.w_gate_up``) -> [E, K, 2I] with the halves interleaved in blocks of tile_n / 2
    columns: block 2j = gate[:, j h:(j+1) h], block 2j+1 = up[:, j h:(j+1) h] (h = tile_n / 2),
    so that N tile j of the GEMM holds the gate and up columns of output columns
    [j h, (j+1) h). I must be a multiple of h. A copy, made once per weight update."""
    E, K, N2 = w_gate_up.shape
    if N2 % tile_n:
        raise ValueError(f"2I={N2} must be a multiple of tile_n={tile_n}")
    h = tile_n // 2
    gate, up = w_gate_up[..., :N2 // 2], w_gate_up[..., N2 // 2:]
    return torch.stack([gate.reshape(E, K, -1, h), up.reshape(E, K, -1, h)],
                       dim=3).reshape(E, K, N2).contiguous()


def deinterleave_gate_up(w_interleaved, tile_n):
    """The inverse of ``interleave_gate_up``: [E, K, 2I] in the kernel's layout -> the gate half
    first (a copy)."""
    E, K, N2 = w_interleaved.shape
    if N2 % tile_n:
        raise ValueError(f"2I={N2} must be a multiple of tile_n={tile_n}")
    h = tile_n // 2
    blocks = w_interleaved.reshape(E, K, -1, 2, h)
    return torch.cat([blocks[..., 0, :].reshape(E, K, -1), blocks[..., 1, :].reshape(E, K, -1)],
                     dim=2).contiguous()


def split_gate_up(y, tile_n=None):
    """(gate, up) columns of y [rows, 2I] = x @ w_gate_up, for w_gate_up with the gate half
    first (tile_n None) or interleaved in blocks of tile_n / 2 (``interleave_gate_up``): views
    (halves) or copies (interleaved), each [rows, I] in output column order."""
    rows, N2 = y.shape
    if tile_n is None:
        return y.split(N2 // 2, dim=1)
    if N2 % tile_n:
        raise ValueError(f"2I={N2} must be a multiple of tile_n={tile_n}")
    blocks = y.reshape(rows, -1, 2, tile_n // 2)
    return blocks[:, :, 0, :].reshape(rows, -1), blocks[:, :, 1, :].reshape(rows, -1)


def up_projection_reference(x, w_gate_up, y, band_expert, band_src_row, schedule, num_bands,
                            tile_m, band_arrived=None, epoch=None):
    """The arrival-gated SwiGLU up-projection in torch, in place on y [rows, I] (tests only):
    for each scheduled band b (the skips of ``band_faults``), and, where ``band_arrived`` is
    given, only for bands with band_arrived[b] == epoch (a band that never arrived is not
    stored, as the kernel after its timeout):
        y[r:r+tile_m] = silu(x_b @ w_gate_up[e][:, :I]) * (x_b @ w_gate_up[e][:, I:])
    in fp32 (the products of the bf16 inputs accumulated in fp32), cast to y.dtype once. Takes
    the ``MoELayer`` layout (gate half first), not the kernel's interleaved one."""
    faults = band_faults(band_expert, band_src_row, schedule, num_bands, tile_m, x.shape[0],
                         w_gate_up.shape[0], y.shape[0])
    if faults and faults[0][0] < 0:
        return y
    skip = {p for p, _, _, _ in faults}
    nb = int(num_bands.reshape(-1)[0].item())
    half = w_gate_up.shape[2] // 2
    ep = None if epoch is None else int(epoch.reshape(-1)[0].item())
    for p, b in enumerate(schedule[:nb].tolist()):
        if p in skip:
            continue
        if band_arrived is not None and int(band_arrived[b].item()) != ep:
            continue
        r, e = int(band_src_row[b].item()), int(band_expert[b].item())
        h = x[r:r + tile_m].float() @ w_gate_up[e].float()
        y[r:r + tile_m] = (torch.nn.functional.silu(h[:, :half]) * h[:, half:]).to(y.dtype)
    return y


def prepare_weights(w):
    """Identity: the kernel reads w [E, K, N] (N contiguous) directly as an MN-major WGMMA B
    operand, so no pre-transposed copy is needed."""
    return w


# --------------------------------------------------------------------------------------------
# Host wrapper (the device kernel: combine/grouped_gemm_sm90.py, imported when compiling)
# --------------------------------------------------------------------------------------------
# Default band_group: 8 bands walk each weight slice together (measured against band-major,
# pairs and groups of 4: bench/NOTES.md, grouped GEMM v10-v11).
DEFAULT_BAND_GROUP = 8


class GroupedGemm:
    """Persistent grouped GEMM producer (see the module docstring for the tensors).

    GroupedGemm(tile_m=128, tile_n=256, tile_k=64, stages=None, signal=True, signal_k_tile=None,
                epi_n=32, epi_stages=4, cluster_n=None, flag_warp=None, band_group=8)
        tile_m in {64, 128}; tile_n in {64, 128, 256}; tile_k = 64 (bf16);
        stages: smem pipeline depth (None: as many as fit);
        signal: compile-time switch for the band flag epilogue (False: plain grouped GEMM);
        signal_k_tile: k iteration of the next tile at which the previous tile's flag is posted
        (its TMA stores must be complete then, so earlier = lower flag latency but the epilogue
        warp may stall on the stores); None: K/tile_k // 2, -1: the last k iteration;
        epi_n, epi_stages: epilogue sub-tile width (32 or 64) and its smem buffers;
        cluster_n: 2 = clusters of two CTAs (tiles 2q, 2q+1 of one band) sharing the A tile by
        TMA multicast; needs an even N/tile_n, and the grid is rounded down to even;
        None: 2 where N/tile_n is even, else 1;
        flag_warp: the consumer warp that issued a tile's stores waits for them but hands the
        band to an idle producer-warpgroup warp, which does the gpu-scope atomic and the ready
        store (no gpu-scope fence in a WGMMA warpgroup); needs signal; None (default): = signal;
        band_group: tile order. G >= 2 interleaves groups of G schedule positions at equal n
        tiles (one cluster of tiles per band in turn), so that the bands of an expert walk its
        weight columns together and each weight slice is read from DRAM about once; the flags of
        a group complete together, up to G bands' time later than band-major order for the
        group's first band. 1: band-major. Default DEFAULT_BAND_GROUP;
        group_by: "position" (default): groups of band_group consecutive schedule positions;
        "expert": groups cut at expert boundaries (``combine.band_groups``: runs of one expert,
        split evenly where longer than band_group, runs of <= band_group packed by aligned
        windows), read from per-position tables built on the device each call (one small
        launch, or ``band_groups=`` passed in); band_group is then the most positions a group
        holds (<= band_groups.MAX_GROUP);
        cluster_slack: beside ccta consumer CTAs, leave cluster_n x ccta SMs out of the grid
        (not ccta): each consumer CTA can break at most one free SM pair, so every cluster of the
        persistent grid finds its SMs wherever the consumer's CTAs land (no second wave);
        tile_fetch: "static" (default): CTA i takes tiles i, i + G, ...; "dynamic": after tile i,
        each cluster takes the next unit of cluster_n tiles from a global counter (kept per
        device, zeroed on the call's stream before each launch: one memset node more in a CUDA
        graph), so that clusters that start late (a second wave beside the consumer) take only
        the tiles left; same output bits. One launch at a time per object and device (the
        counter is shared by its calls);
        skip_padding: a band with at most tile_m / 2 valid rows (``band_valid``: the plan's
        count, its valid rows a prefix of the band) runs no WGMMA in the MMA warpgroup of rows
        tile_m / 2 .. tile_m - 1: that half of the tensor-core work of an expert's short tail
        band is padding. Those rows of y are then 0; the valid rows are bitwise the same (each
        warpgroup accumulates its own rows). Needs the two MMA warpgroups (tile_m 128, tile_n
        256). The loads stay: the saving is the MMA time, not the A and B traffic.
    All option checks are ``GroupedGemm.check_options`` (a static function, no CuTe DSL needed).

    __call__(x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready, epoch,
             ccta=0, band_counter=None, stream=None, err=None, rank=0, band_groups=None,
             band_arrived=None, band_valid=None) -> y
        band_counter: persistent int32 [>= len(band_ready)] zero scratch; allocated (zeros) and
        kept per device if not given.  stream: a torch.cuda.Stream (default: current stream).
        err: int64 [8] error word the kernel records a refused band entry in (ERR_PRODUCER_BOUNDS,
        naming ``rank``); default: one kept per device (``error_word(device)``).
        band_groups: group_by="expert" only: (group_first, group_size) int32 [B_cap] made
        beforehand by ``band_groups.band_groups`` for this schedule and G (e.g. once per plan, off
        the call's path); None: built here on the call's stream (one launch, into a workspace
        kept per device and capacity).
        band_valid: skip_padding only (and needed there): int32 [B_cap], valid rows of each
        band (``CombinePlan.band_valid``).
    Compile cache key: (tile config, stages, signal, flag options, band_group, group_by, N, K,
    and the non-default wait_arrival / swiglu / tile_fetch / skip_padding);
    rows, E_local, B_cap and the grid size (number of SMs - ccta) are runtime values.
    """

    _compiled = {}

    @staticmethod
    def check_options(tile_m=128, tile_n=256, tile_k=64, stages=None, signal=True,
                      signal_k_tile=None, epi_n=32, epi_stages=4, cluster_n=None, flag_warp=None,
                      band_group=DEFAULT_BAND_GROUP, group_by="position", wait_arrival=False,
                      arrival_scope="gpu", arrival_timeout_ns=DEFAULT_ARRIVAL_TIMEOUT_NS,
                      swiglu=False, tile_fetch="static", skip_padding=False):
        """ValueError for any option value the kernel does not implement (CPU only, no CuTe
        DSL); the keywords are the constructor's."""
        if tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n must be 64, 128 or 256, got {tile_n}")
        if tile_k != 64:
            raise ValueError(f"tile_k must be 64 for bf16, got {tile_k}")
        if epi_n not in (32, 64) or epi_n > tile_n:
            raise ValueError(f"epi_n must be 32 or 64 (<= tile_n), got {epi_n}")
        if epi_stages < 1:
            raise ValueError(f"epi_stages must be >= 1, got {epi_stages}")
        if cluster_n not in (None, 1, 2):
            raise ValueError(f"cluster_n must be None, 1 or 2, got {cluster_n}")
        if flag_warp and not signal:
            raise ValueError("flag_warp needs signal=True")
        if isinstance(band_group, bool) or not isinstance(band_group, int) or band_group < 1:
            raise ValueError(f"band_group must be an int >= 1, got {band_group!r}")
        if group_by not in GROUP_BY:
            raise ValueError(f"group_by={group_by!r}; choose from {GROUP_BY}")
        if group_by == "expert":
            check_group(band_group)
        if wait_arrival and signal:
            raise ValueError("wait_arrival (a consumer of arrival flags) needs signal=False: "
                             "the up-projection raises no band flags")
        if arrival_scope not in ARRIVAL_SCOPES:
            raise ValueError(f"arrival_scope={arrival_scope!r}; choose from {ARRIVAL_SCOPES}")
        if isinstance(arrival_timeout_ns, bool) or not isinstance(arrival_timeout_ns, int) \
                or arrival_timeout_ns < 1:
            raise ValueError(f"arrival_timeout_ns must be an int >= 1, got {arrival_timeout_ns!r}")
        if swiglu and epi_n > tile_n // 2:
            raise ValueError(f"swiglu pairs the halves of a tile: epi_n={epi_n} must be <= "
                             f"tile_n / 2 = {tile_n // 2}")
        if not isinstance(tile_fetch, str) or tile_fetch not in TILE_FETCH:
            raise ValueError(f"tile_fetch={tile_fetch!r}; choose from {TILE_FETCH}")
        if not isinstance(skip_padding, bool):
            raise ValueError(f"skip_padding must be a bool, got {skip_padding!r}")
        if skip_padding and not (tile_m == 128 and tile_n > 128):
            raise ValueError(f"skip_padding skips the second MMA warpgroup's rows; tile_m="
                             f"{tile_m}, tile_n={tile_n} has one (it needs tile_m 128 and "
                             "tile_n 256)")

    def __init__(self, tile_m=128, tile_n=256, tile_k=64, stages=None, signal=True,
                 signal_k_tile=None, epi_n=32, epi_stages=4, cluster_n=None, flag_warp=None,
                 band_group=DEFAULT_BAND_GROUP, group_by="position", wait_arrival=False,
                 arrival_scope="gpu", arrival_timeout_ns=DEFAULT_ARRIVAL_TIMEOUT_NS,
                 swiglu=False, cluster_slack=False, tile_fetch="static", skip_padding=False):
        GroupedGemm.check_options(tile_m, tile_n, tile_k, stages, signal, signal_k_tile, epi_n,
                                  epi_stages, cluster_n, flag_warp, band_group, group_by,
                                  wait_arrival, arrival_scope, arrival_timeout_ns, swiglu,
                                  tile_fetch, skip_padding)
        self.tile_fetch = tile_fetch
        self.skip_padding = skip_padding
        self.wait_arrival = bool(wait_arrival)
        self.arrival_scope = arrival_scope
        self.arrival_timeout_ns = int(arrival_timeout_ns)
        self.swiglu = bool(swiglu)
        self.cluster_slack = bool(cluster_slack)
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.stages = stages
        self.signal = bool(signal)
        self.signal_k_tile = None if signal_k_tile is None else int(signal_k_tile)
        self.epi_n, self.epi_stages = int(epi_n), int(epi_stages)
        self.cluster_n = cluster_n
        self.flag_warp = bool(signal) if flag_warp is None else bool(flag_warp)
        self.band_group = band_group
        self.group_by = group_by
        self._counters = {}
        self._errors = {}
        self._group_ws = {}  # group_by="expert": the tables' workspace per (device, B_cap)
        self._fetch_counters = {}  # tile_fetch="dynamic": the work counter per (device, B_cap)

    def grid_size(self, sms: int, ccta: int, N: int) -> int:
        """The persistent grid's CTAs on a device of ``sms`` SMs beside ``ccta`` consumer CTAs:
        the SMs left (less cluster_n - 1 more per consumer CTA with cluster_slack), rounded down
        to whole clusters."""
        cluster = self.cluster_for(N)
        grid = sms - ccta * (cluster if self.cluster_slack else 1)
        return grid - grid % cluster

    def cluster_for(self, N):
        """Cluster size used for output width N."""
        if self.cluster_n is not None:
            return self.cluster_n
        return 2 if (N // self.tile_n) % 2 == 0 else 1

    # ---------------------------------------------------------------- validation
    def _check(self, x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready, epoch,
               band_counter, ccta, need_cuda=True, err=None, rank=0, band_groups=None,
               band_arrived=None, band_valid=None):
        tensors = dict(x=x, w=w, y=y, band_expert=band_expert, band_src_row=band_src_row,
                       schedule=schedule, num_bands=num_bands, band_ready=band_ready, epoch=epoch)
        if band_counter is not None:
            tensors["band_counter"] = band_counter
        check_tensors(tensors, x, need_cuda)
        for name in ("x", "w", "y"):
            if tensors[name].dtype != torch.bfloat16:
                raise TypeError(f"{name} must be bfloat16, got {tensors[name].dtype}")
        for name in ("band_expert", "band_src_row", "schedule", "num_bands", "band_ready",
                     "epoch") + (("band_counter",) if band_counter is not None else ()):
            if tensors[name].dtype != torch.int32:
                raise TypeError(f"{name} must be int32, got {tensors[name].dtype}")
        if x.dim() != 2 or y.dim() != 2 or w.dim() != 3:
            raise ValueError(f"expected x [rows, K], w [E, K, N], y [rows, N]; got "
                             f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(y.shape)}")
        rows, K = x.shape
        E, Kw, N = w.shape
        if Kw != K:
            raise ValueError(f"K mismatch: x has K={K}, w has K={Kw}")
        n_out = N // 2 if self.swiglu else N
        if y.shape[0] != rows or y.shape[1] != n_out:
            raise ValueError(f"y must be [{rows}, {n_out}], got {tuple(y.shape)}")
        if N % self.tile_n != 0:
            raise ValueError(f"N={N} must be a multiple of tile_n={self.tile_n}")
        if (N // self.tile_n) % self.cluster_for(N) != 0:
            raise ValueError(f"N/tile_n={N // self.tile_n} must be a multiple of "
                             f"cluster_n={self.cluster_for(N)}")
        if K % self.tile_k != 0:
            raise ValueError(f"K={K} must be a multiple of tile_k={self.tile_k}")
        if E < 1 or rows < 1:
            raise ValueError("w needs at least one expert and x at least one row")
        b_cap = band_ready.numel()
        for name in ("band_expert", "band_src_row", "schedule"):
            if tensors[name].dim() != 1 or tensors[name].numel() != b_cap:
                raise ValueError(f"{name} must be 1-D of length {b_cap} (= len(band_ready))")
        if num_bands.numel() != 1 or epoch.numel() != 1:
            raise ValueError("num_bands and epoch must have exactly one element")
        if band_counter is not None and band_counter.numel() < b_cap:
            raise ValueError(f"band_counter needs >= {b_cap} elements")
        if not isinstance(ccta, int) or ccta < 0:
            raise ValueError(f"ccta must be a non-negative int, got {ccta!r}")
        if err is not None and (not isinstance(err, torch.Tensor) or err.dtype != torch.int64
                                or err.numel() != ERR_WORDS or not err.is_contiguous()
                                or err.device != x.device):
            raise ValueError(f"err must be a contiguous int64 [{ERR_WORDS}] tensor on "
                             f"{x.device}, got {err!r:.80}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        for name, t, on, what in (
                ("band_arrived", band_arrived, self.wait_arrival, "arrival flags of wait_arrival"),
                ("band_valid", band_valid, self.skip_padding, "valid rows of skip_padding")):
            if on != (t is not None):
                raise ValueError(f"{name} is the {what}=True (and needed there)")
            if t is not None and (
                    not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1
                    or t.numel() != b_cap or t.device != x.device or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous int32 [{b_cap}] tensor on "
                                 f"{x.device}")
        if band_groups is not None:
            if self.group_by != "expert":
                raise ValueError("band_groups are the tables of group_by='expert'; this GEMM "
                                 f"has group_by={self.group_by!r}")
            if not isinstance(band_groups, (tuple, list)) or len(band_groups) != 2:
                raise ValueError("band_groups must be (group_first, group_size)")
            for name, t in zip(("group_first", "group_size"), band_groups):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 \
                        or t.numel() != b_cap or t.device != x.device or not t.is_contiguous():
                    raise ValueError(f"band_groups' {name} must be a contiguous int32 [{b_cap}] "
                                     f"tensor on {x.device}")
        return rows, K, E, N

    # ---------------------------------------------------------------- compilation
    def _key(self, N, K):
        return (self.tile_m, self.tile_n, self.tile_k, self.stages, self.signal,
                self.signal_k_tile, self.epi_n, self.epi_stages, self.cluster_for(N),
                self.flag_warp, self.band_group, self.group_by, int(N), int(K)) + (
                    (self.wait_arrival, self.arrival_scope, self.arrival_timeout_ns, self.swiglu)
                    if self.wait_arrival or self.swiglu else ()) + (
                    ("dynamic",) if self.tile_fetch == "dynamic" else ()) + (
                    ("skip_padding",) if self.skip_padding else ())

    def _kernel(self, N):
        from .grouped_gemm_sm90 import GroupedGemmKernel
        return GroupedGemmKernel(self.tile_m, self.tile_n, self.tile_k, self.stages, self.signal,
                                 self.signal_k_tile, self.epi_n, self.epi_stages,
                                 self.cluster_for(N), self.flag_warp, self.band_group,
                                 self.group_by == "expert", self.wait_arrival,
                                 self.arrival_scope, self.arrival_timeout_ns, self.swiglu,
                                 self.tile_fetch, self.skip_padding)

    def compile(self, N, K, keep_ptx=False):
        """Compiles (or fetches from the cache) the kernel for output width N and depth K from
        symbolic ("fake") tensors: rows, E_local and B_cap are runtime values.  Needs no GPU when
        CUTE_DSL_ARCH=sm_90a is set (used by the compile-only tests).  keep_ptx: keep the PTX
        (``fn.__ptx__``; files go to CUTE_DSL_DUMP_DIR)."""
        key = ("fake", bool(keep_ptx)) + self._key(N, K)
        fn = GroupedGemm._compiled.get(key)
        if fn is not None:
            return fn
        import cutlass.cute as cute
        fn = cute.compile(self._kernel(N), *self.example_args(N, K, self.group_by == "expert",
                                                              self.wait_arrival, self.swiglu,
                                                              self.tile_fetch == "dynamic",
                                                              self.skip_padding),
                          options="--keep-ptx" if keep_ptx else None)
        GroupedGemm._compiled[key] = fn
        return fn

    @staticmethod
    def example_args(N, K, group_tables=False, arrived=False, swiglu=False, fetch=False,
                     valid=False):
        """The kernel's arguments as symbolic ("fake") tensors, rows / E_local / B_cap dynamic,
        for ``cute.compile`` without a GPU (``compile``, and the tests that keep the cubin);
        group_tables: with the two band group tables (group_by="expert"); arrived: with the
        arrival flags (wait_arrival); fetch: with the work counter (tile_fetch="dynamic"); valid:
        with the bands' valid rows (skip_padding); None in the places of the optional ones
        before the last given; swiglu: y is [rows, N / 2]."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor
        from cutlass.runtime import make_fake_stream
        rows, E, bcap = cute.sym_int(), cute.sym_int(), cute.sym_int()
        bf16, i32 = cutlass.BFloat16, cutlass.Int32
        fv = lambda: make_fake_tensor(i32, (bcap,), (1,), assumed_align=4)  # noqa: E731
        f1 = lambda: make_fake_tensor(i32, (1,), (1,), assumed_align=4)  # noqa: E731
        # x, w (N, K, E view), y; band_expert, band_src_row, schedule, num_bands, band_ready,
        # band_counter, epoch; err, rank, grid, stream
        return (make_fake_tensor(bf16, (rows, K), (K, 1), assumed_align=16),
                make_fake_tensor(bf16, (N, K, E), (1, N, K * N), assumed_align=16),
                make_fake_tensor(bf16, (rows, N // 2 if swiglu else N),
                                 (N // 2 if swiglu else N, 1), assumed_align=16),
                fv(), fv(), fv(), f1(), fv(), fv(), f1(), cutlass.Int64(0),
                cutlass.Int32(0), cutlass.Int32(1), make_fake_stream()) + GroupedGemm._trailing(
                    (fv(), fv()) if group_tables else None, fv() if arrived else None,
                    f1() if fetch else None, fv() if valid else None)

    @staticmethod
    def _trailing(tables, arrived, fetch, valid=None):
        """The kernel's optional trailing arguments (group tables, arrival flags, work counter,
        the bands' valid rows): None in the places of those not given before the last one
        given, nothing after it."""
        tail = (tables or (None, None)) + (arrived, fetch, valid)
        while tail and tail[-1] is None:
            tail = tail[:-1]
        return tail

    # ---------------------------------------------------------------- launch
    @staticmethod
    def _cute_args(x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready,
                   band_counter, epoch, band_groups=None):
        """torch -> cute tensors (the kernel's leading tensors, and its trailing group tables
        where given).  rows / E_local / B_cap are marked dynamic (no recompile for a new
        routing); N and K stay static."""
        from cutlass.cute.runtime import from_dlpack

        def dyn(t, mode, align):
            return from_dlpack(t, assumed_align=align).mark_compact_shape_dynamic(
                mode=mode, stride_order=t.dim_order())

        wt = w.permute(2, 1, 0)  # (N, K, E) view, strides (1, N, K*N): MN-major B
        lead = (dyn(x, 0, 16), dyn(wt, 2, 16), dyn(y, 0, 16), dyn(band_expert, 0, 4),
                dyn(band_src_row, 0, 4), dyn(schedule, 0, 4), from_dlpack(num_bands, assumed_align=4),
                dyn(band_ready, 0, 4), dyn(band_counter[:band_ready.numel()], 0, 4),
                from_dlpack(epoch, assumed_align=4))
        return lead, (() if band_groups is None else tuple(dyn(t, 0, 4) for t in band_groups))

    def error_word(self, device):
        """The int64[8] error word this wrapper keeps for ``device`` (used by calls that pass no
        ``err``): zeros until a launch refused a band entry (``describe_error`` decodes it)."""
        device = torch.device(device)
        word = self._errors.get(device)
        if word is None:
            word = self._errors[device] = torch.zeros(ERR_WORDS, dtype=torch.int64,
                                                      device=device)
        return word

    def fetch_counter(self, device, capacity, stream=None):
        """The work counter of tile_fetch="dynamic" for ``device`` (int32 [1], kept per (device,
        capacity) like the band counter), zeroed on ``stream`` (default: the current one; a
        memset: capturable in a CUDA graph, so every replay starts from zero). The kernel's
        atomic on it hands out the units past the first wave; a launch that started from a
        stale count would skip tiles."""
        if self.tile_fetch != "dynamic":
            raise ValueError(f"the work counter is for tile_fetch='dynamic', this GEMM has "
                             f"tile_fetch={self.tile_fetch!r}")
        device = torch.device(device)
        key = (device, int(capacity))
        counter = self._fetch_counters.get(key)
        if counter is None:
            counter = self._fetch_counters[key] = torch.zeros(1, dtype=torch.int32,
                                                              device=device)
        if device.type == "cuda":
            with torch.cuda.stream(stream if stream is not None
                                   else torch.cuda.current_stream(device)):
                counter.zero_()
        else:
            counter.zero_()
        return counter

    def band_groups(self, schedule, band_expert, num_bands, stream=None):
        """This GEMM's band group tables (group_by="expert") for a plan's schedule, on
        ``stream`` (default: the current one), no host sync: (group_first, group_size), views
        of a workspace kept per (device, capacity) and rewritten by the next call of this
        object (``combine.band_groups.band_groups`` with ``out=None`` for tables to keep)."""
        if self.group_by != "expert":
            raise ValueError(f"band groups are tables of group_by='expert', not "
                             f"{self.group_by!r}")
        key = (schedule.device, schedule.numel())
        ws = self._group_ws.get(key)
        if ws is None:
            ws = self._group_ws[key] = torch.empty(WORKSPACE_TABLES * schedule.numel(),
                                                   dtype=torch.int32, device=schedule.device)
        return band_groups(schedule, band_expert, num_bands, self.band_group, out=ws,
                           impl="kernel", stream=stream)

    def __call__(self, x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready, epoch,
                 ccta=0, band_counter=None, stream=None, err=None, rank=0, band_groups=None,
                 band_arrived=None, band_valid=None):
        """band_arrived: int32 [B_cap], the arrival flags (wait_arrival only): band b's A rows
        are read once band_arrived[b] == epoch[0]. band_valid: int32 [B_cap], valid rows per
        band (skip_padding only). With swiglu, w is the interleaved layout
        (``interleave_gate_up``) and y [rows, N / 2]."""
        rows, K, E, N = self._check(x, w, y, band_expert, band_src_row, schedule, num_bands,
                                    band_ready, epoch, band_counter, ccta, err=err, rank=rank,
                                    band_groups=band_groups, band_arrived=band_arrived,
                                    band_valid=band_valid)
        if err is None:
            err = self.error_word(x.device)
        grid = self.grid_size(num_sms(x.device), ccta, N)
        if grid < 1:
            raise ValueError(f"ccta={ccta} leaves no SM for the producer")
        if band_counter is None:
            key = (x.device, band_ready.numel())
            band_counter = self._counters.get(key)
            if band_counter is None:
                band_counter = torch.zeros(band_ready.numel(), dtype=torch.int32, device=x.device)
                self._counters[key] = band_counter
        import cutlass
        import cutlass.cute as cute
        import cuda.bindings.driver as cuda_drv
        torch_stream = stream if stream is not None else torch.cuda.current_stream(x.device)
        cu_stream = cuda_drv.CUstream(torch_stream.cuda_stream)
        if self.group_by == "expert" and band_groups is None:
            band_groups = self.band_groups(schedule, band_expert, num_bands, torch_stream)
        args, tables = self._cute_args(x, w, y, band_expert, band_src_row, schedule, num_bands,
                                       band_ready, band_counter, epoch, band_groups)
        from cutlass.cute.runtime import from_dlpack
        arrived = None if band_arrived is None else from_dlpack(
            band_arrived, assumed_align=4).mark_compact_shape_dynamic(mode=0)
        fetch = None
        if self.tile_fetch == "dynamic":  # zeroed right before the launch, on its stream
            fetch = from_dlpack(self.fetch_counter(x.device, band_ready.numel(), torch_stream),
                                assumed_align=4)
        valid = None if band_valid is None else from_dlpack(
            band_valid, assumed_align=4).mark_compact_shape_dynamic(mode=0)
        tables = self._trailing(tables or None, arrived, fetch, valid)
        key = ("dlpack",) + self._key(N, K)
        fn = GroupedGemm._compiled.get(key)
        if fn is None:
            fn = cute.compile(self._kernel(N), *args, cutlass.Int64(err.data_ptr()),
                              cutlass.Int32(rank), cutlass.Int32(grid), cu_stream, *tables)
            GroupedGemm._compiled[key] = fn
        fn(*args, cutlass.Int64(err.data_ptr()), cutlass.Int32(rank), cutlass.Int32(grid),
           cu_stream, *tables)
        return y
