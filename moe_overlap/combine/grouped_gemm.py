"""Producer grouped GEMM: y[band] = x[band] @ w[band_expert[band]], one persistent launch.

Hopper (sm_90a) CuTe DSL kernel: TMA loads into a multi-stage shared-memory pipeline (one producer
warp), WGMMA in one or two consumer warpgroups (fp32 accumulators), stmatrix + TMA store epilogue,
and a per-band "ready" flag written with release semantics once all N/tile_n tiles of the band are
globally visible.  Written for this project after reading the CUTLASS CuTe DSL Hopper persistent
GEMM example and QuACK's sm90 GEMM; the scheduler, the band indirection and the flag epilogue are
ours.

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

Work: linear tile t = p * (N / tile_n) + n_tile for p in [0, num_bands); persistent CTA i takes
t = i, i + G, i + 2G, ... with G = number of SMs - ccta (a launch argument, not a recompile).
With the default cluster_n=2 (even N/tile_n), CTAs 2c and 2c+1 form a cluster that takes tiles
t, t+1 (same band) and shares the band's A tile by TMA multicast; G is rounded down to even.

Flags: each finished tile is counted on band_counter[b] (acq_rel atomic, gpu scope) once its TMA
stores are complete (wait_group 0 + fence.proxy.async.global); the tile that completes the band
resets the counter and stores band_ready[b] = epoch with release semantics.  The previous tile's
stores are waited for by the first consumer warp in the middle of the next tile's k loop (long
finished, so no stall); by default (flag_warp) that warp then hands the band to warp 2 of the
producer warpgroup, which does the atomic: its GPU-scope fence (MEMBAR.ALL.GPU) would otherwise
stall a WGMMA warpgroup.  store_warp=True instead issues the stores and posts the flags from a
dedicated warp.  See primitives.count_band_after_bulk_stores / relay_band_after_bulk_stores for
the memory-ordering argument.

Tile order: groups of band_group (default 8) schedule positions walk the n tiles together, one
cluster of tiles per band in turn, so the CTAs computing the same weight columns for up to 8 bands
run side by side and each weight slice is read from DRAM about once per group (band-major order
streams a whole expert's weights per wave, more than L2 holds at K=4096).

Measured (H200, bench/NOTES.md v10, ccta=0, T=16k-32k, N=8192, K=1k-4k, E=4-64): 0.95-0.99x the
best library grouped GEMM (cuBLAS bmm / per-expert matmul / torch._grouped_mm) at boost clock,
0.96-1.01x with calls back to back (power-limited); flag epilogue under 1 %.

cutlass is imported lazily: importing this module needs only torch.
"""



import math

import torch

from ..runtime.device import num_sms

__all__ = ["GroupedGemm", "grouped_gemm_reference", "prepare_weights", "tile_order_reference"]


# --------------------------------------------------------------------------------------------
# Plain torch reference (the truth the tests use)
# --------------------------------------------------------------------------------------------
def grouped_gemm_reference(x, w, y, band_expert, band_src_row, schedule, num_bands, tile_m,
                           band_ready=None, epoch=None, acc_dtype=torch.float32):
    """Reference semantics, in place on ``y`` (host-synchronizing; for tests only).

    for p in range(num_bands): b = schedule[p]; r = band_src_row[b]
        y[r:r+tile_m] = x[r:r+tile_m] @ w[band_expert[b]]  (fp32 accumulation, cast to y.dtype)
    and, if band_ready/epoch are given, band_ready[b] = epoch[0].
    """
    nb = int(num_bands.reshape(-1)[0].item())
    sched = schedule[:nb].tolist()
    be = band_expert.tolist()
    bs = band_src_row.tolist()
    for b in sched:
        r, e = bs[b], be[b]
        y[r:r + tile_m] = (x[r:r + tile_m].to(acc_dtype) @ w[e].to(acc_dtype)).to(y.dtype)
        if band_ready is not None:
            band_ready[b] = epoch.reshape(-1)[0]
    return y


def tile_order_reference(num_bands, n_tiles, cluster=1, group=1):
    """The kernel's tile order (``tile_coords``) in plain Python: [(schedule position, n tile)]
    for linear tiles t = 0 .. num_bands * n_tiles - 1. For tests of the arithmetic."""
    out = []
    for t in range(num_bands * n_tiles):
        p, n = t // n_tiles, t % n_tiles
        if group >= 2:
            s0 = (t // (group * n_tiles)) * group
            g = min(group, num_bands - s0)
            u = t - s0 * n_tiles
            q = u // cluster
            p = s0 + q % g
            n = (q // g) * cluster + (u - q * cluster)
        out.append((p, n))
    return out


def prepare_weights(w):
    """Identity: the kernel reads w [E, K, N] (N contiguous) directly as an MN-major WGMMA B
    operand, so no pre-transposed copy is needed."""
    return w


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
_SMEM_CAPACITY_SM90 = 232448  # bytes of dynamic shared memory per CTA on sm_90
# Default band_group: 8 bands walk each weight slice together. Measured (H200, bench/NOTES.md v10)
# against band-major / pairs / groups of 4: the only order at >= 0.95x the library on all eight
# benchmark shapes at boost clock (K=4096 E=16 0.92 -> 0.98, E=4 0.94 -> 0.96).
DEFAULT_BAND_GROUP = 8


def _kernel_class():
    """Builds the kernel class on first use (imports cutlass lazily)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

    from ..kernels.primitives import (RELAY_BYTES, band_relay_loop, count_band_after_bulk_stores,
                             multicast_rank_and_mask, post_band_after_bulk_stores, relay_end,
                             relay_init)

    @cute.jit
    def tile_coords(t: cutlass.Int32, n_tiles: cutlass.Int32, num_bands: cutlass.Int32,
                    cl: cutlass.Constexpr, group: cutlass.Constexpr):
        """Linear tile t -> (schedule position p, n tile); ``tile_order_reference`` is the same
        arithmetic in plain Python. group 1: band-major (p = t // n_tiles). group G >= 2:
        positions s0 .. s0 + G - 1 share tiles [s0 n_tiles, (s0 + G) n_tiles), cycling over the
        G bands every cl tiles (one cluster) at the same n tiles, so that the CTAs computing the
        same weight columns for the bands of an expert run side by side and read them from DRAM
        once; a short last group cycles over the bands left (one band: band-major). Tiles 2q,
        2q+1 of a cluster keep one band and adjacent n tiles."""
        p = t // n_tiles
        n = t - p * n_tiles
        if cutlass.const_expr(group >= 2):
            s0 = (t // (group * n_tiles)) * group
            g = num_bands - s0
            if g > group:
                g = group
            u = t - s0 * n_tiles
            q = u // cl
            p = s0 + q % g
            n = (q // g) * cl + (u - q * cl)
        return p, n

    class _GroupedGemmKernel:
        def __init__(self, tile_m, tile_n, tile_k, stages, signal, signal_k_tile, epi_n=32,
                     epi_stages=4, b_evict_last=False, cluster_n=1, store_warp=False,
                     flag_warp=False, band_group=1):
            self.acc_dtype = cutlass.Float32
            self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
            self.req_stages = stages
            self.signal = signal
            self.signal_k_tile = signal_k_tile
            self.epi_n, self.epi_stages = epi_n, epi_stages
            # cluster_n = 2: the two CTAs of a cluster take tiles 2q and 2q+1 (same band,
            # adjacent n tiles); each loads half of the band's A tile and multicasts it to both.
            self.cluster_n = cluster_n
            # L2 eviction priority of the weight (B) loads: EVICT_LAST keeps an expert's weights
            # resident across the waves of its bands (CUTLASS CacheHintSm90 encodings).
            self.b_cache_policy = 0x14F0000000000000 if b_evict_last else None
            # Two consumer warpgroups (stacked along M) for the 128x256 tile, else one.
            self.atom_layout_mnk = (2, 1, 1) if (tile_m > 64 and tile_n > 128) else (1, 1, 1)
            self.num_mma_wg = math.prod(self.atom_layout_mnk)
            self.threads_per_wg = 128
            self.threads_per_cta = (1 + self.num_mma_wg) * self.threads_per_wg
            self.load_warp_id = 0
            # store_warp: TMA stores + flags from warp 1 (idle in the producer warpgroup), so no
            # consumer warp ever waits on memory; else from the first consumer warp.
            self.store_warp = store_warp
            self.epi_store_warp_id = 1 if store_warp else 4
            # flag_warp: the first consumer warp still issues the TMA stores and waits for them,
            # but hands the band to warp 2 (idle in the producer warpgroup) for the gpu-scope
            # atomic, whose MEMBAR.ALL.GPU would otherwise stall its warpgroup's WGMMAs.
            self.flag_warp = flag_warp and signal and not store_warp
            self.relay_warp_id = 2
            self.relay_bar0 = 4  # named barriers 4, 5: the relay mailbox's "full" signals
            self.band_group = band_group  # 1 band-major, G >= 2 bands interleaved (tile_coords)
            self.load_regs = 40
            self.mma_regs = 232 if self.num_mma_wg == 2 else 240
            self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
            self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
            # store_warp handshake per epilogue sub-tile (consumer threads + the store warp):
            # FULL: consumers bar.arrive after writing the smem buffer, store warp bar.sync;
            # EMPTY: store warp bar.arrive once the buffer is free, consumers bar.sync before
            # writing it.  Each side alternates arrive/sync, so generations never mix.
            self.epi_full = pipeline.NamedBarrier(barrier_id=2, num_threads=self.num_mma_threads + 32)
            self.epi_empty = pipeline.NamedBarrier(barrier_id=3, num_threads=self.num_mma_threads + 32)
            self.buffer_align_bytes = 1024

        # ---------------------------------------------------------------- host-side setup
        def _setup(self, a_dtype, b_dtype, c_dtype, a_layout, b_layout, c_layout):
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                a_dtype, b_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
                self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_n))
            self.tile_shape_mnk = (self.tile_m, self.tile_n, self.tile_k)
            if self.num_mma_wg == 2:
                self.epi_tile = (min(128, self.tile_m), min(self.epi_n, self.tile_n))
            else:
                self.epi_tile = (min(64, self.tile_m), min(self.epi_n, self.tile_n))
            self.epi_stage = self.epi_stages
            ab_bytes = (self.tile_m * self.tile_k * a_dtype.width // 8
                        + self.tile_n * self.tile_k * b_dtype.width // 8)
            epi_bytes = self.epi_tile[0] * self.epi_tile[1] * c_dtype.width // 8 * self.epi_stage
            max_stages = (_SMEM_CAPACITY_SM90 - 1024 - epi_bytes) // ab_bytes
            self.ab_stage = max_stages if self.req_stages is None else self.req_stages
            if self.ab_stage < 2 or self.ab_stage > max_stages:
                raise ValueError(f"stages={self.ab_stage} does not fit (2..{max_stages})")

            def smem_layout(layout, dtype, shape_2d, stages, is_k_major_fn):
                is_k_major = is_k_major_fn(layout)
                major_size = shape_2d[1] if is_k_major else shape_2d[0]
                atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                    sm90_utils.get_smem_layout_atom(layout, dtype, major_size), dtype)
                return cute.tile_to_shape(atom, cute.append(shape_2d, stages),
                                          order=(0, 1, 2) if is_k_major else (1, 0, 2))

            kmaj = lambda l: l.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
            self.a_smem_layout_staged = smem_layout(a_layout, a_dtype, (self.tile_m, self.tile_k),
                                                    self.ab_stage, kmaj)
            self.b_smem_layout_staged = smem_layout(b_layout, b_dtype, (self.tile_n, self.tile_k),
                                                    self.ab_stage, kmaj)
            # C is N-major (row-major y)
            c_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(c_layout, c_dtype, self.epi_tile[1]), c_dtype)
            self.epi_smem_layout_staged = cute.tile_to_shape(
                c_atom, cute.append(self.epi_tile, self.epi_stage), order=(0, 1, 2))

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
                     mBandExpert: cute.Tensor, mBandSrcRow: cute.Tensor, mSchedule: cute.Tensor,
                     mNumBands: cute.Tensor, mReady: cute.Tensor, mCounter: cute.Tensor,
                     mEpoch: cute.Tensor, num_ctas: cutlass.Int32, stream):
            a_dtype, b_dtype, c_dtype = mA.element_type, mB.element_type, mC.element_type
            self.a_dtype, self.b_dtype, self.c_dtype = a_dtype, b_dtype, c_dtype
            self.a_layout = cutlass.tensor_utils.LayoutEnum.from_tensor(mA)
            self.b_layout = cutlass.tensor_utils.LayoutEnum.from_tensor(mB)
            self.c_layout = cutlass.tensor_utils.LayoutEnum.from_tensor(mC)
            self._setup(a_dtype, b_dtype, c_dtype, self.a_layout, self.b_layout, self.c_layout)

            a_smem = cute.slice_(self.a_smem_layout_staged, (None, None, 0))
            b_smem = cute.slice_(self.b_smem_layout_staged, (None, None, 0))
            c_smem = cute.slice_(self.epi_smem_layout_staged, (None, None, 0))
            if cutlass.const_expr(self.cluster_n > 1):
                tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), mA, a_smem,
                    (self.tile_m, self.tile_k), num_multicast=self.cluster_n)
            else:
                tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, a_smem, (self.tile_m, self.tile_k))
            tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, b_smem, (self.tile_n, self.tile_k))
            tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, c_smem, self.epi_tile)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
                relay: cute.struct.MemRange[cutlass.Int64, RELAY_BYTES // 8 if self.flag_warp else 1]
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
                        mNumBands, mReady, mCounter, mEpoch).launch(
                grid=[num_ctas, 1, 1], block=[self.threads_per_cta, 1, 1],
                cluster=[self.cluster_n, 1, 1], min_blocks_per_mp=1, stream=stream)

        # ---------------------------------------------------------------- device kernel
        @cute.kernel
        def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
                   mB: cute.Tensor, tma_atom_c: cute.CopyAtom, mC: cute.Tensor,
                   tiled_mma: cute.TiledMma, a_smem_layout_staged: cute.ComposedLayout,
                   b_smem_layout_staged: cute.ComposedLayout,
                   epi_smem_layout_staged: cute.ComposedLayout, mBandExpert: cute.Tensor,
                   mBandSrcRow: cute.Tensor, mSchedule: cute.Tensor, mNumBands: cute.Tensor,
                   mReady: cute.Tensor, mCounter: cute.Tensor, mEpoch: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)

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
            mainloop_pipeline = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                # every consumer warp releases the stage to each CTA that multicast into it
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_mma_wg * 4 * self.cluster_n),
                tx_count=tma_copy_bytes,
                cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
                defer_sync=True,
            )
            relay = cutlass.Int32(0)
            if cutlass.const_expr(self.flag_warp):
                relay = cutlass.Int32(storage.relay.data_ptr().toint())
                if tidx == 0:
                    relay_init(relay)
            pipeline_init_arrive(cluster_shape_mn=(1, self.cluster_n), is_relaxed=True)

            sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
            sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
            sC = storage.sC.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)

            # (bM, bK, RestM, RestK)
            gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
            # (bN, bK, RestN, RestK, E)
            gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
            # (bM, bN, RestM, RestN)
            gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None))

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
            accumulators = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)

            k_tile_cnt = cute.size(gA, mode=[3])
            n_tiles = cute.size(gC, mode=[3])
            # Scheduler: linear tile t = p * n_tiles + n_tile, CTA i takes i, i+G, ...
            total_tiles = mNumBands[0] * n_tiles

            pipeline_init_wait(cluster_shape_mn=(1, self.cluster_n))

            if warp_group_idx == 0:
                cute.arch.setmaxregister_decrease(self.load_regs)
            # ------------------------------------------------------------ producer (TMA) warp
            if warp_idx == self.load_warp_id:
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                t = cutlass.Int32(bidx)
                while t < total_tiles:
                    p, n_tile = tile_coords(t, n_tiles, mNumBands[0], self.cluster_n,
                                            self.band_group)
                    b = mSchedule[p]
                    e = mBandExpert[b]
                    m_tile = mBandSrcRow[b] // self.tile_m
                    tAgA_k = tAgA[(None, m_tile, None)]
                    tBgB_k = tBgB[(None, n_tile, None, e)]
                    prod_state.reset_count()
                    for k_tile in range(k_tile_cnt):
                        mainloop_pipeline.producer_acquire(prod_state)
                        bar = mainloop_pipeline.producer_get_barrier(prod_state)
                        cute.copy(tma_atom_a, tAgA_k[(None, prod_state.count)],
                                  tAsA[(None, prod_state.index)], tma_bar_ptr=bar,
                                  mcast_mask=a_mcast_mask)
                        if cutlass.const_expr(self.b_cache_policy is None):
                            cute.copy(tma_atom_b, tBgB_k[(None, prod_state.count)],
                                      tBsB[(None, prod_state.index)], tma_bar_ptr=bar)
                        else:
                            cute.copy(tma_atom_b, tBgB_k[(None, prod_state.count)],
                                      tBsB[(None, prod_state.index)], tma_bar_ptr=bar,
                                      cache_policy=cutlass.Int64(self.b_cache_policy))
                        mainloop_pipeline.producer_commit(prod_state)
                        prod_state.advance()
                    t = t + gdim
                mainloop_pipeline.producer_tail(prod_state)

            # ------------------------------------------------------------ relay warp (option)
            if cutlass.const_expr(self.flag_warp):
                if warp_idx == self.relay_warp_id:
                    band_relay_loop(relay, self.relay_bar0, mCounter, mReady, n_tiles,
                                    mEpoch[0])

            # ------------------------------------------------------------ store warp (option)
            if cutlass.const_expr(self.store_warp):
                if warp_idx == self.epi_store_warp_id:
                    epoch_s = mEpoch[0]
                    t = cutlass.Int32(bidx)
                    tiles_done_s = cutlass.Int32(0)
                    while t < total_tiles:
                        p, n_tile = tile_coords(t, n_tiles, mNumBands[0], self.cluster_n,
                                                self.band_group)
                        b = mSchedule[p]
                        m_tile = mBandSrcRow[b] // self.tile_m
                        gC_epi = cute.zipped_divide(gC[(None, None, m_tile, n_tile)], self.epi_tile)
                        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
                        epi_tile_num = cute.size(gC_epi, mode=[1])
                        epi_tile_shape = gC_epi.shape[1]
                        epi_tile_layout = cute.make_layout(epi_tile_shape, stride=(epi_tile_shape[1], 1))
                        for epi_idx in cutlass.range_constexpr(epi_tile_num):
                            epi_buffer = (tiles_done_s * epi_tile_num + epi_idx) % self.epi_stage
                            # buffer epi_buffer is free: the store that last read it is at least
                            # epi_stage - 1 groups old (wait_group.read below)
                            self.epi_empty.arrive()
                            self.epi_full.arrive_and_wait()
                            cute.copy(tma_atom_c, bSG_sD[(None, epi_buffer)],
                                      bSG_gD[(None, epi_tile_layout.get_hier_coord(epi_idx))])
                            cute.arch.cp_async_bulk_commit_group()
                            cute.arch.cp_async_bulk_wait_group(self.epi_stage - 1, read=True)
                        if cutlass.const_expr(self.signal):
                            # the consumers are already in the next tile's main loop
                            count_band_after_bulk_stores(mCounter, mReady, b, n_tiles, epoch_s)
                        tiles_done_s = tiles_done_s + 1
                        t = t + gdim
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

            # ------------------------------------------------------------ consumer warpgroups
            if warp_group_idx > 0:
                cute.arch.setmaxregister_increase(self.mma_regs)
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

                if cutlass.const_expr(not self.store_warp):
                    tma_store_pipeline = pipeline.PipelineTmaStore.create(
                        num_stages=self.epi_stage,
                        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                 self.num_mma_threads))
                # flags from a consumer warp (deferred into the next main loop) unless store_warp
                sig_in_mma = self.signal and not self.store_warp

                epoch = mEpoch[0]
                is_store_warp = warp_idx == self.epi_store_warp_id
                # Band whose stores were issued by the store warp but not yet signalled (-1: none).
                pend_band = cutlass.Int32(-1)
                posts = cutlass.Int32(0)  # bands handed to the relay warp so far (flag_warp)
                # k iteration of the next tile at which the previous tile's flag is posted:
                # None = the middle of the k loop, -1 = its last iteration, else fixed (>= 1).
                if cutlass.const_expr(self.signal_k_tile is None):
                    signal_k = max(k_tile_cnt // 2, 1)
                elif cutlass.const_expr(self.signal_k_tile < 0):
                    signal_k = k_tile_cnt - 1
                else:
                    signal_k = min(max(self.signal_k_tile, 1), k_tile_cnt - 1)
                tiles_done = cutlass.Int32(0)

                t = cutlass.Int32(bidx)
                while t < total_tiles:
                    p, n_tile = tile_coords(t, n_tiles, mNumBands[0], self.cluster_n,
                                            self.band_group)
                    b = mSchedule[p]
                    m_tile = mBandSrcRow[b] // self.tile_m
                    gC_tile = gC[(None, None, m_tile, n_tile)]

                    read_state.reset_count()
                    release_state.reset_count()
                    accumulators.fill(0.0)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.fence()
                    # prologue: one k tile of WGMMAs in flight
                    mainloop_pipeline.consumer_wait(read_state)
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        cute.gemm(tiled_mma, accumulators, tCrA[(None, None, kb, read_state.index)],
                                  tCrB[(None, None, kb, read_state.index)], accumulators)
                    cute.nvgpu.warpgroup.commit_group()
                    read_state.advance()
                    for k_tile in range(1, k_tile_cnt):
                        mainloop_pipeline.consumer_wait(read_state)
                        for kb in cutlass.range_constexpr(num_k_blocks):
                            cute.gemm(tiled_mma, accumulators, tCrA[(None, None, kb, read_state.index)],
                                      tCrB[(None, None, kb, read_state.index)], accumulators)
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(1)
                        mainloop_pipeline.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()
                        if cutlass.const_expr(sig_in_mma):
                            # Deferred flag of the previous tile: its TMA stores were issued a few
                            # k tiles ago, so waiting for their completion here rarely stalls.
                            if k_tile == signal_k and pend_band >= 0:
                                if is_store_warp:
                                    posts = post_band_after_bulk_stores(
                                        self.flag_warp, relay, self.relay_bar0, posts, mCounter,
                                        mReady, pend_band, n_tiles, epoch)
                                pend_band = cutlass.Int32(-1)
                    cute.nvgpu.warpgroup.wait_group(0)
                    mainloop_pipeline.consumer_release(release_state)
                    release_state.advance()
                    if cutlass.const_expr(sig_in_mma):
                        if pend_band >= 0:  # k_tile_cnt too small for an in-loop signal
                            if is_store_warp:
                                posts = post_band_after_bulk_stores(
                                    self.flag_warp, relay, self.relay_bar0, posts, mCounter,
                                    mReady, pend_band, n_tiles, epoch)
                            pend_band = cutlass.Int32(-1)

                    # ---- epilogue: acc -> bf16 -> smem (stmatrix) -> gmem (TMA store)
                    gC_epi = cute.zipped_divide(gC_tile, self.epi_tile)
                    epi_tile_num = cute.size(gC_epi, mode=[1])
                    epi_tile_shape = gC_epi.shape[1]
                    epi_tile_layout = cute.make_layout(epi_tile_shape, stride=(epi_tile_shape[1], 1))
                    num_prev_epi = tiles_done * epi_tile_num
                    for epi_idx in cutlass.range_constexpr(epi_tile_num):
                        for v in cutlass.range_constexpr(size_tRS_rD):
                            tRS_rD[v] = tRS_rAcc[epi_idx * size_tRS_rD + v]
                        tRS_rD_out.store(tRS_rD.load().to(self.c_dtype))
                        epi_buffer = (num_prev_epi + epi_idx) % self.epi_stage
                        if cutlass.const_expr(self.store_warp):
                            self.epi_empty.arrive_and_wait()
                        cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, epi_buffer)])
                        # stmatrix (generic proxy) -> TMA store (async proxy) reads smem
                        cute.arch.fence_proxy("async.shared", space="cta")
                        if cutlass.const_expr(self.store_warp):
                            self.epi_full.arrive()
                        else:
                            self.epi_barrier.arrive_and_wait()
                            if is_store_warp:
                                bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                                    tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                    gC_epi)
                                cute.copy(tma_atom_c, bSG_sD[(None, epi_buffer)],
                                          bSG_gD[(None, epi_tile_layout.get_hier_coord(epi_idx))])
                                tma_store_pipeline.producer_commit()
                                tma_store_pipeline.producer_acquire()
                            self.epi_barrier.arrive_and_wait()
                    if cutlass.const_expr(sig_in_mma):
                        pend_band = b
                    tiles_done = tiles_done + 1
                    t = t + gdim

                if cutlass.const_expr(sig_in_mma):
                    if pend_band >= 0:
                        if is_store_warp:
                            posts = post_band_after_bulk_stores(
                                self.flag_warp, relay, self.relay_bar0, posts, mCounter, mReady,
                                pend_band, n_tiles, epoch)
                    if cutlass.const_expr(self.flag_warp):
                        if is_store_warp:
                            relay_end(relay, self.relay_bar0, posts)
                if cutlass.const_expr(not self.store_warp):
                    tma_store_pipeline.producer_tail()

    return _GroupedGemmKernel


# --------------------------------------------------------------------------------------------
# Host wrapper
# --------------------------------------------------------------------------------------------
_KERNEL_CLASS = None


def _get_kernel_class():
    global _KERNEL_CLASS
    if _KERNEL_CLASS is None:
        _KERNEL_CLASS = _kernel_class()
    return _KERNEL_CLASS


class GroupedGemm:
    """Persistent grouped GEMM producer (see the module docstring for the tensors).

    GroupedGemm(tile_m=128, tile_n=256, tile_k=64, stages=None, signal=True, signal_k_tile=None,
                epi_n=32, epi_stages=4, b_evict_last=False, cluster_n=None, store_warp=False,
                flag_warp=None, band_group=8)
        tile_m in {64, 128}; tile_n in {64, 128, 256}; tile_k = 64 (bf16);
        stages: smem pipeline depth (None: as many as fit);
        signal: compile-time switch for the band flag epilogue (False: plain grouped GEMM);
        signal_k_tile: k iteration of the next tile at which the previous tile's flag is posted
        (its TMA stores must be complete then, so earlier = lower flag latency but the epilogue
        warp may stall on the stores); None: K/tile_k // 2, -1: the last k iteration;
        epi_n, epi_stages: epilogue sub-tile width (32 or 64) and its smem buffers;
        b_evict_last: load the weights with the L2 EVICT_LAST policy;
        cluster_n: 2 = clusters of two CTAs (tiles 2q, 2q+1 of one band) sharing the A tile by
        TMA multicast; needs an even N/tile_n, and the grid is rounded down to even;
        None: 2 where N/tile_n is even, else 1;
        store_warp: issue the epilogue TMA stores and post the flags from a dedicated warp of the
        producer warpgroup (flag posted as soon as the tile's stores complete; no consumer warp
        waits on memory); signal_k_tile is then unused.
        flag_warp: the consumer warp that issued a tile's stores waits for them as usual but
        hands the band to an idle producer-warpgroup warp, which does the gpu-scope atomic and
        the ready store (no gpu-scope fence in a WGMMA warpgroup); needs signal, not store_warp;
        None (default): on whenever signal and not store_warp (flag cost 0.5-1.4 % against
        1-4 % without, bench/NOTES.md).
        band_group: tile order. G >= 2 interleaves groups of G schedule positions at equal n
        tiles (one cluster of tiles per band in turn), so that the bands of an expert walk its
        weight columns together and each weight slice is read from DRAM about once; the flags of
        a group complete together, up to G bands' time later than band-major order for the
        group's first band. 1: band-major. Default DEFAULT_BAND_GROUP (8, measured best).

    __call__(x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready, epoch,
             ccta=0, band_counter=None, stream=None) -> y
        band_counter: persistent int32 [>= len(band_ready)] zero scratch; allocated (zeros) and
        kept per device if not given.  stream: a torch.cuda.Stream (default: current stream).
    Compile cache key: (dtypes, tile config, stages, signal, N, K); rows, E_local, B_cap and the
    grid size (number of SMs - ccta) are runtime values.
    """

    _compiled = {}

    def __init__(self, tile_m=128, tile_n=256, tile_k=64, stages=None, signal=True,
                 signal_k_tile=None, epi_n=32, epi_stages=4, b_evict_last=False, cluster_n=None,
                 store_warp=False, flag_warp=None, band_group=DEFAULT_BAND_GROUP):
        if tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n must be 64, 128 or 256, got {tile_n}")
        if tile_k != 64:
            raise ValueError(f"tile_k must be 64 for bf16, got {tile_k}")
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.stages = stages
        self.signal = bool(signal)
        self.signal_k_tile = None if signal_k_tile is None else int(signal_k_tile)
        if epi_n not in (32, 64) or epi_n > tile_n:
            raise ValueError(f"epi_n must be 32 or 64 (<= tile_n), got {epi_n}")
        if epi_stages < 1:
            raise ValueError(f"epi_stages must be >= 1, got {epi_stages}")
        self.epi_n, self.epi_stages, self.b_evict_last = int(epi_n), int(epi_stages), bool(b_evict_last)
        if cluster_n not in (None, 1, 2):
            raise ValueError(f"cluster_n must be None, 1 or 2, got {cluster_n}")
        self.cluster_n = cluster_n
        self.store_warp = bool(store_warp)
        if flag_warp and (store_warp or not signal):
            raise ValueError("flag_warp needs signal=True and store_warp=False")
        self.flag_warp = (bool(signal) and not store_warp) if flag_warp is None else bool(flag_warp)
        if isinstance(band_group, bool) or not isinstance(band_group, int) or band_group < 1:
            raise ValueError(f"band_group must be an int >= 1, got {band_group!r}")
        self.band_group = band_group
        self._counters = {}

    def cluster_for(self, N):
        """Cluster size used for output width N."""
        if self.cluster_n is not None:
            return self.cluster_n
        return 2 if (N // self.tile_n) % 2 == 0 else 1

    # ---------------------------------------------------------------- validation
    def _check(self, x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready, epoch,
               band_counter, ccta, need_cuda=True):
        tensors = dict(x=x, w=w, y=y, band_expert=band_expert, band_src_row=band_src_row,
                       schedule=schedule, num_bands=num_bands, band_ready=band_ready, epoch=epoch)
        if band_counter is not None:
            tensors["band_counter"] = band_counter
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if need_cuda and t.device.type != "cuda":
                raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, x on {x.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
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
        if y.shape[0] != rows or y.shape[1] != N:
            raise ValueError(f"y must be [{rows}, {N}], got {tuple(y.shape)}")
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
        return rows, K, E, N

    # ---------------------------------------------------------------- compilation
    def _key(self, N, K):
        return (self.tile_m, self.tile_n, self.tile_k, self.stages, self.signal,
                self.signal_k_tile, self.epi_n, self.epi_stages, self.b_evict_last,
                self.cluster_for(N), self.store_warp, self.flag_warp, self.band_group, int(N),
                int(K))

    def _kernel(self, N):
        return _get_kernel_class()(self.tile_m, self.tile_n, self.tile_k, self.stages,
                                   self.signal, self.signal_k_tile, self.epi_n, self.epi_stages,
                                   self.b_evict_last, self.cluster_for(N), self.store_warp,
                                   self.flag_warp, self.band_group)

    def compile(self, N, K, keep_ptx=False):
        """Compiles (or fetches from the cache) the kernel for output width N and depth K from
        symbolic ("fake") tensors: rows, E_local and B_cap are runtime values.  Needs no GPU when
        CUTE_DSL_ARCH=sm_90a is set (used by the compile-only tests).  keep_ptx: keep the PTX
        (``fn.__ptx__``; files go to CUTE_DSL_DUMP_DIR)."""
        key = ("fake", bool(keep_ptx)) + self._key(N, K)
        fn = GroupedGemm._compiled.get(key)
        if fn is not None:
            return fn
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor
        from cutlass.runtime import make_fake_stream
        rows, E, bcap = cute.sym_int(), cute.sym_int(), cute.sym_int()
        bf16, i32 = cutlass.BFloat16, cutlass.Int32
        fx = make_fake_tensor(bf16, (rows, K), (K, 1), assumed_align=16)
        fw = make_fake_tensor(bf16, (N, K, E), (1, N, K * N), assumed_align=16)
        fy = make_fake_tensor(bf16, (rows, N), (N, 1), assumed_align=16)
        fv = lambda: make_fake_tensor(i32, (bcap,), (1,), assumed_align=4)
        f1 = lambda: make_fake_tensor(i32, (1,), (1,), assumed_align=4)
        fn = cute.compile(self._kernel(N), fx, fw, fy, fv(), fv(), fv(), f1(), fv(), fv(), f1(),
                          cutlass.Int32(1), make_fake_stream(),
                          options="--keep-ptx" if keep_ptx else None)
        GroupedGemm._compiled[key] = fn
        return fn

    # ---------------------------------------------------------------- launch
    @staticmethod
    def _cute_args(x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready,
                   band_counter, epoch):
        """torch -> cute tensors.  rows / E_local / B_cap are marked dynamic (no recompile for a
        new routing); N and K stay static."""
        from cutlass.cute.runtime import from_dlpack

        def dyn(t, mode, align):
            return from_dlpack(t, assumed_align=align).mark_compact_shape_dynamic(
                mode=mode, stride_order=t.dim_order())

        wt = w.permute(2, 1, 0)  # (N, K, E) view, strides (1, N, K*N): MN-major B
        return (dyn(x, 0, 16), dyn(wt, 2, 16), dyn(y, 0, 16), dyn(band_expert, 0, 4),
                dyn(band_src_row, 0, 4), dyn(schedule, 0, 4), from_dlpack(num_bands, assumed_align=4),
                dyn(band_ready, 0, 4), dyn(band_counter[:band_ready.numel()], 0, 4),
                from_dlpack(epoch, assumed_align=4))

    def __call__(self, x, w, y, band_expert, band_src_row, schedule, num_bands, band_ready, epoch,
                 ccta=0, band_counter=None, stream=None):
        rows, K, E, N = self._check(x, w, y, band_expert, band_src_row, schedule, num_bands,
                                    band_ready, epoch, band_counter, ccta)
        grid = num_sms(x.device) - ccta
        grid -= grid % self.cluster_for(N)
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
        args = self._cute_args(x, w, y, band_expert, band_src_row, schedule, num_bands,
                               band_ready, band_counter, epoch)
        key = ("dlpack",) + self._key(N, K)
        fn = GroupedGemm._compiled.get(key)
        if fn is None:
            fn = cute.compile(self._kernel(N), *args, cutlass.Int32(grid), cu_stream)
            GroupedGemm._compiled[key] = fn
        fn(*args, cutlass.Int32(grid), cu_stream)
        return y
