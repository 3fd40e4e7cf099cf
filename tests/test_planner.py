"""Planner: a plainly written pure-Python planner, property tests against it, and invariants."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_overlap.combine.plan import plan_combine, recv_rows


def python_plan(counts, rank, tile_m, mgb, layout="aligned", schedule_order="remote_first"):
    """The plan written with loops, straight from the specification (docs/CONTRACTS.md)."""
    W = len(counts)
    E = len(counts[0])
    El = E // W
    order = [s for s in range(W) if s != rank] + [rank]
    pad = lambda c: -(-c // tile_m) * tile_m  # noqa: E731
    if layout == "auto":
        sizes = [[counts[s][rank * El + e] for s in order] for e in range(El)]
        packed_rows = sum(pad(sum(g)) for g in sizes)
        aligned_rows = sum(pad(c) for g in sizes for c in g)
        layout = "packed" if packed_rows < aligned_rows else "aligned"
    group_row_start = [[0] * W for _ in range(El)]
    expert_rows = []
    for e in range(El):
        row = 0
        for s in order:
            group_row_start[e][s] = row
            c = counts[s][rank * El + e]
            row += pad(c) if layout == "aligned" else c
        expert_rows.append(pad(row))
    expert_row_start = [sum(expert_rows[:e]) for e in range(El)]
    bands = []  # dicts in stacked row order
    for e in range(El):
        for k in range(expert_rows[e] // tile_m):
            bands.append(dict(expert=e, row=k * tile_m,
                              src_row=expert_row_start[e] + k * tile_m, cells=[]))
    band_id = {(b["expert"], b["row"] // tile_m): i for i, b in enumerate(bands)}
    for e in range(El):  # cells: a group's rows cut at band boundaries, in row order
        g = rank * El + e
        for s in order:
            c = counts[s][g]
            recv_off = sum(counts[s][:g])  # rows of experts < g in s's receive buffer
            lo = group_row_start[e][s]
            while lo < group_row_start[e][s] + c:
                hi = min(group_row_start[e][s] + c, (lo // tile_m + 1) * tile_m)
                bands[band_id[e, lo // tile_m]]["cells"].append(dict(
                    group=(e, s), dest=s, src_row=expert_row_start[e] + lo, rows=hi - lo,
                    dest_row=recv_off + lo - group_row_start[e][s]))
                lo = hi
    for b in bands:
        b["valid"] = sum(c["rows"] for c in b["cells"])
        b["dest"], b["dest_row"] = b["cells"][0]["dest"], b["cells"][0]["dest_row"]
        b["remote"] = any(c["dest"] != rank for c in b["cells"])
    remote_bands = [sum(1 for b in bands if b["expert"] == e and b["remote"]) for e in range(El)]
    exp_order = sorted(range(El), key=lambda e: (-remote_bands[e], e))
    schedule = []
    if schedule_order == "expert":  # stacked row order: expert by expert, remote rows first
        schedule = list(range(len(bands)))
    else:
        for want_remote in (True, False):
            for e in exp_order:
                schedule += [i for i, b in enumerate(bands)
                             if b["expert"] == e and b["remote"] == want_remote]
    R_bands = sum(b["remote"] for b in bands)
    # (position, cell) in schedule order, then row order inside a band
    cells = [(p, c) for p, i in enumerate(schedule) for c in bands[i]["cells"]]
    remote = [(p, c) for p, c in cells if c["dest"] != rank]
    # segments: runs of one group; first and last remote cell alone; others <= mgb cells
    segments = []
    q = 0
    R = len(remote)
    while q < R:
        n = 1
        if 0 < q < R - 1:
            while (n < mgb and q + n < R - 1
                   and remote[q + n][1]["group"] == remote[q][1]["group"]):
                n += 1
        run = remote[q:q + n]
        segments.append(dict(start=run[0][0], bands=run[-1][0] - run[0][0] + 1,
                             dest=run[0][1]["dest"], src_row=run[0][1]["src_row"],
                             dest_row=run[0][1]["dest_row"],
                             rows=sum(c["rows"] for _, c in run)))
        q += n
    local = [dict(band=schedule[p], src_row=c["src_row"], dest_row=c["dest_row"],
                  rows=c["rows"]) for p, c in cells if c["dest"] == rank]
    return dict(layout=layout, group_row_start=group_row_start, expert_rows=expert_rows,
                expert_row_start=expert_row_start, bands=bands, schedule=schedule,
                num_remote=R_bands, segments=segments, local_cells=local)


def check_against_python(counts_t, rank, tile_m, mgb, plan, layout="aligned",
                         order="remote_first"):
    counts = counts_t.tolist()
    ref = python_plan(counts, rank, tile_m, mgb, layout, order)
    assert plan.order == order
    nb, nr, ns = plan.counts()
    assert int(plan.packed) == (ref["layout"] == "packed")
    assert nb == len(ref["bands"])
    assert nr == ref["num_remote"]
    assert plan.group_row_start.tolist() == ref["group_row_start"]
    assert plan.expert_rows.tolist() == ref["expert_rows"]
    assert plan.expert_row_start.tolist() == ref["expert_row_start"]
    t = plan.band_table()
    for i, b in enumerate(ref["bands"]):
        got = {k: t["band_" + k][i] for k in ("expert", "row", "src_row", "dest", "valid",
                                                "dest_row")}
        assert got == {k: b[k] for k in got}, (i, got, b)
    assert plan.schedule[:nb].tolist() == ref["schedule"]
    assert (plan.schedule[nb:] == -1).all()
    assert ns == len(ref["segments"])
    for k in ("start", "bands", "dest", "src_row", "dest_row", "rows"):
        assert getattr(plan, "segment_" + k)[:ns].tolist() == [g[k] for g in ref["segments"]], k
    nl = int(plan.num_local_cells)
    assert nl == len(ref["local_cells"])
    for k in ("band", "src_row", "dest_row", "rows"):
        assert getattr(plan, "local_cell_" + k)[:nl].tolist() == \
            [c[k] for c in ref["local_cells"]], k
    assert (plan.segment_start[ns:] == -1).all() and (plan.band_expert[nb:] == -1).all()
    assert (plan.local_cell_band[nl:] == -1).all()


def row_owners(counts_t, plan):
    """Source rank of every row of the stacked input (-1: padding)."""
    W = counts_t.shape[0]
    El, rank = plan.experts_per_rank, plan.rank
    owner = np.full(int(plan.total_rows), -1, dtype=np.int64)
    gs, rs = plan.group_row_start.numpy(), plan.expert_row_start.numpy()
    for e in range(El):
        for s in range(W):
            c = int(counts_t[s, rank * El + e])
            owner[rs[e] + gs[e, s]: rs[e] + gs[e, s] + c] = s
    return owner


def check_invariants(counts_t, plan):
    W, E = counts_t.shape
    rank, tile_m, El = plan.rank, plan.tile_m, plan.experts_per_rank
    nb, nr, ns = plan.counts()
    t = {k: np.array(v, dtype=np.int64) for k, v in plan.band_table().items()}
    gs = plan.group_row_start.numpy()
    order = [s for s in range(W) if s != rank] + [rank]
    # groups: remote ranks ascending first, local last; aligned: at multiples of tile_m, packed:
    # back to back; only each expert is padded to a multiple of tile_m
    assert (plan.expert_rows.numpy() % tile_m == 0).all()
    for e in range(El):
        starts = [gs[e, s] for s in order]
        assert starts == sorted(starts) and starts[0] == 0
        sizes = [int(counts_t[s, rank * El + e]) for s in order]
        if int(plan.packed):
            assert all(starts[j + 1] == starts[j] + sizes[j] for j in range(W - 1))
        else:
            assert all(x % tile_m == 0 for x in starts)
        assert plan.expert_rows[e] >= starts[-1] + sizes[-1]
        assert plan.expert_rows[e] - (starts[-1] + sizes[-1]) < tile_m or sizes == [0] * W
    assert 0 <= t["band_valid"].min(initial=0) and t["band_valid"].max(initial=0) <= tile_m
    assert int(t["band_valid"].sum()) == int(counts_t[:, rank * El:(rank + 1) * El].sum())
    owner = row_owners(counts_t, plan)
    assert (t["band_src_row"] == np.arange(nb) * tile_m).all()  # bands are stacked row tiles
    # schedule is a permutation; remote_first: bands holding any remote row first, experts in
    # row order; expert: stacked row order (each expert's bands together, remote rows first)
    sched = plan.schedule[:nb].numpy()
    assert sorted(sched.tolist()) == list(range(nb))
    band_owners = owner[: nb * tile_m].reshape(nb, tile_m) if nb else np.zeros((0, tile_m))
    has_remote = ((band_owners >= 0) & (band_owners != rank)).any(1)
    assert int(has_remote.sum()) == nr
    if plan.order == "expert":
        assert sched.tolist() == list(range(nb))
        for e in range(El):  # inside an expert, no band with remote rows after one without
            h = has_remote[t["band_expert"] == e]
            assert not (np.diff(h.astype(np.int64)) > 0).any()
    else:
        assert has_remote[sched][:nr].all() and not has_remote[sched][nr:].any()
    for e in range(El):
        rows = t["band_row"][sched][t["band_expert"][sched] == e]
        assert (np.diff(rows) > 0).all()  # an expert's bands in row order, in either order
    # segments: every remote row of y shipped exactly once, local and padding rows never; one
    # destination each, contiguous in y and at the destination; bands named are those it covers
    seg = {k: getattr(plan, "segment_" + k)[:ns].numpy() for k in
           ("start", "bands", "dest", "src_row", "dest_row", "rows")}
    shipped = np.zeros(owner.size, dtype=np.int64)
    if ns:
        # the first remote band ships first (remote_first: schedule position 0)
        assert seg["start"][0] == int(np.argmax(has_remote[sched])) and seg["rows"].min() > 0
        assert (np.diff(seg["start"]) >= 0).all()
    for q in range(ns):
        r0, n = seg["src_row"][q], seg["rows"][q]
        shipped[r0:r0 + n] += 1
        assert (owner[r0:r0 + n] == seg["dest"][q]).all() and seg["dest"][q] != rank
        bs = sched[seg["start"][q]:seg["start"][q] + seg["bands"][q]]
        assert bs.tolist() == list(range(r0 // tile_m, (r0 + n - 1) // tile_m + 1))
        assert seg["bands"][q] <= max(plan.mgb, 1)
    assert (shipped == ((owner >= 0) & (owner != rank))).all()
    # local cells: every local row once, one band each, in schedule order
    nl = int(plan.num_local_cells)
    lc = {k: getattr(plan, "local_cell_" + k)[:nl].numpy() for k in
          ("band", "src_row", "dest_row", "rows")}
    copied = np.zeros(owner.size, dtype=np.int64)
    for q in range(nl):
        r0, n = lc["src_row"][q], lc["rows"][q]
        copied[r0:r0 + n] += 1
        assert r0 // tile_m == (r0 + n - 1) // tile_m == lc["band"][q]
    assert (copied == (owner == rank)).all()
    pos = np.empty(nb, dtype=np.int64)
    pos[sched] = np.arange(nb)
    assert (np.diff(pos[lc["band"]]) > 0).all()


def all_plans_cover_receive_buffers(counts_t, tile_m, mgb, layout="aligned",
                                    order="remote_first"):
    """Segments and local cells of all ranks' plans write every receive row exactly once."""
    W = counts_t.shape[0]
    recv = counts_t.sum(1).tolist()
    hits = [np.zeros(n, dtype=np.int64) for n in recv]
    for r in range(W):
        p = plan_combine(counts_t, r, tile_m=tile_m, mgb=mgb, layout=layout, order=order)
        ns, nl = p.counts()[2], int(p.num_local_cells)
        for d, row, v in zip(p.segment_dest[:ns].tolist(), p.segment_dest_row[:ns].tolist(),
                             p.segment_rows[:ns].tolist()):
            hits[d][row:row + v] += 1
        for row, v in zip(p.local_cell_dest_row[:nl].tolist(), p.local_cell_rows[:nl].tolist()):
            hits[r][row:row + v] += 1
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
    for layout in ("aligned", "packed", "auto"):
        for order in ("remote_first", "expert"):
            plan = plan_combine(counts, rank, tile_m=tile_m, mgb=mgb, layout=layout,
                                order=order)
            check_against_python(counts, rank, tile_m, mgb, plan, layout, order)
            check_invariants(counts, plan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts_strategy())
def test_destination_rows_disjoint_and_cover(args):
    counts, _, tile_m, mgb = args
    if counts.shape[0] > 16:
        counts = counts[:16, : 16 * (counts.shape[1] // counts.shape[0])]
    for layout in ("aligned", "packed"):
        for order in ("remote_first", "expert"):
            all_plans_cover_receive_buffers(counts, tile_m, mgb, layout, order)


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
    (dict(order="fastest"), ValueError, "order"),
    (dict(order="expert", impl="kernel"), ValueError, "CUDA"),  # CPU counts; either order
    (dict(order="expert", impl="fastest"), ValueError, "impl"),
])
def test_bad_input_is_rejected(bad, exc, msg):
    kw = dict(expert_counts=torch.ones(2, 4, dtype=torch.int64) * 5, rank=0)
    kw.update(bad)
    with pytest.raises(exc, match=msg):
        plan_combine(**kw)


def test_expert_order_is_the_same_plan_in_another_order():
    """order="expert" changes the schedule (and the positions that name it) only: the layout,
    the bands and the rows every segment and local cell moves are those of remote_first."""
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 300, (4, 32), generator=g)
    for layout in ("aligned", "packed"):
        a = plan_combine(counts, 1, tile_m=128, mgb=2, layout=layout)
        b = plan_combine(counts, 1, tile_m=128, mgb=2, layout=layout, order="expert")
        assert a.band_table() == b.band_table() and a.counts()[:2] == b.counts()[:2]
        nb = a.counts()[0]
        assert b.schedule[:nb].tolist() == list(range(nb)) != a.schedule[:nb].tolist()

        def moves(p):
            ns, nl = p.counts()[2], int(p.num_local_cells)
            seg = {(d, s, r, n) for d, s, r, n in zip(
                p.segment_dest[:ns].tolist(), p.segment_src_row[:ns].tolist(),
                p.segment_dest_row[:ns].tolist(), p.segment_rows[:ns].tolist())}
            rows = sorted((s, n) for _, s, _, n in seg)
            loc = sorted(zip(p.local_cell_src_row[:nl].tolist(),
                             p.local_cell_rows[:nl].tolist()))
            return sum(n for _, n in rows), loc
        assert moves(a) == moves(b)


# ---- the counts fingerprint: the call's identity in the epoch tags (issue 35, skipped call) --
def _fp(counts) -> int:
    """The plan's fingerprint as an unsigned 32-bit int (the torch planner's)."""
    from moe_overlap.combine.plan import counts_fingerprint_torch
    return int(counts_fingerprint_torch(counts)) & 0xFFFFFFFF


def _random_counts(g, W, E, hi=3000):
    return torch.randint(0, hi, (W, E), generator=g)


def test_counts_fingerprint_torch_equals_plain_python_and_every_ranks_plan():
    """The torch planner's fingerprint equals the plain-Python reference (plan_closed_form,
    which the kernel's closed forms return too), for int32 and int64 counts alike (the low
    word of each entry), and every rank's plan of one call holds the same value."""
    from moe_overlap.combine.plan_closed_form import counts_fingerprint
    g = torch.Generator().manual_seed(11)
    for W, El in [(1, 1), (2, 4), (3, 5), (8, 16), (16, 2)]:
        for hi in (2, 3000, 2 ** 31 - 1):
            c = _random_counts(g, W, W * El, hi)
            want = counts_fingerprint(c)
            assert _fp(c) == _fp(c.to(torch.int32)) == want
        c = _random_counts(g, W, W * El)  # plannable sizes
        plans = [plan_combine(c, r, tile_m=64, mgb=2) for r in range(W)]
        got = {int(p.counts_fingerprint) & 0xFFFFFFFF for p in plans}
        assert got == {counts_fingerprint(c)}, (W, El, got)
        assert all(p.counts_fingerprint.dtype == torch.int32 and
                   tuple(p.counts_fingerprint.shape) == (1,) for p in plans)
    # entries past 32 bits: only the low word counts (what the kernel loads of int64 counts)
    c = _random_counts(g, 2, 4)
    assert _fp(c + (c % 2) * (1 << 32)) == _fp(c)


def test_counts_fingerprint_tells_every_single_entry_change_apart():
    """The stated property: counts that differ in exactly one entry (as 32-bit words) never
    share a fingerprint (per entry the term is a bijection of the entry). Checked on random
    changes, among them 0 <-> large and +-1, with both implementations."""
    from moe_overlap.combine.plan_closed_form import counts_fingerprint
    g = torch.Generator().manual_seed(12)
    rng = np.random.default_rng(12)
    for trial in range(300):
        W = int(rng.choice([1, 2, 4, 8]))
        E = W * int(rng.integers(1, 9))
        c = _random_counts(g, W, E, int(rng.choice([2, 50, 3000])))
        s, e = int(rng.integers(W)), int(rng.integers(E))
        d = c.clone()
        d[s, e] = int(rng.choice([c[s, e] + 1, max(int(c[s, e]) - 1, 0) if c[s, e] else 7,
                                  0 if c[s, e] else 1 << 20, int(rng.integers(0, 2 ** 32))]))
        d[s, e] = d[s, e] & 0xFFFFFFFF
        assert d[s, e] != c[s, e]
        assert _fp(d) != _fp(c), (trial, s, e, int(c[s, e]), int(d[s, e]))
        assert counts_fingerprint(d) != counts_fingerprint(c)


def test_counts_fingerprint_tells_moved_rows_apart():
    """Where rows moved (two entries swapped, two ranks' rows swapped): the same row totals,
    other routings, other fingerprints (a plain sum of the counts could not tell these)."""
    g = torch.Generator().manual_seed(13)
    seen = set()
    for _ in range(100):
        c = _random_counts(g, 4, 16)
        a = c.clone()
        a[0, 0], a[0, 1] = c[0, 1], c[0, 0]
        b = c[[1, 0, 2, 3]]
        for x in (a, b):
            if not torch.equal(x, c):
                assert _fp(x) != _fp(c)
        seen.add(_fp(c))
    assert len(seen) == 100  # no two of these routings collide either


def test_the_skipped_calls_routings_have_different_fingerprints():
    """tests/test_ranks_faults_gpu.py's skip: rank 0 skips call 1 (case 1: 200 tokens a rank,
    seed 2) and makes call 2 (case 2: 40 tokens, seed 3) at the epoch where rank 1 makes call 1.
    Rank 1 sent rank 0 more rows in call 1 than call 2 needs (the counter wait passes), the
    epochs are equal; the fingerprints of the two routings must differ so rank 0's
    scale records ERR_EPOCH_MISMATCH instead of reading another routing's rows."""
    from moe_overlap.kernels import errors as Er
    from moe_overlap.routing import routing_counts
    E, TOPK, El = 8, 2, 4
    cases = [routing_counts(2, T, E, TOPK, "moderate_skew", seed)
             for T, seed in ((150, 1), (200, 2), (40, 3), (40, 4))]
    rows_1_to_0 = [int(c[1, 0:El].sum()) for c in cases]
    assert rows_1_to_0[1] >= rows_1_to_0[2]  # the case the GPU test is about
    fps = [_fp(c) for c in cases]
    assert len(set(fps)) == len(fps), fps
    # what rank 0's scale compares at that epoch: its own tag (call 2's plan) against rank 1's
    # (call 1's plan), both at the same epoch
    epoch = 6
    plans = {(r, i): plan_combine(cases[i], r, tile_m=128, mgb=2, max_rows=2 * 256 * TOPK,
                                  validate=False) for r in (0, 1) for i in (1, 2)}
    own = Er.call_tag(epoch, int(plans[0, 2].counts_fingerprint))
    src = Er.call_tag(epoch, int(plans[1, 1].counts_fingerprint))
    assert Er.call_tags_differ(src, own)
    # in step (both ranks at call 1): equal tags
    assert not Er.call_tags_differ(Er.call_tag(epoch, int(plans[1, 1].counts_fingerprint)),
                                   Er.call_tag(epoch, int(plans[0, 1].counts_fingerprint)))
