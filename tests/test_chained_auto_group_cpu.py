"""group="auto" of the chained FFN kernel (compute_chained.auto_group): on the shapes of its GPU
measurement (groups 2-16 timed in a shuffled order per round) it takes a group within 3.5 % of
the best measured one on every point, and it follows its written rule (largest of 8, 4, 2 whose
ring holds at most half of H's row blocks, else the largest within 1.25x the fewest blocks, else
1)."""
import glob
import json
import pathlib

import pytest

from moe_overlap.ffn.compute_chained import ChainedFFNCompute, auto_group, schedule_for

# the measurement the rule was chosen from (one H200, the seven slices at 8192 and 32768 tokens)
RESULTS = sorted(glob.glob(str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
                               / "ffn_chained_compute_h200_groups*_c294d29.json")))
ROWS = [r for f in RESULTS for r in json.loads(pathlib.Path(f).read_text())["rows"]
        if "variants" in r]


def _held(M, P, hidden, N, g, grid=132):
    return min(schedule_for(M, P, hidden, N, grid, group=g).ring, -(-M // 128))


def test_measurement_has_every_shape_at_both_token_counts():
    assert len({(r["shape"], r["tokens"]) for r in ROWS}) == 14
    assert all("8" in r["variants"] for r in ROWS)


@pytest.mark.parametrize("r", ROWS, ids=lambda r: f"{r['shape']}@{r['tokens']}")
def test_auto_within_the_best_measured_group(r):
    grid = r["variants"]["auto"]["grid"]
    g = auto_group(r["tokens"], r["P"], r["hidden_slice"], r["N"], grid)
    timed = {k: v["speedup"] for k, v in r["variants"].items() if k != "auto" and "speedup" in v}
    assert str(g) in timed, (r["shape"], r["tokens"], g)  # the choice was measured
    # 3.5 %: the run's own spread (llama3-8b and mixtral-8x7b-expert are the same slice, and their
    # group orders differ by up to 3.6 % between the two rows)
    assert timed[str(g)] >= 0.965 * max(timed.values()), (r["shape"], r["tokens"], g, timed)
    # the schedule's ring is the one the bench measured for that group (same derivation)
    assert schedule_for(r["tokens"], r["P"], r["hidden_slice"], r["N"], grid,
                        group=g).ring == r["variants"][str(g)]["ring"]


@pytest.mark.parametrize("M,P,hidden,N", [(8192, 4096, 7168, 4096), (32768, 8192, 14336, 8192),
                                          (1000, 8192, 14336, 8192), (8192, 7168, 1024, 7168),
                                          (4096, 4096, 7168, 4096), (300, 512, 1024, 512),
                                          (100, 4096, 7168, 4096)])
@pytest.mark.parametrize("grid", [132, 64, 16])
def test_rule_as_written(M, P, hidden, N, grid):
    blocks = -(-M // 128)
    held = {g: _held(M, P, hidden, N, g, grid) for g in (1, 2, 4, 8)}
    g = auto_group(M, P, hidden, N, grid)
    fits = [c for c in (8, 4, 2) if held[c] <= blocks // 2]
    near = [c for c in (8, 4, 2) if held[c] * 4 <= min(held.values()) * 5]
    want = fits[0] if fits else near[0] if near else 1
    assert g == want, (held, blocks)
    if fits:  # the activation-memory cap: the ring keeps at most half of H
        assert held[g] <= blocks // 2


def test_few_rows_take_the_largest_group():
    # every ring covers all 8 blocks: no group holds less of H, so the one sharing most panels
    assert auto_group(1024, 8192, 14336, 8192, 132) == 8


def test_instance_default_is_auto_and_consistent():
    c = ChainedFFNCompute()
    assert c.group == "auto"
    M, P, hidden, N = 32768, 8192, 14336, 8192
    g = c.group_for(M, P, hidden, N, 132)
    assert g == auto_group(M, P, hidden, N, 132) == 8
    s = c.schedule(M, P, hidden, N, 132)
    assert s.group == g
    assert c.ring_bytes(M, P, hidden, N, 132) == s.ring_bytes
    assert ChainedFFNCompute(group=4).group_for(M, P, hidden, N, 132) == 4


@pytest.mark.parametrize("kw,msg", [(dict(group="fast"), "group"), (dict(group=0), "group"),
                                    (dict(group=True), "group"),
                                    (dict(_test_ring=2), "_test_ring"),
                                    (dict(group=2, _test_ring=0), "_test_ring")])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ChainedFFNCompute(**kw)


def test_ffn_package_exports_it():
    import moe_overlap.ffn as ffn
    assert ffn.ChainedFFNCompute is ChainedFFNCompute and "ChainedFFNCompute" in ffn.__all__
