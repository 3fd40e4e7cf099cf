"""Fused FFN compute blocks (issue 5): ``acc += act1(X W1_g + b1_g) W2_g`` with band ready flags.

This is the compute half of ``FusedFFN(backend="fused")`` and ``ShardedExperts(backend="fused")``
(the same kernel over several experts: weights ``[E, ...]``, one expert per m-tile named by a
device table, see ``FusedFFNCompute.grouped``); the communication half is
``moe_overlap.ffn.band_allreduce.BandAllReduce`` (``producer=True``), running concurrently on its own
``ccta`` SMs and waiting on the flags written here.

Per GPU g (tensors all CUDA, row-major, no host synchronization in the call path)::

    x     [M, P]    bf16          (the same on every rank)
    w1    [P, O_g]  bf16          (this rank's column slice of W1; O_g contiguous)
    b1    [O_g]     bf16 or None
    w2    [O_g, N]  bf16          (this rank's row slice of W2; N contiguous)
    acc   [M, N]    fp32          (BandAllReduce.acc[:M]; zero on entry, the previous call's
                                   all-reduce zeroed it)
    band_ready [>= ceil(M / band_rows)] int32   (BandAllReduce.band_ready)
    epoch      [1] int32          (BandAllReduce.epoch, advanced in stream order before the call)

    acc[m, n] += sum_j act1(x[m] @ w1[:, j] + b1[j]) @ w2[j, n]      (fp32, TMA reduce-add)
    band_ready[b] = epoch          (st.release.gpu) once every contribution to rows
                                   [b * band_rows, (b + 1) * band_rows) of acc is complete

Hopper (sm_90a) CuTe DSL kernel, same skeleton as ``grouped_gemm.py`` (persistent CTAs, one TMA
producer warp, WGMMA consumer warpgroups, TMA-store epilogue through a ``PipelineTmaStore``):

* work unit = (m-tile of ``tile_m`` rows, j-tile of ``tile_o`` hidden columns), linear index
  u = m_tile * J + j (J = O_g / tile_o): m-major, so the J contributions of one band run at the
  same time on J CTAs and bands complete (and are published) in order; CTA i takes
  u = i, i + G, ... with G = SMs - ccta (a launch argument).
* One TMA/mbarrier ring of stages feeds both GEMMs, consumed in the order it is filled: per unit,
  P / tile_k GEMM1 stages (X tile + W1 tile), then two W2 chunk stages per n-tile (a W2 chunk,
  tile_n x tile_o / 2, lives in the W1 tile's buffer: same size). One ring gives each GEMM every
  stage and streams the next GEMM's operands while the current one finishes (``_ring_plan``:
  tile_o 256 -> 4 x 48 KiB stages + 32 KiB epilogue buffers; 3 stages + 64 KiB H + 16 KiB
  with h_regs=False).
* GEMM1: the unit's whole tile_m x tile_o H tile at once (64 x tile_o WGMMA accumulator per
  warpgroup, X read once per unit); the accumulator starts at b1 (fp32), so the bias costs
  nothing; act1 in registers; converted to bf16 in place into GEMM2's A fragment (h_regs,
  default: the m64 accumulator fragment is the m64k16 A fragment element for element, as in
  FlashAttention-3's P.V), or (h_regs=False) written to shared memory (``sH``, K-major swizzled)
  with stmatrix + ``fence.proxy.async.shared::cta``. H never goes to HBM.
* GEMM2: for each n-tile (rotated start n = j mod N/tile_n, so the J CTAs of a band do not
  reduce into the same columns at once): acc_tile = H @ W2[j, n] with K = tile_o (A from
  registers or sH, B = the two W2 chunks from the ring), then the fp32 tile is added into acc:
  ``epilogue="tma"`` (default) in ``tile_m x epi_n`` sub-tiles through ``epi_stages``
  shared-memory buffers with TMA reduce-add (``cp.reduce.async.bulk.tensor...add``);
  ``epilogue="red"`` straight from registers with ``red.global.add.v2.f32``.
* Counting: the unit (m, j) is complete once its N/tile_n reductions have completed; the
  epilogue warp (the one that issued them; every consumer thread with the red epilogue, see
  ``_count_unit``) counts it on ``band_counter[b]`` and the last of the
  band's J * (m-tiles in band) contributions publishes ``band_ready[b] = epoch``. The count is
  posted (deferred, as in grouped_gemm) in the middle of the next unit's GEMM1 k-loop, when the
  reductions are long finished. See ``_count_unit`` for the memory-ordering argument.

* ``cluster_m=2`` (option, dense call only): clusters of two CTAs on units (2p, j), (2p + 1, j)
  load half of every W1 tile and W2 chunk each and multicast it to both.

Without GEMM2's fp32 reductions both GEMMs run at cuBLAS speed, so the reduce epilogue is the
limit (its throughput depends on the sub-tile row width and buffering, hence h_regs). Timings of
the variants, and of those tried and dropped: bench/NOTES.md.
Limits: tile_n = 128 only; one consumer warpgroup per 64 rows of tile_m (tile_m 64 or 128).
The pipeline mbarrier waits are the usual unbounded ones (TMA completion); the kernel never waits
on another CTA or on the communication blocks (one-way dependency).

cutlass is imported lazily: importing this module needs only torch.
"""

import torch

from ..runtime.device import num_sms

__all__ = ["FusedFFNCompute", "fused_ffn_compute_reference", "ACTIVATIONS"]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
_SMEM_CAPACITY_SM90 = 232448  # bytes of dynamic shared memory per CTA on sm_90


# --------------------------------------------------------------------------------------------
# Plain torch reference (the truth the tests use)
# --------------------------------------------------------------------------------------------
def fused_ffn_compute_reference(x, w1, b1, w2, act1: str, acc=None):
    """fp32 ``act1(x @ w1 + b1) @ w2`` with H rounded to bf16 like the kernel (inputs any float
    dtype, any device); added into ``acc`` when given (returned), else returned as a new tensor."""
    from .activations import activation
    if act1 not in ACTIVATIONS:
        raise ValueError(f"act1={act1!r}: choose from {ACTIVATIONS}")
    h = x.float() @ w1.float()
    if b1 is not None:
        h = h + b1.float()
    h = activation(h, act1).to(torch.bfloat16).float()
    y = h @ w2.float()
    if acc is None:
        return y
    acc += y
    return acc


def _ring_plan(tile_m, tile_o, tile_n, tile_k, stages, epi_n, epi_stages, red_epi, h_regs=False,
               h_pair=False):
    """Shared-memory plan of the kernel: returns (ring stages, epi_n).

    Per CTA: the ring (stage = X tile tile_m x tile_k + one W1 tile tile_o x tile_k, or one W2
    chunk tile_n x tile_o / 2 in the W1 tile's place: the same size when tile_n = 2 tile_k), the
    unit's H tile (tile_m x tile_o bf16) and the fp32 epilogue buffers (tile_m x epi_n x
    epi_stages, none for the red epilogue), plus 1 KiB for the mbarriers and alignment.
    stages None: as many as fit; epi_n None: 32 unless that leaves fewer than 3 stages, then 16
    (tile_o 256: 3 x 48 KiB stages + 64 KiB H + 16 KiB epilogue = 225 KiB of 227; with h_regs,
    H in registers: 4 stages + 32 KiB of 128-byte-row epilogue buffers)."""
    x_bytes, b_bytes = tile_m * tile_k * 2, tile_o * tile_k * 2
    if tile_n * (tile_o // 2) * 2 != b_bytes:
        raise ValueError(f"tile_n={tile_n} must be 2 * tile_k = {2 * tile_k} (a W2 chunk fills "
                         f"a W1 stage buffer)")
    # h_regs: no H tile, but its 1 KiB-aligned stub in the shared storage struct; h_pair: one of
    # the unit's two H tiles in shared memory
    h_bytes = 1024 if h_regs and not h_pair else tile_m * tile_o * 2

    def fit(n):
        epi = 0 if red_epi else tile_m * n * 4 * epi_stages
        return (_SMEM_CAPACITY_SM90 - 1024 - h_bytes - epi) // (x_bytes + b_bytes)

    if epi_n is None:
        epi_n = 32 if red_epi or fit(32) >= 3 else 16
    max_stages = fit(epi_n)
    stages = max_stages if stages is None else stages
    if stages < 2 or stages > max_stages:
        raise ValueError(f"stages={stages} does not fit in shared memory (2..{max_stages} with "
                         f"tile_m={tile_m}, tile_o={tile_o}, epi_n={epi_n}, "
                         f"epi_stages={epi_stages})")
    return stages, epi_n


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
def _kernel_class():
    """Builds the kernel class on first use (imports cutlass lazily)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
    from cutlass.utils import LayoutEnum

    from ..kernels.primitives import (count_band_after_bulk_stores, fence_acq_rel_gpu,
                             multicast_rank_and_mask, publish_band_count)
    from .band_allreduce import device_lib

    def red_add_v2_f32(addr, a, b):
        """acc[addr .. addr + 8) += (a, b): a relaxed gpu-scope vector reduction (sm_90)."""
        cute.arch.inline_ptx("red.global.add.v2.f32 [{$r0}], {{$r1}, {$r2}};",
                             read_only_args=[addr, a, b])

    act_fn = device_lib().act  # fp32 relu / gelu (erf) / gelu_tanh / silu, same as act2

    def acc_to_smem_copy(tiled_mma, elem_ty_d):
        """Tiled copy of a (row-major) fp32 WGMMA accumulator into shared memory as elem_ty_d:
        stmatrix for bf16 (H), plain st.shared for fp32 (the epilogue's sub-tiles); the 16-bit
        stmatrix atom gives the accumulator's thread/value layout in both cases."""
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                                   cutlass.BFloat16)
        return cute.make_tiled_copy_S(
            sm90_utils.sm90_get_smem_store_op(LayoutEnum.ROW_MAJOR, elem_ty_d=elem_ty_d,
                                              elem_ty_acc=cutlass.Float32),
            cute.make_tiled_copy_C_atom(atom, tiled_mma))

    class _FusedFFNKernel:
        def __init__(self, tile_m, tile_o, tile_n, tile_k, act1, stages, epi_n, epi_stages,
                     signal_k_tile, diag_plain_store=False, epilogue="tma", cluster_m=1,
                     diag_skip=None, h_regs=False, h_pair=False):
            self.acc_dtype = cutlass.Float32
            # cluster_m = 2: the two CTAs of a cluster take units (2p, j) and (2p + 1, j) (same
            # hidden columns, adjacent m-tiles): each loads half of every W1 tile and W2 chunk
            # and multicasts it to both, so per SM a third fewer operand bytes come from L2 in
            # GEMM1 and half in GEMM2. X stays per CTA.
            self.cluster_m = cluster_m
            self.tile_m, self.tile_o, self.tile_n, self.tile_k = tile_m, tile_o, tile_n, tile_k
            # GEMM1 computes the unit's whole tile_m x tile_o H tile at once (accumulator
            # 64 x tile_o per warpgroup): X and W1 are read once per unit. GEMM2 reduces over
            # all tile_o hidden columns, taking W2 in two k-chunks of tile_o / 2 rows per n tile,
            # so that a W2 chunk (tile_n x tile_o / 2) is exactly as large as a W1 tile
            # (tile_o x tile_k): both live in the same stage buffer of the one shared ring.
            self.kc2 = tile_o // 2
            self.act1 = act1
            self.req_stages = stages
            self.epi_n, self.epi_stage = epi_n, epi_stages
            self.signal_k_tile = signal_k_tile
            self.diag_plain_store = diag_plain_store
            # diag_skip (benchmarks only, wrong results): "gemm1" / "gemm2" leave that GEMM's
            # stages and work out on both sides of the ring, "epilogue" GEMM2's reductions;
            # "gemm1+epilogue" both
            self.skip_gemm1 = diag_skip in ("gemm1", "gemm1+epilogue")
            self.skip_gemm2 = diag_skip == "gemm2"
            self.skip_epi = diag_skip in ("epilogue", "gemm1+epilogue")
            # h_regs: H stays in registers as GEMM2's A operand (WGMMA RS): the GEMM1
            # accumulator's fragment (m64 n8 blocks) is, element for element, the A fragment of
            # m64 k16 for 16-bit types, so no shared memory, fence or barrier sits between the
            # GEMMs, and the 64 KiB of sH go to the ring and the epilogue buffers
            self.h_regs = h_regs
            # h_pair (with h_regs): a unit covers two hidden tiles j0, j0 + 1 of one m-tile: H of
            # j0 + 1 goes to sH, H of j0 stays in registers, and GEMM2 reduces over both (K =
            # 2 tile_o) before each fp32 reduce-add: half the reduce-add bytes per FLOP
            self.h_pair = h_pair
            self.jpu = 2 if h_pair else 1  # hidden tiles per unit
            self.h_smem = (not h_regs) or h_pair  # an H tile in shared memory
            # "red": each thread adds its accumulator pairs straight from registers into acc
            # with red.global.add.v2.f32 (fire-and-forget: the next product's WGMMAs start at
            # once, no shared-memory round trip, no barriers). "tma" (default): fp32 sub-tiles
            # through shared memory and TMA reduce-add. About as fast as each other (NOTES.md).
            self.red_epi = epilogue == "red"
            # one consumer warpgroup per 64 rows; WG w owns rows [64 w, 64 w + 64) of the tile in
            # both GEMMs, so the H rows it writes to sH are the ones its GEMM2 reads.
            self.num_mma_wg = tile_m // 64
            self.atom_layout_mnk = (self.num_mma_wg, 1, 1)
            self.threads_per_wg = 128
            self.threads_per_cta = (1 + self.num_mma_wg) * self.threads_per_wg
            self.load_warp_id = 0
            self.epi_store_warp_id = 4  # first consumer warp: issues the reductions, posts flags
            self.load_regs = 40
            self.mma_regs = 232 if self.num_mma_wg == 2 else 240
            self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
            self.epi_barrier = pipeline.NamedBarrier(barrier_id=1,
                                                     num_threads=self.num_mma_threads)
            self.buffer_align_bytes = 1024
            self.stages, self.epi_n = _ring_plan(tile_m, tile_o, tile_n, tile_k, stages, epi_n,
                                                 epi_stages, self.red_epi, h_regs, h_pair)
            if self.red_epi:  # the (unused) TMA output buffer shrinks to one 16-column sub-tile
                self.epi_n, self.epi_stage = 16, 1

        # ---------------------------------------------------------------- host-side setup
        def _setup(self):
            bf16, f32 = cutlass.BFloat16, cutlass.Float32
            kmaj = LayoutEnum.ROW_MAJOR  # A operands (X, sH): K contiguous
            # GEMM1: A = X tile (K-major), B = W1 tile (O contiguous: MN-major), N = tile_o
            self.tiled_mma1 = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, kmaj.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
                self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_o))
            # GEMM2: A = sH (K-major, K = tile_o) or H in registers, B = W2 chunks (N contiguous)
            a2 = dict(a_source=sm90_utils.OperandSource.RMEM) if self.h_regs else {}
            self.tiled_mma2 = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, kmaj.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
                self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_n), **a2)
            # h_pair: the second H tile's GEMM2 reads it from sH (A from shared memory)
            self.tiled_mma2s = self.tiled_mma2
            if self.h_pair:
                self.tiled_mma2s = sm90_utils.make_trivial_tiled_mma(
                    bf16, bf16, kmaj.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
                    self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_n))
            self.epi_tile = (self.tile_m, self.epi_n)

            def smem_layout(layout, dtype, shape_2d, stages):
                is_k_major = layout.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
                major_size = shape_2d[1] if is_k_major else shape_2d[0]
                atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                    sm90_utils.get_smem_layout_atom(layout, dtype, major_size), dtype)
                if stages is None:
                    return cute.tile_to_shape(atom, shape_2d,
                                              order=(0, 1) if is_k_major else (1, 0))
                return cute.tile_to_shape(atom, cute.append(shape_2d, stages),
                                          order=(0, 1, 2) if is_k_major else (1, 0, 2))

            # the ring: stage s = X tile in sX[s] and a W1 tile or a W2 chunk in sB[s]
            self.tx1 = (self.tile_m + self.tile_o) * self.tile_k * 2  # GEMM1 k step: X + W1
            self.tx2 = self.tile_n * self.kc2 * 2  # GEMM2 chunk: W2 only (sX[s] idle)
            self.sX_layout = smem_layout(kmaj, bf16, (self.tile_m, self.tile_k), self.stages)
            self.sW1_layout = smem_layout(self.b_layout, bf16, (self.tile_o, self.tile_k),
                                          self.stages)
            self.sW2_layout = smem_layout(self.b_layout, bf16, (self.tile_n, self.kc2),
                                          self.stages)
            self.sH_layout = smem_layout(kmaj, bf16, (self.tile_m, self.tile_o), None)
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
            sX1 = cute.slice_(self.sX_layout, (None, None, 0))
            sW11 = cute.slice_(self.sW1_layout, (None, None, 0))
            sW21 = cute.slice_(self.sW2_layout, (None, None, 0))
            sO1 = cute.slice_(self.sO_layout, (None, None, 0))
            G2S = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp
            tma_atom_x, tma_x = cute.nvgpu.cpasync.make_tiled_tma_atom(
                G2S(), mX, sX1, (self.tile_m, self.tile_k))
            if cutlass.const_expr(self.cluster_m > 1):  # weights: half per CTA, multicast
                mc = dict(num_multicast=self.cluster_m)
                w_op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            else:
                mc = {}
                w_op = G2S()
            tma_atom_w1, tma_w1 = cute.nvgpu.cpasync.make_tiled_tma_atom(
                w_op, mW1, sW11, (self.tile_o, self.tile_k), **mc)
            tma_atom_w2, tma_w2 = cute.nvgpu.cpasync.make_tiled_tma_atom(
                w_op, mW2, sW21, (self.tile_n, self.kc2), **mc)
            # TMA reduce-add of fp32 sub-tiles into acc (cp.reduce.async.bulk.tensor ... .add)
            # (diag_plain_store: a plain TMA store instead, wrong results; isolates the cost of
            # the L2 read-modify-write in bench/bench_fused_compute.py)
            o_op = (cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp() if self.diag_plain_store else
                    cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(
                        cute.nvgpu.cpasync.ReductionKind.ADD))
            tma_atom_o, tma_o = cute.nvgpu.cpasync.make_tiled_tma_atom(
                o_op, mAcc, sO1, self.epi_tile)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sX: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.sX_layout)],
                                      self.buffer_align_bytes]
                # W1 tiles and W2 chunks share these buffers (same size, see _ring_plan)
                sB: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.sW1_layout)],
                                      self.buffer_align_bytes]
                sH: cute.struct.Align[cute.struct.MemRange[
                    bf16, cute.cosize(self.sH_layout) if self.h_smem else 8],
                    self.buffer_align_bytes]
                # the red epilogue needs no output staging: 4 bytes stand in for sO
                # (1024-byte aligned for the swizzled TMA reads: with h_regs, sH is a stub)
                sO: cute.struct.Align[cute.struct.MemRange[
                    f32, 1 if self.red_epi else cute.cosize(self.sO_layout)],
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
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_x)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_w1)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_w2)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_o)

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
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                # every consumer warp releases a stage to each CTA that multicast into it
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_mma_wg * 4 * cl),
                tx_count=self.tx1, cta_layout_vmnk=cta_vmnk, defer_sync=True)
            pipeline_init_arrive(cluster_shape_mn=(cl, 1), is_relaxed=True)

            sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
            sW1 = storage.sB.get_tensor(sW1_layout.outer, swizzle=sW1_layout.inner)
            sW2 = storage.sB.get_tensor(sW2_layout.outer, swizzle=sW2_layout.inner)
            sH = None
            if cutlass.const_expr(self.h_smem):
                sH = storage.sH.get_tensor(sH_layout.outer, swizzle=sH_layout.inner)  # M, tile_o
            sO = None
            if cutlass.const_expr(not self.red_epi):
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
            if cutlass.const_expr(self.h_regs):  # bf16 registers ((2, 2, 2), 1, tile_o / 16)
                tCrH = cute.make_rmem_tensor(thr_mma2.partition_A(
                    cute.make_identity_tensor((self.tile_m, self.tile_o))).shape, bf16)
            else:
                tCrH = tiled_mma2.make_fragment_A(thr_mma2.partition_A(sH))  # (.., kb: tile_o)
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
            # diag_skip (benchmarks only, wrong results): leave out one GEMM's stages and work
            # on both sides of the ring, to split the kernel's time between the two phases
            k_tiles1 = 0 if cutlass.const_expr(self.skip_gemm1) else k_tiles
            n_tiles2 = 0 if cutlass.const_expr(self.skip_gemm2) else n_tiles
            n_clusters = gdim // cl
            cluster_id = cutlass.Int32(bidx) // cl

            pipeline_init_wait(cluster_shape_mn=(cl, 1))

            if warp_group_idx == 0:
                cute.arch.setmaxregister_decrease(self.load_regs)
            # ------------------------------------------------------------ producer (TMA) warp
            if warp_idx == self.load_warp_id:
                st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                  self.stages)
                u = cluster_id
                while u < total_units:
                    m_tile, jp, e = self._unit(u, JU, cta_rank, m_tiles, mMtE)
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
                cute.arch.setmaxregister_increase(self.mma_regs)
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

                # H: fp32 accumulator -> bf16 -> sH with stmatrix (or straight into tCrH)
                if cutlass.const_expr(self.h_smem):
                    h_copy = acc_to_smem_copy(tiled_mma1, bf16)
                    thr_h = h_copy.get_slice(ctid)
                    tRS_sH = thr_h.partition_D(sH)
                    tRS_rAcc1 = h_copy.retile(acc1)
                    rH_shape = cute.shape(thr_h.partition_S(sH))
                    tRS_rHf = cute.make_rmem_tensor(rH_shape, self.acc_dtype)
                    tRS_rH = cute.make_rmem_tensor(rH_shape, bf16)
                    size_rH = cute.size(tRS_rHf)
                if cutlass.const_expr(self.h_regs):
                    # acc1 ((2, 2, tile_o / 8), 1, 1) and tCrH ((2, 2, 2), 1, tile_o / 16) are
                    # both compact: element i of one is element i of the other (column pair,
                    # row half, n8 block = 2 kb + k half)
                    tCrH_as_acc1 = cute.make_tensor(tCrH.iterator, acc1.layout)

                if cutlass.const_expr(not self.red_epi):
                    # output: fp32 sub-tiles -> sO (st.shared) -> TMA reduce-add
                    o_copy = acc_to_smem_copy(tiled_mma2, f32)
                    thr_o = o_copy.get_slice(ctid)
                    tRS_sO = thr_o.partition_D(sO)
                    tRS_rAcc2 = o_copy.retile(acc2)
                    rO_shape = cute.shape(thr_o.partition_S(sO))
                    tRS_rO = cute.make_rmem_tensor(rO_shape[:3], self.acc_dtype)
                    size_rO = cute.size(tRS_rO)
                    red_pipeline = pipeline.PipelineTmaStore.create(
                        num_stages=self.epi_stage,
                        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                 self.num_mma_threads))
                # red epilogue: this thread's accumulator coordinates (per-thread slice) and acc
                tCcO_thr = tiled_mma2.get_slice(ctid).partition_C(
                    cute.make_identity_tensor((self.tile_m, self.tile_n)))
                acc_base = cutlass.Int64(mAccRaw.iterator.toint())
                acc_rows = cute.size(mAccRaw, mode=[0])
                acc_ld = cutlass.Int64(cute.size(mAccRaw, mode=[1]))

                epoch = mEpoch[0]
                is_store_warp = warp_idx == self.epi_store_warp_id
                pend_band = cutlass.Int32(-1)  # band of the last unit, not yet counted
                pend_need = cutlass.Int32(0)
                if cutlass.const_expr(self.signal_k_tile is None):
                    signal_k = max(k_tiles // 2, 1)
                else:
                    signal_k = min(max(self.signal_k_tile, 1), k_tiles - 1)
                epis_done = cutlass.Int32(0)

                u = cluster_id
                while u < total_units:
                    m_tile, jp, e = self._unit(u, JU, cta_rank, m_tiles, mMtE)
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
                            for kb in cutlass.range_constexpr(num_kb1):
                                cute.gemm(tiled_mma1, acc1, tCrX[(None, None, kb, read.index)],
                                          tCrW1[(None, None, kb, read.index)], acc1)
                            cute.nvgpu.warpgroup.commit_group()
                            read.advance()
                            for k_tile in range(1, k_tiles):
                                pipe.consumer_wait(read)
                                for kb in cutlass.range_constexpr(num_kb1):
                                    cute.gemm(tiled_mma1, acc1,
                                              tCrX[(None, None, kb, read.index)],
                                              tCrW1[(None, None, kb, read.index)], acc1)
                                cute.nvgpu.warpgroup.commit_group()
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

                        if cutlass.const_expr(self.h_regs and h == self.jpu - 1):
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
                        elif cutlass.const_expr(self.red_epi):
                            # fire-and-forget fp32 adds from registers (pairs of adjacent
                            # columns of the WGMMA accumulator); rows past M are skipped
                            row0 = m_tile * self.tile_m
                            col0 = n_tile * self.tile_n
                            for h in cutlass.range_constexpr(cute.size(acc2) // 2):
                                rr = row0 + tCcO_thr[2 * h][0]
                                if rr < acc_rows:
                                    off = cutlass.Int64(rr) * acc_ld + (col0 + tCcO_thr[2 * h][1])
                                    red_add_v2_f32(acc_base + off * 4, acc2[2 * h],
                                                   acc2[2 * h + 1])
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
                                cute.copy(o_copy, tRS_rO, tRS_sO[(None, None, None, buf)])
                                # st.shared (generic) -> TMA reduce (async proxy) reads sO
                                cute.arch.fence_proxy("async.shared", space="cta")
                                self.epi_barrier.arrive_and_wait()
                                if is_store_warp:
                                    bSG_sO, bSG_gO = cute.nvgpu.cpasync.tma_partition(
                                        tma_atom_o, 0, one, cute.group_modes(sO, 0, 2), gO_epi)
                                    cute.copy(tma_atom_o, bSG_sO[(None, buf)],
                                              bSG_gO[(None, epi_layout.get_hier_coord(epi_idx))])
                                    red_pipeline.producer_commit()
                                    # buffer reuse: at most epi_stages - 1 groups still reading sO
                                    red_pipeline.producer_acquire()
                                self.epi_barrier.arrive_and_wait()
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
                if cutlass.const_expr(not self.red_epi):
                    red_pipeline.producer_tail()

        @cute.jit
        def _unit(self, u: cutlass.Int32, J: cutlass.Int32, cta_rank, m_tiles: cutlass.Int32,
                  mMtE: cute.Tensor):
            """Work item u -> (m_tile, j_tile, expert): u = m_pair * J + j (J = units per m-pair:
            O_g / tile_o, or the number of hidden-tile pairs with h_pair), m_tile = m_pair *
            cluster_m + this CTA's rank; the expert of a phantom m-tile past M is the last one's."""
            m_pair = u // J
            j_tile = u - m_pair * J
            m_tile = m_pair * self.cluster_m + cta_rank
            m_e = m_tile
            if m_e >= m_tiles:
                m_e = m_tiles - 1
            return m_tile, j_tile, mMtE[m_e]

        @cute.jit
        def _count_unit(self, b: cutlass.Int32, need: cutlass.Int32, epoch: cutlass.Int32,
                        mReady: cute.Tensor, mCounter: cute.Tensor, is_store_warp,
                        ctid: cutlass.Int32):
            """Counts one finished unit of band b. TMA epilogue: the warp that issued the bulk
            reductions waits for them and counts (``primitives.count_band_after_bulk_stores``,
            whose docstring has the memory-ordering argument; on the consumer side
            BandAllReduce's ``ld.acquire.gpu`` of the flag is followed by generic-proxy reads of
            acc only, so it needs no proxy fence). Red epilogue: the adds
            were issued by every consumer thread, so every thread orders its own adds
            (``fence.acq_rel.gpu``: they are performed, at gpu scope, before anything it does
            next), the named barrier orders all of them before thread 0's ``atom.acq_rel.gpu``
            (release is cumulative over what happens-before it), and thread 0 counts."""
            if cutlass.const_expr(self.red_epi):
                fence_acq_rel_gpu()
                self.epi_barrier.arrive_and_wait()
                if ctid == 0:
                    publish_band_count(mCounter, mReady, b, need, epoch)
            else:
                if is_store_warp:
                    count_band_after_bulk_stores(mCounter, mReady, b, need, epoch)

    return _FusedFFNKernel


# --------------------------------------------------------------------------------------------
# Host wrapper
# --------------------------------------------------------------------------------------------
_KERNEL_CLASS = None


def _get_kernel_class():
    global _KERNEL_CLASS
    if _KERNEL_CLASS is None:
        _KERNEL_CLASS = _kernel_class()
    return _KERNEL_CLASS


class FusedFFNCompute:
    """Compute blocks of the fused TP FFN (see the module docstring).

    FusedFFNCompute(tile_m=128, tile_o=256, tile_n=128, band_rows=None, stages=None,
                    epi_n=None, epi_stages=2, signal_k_tile=None, epilogue="tma",
                    cluster_m=1, h_regs=True, h_pair=False)
        tile_m in {64, 128} (one consumer warpgroup per 64 rows); tile_o in {128, 256} (hidden
        columns per unit: GEMM1's N, GEMM2's K; 256 halves the fp32 reduce-add traffic and is
        faster, 128 serves O_g that 256 does not divide); tile_n = 128; band_rows: rows per
        ready flag, a multiple of tile_m (None: tile_m); must equal the BandAllReduce's
        band_rows; stages: depth of the operand ring (None: as many as fit, see _ring_plan);
        epi_n (fp32 columns per reduce sub-tile; None: 32, or 16 where 32 would leave fewer than
        3 stages) and epi_stages (sub-tile buffers); signal_k_tile: GEMM1 k iteration of the next
        unit at which the previous unit is counted (None: the middle); epilogue: "tma" (fp32
        sub-tiles through shared memory, TMA reduce-add) or "red" (red.global.add.v2.f32
        straight from registers; slower, see bench/NOTES.md); cluster_m: 2 = clusters
        of two CTAs on adjacent m-tiles sharing every W1 tile and W2 chunk by TMA multicast
        (dense __call__ only; the grid is rounded down to even); h_regs (default): H stays in
        registers as GEMM2's A operand (WGMMA RS) instead of a 64 KiB shared-memory tile, which
        leaves room for a 4-stage ring and 128-byte epilogue rows (faster, bench/NOTES.md);
        False: H through shared memory. h_pair (needs h_regs, O_g / tile_o even): a unit
        covers two hidden tiles of one m-tile, one H in registers and one in shared memory, and
        GEMM2 reduces over both before each fp32 reduce-add (half the reduce-add bytes; 3 ring
        stages): faster (bench/NOTES.md); off here, on in FusedFFN /
        ShardedExperts wherever O_g / tile_o is even.

    __call__(x, w1, b1, w2, acc, band_ready, epoch, ccta=0, act1="gelu", stream=None) -> acc
        x [M, P] bf16, w1 [P, O_g] bf16, b1 [O_g] (any float dtype) or None, w2 [O_g, N] bf16,
        acc [M, N] fp32 (contiguous rows; zero on entry unless you want the sum added),
        band_ready int32 [>= ceil(M / band_rows)], epoch int32 [1] (read on the device);
        P % 64 == 0, O_g % tile_o == 0, N % tile_n == 0; any M >= 1 (the TMA clips the ragged
        last m-tile). ccta: SMs left to the communication blocks (grid = SMs - ccta, capped at
        the number of units). Never synchronizes. All checks raise before any launch.
    grouped(x, w1 [E, P, O_g], b1 [E, O_g] | None, w2 [E, O_g, N], acc, band_ready, epoch,
            m_tile_expert, ...): the same kernel over several experts (expert groups padded to
        tile_m rows; m_tile_expert names each m-tile's expert). The dense call is the E = 1 case.
    Compile cache key: (tiles, stages, epilogue, act1, P, O_g, N); M, E, the flag capacity and
    the m-tile table are runtime values.
    """

    _compiled = {}

    def __init__(self, tile_m=128, tile_o=256, tile_n=128, band_rows=None, stages=None,
                 epi_n=None, epi_stages=2, signal_k_tile=None, epilogue="tma", cluster_m=1,
                 h_regs=True, h_pair=False, _diag_plain_store=False, _diag_skip=None):
        if tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
        if tile_o not in (128, 256):
            raise ValueError(f"tile_o must be 128 or 256, got {tile_o}")
        if tile_n != 128:
            raise ValueError(f"tile_n must be 128 in this version, got {tile_n}")
        band_rows = tile_m if band_rows is None else band_rows
        if isinstance(band_rows, bool) or not isinstance(band_rows, int) or band_rows < 1 \
                or band_rows % tile_m:
            raise ValueError(f"band_rows={band_rows!r} must be a positive multiple of "
                             f"tile_m={tile_m}")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or stages < 2):
            raise ValueError(f"stages must be None or an int >= 2, got {stages!r}")
        if epilogue not in ("red", "tma"):
            raise ValueError(f"epilogue must be 'red' or 'tma', got {epilogue!r}")
        if _diag_plain_store and epilogue != "tma":
            raise ValueError("_diag_plain_store applies to epilogue='tma' only")
        if epi_n not in (None, 16, 32):
            raise ValueError(f"epi_n must be None, 16 or 32, got {epi_n}")
        if not isinstance(epi_stages, int) or epi_stages < 1:
            raise ValueError(f"epi_stages must be an int >= 1, got {epi_stages!r}")
        self.tile_m, self.tile_o, self.tile_n, self.tile_k = tile_m, tile_o, tile_n, 64
        self.band_rows = band_rows
        # shared-memory plan (raises if it does not fit): ring depth and epilogue sub-tile
        self.h_regs = bool(h_regs)
        if h_pair and not h_regs:
            raise ValueError("h_pair needs h_regs=True (one H tile stays in registers)")
        self.h_pair = bool(h_pair)
        self.stages, self.epi_n = _ring_plan(tile_m, tile_o, tile_n, self.tile_k, stages, epi_n,
                                             epi_stages, epilogue == "red", self.h_regs,
                                             self.h_pair)
        self.epi_stages = epi_stages
        self.signal_k_tile = None if signal_k_tile is None else int(signal_k_tile)
        self._diag_plain_store = bool(_diag_plain_store)  # benchmarks only: results are wrong
        if _diag_skip not in (None, "gemm1", "gemm2", "epilogue", "gemm1+epilogue"):
            raise ValueError("_diag_skip must be None, 'gemm1', 'gemm2', 'epilogue' or "
                             f"'gemm1+epilogue', got {_diag_skip!r}")
        self._diag_skip = _diag_skip  # benchmarks only: results are wrong
        self.epilogue = epilogue
        if cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {cluster_m!r}")
        self.cluster_m = int(cluster_m)
        self._counters = {}
        self._b1_zero = {}

    # ---------------------------------------------------------------- validation
    def check(self, x, w1, b1, w2, acc, band_ready, epoch, ccta=0, act1="gelu",
              need_cuda=True):
        """All argument checks (TypeError / ValueError); returns (M, P, O_g, N)."""
        if act1 not in ACTIVATIONS:
            raise ValueError(f"act1={act1!r}: choose from {ACTIVATIONS}")
        tensors = dict(x=x, w1=w1, w2=w2, acc=acc, band_ready=band_ready, epoch=epoch)
        if b1 is not None:
            tensors["b1"] = b1
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if need_cuda and t.device.type != "cuda":
                raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, x on {x.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        for name in ("x", "w1", "w2", "acc"):
            if tensors[name].data_ptr() % 16:
                raise ValueError(f"{name} must be 16-byte aligned (TMA)")
        for name in ("x", "w1", "w2"):
            if tensors[name].dtype != torch.bfloat16:
                raise TypeError(f"{name} must be bfloat16, got {tensors[name].dtype}")
        if acc.dtype != torch.float32:
            raise TypeError(f"acc must be float32, got {acc.dtype}")
        if b1 is not None and not b1.is_floating_point():
            raise TypeError(f"b1 must be floating point, got {b1.dtype}")
        for name in ("band_ready", "epoch"):
            if tensors[name].dtype != torch.int32:
                raise TypeError(f"{name} must be int32, got {tensors[name].dtype}")
        if x.dim() != 2 or w1.dim() != 2 or w2.dim() != 2 or acc.dim() != 2:
            raise ValueError(f"expected x [M, P], w1 [P, O_g], w2 [O_g, N], acc [M, N]; got "
                             f"{tuple(x.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}, "
                             f"{tuple(acc.shape)}")
        M, P = x.shape
        Pw, O = w1.shape
        Ow, N = w2.shape
        if M < 1:
            raise ValueError("x needs at least one row")
        if Pw != P:
            raise ValueError(f"P mismatch: x has P={P}, w1 has {Pw} rows")
        if Ow != O:
            raise ValueError(f"O_g mismatch: w1 has {O} columns, w2 has {Ow} rows")
        if b1 is not None and (b1.dim() != 1 or b1.numel() != O):
            raise ValueError(f"b1 must be [{O}], got {tuple(b1.shape)}")
        if tuple(acc.shape) != (M, N):
            raise ValueError(f"acc must be [{M}, {N}], got {tuple(acc.shape)}")
        if P % self.tile_k:
            raise ValueError(f"P={P} must be a multiple of tile_k={self.tile_k}")
        if O % self.tile_o:
            raise ValueError(f"O_g={O} must be a multiple of tile_o={self.tile_o}")
        if self.h_pair and O % (2 * self.tile_o):
            raise ValueError(f"h_pair: O_g={O} must be a multiple of 2 * tile_o = "
                             f"{2 * self.tile_o}")
        if N % self.tile_n:
            raise ValueError(f"N={N} must be a multiple of tile_n={self.tile_n}")
        nb = -(-M // self.band_rows)
        if band_ready.dim() != 1 or band_ready.numel() < nb:
            raise ValueError(f"band_ready must be 1-D with >= ceil(M / band_rows) = {nb} "
                             f"entries, got {tuple(band_ready.shape)}")
        if epoch.numel() != 1:
            raise ValueError("epoch must have exactly one element")
        if isinstance(ccta, bool) or not isinstance(ccta, int) or ccta < 0:
            raise ValueError(f"ccta must be a non-negative int, got {ccta!r}")
        return M, P, O, N

    # ---------------------------------------------------------------- compilation
    def _key(self, P, O, N, act1):
        return (self.tile_m, self.tile_o, self.tile_n, self.stages, self.epi_n,
                self.epi_stages, self.signal_k_tile, self._diag_plain_store, self._diag_skip,
                self.epilogue, act1,
                self.cluster_m, self.h_regs, self.h_pair, int(P), int(O), int(N))

    def _kernel(self, act1):
        return _get_kernel_class()(self.tile_m, self.tile_o, self.tile_n, self.tile_k, act1,
                                   self.stages, self.epi_n, self.epi_stages,
                                   self.signal_k_tile, self._diag_plain_store, self.epilogue,
                                   self.cluster_m, self._diag_skip, self.h_regs, self.h_pair)

    def compile(self, P, O, N, act1="gelu", keep_ptx=False):
        """Compiles from symbolic tensors (M and the flag capacity are runtime values); needs no
        GPU with CUTE_DSL_ARCH=sm_90a (compile-only tests). keep_ptx: keep ``fn.__ptx__`` (text)
        and ``fn.__cubin__``."""
        if act1 not in ACTIVATIONS:
            raise ValueError(f"act1={act1!r}: choose from {ACTIVATIONS}")
        key = ("fake", bool(keep_ptx)) + self._key(P, O, N, act1)
        fn = FusedFFNCompute._compiled.get(key)
        if fn is not None:
            return fn
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor
        from cutlass.runtime import make_fake_stream
        M, nb, E, mt = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
        bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        fx = make_fake_tensor(bf16, (M, P), (P, 1), assumed_align=16)
        fw1 = make_fake_tensor(bf16, (O, P, E), (1, O, P * O), assumed_align=16)
        fb1 = make_fake_tensor(f32, (E, O), (O, 1), assumed_align=16)
        fw2 = make_fake_tensor(bf16, (N, O, E), (1, N, O * N), assumed_align=16)
        facc = make_fake_tensor(f32, (M, N), (N, 1), assumed_align=16)
        fr = make_fake_tensor(i32, (nb,), (1,), assumed_align=4)
        fc = make_fake_tensor(i32, (nb,), (1,), assumed_align=4)
        fe = make_fake_tensor(i32, (1,), (1,), assumed_align=4)
        fm = make_fake_tensor(i32, (mt,), (1,), assumed_align=4)
        args = (fx, fw1, fb1, fw2, facc, fr, fc, fe, fm, cutlass.Int32(1), cutlass.Int32(1),
                make_fake_stream())
        if keep_ptx:  # PTX and cubin in memory (fn.__ptx__, fn.__cubin__); dumps to a tmp dir
            from ..kernels.compile import compile_keep
            fn = compile_keep(self._kernel(act1), *args)
        else:
            fn = cute.compile(self._kernel(act1), *args)
        FusedFFNCompute._compiled[key] = fn
        return fn

    # ---------------------------------------------------------------- launch
    @staticmethod
    def _cute_args(x, w1, b1f, w2, acc, band_ready, counter, epoch, mte):
        """torch -> cute tensors (w1 [E, P, O_g], b1f [E, O_g] fp32, w2 [E, O_g, N]); M, E, the
        flag capacity and the m-tile table length are marked dynamic."""
        from cutlass.cute.runtime import from_dlpack

        def dyn(t, mode, align):
            return from_dlpack(t, assumed_align=align).mark_compact_shape_dynamic(
                mode=mode, stride_order=t.dim_order())

        w1t = w1.permute(2, 1, 0)  # (O_g, P, E) view, strides (1, O_g, P O_g): MN-major B
        w2t = w2.permute(2, 1, 0)  # (N, O_g, E) view, strides (1, N, O_g N): MN-major B
        return (dyn(x, 0, 16), dyn(w1t, 2, 16), dyn(b1f, 0, 16), dyn(w2t, 2, 16),
                dyn(acc, 0, 16), dyn(band_ready, 0, 4), dyn(counter, 0, 4),
                from_dlpack(epoch, assumed_align=4), dyn(mte, 0, 4))

    def counter_for(self, band_ready):
        """The persistent zero scratch counter that goes with band_ready (same length)."""
        key = (band_ready.device, band_ready.data_ptr(), band_ready.numel())
        c = self._counters.get(key)
        if c is None:
            c = torch.zeros(band_ready.numel(), dtype=torch.int32, device=band_ready.device)
            self._counters[key] = c
        return c

    def grid(self, M, O, device, ccta):
        cl = self.cluster_m
        units = -(-(-(-M // self.tile_m)) // cl) * cl * (O // self.tile_o // (1 + self.h_pair))
        g = min(num_sms(device) - ccta, units)
        g -= g % cl  # whole clusters
        if g < 1:
            raise ValueError(f"ccta={ccta} leaves no SM (no whole cluster of {cl}) for the "
                             f"compute blocks")
        return g

    def __call__(self, x, w1, b1, w2, acc, band_ready, epoch, ccta=0, act1="gelu",
                 stream=None):
        M, P, O, N = self.check(x, w1, b1, w2, acc, band_ready, epoch, ccta, act1)
        dev = x.device
        torch_stream = stream if stream is not None else torch.cuda.current_stream(dev)
        mt = -(-M // self.tile_m)
        with torch.cuda.stream(torch_stream):
            b1f = self._b1_rows(b1, 1, O, dev)
        # the dense layer is the grouped kernel with one expert: every m-tile reads expert 0
        zk = ("mte", dev)
        mte = self._b1_zero.get(zk)
        if mte is None or mte.numel() < mt:
            mte = torch.zeros(max(mt, 1024), dtype=torch.int32, device=dev)
            self._b1_zero[zk] = mte
        return self._launch(x, w1.unsqueeze(0), b1f, w2.unsqueeze(0), acc, band_ready, epoch,
                            mte, ccta, act1, torch_stream, M, P, O, N)

    def grouped(self, x, w1, b1, w2, acc, band_ready, epoch, m_tile_expert, ccta=0,
                act1="gelu", stream=None):
        """One launch over several experts (``ShardedExperts``): x [M, P] holds the experts'
        rows with every expert's group padded to a multiple of tile_m (so an m-tile, and a
        band, belongs to one expert); w1 [E, P, O_g], b1 [E, O_g] or None, w2 [E, O_g, N];
        m_tile_expert int32 [>= ceil(M / tile_m)]: the expert of each m-tile, in [0, E) (device
        values: the caller guarantees the range; see ShardedExperts). Otherwise as __call__."""
        if self.cluster_m > 1:  # the pair of m-tiles of a cluster must share one expert
            raise ValueError("cluster_m=2 supports the dense call only, not grouped()")
        for name, t, d in (("w1", w1, 3), ("w2", w2, 3)):
            if not isinstance(t, torch.Tensor) or t.dim() != d:
                raise ValueError(f"{name} must be a {d}-D tensor [E, ...]")
        E = w1.shape[0]
        if E < 1 or w2.shape[0] != E:
            raise ValueError(f"w1 has {E} experts, w2 {w2.shape[0]}")
        if b1 is not None and (not isinstance(b1, torch.Tensor) or b1.dim() != 2
                               or b1.shape[0] != E):
            raise ValueError(f"b1 must be [E={E}, O_g]")
        M, P, O, N = self.check(x, w1[0], None if b1 is None else b1[0], w2[0], acc, band_ready,
                                epoch, ccta, act1)
        for name, t in (("w1", w1), ("w2", w2)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        mt = -(-M // self.tile_m)
        if not isinstance(m_tile_expert, torch.Tensor) or m_tile_expert.dtype != torch.int32 \
                or m_tile_expert.dim() != 1 or m_tile_expert.numel() < mt \
                or m_tile_expert.device != x.device:
            raise ValueError(f"m_tile_expert must be an int32 vector of >= {mt} entries on "
                             f"{x.device}")
        dev = x.device
        torch_stream = stream if stream is not None else torch.cuda.current_stream(dev)
        with torch.cuda.stream(torch_stream):
            b1f = self._b1_rows(b1, E, O, dev)
        return self._launch(x, w1, b1f, w2, acc, band_ready, epoch, m_tile_expert, ccta, act1,
                            torch_stream, M, P, O, N)

    def _b1_rows(self, b1, E, O, dev):
        """b1 as a 16-byte aligned fp32 [E, O] (zeros, cached, when None)."""
        if b1 is None:
            zk = (dev, E, O)
            if zk not in self._b1_zero:
                self._b1_zero[zk] = torch.zeros(E, O, dtype=torch.float32, device=dev)
            return self._b1_zero[zk]
        b1f = b1.reshape(E, O)
        b1f = b1f if b1f.dtype == torch.float32 else b1f.float()
        if b1f.data_ptr() % 16 or not b1f.is_contiguous():
            b1f = b1f.contiguous().clone()
        return b1f

    def _launch(self, x, w1, b1f, w2, acc, band_ready, epoch, mte, ccta, act1, torch_stream,
                M, P, O, N):
        grid = self.grid(M, O, x.device, ccta)
        counter = self.counter_for(band_ready)
        import cutlass
        import cutlass.cute as cute
        import cuda.bindings.driver as cuda_drv
        cu_stream = cuda_drv.CUstream(torch_stream.cuda_stream)
        args = self._cute_args(x, w1, b1f, w2, acc, band_ready, counter, epoch, mte)
        mt = cutlass.Int32(self.band_rows // self.tile_m)
        key = ("dlpack",) + self._key(P, O, N, act1)
        fn = FusedFFNCompute._compiled.get(key)
        if fn is None:
            fn = cute.compile(self._kernel(act1), *args, mt, cutlass.Int32(grid), cu_stream)
            FusedFFNCompute._compiled[key] = fn
        # b1f (if converted) was allocated on torch_stream: freeing it after the launch is safe
        fn(*args, mt, cutlass.Int32(grid), cu_stream)
        return acc
