"""group="auto" of the chained FFN kernel (compute_chained.auto_group): on the shapes of its first
GPU measurement it takes a grouped order (2 or 4) wherever one measured best, never a ring above
the L2, and it follows its written rule (largest of 4, 2 within half the L2, then within 0.8)."""
import json
import pathlib

import pytest

from moe_overlap.ffn.compute_chained import (L2_BYTES_SM90, ChainedFFNCompute, auto_group,
                                             schedule_for)

# the measurement the rule was chosen from (groups 1, 2, 4 in the same rounds; archived once the
# run of the rule itself became the headline)
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results" / "archive" / \
    "ffn_chained_compute_h200_2bc5fa0.json"
ROWS = [r for r in json.loads(RESULTS.read_text())["rows"] if "variants" in r]


def _ring(r, g):
    grid = r["variants"][str(g)]["grid"]
    return schedule_for(r["tokens"], r["P"], r["hidden_slice"], r["N"], grid, group=g).ring_bytes


def test_measurement_has_every_shape():
    assert len(ROWS) == 14 and {r["tokens"] for r in ROWS} == {8192, 32768}


@pytest.mark.parametrize("r", ROWS, ids=lambda r: f"{r['shape']}@{r['tokens']}")
def test_auto_on_measured_shapes(r):
    grid = r["variants"]["1"]["grid"]
    g = auto_group(r["tokens"], r["P"], r["hidden_slice"], r["N"], grid)
    # the schedule's ring is the one the bench measured (same derivation)
    assert _ring(r, g) == r["variants"][str(g)]["ring_bytes"]
    assert _ring(r, g) <= L2_BYTES_SM90
    if int(r["best_group"]) in (2, 4):
        assert g in (2, 4), (r["shape"], r["tokens"], g)
    # within 4 % of the best measured group on every shape but llama3-70b (whose best ring,
    # group 4's 56 MiB, is above the L2 and excluded on purpose)
    best = r["best_speedup"]
    chosen = r["variants"][str(g)]["speedup"]
    if r["shape"] != "llama3-70b":
        assert chosen >= 0.96 * best, (r["shape"], r["tokens"], g, chosen, best)
    else:
        assert r["variants"]["4"]["ring_bytes"] > L2_BYTES_SM90 and g == 2


@pytest.mark.parametrize("M,P,hidden,N", [(8192, 4096, 7168, 4096), (32768, 8192, 14336, 8192),
                                          (1000, 8192, 14336, 8192), (8192, 7168, 1024, 7168),
                                          (300, 512, 1024, 512)])
@pytest.mark.parametrize("l2", [L2_BYTES_SM90, 24 * 2 ** 20, 8 * 2 ** 20, 2 ** 20])
def test_rule_as_written(M, P, hidden, N, l2):
    rings = {g: schedule_for(M, P, hidden, N, 132, group=g).ring_bytes for g in (1, 2, 4)}
    g = auto_group(M, P, hidden, N, 132, l2_bytes=l2)
    if rings[4] <= l2 // 2:
        want = 4
    elif rings[2] <= l2 // 2:
        want = 2
    elif rings[4] <= l2 * 4 // 5:
        want = 4
    elif rings[2] <= l2 * 4 // 5:
        want = 2
    else:
        want = 1
    assert g == want, (rings, l2)
    if g > 1:
        assert rings[g] <= l2 * 4 // 5


def test_tiny_l2_falls_back_to_group_one():
    assert auto_group(32768, 8192, 14336, 8192, 132, l2_bytes=2 ** 20) == 1


def test_instance_default_is_auto_and_consistent():
    c = ChainedFFNCompute()
    assert c.group == "auto"
    M, P, hidden, N = 32768, 8192, 14336, 8192
    g = c.group_for(M, P, hidden, N, 132)
    assert g == auto_group(M, P, hidden, N, 132) == 2
    s = c.schedule(M, P, hidden, N, 132)
    assert s.group == g
    assert c.ring_bytes(M, P, hidden, N, 132) == s.ring_bytes
    assert ChainedFFNCompute(group=4).group_for(M, P, hidden, N, 132) == 4
    # a smaller planned L2 changes the choice, through the instance too
    assert ChainedFFNCompute(l2_bytes=2 ** 20).group_for(M, P, hidden, N, 132) == 1


@pytest.mark.parametrize("kw,msg", [(dict(group="fast"), "group"), (dict(group=0), "group"),
                                    (dict(group=True), "group"), (dict(l2_bytes=0), "l2_bytes"),
                                    (dict(_test_ring=2), "_test_ring"),
                                    (dict(group=2, _test_ring=0), "_test_ring")])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ChainedFFNCompute(**kw)


def test_ffn_package_exports_it():
    import moe_overlap.ffn as ffn
    assert ffn.ChainedFFNCompute is ChainedFFNCompute and "ChainedFFNCompute" in ffn.__all__
