"""Tile schedulers of the persistent kernels: a linear work index -> tile coordinates.

A scheduler object holds the compile-time part of a schedule (cluster size, grouping); its
``@cute.jit`` methods take the runtime part (tile counts, tables) and are called from the kernel,
by the producer warp and the consumer warpgroups alike, so both walk the same order. CTA (or
cluster) i of a persistent grid of G takes the work indices i, i + G, i + 2G, ... (static), or,
with ``ClusterTileFetch`` (dynamic), its first index i and then whichever index a global atomic
counter hands its cluster next.

Plain-Python mirrors of the arithmetic live next to the host wrappers
(``combine.grouped_gemm.tile_order_reference``) for CPU tests. Imports cutlass.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .primitives import (ld_shared_s32, mbar_arrive, mbar_init, mbar_try_wait_parity,
                         mbar_try_wait_parity_cluster, st_shared_s32)

__all__ = ["BandTileScheduler", "ClusterTileFetch", "UnitScheduler"]


class BandTileScheduler:
    """The producer grouped GEMM's walk over (schedule position, n tile).

    BandTileScheduler(cluster, group): linear tile t over num_bands * n_tiles tiles.
    group 1: band-major (p = t // n_tiles). group G >= 2: positions s0 .. s0 + G - 1 share tiles
    [s0 n_tiles, (s0 + G) n_tiles), cycling over the G bands every ``cluster`` tiles (one cluster)
    at the same n tiles, so that the CTAs computing the same weight columns for the bands of an
    expert run side by side and read them from DRAM once; a short last group cycles over the
    bands left (one band: band-major). The ``cluster`` tiles of a cluster keep one band and
    adjacent n tiles. ``walk``: the same cycle over a group given by its first position and size
    (GroupedGemm(group_by="expert"): groups cut at expert boundaries, read per position)."""

    def __init__(self, cluster: int, group: int):
        self.cluster, self.group = cluster, group

    @cute.jit
    def coords(self, t: cutlass.Int32, n_tiles: cutlass.Int32, num_bands: cutlass.Int32):
        """Linear tile t -> (schedule position p, n tile)."""
        p = t // n_tiles
        n = t - p * n_tiles
        if cutlass.const_expr(self.group >= 2):
            s0 = (t // (self.group * n_tiles)) * self.group
            g = num_bands - s0
            if g > self.group:
                g = self.group
            u = t - s0 * n_tiles
            q = u // self.cluster
            p = s0 + q % g
            n = (q // g) * self.cluster + (u - q * self.cluster)
        return p, n

    @cute.jit
    def walk(self, t: cutlass.Int32, n_tiles: cutlass.Int32, s0: cutlass.Int32,
             g: cutlass.Int32):
        """Linear tile t of the group of positions [s0, s0 + g) (tiles [s0 n_tiles, (s0 + g)
        n_tiles)) -> (schedule position p, n tile): ``coords``' walk for a group read from the
        per-position tables of ``combine.band_groups`` (group_by="expert"; the kernel checks
        s0 <= t // n_tiles < s0 + g <= num_bands first). g = 1 is band-major."""
        u = t - s0 * n_tiles
        q = u // self.cluster
        p = s0 + q % g
        n = (q // g) * self.cluster + (u - q * self.cluster)
        return p, n


class UnitScheduler:
    """The fused FFN compute kernel's walk over units (m-tile, hidden tile), m-major.

    UnitScheduler(cluster_m): unit u = m_pair * J + j over ceil(m_tiles / cluster_m) m-pairs and
    J units per m-pair; cluster c takes u = c, c + C, ... and its CTA of rank r the m-tile
    m_pair * cluster_m + r, so the J contributions of one band run at the same time and bands
    complete in order."""

    def __init__(self, cluster_m: int):
        self.cluster_m = cluster_m

    @cute.jit
    def unit(self, u: cutlass.Int32, J: cutlass.Int32, cta_rank, m_tiles: cutlass.Int32,
             mMtE: cute.Tensor):
        """Work item u -> (m_tile, j_tile, expert); the expert is mMtE[m_tile], that of the last
        m-tile for a phantom m-tile past M (the second CTA of a cluster on an odd m_tiles)."""
        m_pair = u // J
        j_tile = u - m_pair * J
        m_tile = m_pair * self.cluster_m + cta_rank
        m_e = m_tile
        if m_e >= m_tiles:
            m_e = m_tiles - 1
        return m_tile, j_tile, mMtE[m_e]


# ---- dynamic tile fetch: a global work counter, its units handed through a shared-memory ring
def _mapa_shared(addr, rank):
    """The shared::cluster address of this CTA's shared::cta address ``addr`` in CTA ``rank``."""
    return cute.arch.inline_ptx("mapa.shared::cluster.u32 {$w0}, {$r0}, {$r1};",
                                write_only_types=[Int32],
                                read_only_args=[Int32(addr), Int32(rank)])


def _st_shared_cluster_s32(addr, v):
    cute.arch.inline_ptx("st.shared::cluster.s32 [{$r0}], {$r1};",
                         read_only_args=[Int32(addr), Int32(v)])


def _mbar_arrive_cluster(addr):
    """mbarrier.arrive on a shared::cluster address (this CTA's or the peer's), release at
    cluster scope: this thread's earlier shared-memory accesses (st.shared::cluster into the
    peer included) happen before anything a thread does after its acquire.cluster wait on the
    completed phase."""
    cute.arch.inline_ptx("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [{$r0}];",
                         read_only_args=[Int32(addr)])


def _atom_add_relaxed_gpu_s32(addr, v):
    return cute.arch.inline_ptx("atom.relaxed.gpu.global.add.s32 {$w0}, [{$r0}], {$r1};",
                                write_only_types=[Int32], read_only_args=[Int64(addr), Int32(v)])


class ClusterTileFetch:
    """Dynamic work fetch of a persistent kernel of clusters of ``cluster`` CTAs (1 or 2).

    Work comes in cluster units: unit u is the ``cluster`` consecutive work indices
    [u cluster, (u + 1) cluster), CTA rank r of the cluster taking u cluster + r (so a cluster's
    CTAs keep what a static schedule gives a cluster). A cluster's first unit is its cluster id
    (no round trip; the static schedule's first wave); each next one is
    ``num_clusters + atomicAdd(counter, 1)`` on a global int32 counter that is zero at launch
    (the host zeroes it on the launch stream before each launch), taken by one thread of the
    cluster, the writer (lane 0 of the rank-0 CTA's producer warp), so that a cluster that
    starts late takes only the units left. A unit past the end is the stop sentinel: every
    walker stops at it.

    The writer hands the units to the other walkers (readers) through a ring of STAGES slots in
    each CTA's shared memory (BYTES at an 8-aligned shared address ``ring``): full[s] (count 1)
    at 8 s, empty[s] at 16 + 8 s, the unit of slot s (int32) at 32 + 4 s. Post n goes to slot
    n % STAGES: the writer waits until every reader released the slot's previous post
    (empty[s] of the rank-0 CTA, acquire.cluster), fetches u, stores it into its own slot and
    (cluster 2) into the peer's (st.shared::cluster), then arrives on each CTA's full[s]
    (release; to the peer at cluster scope). A reader warp waits for full[s] (acquire at
    cluster scope with cluster 2), reads the unit, and lane 0 arrives on the rank-0 CTA's
    empty[s] (release.cluster: its read happens before the writer's next store into the slot).
    ``readers``: the reader warps of the cluster (each CTA's consumer warps, and the rank-1
    CTA's producer warp with cluster 2). Every walker takes the same sequence of posts (they
    walk the same tiles, skips included), so each post is read by exactly ``readers`` warps and
    the waits are exact; the writer's ``tail`` waits until the last post was read, so that no
    reader's remote arrive targets a CTA that has exited."""

    STAGES = 2
    BYTES = 40

    def __init__(self, cluster: int, readers: int):
        self.cluster, self.readers = cluster, readers

    @cute.jit
    def init(self, ring: Int32):
        """One thread, before the CTA's barrier-init fence and cluster sync."""
        for s in cutlass.range_constexpr(self.STAGES):
            mbar_init(ring + Int32(8 * s), 1)
            mbar_init(ring + Int32(16 + 8 * s), self.readers)

    @cute.jit
    def _wait(self, mbar: Int32, parity: Int32):
        if cutlass.const_expr(self.cluster > 1):
            done = mbar_try_wait_parity_cluster(mbar, parity)
            while done == Int32(0):
                done = mbar_try_wait_parity_cluster(mbar, parity)
        else:
            done = mbar_try_wait_parity(mbar, parity)
            while done == Int32(0):
                done = mbar_try_wait_parity(mbar, parity)

    @cute.jit
    def post(self, ring: Int32, n: Int32, counter: Int64, num_clusters: Int32):
        """Writer warp (all 32 lanes): fetch and post unit number n (n = 0, 1, ... after the
        static first unit); returns the unit on every lane."""
        s = n % Int32(self.STAGES)
        ph = (n // Int32(self.STAGES)) % Int32(2)
        slot = ring + Int32(32) + s * Int32(4)
        if cute.arch.lane_idx() == 0:
            self._wait(ring + Int32(16) + s * Int32(8), ph ^ Int32(1))
            u = num_clusters + _atom_add_relaxed_gpu_s32(counter, Int32(1))
            st_shared_s32(slot, u)
            if cutlass.const_expr(self.cluster > 1):
                _st_shared_cluster_s32(_mapa_shared(slot, Int32(1)), u)
                _mbar_arrive_cluster(_mapa_shared(ring + s * Int32(8), Int32(1)))
            mbar_arrive(ring + s * Int32(8))
        cute.arch.sync_warp()
        return ld_shared_s32(slot)

    @cute.jit
    def take(self, ring: Int32, n: Int32):
        """Reader warp (all 32 lanes): unit number n (waits for its post), then hands the slot
        back."""
        s = n % Int32(self.STAGES)
        self._wait(ring + s * Int32(8), (n // Int32(self.STAGES)) % Int32(2))
        u = ld_shared_s32(ring + Int32(32) + s * Int32(4))
        cute.arch.sync_warp()  # every lane has read the slot before it is handed back
        if cute.arch.lane_idx() == 0:
            empty = ring + Int32(16) + s * Int32(8)
            if cutlass.const_expr(self.cluster > 1):
                _mbar_arrive_cluster(_mapa_shared(empty, Int32(0)))
            else:
                mbar_arrive(empty)
        return u

    @cute.jit
    def tail(self, ring: Int32, posts: Int32):
        """Writer warp, after its last post (``posts`` in all): waits until every reader took
        it (cluster 2: the readers of the peer CTA arrive on this CTA's barriers)."""
        if cutlass.const_expr(self.cluster > 1):
            if posts > Int32(0):
                if cute.arch.lane_idx() == 0:
                    n = posts - Int32(1)
                    s = n % Int32(self.STAGES)
                    self._wait(ring + Int32(16) + s * Int32(8),
                               (n // Int32(self.STAGES)) % Int32(2))
            cute.arch.sync_warp()
