"""Planner: a plainly written pure-Python planner, property tests against it, and invariants."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_overlap.combine.plan import plan_combine, recv_rows


def python_plan(counts, rank, tile_m, mgb):
    """The plan written with loops, straight from the specification."""
    W = len(counts)
    E = len(counts[0])
    El = E // W
    order = [s for s in range(W) if s != rank] + [rank]
    group_row_start = [[0] * W for _ in range(El)]
    expert_rows = []
    for e in range(El):
        row = 0
        for s in order:
            group_row_start[e][s] = row
            c = counts[s][rank * El + e]
            row += -(-c // tile_m) * tile_m
        expert_rows.append(row)
    expert_row_start = [sum(expert_rows[:e]) for e in range(El)]
    bands = []  # dicts in stacked row order
    for e in range(El):
        g = rank * El + e
        for s in order:
            c = counts[s][g]
            recv_off = sum(counts[s][:g])  # rows of experts < g in s's receive buffer
            for k in range(-(-c // tile_m)):
                bands.append(dict(expert=e, row=group_row_start[e][s] + k * tile_m,
                                  dest=s, valid=min(tile_m, c - k * tile_m),
                                  dest_row=recv_off + k * tile_m))
    for b in bands:
        b["src_row"] = expert_row_start[b["expert"]] + b["row"]
    remote_bands = [sum(1 for b in bands if b["expert"] == e and b["dest"] != rank)
                    for e in range(El)]
    exp_order = sorted(range(El), key=lambda e: (-remote_bands[e], e))
    schedule = []
    for want_remote in (True, False):
        for e in exp_order:
            schedule += [i for i, b in enumerate(bands)
                         if b["expert"] == e and (b["dest"] != rank) == want_remote]
    remote = [i for i in schedule if bands[i]["dest"] != rank]
    # segments: runs of one (expert, dest); first and last remote band alone; others <= mgb bands
    segments = []  # (start position, count)
    p = 0
    R = len(remote)
    while p < R:
        if p == 0 or p == R - 1:
            segments.append((p, 1))
            p += 1
            continue
        b0 = bands[remote[p]]
        n = 1
        while (n < mgb and p + n < R - 1 and bands[remote[p + n]]["expert"] == b0["expert"]
               and bands[remote[p + n]]["dest"] == b0["dest"]):
            n += 1
        segments.append((p, n))
        p += n
    return dict(group_row_start=group_row_start, expert_rows=expert_rows,
                expert_row_start=expert_row_start, bands=bands, schedule=schedule,
                num_remote=R, segments=segments)


def check_against_python(counts_t, rank, tile_m, mgb, plan):
    counts = counts_t.tolist()
    ref = python_plan(counts, rank, tile_m, mgb)
    nb, nr, ns = plan.counts()
    assert nb == len(ref["bands"])
    assert nr == ref["num_remote"]
    assert plan.group_row_start.tolist() == ref["group_row_start"]
    assert plan.expert_rows.tolist() == ref["expert_rows"]
    assert plan.expert_row_start.tolist() == ref["expert_row_start"]
    t = plan.band_table()
    for i, b in enumerate(ref["bands"]):
        got = {k: t["band_" + k][i] for k in ("expert", "row", "src_row", "dest", "valid",
                                                "dest_row")}
        assert got == b, (i, got, b)
    assert plan.schedule[:nb].tolist() == ref["schedule"]
    assert (plan.schedule[nb:] == -1).all()
    assert ns == len(ref["segments"])
    assert plan.segment_start[:ns].tolist() == [s for s, _ in ref["segments"]]
    assert plan.segment_bands[:ns].tolist() == [n for _, n in ref["segments"]]
    assert (plan.segment_start[ns:] == -1).all() and (plan.band_expert[nb:] == -1).all()


def check_invariants(counts_t, plan):
    W, E = counts_t.shape
    rank, tile_m, El = plan.rank, plan.tile_m, plan.experts_per_rank
    nb, nr, ns = plan.counts()
    t = {k: np.array(v, dtype=np.int64) for k, v in plan.band_table().items()}
    gs = plan.group_row_start.numpy()
    # groups start at multiples of tile_m, remote ranks ascending first, local last
    assert (gs % tile_m == 0).all()
    assert (plan.expert_rows.numpy() % tile_m == 0).all()
    for e in range(El):
        order = [s for s in range(W) if s != rank] + [rank]
        starts = [gs[e, s] for s in order]
        assert starts == sorted(starts)
    assert 0 <= t["band_valid"].min(initial=0) and t["band_valid"].max(initial=0) <= tile_m
    assert int(t["band_valid"].sum()) == int(counts_t[:, rank * El:(rank + 1) * El].sum())
    # schedule is a permutation, remote first, experts in row order
    sched = plan.schedule[:nb].numpy()
    assert sorted(sched.tolist()) == list(range(nb))
    is_remote = t["band_dest"][sched] != rank
    assert is_remote[:nr].all() and not is_remote[nr:].any()
    for e in range(El):
        rows = t["band_row"][sched][t["band_expert"][sched] == e]
        remote_rows = rows[: (t["band_expert"][sched][:nr] == e).sum()]
        assert (np.diff(remote_rows) > 0).all()
    # segments tile the remote schedule; each has one destination, contiguous in y and dest
    seg = {k: getattr(plan, "segment_" + k)[:ns].numpy() for k in
           ("start", "bands", "dest", "src_row", "dest_row", "rows")}
    assert int(seg["bands"].sum()) == nr
    if ns:
        assert seg["start"][0] == 0 and seg["bands"][0] == 1 and seg["bands"][-1] == 1
        assert (seg["bands"] <= max(plan.mgb, 1)).all()
        assert (np.diff(seg["start"]) == seg["bands"][:-1]).all()
    for q in range(ns):
        bs = sched[seg["start"][q]:seg["start"][q] + seg["bands"][q]]
        assert (t["band_dest"][bs] == seg["dest"][q]).all()
        assert (np.diff(t["band_src_row"][bs]) == tile_m).all()
        dest_end = t["band_dest_row"][bs] + t["band_valid"][bs]
        assert (t["band_dest_row"][bs][1:] == dest_end[:-1]).all()  # contiguous at the destination
        assert seg["src_row"][q] == t["band_src_row"][bs[0]]
        assert seg["dest_row"][q] == t["band_dest_row"][bs[0]]
        assert seg["rows"][q] == t["band_valid"][bs].sum()


def all_plans_cover_receive_buffers(counts_t, tile_m, mgb):
    W = counts_t.shape[0]
    recv = counts_t.sum(1).tolist()
    hits = [np.zeros(n, dtype=np.int64) for n in recv]
    for r in range(W):
        p = plan_combine(counts_t, r, tile_m=tile_m, mgb=mgb)
        t = p.band_table()
        for d, row, v in zip(t["band_dest"], t["band_dest_row"], t["band_valid"]):
            hits[d][row:row + v] += 1
    for d in range(W):
        assert (hits[d] == 1).all(), f"receive buffer of rank {d} not covered exactly once"


@st.composite
def counts_strategy(draw):
    W = draw(st.integers(1, 64))
    El = draw(st.integers(1, 16))
    hi = draw(st.sampled_from([0, 3, 70, 300]))
    zero_p = draw(st.floats(0.0, 0.9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    c = g.integers(0, hi + 1, size=(W, W * El))
    c[g.random(c.shape) < zero_p] = 0
    rank = draw(st.integers(0, W - 1))
    tile_m = draw(st.sampled_from([64, 128, 256]))
    mgb = draw(st.integers(1, 4))
    return torch.from_numpy(c), rank, tile_m, mgb


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts_strategy())
def test_plan_matches_python_planner(args):
    counts, rank, tile_m, mgb = args
    plan = plan_combine(counts, rank, tile_m=tile_m, mgb=mgb)
    check_against_python(counts, rank, tile_m, mgb, plan)
    check_invariants(counts, plan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts_strategy())
def test_destination_rows_disjoint_and_cover(args):
    counts, _, tile_m, mgb = args
    if counts.shape[0] > 16:
        counts = counts[:16, : 16 * (counts.shape[1] // counts.shape[0])]
    all_plans_cover_receive_buffers(counts, tile_m, mgb)


def test_capacity_sized_plan_matches_exact_plan():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 500, (4, 16), generator=g)
    exact = plan_combine(counts, 2, tile_m=128, mgb=2)
    roomy = plan_combine(counts, 2, tile_m=128, mgb=2, max_rows=10_000)
    assert roomy.band_capacity > exact.band_capacity
    assert exact.counts() == roomy.counts()
    assert exact.band_table() == roomy.band_table()
    nb, _, ns = exact.counts()
    assert exact.schedule[:nb].tolist() == roomy.schedule[:nb].tolist()
    assert exact.segment_rows[:ns].tolist() == roomy.segment_rows[:ns].tolist()


def test_all_zero_counts_give_an_empty_plan():
    plan = plan_combine(torch.zeros(3, 6, dtype=torch.int32), 1)
    assert plan.counts() == (0, 0, 0)
    assert plan.expert_rows.tolist() == [0, 0]
    assert (plan.schedule == -1).all()


def test_stats_report_padding_and_remote_fraction():
    counts = torch.tensor([[1, 0], [0, 0]])  # one row from rank 0 to expert 0 (rank 0's)
    s = plan_combine(counts, 0, tile_m=64).stats()
    assert s["rows_valid"] == 1 and s["rows_padded"] == 64 and s["padding_overhead"] == 63
    assert s["remote_fraction"] == 0.0
    s1 = plan_combine(torch.tensor([[0, 0], [10, 0]]), 0, tile_m=64).stats()
    assert s1["remote_fraction"] == 1.0 and s1["remote_bands"] == 1


def test_recv_rows_orders_by_expert_then_token_then_k():
    ids = torch.tensor([[3, 1], [1, 0], [3, 0]])
    rows = recv_rows(ids, 4)
    # expert 0: (1,1),(2,1); expert 1: (0,1),(1,0); expert 3: (0,0),(2,0)
    assert rows.tolist() == [[4, 2], [3, 0], [5, 1]]


@pytest.mark.parametrize("bad,exc,msg", [
    (dict(expert_counts=torch.ones(2, 4, dtype=torch.float32)), TypeError, "integer"),
    (dict(expert_counts=torch.ones(2, 5, dtype=torch.int64)), ValueError, "multiple"),
    (dict(expert_counts=torch.ones(4, dtype=torch.int64)), ValueError, "2-D"),
    (dict(rank=2), ValueError, "rank"),
    (dict(rank=-1), ValueError, "rank"),
    (dict(tile_m=96), ValueError, "tile_m"),
    (dict(tile_m=32), ValueError, "tile_m"),
    (dict(mgb=0), ValueError, "mgb"),
    (dict(expert_counts=-torch.ones(2, 4, dtype=torch.int64)), ValueError, "non-negative"),
    (dict(max_rows=3), ValueError, "capacity"),
])
def test_bad_input_is_rejected(bad, exc, msg):
    kw = dict(expert_counts=torch.ones(2, 4, dtype=torch.int64) * 5, rank=0)
    kw.update(bad)
    with pytest.raises(exc, match=msg):
        plan_combine(**kw)
