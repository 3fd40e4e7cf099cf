"""CPU tests of the token-ordered scale's reference (moe_overlap/combine/ordered_scale.py): the
row -> signal map against a loop-written one, the tiles' order and dependency lists, the
per-segment expectations, and the simulator's queue."""
import pytest
import torch

from moe_overlap.combine import ordered_scale as osc
from moe_overlap.combine.ordered_scale import LOCAL, REMOTE
from moe_overlap.routing import route

CASES = [  # W, T, E, k, tile_m, mgb, layout, mode
    (2, 300, 16, 4, 64, 2, "aligned", "balanced"),
    (2, 300, 16, 4, 64, 1, "packed", "stress_skew"),
    (4, 200, 16, 2, 64, 2, "packed", "moderate_skew"),
    (4, 150, 8, 3, 128, 1, "aligned", "balanced"),
]


def world(W, T, E, k, mode, seed=0):
    ids = [route(T, E, k, mode, seed=seed, rank=r)[0] for r in range(W)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    return ids, counts


def loop_deps(ids, counts, o, plans):
    """Row dependencies written with loops: walk the receive buffer in (expert, token, k) order;
    a remote row's segment is the sender's segment to o whose range holds it, a local row's band
    is its y row // tile_m."""
    W, E = counts.shape
    El = E // W
    T, k = ids.shape
    flat = [(int(ids[t, j]), t, j) for t in range(T) for j in range(k)]
    order = sorted(flat)  # expert, token, k
    recv = {(t, j): r for r, (_, t, j) in enumerate(order)}
    first = {}
    for r, (g, _, _) in enumerate(order):
        first.setdefault(g, r)
    out = {}
    for (g, t, j) in flat:
        r, s = recv[(t, j)], g // El
        if s != o:
            p = plans[s]
            ns = int(p.num_segments)
            hits = [i for i in range(ns) if int(p.segment_dest[i]) == o
                    and int(p.segment_dest_row[i]) <= r
                    < int(p.segment_dest_row[i]) + int(p.segment_rows[i])]
            assert len(hits) == 1
            out[(t, j)] = (REMOTE, s, hits[0], r)
        else:
            p, e = plans[o], g - o * El
            y = int(p.expert_row_start[e]) + int(p.group_row_start[e, o]) + r - first[g]
            out[(t, j)] = (LOCAL, o, y // p.tile_m, y)
    return out


@pytest.mark.parametrize("order", ["remote_first", "expert"])
@pytest.mark.parametrize("W,T,E,k,tile_m,mgb,layout,mode", CASES)
def test_row_dependencies_match_loops_and_cover_segments(W, T, E, k, tile_m, mgb, layout, mode,
                                                         order):
    ids, counts = world(W, T, E, k, mode)
    plans = osc.sender_plans(counts, tile_m, mgb, layout, order=order)
    assert all(p.order == order for p in plans)
    El = E // W
    for o in range(W):
        d = osc.row_dependencies(ids[o], counts, o, plans)
        ref = loop_deps(ids[o], counts, o, plans)
        for (t, j), want in ref.items():
            got = (int(d.kind[t, j]), int(d.source[t, j]), int(d.index[t, j]), int(d.row[t, j]))
            assert got == want, (o, t, j)
        # every row of every segment to o is one of o's assignments (exact cover), and nothing
        # maps to a segment to another rank
        for s in range(W):
            if s == o:
                continue
            p = plans[s]
            ns = int(p.num_segments)
            m = (d.kind == REMOTE) & (d.source == s)
            per_seg = torch.bincount(d.index[m], minlength=ns)
            for i in range(ns):
                want = int(p.segment_rows[i]) if int(p.segment_dest[i]) == o else 0
                assert int(per_seg[i]) == want, (o, s, i)
        # a local row lies in a valid band of its own expert, and local y rows are distinct
        p = plans[o]
        loc = d.kind == LOCAL
        bands = d.index[loc]
        assert bool((p.band_expert.long()[bands] == ids[o][loc] - o * El).all())
        assert bool((p.band_valid.long()[bands] > 0).all())
        assert d.row[loc].unique().numel() == int(loc.sum())


def test_row_dependencies_refuse_mismatched_inputs():
    ids, counts = world(2, 64, 8, 2, "balanced")
    plans = osc.sender_plans(counts, 64, 1, "packed")
    with pytest.raises(ValueError, match="plans of all 2"):
        osc.row_dependencies(ids[0], counts, 0, plans[:1])
    with pytest.raises(ValueError, match="do not match"):
        osc.row_dependencies(ids[1], counts, 0, plans)
    with pytest.raises(ValueError, match="out of range"):
        osc.row_dependencies(ids[0], counts, 2, plans)


@pytest.mark.parametrize("W,T,E,k,tile_m,mgb,layout,mode", CASES)
def test_seg_expected_inc_is_what_each_sender_ships_to_the_owner(W, T, E, k, tile_m, mgb,
                                                                   layout, mode):
    ids, counts = world(W, T, E, k, mode)
    plans = osc.sender_plans(counts, tile_m, mgb, layout)
    El = E // W
    for o in range(W):
        inc = osc.seg_expected_inc(plans, o)
        assert inc.shape == (W, max(p.segment_capacity for p in plans))
        assert int(inc[o].abs().sum()) == 0
        for s in range(W):
            if s != o:  # rows o receives back from s: its assignments to s's experts
                assert int(inc[s].sum()) == int(counts[o, s * El:(s + 1) * El].sum())
    assert int(plans[1].num_segments) > 0
    with pytest.raises(ValueError, match="capacity"):
        osc.seg_expected_inc(plans, 0, capacity=0)


@pytest.mark.parametrize("tile_tokens", [1, 7, 32])
@pytest.mark.parametrize("W,T,E,k,tile_m,mgb,layout,mode", CASES[:3])
def test_token_tiles_order_and_dependencies(W, T, E, k, tile_m, mgb, layout, mode, tile_tokens):
    ids, counts = world(W, T, E, k, mode)
    plans = osc.sender_plans(counts, tile_m, mgb, layout)
    model = osc.ScaleModel()
    flows = [osc.flow_times(p, 1024, 512, 8, model) for p in plans]
    o = W - 1
    d = osc.row_dependencies(ids[o], counts, o, plans)
    times = osc.dependency_times(d, o, [f[0] for f in flows], [f[1] for f in flows])
    assert bool(torch.isfinite(times).all())
    tiles = osc.token_tiles(d, times, tile_tokens)
    # every token scheduled exactly once
    assert torch.equal(torch.sort(tiles.order).values, torch.arange(T))
    assert int(tiles.tile_start[-1]) == T
    sizes = tiles.tile_start[1:] - tiles.tile_start[:-1]
    assert bool((sizes[:-1] == tile_tokens).all()) and 1 <= int(sizes[-1]) <= tile_tokens
    done = times.max(1).values
    prev_max = -1.0
    for j in range(tiles.num_tiles):
        tok = tiles.order[tiles.tile_start[j]:tiles.tile_start[j + 1]]
        # order consistent: no token of a later tile completes before one of an earlier tile;
        # equal times keep token order; the key is the tile's last completion
        assert float(done[tok].min()) >= prev_max
        prev_max = float(done[tok].max())
        assert float(tiles.key[j]) == prev_max
        same = done[tok] == done[tok][0]
        if bool(same.all()):
            assert bool((tok[1:] > tok[:-1]).all())
        # the dependency list is exactly the set of signals of the tile's rows
        want = {(int(a), int(b), int(c)) for a, b, c in zip(d.kind[tok].reshape(-1),
                                                            d.source[tok].reshape(-1),
                                                            d.index[tok].reshape(-1))}
        a, b = int(tiles.dep_start[j]), int(tiles.dep_start[j + 1])
        got = list(zip(tiles.dep_kind[a:b].tolist(), tiles.dep_source[a:b].tolist(),
                       tiles.dep_index[a:b].tolist()))
        assert len(got) == len(set(got)) and set(got) == want
        for s in range(W):
            segs = [i for kk, ss, i in got if kk == REMOTE and ss == s]
            assert int(tiles.max_segment[j, s]) == (max(segs) if segs else -1)
        # the tile's key is the time of its latest dependency
        assert float(tiles.key[j]) == float(times[tok].max())
    assert bool((tiles.key[1:] >= tiles.key[:-1]).all())
    with pytest.raises(ValueError, match="tile_tokens"):
        osc.token_tiles(d, times, 0)


def test_run_queue_hand_cases():
    q = osc._run_queue
    # one phase at 1 byte/s from t=1: tiles available at 0 and 5, 2 bytes each
    assert q([0.0, 5.0], [2.0, 2.0], [(1.0, 1.0)]) == pytest.approx(7.0)
    # rate changes mid-tile: 1 B/s from 0, 4 B/s from 2; 6 bytes available at 0
    # -> 2 bytes by t=2, 4 left at 4 B/s -> t=3
    assert q([0.0], [6.0], [(0.0, 1.0), (2.0, 4.0)]) == pytest.approx(3.0)
    # a zero-rate phase waits for the next one
    assert q([0.0], [4.0], [(0.0, 0.0), (3.0, 2.0)]) == pytest.approx(5.0)
    # a tile waiting for its key past the backlog
    assert q([0.0, 10.0], [1.0, 1.0], [(0.0, 1.0)]) == pytest.approx(11.0)


def test_flow_times_follow_the_schedule():
    ids, counts = world(2, 400, 16, 4, "balanced")
    plans = osc.sender_plans(counts, 64, 2, "packed")
    model = osc.ScaleModel(gemm_ms=1.0, ship_gbps=100.0, begin_us=0.0)
    band_done, seg_arr, gemm_end, ship_end = osc.flow_times(plans[0], 256, 256, 8, model)
    nb, _, ns = plans[0].counts()
    sched = plans[0].schedule[:nb].long()
    assert bool((band_done[sched][1:] > band_done[sched][:-1]).all())
    assert gemm_end == pytest.approx(1e-3) and float(band_done[sched[-1]]) == pytest.approx(1e-3)
    assert bool((seg_arr[1:] > seg_arr[:-1]).all()) and ship_end == float(seg_arr[-1])
    last = plans[0].schedule.long()[plans[0].segment_start[:ns].long()
                                    + plans[0].segment_bands[:ns].long() - 1]
    assert bool((seg_arr > band_done[last]).all())  # a segment leaves after its last band


@pytest.mark.parametrize("ccta", [4, 16])
def test_simulate_orders_the_designs(ccta):
    ids, counts = world(2, 512, 16, 4, "balanced")
    r = osc.simulate(ids, counts, N=1024, K=512, ccta=ccta, tile_m=64, mgb=2, tile_tokens=16)
    lo = max(r["gemm_end"], r["ship_end"])
    # B has at least A's rate at every time, A starts no later than today's scale
    assert lo <= r["B"] + 1e-12 and r["B"] <= r["A"] + 1e-12 and r["A"] <= r["today"] + 1e-12
    assert r["today"] == pytest.approx(max(r["gemm_end"], r["last_arrival"]) + 5e-3
                                       + r["scale_full"])
    # an infinitely fast scale leaves only the latency after the last signal
    fast = osc.ScaleModel(scale_tbs=1e9, worker_gbps_per_sm=1e12)
    f = osc.simulate(ids, counts, N=1024, K=512, ccta=ccta, tile_m=64, mgb=2, tile_tokens=16,
                     model=fast)
    assert f["A"] == pytest.approx(max(f["gemm_end"] + 5e-3, f["last_arrival"]), rel=1e-6,
                                   abs=1e-6)


def test_completion_keys_are_integer_buckets_in_schedule_order():
    """The tile order's key: (position * KEY_BUCKETS) // count, an int64 in [0, KEY_BUCKETS),
    non-decreasing along the owner's schedule and along each sender's segments."""
    from moe_overlap.combine.ordered_scale import (KEY_BUCKETS, completion_keys,
                                                   row_dependencies, sender_plans)
    W, E, T, k = 4, 16, 400, 4
    ids = [route(T, E, k, "moderate_skew", seed=3, rank=r)[0] for r in range(W)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plans = sender_plans(counts, tile_m=64, mgb=2)
    rank = 1
    deps = row_dependencies(ids[rank], counts, rank, plans)
    key = completion_keys(deps, plans, rank)
    assert key.dtype == torch.int64
    assert bool((key >= 0).all()) and bool((key < KEY_BUCKETS).all())
    p = plans[rank]
    nb = int(p.num_bands)
    pos = {int(b): i for i, b in enumerate(p.schedule[:nb])}
    loc = deps.kind == LOCAL
    for b, kk in zip(deps.index[loc].tolist(), key[loc].tolist()):
        assert kk == pos[b] * KEY_BUCKETS // nb
    rem = deps.kind == REMOTE
    for s, i, kk in zip(deps.source[rem].tolist(), deps.index[rem].tolist(), key[rem].tolist()):
        assert kk == i * KEY_BUCKETS // int(plans[s].num_segments)
    assert bool(loc.any()) and bool(rem.any())
