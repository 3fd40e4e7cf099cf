"""The producer grouped GEMM's device kernel: ``GroupedGemmKernel``, a ``GemmSm90`` subclass.

y[band] = x[band] @ w[band_expert[band]] for the bands of ``schedule``, one persistent launch;
the host wrapper, the tensors' contract and the torch reference are in ``combine.grouped_gemm``.
What this subclass adds to the base's mainloop pieces:

* the schedule: ``BandTileScheduler`` over (schedule position, n tile), the band -> expert /
  first-row indirection read on the device, with its bounds checks (``band_tile``: once per tile,
  scalar): ``num_bands`` outside [0, capacity] computes no band, a schedule entry outside
  [0, num_bands), an expert outside w, or a band whose rows are not a tile of x / y skips that
  band (no load, no store, no count, no flag); either records ERR_PRODUCER_BOUNDS in the combine's
  error word (first writer wins). ``group_tables`` (GroupedGemm(group_by="expert")): the group
  of the tile's position p0 = t // n_tiles is read from the per-position tables
  (``combine.band_groups``) instead of fixed multiples of band_group; an entry that does not
  hold p0 inside [0, num_bands) (group_first outside [0, p0], or its end outside
  (p0, num_bands]) skips the tile and records the same error (tables that partition the
  schedule, as ``band_groups`` makes, are refused group by group: no band is half computed).
  Every warp walks the same tiles, so the pipeline stays matched; a skipped band's flag never
  comes, and the consumer's band wait stops at the error word;
* clusters of ``cluster_n`` CTAs along N sharing the band's A tile by TMA multicast;
* ``tile_fetch="dynamic"``: after its first (static) tile, a cluster's next unit of cluster_n
  tiles comes from a global counter (``kernels.tile_scheduler.ClusterTileFetch``: the rank-0
  CTA's TMA warp fetches, a shared-memory ring hands the unit to every other tile walker of the
  cluster); ``band_tile``'s skip of a refused band fetches the next unit too, so every walker
  still walks the same tiles;
* the epilogue: acc -> bf16 -> stmatrix -> TMA store per epi_n-column sub-tile, and the band
  flag: a finished tile is counted on band_counter[b] once its TMA stores are complete
  (``cp.async.bulk.wait_group 0`` + ``fence.proxy.async.global``), the tile that completes the
  band stores band_ready[b] = epoch with release semantics. The previous tile's count is posted
  by the first consumer warp in the middle of the next tile's k loop (its stores are long
  finished by then); with ``flag_warp`` that warp hands the band to warp 2 of the producer
  warpgroup, which does the gpu-scope atomic so that its fence (MEMBAR.ALL.GPU) never stalls a
  WGMMA warpgroup. See ``kernels.primitives.count_band_after_bulk_stores`` /
  ``relay_band_after_bulk_stores`` for the memory-ordering argument.

Arrival-gated variant (``wait_arrival``: the up-projection as a consumer of the dispatch's
arrivals, issue 39 item 2): before the first TMA load of a tile's A rows, lane 0 of the producer
warp waits (bounded, ``arrival_timeout_ns`` by %globaltimer) until band_arrived[b] == epoch with
ld.acquire at ``arrival_scope`` ("gpu": the dispatch's expand kernel runs on this GPU), polling
the error word; then ``fence.proxy.async.global`` (the rows were written by generic stores, the
TMA reads them through the async proxy) and ``bar.warp.sync``. A timeout records
ERR_ARRIVAL_TIMEOUT (rank, band, flag value, epoch); the loads go on (every warp walks the same
tiles, so the pipeline stays matched) and the store warp issues no TMA store for any tile whose
epilogue starts after it sees the error word set (a warp vote on one relaxed load per tile).

SwiGLU epilogue (``swiglu``): w holds [gate | up] column blocks interleaved per N tile
(``combine.grouped_gemm.interleave_gate_up``): columns [j * tile_n, j * tile_n + tile_n / 2) of
w are gate columns [j * tile_n / 2, (j + 1) * tile_n / 2), the next tile_n / 2 the matching up
columns, so one tile's accumulator holds both halves: epilogue sub-tile n (< half) is paired
with sub-tile n + half (the same fragment positions), y = silu(g) * u in fp32, bf16 out; y is
[rows, N / 2].

Imports cutlass (the host wrapper imports this module when it compiles).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ..kernels.errors import (ERR_ARRIVAL_TIMEOUT, ERR_PRODUCER_BOUNDS, PRF_EXPERT, PRF_GROUP_END, PRF_GROUP_FIRST,
                              PRF_NUM_BANDS, PRF_SCHEDULE, PRF_SRC_ROW)
from ..kernels.gemm_sm90 import SMEM_CAPACITY_SM90, GemmSm90, smem_layout_staged
from ..kernels.primitives import (RELAY_BYTES, act_f32, band_relay_loop, error_set,
                                  fence_proxy_async_global, in_range_s64,
                                  multicast_rank_and_mask, post_band_after_bulk_stores,
                                  record_error, relay_end, relay_init, wait_eq_s32_or_error,
                                  warp_all)
from ..kernels.tile_scheduler import BandTileScheduler, ClusterTileFetch

__all__ = ["GroupedGemmKernel"]


class GroupedGemmKernel(GemmSm90):
    """GroupedGemmKernel(tile_m, tile_n, tile_k, stages, signal, signal_k_tile, epi_n,
    epi_stages, cluster_n, flag_warp, band_group, group_tables, wait_arrival, arrival_scope,
    arrival_timeout_ns, swiglu, tile_fetch): options as ``GroupedGemm`` (already checked there);
    ``__call__(mA, mB, mC, mBandExpert, mBandSrcRow, mSchedule, mNumBands, mReady, mCounter,
    mEpoch, err, rank, num_ctas, stream, mGroupFirst, mGroupSize, mArrived, mFetch)`` traces and
    launches it (err: the int64[8] error word's address, rank: the rank it names; mGroupFirst /
    mGroupSize: the band group tables with group_tables, else None; mArrived: the arrival flags
    with wait_arrival; mFetch: the int32[1] work counter, zero at launch, with
    tile_fetch="dynamic")."""

    relay_warp_id = 2  # producer-warpgroup warp that posts the flags (flag_warp)
    relay_bar0 = 4  # named barriers 4, 5: the relay mailbox's "full" signals

    def __init__(self, tile_m, tile_n, tile_k, stages, signal, signal_k_tile, epi_n=32,
                 epi_stages=4, cluster_n=1, flag_warp=False, band_group=1, group_tables=False,
                 wait_arrival=False, arrival_scope="gpu", arrival_timeout_ns=10_000_000_000,
                 swiglu=False, tile_fetch="static", skip_padding=False):
        # two consumer warpgroups (stacked along M) for the 128 x 256 tile, else one
        super().__init__(2 if (tile_m > 64 and tile_n > 128) else 1)
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.req_stages = stages
        self.signal = signal
        self.signal_k_tile = signal_k_tile
        self.epi_n, self.epi_stages = epi_n, epi_stages
        # cluster_n = 2: the two CTAs of a cluster take tiles 2q and 2q+1 (same band, adjacent
        # n tiles); each loads half of the band's A tile and multicasts it to both.
        self.cluster_n = cluster_n
        self.flag_warp = flag_warp and signal
        self.scheduler = BandTileScheduler(cluster_n, band_group)
        self.group_tables = group_tables
        self.wait_arrival = wait_arrival
        self.arrival_scope = arrival_scope  # scope of the acquire of band_arrived
        self.arrival_timeout_ns = int(arrival_timeout_ns)
        self.swiglu = swiglu
        # output columns per tile: half of the accumulator's with swiglu (gate | up pairs)
        self.tile_n_out = tile_n // 2 if swiglu else tile_n
        # tile_fetch="dynamic": after its first tile (static), a cluster takes the next unit of
        # cluster_n tiles from a global counter; the unit reaches every tile walker of the
        # cluster (its producer warps and consumer warps) through a shared-memory ring
        self.dynamic = tile_fetch == "dynamic"
        # skip_padding: the second MMA warpgroup (rows tile_m / 2 ..) runs no WGMMA for a band
        # whose valid rows (a prefix) all lie in the first half
        self.skip_padding = skip_padding
        self.fetch = ClusterTileFetch(cluster_n, 4 * self.num_mma_wg * cluster_n + cluster_n - 1)

    # ---------------------------------------------------------------- host-side setup
    def _setup(self, a_dtype, b_dtype, c_dtype, a_layout, b_layout, c_layout):
        self.tiled_mma = self.make_tiled_mma(a_dtype, b_dtype, a_layout, b_layout,
                                             (64, self.tile_n))
        self.epi_tile = (min(64 * self.num_mma_wg, self.tile_m), min(self.epi_n, self.tile_n))
        self.epi_stage = self.epi_stages
        ab_bytes = (self.tile_m * self.tile_k * a_dtype.width // 8
                    + self.tile_n * self.tile_k * b_dtype.width // 8)
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * c_dtype.width // 8 * self.epi_stage
        max_stages = (SMEM_CAPACITY_SM90 - 1024 - epi_bytes) // ab_bytes
        self.ab_stage = max_stages if self.req_stages is None else self.req_stages
        if self.ab_stage < 2 or self.ab_stage > max_stages:
            raise ValueError(f"stages={self.ab_stage} does not fit (2..{max_stages})")
        self.a_smem_layout_staged = smem_layout_staged(a_layout, a_dtype,
                                                       (self.tile_m, self.tile_k), self.ab_stage)
        self.b_smem_layout_staged = smem_layout_staged(b_layout, b_dtype,
                                                       (self.tile_n, self.tile_k), self.ab_stage)
        # C is N-major (row-major y)
        c_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(c_layout, c_dtype, self.epi_tile[1]), c_dtype)
        self.epi_smem_layout_staged = cute.tile_to_shape(
            c_atom, cute.append(self.epi_tile, self.epi_stage), order=(0, 1, 2))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
                 mBandExpert: cute.Tensor, mBandSrcRow: cute.Tensor, mSchedule: cute.Tensor,
                 mNumBands: cute.Tensor, mReady: cute.Tensor, mCounter: cute.Tensor,
                 mEpoch: cute.Tensor, err: cutlass.Int64, rank: cutlass.Int32,
                 num_ctas: cutlass.Int32, stream, mGroupFirst: cute.Tensor = None,
                 mGroupSize: cute.Tensor = None, mArrived: cute.Tensor = None,
                 mFetch: cute.Tensor = None, mBandValid: cute.Tensor = None):
        a_dtype, b_dtype, c_dtype = mA.element_type, mB.element_type, mC.element_type
        self.a_dtype, self.b_dtype, self.c_dtype = a_dtype, b_dtype, c_dtype
        self.a_layout = cutlass.tensor_utils.LayoutEnum.from_tensor(mA)
        self.b_layout = cutlass.tensor_utils.LayoutEnum.from_tensor(mB)
        self.c_layout = cutlass.tensor_utils.LayoutEnum.from_tensor(mC)
        self._setup(a_dtype, b_dtype, c_dtype, self.a_layout, self.b_layout, self.c_layout)

        tma_atom_a, tma_a = self.make_tma_load(mA, self.a_smem_layout_staged,
                                               (self.tile_m, self.tile_k), self.cluster_n)
        tma_atom_b, tma_b = self.make_tma_load(mB, self.b_smem_layout_staged,
                                               (self.tile_n, self.tile_k))
        tma_atom_c, tma_c = self.make_tma_store(mC, self.epi_smem_layout_staged, self.epi_tile)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            # the relay mailbox (flag_warp), then the tile fetch ring (dynamic)
            relay: cute.struct.MemRange[cutlass.Int64, (RELAY_BYTES // 8 if self.flag_warp else 1)
                                        + (ClusterTileFetch.BYTES // 8 if self.dynamic else 0)]
            sA: cute.struct.Align[cute.struct.MemRange[a_dtype, cute.cosize(self.a_smem_layout_staged)],
                                  self.buffer_align_bytes]
            sB: cute.struct.Align[cute.struct.MemRange[b_dtype, cute.cosize(self.b_smem_layout_staged)],
                                  self.buffer_align_bytes]
            sC: cute.struct.Align[cute.struct.MemRange[c_dtype, cute.cosize(self.epi_smem_layout_staged)],
                                  self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, self.tiled_mma,
                    self.a_smem_layout_staged, self.b_smem_layout_staged,
                    self.epi_smem_layout_staged, mBandExpert, mBandSrcRow, mSchedule,
                    mNumBands, mReady, mCounter, mEpoch, err, rank, cute.size(mA, mode=[0]),
                    cute.size(mC, mode=[0]), cute.size(mB, mode=[2]),
                    cute.size(mSchedule, mode=[0]), mGroupFirst, mGroupSize, mArrived,
                    mFetch, mBandValid).launch(
            grid=[num_ctas, 1, 1], block=[self.threads_per_cta, 1, 1],
            cluster=[self.cluster_n, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def band_tile(self, t: cutlass.Int32, total_tiles: cutlass.Int32, gdim: cutlass.Int32,
                  n_tiles: cutlass.Int32, num_bands: cutlass.Int32, mSchedule: cute.Tensor,
                  mBandExpert: cute.Tensor, mBandSrcRow: cute.Tensor,
                  n_experts: cutlass.Int32, rows: cutlass.Int32, err: cutlass.Int64,
                  rank: cutlass.Int32, record: cutlass.Constexpr, mGroupFirst=None,
                  mGroupSize=None, fetch_state=None):
        """This CTA's next tile at or after linear tile t (t, t + G, ...) whose band passes the
        bounds checks: (t, n tile, band, expert, m tile); t >= total_tiles when none is left.
        num_bands is already within the tables (so a position p < num_bands reads the schedule in
        bounds, and a band id checked against num_bands indexes every band table, band_ready and
        band_counter in bounds). A band that fails is skipped by every warp alike (the decision
        depends on the band's table entries only, which no thread writes during the launch, so
        the warps' pipelines and a cluster's two CTAs stay matched); ``record``: lane 0 records
        ERR_PRODUCER_BOUNDS (schedule position, field, value, bound; the first error wins).
        Scalar work once per tile: a few compares, no per-element check. group_tables: the
        position's group entry is checked first (a bad one: the tile is skipped at p0, which
        the fallback group [p0, p0 + 1) walks to, and recorded at p0). ``fetch_state``
        (tile_fetch="dynamic"): (ring, fetched, role, cta_rank, counter, num_clusters) of
        ``next_fetched_tile``: a skipped tile's successor is the next unit fetched, not t + G;
        the count of units taken is returned last."""
        n_tile = cutlass.Int32(0)
        b = cutlass.Int32(0)
        e = cutlass.Int32(0)
        r = cutlass.Int32(0)
        bad = cutlass.Int32(1)
        if cutlass.const_expr(self.dynamic):
            ring, fetched, role, cta_rank, counter, num_clusters = fetch_state
        while bad != 0 and t < total_tiles:
            if cutlass.const_expr(self.group_tables):
                # p0 < num_bands <= capacity: the table reads are in bounds
                p0 = t // n_tiles
                s0 = mGroupFirst[p0]
                g = mGroupSize[p0]
                gend = s0 + g
                ok_g = in_range_s64(cutlass.Int64(s0), cutlass.Int64(0),
                                    cutlass.Int64(p0) + cutlass.Int64(1))
                ok_e = in_range_s64(cutlass.Int64(s0) + cutlass.Int64(g),
                                    cutlass.Int64(p0) + cutlass.Int64(1),
                                    cutlass.Int64(num_bands) + cutlass.Int64(1))
                ws0 = s0
                wg = g
                if ok_g == cutlass.Int32(0) or ok_e == cutlass.Int32(0):
                    ws0 = p0  # a group inside the bounds; the tile is then skipped
                    wg = cutlass.Int32(1)
                p, n_tile = self.scheduler.walk(t, n_tiles, ws0, wg)
            else:
                p, n_tile = self.scheduler.coords(t, n_tiles, num_bands)
            b = mSchedule[p]
            ok_b = in_range_s64(cutlass.Int64(b), cutlass.Int64(0), cutlass.Int64(num_bands))
            bc = b
            if ok_b == cutlass.Int32(0):
                bc = cutlass.Int32(0)  # a valid index: the loads stay in bounds, then skipped
            e = mBandExpert[bc]
            r = mBandSrcRow[bc]
            field = cutlass.Int32(-1)
            value = cutlass.Int32(0)
            bound = cutlass.Int32(0)
            # rows [r, r + tile_m) inside x and y, r a multiple of tile_m (a power of two)
            ok_r = in_range_s64(cutlass.Int64(r), cutlass.Int64(0),
                                cutlass.Int64(rows) - cutlass.Int64(self.tile_m - 1))
            if ok_r == cutlass.Int32(0) or (r & cutlass.Int32(self.tile_m - 1)) != 0:
                field, value, bound = cutlass.Int32(PRF_SRC_ROW), r, rows
            if in_range_s64(cutlass.Int64(e), cutlass.Int64(0),
                            cutlass.Int64(n_experts)) == cutlass.Int32(0):
                field, value, bound = cutlass.Int32(PRF_EXPERT), e, n_experts
            if ok_b == cutlass.Int32(0):
                field, value, bound = cutlass.Int32(PRF_SCHEDULE), b, num_bands
            if cutlass.const_expr(self.group_tables):
                if ok_e == cutlass.Int32(0):
                    field, value, bound = cutlass.Int32(PRF_GROUP_END), gend, num_bands
                if ok_g == cutlass.Int32(0):
                    field, value, bound = cutlass.Int32(PRF_GROUP_FIRST), s0, p0
            bad = cutlass.Int32(0)
            if field >= cutlass.Int32(0):
                bad = cutlass.Int32(1)
                if cutlass.const_expr(record):
                    if cute.arch.lane_idx() == 0:
                        record_error(err, cutlass.Int32(ERR_PRODUCER_BOUNDS), rank, p, field,
                                     cutlass.Int64(value), cutlass.Int64(bound),
                                     cutlass.Int64(0))
                if cutlass.const_expr(self.dynamic):
                    t, fetched = self.next_fetched_tile(ring, fetched, role, cta_rank, counter,
                                                      num_clusters)
                else:
                    t = t + gdim
        out = (t, n_tile, b, e, r // self.tile_m)
        if cutlass.const_expr(self.dynamic):
            out = out + (fetched,)
        return out

    def walk_tile(self, t, fetched, role: str, record: bool, walk: tuple, fetch: tuple):
        """One step of a tile walker (the TMA warp: role "producer", record=True; the MMA
        warps: "consumer", False), static or dynamic alike: with fetched None, this CTA's first
        tile (t = its CTA index, nothing fetched); else the tile after linear tile t (t + G, or
        the next unit fetched). Returns band_tile's (t, n tile, band, expert, m tile) and the
        units fetched so far (0 with tile_fetch="static": a constant, no register). walk:
        band_tile's arguments from total_tiles to rank, then mGroupFirst, mGroupSize; fetch:
        (ring, cta_rank, counter, num_clusters), dynamic only."""
        if cutlass.const_expr(self.dynamic):
            ring, cta_rank, counter, num_clusters = fetch
            if fetched is None:
                fetched = cutlass.Int32(0)
            else:
                t, fetched = self.next_fetched_tile(ring, fetched, role, cta_rank, counter,
                                                    num_clusters)
            return self.band_tile(t, *walk[:11], record, *walk[11:],
                                  (ring, fetched, role, cta_rank, counter, num_clusters))
        if fetched is not None:
            t = t + walk[1]  # + G
        return self.band_tile(t, *walk[:11], record, *walk[11:]) + (cutlass.Int32(0),)

    @cute.jit
    def next_fetched_tile(self, ring: cutlass.Int32, fetched: cutlass.Int32,
                          role: cutlass.Constexpr, cta_rank, counter: cutlass.Int64,
                          num_clusters: cutlass.Int32):
        """tile_fetch="dynamic": this CTA's next linear tile u * cluster_n + cta_rank, u the
        cluster's next unit (``ClusterTileFetch``: posted by the rank-0 CTA's producer warp
        (``role`` "producer"), taken from the ring by the rank-1 CTA's producer warp and the
        consumer warps (role "consumer")); and fetched + 1 (the units taken after the first)."""
        u = cutlass.Int32(0)
        if cutlass.const_expr(role == "producer" and self.cluster_n == 1):
            u = self.fetch.post(ring, fetched, counter, num_clusters)
        elif cutlass.const_expr(role == "producer"):
            if cta_rank == 0:
                u = self.fetch.post(ring, fetched, counter, num_clusters)
            else:
                u = self.fetch.take(ring, fetched)
        else:
            u = self.fetch.take(ring, fetched)
        return u * cutlass.Int32(self.cluster_n) + cta_rank, fetched + cutlass.Int32(1)

    @cute.jit
    def wait_band_arrived(self, mArrived: cute.Tensor, b: cutlass.Int32, epoch: cutlass.Int32,
                          err: cutlass.Int64, rank: cutlass.Int32):
        """Producer warp, before a tile's first A load: lane 0 waits until band_arrived[b] ==
        epoch (ld.acquire.<arrival_scope>, bounded, polling the error word); a timeout records
        ERR_ARRIVAL_TIMEOUT (rank, band, flag value, epoch, elapsed). Then the async-proxy fence
        (the TMA loads that follow read rows the expand wrote with generic stores) and a warp
        sync (whichever lane issues the TMA is ordered after lane 0's acquire)."""
        if cute.arch.lane_idx() == 0:
            flag = cutlass.Int64(mArrived.iterator.toint()) + cutlass.Int64(b) * cutlass.Int64(4)
            st, v, el = wait_eq_s32_or_error(flag, epoch, err, cute.arch.globaltimer(),
                                             cutlass.Int64(self.arrival_timeout_ns),
                                             self.arrival_scope)
            if st == cutlass.Int32(1):
                record_error(err, cutlass.Int32(ERR_ARRIVAL_TIMEOUT), rank, b, b,
                             cutlass.Int64(v), cutlass.Int64(epoch), el)
            fence_proxy_async_global()
        cute.arch.sync_warp()

    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB: cute.Tensor, tma_atom_c: cute.CopyAtom, mC: cute.Tensor,
               tiled_mma: cute.TiledMma, a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout, mBandExpert: cute.Tensor,
               mBandSrcRow: cute.Tensor, mSchedule: cute.Tensor, mNumBands: cute.Tensor,
               mReady: cute.Tensor, mCounter: cute.Tensor, mEpoch: cute.Tensor,
               err: cutlass.Int64, rank: cutlass.Int32, x_rows: cutlass.Int32,
               y_rows: cutlass.Int32, n_experts: cutlass.Int32, band_cap: cutlass.Int32,
               mGroupFirst: cute.Tensor, mGroupSize: cute.Tensor, mArrived: cute.Tensor,
               mFetch: cute.Tensor, mBandValid: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            self.prefetch_descriptors(tma_atom_a, tma_atom_b, tma_atom_c)

        a_smem_layout = cute.slice_(a_smem_layout_staged, (None, None, 0))
        b_smem_layout = cute.slice_(b_smem_layout_staged, (None, None, 0))
        tma_copy_bytes = (cute.size_in_bytes(self.a_dtype, a_smem_layout)
                          + cute.size_in_bytes(self.b_dtype, b_smem_layout))

        # cluster of cluster_n CTAs along N: (1, cluster_n, 1)
        cta_layout_mnk = cute.make_layout((1, self.cluster_n, 1))
        # the CTAs of a cluster (along N) share the band's A tile
        cta_rank, a_mcast_mask = multicast_rank_and_mask(cta_layout_mnk, mode=1)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop_pipeline = self.make_mainloop_pipeline(
            storage.mbar.data_ptr(), self.ab_stage, tma_copy_bytes,
            cute.make_layout((1, *cta_layout_mnk.shape)), self.cluster_n)
        relay = cutlass.Int32(0)
        if cutlass.const_expr(self.flag_warp):
            relay = cutlass.Int32(storage.relay.data_ptr().toint())
            if tidx == 0:
                relay_init(relay)
        fetch = ()  # the dynamic walk's (ring, cta_rank, counter, num_clusters)
        if cutlass.const_expr(self.dynamic):
            ring = cutlass.Int32(storage.relay.data_ptr().toint()) + cutlass.Int32(
                RELAY_BYTES if self.flag_warp else 8)
            fetch_counter = cutlass.Int64(mFetch.iterator.toint())
            num_clusters = gdim // cutlass.Int32(self.cluster_n)
            if tidx == 0:
                self.fetch.init(ring)
            fetch = (ring, cta_rank, fetch_counter, num_clusters)
        pipeline_init_arrive(cluster_shape_mn=(1, self.cluster_n), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)

        # (bM, bK, RestM, RestK)
        gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
        # (bN, bK, RestN, RestK, E)
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
        # (bM, bN, RestM, RestN)
        gC = cute.local_tile(mC, (self.tile_m, self.tile_n_out), (None, None))

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, cta_rank, cute.make_layout(self.cluster_n), cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        mma_wg_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
        thr_mma = tiled_mma.get_slice(mma_wg_layout(warp_group_idx - 1))
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        tCgC = thr_mma.partition_C(gC)
        if cutlass.const_expr(self.swiglu):
            # the accumulator spans the whole tile_n (gate and up columns), y the half of it
            accumulators = cute.make_rmem_tensor(
                tiled_mma.partition_shape_C((self.tile_m, self.tile_n)), self.acc_dtype)
        else:
            accumulators = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)

        k_tile_cnt = cute.size(gA, mode=[3])
        n_tiles = cute.size(gC, mode=[3])
        # validate=False plans: a band count outside the tables computes no band (recorded)
        num_bands = mNumBands[0]
        if in_range_s64(cutlass.Int64(num_bands), cutlass.Int64(0),
                        cutlass.Int64(band_cap) + cutlass.Int64(1)) == cutlass.Int32(0):
            if bidx == 0 and tidx == 0:
                record_error(err, cutlass.Int32(ERR_PRODUCER_BOUNDS), rank, cutlass.Int32(-1),
                             cutlass.Int32(PRF_NUM_BANDS), cutlass.Int64(num_bands),
                             cutlass.Int64(band_cap), cutlass.Int64(0))
            num_bands = cutlass.Int32(0)
        rows = x_rows
        if y_rows < rows:
            rows = y_rows
        # linear tile t over (schedule position, n tile), CTA i takes i, i+G, ...
        total_tiles = num_bands * n_tiles
        # every tile walker's tables and bounds (walk_tile)
        walk = (total_tiles, gdim, n_tiles, num_bands, mSchedule, mBandExpert, mBandSrcRow,
                n_experts, rows, err, rank, mGroupFirst, mGroupSize)

        pipeline_init_wait(cluster_shape_mn=(1, self.cluster_n))

        if warp_group_idx == 0:
            self.producer_warpgroup()
        # ------------------------------------------------------------ producer (TMA) warp
        if warp_idx == self.load_warp_id:
            prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            # the first tile is the static one (no fetch); fetched: units taken after it
            t, n_tile, b, e, m_tile, fetched = self.walk_tile(
                cutlass.Int32(bidx), None, "producer", True, walk, fetch)
            if cutlass.const_expr(self.wait_arrival):
                epoch_p = mEpoch[0]
            while t < total_tiles:
                if cutlass.const_expr(self.wait_arrival):
                    self.wait_band_arrived(mArrived, b, epoch_p, err, rank)
                tAgA_k = tAgA[(None, m_tile, None)]
                tBgB_k = tBgB[(None, n_tile, None, e)]
                prod_state.reset_count()
                for k_tile in range(k_tile_cnt):
                    mainloop_pipeline.producer_acquire(prod_state)
                    bar = mainloop_pipeline.producer_get_barrier(prod_state)
                    cute.copy(tma_atom_a, tAgA_k[(None, prod_state.count)],
                              tAsA[(None, prod_state.index)], tma_bar_ptr=bar,
                              mcast_mask=a_mcast_mask)
                    cute.copy(tma_atom_b, tBgB_k[(None, prod_state.count)],
                              tBsB[(None, prod_state.index)], tma_bar_ptr=bar)
                    mainloop_pipeline.producer_commit(prod_state)
                    prod_state.advance()
                t, n_tile, b, e, m_tile, fetched = self.walk_tile(t, fetched, "producer", True,
                                                                  walk, fetch)
            mainloop_pipeline.producer_tail(prod_state)
            if cutlass.const_expr(self.dynamic and self.cluster_n > 1):
                if cta_rank == 0:  # the peer's last remote arrives land before this CTA exits
                    self.fetch.tail(ring, fetched)

        # ------------------------------------------------------------ relay warp (flag_warp)
        if cutlass.const_expr(self.flag_warp):
            if warp_idx == self.relay_warp_id:
                band_relay_loop(relay, self.relay_bar0, mCounter, mReady, n_tiles, mEpoch[0])

        # ------------------------------------------------------------ consumer warpgroups
        if warp_group_idx > 0:
            self.consumer_warpgroup()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            num_k_blocks = cute.size(tCrA, mode=[2])

            copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
                self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype)
            copy_atom_C = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype)
            tiled_copy_C_atom = cute.make_tiled_copy_C_atom(copy_atom_C, tiled_mma)
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_C_atom)
            thr_copy_r2s = tiled_copy_r2s.get_slice(tidx - self.threads_per_wg)
            tRS_sD = thr_copy_r2s.partition_D(sC)
            tRS_rAcc = tiled_copy_r2s.retile(accumulators)
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
            tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
            tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.c_dtype)
            size_tRS_rD = cute.size(tRS_rD)

            tma_store_pipeline = self.make_epi_store_pipeline(self.epi_stage)

            epoch = mEpoch[0]
            is_store_warp = warp_idx == self.epi_store_warp_id
            # band whose stores were issued but not yet counted (-1: none)
            pend_band = cutlass.Int32(-1)
            posts = cutlass.Int32(0)  # bands handed to the relay warp so far (flag_warp)
            signal_k = self.signal_k_index(k_tile_cnt)
            tiles_done = cutlass.Int32(0)

            t, n_tile, b, e, m_tile, fetched = self.walk_tile(
                cutlass.Int32(bidx), None, "consumer", False, walk, fetch)
            while t < total_tiles:
                gC_tile = gC[(None, None, m_tile, n_tile)]

                read_state.reset_count()
                release_state.reset_count()
                accumulators.fill(0.0)
                mma_on = cutlass.Int32(1)
                if cutlass.const_expr(self.skip_padding):
                    # b passed band_tile's bounds check: band_valid[b] is in bounds. The warps
                    # still wait for and release every stage (the pipeline's counts stay).
                    if warp_group_idx == 2 and mBandValid[b] <= cutlass.Int32(self.tile_m // 2):
                        mma_on = cutlass.Int32(0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                # prologue: one k tile of WGMMAs in flight
                mainloop_pipeline.consumer_wait(read_state)
                if mma_on != cutlass.Int32(0):
                    self.mma_k_tile(tiled_mma, accumulators, tCrA, tCrB, read_state.index,
                                    num_k_blocks)
                read_state.advance()
                for k_tile in range(1, k_tile_cnt):
                    mainloop_pipeline.consumer_wait(read_state)
                    if mma_on != cutlass.Int32(0):
                        self.mma_k_tile(tiled_mma, accumulators, tCrA, tCrB, read_state.index,
                                        num_k_blocks)
                    cute.nvgpu.warpgroup.wait_group(1)
                    mainloop_pipeline.consumer_release(release_state)
                    release_state.advance()
                    read_state.advance()
                    if cutlass.const_expr(self.signal):
                        # deferred flag of the previous tile: its TMA stores were issued a few
                        # k tiles ago, so waiting for their completion here rarely stalls
                        if k_tile == signal_k and pend_band >= 0:
                            if is_store_warp:
                                posts = post_band_after_bulk_stores(
                                    self.flag_warp, relay, self.relay_bar0, posts, mCounter,
                                    mReady, pend_band, n_tiles, epoch)
                            pend_band = cutlass.Int32(-1)
                cute.nvgpu.warpgroup.wait_group(0)
                mainloop_pipeline.consumer_release(release_state)
                release_state.advance()
                if cutlass.const_expr(self.signal):
                    if pend_band >= 0:  # k_tile_cnt too small for an in-loop signal
                        if is_store_warp:
                            posts = post_band_after_bulk_stores(
                                self.flag_warp, relay, self.relay_bar0, posts, mCounter,
                                mReady, pend_band, n_tiles, epoch)
                        pend_band = cutlass.Int32(-1)

                # ---- epilogue: acc -> bf16 -> smem (stmatrix) -> gmem (TMA store)
                store_warp_tile = is_store_warp
                if cutlass.const_expr(self.wait_arrival):
                    # an arrival wait that failed (or any error recorded): no more stores (one
                    # decision per warp: a vote over the lanes' loads of the code word)
                    ok = warp_all(error_set(err) == cutlass.Int32(0))
                    store_warp_tile = is_store_warp & (ok != cutlass.Int32(0))
                gC_epi = cute.zipped_divide(gC_tile, self.epi_tile)
                epi_tile_num = cute.size(gC_epi, mode=[1])
                epi_tile_shape = gC_epi.shape[1]
                epi_tile_layout = cute.make_layout(epi_tile_shape, stride=(epi_tile_shape[1], 1))
                num_prev_epi = tiles_done * epi_tile_num
                for epi_idx in cutlass.range_constexpr(epi_tile_num):
                    if cutlass.const_expr(self.swiglu):
                        # output sub-tile (m, n) <- accumulator sub-tiles (m, n) (gate) and
                        # (m, n + half) (up) of the tile's row-major (m, n) sub-tile order
                        half = epi_tile_shape[1]
                        g_idx = (epi_idx // half) * 2 * half + epi_idx % half
                        for v in cutlass.range_constexpr(size_tRS_rD):
                            tRS_rD[v] = act_f32(tRS_rAcc[g_idx * size_tRS_rD + v], "silu") * \
                                tRS_rAcc[(g_idx + half) * size_tRS_rD + v]
                    else:
                        for v in cutlass.range_constexpr(size_tRS_rD):
                            tRS_rD[v] = tRS_rAcc[epi_idx * size_tRS_rD + v]
                    tRS_rD_out.store(tRS_rD.load().to(self.c_dtype))
                    epi_buffer = (num_prev_epi + epi_idx) % self.epi_stage
                    self.store_epi_subtile(tiled_copy_r2s, tRS_rD_out, tRS_sD, sC, tma_atom_c,
                                           gC_epi, epi_tile_layout, epi_idx, epi_buffer,
                                           tma_store_pipeline,
                                           store_warp_tile if self.wait_arrival else is_store_warp)
                if cutlass.const_expr(self.signal):
                    pend_band = b
                tiles_done = tiles_done + 1
                t, n_tile, b, e, m_tile, fetched = self.walk_tile(t, fetched, "consumer", False,
                                                                  walk, fetch)

            if cutlass.const_expr(self.signal):
                if pend_band >= 0:
                    if is_store_warp:
                        posts = post_band_after_bulk_stores(
                            self.flag_warp, relay, self.relay_bar0, posts, mCounter, mReady,
                            pend_band, n_tiles, epoch)
                if cutlass.const_expr(self.flag_warp):
                    if is_store_warp:
                        relay_end(relay, self.relay_bar0, posts)
            tma_store_pipeline.producer_tail()
