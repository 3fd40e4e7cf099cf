"""Base of the persistent Hopper (sm_90a) TMA + WGMMA kernels: ``GemmSm90``.

A kernel built on it is warp-specialized: warpgroup 0 is the producer (warp 0 issues the TMA
loads of A and B tiles into a multi-stage shared-memory ring guarded by a ``PipelineTmaAsync``;
the other warps are free for a subclass, e.g. the producer GEMM's flag relay), warpgroups
1 .. num_mma_wg are the WGMMA consumers (fp32 accumulators, register budget raised with
``setmaxnreg``). CTAs are persistent: a tile-scheduler object (``kernels.tile_scheduler``) maps a
linear work index to tile coordinates, and CTA i takes i, i + G, i + 2G, ... (G = grid size, a
launch argument).

The base holds what every such kernel does the same way, as methods a subclass calls from its
``__call__`` (host side, at trace time) and its ``@cute.kernel`` (device side):

* host: ``make_tiled_mma`` (A from shared memory or registers), ``smem_layout_staged``,
  ``make_tma_load`` (plain or multicast over the cluster), ``make_tma_store`` (store or fp32
  reduce-add), ``SMEM_CAPACITY_SM90``;
* device: ``prefetch_descriptors``, ``make_mainloop_pipeline`` (the ring's mbarriers; every
  consumer warp releases a stage to each CTA that multicast into it), ``make_epi_store_pipeline``
  (bulk-group bookkeeping of the epilogue stores), ``producer_warpgroup`` /
  ``consumer_warpgroup`` (register reallocation), ``mma_k_tile`` (the WGMMAs of one ring stage:
  one per k block, then ``commit_group``), ``signal_k_index`` (the k iteration at which a deferred
  flag of the previous tile is posted), ``store_epi_subtile`` (one epilogue sub-tile: registers ->
  shared memory, async-proxy fence, the TMA store or reduce-add issued by one warp).

Per tile, the subclass picks the A / B tensors (their TMA partitions and WGMMA fragments are
arguments of these methods, not attributes) and the epilogue (the TMA atom passed to
``store_epi_subtile``, or its own), so one kernel can run different GEMMs on different tiles.
The k loops themselves stay in the subclass's kernel body: the DSL carries a loop's state
(pipeline states, pending flags) by the names written or advanced in that loop's own source, so
a pipeline state is advanced where its loop is written; a k-loop helper that returned the states
would also reorder the carried values of the enclosing tile loop, i.e. change the kernels' code.

Written after CUTLASS's CuTe DSL Hopper persistent dense GEMM example and QuACK's ``GemmSm90``.
Imports cutlass: import this module only where CuTe DSL is installed (the host wrappers import
it when they compile).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils

__all__ = ["GemmSm90", "SMEM_CAPACITY_SM90", "smem_layout_staged"]

SMEM_CAPACITY_SM90 = 232448  # bytes of dynamic shared memory per CTA on sm_90


def smem_layout_staged(layout, dtype, shape_2d, stages):
    """Swizzled shared-memory layout of a (rows, cols) WGMMA operand or TMA tile with ``stages``
    buffers (None: one buffer, 2-D); ``layout`` is the tensor's LayoutEnum (K-major operands are
    tiled along their second mode first)."""
    is_k_major = layout.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
    major_size = shape_2d[1] if is_k_major else shape_2d[0]
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(layout, dtype, major_size), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, shape_2d, order=(0, 1) if is_k_major else (1, 0))
    return cute.tile_to_shape(atom, cute.append(shape_2d, stages),
                              order=(0, 1, 2) if is_k_major else (1, 0, 2))


class GemmSm90:
    """Persistent warp-specialized TMA + WGMMA kernel base (see the module docstring).

    GemmSm90(num_mma_wg): ``num_mma_wg`` consumer warpgroups (1 or 2) stacked along M
    (``atom_layout_mnk``); the subclass sets its tiles and calls the helpers."""

    threads_per_wg = 128
    load_warp_id = 0  # the TMA producer warp
    epi_store_warp_id = 4  # first consumer warp: issues the epilogue's TMA stores
    load_regs = 40  # producer warpgroup's registers per thread after setmaxnreg
    buffer_align_bytes = 1024  # shared-memory buffers: 1024 B for the 128 B swizzle

    def __init__(self, num_mma_wg: int):
        if num_mma_wg not in (1, 2):
            raise ValueError(f"num_mma_wg must be 1 or 2, got {num_mma_wg}")
        self.acc_dtype = cutlass.Float32
        self.atom_layout_mnk = (num_mma_wg, 1, 1)
        self.num_mma_wg = num_mma_wg
        self.threads_per_cta = (1 + num_mma_wg) * self.threads_per_wg
        self.mma_regs = 232 if num_mma_wg == 2 else 240
        self.num_mma_threads = num_mma_wg * self.threads_per_wg
        # all consumer threads: orders the epilogue's shared-memory writes before the TMA store
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

    # ------------------------------------------------------------------ host side (trace time)
    def make_tiled_mma(self, a_dtype, b_dtype, a_layout, b_layout, tiler_mn, a_from_regs=False):
        """WGMMA tiled MMA over the consumer warpgroups (64 rows each); ``a_from_regs``: A from
        registers (RS), else from shared memory (SS)."""
        extra = dict(a_source=sm90_utils.OperandSource.RMEM) if a_from_regs else {}
        return sm90_utils.make_trivial_tiled_mma(
            a_dtype, b_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=tiler_mn, **extra)

    @staticmethod
    def make_tma_load(tensor, smem_layout_staged, tile, num_multicast=1):
        """TMA load atom and tensor for ``tile`` of ``tensor`` into one buffer of the staged
        layout; num_multicast > 1: each CTA of the cluster loads its slice and multicasts it."""
        one = cute.slice_(smem_layout_staged, (None, None, 0))
        if num_multicast > 1:
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), tensor, one, tile,
                num_multicast=num_multicast)
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), tensor, one, tile)

    @staticmethod
    def make_tma_store(tensor, smem_layout_staged, tile, reduce_add=False):
        """TMA store atom and tensor from one buffer of the staged layout; reduce_add: an
        element-wise add into global memory (``cp.reduce.async.bulk.tensor...add``)."""
        one = cute.slice_(smem_layout_staged, (None, None, 0))
        op = (cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(
            cute.nvgpu.cpasync.ReductionKind.ADD) if reduce_add
              else cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp())
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, one, tile)

    # ------------------------------------------------------------------ device side
    @staticmethod
    def prefetch_descriptors(*tma_atoms):
        """Prefetch the TMA descriptors (call from one warp)."""
        for atom in tma_atoms:
            cute.nvgpu.cpasync.prefetch_descriptor(atom)

    def make_mainloop_pipeline(self, mbar_ptr, stages, tx_bytes, cta_layout_vmnk, cluster_size):
        """The operand ring's full / empty mbarriers: one producer thread arms ``tx_bytes`` per
        stage; every consumer warp releases a stage to each of the ``cluster_size`` CTAs that
        multicast into it. Initialized with defer_sync: the caller runs pipeline_init_arrive /
        pipeline_init_wait around its other setup."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar_ptr, num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.num_mma_wg * 4 * cluster_size),
            tx_count=tx_bytes, cta_layout_vmnk=cta_layout_vmnk, defer_sync=True)

    def make_epi_store_pipeline(self, stages):
        """Bulk-group bookkeeping of the epilogue's TMA stores (``stages`` shared buffers)."""
        return pipeline.PipelineTmaStore.create(
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.num_mma_threads))

    @staticmethod
    def mma_k_tile(tiled_mma, acc, tCrA, tCrB, stage, num_k_blocks):
        """acc += A @ B over one ring stage: one WGMMA per k block, then commit_group (the
        caller waits with warpgroup.wait_group and releases the stage)."""
        for kb in range(num_k_blocks):  # unrolled at trace time (a plain Python loop)
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)],
                      tCrB[(None, None, kb, stage)], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def signal_k_index(self, k_tiles: cutlass.Int32):
        """k iteration (of the next tile's main loop) at which the previous tile's deferred flag
        is posted: ``self.signal_k_tile`` None = the middle, < 0 = the last iteration, else that
        iteration clamped to [1, k_tiles - 1]."""
        if cutlass.const_expr(self.signal_k_tile is None):
            signal_k = max(k_tiles // 2, 1)
        elif cutlass.const_expr(self.signal_k_tile < 0):
            signal_k = k_tiles - 1
        else:
            signal_k = min(max(self.signal_k_tile, 1), k_tiles - 1)
        return signal_k

    @cute.jit
    def store_epi_subtile(self, tiled_copy_r2s, tRS_rD, tRS_sD, sD, tma_atom, gD_epi,
                          epi_layout, epi_idx: cutlass.Constexpr, buf, store_pipeline,
                          is_store_warp):
        """One epilogue sub-tile: registers (``tRS_rD``, already in the output dtype) -> shared
        buffer ``buf`` -> global sub-tile ``epi_idx`` of ``gD_epi`` by ``tma_atom`` (a store or a
        reduce-add), issued by the store warp. The async-proxy fence orders the generic-proxy
        shared writes before the TMA read; the second barrier keeps the buffer until the store
        warp has waited for the store that read it ``stages`` sub-tiles ago."""
        cute.copy(tiled_copy_r2s, tRS_rD, tRS_sD[(None, None, None, buf)])
        # shared-memory writes (generic proxy) -> TMA (async proxy) reads them
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_barrier.arrive_and_wait()
        if is_store_warp:
            bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                tma_atom, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi)
            cute.copy(tma_atom, bSG_sD[(None, buf)],
                      bSG_gD[(None, epi_layout.get_hier_coord(epi_idx))])
            store_pipeline.producer_commit()
            # buffer reuse: at most stages - 1 bulk groups still reading shared memory
            store_pipeline.producer_acquire()
        self.epi_barrier.arrive_and_wait()

    def producer_warpgroup(self):
        """Lower the producer warpgroup's register budget (call in warpgroup 0)."""
        cute.arch.setmaxregister_decrease(self.load_regs)

    def consumer_warpgroup(self):
        """Raise the consumer warpgroups' register budget (call in warpgroups >= 1)."""
        cute.arch.setmaxregister_increase(self.mma_regs)
