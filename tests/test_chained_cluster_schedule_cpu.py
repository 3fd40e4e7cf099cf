"""The pair-block tile order of the 2-CTA cluster chained kernel (compute_chained.
PairedChainedSchedule, schedule_for(cluster=2)): the kernel's table in pair units, its row-block
expansion with every tile once, every dependency earlier in the list per 128-row block
(simulate asserts it), an even ring, the reference walk equal to the plain math with an odd
block count (the pair's second block past M), and the host wrapper's cluster checks."""
import pytest
import torch

from moe_overlap.ffn.activations import activation
from moe_overlap.ffn.chained_schedule import GEMM1, GEMM2, execute_reference, simulate
from moe_overlap.ffn.compute_chained import (ChainedFFNCompute, PairedChainedSchedule,
                                             chained_ffn_reference, schedule_for)

SLICES = {"llama3-8b": (4096, 7168), "llama3-70b": (8192, 14336),
          "deepseek-v3-expert": (7168, 1024), "llama4-scout-expert": (5120, 4096)}


def _walk_like_the_kernel(s):
    """The kernel's walk of the pair table: entry (kind, q, c) is row block 2 q + r on the CTA of
    rank r; a block at or past ``blocks`` runs the loads but stores and counts nothing. Checks,
    in list order, the two waits with per-block counters (GEMM2 of b: g1_done[b] == h_tiles;
    GEMM1 of b >= ring: g2_done[b - ring] == n_tiles) and returns the counters."""
    nb = s.blocks
    g1, g2 = [0] * nb, [0] * nb
    for kind, q, c in s.tile_table().tolist():
        for r in range(2):
            b = 2 * q + r
            if b >= nb:
                continue
            if kind == GEMM1:
                if b >= s.ring:
                    assert g2[b - s.ring] == s.n_tiles, (b, "slot not free")
                assert 0 <= c < s.h_tiles
                g1[b] += 1
            else:
                assert g1[b] == s.h_tiles, (b, "H block not complete")
                assert 0 <= c < s.n_tiles
                g2[b] += 1
    return g1, g2


@pytest.mark.parametrize("name", list(SLICES))
@pytest.mark.parametrize("T", [8192, 1000, 8192 - 128 - 5])
@pytest.mark.parametrize("group,patch", [(1, 1), (2, 1), (4, 1), (8, 2), (8, 4), (16, 4)])
def test_every_tile_once_per_block_dependencies_earlier(name, T, group, patch):
    P, hidden = SLICES[name]
    s = schedule_for(T, P, hidden, P, grid=132, group=group, patch=patch, cluster=2)
    assert isinstance(s, PairedChainedSchedule)
    assert s.ring % 2 == 0 and s.lookahead % 2 == 0 and s.ring > s.lookahead
    assert s.pair_blocks == -(-s.blocks // 2)
    tiles = s.tiles()
    want = {(GEMM1, b, j) for b in range(s.blocks) for j in range(s.h_tiles)} | \
        {(GEMM2, b, n) for b in range(s.blocks) for n in range(s.n_tiles)}
    assert len(tiles) == len(want) and set(tiles) == want
    table = s.tile_table()
    assert table.shape == (s.pair_blocks * (s.h_tiles + s.n_tiles), 3)
    assert int(table[:, 1].max()) == s.pair_blocks - 1
    g1, g2 = _walk_like_the_kernel(s)
    assert g1 == [s.h_tiles] * s.blocks and g2 == [s.n_tiles] * s.blocks
    simulate(s)  # raises AssertionError on a dependency later in the list
    assert s.ring_bytes == min(s.ring, s.blocks) * 128 * hidden * 2


def test_pair_blocks_adjacent_and_dense_order_unchanged():
    """The expansion puts a pair's two blocks next to each other (same kind and column); the
    cluster-free order is the one schedule_for always gave."""
    s = schedule_for(8192, 4096, 7168, 4096, grid=132, group=4, cluster=2)
    tiles = s.tiles()
    for i in range(0, len(tiles), 2):
        (k0, b0, c0), (k1, b1, c1) = tiles[i], tiles[i + 1]
        assert (k0, c0) == (k1, c1) and b0 % 2 == 0 and b1 == b0 + 1
    base = schedule_for(8192, 4096, 7168, 4096, grid=66, tile_m=256, group=2)
    assert s.pair_tiles() == base.tiles()
    plain = schedule_for(8192, 4096, 7168, 4096, grid=132, group=4)
    assert plain.tiles() == schedule_for(8192, 4096, 7168, 4096, grid=132, group=4,
                                         cluster=1).tiles()


@pytest.mark.parametrize("M", [4000, 610, 130, 100])
@pytest.mark.parametrize("group,patch", [(1, 1), (2, 1), (4, 2)])
def test_reference_walk_matches_math_odd_blocks(M, group, patch):
    torch.manual_seed(M + group)
    P, hidden, N = 128, 512, 512
    x = torch.randn(M, P, dtype=torch.bfloat16)
    w1 = torch.randn(P, hidden, dtype=torch.bfloat16) / P ** 0.5
    b1 = torch.randn(hidden, dtype=torch.bfloat16)
    w2 = torch.randn(hidden, N, dtype=torch.bfloat16) / hidden ** 0.5
    s = schedule_for(M, P, hidden, N, grid=6, group=group, patch=patch, cluster=2)
    if M == 4000:
        assert s.ring < s.blocks  # the ring wraps, so a slot reused too early would show
    y = execute_reference(s, x, w1, b1, w2, lambda h: activation(h, "silu"))
    ref = chained_ffn_reference(x, w1, b1, w2, "silu")
    assert not torch.isnan(y).any()
    assert (y.float() - ref).abs().max() <= 8e-3 * ref.abs().max()


def test_overrides_in_row_blocks_must_be_even():
    s = schedule_for(8192, 8192, 14336, 8192, grid=132, group=16, patch=4, ring=32,
                     lookahead=16, cluster=2)
    assert (s.ring, s.lookahead) == (32, 16) and s.base.group == 8
    simulate(s)
    for kw in (dict(group=3), dict(group=4, ring=9), dict(group=4, lookahead=5)):
        with pytest.raises(ValueError, match="cluster=2"):
            schedule_for(8192, 8192, 14336, 8192, grid=132, cluster=2, **kw)
    with pytest.raises(ValueError, match="cluster"):
        schedule_for(8192, 8192, 14336, 8192, grid=132, cluster=4)


def test_host_wrapper_cluster_checks():
    C = ChainedFFNCompute
    assert C.can_implement(4096, 7168, 4096, "gelu", cluster=2)
    assert not C.can_implement(4096, 7168, 4096, "gelu", cluster=2, grouped=True)
    assert not C.can_implement(4096, 7168, 4096, "gelu", cluster=3)
    assert C.can_implement(4096, 7168, 4096, "gelu", grouped=True)
    for bad in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="cluster"):
            C(cluster=bad)
    with pytest.raises(ValueError, match="even"):
        C(cluster=2, group=3)
    c = C(cluster=2, group=8)
    assert c.grid(8192, 14336, 8192, sms=132) == 132
    assert c.grid(8192, 14336, 8192, sms=132, ccta=3) == 128  # whole clusters only
    assert c.grid(100, 256, 256, sms=132) == 4  # one pair block, two pair tiles: 2 clusters
    with pytest.raises(ValueError, match="pair"):
        c.grid(8192, 14336, 8192, sms=132, ccta=131)
    s = c.schedule(8192, 8192, 14336, 8192, 132)
    assert isinstance(s, PairedChainedSchedule) and s.base.group == 4
    assert c.ring_rows(8192, 8192, 14336, 8192) == min(s.ring, 64) * 128
    auto = C(cluster=2).schedule(8192, 8192, 14336, 8192, 132)
    assert isinstance(auto, PairedChainedSchedule)
    with pytest.raises(ValueError, match="dense calls only"):
        c.compile(512, 1024, 512, grouped=True)
    bf = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dense calls only"):
        c.check_grouped_args(torch.zeros(256, 256, **bf), torch.zeros(2, 256, 256, **bf), None,
                             torch.zeros(2, 256, 256, **bf), None, None, None,
                             torch.zeros(2, dtype=torch.int32), "gelu", 0, need_cuda=False)
