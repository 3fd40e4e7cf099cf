"""Tile schedulers of the persistent kernels: a linear work index -> tile coordinates.

A scheduler object holds the compile-time part of a schedule (cluster size, grouping); its
``@cute.jit`` methods take the runtime part (tile counts, tables) and are called from the kernel,
by the producer warp and the consumer warpgroups alike, so both walk the same order. CTA (or
cluster) i of a persistent grid of G takes the work indices i, i + G, i + 2G, ...

Plain-Python mirrors of the arithmetic live next to the host wrappers
(``combine.grouped_gemm.tile_order_reference``) for CPU tests. Imports cutlass.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

__all__ = ["BandTileScheduler", "UnitScheduler"]


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
