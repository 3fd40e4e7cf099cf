"""CPU checks of the producer's band groups cut at expert boundaries (GroupedGemm(group_by=
"expert"), moe_overlap/combine/band_groups.py): the torch builder against a plain-Python
statement of the rule (seeded random schedules, and schedules of the planner on model-shaped
routings), the rule's properties (a partition of the schedule, groups <= G, a run of one expert
never split unless longer than G and then into equal pieces, runs of different experts only
packed whole inside one aligned window), the scheduler walk over the tables (every (position,
n tile) once, cluster pairs kept), the fault fields and the option checks. No GPU, no CuTe DSL.
"""
import random

import pytest
import torch

from moe_overlap.combine.band_groups import (MAX_GROUP, band_groups, band_groups_torch,
                                             check_group)
from moe_overlap.combine.grouped_gemm import GroupedGemm, tile_order_reference
from moe_overlap.combine.options import CombineOptions
from moe_overlap.combine.plan import plan_combine
from moe_overlap.kernels import errors as E

i32 = dict(dtype=torch.int32)


def _t(v):
    return torch.tensor(v, **i32)


# ---- the rule in plain Python (sets of runs, no scans) ------------------------------------
def _runs(schedule, band_expert, nb):
    """[(start, end)] runs of one expert along the schedule; a position whose entry is outside
    [0, nb) is a run of its own."""
    def key(p):
        b = schedule[p]
        return ("band", band_expert[b]) if 0 <= b < nb else ("bad", p)
    runs, p = [], 0
    while p < nb:
        q = p + 1
        while q < nb and key(q) == key(p):
            q += 1
        runs.append((p, q))
        p = q
    return runs


def plain_groups(schedule, band_expert, nb, G):
    cap = len(schedule)
    if not 0 <= nb <= cap:
        nb = 0
    first, size = [-1] * cap, [-1] * cap
    runs = _runs(schedule, band_expert, nb)
    for a, e in runs:
        L = e - a
        if L > G:  # k pieces, the i-th from a + ceil(i L / k)
            k = -(-L // G)
            bd = [a + -(-i * L // k) for i in range(k + 1)]
            groups = list(zip(bd[:-1], bd[1:]))
        elif a // G == (e - 1) // G:  # inside its window: with every run inside that window
            w = a // G
            inside = [(x, y) for x, y in runs if x >= w * G and y <= (w + 1) * G]
            groups = [(min(x for x, _ in inside), max(y for _, y in inside))]
        else:  # crosses a window edge: alone
            groups = [(a, e)]
        for lo, hi in groups:
            for q in range(lo, hi):
                first[q], size[q] = lo, hi - lo
    return first, size


def _random_case(rng):
    cap = rng.randint(0, 70)
    nb = rng.randint(0, cap)
    if rng.random() < 0.08:
        nb = rng.choice([-1, cap + 1, -(1 << 30)])
    m = min(max(nb, 0), cap)
    G = rng.choice([1, 2, 3, 4, 5, 8, 8, 8, 16, rng.randint(1, 20)])
    be = [rng.randint(-3, 40)] * cap
    i, e = 0, rng.randint(0, 5)
    while i < cap:  # experts in runs of model-like lengths, the same expert sometimes twice
        L = rng.choice([1, 1, 2, 3, 4, 5, 5, 8, 9, 10, 17, 32, rng.randint(1, 40)])
        for j in range(i, min(cap, i + L)):
            be[j] = e
        e += rng.choice([1, 1, 1, 2, 0])
        i += L
    sched = [-1] * cap
    order = list(range(m))
    if rng.random() < 0.4:
        rng.shuffle(order)
    sched[:m] = order
    for _ in range(rng.choice([0, 0, 0, 1, 3])):  # entries outside [0, nb) (validate=False)
        if m:
            sched[rng.randrange(m)] = rng.choice([-1, -7, nb, nb + 5, 1 << 30])
    return sched, be, nb, G


def _check_properties(first, size, sched, be, nb, G):
    cap = len(sched)
    nbv = nb if 0 <= nb <= cap else 0
    assert first[nbv:] == [-1] * (cap - nbv) and size[nbv:] == [-1] * (cap - nbv)
    runs = _runs(sched, be, nbv)
    run_of = {p: (a, e) for a, e in runs for p in range(a, e)}
    p = 0
    while p < nbv:  # groups in order, each [p, p + size), every entry of it the same
        f, s = first[p], size[p]
        assert f == p and 1 <= s <= G and p + s <= nbv, (p, f, s)
        assert all((first[q], size[q]) == (f, s) for q in range(p, p + s))
        rs = sorted({run_of[q] for q in range(p, p + s)})
        if len(rs) > 1:  # packing: whole runs of <= G positions, inside one aligned window
            assert rs[0][0] == p and rs[-1][1] == p + s
            assert all(e - a <= G for a, e in rs)
            assert p // G == (p + s - 1) // G
        else:
            (a, e), = rs
            L = e - a
            if L <= G:
                assert (a, e) == (p, p + s), "a run of <= G positions was split"
            else:  # one of ceil(L / G) pieces of floor / ceil(L / k)
                k = -(-L // G)
                assert s in (L // k, -(-L // k))
        p += s
    # each run longer than G is cut into exactly ceil(L / G) groups
    for a, e in runs:
        if e - a > G:
            assert len({first[q] for q in range(a, e)}) == -(-(e - a) // G)


def test_torch_builder_matches_the_plain_rule_on_random_schedules():
    rng = random.Random(36)
    for _ in range(1500):
        sched, be, nb, G = _random_case(rng)
        f, s = band_groups_torch(_t(sched), _t(be), _t([nb]), G)
        assert f.dtype == s.dtype == torch.int32
        want = plain_groups(sched, be, nb, G)
        assert (f.tolist(), s.tolist()) == want, (sched, be, nb, G)
        _check_properties(f.tolist(), s.tolist(), sched, be, nb, G)


def _model_counts(W, E, tokens, topk, skew, seed):
    """[W, E] counts of a top-k routing of ``tokens`` per rank: per-expert popularity drawn
    once (skew: a heavy tail, max well above the mean), each rank's assignments multinomial."""
    g = torch.Generator().manual_seed(seed)
    pop = torch.rand(E, generator=g) ** (3.0 if skew else 0.0) + 0.05
    pop = pop / pop.sum()
    return torch.stack([torch.bincount(torch.multinomial(pop, tokens * topk, replacement=True,
                                                         generator=g), minlength=E)
                        for _ in range(W)])


@pytest.mark.parametrize("name,W,E,tokens,topk,skew,order", [
    ("deepseek-v3@16384", 1, 256, 16384, 8, False, "remote_first"),  # 4-5 bands per expert
    ("deepseek-v3@16384 skew", 1, 256, 16384, 8, True, "remote_first"),
    ("deepseek-v3@4096 W8", 8, 256, 4096, 8, True, "remote_first"),  # 1-2 bands per expert
    ("deepseek-v3@4096 W2", 2, 256, 4096, 8, False, "expert"),
    ("qwen3-30b@4096 W2", 2, 128, 4096, 8, True, "remote_first"),
    ("mixtral@16384", 1, 8, 16384, 2, False, "remote_first"),  # 32 bands per expert
    ("mixtral@4096 W2", 2, 8, 4096, 2, True, "expert"),
])
@pytest.mark.parametrize("G", [4, 8, 16])
def test_planner_schedules(name, W, E, tokens, topk, skew, order, G):
    """On the planner's schedules of model-shaped routings (rank 0): the plain rule and its
    properties; every group holds one expert's positions only, or whole runs of <= G."""
    counts = _model_counts(W, E, tokens, topk, skew, seed=len(name) * 7 + G)
    plan = plan_combine(counts, 0, tile_m=128, impl="torch", order=order)
    nb = int(plan.num_bands)
    sched, be = plan.schedule.tolist(), plan.band_expert.tolist()
    f, s = band_groups_torch(plan.schedule, plan.band_expert, plan.num_bands, G)
    f, s = f.tolist(), s.tolist()
    assert (f, s) == plain_groups(sched, be, nb, G)
    _check_properties(f, s, sched, be, nb, G)
    assert nb > 0 and all(0 <= sched[p] < nb for p in range(nb))


def test_fixed_groups_are_the_special_case():
    """Where no run crosses a window edge (1-band experts; 2-, 4-, 8-band experts at aligned
    starts) the tables are exactly today's arithmetic, and the walk over them is today's order."""
    rng = random.Random(5)
    for per in (1, 2, 4, 8):
        for G in (per, 2 * per, 8, 16):
            if G % per:
                continue
            nb = per * rng.randint(1, 30)
            cap = nb + rng.randint(0, 5)
            be = [q // per for q in range(nb)] + [-1] * (cap - nb)
            sched = list(range(nb)) + [-1] * (cap - nb)
            f, s = band_groups_torch(_t(sched), _t(be), _t([nb]), G)
            fixed_f = [p - p % G for p in range(nb)]
            assert f.tolist()[:nb] == fixed_f
            assert s.tolist()[:nb] == [min(G, nb - x) for x in fixed_f]
            for n_tiles, cluster in ((4, 1), (4, 2), (6, 2), (5, 1)):
                assert tile_order_reference(nb, n_tiles, cluster, G, tables=(
                    f.tolist(), s.tolist())) == tile_order_reference(nb, n_tiles, cluster, G)


@pytest.mark.parametrize("L,G,pieces", [(10, 8, [5, 5]), (17, 8, [6, 6, 5]), (9, 8, [5, 4]),
                                        (16, 8, [8, 8]), (8, 8, [8]), (3, 1, [1, 1, 1]),
                                        (33, 16, [11, 11, 11])])
def test_long_runs_split_evenly(L, G, pieces):
    sched = list(range(L))
    f, s = band_groups_torch(_t(sched), _t([0] * L), _t([L]), G)
    got, p = [], 0
    while p < L:
        got.append(s[p].item())
        p += s[p].item()
    assert got == pieces


def test_examples():
    """Hand-checked, G = 8: runs of 3, 3 inside window 0; 3 crossing 8 (alone); 5, 1 inside
    window 1 up to the run of 3 crossing 16 (alone); 2, 3 inside window 2 up to a 10-band
    expert, whose band at position 25 is refused (schedule entry -4): 2 crossing 24 (alone),
    the refused position inside window 3 (alone there), 7 crossing 32 (alone)."""
    be = [0] * 3 + [1] * 3 + [2] * 3 + [3] * 5 + [4] + [5] * 3 + [6] * 2 + [7] * 3 + [8] * 10
    nb = len(be)
    sched = list(range(nb))
    f, s = band_groups_torch(_t(sched), _t(be), _t([nb]), 8)
    groups = sorted({(a, a + b) for a, b in zip(f.tolist(), s.tolist())})
    assert groups == [(0, 6), (6, 9), (9, 15), (15, 18), (18, 23), (23, 28), (28, 33)]
    sched[25] = -4
    f, s = band_groups_torch(_t(sched), _t(be), _t([nb]), 8)
    groups = sorted({(a, a + b) for a, b in zip(f.tolist(), s.tolist())})
    assert groups == [(0, 6), (6, 9), (9, 15), (15, 18), (18, 23), (23, 25), (25, 26), (26, 33)]


def test_num_bands_outside_the_tables_gives_no_group():
    for nb in (-1, 9, 1 << 30):
        f, s = band_groups_torch(_t(list(range(8))), _t([0] * 8), _t([nb]), 8)
        assert f.tolist() == [-1] * 8 and s.tolist() == [-1] * 8


@pytest.mark.parametrize("cluster", [1, 2])
def test_walk_over_the_tables_visits_every_tile_once(cluster):
    """``tile_order_reference(tables=)`` (the mirror of ``BandTileScheduler.walk``): every
    (position, n tile) exactly once, each group's tiles in its own range of t, a cluster's tiles
    one band at adjacent n tiles, and the bands of a group cycling at equal n tiles."""
    rng = random.Random(11 + cluster)
    for _ in range(300):
        sched, be, nb, G = _random_case(rng)
        if not 0 <= nb <= len(sched):
            continue
        f, s = (v.tolist() for v in band_groups_torch(_t(sched), _t(be), _t([nb]), G))
        n_tiles = cluster * rng.randint(1, 5)
        order = tile_order_reference(nb, n_tiles, cluster, G, tables=(f, s))
        assert sorted(order) == [(p, n) for p in range(nb) for n in range(n_tiles)]
        for t, (p, n) in enumerate(order):
            p0 = t // n_tiles
            assert f[p0] <= p < f[p0] + s[p0]  # inside the group of its range
            if t % cluster == 0:
                assert order[t + cluster - 1] == (p, n + cluster - 1) and n % cluster == 0
            u = t - f[p0] * n_tiles
            assert n // cluster == u // (cluster * s[p0])  # the group's bands at equal n


def test_options_and_argument_checks():
    assert GroupedGemm().group_by == "position"
    g = GroupedGemm(group_by="expert")
    assert g.band_group == 8 and g._key(1024, 512) != GroupedGemm()._key(1024, 512)
    for bad in ("experts", None, 1):
        with pytest.raises(ValueError, match="group_by"):
            GroupedGemm(group_by=bad)
    for bad in (0, MAX_GROUP + 1, True):
        with pytest.raises(ValueError, match="band_group"):
            GroupedGemm(band_group=bad, group_by="expert")
    assert check_group(MAX_GROUP) == MAX_GROUP
    GroupedGemm(band_group=MAX_GROUP + 1)  # fixed groups: no table bound
    # through the combine's options (the switch to time it: gemm_options)
    assert CombineOptions(gemm_options={"group_by": "expert"}).check_gemm_options(128) == {
        "group_by": "expert"}
    with pytest.raises(ValueError, match="group_by"):
        CombineOptions(gemm_options={"group_by": "band"}).check_gemm_options(128)
    # the wrapper's checks of band_groups (before any launch)
    x = torch.zeros(256, 512, dtype=torch.bfloat16)
    w = torch.zeros(2, 512, 1024, dtype=torch.bfloat16)
    y = torch.zeros(256, 1024, dtype=torch.bfloat16)
    v, one = torch.zeros(4, **i32), torch.zeros(1, **i32)
    args = [x, w, y, v, v, v, one, v, one]
    def chk(gemm, bg):
        return gemm._check(*args, band_counter=None, ccta=0, need_cuda=False, band_groups=bg)
    chk(g, (v.clone(), v.clone()))
    with pytest.raises(ValueError, match="group_by='expert'"):
        chk(GroupedGemm(), (v, v))
    for bad in ((v,), (v, torch.zeros(5, **i32)), (v, v.long()), [v, torch.zeros(8, **i32)[::2]]):
        with pytest.raises(ValueError, match="band_groups"):
            chk(g, bad)
    with pytest.raises(ValueError, match="group_by"):
        GroupedGemm().band_groups(v, v, one)
    # the builder's own checks; impl="auto" on the CPU is the torch builder
    f, s = band_groups(_t([1, 0, -1]), _t([0, 0, -1]), _t([2]), 8)
    assert f.tolist() == [0, 0, -1] and s.tolist() == [2, 2, -1]
    with pytest.raises(ValueError, match="int32"):
        band_groups(v.long(), v, one, 8)
    with pytest.raises(ValueError, match="1-D"):
        band_groups(v, torch.zeros(5, **i32), one, 8)
    with pytest.raises(ValueError, match="CUDA"):
        band_groups(v, v, one, 8, impl="kernel")
    with pytest.raises(ValueError, match="impl"):
        band_groups(v, v, one, 8, impl="cuda")


def test_group_fault_fields_are_named():
    assert E.PRF_GROUP_FIRST not in (E.PRF_NUM_BANDS, E.PRF_SCHEDULE, E.PRF_EXPERT,
                                     E.PRF_SRC_ROW)
    for field, needle in ((E.PRF_GROUP_FIRST, "group_first outside [0, schedule position]"),
                          (E.PRF_GROUP_END, "group_first + group_size outside")):
        m = E.describe_error([E.ERR_PRODUCER_BOUNDS, 0, 7, field, -1, 7, 0, 0])
        assert needle in m and "schedule position 7" in m
