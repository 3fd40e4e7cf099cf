"""The chained FFN compute kernel: ``ChainedFFNKernel``, a ``GemmSm90`` subclass, two tile kinds.

GEMM1 tiles (``H_ring[slot][:, j] = act1(x[blk] W1[:, j] + b1[j])``) and GEMM2 tiles
(``out[blk, n] = H_ring[slot] W2[:, n]``) of one runtime tile list; the host wrapper, the tensors'
contract, the dependency protocol and the torch reference are in ``ffn.compute_chained``. What it
shares with the base (and the other two kernels): the tiled MMA, the staged shared-memory
layouts, the TMA load / store atoms, the descriptor prefetch, the operand-ring pipeline, the
WGMMA step of one ring stage and the register reallocation. What is its own: the dynamic tile
scheduler (a global atomic tile counter and a two-slot shared-memory mailbox: the tiles are taken
in list order, which the cross-CTA waits need), one ring feeding both kinds (x + W1 or H + W2
stages), the separate store warp (warp 1) with its FULL / EMPTY named-barrier handshake (the base's
``store_epi_subtile`` has a consumer warp issue the store, which would put the bounded slot wait
and the counter releases into a WGMMA warpgroup), and the bounded cross-CTA counter waits.

``grouped=True`` (compile-time) is the same kernel over E experts (``ChainedFFNCompute.grouped``):
the weights are 3-D TMA tensors with the expert as their last coordinate, b1 is [E, hidden], and
the tile table carries each row block's expert after its tile rows (``mTable[3 * num_tiles +
blk]``, written by the host before the launch), so the parameter list is the dense kernel's and
its PTX is unchanged. The TMA warp checks the expert against [0, E) (out of range: the error
word, ``ERR_EXPERT_RANGE``, and expert 0's weights so that every access stays in bounds).

``cluster=2`` (compile-time, dense only): 2-CTA clusters along M on the pair table
(``PairedChainedSchedule``): the weight TMA atoms multicast (each CTA loads its half of the
tile into both), the operand ring is the base's cluster-aware pipeline with bounded waits
(``ring_wait``), the TMA warps run the cluster mailbox (``fetch_tile_pair``: the leader takes
the tile and posts it to the peer's inbox through distributed shared memory, each TMA warp
posts it to its own CTA's readers), a CTA whose row block lies past M stores and counts
nothing, and the CTAs end with a cluster barrier. With cluster=1 nothing of this is traced
(the dense PTX is unchanged).

Termination of cluster=2: every role of both CTAs reaches the closing cluster barrier in
bounded time, also after a wait gave up (tests/test_chained_cluster_mailbox_cpu.py models it).

* Every wait that has the other CTA of the cluster on its far side is bounded and gives up at
  ``timeout_ns`` (recording its error) or as soon as the error word is set: the operand ring's
  three (``ring_wait``: ``RING_ACQUIRE``, a stage freed by the consumers of both CTAs;
  ``RING_FULL``, a stage filled by both CTAs' loads; ``RING_TAIL``, the TMA warp's last look
  at every stage) and the mailbox's two (the leader's wait for the peer's forward, the peer's
  wait for the leader's post). The counter waits (``wait_count``) are bounded the same way.
* A give-up changes no loop count: the caller goes on to its next stage (a TMA warp that could
  not acquire a stage, or found its previous fill incomplete, arms and loads no stage from
  then on: no barrier phase is armed twice), the mailbox posts kind -1 to its own CTA. So the
  roles of one CTA walk the same tiles with the same k counts, and once the error word is set
  every later wait that would block gives up at its first spin.
* The waits inside one CTA are exact, as with cluster=1: a reader's wait for its slot (its own
  TMA warp posts every tile the reader waits for: the TMA warp saw the same previous tile, and
  its own waits are all bounded), the TMA warp's wait for its readers (they hand a slot back
  right after reading it), the epilogue's named barriers (consumers and store warp walk the
  same tiles). Each has a role of its own CTA on the far side whose waits are all bounded.
* Why the peer's tile goes through an inbox: each slot has one writer, its CTA's TMA warp,
  which writes it only after every reader of its CTA read the slot's previous tile. A kind -1
  after a give-up therefore reaches all readers of a CTA alike and never overwrites words a
  reader has not read, nor completes a second phase of its full barrier; the roles of one CTA
  never disagree on a tile (a disagreement would leave the consumers or the store warp in a
  named barrier that the other never reaches, a second phase a reader that waits for the
  next one that never comes). The
  leader writes the inbox only after the peer's forward, which the peer sends once it has read
  the inbox's previous tile; a post that comes after the peer gave up is never read.
* Divergence: when one CTA stops taking tiles while the other goes on (the peer gave up on a
  post that the leader makes later, or the leader on a forward), the CTA that goes on waits for
  stages its partner never fills or frees: those ring waits give up (the partner's record set
  the error word; else at their own timeout, naming the ring), the leader's next mailbox wait
  gives up on the missing forward, and both CTAs end their tiles; the tail gives up likewise.
  After a give-up no wait proves that the copies a TMA warp issued (into both CTAs' shared
  memory) have landed, and the partner may exit right after the closing barrier: a TMA warp
  that sees the error word set waits ``ERROR_SETTLE_NS`` before it.

Imports cutlass (the host wrapper imports this module when it compiles).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..kernels.gemm_sm90 import GemmSm90, smem_layout_staged
from ..kernels.primitives import (fence_mbar_init, globaltimer, ld_acquire_gpu_s32,
                                  ld_shared_s32, mbar_arrive, mbar_init,
                                  mbar_wait_parity_cluster_or_error,
                                  mbar_test_wait_parity, mbar_wait_parity_intra_cta,
                                  mbar_wait_parity_or_error,
                                  multicast_rank_and_mask, record_error,
                                  red_release_gpu_add_s32, st_shared_s32, warp_all)
from .band_allreduce import device_lib
from .chained_schedule import (ERR_BLOCK_TIMEOUT, ERR_EXPERT_RANGE, ERR_MAILBOX_TIMEOUT,
                               ERR_RING_TIMEOUT, ERR_SLOT_TIMEOUT, RING_ACQUIRE, RING_FULL,
                               RING_TAIL)

__all__ = ["ChainedFFNKernel"]

act_fn = device_lib().act  # fp32 none / relu / gelu (erf) / gelu_tanh / silu

def ld_relaxed_gpu_s64(addr):
    return cute.arch.inline_ptx("ld.relaxed.gpu.global.s64 {$w0}, [{$r0}];",
                                write_only_types=[Int64], read_only_args=[addr])


def atom_add_relaxed_gpu_s32(addr, v):
    return cute.arch.inline_ptx("atom.relaxed.gpu.global.add.s32 {$w0}, [{$r0}], {$r1};",
                                write_only_types=[Int32], read_only_args=[addr, Int32(v)])


def atom_add_acq_rel_gpu_s32(addr, v):
    return cute.arch.inline_ptx("atom.acq_rel.gpu.global.add.s32 {$w0}, [{$r0}], {$r1};",
                                write_only_types=[Int32], read_only_args=[addr, Int32(v)])


# ---- distributed shared memory of a 2-CTA cluster (the cluster mailbox) ----------------------
def mapa_shared(addr, rank):
    """The shared::cluster address of this CTA's shared::cta address ``addr`` in CTA ``rank``
    of the cluster."""
    return cute.arch.inline_ptx("mapa.shared::cluster.u32 {$w0}, {$r0}, {$r1};",
                                write_only_types=[Int32],
                                read_only_args=[Int32(addr), Int32(rank)])


def st_shared_cluster_s32(addr, v):
    cute.arch.inline_ptx("st.shared::cluster.s32 [{$r0}], {$r1};",
                         read_only_args=[Int32(addr), Int32(v)])


def mbar_arrive_remote(addr):
    """mbarrier.arrive on a shared::cluster address (another CTA's barrier), release at cluster
    scope: this thread's earlier writes (its st.shared::cluster included) and what it observed
    are visible to a thread whose acquire.cluster wait on the completed phase succeeds."""
    cute.arch.inline_ptx("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [{$r0}];",
                         read_only_args=[Int32(addr)])


# after an error, what a TMA warp of a cluster waits before the closing cluster barrier: its
# bulk copies into both CTAs' shared memory land within microseconds, and no wait proves it
# once one gave up (module docstring, "Divergence")
ERROR_SETTLE_NS = 1_000_000

# cluster mailbox layout (bytes from its base): full[s] at 8 s, empty[s] at 16 + 8 s, slot s's
# words (kind, block, column tile, list position) at 32 + 16 s; cluster 2 adds the peer's inbox:
# inbox_full[s] at 64 + 8 s (the leader's remote arrive), inbox_free[s] at 80 + 8 s (on the
# leader: the peer's forward), the inbox words at 96 + 16 s (written by the leader)
MAILBOX_BYTES = (64, 128)  # cluster 1, cluster 2


@cute.jit
def mailbox_wait(mbar: Int32, parity: Int32, err: Int64, rank: Int32, n: Int32, slot: Int32,
                 timeout_ns: Int64):
    """acquire.cluster wait on a mailbox phase that the other CTA of the cluster completes,
    bounded: on timeout records ERR_MAILBOX_TIMEOUT (this CTA's cluster rank, its tile count n,
    the slot, the parity); gives up at once when the error word is set. Returns 1 when the
    phase completed, else 0 (one lane calls it)."""
    status, el = mbar_wait_parity_cluster_or_error(mbar, parity, err, timeout_ns)
    if status == Int32(1):
        record_error(err, Int32(ERR_MAILBOX_TIMEOUT), rank, n, slot, Int64(0), Int64(parity),
                     el)
    ok = Int32(1)
    if status != Int32(0):
        ok = Int32(0)
    return ok


@cute.jit
def ring_wait(mbar: Int32, parity: Int32, stage: Int32, side: Int32, err: Int64,
              timeout_ns: Int64):
    """A wait of the operand ring of a cluster (the base pipeline's barrier ``mbar``, the parity
    of its pipeline state), bounded: on timeout records ERR_RING_TIMEOUT (this CTA's cluster
    rank, the stage, ``side``: RING_ACQUIRE / RING_FULL / RING_TAIL, the parity, the CTA's block
    index); gives up at once when the error word is set. Returns 1 when the phase completed,
    else 0 (every thread of the waiting group calls it, as the pipeline's waits)."""
    status, el = mbar_wait_parity_or_error(mbar, parity, err, timeout_ns)
    if status == Int32(1):
        bidx, _, _ = cute.arch.block_idx()
        record_error(err, Int32(ERR_RING_TIMEOUT), cute.arch.block_idx_in_cluster(), stage,
                     side, Int64(parity), Int64(bidx), el)
    ok = Int32(1)
    if status != Int32(0):
        ok = Int32(0)
    return ok


@cute.jit
def wait_count(addr: Int64, target: Int32, err: Int64, code: Int32, pos: Int32, blk: Int32,
               timeout_ns: Int64):
    """Spin (ld.acquire.gpu) until ``*addr == target``; on timeout record the error word and
    stop; stop at once when another wait already recorded one (the launch must end)."""
    t0 = globaltimer()
    v = ld_acquire_gpu_s32(addr)
    go = Int32(1)
    while v != target and go == Int32(1):
        el = globaltimer() - t0
        if el > timeout_ns:
            record_error(err, code, Int32(0), pos, blk, Int64(v), Int64(target), el)
            go = Int32(0)
        if ld_relaxed_gpu_s64(err) != Int64(0):
            go = Int32(0)
        v = ld_acquire_gpu_s32(addr)


class ChainedFFNKernel(GemmSm90):
    """ChainedFFNKernel(tile_m, tile_n, tile_k, act1, has_b1, stages, epi_n, epi_stages, k1, k2,
    skip_slot_wait, grouped, cluster, test_fault): options as ``ChainedFFNCompute``, with
    ``stages`` already resolved by its shared-memory plan; k1 = P / tile_k and k2 = hidden /
    tile_k are GEMM1's and GEMM2's k tiles; grouped: weights (hidden, P, E) / (N, hidden, E), b1
    (E, hidden), the blocks' experts after the tile table (module docstring); test_fault: a
    private fault of cluster 0 (``TEST_FAULTS``). ``__call__(mX, mW1, mB1, mW2, mH, mOut,
    mTable, mSync, mReady, mEpoch, mErr, num_tiles, blocks, ring, timeout_ns, num_ctas,
    stream)`` traces and launches it."""

    store_warp_id = 1  # the epilogue's store warp (in the producer warpgroup, beside the TMA warp)

    # private faults of the cluster variant for the GPU tests (tests/test_chained_cluster_faults_
    # gpu.py), on the first cluster (CTAs 0, 1) at its tile n: ("stall_leader", n): the leader's
    # TMA warp stops for 2 timeouts before it takes tile n (the peer gives up waiting for the
    # post, the leader goes on later); ("stop_peer", n): the peer's TMA warp posts kind -1 to its
    # CTA at tile n without waiting or recording (only the leader's ring waits can notice)
    TEST_FAULTS = ("stall_leader", "stop_peer")

    def __init__(self, tile_m, tile_n, tile_k, act1, has_b1, stages, epi_n, epi_stages, k1, k2,
                 skip_slot_wait=False, grouped=False, cluster=1, test_fault=None):
        super().__init__(num_mma_wg=tile_m // 64)  # one consumer warpgroup per 64 rows
        self.k1, self.k2 = k1, k2
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.act1, self.has_b1 = act1, has_b1
        self.stages = stages
        self.epi_n, self.epi_stage = epi_n, epi_stages
        # private test switch: GEMM1 tiles overwrite their slot without waiting (wrong results
        # with a small ring: tests/test_chained_ffn_gpu.py shows the wait matters)
        self.skip_slot_wait = skip_slot_wait
        self.grouped = bool(grouped)
        # store-warp handshake per epilogue sub-tile (consumer threads + the store warp):
        # FULL: consumers bar.arrive after writing the buffer, the store warp bar.sync;
        # EMPTY: the store warp bar.arrive once the buffer is free, consumers bar.sync before
        # writing it. Each side alternates arrive / sync, so generations never mix.
        self.epi_full = pipeline.NamedBarrier(barrier_id=2,
                                              num_threads=self.num_mma_threads + 32)
        self.epi_empty = pipeline.NamedBarrier(barrier_id=3,
                                               num_threads=self.num_mma_threads + 32)
        # tile mailbox: 2 slots; "empty" is arrived once per consumer warp and by the store
        # warp
        self.mailbox_readers = self.num_mma_wg * 4 + 1
        # cluster 2 (dense only): the CTAs of rank 0 / 1 run row blocks 2 q / 2 q + 1 of pair
        # tile q, loading the weight tiles once (half each, multicast to both). Mailbox: the
        # leader (rank 0) takes the tile and posts it to its own slot and to the peer's inbox;
        # the peer's TMA warp forwards that it has read the inbox and posts the tile to its own
        # slot (``fetch_tile_pair``), so each CTA's slots have the same readers as with cluster 1
        if cluster not in (1, 2):
            raise ValueError(f"cluster must be 1 or 2, got {cluster!r}")
        if cluster == 2 and grouped:
            raise ValueError("cluster=2 runs dense calls only")
        self.cluster = cluster
        if test_fault is not None and (cluster != 2 or len(test_fault) != 2
                                       or test_fault[0] not in self.TEST_FAULTS
                                       or not isinstance(test_fault[1], int)
                                       or test_fault[1] < 1):
            raise ValueError(f"test_fault must be None or (one of {self.TEST_FAULTS}, tile >= 1) "
                             f"with cluster=2, got {test_fault!r}")
        self.test_fault = test_fault

    # ---------------------------------------------------------------- host-side setup
    def _setup(self):
        bf16 = cutlass.BFloat16
        a_layout = LayoutEnum.ROW_MAJOR  # x and the H ring: K contiguous
        self.b_layout = LayoutEnum.from_tensor(self._mW1)  # MN-major (column-major view)
        self.c_layout = LayoutEnum.ROW_MAJOR
        # one tiled MMA for both kinds: A (x or H) K-major from shared memory, B MN-major
        self.tiled_mma = self.make_tiled_mma(bf16, bf16, a_layout, self.b_layout,
                                             (64, self.tile_n))
        self.epi_tile = (self.tile_m, self.epi_n)
        self.a_smem_layout = smem_layout_staged(a_layout, bf16, (self.tile_m, self.tile_k),
                                                self.stages)
        self.b_smem_layout = smem_layout_staged(self.b_layout, bf16, (self.tile_n, self.tile_k),
                                                self.stages)
        self.c_smem_layout = smem_layout_staged(self.c_layout, bf16, self.epi_tile,
                                                self.epi_stage)
        self.tx_bytes = (self.tile_m + self.tile_n) * self.tile_k * 2

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW1: cute.Tensor, mB1: cute.Tensor,
                 mW2: cute.Tensor, mH: cute.Tensor, mOut: cute.Tensor, mTable: cute.Tensor,
                 mSync: cute.Tensor, mReady: cute.Tensor, mEpoch: cute.Tensor,
                 mErr: cute.Tensor, num_tiles: Int32, blocks: Int32, ring: Int32,
                 timeout_ns: Int64, num_ctas: Int32, stream):
        self._mW1 = mW1
        self._setup()
        bf16 = cutlass.BFloat16
        tk = (self.tile_m, self.tile_k)
        bk = (self.tile_n, self.tile_k)
        # the H ring is read by GEMM2 (A tiles through the operand ring) and written by GEMM1
        # (epilogue sub-tiles): one load and one store atom on the same tensor
        tma_atom_x, tma_x = self.make_tma_load(mX, self.a_smem_layout, tk)
        tma_atom_ha, tma_ha = self.make_tma_load(mH, self.a_smem_layout, tk)
        tma_atom_w1, tma_w1 = self.make_tma_load(mW1, self.b_smem_layout, bk,
                                                 num_multicast=self.cluster)
        tma_atom_w2, tma_w2 = self.make_tma_load(mW2, self.b_smem_layout, bk,
                                                 num_multicast=self.cluster)
        tma_atom_hs, tma_hs = self.make_tma_store(mH, self.c_smem_layout, self.epi_tile)
        tma_atom_o, tma_o = self.make_tma_store(mOut, self.c_smem_layout, self.epi_tile)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            # tile mailbox: full[0..1], empty[0..1] mbarriers, then 2 slots of 4 int32
            # (kind, block, column tile, list position); cluster 2: the inbox after them
            mailbox: cute.struct.MemRange[cutlass.Int64, MAILBOX_BYTES[self.cluster - 1] // 8]
            sA: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.a_smem_layout)],
                                  self.buffer_align_bytes]
            sB: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.b_smem_layout)],
                                  self.buffer_align_bytes]
            sC: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(self.c_smem_layout)],
                                  self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        # num_ctas: a multiple of the cluster size (the host wrapper's grid)
        launch = dict(cluster=[self.cluster, 1, 1]) if self.cluster > 1 else {}
        self.kernel(tma_atom_x, tma_x, tma_atom_ha, tma_ha, tma_atom_w1, tma_w1, tma_atom_w2,
                    tma_w2, tma_atom_hs, tma_hs, tma_atom_o, tma_o, self.tiled_mma,
                    self.a_smem_layout, self.b_smem_layout, self.c_smem_layout, mB1, mTable,
                    mSync, mReady, mEpoch, mErr, num_tiles, blocks, ring,
                    timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1, stream=stream, **launch)

    # ---------------------------------------------------------------- device kernel
    @cute.kernel
    def kernel(self, tma_atom_x: cute.CopyAtom, mX: cute.Tensor,
               tma_atom_ha: cute.CopyAtom, mHA: cute.Tensor,
               tma_atom_w1: cute.CopyAtom, mW1: cute.Tensor,
               tma_atom_w2: cute.CopyAtom, mW2: cute.Tensor,
               tma_atom_hs: cute.CopyAtom, mHS: cute.Tensor,
               tma_atom_o: cute.CopyAtom, mOut: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
               c_smem_layout: cute.ComposedLayout, mB1: cute.Tensor, mTable: cute.Tensor,
               mSync: cute.Tensor, mReady: cute.Tensor, mEpoch: cute.Tensor,
               mErr: cute.Tensor, num_tiles: Int32, blocks: Int32, ring: Int32,
               timeout_ns: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            self.prefetch_descriptors(tma_atom_x, tma_atom_ha, tma_atom_w1, tma_atom_w2,
                                      tma_atom_hs, tma_atom_o)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        cl = self.cluster
        # a weight stage is written into both CTAs of a cluster: free once the consumers of
        # both released it (the base pipeline's cluster-aware empty arrivals)
        pipe = self.make_mainloop_pipeline(storage.mbar.data_ptr(), self.stages,
                                           self.tx_bytes, cute.make_layout((1, cl, 1, 1)), cl)
        mailbox = Int32(storage.mailbox.data_ptr().toint())
        readers = self.mailbox_readers
        if tidx == 0:
            for s in range(2):
                mbar_init(mailbox + Int32(8 * s), 1)  # full[s]: the TMA warp's lane 0
                mbar_init(mailbox + Int32(16 + 8 * s), readers)  # empty[s]
                if cutlass.const_expr(cl > 1):
                    mbar_init(mailbox + Int32(64 + 8 * s), 1)  # inbox_full[s]: the leader
                    mbar_init(mailbox + Int32(80 + 8 * s), 1)  # inbox_free[s]: the peer
            fence_mbar_init()
        pipeline_init_arrive(cluster_shape_mn=(cl, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sC = storage.sC.get_tensor(c_smem_layout.outer, swizzle=c_smem_layout.inner)

        sync_base = Int64(mSync.iterator.toint())  # [0] tile counter, g1_done, g2_done
        err = Int64(mErr.iterator.toint())

        pipeline_init_wait(cluster_shape_mn=(cl, 1))
        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        if warp_group_idx == 0:
            self.producer_warpgroup()
        # ------------------------------------------------------------ TMA warp
        if warp_idx == self.load_warp_id:
            self.load_role(tma_atom_x, mX, tma_atom_ha, mHA, tma_atom_w1, mW1, tma_atom_w2,
                           mW2, sA, sB, pipe, mailbox, mTable, sync_base, err, num_tiles,
                           blocks, ring, timeout_ns)
        # ------------------------------------------------------------ store warp
        if warp_idx == self.store_warp_id:
            self.store_role(tma_atom_hs, mHS, tma_atom_o, mOut, sC, mailbox, sync_base,
                            mReady, mEpoch, err, blocks, ring, timeout_ns)
        # ------------------------------------------------------------ consumer warpgroups
        if warp_group_idx > 0:
            self.consumer_warpgroup()
            self.mma_role(tiled_mma, sA, sB, sC, pipe, mailbox, mB1, tidx, mTable, num_tiles,
                          err, timeout_ns)
        if cutlass.const_expr(cl > 1):
            # no CTA exits while its peer may still arrive on its barriers or write its smem
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    # ---------------------------------------------------------------- tile scheduler
    @cute.jit
    def fetch_tile(self, n: Int32, mailbox: Int32, mTable: cute.Tensor, sync_base: Int64,
                   num_tiles: Int32):
        """TMA warp: lane 0 takes list position p = atomicAdd(tile counter) for this CTA's
        n-th tile and posts (kind, block, column, p) to mailbox slot n % 2 (kind -1: no tile
        left); every lane returns it."""
        s = n % Int32(2)
        info = mailbox + Int32(32) + s * Int32(16)
        if cute.arch.lane_idx() == 0:
            # the slot's previous tile (n - 2) was read by every reader
            mbar_wait_parity_intra_cta(mailbox + Int32(16) + s * Int32(8),
                                       ((n // Int32(2)) % Int32(2)) ^ Int32(1))
            p = atom_add_relaxed_gpu_s32(sync_base, Int32(1))
            st_shared_s32(info + Int32(12), p)
            if p < num_tiles:
                st_shared_s32(info, mTable[p * 3])
                st_shared_s32(info + Int32(4), mTable[p * 3 + 1])
                st_shared_s32(info + Int32(8), mTable[p * 3 + 2])
            else:
                st_shared_s32(info, Int32(-1))
            mbar_arrive(mailbox + s * Int32(8))  # release (CTA): the slot's words
        cute.arch.sync_warp()
        return (ld_shared_s32(info), ld_shared_s32(info + Int32(4)),
                ld_shared_s32(info + Int32(8)), ld_shared_s32(info + Int32(12)))

    @cute.jit
    def read_tile(self, n: Int32, mailbox: Int32):
        """Consumer / store warps: this CTA's n-th tile from the mailbox (waits for it), then
        hands the slot back (lane 0 arrives on empty[n % 2] after the warp's reads). The slot's
        only writer is this CTA's TMA warp (also with cluster 2), which posts every tile that a
        reader waits for: the wait is exact."""
        s = n % Int32(2)
        info = mailbox + Int32(32) + s * Int32(16)
        mbar_wait_parity_intra_cta(mailbox + s * Int32(8), (n // Int32(2)) % Int32(2))
        kind = ld_shared_s32(info)
        blk = ld_shared_s32(info + Int32(4))
        col = ld_shared_s32(info + Int32(8))
        pos = ld_shared_s32(info + Int32(12))
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            mbar_arrive(mailbox + Int32(16) + s * Int32(8))
        return kind, blk, col, pos

    # ---------------------------------------------------------------- cluster mailbox
    @cute.jit
    def fetch_tile_pair(self, n: Int32, mailbox: Int32, mTable: cute.Tensor, sync_base: Int64,
                        num_tiles: Int32, err: Int64, timeout_ns: Int64):
        """TMA warp, cluster 2: this CTA's n-th tile (kind, row block, column, list position),
        posted to its own slot n % 2 as ``fetch_tile`` does (after every reader of this CTA read
        the slot's previous tile). The leader (rank 0) also waits (bounded) until the peer's TMA
        warp has read its inbox slot's previous tile (the peer's forward; the first wait on
        each slot is on a fresh barrier), takes list position p and posts pair block q as row
        block 2 q to its own slot and as 2 q + 1 to the peer's inbox (st.shared::cluster, then
        a release.cluster arrive on the peer's inbox_full). The peer waits (bounded) for that
        post, reads the inbox, forwards (a release.cluster arrive on the leader's inbox_free)
        and posts the tile to its own slot. A wait that gives up (timeout: the error word; or
        the error word already set) posts kind -1 to its own CTA instead, and the leader then
        writes nothing into the inbox (module docstring, "Termination")."""
        s = n % Int32(2)
        info = mailbox + Int32(32) + s * Int32(16)
        full = mailbox + s * Int32(8)
        empty = mailbox + Int32(16) + s * Int32(8)
        inbox_full = mailbox + Int32(64) + s * Int32(8)
        inbox_free = mailbox + Int32(80) + s * Int32(8)
        inbox = mailbox + Int32(96) + s * Int32(16)
        ph = (n // Int32(2)) % Int32(2)
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        if cute.arch.lane_idx() == 0:
            # the slot's previous tile (n - 2) was read by every reader of this CTA
            mbar_wait_parity_intra_cta(empty, ph ^ Int32(1))
            kind, blk, col, p = Int32(-1), Int32(0), Int32(0), Int32(num_tiles)
            if rank == Int32(0):
                ok = mailbox_wait(inbox_free, ph ^ Int32(1), err, rank, n, s, timeout_ns)
                if ok != Int32(0):
                    p = atom_add_relaxed_gpu_s32(sync_base, Int32(1))
                    q = Int32(0)
                    if p < num_tiles:
                        kind = mTable[p * 3]
                        q = mTable[p * 3 + 1]
                        col = mTable[p * 3 + 2]
                    peer = mapa_shared(inbox, Int32(1))
                    st_shared_cluster_s32(peer, kind)
                    st_shared_cluster_s32(peer + Int32(4), q * Int32(2) + Int32(1))
                    st_shared_cluster_s32(peer + Int32(8), col)
                    st_shared_cluster_s32(peer + Int32(12), p)
                    # release (cluster): the inbox words
                    mbar_arrive_remote(mapa_shared(inbox_full, Int32(1)))
                    blk = q * Int32(2)
            else:
                ok = self.peer_inbox_wait(inbox_full, ph, err, rank, n, s, timeout_ns)
                if ok != Int32(0):
                    kind = ld_shared_s32(inbox)
                    blk = ld_shared_s32(inbox + Int32(4))
                    col = ld_shared_s32(inbox + Int32(8))
                    p = ld_shared_s32(inbox + Int32(12))
                    # release (cluster): the inbox reads, before the leader's next writes
                    mbar_arrive_remote(mapa_shared(inbox_free, Int32(0)))
            st_shared_s32(info, kind)
            st_shared_s32(info + Int32(4), blk)
            st_shared_s32(info + Int32(8), col)
            st_shared_s32(info + Int32(12), p)
            mbar_arrive(full)  # release (CTA): the slot's words
        cute.arch.sync_warp()
        return (ld_shared_s32(info), ld_shared_s32(info + Int32(4)),
                ld_shared_s32(info + Int32(8)), ld_shared_s32(info + Int32(12)))

    @cute.jit
    def peer_inbox_wait(self, inbox_full: Int32, ph: Int32, err: Int64, rank: Int32, n: Int32,
                        s: Int32, timeout_ns: Int64):
        """The peer's bounded wait for the leader's post of its tile n (``mailbox_wait``);
        ``test_fault`` ("stop_peer", m): on cluster 0 it gives up at tile m without waiting or
        recording."""
        if cutlass.const_expr(self.test_fault is not None and self.test_fault[0] == "stop_peer"):
            ok = Int32(0)
            bidx, _, _ = cute.arch.block_idx()
            if n != Int32(self.test_fault[1]) or bidx >= Int32(2):
                ok = mailbox_wait(inbox_full, ph, err, rank, n, s, timeout_ns)
        else:
            ok = mailbox_wait(inbox_full, ph, err, rank, n, s, timeout_ns)
        return ok

    @cute.jit
    def test_stall(self, n: Int32, timeout_ns: Int64):
        """``test_fault`` ("stall_leader", m): the leader of cluster 0 spins for two timeouts
        before its TMA warp takes tile m."""
        bidx, _, _ = cute.arch.block_idx()
        if n == Int32(self.test_fault[1]) and bidx == Int32(0):
            t0 = globaltimer()
            el = Int64(0)
            while el < timeout_ns * Int64(2):
                el = globaltimer() - t0

    def fetch(self, n, mailbox, mTable, sync_base, num_tiles, err, timeout_ns):
        """The TMA warp's next tile: ``fetch_tile`` (one CTA) or ``fetch_tile_pair``."""
        if self.cluster == 1:
            return self.fetch_tile(n, mailbox, mTable, sync_base, num_tiles)
        return self.fetch_tile_pair(n, mailbox, mTable, sync_base, num_tiles, err, timeout_ns)

    # ---------------------------------------------------------------- grouped: the block's expert
    @cute.jit
    def block_expert(self, mTable: cute.Tensor, num_tiles: Int32, blk: Int32,
                     num_experts: Int32, err: Int64, pos: Int32, report: cutlass.Constexpr):
        """Expert of row block blk (the table's tail); outside [0, num_experts): expert 0, so
        that every access stays in bounds, and with ``report`` lane 0 records the error word
        (the launch goes on and ends; ``check()`` raises)."""
        e = mTable[num_tiles * Int32(3) + blk]
        bad = Int32(0)
        if e < Int32(0):
            bad = Int32(1)
        if e >= num_experts:
            bad = Int32(1)
        if bad != Int32(0):
            if cutlass.const_expr(report):
                if cute.arch.lane_idx() == 0:
                    record_error(err, Int32(ERR_EXPERT_RANGE), Int32(0), pos, blk, Int64(e),
                                 Int64(num_experts), Int64(0))
            e = Int32(0)
        return e

    def weight_expert(self, mTable, num_tiles, blk, gW1, err, pos):
        """The weights' expert coordinate of row block blk: its checked expert (grouped, the
        TMA warp reports a bad id) or None (dense: the weight tensors have no expert mode)."""
        if self.grouped:
            return self.block_expert(mTable, num_tiles, blk, cute.size(gW1, mode=[4]), err, pos,
                                     True)
        return None

    @staticmethod
    def weight_coord(col, k, e):
        """Coordinate of a weight tile in the TMA partition: (col, k) plus the expert if any."""
        return (None, col, k) if e is None else (None, col, k, e)

    # ---------------------------------------------------------------- TMA warp
    @cute.jit
    def load_role(self, tma_atom_x, mX, tma_atom_ha, mHA, tma_atom_w1, mW1, tma_atom_w2,
                  mW2, sA, sB, pipe, mailbox: Int32, mTable: cute.Tensor, sync_base: Int64,
                  err: Int64, num_tiles: Int32, blocks: Int32, ring: Int32,
                  timeout_ns: Int64):
        one = cute.make_layout(1)
        gX = cute.local_tile(mX, (self.tile_m, self.tile_k), (None, None))
        gHA = cute.local_tile(mHA, (self.tile_m, self.tile_k), (None, None))
        # grouped: (bN, bK, RN, RK, E), the expert is the last mode
        w_modes = (None,) * (3 if self.grouped else 2)
        gW1 = cute.local_tile(mW1, (self.tile_n, self.tile_k), w_modes)
        gW2 = cute.local_tile(mW2, (self.tile_n, self.tile_k), w_modes)
        gsA, gsB = cute.group_modes(sA, 0, 2), cute.group_modes(sB, 0, 2)
        tXs, tXg = cute.nvgpu.cpasync.tma_partition(tma_atom_x, 0, one, gsA,
                                                    cute.group_modes(gX, 0, 2))
        tHs, tHg = cute.nvgpu.cpasync.tma_partition(tma_atom_ha, 0, one, gsA,
                                                    cute.group_modes(gHA, 0, 2))
        # cluster 2: each CTA loads its half of the weight tile and multicasts it to both (the
        # A tiles, x rows or the H block, are the CTA's own)
        cl = self.cluster
        w_rank, w_mask = multicast_rank_and_mask(cute.make_layout((cl, 1, 1)), mode=0)
        tW1s, tW1g = cute.nvgpu.cpasync.tma_partition(tma_atom_w1, w_rank,
                                                      cute.make_layout(cl), gsB,
                                                      cute.group_modes(gW1, 0, 2))
        tW2s, tW2g = cute.nvgpu.cpasync.tma_partition(tma_atom_w2, w_rank,
                                                      cute.make_layout(cl), gsB,
                                                      cute.group_modes(gW2, 0, 2))
        k1 = cute.size(gX, mode=[3])  # P / 64
        k2 = cute.size(gHA, mode=[3])  # hidden / 64
        h_tiles = cute.size(gW1, mode=[2])  # hidden / tile_n
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        stopped = Int32(0)  # cluster 2: 1 once a stage was not armed (``ring_acquire``)
        n = Int32(0)
        kind, blk, col, pos = self.fetch(n, mailbox, mTable, sync_base, num_tiles, err,
                                         timeout_ns)
        while kind >= 0:
            k_cnt = Int32(k1)
            slot = blk % ring
            e = self.weight_expert(mTable, num_tiles, blk, gW1, err, pos)
            if kind == 1:
                k_cnt = Int32(k2)
                if cutlass.const_expr(cl == 1):
                    # H of the block complete (all its GEMM1 tiles), then make the acquired
                    # generic-proxy view order this thread's async-proxy (TMA) reads after it
                    wait_count(sync_base + Int64(4) * Int64(1 + blk), Int32(h_tiles), err,
                               Int32(ERR_BLOCK_TIMEOUT), pos, blk, timeout_ns)
                    cute.arch.fence_proxy("async.global")
                else:
                    # the same; a block past M (the odd block of the last pair) has no
                    # counter and no H: it loads what is there and stores nothing
                    if blk < blocks:
                        wait_count(sync_base + Int64(4) * Int64(1 + blk), Int32(h_tiles), err,
                                   Int32(ERR_BLOCK_TIMEOUT), pos, blk, timeout_ns)
                        cute.arch.fence_proxy("async.global")
            for k in range(k_cnt):
                if cutlass.const_expr(cl == 1):
                    pipe.producer_acquire(st)
                    self.load_stage(tma_atom_x, tXg, tXs, tma_atom_ha, tHg, tHs, tma_atom_w1,
                                    tW1g, tW1s, tma_atom_w2, tW2g, tW2s, w_mask, pipe, st, kind,
                                    blk, slot, col, k, e)
                    pipe.producer_commit(st)
                else:
                    # a stage not armed is not loaded: its consumers' bounded waits give up too
                    # (the error word is set), and so does every later stage
                    free = self.ring_acquire(pipe, st, stopped, err, timeout_ns)
                    if free != Int32(0):
                        self.load_stage(tma_atom_x, tXg, tXs, tma_atom_ha, tHg, tHs,
                                        tma_atom_w1, tW1g, tW1s, tma_atom_w2, tW2g, tW2s,
                                        w_mask, pipe, st, kind, blk, slot, col, k, e)
                    else:
                        stopped = Int32(1)
                st.advance()
            n = n + Int32(1)
            if cutlass.const_expr(self.test_fault is not None
                                  and self.test_fault[0] == "stall_leader"):
                self.test_stall(n, timeout_ns)
            kind, blk, col, pos = self.fetch(n, mailbox, mTable, sync_base, num_tiles, err,
                                             timeout_ns)
        if cutlass.const_expr(cl == 1):
            pipe.producer_tail(st)
        else:
            self.ring_tail(pipe, st, err, timeout_ns)

    @cute.jit
    def load_stage(self, tma_atom_x, tXg, tXs, tma_atom_ha, tHg, tHs, tma_atom_w1, tW1g, tW1s,
                   tma_atom_w2, tW2g, tW2s, w_mask, pipe, st, kind: Int32, blk: Int32,
                   slot: Int32, col: Int32, k: Int32, e):
        """The TMA loads of ring stage ``st`` (acquired and armed): the A tile (x rows of block
        blk, or the H block of its slot) and the weight tile (col, k), multicast over a
        cluster (each CTA its half, ``w_mask``)."""
        mc = dict(mcast_mask=w_mask) if self.cluster > 1 else {}
        bar = pipe.producer_get_barrier(st)
        if kind == 0:
            cute.copy(tma_atom_x, tXg[(None, blk, k)], tXs[(None, st.index)], tma_bar_ptr=bar)
            cute.copy(tma_atom_w1, tW1g[self.weight_coord(col, k, e)], tW1s[(None, st.index)],
                      tma_bar_ptr=bar, **mc)
        else:
            cute.copy(tma_atom_ha, tHg[(None, slot, k)], tHs[(None, st.index)],
                      tma_bar_ptr=bar)
            cute.copy(tma_atom_w2, tW2g[self.weight_coord(col, k, e)], tW2s[(None, st.index)],
                      tma_bar_ptr=bar, **mc)

    # ---------------------------------------------------------------- cluster operand ring
    @cute.jit
    def ring_acquire(self, pipe, st, stopped: Int32, err: Int64, timeout_ns: Int64):
        """TMA warp, cluster 2: ``pipe.producer_acquire(st)`` with the bounded ``ring_wait`` for
        the stage (freed by the consumers of both CTAs). Returns 1 and arms the stage's full
        barrier when every lane saw it free, else 0 (one decision per warp: the loads are
        issued by an elected lane); after one 0 (``stopped``) it arms nothing more. A stage
        whose previous fill never completed here (a consumer gave up on it and freed it anyway)
        is not armed: an arrive on a phase whose arrival is already in would take its pending
        count below zero. Before the first refusal the parity test is exact (every earlier fill
        of the stage was armed, so its barrier is at most one phase behind), and without a
        give-up that fill has always completed (consumers free a stage after their wait on
        it): the test never refuses a stage then."""
        free = Int32(0)
        if stopped == Int32(0):
            free = ring_wait(Int32(pipe.sync_object_empty.get_barrier(st.index).toint()),
                             st.phase, st.index, Int32(RING_ACQUIRE), err, timeout_ns)
            if free != Int32(0):
                # the previous fill's phase has the parity of this producer state's phase
                free = mbar_test_wait_parity(
                    Int32(pipe.sync_object_full.get_barrier(st.index).toint()), st.phase)
            free = warp_all(free)
            if free != Int32(0):
                pipe.sync_object_full.arrive(st.index, pipe.producer_mask)
        return free

    @cute.jit
    def ring_full(self, pipe, read, err: Int64, timeout_ns: Int64):
        """Consumers: ``pipe.consumer_wait(read)``; cluster 2: the bounded ``ring_wait`` for the
        stage (filled by the loads of both CTAs). A consumer that gave up goes on with the
        stage as it is (its results are wrong; the error word says so)."""
        if cutlass.const_expr(self.cluster == 1):
            pipe.consumer_wait(read)
        else:
            ring_wait(Int32(pipe.sync_object_full.get_barrier(read.index).toint()), read.phase,
                      read.index, Int32(RING_FULL), err, timeout_ns)

    @cute.jit
    def ring_tail(self, pipe, st, err: Int64, timeout_ns: Int64):
        """TMA warp, cluster 2: ``pipe.producer_tail(st)`` (every stage freed by the consumers of
        both CTAs, so that no arrive of the other CTA is still due) with bounded waits; then,
        if the error word is set, ``ERROR_SETTLE_NS`` for the copies issued into both CTAs to
        land (module docstring, "Divergence")."""
        for _ in cutlass.range_constexpr(self.stages):
            ring_wait(Int32(pipe.sync_object_empty.get_barrier(st.index).toint()), st.phase,
                      st.index, Int32(RING_TAIL), err, timeout_ns)
            st.advance()
        if ld_relaxed_gpu_s64(err) != Int64(0):
            t0 = globaltimer()
            el = Int64(0)
            while el < Int64(ERROR_SETTLE_NS):
                el = globaltimer() - t0

    # ---------------------------------------------------------------- consumers
    @cute.jit
    def mma_tile(self, tiled_mma, acc, tCrA, tCrB, pipe, read, rel, k_cnt: Int32, err: Int64,
                 timeout_ns: Int64):
        """WGMMA mainloop over k_cnt stages (one WGMMA group in flight); returns the states."""
        num_kb = cute.size(tCrA, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.fence()
        self.ring_full(pipe, read, err, timeout_ns)
        self.mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index, num_kb)
        read.advance()
        for _k in range(1, k_cnt):
            self.ring_full(pipe, read, err, timeout_ns)
            self.mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index, num_kb)
            cute.nvgpu.warpgroup.wait_group(1)
            pipe.consumer_release(rel)
            rel.advance()
            read.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        pipe.consumer_release(rel)
        rel.advance()
        return read, rel

    @cute.jit
    def epilogue_gemm1(self, tRS_rD, tRS_rAcc, e: cutlass.Constexpr, size: cutlass.Constexpr):
        """GEMM1 sub-tile: act1 of the accumulator (b1 is already in it)."""
        for v in cutlass.range_constexpr(size):
            tRS_rD[v] = act_fn(tRS_rAcc[e * size + v], self.act1)

    @cute.jit
    def epilogue_gemm2(self, tRS_rD, tRS_rAcc, e: cutlass.Constexpr, size: cutlass.Constexpr):
        """GEMM2 sub-tile: the accumulator as is (final output)."""
        for v in cutlass.range_constexpr(size):
            tRS_rD[v] = tRS_rAcc[e * size + v]

    @cute.jit
    def mma_role(self, tiled_mma, sA, sB, sC, pipe, mailbox: Int32, mB1: cute.Tensor,
                 tidx: Int32, mTable: cute.Tensor, num_tiles: Int32, err: Int64,
                 timeout_ns: Int64):
        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        ctid = tidx - self.threads_per_wg
        mma_wg_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
        thr_mma = tiled_mma.get_slice(mma_wg_layout(warp_group_idx - 1))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_shape = thr_mma.partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))).shape
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        # this thread's accumulator coordinates (per-thread slice), for b1's columns
        tCc_thr = tiled_mma.get_slice(ctid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n)))

        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
            self.c_layout, elem_ty_d=cutlass.BFloat16, elem_ty_acc=self.acc_dtype)
        copy_atom_C = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
            cutlass.BFloat16)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s,
                                                cute.make_tiled_copy_C_atom(copy_atom_C,
                                                                            tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(ctid)
        tRS_sD = thr_copy_r2s.partition_D(sC)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], cutlass.BFloat16)
        size_rD = cute.size(tRS_rD)
        epi_num = self.tile_n // self.epi_n

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        n = Int32(0)
        kind, blk, col, pos = self.read_tile(n, mailbox)
        while kind >= 0:
            k_cnt = Int32(self.k1)
            if kind == 0:
                if cutlass.const_expr(self.has_b1):
                    if cutlass.const_expr(self.grouped):
                        # the TMA warp reports a bad expert; here it only stays in bounds
                        e = self.block_expert(mTable, num_tiles, blk, cute.size(mB1, mode=[0]),
                                              Int64(0), pos, False)
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            b = mB1[(e, col * self.tile_n + tCc_thr[i][1])]
                            acc[i] = b.to(self.acc_dtype)
                    else:
                        for i in cutlass.range_constexpr(cute.size(acc)):
                            # b1 is bf16 or fp32 (b1_read_dtype); the sum is fp32 either way
                            acc[i] = mB1[col * self.tile_n + tCc_thr[i][1]].to(self.acc_dtype)
                else:
                    acc.fill(0.0)
            else:
                k_cnt = Int32(self.k2)
                acc.fill(0.0)
            read, rel = self.mma_tile(tiled_mma, acc, tCrA, tCrB, pipe, read, rel, k_cnt, err,
                                      timeout_ns)
            # ---- epilogue: acc -> bf16 sub-tiles -> sC (stmatrix) -> the store warp
            for e in cutlass.range_constexpr(epi_num):
                if kind == 0:
                    self.epilogue_gemm1(tRS_rD, tRS_rAcc, e, size_rD)
                else:
                    self.epilogue_gemm2(tRS_rD, tRS_rAcc, e, size_rD)
                tRS_rD_out.store(tRS_rD.load().to(cutlass.BFloat16))
                buf = (n * epi_num + e) % self.epi_stage
                self.epi_empty.arrive_and_wait()
                cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
                # stmatrix (generic proxy) -> the TMA store (async proxy) reads sC
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epi_full.arrive()
            n = n + Int32(1)
            kind, blk, col, pos = self.read_tile(n, mailbox)

    # ---------------------------------------------------------------- store warp
    @cute.jit
    def count_tile(self, kind: Int32, blk: Int32, g1_base: Int64, g2_base: Int64,
                   n_tiles: Int32, mReady: cute.Tensor, epoch: Int32):
        """One lane: the tile's counter update, and the band flag after a block's last GEMM2."""
        if kind == 0:
            red_release_gpu_add_s32(g1_base + Int64(4) * Int64(blk), Int32(1))
        else:
            old = atom_add_acq_rel_gpu_s32(g2_base + Int64(4) * Int64(blk), Int32(1))
            if old == n_tiles - 1:
                # acquired every tile of the block (one release sequence): publish
                cute.arch.store(mReady.iterator + blk, epoch, sem="release", scope="gpu")

    @cute.jit
    def store_role(self, tma_atom_hs, mHS, tma_atom_o, mOut, sC, mailbox: Int32,
                   sync_base: Int64, mReady: cute.Tensor, mEpoch: cute.Tensor, err: Int64,
                   blocks: Int32, ring: Int32, timeout_ns: Int64):
        one = cute.make_layout(1)
        gH = cute.local_tile(mHS, (self.tile_m, self.tile_n), (None, None))
        gO = cute.local_tile(mOut, (self.tile_m, self.tile_n), (None, None))
        n_tiles = cute.size(gO, mode=[3])  # N / tile_n: GEMM2 tiles per block
        epi_num = self.tile_n // self.epi_n
        epoch = mEpoch[0]
        g1_base = sync_base + Int64(4)
        g2_base = sync_base + Int64(4) * Int64(1 + blocks)
        n = Int32(0)
        kind, blk, col, pos = self.read_tile(n, mailbox)
        while kind >= 0:
            slot = blk % ring
            if kind == 0:
                if cutlass.const_expr(not self.skip_slot_wait):
                    if cutlass.const_expr(self.cluster == 1):
                        if blk >= ring:
                            # every GEMM2 tile that reads this slot (block blk - ring) is done;
                            # then order the acquire before this thread's async-proxy writes
                            wait_count(g2_base + Int64(4) * Int64(blk - ring), n_tiles, err,
                                       Int32(ERR_SLOT_TIMEOUT), pos, blk, timeout_ns)
                            cute.arch.fence_proxy("async.global")
                    else:
                        # the same, but a block past M stores nothing, so it does not wait
                        if blk >= ring and blk < blocks:
                            wait_count(g2_base + Int64(4) * Int64(blk - ring), n_tiles, err,
                                       Int32(ERR_SLOT_TIMEOUT), pos, blk, timeout_ns)
                            cute.arch.fence_proxy("async.global")
            gH_epi = cute.zipped_divide(gH[(None, None, slot, col)], self.epi_tile)
            gO_epi = cute.zipped_divide(gO[(None, None, blk, col)], self.epi_tile)
            sH_p, gH_p = cute.nvgpu.cpasync.tma_partition(
                tma_atom_hs, 0, one, cute.group_modes(sC, 0, 2), gH_epi)
            sO_p, gO_p = cute.nvgpu.cpasync.tma_partition(
                tma_atom_o, 0, one, cute.group_modes(sC, 0, 2), gO_epi)
            for e in cutlass.range_constexpr(epi_num):
                buf = (n * epi_num + e) % self.epi_stage
                # buffer buf is free: the store that last read it is at least epi_stage - 1
                # groups old (wait_group.read below)
                self.epi_empty.arrive()
                self.epi_full.arrive_and_wait()
                if cutlass.const_expr(self.cluster == 1):
                    if kind == 0:
                        cute.copy(tma_atom_hs, sH_p[(None, buf)], gH_p[(None, (0, e))])
                    else:
                        cute.copy(tma_atom_o, sO_p[(None, buf)], gO_p[(None, (0, e))])
                else:
                    # a block past M: the handshake only (its slot may be a live block's)
                    if blk < blocks:
                        if kind == 0:
                            cute.copy(tma_atom_hs, sH_p[(None, buf)], gH_p[(None, (0, e))])
                        else:
                            cute.copy(tma_atom_o, sO_p[(None, buf)], gO_p[(None, (0, e))])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(self.epi_stage - 1, read=True)
            # the tile's writes performed (not only read from smem), ordered before the
            # generic-proxy counter update; every lane waited for its own bulk groups
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()
            if cutlass.const_expr(self.cluster == 1):
                if cute.arch.lane_idx() == 0:
                    self.count_tile(kind, blk, g1_base, g2_base, n_tiles, mReady, epoch)
            else:
                if cute.arch.lane_idx() == 0:
                    if blk < blocks:  # no counter or flag for a block past M
                        self.count_tile(kind, blk, g1_base, g2_base, n_tiles, mReady, epoch)
            n = n + Int32(1)
            kind, blk, col, pos = self.read_tile(n, mailbox)
        cute.arch.cp_async_bulk_wait_group(0, read=True)

