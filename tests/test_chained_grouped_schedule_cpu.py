"""The super-block tile order of the chained FFN kernel (compute_chained.GroupedChainedSchedule /
schedule_for): every tile once, every dependency earlier in the list (simulate asserts it), the
reference walk equal to the plain math, and G blocks side by side on each weight panel."""
import pytest
import torch

from moe_overlap.ffn.activations import activation
from moe_overlap.ffn.chained_schedule import GEMM1, GEMM2, execute_reference, simulate
from moe_overlap.ffn.compute_chained import chained_ffn_reference, schedule_for

SLICES = {"llama3-8b": (4096, 7168), "llama3-70b": (8192, 14336),
          "deepseek-v3-expert": (7168, 1024), "llama4-scout-expert": (5120, 4096)}


@pytest.mark.parametrize("name", list(SLICES))
@pytest.mark.parametrize("T", [8192, 1000])
@pytest.mark.parametrize("group,patch", [(1, 1), (2, 1), (4, 1), (8, 2), (4, 4), (8, 4)])
def test_every_tile_once_dependencies_earlier(name, T, group, patch):
    P, hidden = SLICES[name]
    s = schedule_for(T, P, hidden, P, grid=132, group=group, patch=patch)
    tiles = s.tiles()
    want = {(GEMM1, b, j) for b in range(s.blocks) for j in range(s.h_tiles)} | \
        {(GEMM2, b, n) for b in range(s.blocks) for n in range(s.n_tiles)}
    assert len(tiles) == len(want) and set(tiles) == want
    assert s.ring > s.lookahead
    sim = simulate(s)  # raises AssertionError on a dependency later in the list
    if T == 8192:  # (at 1000 rows the last wave dominates any order)
        assert sim.efficiency > 0.9, (name, T, group, sim)
    assert s.ring_bytes == min(s.ring, s.blocks) * 128 * hidden * 2
    assert torch.equal(s.tile_table()[:, 1], torch.tensor([t[1] for t in tiles],
                                                          dtype=torch.int32))


def test_group_puts_blocks_side_by_side_on_a_panel():
    """With group G the G blocks of a super-block take each column tile next to each other."""
    s = schedule_for(8192, 4096, 7168, 4096, grid=132, group=4)
    tiles = s.tiles()
    for i in range(0, 64, 4):  # runs of 4 tiles: same kind and column, consecutive blocks
        run = tiles[i:i + 4]
        assert len({(k, c) for k, _, c in run}) == 1
        assert [b for _, b, _ in run] == list(range(run[0][1], run[0][1] + 4))


def test_patch_puts_a_blocks_column_tiles_side_by_side():
    """patch C: each block's C column tiles of a run are adjacent, the G blocks of the run
    follow each other; patch 1 is the side-by-side order above."""
    G, C = 4, 3
    s = schedule_for(8192, 4096, 7168, 4096, grid=132, group=G, patch=C)
    tiles = s.tiles()
    run = tiles[:G * C]  # the prologue: GEMM1 of super-block 0, column tiles 0..C-1
    assert run == [(GEMM1, b, c) for b in range(G) for c in range(C)]
    plain = schedule_for(8192, 4096, 7168, 4096, grid=132, group=G)
    assert sorted(tiles) == sorted(plain.tiles()) and tiles != plain.tiles()
    with pytest.raises(ValueError, match="patch"):
        schedule_for(8192, 4096, 7168, 4096, grid=132, group=G, patch=0)


@pytest.mark.parametrize("group,patch", [(1, 1), (2, 1), (3, 1), (3, 4)])
def test_reference_walk_matches_math(group, patch):
    torch.manual_seed(group)
    M, P, hidden, N = 4000, 128, 512, 512
    x = torch.randn(M, P, dtype=torch.bfloat16)
    w1 = torch.randn(P, hidden, dtype=torch.bfloat16) / P ** 0.5
    b1 = torch.randn(hidden, dtype=torch.bfloat16)
    w2 = torch.randn(hidden, N, dtype=torch.bfloat16) / hidden ** 0.5
    s = schedule_for(M, P, hidden, N, grid=6, group=group, patch=patch)
    assert s.ring < s.blocks  # the ring wraps, so a slot reused too early would show
    y = execute_reference(s, x, w1, b1, w2, lambda h: activation(h, "silu"))
    ref = chained_ffn_reference(x, w1, b1, w2, "silu")
    assert not torch.isnan(y).any()
    assert (y.float() - ref).abs().max() <= 8e-3 * ref.abs().max()


def test_ring_override():
    assert schedule_for(8192, 4096, 7168, 4096, grid=132, ring=2).ring == 2  # group 1: unchecked
    d = schedule_for(8192, 8192, 14336, 8192, grid=132, group=2)
    assert d.ring == 10 and d.lookahead == 4  # llama3-70b's slice: 5 super-blocks, 35 MiB
    s = schedule_for(8192, 8192, 14336, 8192, grid=132, group=2, ring=8)
    assert s.ring == 8 and s.ring_bytes == 8 * 128 * 14336 * 2 and s.lookahead == d.lookahead
    sim = simulate(s)  # raises on a dependency later in the list
    assert sim.efficiency >= simulate(d).efficiency - 0.005
    for bad in (7, 4, 3):  # not a multiple of the group, or not above the lookahead
        with pytest.raises(ValueError, match="multiple of the group"):
            schedule_for(8192, 8192, 14336, 8192, grid=132, group=2, ring=bad)


def test_lookahead_override():
    """A shorter lookahead lets group 16 run in a ring of 32 blocks at 8192 tokens (half of H):
    the list stays valid (simulate), and the overrides are checked."""
    s = schedule_for(8192, 8192, 14336, 8192, grid=132, group=16, patch=4, ring=32, lookahead=16)
    assert (s.lookahead, s.ring, s.patch) == (16, 32, 4)
    assert simulate(s).efficiency > 0.95
    for kw in (dict(lookahead=8), dict(lookahead=24), dict(lookahead=64),
               dict(lookahead=16, ring=16)):
        with pytest.raises(ValueError):
            schedule_for(8192, 8192, 14336, 8192, grid=132, group=16, **kw)
