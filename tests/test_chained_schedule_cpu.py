"""The chained FFN kernel's tile order (moe_overlap/ffn/chained_schedule.py) on CPU: every tile
once, dependencies earlier in the list, the ring reused only after its GEMM2 tiles, the derived
lookahead/ring keep persistent CTAs from waiting, and a too-small ring gives a wrong result."""
import pytest
import torch

from moe_overlap.ffn.chained_schedule import (GEMM1, GEMM2, ChainedSchedule, derive,
                                              execute_reference, simulate)
from moe_overlap.ffn.shapes import FFN_SHAPES

SHAPES = FFN_SHAPES  # name: (P = N, O), sliced over G = 2 below


@pytest.mark.parametrize("rows,hidden,out,tm,th,tn,grid", [
    (1000, 512, 384, 128, 256, 128, 7), (128, 256, 256, 128, 256, 256, 132),
    (8192, 7168, 4096, 128, 256, 256, 132), (70, 1024, 100, 64, 128, 64, 3)])
def test_every_tile_once_and_dependencies_earlier(rows, hidden, out, tm, th, tn, grid):
    s = derive(rows, hidden, out, tm, th, tn, grid)
    tiles = s.tiles()
    assert len(tiles) == len(set(tiles)) == s.blocks * (s.h_tiles + s.n_tiles)
    pos = {t: p for p, t in enumerate(tiles)}
    for (kind, b, c), p in pos.items():
        if kind == GEMM2:
            assert all(pos[(GEMM1, b, j)] < p for j in range(s.h_tiles))
        elif b >= s.ring:
            assert all(pos[(GEMM2, b - s.ring, n)] < p for n in range(s.n_tiles))
    table = s.tile_table()
    assert table.dtype == torch.int32 and table.shape == (len(tiles), 3)
    assert table.tolist() == [list(t) for t in tiles]


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [8192, 32768])
def test_derived_ring_keeps_ctas_busy(name, tokens):
    """With tile durations proportional to their work, the derived lookahead and ring lose
    under 2 % to waiting, and the ring is far smaller than H."""
    P, O = SHAPES[name]
    s = derive(tokens, O // 2, P, grid=132)
    sim = simulate(s)
    assert sim.wait <= 0.02 * sim.busy, (name, s, sim)
    assert sim.efficiency > 0.9, (name, s, sim)
    h_bytes = tokens * (O // 2) * 2
    assert s.ring_bytes <= 32 * 2**20, (name, s.ring_bytes)
    assert s.ring_bytes < h_bytes


def test_no_lookahead_makes_ctas_wait():
    """The measure can fail: with the smallest lookahead GEMM2 tiles wait on their block."""
    P, O = SHAPES["llama3-8b"]
    good = simulate(derive(8192, O // 2, P))
    bad = simulate(ChainedSchedule(8192, O // 2, P, 128, 256, 256, 132, lookahead=1, ring=2))
    assert bad.wait > 10 * max(good.wait, 1.0)
    assert bad.makespan > 1.1 * good.makespan


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3-expert"])
def test_tiles_from_a_counter_not_striding(name):
    """With GEMM1 and GEMM2 tiles of different durations, CTAs striding over the list drift
    apart and wait; taking the next tile from a counter does not."""
    P, O = SHAPES[name]
    s = derive(8192, O // 2, P)
    dyn, static = simulate(s), simulate(s, policy="static")
    assert dyn.efficiency > 0.95 and static.efficiency < 0.8, (dyn, static)
    with pytest.raises(ValueError, match="policy"):
        simulate(s, policy="random")


def _act(h):
    return torch.nn.functional.gelu(h)


@pytest.mark.parametrize("rows", [1, 300, 1024])
def test_reference_walk_matches_dense(rows):
    g = torch.Generator().manual_seed(rows)
    P, O, N = 192, 512, 192
    x = torch.randn(rows, P, generator=g)
    w1 = torch.randn(P, O, generator=g) / P ** 0.5
    b1 = torch.randn(O, generator=g)
    w2 = torch.randn(O, N, generator=g) / O ** 0.5
    s = derive(rows, O, N, tile_m=64, tile_h=128, tile_n=64, grid=5)
    got = execute_reference(s, x, w1, b1, w2, _act)
    # H is rounded to bf16 like the kernel's: compare with the float64 truth at bf16 precision,
    # and exactly with the same math on the whole matrix
    truth = _act(x.double() @ w1.double() + b1.double()) @ w2.double()
    torch.testing.assert_close(got.double(), truth, rtol=2e-2, atol=2e-2)
    h = _act(x @ w1 + b1).to(torch.bfloat16).float()
    torch.testing.assert_close(got, h @ w2, rtol=1e-4, atol=1e-4)


def test_too_small_ring_gives_wrong_result():
    """A ring no larger than the lookahead overwrites H blocks before their GEMM2 tiles read
    them: the walk's output differs (the broken ordering is caught), and derive refuses it."""
    g = torch.Generator().manual_seed(0)
    rows, P, O, N = 1024, 128, 256, 128
    x = torch.randn(rows, P, generator=g)
    w1 = torch.randn(P, O, generator=g)
    w2 = torch.randn(O, N, generator=g)
    good = derive(rows, O, N, tile_m=64, tile_h=128, tile_n=64, grid=4)
    bad = ChainedSchedule(rows, O, N, 64, 128, 64, 4, lookahead=good.lookahead,
                          ring=good.lookahead)
    want = execute_reference(good, x, w1, None, w2, _act)
    got = execute_reference(bad, x, w1, None, w2, _act)
    assert not torch.allclose(got, want, equal_nan=False)
    with pytest.raises(AssertionError, match="before all GEMM2"):
        simulate(bad)
    with pytest.raises(ValueError, match="must exceed lookahead"):
        derive(rows, O, N, tile_m=64, tile_h=128, tile_n=64, grid=4, lookahead=3, ring=3)


@pytest.mark.parametrize("kw,match", [(dict(hidden=300), "multiple of tile_h"),
                                      (dict(grid=0), "grid must be"),
                                      (dict(rows=1.5), "rows must be")])
def test_bad_arguments(kw, match):
    args = dict(rows=128, hidden=512, out=256)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        derive(**args)
