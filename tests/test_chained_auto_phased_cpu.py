"""The phased orders of group="auto" (compute_chained.auto_phased, ChainedFFNCompute.phased_for):
the properties the rule promises (bound, threshold, no better fitting order, fallback), the
activation bound it keeps, the options that leave it out; on the points of the GPU measurement
it was chosen from (one H100, the seven slices at 8192 and 32768 tokens, each order's graph
alone for 2 s: hold_speedup; in-sample), that its choice was measured, within 2 % of the best
measured cluster-1 order under the bound and at >= 0.95x the library, and where it chooses none,
that the order run instead was faster; held out, on the H200, that its choice is within 2 % of
the best order measured there before under the bound."""
import json
import pathlib

import pytest

from moe_overlap.ffn.chained_schedule import simulate
from moe_overlap.ffn.compute_chained import (ACTIVATION_CAP, AUTO_GROUPS, PHASED_MIN_EFFICIENCY,
                                             PHASED_ORDERS, SPLIT_TOLERANCE, ChainedFFNCompute,
                                             activation_bytes, auto_group, auto_phased,
                                             baseline_activation_bytes, ring_cap_blocks,
                                             schedule_for)

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
FILES = [RESULTS / n for n in ("ffn_chained_compute_h100_phased_73897e1.json",
                               "ffn_chained_compute_h100_lookahead_73897e1.json",
                               "ffn_chained_compute_h100_t32768_2631ea0.json",
                               "ffn_chained_compute_h100_c2phased_2631ea0.json")]


def _points():
    """(shape, tokens) -> {"dims": (M, P, hidden, N), "grid", "runs": {variant: [hold_speedup,
    ring, ...]}} over the files (a variant measured in two files has two speedups)."""
    pts = {}
    for f in FILES:
        doc = json.loads(f.read_text())
        assert doc["device"].startswith("NVIDIA H100")
        for r in doc["rows"]:
            p = pts.setdefault((r["shape"], r["tokens"]),
                               dict(dims=(r["tokens"], r["P"], r["hidden_slice"], r["N"]),
                                    runs={}))
            for name, v in r["variants"].items():
                p["runs"].setdefault(name, []).append(v)
    return pts


POINTS = _points()


def test_measurement_covers_the_seven_slices_at_both_token_counts():
    assert len(POINTS) == 14
    assert {t for _, t in POINTS} == {8192, 32768}


def _spec(s):
    return f"{s.group}p{s.patch}r{s.ring}l{s.lookahead}s"


@pytest.mark.parametrize("key", sorted(POINTS), ids=lambda k: f"{k[0]}@{k[1]}")
def test_choice_on_the_measurement_it_was_chosen_from(key):
    """In-sample (the rule was chosen from these files): where it picks a phased order, that
    order was measured, at >= 0.95x the library and within 2 % of the best measured cluster-1
    order under the bound; where it picks none, the order it runs instead (``auto_group``'s, the
    files' "auto") was measured faster than each of PHASED_ORDERS there. The held-out check is
    ``test_choice_on_h200_is_near_the_best_order_measured_there_before``."""
    p = POINTS[key]
    M, P, hidden, N = p["dims"]
    grid = next(iter(p["runs"].values()))[0]["grid"]
    c = ChainedFFNCompute()
    phased = c.phased_for(M, P, hidden, N, grid)
    blocks = -(-M // 128)
    cap = ring_cap_blocks(M, hidden, N)
    if phased is None:
        s = c.schedule(M, P, hidden, N, grid)
        fallback = [v["hold_speedup"] for v in p["runs"]["auto"]
                    if (v["group_run"], v["ring"]) == (s.group, s.ring)]
        assert len(fallback) == len(p["runs"]["auto"]) > 0, key  # the order run was measured
        declined = [v["hold_speedup"] for g, r in PHASED_ORDERS
                    for v in p["runs"][f"{g}p1r{r}l{g}s"]]
        assert declined and min(fallback) > max(declined), (key, fallback, declined)
        return
    assert c.schedule(M, P, hidden, N, grid) is phased
    runs = p["runs"][_spec(phased)]  # KeyError: the rule chose an order nobody measured
    for v in runs:
        assert v["ring"] == phased.ring and v["split"] == phased.base.split
    ours = sum(v["hold_speedup"] for v in runs) / len(runs)
    under = {n: sum(v["hold_speedup"] for v in vs) / len(vs) for n, vs in p["runs"].items()
             if not n.endswith("c2") and min(vs[0]["ring"], blocks) <= cap}
    assert ours >= 0.95, (key, ours)
    # 2 %: one 2 s hold per run; the same order differs by up to 0.5 % between two files
    assert ours >= 0.98 * max(under.values()), (key, _spec(phased), ours, under)


def test_choice_on_h200_is_near_the_best_order_measured_there_before():
    """Held out (the phased rule was chosen on an H100): on the H200, the committed rule's
    sustained rate (its headline run) is within 2 % of the best order measured there before it
    existed (``auto_group``'s variants, ffn_chained_compute_h200_holds_patch_606dff6.json) that
    keeps the activation bound, on every point where one does (at 32768 tokens, and
    llama4-scout-expert's slice at 8192). 2 %: two runs two days apart; the one order both ran
    (deepseek-v3-expert at 32768, group 16) differs by 0.8 %."""
    new = json.loads((RESULTS / "ffn_chained_compute_h200_auto_phased_918b75d.json").read_text())
    old = json.loads((RESULTS / "ffn_chained_compute_h200_holds_patch_606dff6.json").read_text())
    before = {(r["shape"], r["tokens"]): r for r in old["rows"]}
    compared = 0
    for r in new["rows"]:
        M, P, hidden, N = r["tokens"], r["P"], r["hidden_slice"], r["N"]
        v = r["variants"]["auto"]
        c = ChainedFFNCompute()
        s = c.schedule(M, P, hidden, N, v["grid"])
        assert (c.group_for(M, P, hidden, N, v["grid"]), s.ring) == (v["group_run"], v["ring"])
        blocks, cap = -(-M // 128), ring_cap_blocks(M, hidden, N)
        under = [w["hold_speedup"] for w in before[r["shape"], M]["variants"].values()
                 if min(w["ring"], blocks) <= cap]
        if under:
            compared += 1
            assert v["hold_speedup"] >= 0.98 * max(under), (r["shape"], M, v, under)
    assert compared == 8


SLICES = [(4096, 7168, 4096), (8192, 14336, 8192), (7168, 9216, 7168), (7168, 1024, 7168),
          (5120, 4096, 5120), (5120, 8192, 5120), (1024, 2048, 1024)]


@pytest.mark.parametrize("M", [2048, 4096, 6000, 8192, 12000, 16384])
@pytest.mark.parametrize("P,hidden,N", SLICES)
@pytest.mark.parametrize("grid", [132, 64])
def test_choice_fits_the_bound_reaches_the_threshold_and_none_fitting_is_better(M, P, hidden, N,
                                                                                grid):
    """The properties the rule promises. Each order of PHASED_ORDERS is simulated at M's bucket
    (row blocks rounded up to a power of two, as the rule decides once per bucket) with the
    split ``auto_split`` gives there. A chosen order: its ring fits ``ring_cap_blocks``, its
    efficiency reaches PHASED_MIN_EFFICIENCY, no other fitting order's beats it by more than
    SPLIT_TOLERANCE, and its tile list is for M itself (patch 1, lookahead one super-block).
    None: no fitting order reaches the threshold, and the instance runs ``auto_group``'s."""
    cap = ring_cap_blocks(M, hidden, N)
    bucket = 1 << (-(-M // 128) - 1).bit_length()
    fitting = {}
    for group, ring in PHASED_ORDERS:
        if ring <= cap:
            s = schedule_for(bucket * 128, P, hidden, N, grid, group=group, ring=ring, patch=1,
                             lookahead=group, split="auto")
            fitting[group, ring] = (simulate(s).efficiency, s.base.split)
    got = auto_phased(M, P, hidden, N, grid)
    if got is None:
        assert all(e < PHASED_MIN_EFFICIENCY for e, _ in fitting.values()), fitting
        assert ChainedFFNCompute().group_for(M, P, hidden, N, grid) == \
            auto_group(M, P, hidden, N, grid)
        return
    assert (got.group, got.ring) in fitting and got.ring <= cap, (got.group, got.ring, cap)
    e, split = fitting[got.group, got.ring]
    assert e >= PHASED_MIN_EFFICIENCY
    assert all(other <= e + SPLIT_TOLERANCE for other, _ in fitting.values()), fitting
    assert (got.rows, got.patch, got.lookahead, got.base.split) == (M, 1, got.group, split)


def test_the_property_cases_reach_both_outcomes_and_a_choice_between_two():
    """Not vacuous: over the cases above the rule declines somewhere, and somewhere takes the
    second order of PHASED_ORDERS although the first fits too."""
    outcomes = set()
    for M in (2048, 4096, 6000, 8192, 12000, 16384):
        for P, hidden, N in SLICES:
            got = auto_phased(M, P, hidden, N, 132)
            both_fit = all(r <= ring_cap_blocks(M, hidden, N) for _, r in PHASED_ORDERS)
            outcomes.add(None if got is None else (got.group, got.ring) if both_fit else "one")
    assert None in outcomes and PHASED_ORDERS[1] in outcomes, outcomes


def test_a_new_row_count_in_a_decided_bucket_simulates_nothing(monkeypatch):
    """The experts' rows change every call: once a bucket of row blocks is decided, another M
    in it builds its tile list only (no simulation, ~1 ms instead of ~0.2-0.7 s)."""
    import moe_overlap.ffn.compute_chained as cc
    P, hidden, N = 4096, 7168, 4096
    first = auto_phased(8192, P, hidden, N, 132)  # 64 blocks: decides the bucket
    assert first is not None

    def no_simulation(*a, **k):
        raise AssertionError("simulated again inside a decided bucket")
    monkeypatch.setattr(cc, "simulate", no_simulation)
    for M in (7000, 7900, 8191):  # 55-64 blocks: the same bucket
        s = auto_phased(M, P, hidden, N, 132)
        assert (s.group, s.ring, s.base.split) == (first.group, first.ring, first.base.split)
        assert s.rows == M


@pytest.mark.parametrize("M", [4096, 8192, 12288, 32768, 65536])
@pytest.mark.parametrize("P,hidden,N", SLICES)
def test_phased_choice_keeps_the_activation_bound(M, P, hidden, N):
    s = auto_phased(M, P, hidden, N, 132)
    blocks = -(-M // 128)
    if s is None:
        # no phased order: only for the reasons auto_phased's doc gives (no phased ring within
        # the bound; a narrow hidden slice, <= 8 column tiles, with nothing to phase; 4096
        # rows, where a ring of 16 would be half of H); the call then runs auto_group's order
        fits = [r for _, r in PHASED_ORDERS if r <= ring_cap_blocks(M, hidden, N)]
        assert not fits or hidden // 256 <= 8 or M <= 4096, (M, hidden, fits)
        assert auto_group(M, P, hidden, N, 132) in AUTO_GROUPS + (1,)
        return
    assert s.ring <= ring_cap_blocks(M, hidden, N) <= blocks // 2
    ours = activation_bytes(M, hidden, N, s.ring * 128)
    base = baseline_activation_bytes(M, hidden, N)
    assert ours <= base
    if hidden >= N:
        assert ours <= ACTIVATION_CAP * base


def test_the_rule_chooses_phased_orders_on_the_wide_slices_from_8192_tokens():
    """Not vacuous: the rule picks a phased order at the measured wide points, none at 4096
    tokens (no phased ring fits the bound) or on deepseek-v3-expert's slice."""
    for P, hidden, N in SLICES[:3] + SLICES[4:6]:
        for M in (8192, 32768):
            assert auto_phased(M, P, hidden, N, 132) is not None, (P, hidden, N, M)
        assert auto_phased(4096, P, hidden, N, 132) is None
    assert auto_phased(8192, 7168, 1024, 7168, 132) is None


@pytest.mark.parametrize("kw", [dict(group=8), dict(patch=4), dict(patch=1), dict(split="auto"),
                                dict(split=3), dict(cluster=2), dict(group=8, _test_lookahead=8)])
def test_explicit_options_leave_the_phased_rule_out(kw):
    M, P, hidden, N = 8192, 8192, 14336, 8192
    c = ChainedFFNCompute(**kw)
    assert c.phased_for(M, P, hidden, N, 132) is None
    assert ChainedFFNCompute().phased_for(M, P, hidden, N, 132) is not None
    s = c.schedule(M, P, hidden, N, 132)
    want = schedule_for(M, P, hidden, N, 132, group=c.group_for(M, P, hidden, N, 132),
                        patch=c.patch_for(M, P, hidden, N, 132),
                        lookahead=kw.get("_test_lookahead"), cluster=c.cluster,
                        split=c.split)
    assert s.tiles() == want.tiles()


@pytest.mark.parametrize("M", [8192, 7000, 32768])
def test_phased_choice_is_a_valid_order(M):
    """Every tile once; ``simulate`` raises where a GEMM2 tile comes before its block's GEMM1
    tiles or a ring slot's GEMM1 before the GEMM2 tiles of the block it evicts (the kernel's
    waits would deadlock or overwrite H); also at an M inside a bucket (7000: 55 of 64 blocks)."""
    from moe_overlap.ffn.chained_schedule import GEMM1, GEMM2
    s = auto_phased(M, 8192, 14336, 8192, 132)
    tiles = s.tiles()
    want = {(GEMM1, b, j) for b in range(s.blocks) for j in range(s.h_tiles)} | \
        {(GEMM2, b, n) for b in range(s.blocks) for n in range(s.n_tiles)}
    assert len(tiles) == len(set(tiles)) and set(tiles) == want
    simulate(s)


HEADLINES = [RESULTS / n for n in ("ffn_chained_compute_h100_auto_phased_0792106.json",
                                   "ffn_chained_compute_h200_auto_phased_918b75d.json")]


@pytest.mark.parametrize("path", HEADLINES, ids=lambda p: p.name)
def test_headline_ran_the_rule_as_committed(path):
    """The headline files (the rule's sustained rate on both cards) ran the order the rule
    picks today at every point (group, ring, split), and that order kept the compute goal
    (>= 0.95x sustained) and the activation bound (<= 0.6x the in-place baseline where
    hidden >= N, never above it)."""
    doc = json.loads(path.read_text())
    assert doc["groups"] == ["auto"] and doc["baseline_act_in_place"]
    assert len({(r["shape"], r["tokens"]) for r in doc["rows"]}) == 14
    for r in doc["rows"]:
        M, P, hidden, N = r["tokens"], r["P"], r["hidden_slice"], r["N"]
        v = r["variants"]["auto"]
        c = ChainedFFNCompute()
        s = c.schedule(M, P, hidden, N, v["grid"])
        split = getattr(getattr(s, "base", s), "split", None)
        assert (c.group_for(M, P, hidden, N, v["grid"]), s.ring, split) == \
            (v["group_run"], v["ring"], v["split"]), (r["shape"], M)
        assert v["hold_speedup"] >= 0.95, (r["shape"], M)
        base = baseline_activation_bytes(M, hidden, N)
        assert v["activation_mem"] <= base, (r["shape"], M)
        if hidden >= N:
            assert v["activation_mem"] <= ACTIVATION_CAP * base, (r["shape"], M)
