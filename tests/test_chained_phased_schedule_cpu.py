"""The phased step of the chained FFN tile order (``split``: chained_schedule.ChainedSchedule,
compute_chained.schedule_for / auto_split, the bench's sK entries): every tile once, every
dependency earlier in the list (simulate asserts it), the reference walk equal to the plain
math with a ring that wraps, and the short ring it allows keeping the CTAs busy where the
interleaved order with the same ring does not."""

import pytest
import torch

from moe_overlap.ffn.activations import activation
from moe_overlap.ffn.chained_schedule import (GEMM1, GEMM2, ChainedSchedule, derive,
                                              execute_reference, simulate)
from moe_overlap.ffn.compute_chained import (ChainedFFNCompute, auto_split,
                                             chained_ffn_reference, ring_cap_blocks,
                                             schedule_for)
from moe_overlap.ffn.shapes import FFN_SHAPES

from conftest import load_bench


def _tile_set(s):
    return {(GEMM1, b, j) for b in range(s.blocks) for j in range(s.h_tiles)} | \
        {(GEMM2, b, n) for b in range(s.blocks) for n in range(s.n_tiles)}


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "deepseek-v3-expert",
                                  "llama4-scout-expert"])
@pytest.mark.parametrize("T", [8192, 1000])
@pytest.mark.parametrize("group,patch,ls,rs", [(1, 1, None, None), (4, 1, 1, 2), (8, 1, 1, 2),
                                               (8, 2, 1, 2), (6, 1, 2, 3), (4, 4, 1, 3)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_every_tile_once_dependencies_earlier(name, T, group, patch, ls, rs, where):
    P, O = FFN_SHAPES[name]
    hidden = O // 2
    n1 = hidden // 256
    k = {"first": 0, "middle": n1 // 2, "last": n1}[where]
    kw = {} if ls is None else dict(lookahead=ls * group, ring=rs * group)
    s = schedule_for(T, P, hidden, P, grid=132, group=group, patch=patch, split=k, **kw)
    tiles = s.tiles()
    assert len(tiles) == len(set(tiles)) and set(tiles) == _tile_set(s)
    simulate(s)  # raises AssertionError on a dependency later in the list


def test_phased_step_layout():
    """A step: its first k GEMM1 tiles, all its GEMM2 tiles, the rest of its GEMM1 tiles."""
    s = ChainedSchedule(1280, 2048, 1024, 128, 256, 256, 8, lookahead=2, ring=3, split=3)
    n1, n2 = s.h_tiles, s.n_tiles  # 8, 4
    tiles = s.tiles()
    assert tiles[:2 * n1] == [(GEMM1, b, j) for b in range(2) for j in range(n1)]
    step0 = tiles[2 * n1:2 * n1 + n1 + n2]
    assert step0 == ([(GEMM1, 2, j) for j in range(3)] + [(GEMM2, 0, n) for n in range(n2)]
                     + [(GEMM1, 2, j) for j in range(3, n1)])
    assert tiles[-n2:] == [(GEMM2, s.blocks - 1, n) for n in range(n2)]
    inter = ChainedSchedule(1280, 2048, 1024, 128, 256, 256, 8, lookahead=2, ring=3)
    assert sorted(inter.tiles()) == sorted(tiles) and inter.tiles() != tiles


@pytest.mark.parametrize("bad", [-1, 9, True, 2.0, "3"])
def test_split_checked(bad):
    with pytest.raises(ValueError, match="split"):
        ChainedSchedule(1280, 2048, 1024, 128, 256, 256, 8, lookahead=2, ring=3, split=bad)
    with pytest.raises(ValueError, match="split"):
        ChainedFFNCompute(group=4, split=-1)


@pytest.mark.parametrize("group,patch,split,ls,rs", [(1, 1, 0, None, None), (1, 1, 1, None, None),
                                                     (3, 1, 1, 1, 2), (3, 2, 2, 1, 2),
                                                     (2, 1, 0, 2, 3), (2, 4, 2, 1, 2)])
def test_reference_walk_matches_math(group, patch, split, ls, rs):
    torch.manual_seed(group + split)
    M, P, hidden, N = 4000, 128, 512, 512
    x = torch.randn(M, P, dtype=torch.bfloat16)
    w1 = torch.randn(P, hidden, dtype=torch.bfloat16) / P ** 0.5
    b1 = torch.randn(hidden, dtype=torch.bfloat16)
    w2 = torch.randn(hidden, N, dtype=torch.bfloat16) / hidden ** 0.5
    kw = {} if ls is None else dict(lookahead=ls * group, ring=rs * group)
    s = schedule_for(M, P, hidden, N, grid=6, group=group, patch=patch, split=split, **kw)
    assert s.ring < s.blocks  # the ring wraps, so a slot reused too early would show
    y = execute_reference(s, x, w1, b1, w2, lambda h: activation(h, "silu"))
    ref = chained_ffn_reference(x, w1, b1, w2, "silu")
    assert not torch.isnan(y).any()
    assert (y.float() - ref).abs().max() <= 8e-3 * ref.abs().max()


def test_a_slot_reused_too_early_shows():
    """The reference walk can fail: the phased list with a ring one super-block too short
    (GEMM1 of block b then reuses the slot of b - ring before its GEMM2 tiles) leaves NaN or
    wrong rows."""
    torch.manual_seed(0)
    M, P, hidden, N = 2000, 128, 512, 512
    x = torch.randn(M, P, dtype=torch.bfloat16)
    w1 = torch.randn(P, hidden, dtype=torch.bfloat16) / P ** 0.5
    w2 = torch.randn(hidden, N, dtype=torch.bfloat16) / hidden ** 0.5
    s = schedule_for(M, P, hidden, N, grid=6, group=2, split=1, lookahead=2, ring=4)
    bad = type(s)(type(s.base)(**{**s.base.__dict__, "ring": 1}), s.group, s.rows, s.tile_m,
                  s.grid, s.patch)
    ref = chained_ffn_reference(x, w1, None, w2, "relu")
    y = execute_reference(bad, x, w1, None, w2, lambda h: activation(h, "relu"))
    assert torch.isnan(y).any() or (y.float() - ref).abs().max() > 8e-3 * ref.abs().max()
    with pytest.raises(AssertionError):
        simulate(bad)


@pytest.mark.parametrize("name", ["llama3-70b", "deepseek-v3-dense"])
def test_group8_in_two_super_blocks_keeps_ctas_busy(name):
    """Group 8 with one super-block of lookahead in a ring of two (16 blocks: inside the
    activation bound at 8192 tokens): phased, the CTAs lose little; interleaved, the same ring
    loses several percent (the check can fail)."""
    P, O = FFN_SHAPES[name]
    M, hidden = 8192, O // 2
    assert 16 <= ring_cap_blocks(M, hidden, P)
    phased = schedule_for(M, P, hidden, P, 132, group=8, patch=1, lookahead=8, ring=16,
                          split="auto")
    inter = schedule_for(M, P, hidden, P, 132, group=8, patch=1, lookahead=8, ring=16)
    assert phased.ring == 16 and phased.base.split is not None
    assert simulate(phased).efficiency >= 0.975
    assert simulate(inter).efficiency <= simulate(phased).efficiency - 0.04


def test_auto_split_picks_from_the_best():
    P, O = FFN_SHAPES["llama3-70b"]
    args = (8192, P, O // 2, P, 132)
    s = auto_split(*args, group=8, ring=16, patch=1, lookahead=8)
    assert auto_split(*args, group=8, ring=16, patch=1, lookahead=8) is s  # cached
    e = simulate(s).efficiency
    n1 = O // 2 // 256
    effs = [simulate(schedule_for(*args, group=8, ring=16, patch=1, lookahead=8,
                                  split=k)).efficiency for k in range(0, n1 + 1, 7)]
    assert e >= max(effs) - 0.002
    assert schedule_for(*args, group=8, ring=16, patch=1, lookahead=8, split="auto") == s


def test_cluster_pairs_take_the_split():
    P, O = FFN_SHAPES["llama3-70b"]
    s = schedule_for(8192, P, O // 2, P, 132, group=8, patch=1, lookahead=8, ring=16, split=12,
                     cluster=2)
    assert s.base.base.split == 12 and s.ring == 16
    assert set(s.tiles()) == _tile_set(s)
    simulate(s)


def test_compute_runs_the_split():
    """ChainedFFNCompute(split=) reaches the list the kernel walks (its table)."""
    P, O = FFN_SHAPES["llama3-70b"]
    c = ChainedFFNCompute(group=8, patch=1, split=12, _test_ring=16, _test_lookahead=8)
    s = c.schedule(8192, P, O // 2, P, 132)
    assert s.base.split == 12 and s.ring == 16
    want = schedule_for(8192, P, O // 2, P, 132, group=8, patch=1, ring=16, lookahead=8,
                        split=12)
    assert torch.equal(s.tile_table(), want.tile_table())
    plain = ChainedFFNCompute(group=8, patch=1, _test_ring=16, _test_lookahead=8)
    assert not torch.equal(plain.schedule(8192, P, O // 2, P, 132).tile_table(), s.tile_table())


def test_derive_keeps_the_split():
    s = derive(8192, 7168, 4096, grid=132, split=5)
    assert s.split == 5 and derive(8192, 7168, 4096, grid=132).split is None


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_chained_compute")


def test_bench_spec_grammar(bench):
    assert bench.parse_spec("8p1r16l8s12") == dict(group=8, patch=1, _test_ring=16,
                                                   _test_lookahead=8, cluster=1, split=12)
    assert bench.parse_spec("8p1r16l8s")["split"] == "auto"
    assert bench.parse_spec("16p4r32l16")["split"] is None
    assert bench.parse_spec("8s0c2") == dict(group=8, patch="auto", _test_ring=None,
                                             _test_lookahead=None, cluster=2, split=0)
    c = bench.make_comp("8p1r16l8s")
    assert c.split == "auto" and c.schedule(8192, 8192, 14336, 8192, 132).ring == 16
    with pytest.raises(ValueError):
        bench.parse_spec("8x3")
