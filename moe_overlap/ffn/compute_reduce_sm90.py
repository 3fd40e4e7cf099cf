"""The fused FFN compute kernel: ``FusedFFNKernel``, a ``GemmSm90`` subclass with two chained GEMMs.

acc += act1(X W1_g + b1_g) W2_g with band ready flags; the host wrapper, the tensors' contract
and the torch reference are in ``ffn.compute_reduce``. What it shares with the base (and the
producer GEMM): the tiled MMAs, staged shared-memory layouts, TMA atoms (loads multicast over
clusters of ``cluster_m`` along M, the fp32 TMA reduce-add store), the operand-ring pipeline,
the WGMMA step of GEMM1's k loop, the deferred-flag k index and the epilogue sub-tile store. What
is its own: one ring feeding both GEMMs (GEMM1's X + W1 stages, then GEMM2's W2 chunks armed by
hand with their own byte count), GEMM1's bias start and activation into GEMM2's register A
operand (h_pair: one H tile through shared memory), GEMM2's chunked k loop with early stage
release, the unit schedule (``UnitScheduler``) and the band count.

Imports cutlass (the host wrapper imports this module when it compiles).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import LayoutEnum

from ..kernels.gemm_sm90 import GemmSm90, smem_layout_staged
from ..kernels.primitives import count_band_after_bulk_stores, multicast_rank_and_mask
from ..kernels.tile_scheduler import UnitScheduler
from .band_allreduce import device_lib

__all__ = ["FusedFFNKernel"]


def red_add_v2_f32(addr, a, b):
    """acc[addr .. addr + 8) += (a, b): a relaxed gpu-scope vector reduction (sm_90); only the
    never-taken branch of skip_epi uses it, to keep the GEMM2 products live."""
    cute.arch.inline_ptx("red.global.add.v2.f32 [{$r0}], {{$r1}, {$r2}};",
                         read_only_args=[addr, a, b])


act_fn = device_lib().act  # fp32 relu / gelu (erf) / gelu_tanh / silu, same as act2


def acc_to_smem_copy(tiled_mma, elem_ty_d):
    """Tiled copy of a (row-major) fp32 WGMMA accumulator into shared memory as elem_ty_d:
    stmatrix for bf16 (H), plain st.shared for fp32 (the epilogue's sub-tiles); the 16-bit
    stmatrix atom gives the accumulator's thread/value layout in both cases."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16)
    return cute.make_tiled_copy_S(
        sm90_utils.sm90_get_smem_store_op(LayoutEnum.ROW_MAJOR, elem_ty_d=elem_ty_d,
                                          elem_ty_acc=cutlass.Float32),
        cute.make_tiled_copy_C_atom(atom, tiled_mma))


class FusedFFNKernel(GemmSm90):
    """FusedFFNKernel(tile_m, tile_o, tile_n, tile_k, act1, stages, epi_n, epi_stages,
    signal_k_tile, cluster_m, h_pair): options as ``FusedFFNCompute``, with ``stages`` and
    ``epi_n`` already resolved by its shared-memory plan; ``__call__(mX, mW1, mB1, mW2, mAcc,
    mReady, mCounter, mEpoch, mMtE, mt_per_band, num_ctas, stream)`` traces and launches it.

    Class attributes for timing splits (benchmarks only, wrong results; a bench subclass sets
    them, bench/bench_fused_compute.py): ``skip_gemm1`` / ``skip_gemm2`` leave that GEMM's stages
    and work out on both sides of the ring, ``skip_epi`` GEMM2's reductions, ``plain_store``
    replaces the reduce-add by a plain TMA store."""

    skip_gemm1 = skip_gemm2 = skip_epi = plain_store = False

    def __init__(self, tile_m, tile_o, tile_n, tile_k, act1, stages, epi_n, epi_stages,
                 signal_k_tile, cluster_m=1, h_pair=False):
        # one consumer warpgroup per 64 rows; WG w owns rows [64 w, 64 w + 64) of the tile in
        # both GEMMs, so the H rows it writes to sH are the ones its GEMM2 reads.
        super().__init__(tile_m // 64)
        # cluster_m = 2: the two CTAs of a cluster take units (2p, j) and (2p + 1, j) (same
        # hidden columns, adjacent m-tiles): each loads half of every W1 tile and W2 chunk
        # and multicasts it to both, so per SM a third fewer operand bytes come from L2 in
        # GEMM1 and half in GEMM2. X stays per CTA.
        self.cluster_m = cluster_m
        self.scheduler = UnitScheduler(cluster_m)
        self.tile_m, self.tile_o, self.tile_n, self.tile_k = tile_m, tile_o, tile_n, tile_k
        # GEMM1 computes the unit's whole tile_m x tile_o H tile at once (accumulator
        # 64 x tile_o per warpgroup): X and W1 are read once per unit. GEMM2 reduces over
        # all tile_o hidden columns, taking W2 in two k-chunks of tile_o / 2 rows per n tile,
        # so that a W2 chunk (tile_n x tile_o / 2) is exactly as large as a W1 tile
        # (tile_o x tile_k): both live in the same stage buffer of the one shared ring.
        self.kc2 = tile_o // 2
        self.act1 = act1
        self.stages, self.epi_n, self.epi_stage = stages, epi_n, epi_stages
        self.signal_k_tile = signal_k_tile
        # H of the unit's (last) hidden tile stays in registers as GEMM2's A operand (WGMMA
        # RS): the GEMM1 accumulator's fragment (m64 n8 blocks) is, element for element, the A
        # fragment of m64 k16 for 16-bit types, so no shared memory, fence or barrier sits
        # between the GEMMs.
        # h_pair: a unit covers two hidden tiles j0, j0 + 1 of one m-tile: H of j0 + 1 goes to
        # sH, H of j0 stays in registers, and GEMM2 reduces over both (K = 2 tile_o) before
        # each fp32 reduce-add: half the reduce-add bytes per FLOP
        self.h_pair = h_pair
        self.jpu = 2 if h_pair else 1  # hidden tiles per unit
        self.h_smem = h_pair  # an H tile in shared memory

    # ---------------------------------------------------------------- host-side setup
    def _setup(self):
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        kmaj = LayoutEnum.ROW_MAJOR  # A operands (X, sH): K contiguous
        # GEMM1: A = X tile (K-major), B = W1 tile (O contiguous: MN-major), N = tile_o
        self.tiled_mma1 = self.make_tiled_mma(bf16, bf16, kmaj, self.b_layout,
                                              (64, self.tile_o))
        # GEMM2: A = H in registers (K = tile_o), B = W2 chunks (N contiguous)
        self.tiled_mma2 = self.make_tiled_mma(bf16, bf16, kmaj, self.b_layout,
                                              (64, self.tile_n), a_from_regs=True)
        # h_pair: the second H tile's GEMM2 reads it from sH (A from shared memory)
        self.tiled_mma2s = self.tiled_mma2
        if self.h_pair:
            self.tiled_mma2s = self.make_tiled_mma(bf16, bf16, kmaj, self.b_layout,
                                                   (64, self.tile_n))
        self.epi_tile = (self.tile_m, self.epi_n)

        # the ring: stage s = X tile in sX[s] and a W1 tile or a W2 chunk in sB[s]
        self.tx1 = (self.tile_m + self.tile_o) * self.tile_k * 2  # GEMM1 k step: X + W1
        self.tx2 = self.tile_n * self.kc2 * 2  # GEMM2 chunk: W2 only (sX[s] idle)
        self.sX_layout = smem_layout_staged(kmaj, bf16, (self.tile_m, self.tile_k), self.stages)
        self.sW1_layout = smem_layout_staged(self.b_layout, bf16, (self.tile_o, self.tile_k),
                                             self.stages)
        self.sW2_layout = smem_layout_staged(self.b_layout, bf16, (self.tile_n, self.kc2),
                                             self.stages)
        self.sH_layout = smem_layout_staged(kmaj, bf16, (self.tile_m, self.tile_o), None)
        o_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, f32, self.epi_n), f32)
        self.sO_layout = cute.tile_to_shape(o_atom, cute.append(self.epi_tile, self.epi_stage),
                                            order=(0, 1, 2))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW1: cute.Tensor, mB1: cute.Tensor,
                 mW2: cute.Tensor, mAcc: cute.Tensor, mReady: cute.Tensor,
                 mCounter: cute.Tensor, mEpoch: cute.Tensor, mMtE: cute.Tensor,
                 mt_per_band: cutlass.Int32, num_ctas: cutlass.Int32, stream):
        self.b_layout = cutlass.tensor_utils.LayoutEnum.from_tensor(mW1)
        self._setup()
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        tma_atom_x, tma_x = self.make_tma_load(mX, self.sX_layout, (self.tile_m, self.tile_k))
        # weights: half per CTA of a cluster, multicast to both
        tma_atom_w1, tma_w1 = self.make_tma_load(mW1, self.sW1_layout,
                                                 (self.tile_o, self.tile_k), self.cluster_m)
        tma_atom_w2, tma_w2 = self.make_tma_load(mW2, self.sW2_layout,
                                                 (self.tile_n, self.kc2), self.cluster_m)
        # TMA reduce-add of fp32 sub-tiles into acc (cp.reduce.async.bulk.tensor ... .add)
        tma_atom_o, tma_o = self.make_tma_store(mAcc, self.sO_layout, self.epi_tile,
                                                reduce_add=not self.plain_store)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sX: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.sX_layout)],
                                  self.buffer_align_bytes]
            # W1 tiles and W2 chunks share these buffers (same size, see _ring_plan)
            sB: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.sW1_layout)],
                                  self.buffer_align_bytes]
            # without h_pair a 16-byte stub, 1024-byte aligned like every buffer (the
            # epilogue buffers behind it need it for the swizzled TMA reads)
            sH: cute.struct.Align[cute.struct.MemRange[
                bf16, cute.cosize(self.sH_layout) if self.h_smem else 8],
                self.buffer_align_bytes]
            sO: cute.struct.Align[cute.struct.MemRange[f32, cute.cosize(self.sO_layout)],
                                  self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(tma_atom_x, tma_x, tma_atom_w1, tma_w1, tma_atom_w2, tma_w2, tma_atom_o,
                    tma_o, self.tiled_mma1, self.tiled_mma2, self.tiled_mma2s, self.sX_layout,
                    self.sW1_layout, self.sW2_layout, self.sH_layout, self.sO_layout, mAcc, mB1,
                    mReady, mCounter, mEpoch, mMtE, mt_per_band).launch(
            grid=[num_ctas, 1, 1], block=[self.threads_per_cta, 1, 1],
            cluster=[self.cluster_m, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    # ---------------------------------------------------------------- device kernel
    @cute.kernel
    def kernel(self, tma_atom_x: cute.CopyAtom, mX: cute.Tensor, tma_atom_w1: cute.CopyAtom,
               mW1: cute.Tensor, tma_atom_w2: cute.CopyAtom, mW2: cute.Tensor,
               tma_atom_o: cute.CopyAtom, mAcc: cute.Tensor, tiled_mma1: cute.TiledMma,
               tiled_mma2: cute.TiledMma, tiled_mma2s: cute.TiledMma,
               sX_layout: cute.ComposedLayout,
               sW1_layout: cute.ComposedLayout, sW2_layout: cute.ComposedLayout,
               sH_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               mAccRaw: cute.Tensor,
               mB1: cute.Tensor, mReady: cute.Tensor, mCounter: cute.Tensor,
               mEpoch: cute.Tensor, mMtE: cute.Tensor, mt_per_band: cutlass.Int32):
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            self.prefetch_descriptors(tma_atom_x, tma_atom_w1, tma_atom_w2, tma_atom_o)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        cl = self.cluster_m
        cta_layout_mnk = cute.make_layout((cl, 1, 1))
        cta_vmnk = cute.make_layout((1, cl, 1, 1))
        # the CTAs of a cluster (along M) share the weight tiles
        cta_rank, w_mcast_mask = multicast_rank_and_mask(cta_layout_mnk, mode=0)
        # one ring for both GEMMs, consumed in the order it is filled: a unit's P / tile_k
        # GEMM1 stages (X + W1, tx1 bytes), then 2 W2 chunk stages per n tile (tx2 bytes,
        # armed by hand in the producer). One ring instead of two lets the next GEMM's
        # operands stream in while the current one finishes and gives each GEMM all stages.
        pipe = self.make_mainloop_pipeline(storage.mbar.data_ptr(), self.stages, self.tx1,
                                           cta_vmnk, cl)
        pipeline_init_arrive(cluster_shape_mn=(cl, 1), is_relaxed=True)

        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        sW1 = storage.sB.get_tensor(sW1_layout.outer, swizzle=sW1_layout.inner)
        sW2 = storage.sB.get_tensor(sW2_layout.outer, swizzle=sW2_layout.inner)
        sH = None
        if cutlass.const_expr(self.h_smem):
            sH = storage.sH.get_tensor(sH_layout.outer, swizzle=sH_layout.inner)  # M, tile_o
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        gX = cute.local_tile(mX, (self.tile_m, self.tile_k), (None, None))  # bM,bK,RM,RK
        # weights are (.., E): expert e = mMtE[m_tile] (E = 1 and zeros for the dense layer)
        gW1 = cute.local_tile(mW1, (self.tile_o, self.tile_k),
                              (None, None, None))  # bO,bK,RO,RK,E
        gW2 = cute.local_tile(mW2, (self.tile_n, self.kc2),
                              (None, None, None))  # bN,bO2,RN,RO2,E
        gAcc = cute.local_tile(mAcc, (self.tile_m, self.tile_n), (None, None))  # bM,bN,RM,RN

        one = cute.make_layout(1)
        tXsX, tXgX = cute.nvgpu.cpasync.tma_partition(
            tma_atom_x, 0, one, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tW1sW1, tW1gW1 = cute.nvgpu.cpasync.tma_partition(
            tma_atom_w1, cta_rank, cute.make_layout(cl), cute.group_modes(sW1, 0, 2),
            cute.group_modes(gW1, 0, 2))
        tW2sW2, tW2gW2 = cute.nvgpu.cpasync.tma_partition(
            tma_atom_w2, cta_rank, cute.make_layout(cl), cute.group_modes(sW2, 0, 2),
            cute.group_modes(gW2, 0, 2))

        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        mma_wg_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
        wg_slice = mma_wg_layout(warp_group_idx - 1)
        thr_mma1 = tiled_mma1.get_slice(wg_slice)
        thr_mma2 = tiled_mma2.get_slice(wg_slice)
        thr_mma2s = tiled_mma2s.get_slice(wg_slice)
        tCrX = tiled_mma1.make_fragment_A(thr_mma1.partition_A(sX))
        tCrW1 = tiled_mma1.make_fragment_B(thr_mma1.partition_B(sW1))
        # H in bf16 registers ((2, 2, 2), 1, tile_o / 16)
        tCrH = cute.make_rmem_tensor(thr_mma2.partition_A(
            cute.make_identity_tensor((self.tile_m, self.tile_o))).shape, bf16)
        tCrW2 = tiled_mma2.make_fragment_B(thr_mma2.partition_B(sW2))  # (.., kb, stage)
        tCrH1, tCrW2s = tCrH, tCrW2
        if cutlass.const_expr(self.h_pair):  # the second H tile: A from sH
            tCrH1 = tiled_mma2s.make_fragment_A(thr_mma2s.partition_A(sH))
            tCrW2s = tiled_mma2s.make_fragment_B(thr_mma2s.partition_B(sW2))
        # coordinates of the GEMM1 accumulator elements (for the bias column)
        tCcH = thr_mma1.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_o)))
        acc1 = cute.make_rmem_tensor(tCcH.shape, self.acc_dtype)
        tCcO = thr_mma2.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc2 = cute.make_rmem_tensor(tCcO.shape, self.acc_dtype)

        k_tiles = cute.size(gX, mode=[3])  # P / tile_k
        m_tiles = cute.size(gX, mode=[2])  # ceil(M / tile_m): TMA clips the ragged tail
        J = cute.size(gW1, mode=[2])  # O_g / tile_o
        n_tiles = cute.size(gAcc, mode=[3])  # N / tile_n
        # work: q = m_pair * J + j over ceil(m_tiles / cl) m-pairs; cluster c takes q = c,
        # c + C, ... (C clusters) and its CTA of rank r the unit (m_pair * cl + r, j). With
        # an odd m_tiles the last pair's second m-tile lies past M: that CTA still loads and
        # multicasts its weight halves and runs the GEMMs (X rows past M load as zeros, the
        # TMA reductions past M are clipped) but counts nothing.
        # h_pair: units (m_pair, jp) over J / 2 pairs of hidden tiles (2 jp, 2 jp + 1)
        JU = J // self.jpu
        total_units = -(-m_tiles // cl) * JU
        # skip_gemm1 / skip_gemm2 (timing splits only, see the class docstring): leave out
        # one GEMM's stages and work on both sides of the ring
        k_tiles1 = 0 if cutlass.const_expr(self.skip_gemm1) else k_tiles
        n_tiles2 = 0 if cutlass.const_expr(self.skip_gemm2) else n_tiles
        n_clusters = gdim // cl
        cluster_id = cutlass.Int32(bidx) // cl

        pipeline_init_wait(cluster_shape_mn=(cl, 1))

        if warp_group_idx == 0:
            self.producer_warpgroup()
        # ------------------------------------------------------------ producer (TMA) warp
        if warp_idx == self.load_warp_id:
            st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                              self.stages)
            u = cluster_id
            while u < total_units:
                m_tile, jp, e = self.scheduler.unit(u, JU, cta_rank, m_tiles, mMtE)
                j0 = jp * self.jpu
                # GEMM1 of each hidden tile (h_pair: j0 + 1 first, for sH; then j0)
                for h in cutlass.range_constexpr(self.jpu):
                    jj = j0 + (self.jpu - 1 - h)
                    for k_tile in range(k_tiles1):  # GEMM1: X tile + W1 tile per stage
                        pipe.producer_acquire(st)
                        bar = pipe.producer_get_barrier(st)
                        cute.copy(tma_atom_x, tXgX[(None, m_tile, k_tile)],
                                  tXsX[(None, st.index)], tma_bar_ptr=bar)
                        cute.copy(tma_atom_w1, tW1gW1[(None, jj, k_tile, e)],
                                  tW1sW1[(None, st.index)], tma_bar_ptr=bar,
                                  mcast_mask=w_mcast_mask)
                        pipe.producer_commit(st)
                        st.advance()
                for nn in range(n_tiles2):  # GEMM2: two W2 chunks per n tile and H tile
                    n_tile = nn + jp
                    n_tile = n_tile - (n_tile // n_tiles) * n_tiles  # rotated start
                    for c in cutlass.range_constexpr(2 * self.jpu):
                        # producer_acquire with this stage's byte count (tx2, not tx1)
                        pipe.sync_object_empty.wait(st.index, st.phase)
                        pipe.sync_object_full.arrive_and_expect_tx(st.index, self.tx2)
                        bar = pipe.producer_get_barrier(st)
                        # chunks of W2[j0] (registers' H), then of W2[j0 + 1] (sH's)
                        cute.copy(tma_atom_w2, tW2gW2[(None, n_tile, j0 * 2 + c, e)],
                                  tW2sW2[(None, st.index)], tma_bar_ptr=bar,
                                  mcast_mask=w_mcast_mask)
                        pipe.producer_commit(st)
                        st.advance()
                u = u + n_clusters
            pipe.producer_tail(st)

        # ------------------------------------------------------------ consumer warpgroups
        if warp_group_idx > 0:
            self.consumer_warpgroup()
            ctid = tidx - self.threads_per_wg
            # coordinates of this thread's own GEMM1 accumulator values, for the bias column:
            # the slice must be the thread's (tCcH above is sliced by warpgroup, i.e. holds
            # the coordinates of the warpgroup's first thread, which adds the bias at the
            # wrong columns)
            tCcH_thr = tiled_mma1.get_slice(ctid).partition_C(
                cute.make_identity_tensor((self.tile_m, self.tile_o)))
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.stages)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.stages)
            num_kb1 = cute.size(tCrX, mode=[2])
            num_kb2 = cute.size(tCrW2, mode=[2])  # k blocks per W2 chunk (tile_o / 32)

            # H: fp32 accumulator -> bf16 -> sH with stmatrix (h_pair's first hidden tile) or
            # straight into tCrH
            if cutlass.const_expr(self.h_smem):
                h_copy = acc_to_smem_copy(tiled_mma1, bf16)
                thr_h = h_copy.get_slice(ctid)
                tRS_sH = thr_h.partition_D(sH)
                tRS_rAcc1 = h_copy.retile(acc1)
                rH_shape = cute.shape(thr_h.partition_S(sH))
                tRS_rHf = cute.make_rmem_tensor(rH_shape, self.acc_dtype)
                tRS_rH = cute.make_rmem_tensor(rH_shape, bf16)
                size_rH = cute.size(tRS_rHf)
            # acc1 ((2, 2, tile_o / 8), 1, 1) and tCrH ((2, 2, 2), 1, tile_o / 16) are both
            # compact: element i of one is element i of the other (column pair, row half, n8
            # block = 2 kb + k half)
            tCrH_as_acc1 = cute.make_tensor(tCrH.iterator, acc1.layout)

            # output: fp32 sub-tiles -> sO (st.shared) -> TMA reduce-add
            o_copy = acc_to_smem_copy(tiled_mma2, f32)
            thr_o = o_copy.get_slice(ctid)
            tRS_sO = thr_o.partition_D(sO)
            tRS_rAcc2 = o_copy.retile(acc2)
            rO_shape = cute.shape(thr_o.partition_S(sO))
            tRS_rO = cute.make_rmem_tensor(rO_shape[:3], self.acc_dtype)
            size_rO = cute.size(tRS_rO)
            red_pipeline = self.make_epi_store_pipeline(self.epi_stage)
            acc_base = cutlass.Int64(mAccRaw.iterator.toint())  # skip_epi's never-taken add

            epoch = mEpoch[0]
            is_store_warp = warp_idx == self.epi_store_warp_id
            pend_band = cutlass.Int32(-1)  # band of the last unit, not yet counted
            pend_need = cutlass.Int32(0)
            signal_k = self.signal_k_index(k_tiles)
            epis_done = cutlass.Int32(0)

            u = cluster_id
            while u < total_units:
                m_tile, jp, e = self.scheduler.unit(u, JU, cta_rank, m_tiles, mMtE)
                j0 = jp * self.jpu
                for h in cutlass.range_constexpr(self.jpu):
                    # hidden tile of this GEMM1: j0 (h_pair: j0 + 1 first, into sH)
                    jj = j0 + (self.jpu - 1 - h)
                    # ---- GEMM1: acc1 = b1[cols] (+) X[m] @ W1[:, cols] over the tile_o
                    # hidden columns cols = jj * tile_o + [0, tile_o)
                    for i in cutlass.range_constexpr(cute.size(acc1)):
                        acc1[i] = mB1[(e, jj * self.tile_o + tCcH_thr[i][1])]
                    if cutlass.const_expr(not self.skip_gemm1):
                        tiled_mma1.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.fence()
                        pipe.consumer_wait(read)
                        self.mma_k_tile(tiled_mma1, acc1, tCrX, tCrW1, read.index, num_kb1)
                        read.advance()
                        for k_tile in range(1, k_tiles):
                            pipe.consumer_wait(read)
                            self.mma_k_tile(tiled_mma1, acc1, tCrX, tCrW1, read.index, num_kb1)
                            cute.nvgpu.warpgroup.wait_group(1)
                            pipe.consumer_release(rel)
                            rel.advance()
                            read.advance()
                            # deferred count of the previous unit: its reductions were
                            # issued a whole GEMM1 ago, so the wait_group 0 inside rarely
                            # stalls
                            if k_tile == signal_k and pend_band >= 0:
                                self._count_unit(pend_band, pend_need, epoch, mReady,
                                                 mCounter, is_store_warp, ctid)
                                pend_band = cutlass.Int32(-1)
                        cute.nvgpu.warpgroup.wait_group(0)
                        pipe.consumer_release(rel)
                        rel.advance()
                    if pend_band >= 0:  # P / tile_k too small for an in-loop count
                        self._count_unit(pend_band, pend_need, epoch, mReady, mCounter,
                                         is_store_warp, ctid)
                        pend_band = cutlass.Int32(-1)

                    if cutlass.const_expr(h == self.jpu - 1):
                        # ---- act1 in registers, bf16 into GEMM2's A fragment (the previous
                        # unit's GEMM2 WGMMAs, which read tCrH, completed at its
                        # wait_group 0)
                        for v in cutlass.range_constexpr(cute.size(acc1)):
                            acc1[v] = act_fn(acc1[v], self.act1)
                        tCrH_as_acc1.store(acc1.load().to(bf16))
                    else:
                        # ---- act1 in registers, bf16, stmatrix into sH (each warpgroup
                        # writes and later reads only its own 64 rows, after its own GEMM2
                        # WGMMAs completed)
                        for v in cutlass.range_constexpr(size_rH):
                            tRS_rHf[v] = act_fn(tRS_rAcc1[v], self.act1)
                        tRS_rH.store(tRS_rHf.load().to(bf16))
                        cute.copy(h_copy, tRS_rH, tRS_sH)
                        # generic-proxy smem writes -> visible to WGMMA (async proxy) reads
                        cute.arch.fence_proxy("async.shared", space="cta")
                        self.epi_barrier.arrive_and_wait()

                # ---- GEMM2 + reduce-add, one n tile at a time
                for nn in range(n_tiles2):
                    n_tile = nn + jp
                    n_tile = n_tile - (n_tile // n_tiles) * n_tiles
                    acc2.fill(0.0)
                    tiled_mma2.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    if cutlass.const_expr(self.h_pair):
                        tiled_mma2s.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.fence()
                    # K = tile_o in two W2 chunks per H tile (h_pair: registers' H of j0,
                    # then sH's of j0 + 1)
                    for c in cutlass.range_constexpr(2 * self.jpu):
                        pipe.consumer_wait(read)
                        for kb in cutlass.range_constexpr(num_kb2):
                            if cutlass.const_expr(c < 2):
                                cute.gemm(tiled_mma2, acc2,
                                          tCrH[(None, None, c * num_kb2 + kb)],
                                          tCrW2[(None, None, kb, read.index)], acc2)
                            else:
                                cute.gemm(tiled_mma2s, acc2,
                                          tCrH1[(None, None, (c - 2) * num_kb2 + kb)],
                                          tCrW2s[(None, None, kb, read.index)], acc2)
                        cute.nvgpu.warpgroup.commit_group()
                        read.advance()
                        if cutlass.const_expr(c > 0):
                            # free the previous chunk's stage as soon as its WGMMAs are done
                            # (the producer streams the next chunk meanwhile; holding at most
                            # two stages, so 4 chunks per n tile pass through a 3-stage ring)
                            cute.nvgpu.warpgroup.wait_group(1)
                            pipe.consumer_release(rel)
                            rel.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    pipe.consumer_release(rel)
                    rel.advance()
                    if cutlass.const_expr(self.skip_epi):
                        # keep the products live (a test that never holds) without the
                        # reductions
                        if acc2[0] == cutlass.Float32(-1.2345e38):
                            red_add_v2_f32(acc_base, acc2[0], acc2[1])
                    else:
                        gO_epi = cute.zipped_divide(gAcc[(None, None, m_tile, n_tile)],
                                                    self.epi_tile)
                        epi_num = cute.size(gO_epi, mode=[1])
                        epi_shape = gO_epi.shape[1]
                        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                        for epi_idx in cutlass.range_constexpr(epi_num):
                            for v in cutlass.range_constexpr(size_rO):
                                tRS_rO[v] = tRS_rAcc2[epi_idx * size_rO + v]
                            buf = (epis_done + epi_idx) % self.epi_stage
                            self.store_epi_subtile(o_copy, tRS_rO, tRS_sO, sO, tma_atom_o,
                                                   gO_epi, epi_layout, epi_idx, buf,
                                                   red_pipeline, is_store_warp)
                        epis_done = epis_done + epi_num

                # this unit is counted once its reductions completed (deferred, see above)
                if m_tile < m_tiles:  # (not the phantom unit past M of an odd m_tiles)
                    b = m_tile // mt_per_band
                    mt_in_band = m_tiles - b * mt_per_band
                    if mt_in_band > mt_per_band:
                        mt_in_band = mt_per_band
                    pend_band = b
                    pend_need = mt_in_band * JU
                u = u + n_clusters

            if pend_band >= 0:
                self._count_unit(pend_band, pend_need, epoch, mReady, mCounter,
                                 is_store_warp, ctid)
            red_pipeline.producer_tail()

    @cute.jit
    def _count_unit(self, b: cutlass.Int32, need: cutlass.Int32, epoch: cutlass.Int32,
                    mReady: cute.Tensor, mCounter: cute.Tensor, is_store_warp,
                    ctid: cutlass.Int32):
        """Counts one finished unit of band b: the warp that issued the bulk reductions waits
        for them and counts (``primitives.count_band_after_bulk_stores``, whose docstring has
        the memory-ordering argument; on the consumer side BandAllReduce's ``ld.acquire.gpu``
        of the flag is followed by generic-proxy reads of acc only, so it needs no proxy
        fence)."""
        if is_store_warp:
            count_band_after_bulk_stores(mCounter, mReady, b, need, epoch)

