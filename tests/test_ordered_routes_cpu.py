"""CPU tests of the ordered scale's device-side preparation (moe_overlap/combine/ordered_routes.py,
``ordered_routes_device``) against its host reference (``ordered_scale.ordered_routes``):

- bitwise the same tables (the valid part; the padding -1), seg_inc and row signals, for W in
  {1, 2, 4, 8}, every layout and order, tile_tokens in {1, 16, 64}, and adversarial routings;
- no host synchronization (tests/no_sync.py; the reference trips the same check) and every
  output's size a function of the input shapes alone (the meta device);
- validate=True raises what the reference raises; validate=False stays in bounds;
- the padded tables drive an emulation of the kernel's claim loop to the exact tables' output,
  and the emulation catches a tile waiting on too little and a read past dep_start;
- OverlapCombine._prepare_ordered: the device path by default, "host" the reference.
"""
import pytest
import torch

from no_sync import HostSyncError, no_host_sync
from moe_overlap.combine import ordered_scale as osc
from moe_overlap.combine.ordered_routes import (ORDERED_IMPLS, ordered_routes_device,
                                                sender_max_rows)
from moe_overlap.combine.ordered_scale import LOCAL, REMOTE
from moe_overlap.combine.plan import band_capacity_for, plan_combine
from moe_overlap.combine.routes import prepare_routes_torch
from moe_overlap.combine.scale import scale_torch
from moe_overlap.routing import route

DEP_ARRAYS = ("dep_kind", "dep_source", "dep_index")


def world(W, T, E, k, mode, seed=0):
    ids = [route(T, E, k, mode, seed=seed, rank=r)[0] for r in range(W)]
    return ids, torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])


def layer_plan(counts, rank, T, k, tile_m, mgb, layout, order):
    """The owner's plan as MoECombine.plan makes it (max_rows = W x max tokens x topk)."""
    W = counts.shape[0]
    return plan_combine(counts, rank, tile_m=tile_m, mgb=mgb, max_rows=W * max(T, 1) * k,
                        layout=layout, impl="torch", order=order)


def assert_same_as_reference(ids, counts, rank, plan, tile_tokens):
    """Device tables == reference tables on the valid part, -1 padding, exact sizes."""
    ref = osc.ordered_routes(ids, counts, rank, plan.tile_m, plan.mgb, plan.layout,
                             plan.segment_capacity, tile_tokens=tile_tokens, order=plan.order)
    got, deps = ordered_routes_device(ids, counts, plan, tile_tokens=tile_tokens,
                                      validate=True, return_deps=True)
    T, k = ids.shape
    t = got.tables
    assert all(v.dtype == torch.int32 and v.is_contiguous() for v in t.values())
    n_tiles = -(-T // tile_tokens)
    assert t["order"].shape == (T,)
    assert t["tile_start"].shape == t["dep_start"].shape == (n_tiles + 1,)
    for n in ("order", "tile_start", "dep_start"):
        assert torch.equal(t[n], ref.tables[n]), n
    nd = int(t["dep_start"][-1])
    for n in DEP_ARRAYS:
        assert t[n].shape == (T * k,), n
        assert torch.equal(t[n][:nd], ref.tables[n]), n
        assert bool((t[n][nd:] == -1).all()), n
    assert got.seg_inc.dtype == torch.int64 and torch.equal(got.seg_inc, ref.seg_inc)
    assert got.seg_count.dtype == torch.int32 and torch.equal(got.seg_count, ref.seg_count)
    assert int(got.seg_count[rank]) == 0 and bool((got.seg_count >= 0).all())
    # past each sender's prefix the torch path is zero (the kernel path leaves it unwritten)
    past = torch.arange(plan.segment_capacity)[None, :] >= got.seg_count.long()[:, None]
    assert int(got.seg_inc[past].abs().sum()) == 0
    want = osc.row_dependencies(ids, counts, rank, osc.sender_plans(
        counts, plan.tile_m, plan.mgb, plan.layout, order=plan.order))
    for f in ("kind", "source", "index", "row"):
        assert torch.equal(getattr(deps, f), getattr(want, f)), f
    return got, ref


# ------------------------------------------------------------------------ bitwise equality
@pytest.mark.parametrize("tile_tokens", [1, 16, 64])
@pytest.mark.parametrize("order", ["remote_first", "expert"])
@pytest.mark.parametrize("layout", ["aligned", "packed", "auto"])
@pytest.mark.parametrize("W,T,E,k,tile_m,mgb,mode", [
    (1, 97, 8, 2, 64, 1, "balanced"),
    (2, 130, 16, 4, 64, 2, "moderate_skew"),
    (4, 100, 16, 2, 128, 1, "stress_skew"),
    (8, 70, 32, 3, 64, 2, "balanced"),
])
def test_device_tables_equal_the_reference(W, T, E, k, tile_m, mgb, mode, layout, order,
                                           tile_tokens):
    ids, counts = world(W, T, E, k, mode, seed=W + tile_tokens)
    for rank in sorted({0, W // 2, W - 1}):
        plan = layer_plan(counts, rank, T, k, tile_m, mgb, layout, order)
        assert_same_as_reference(ids[rank], counts, rank, plan, tile_tokens)


def _adversarial(name, W, T, E, k, rank, seed):
    """(ids of rank, counts [W, E]) of one adversarial routing; the other ranks random."""
    El = E // W
    g = torch.Generator().manual_seed(seed)
    _, counts = world(W, T, E, k, "stress_skew", seed=seed)

    def distinct(cands):  # k distinct experts per token from the candidates [T, c]
        pick = torch.rand(cands.shape, generator=g).argsort(1)[:, :k]
        return torch.gather(cands, 1, pick)
    if name == "empty_experts":  # only the even experts get tokens
        ids = distinct(torch.arange(0, E, 2).expand(T, -1))
    elif name == "hot_expert":  # every token's first choice is expert E - 1 (rank W - 1)
        rest = distinct(torch.arange(E - 1).expand(T, -1))[:, :k - 1]
        ids = torch.cat([torch.full((T, 1), E - 1), rest], 1)
    elif name == "all_to_one_rank":  # every token to the experts of rank (rank + 1) % W
        s = (rank + 1) % W
        ids = distinct(torch.arange(s * El, (s + 1) * El).expand(T, -1))
    elif name == "all_local":
        ids = distinct(torch.arange(rank * El, (rank + 1) * El).expand(T, -1))
    elif name == "no_tokens":
        ids = torch.zeros(0, k, dtype=torch.int64)
    else:
        raise AssertionError(name)
    counts[rank] = torch.bincount(ids.reshape(-1), minlength=E)
    if name == "no_tokens":
        counts[(rank + 1) % W].zero_()  # a sender with no tokens either
    return ids, counts


@pytest.mark.parametrize("layout,order", [("packed", "remote_first"), ("aligned", "expert"),
                                          ("auto", "remote_first")])
@pytest.mark.parametrize("name", ["empty_experts", "hot_expert", "all_to_one_rank", "all_local",
                                  "no_tokens"])
@pytest.mark.parametrize("W,T,tile_tokens", [(2, 77, 16), (4, 50, 64), (8, 33, 1)])
def test_adversarial_routings(name, W, T, tile_tokens, layout, order):
    E, k, tile_m, mgb = 16, 2, 64, 2
    for rank in sorted({0, W - 1}):
        ids, counts = _adversarial(name, W, T, E, k, rank, seed=rank + 5)
        plan = layer_plan(counts, rank, T, k, tile_m, mgb, layout, order)
        got, _ = assert_same_as_reference(ids, counts, rank, plan, tile_tokens)
        if name == "no_tokens":
            assert got.tables["tile_start"].tolist() == [0] and int(got.seg_inc.sum()) == 0


def test_one_token_and_tile_bigger_than_the_tokens():
    ids, counts = world(2, 1, 8, 2, "balanced", seed=1)
    plan = layer_plan(counts, 0, 1, 2, 64, 1, "auto", "remote_first")
    got, _ = assert_same_as_reference(ids[0], counts, 0, plan, 64)
    assert got.tables["tile_start"].tolist() == [0, 1]


# ------------------------------------------------------------------------ no host sync
def _case(W=4, T=120, E=16, k=2, rank=1, order="remote_first"):
    ids, counts = world(W, T, E, k, "stress_skew", seed=2)
    return ids[rank], counts, layer_plan(counts, rank, T, k, 64, 2, "auto", order)


@pytest.mark.parametrize("order", ["remote_first", "expert"])
def test_device_path_makes_no_host_sync(order):
    ids, counts, plan = _case(order=order)
    with no_host_sync() as mode:
        got = ordered_routes_device(ids, counts, plan, validate=False)
    assert {"aten.sort", "aten.scatter_reduce_", "aten.cummax"} <= mode.ops  # it saw the work
    want = ordered_routes_device(ids, counts, plan, validate=True)
    for n, t in want.tables.items():
        assert torch.equal(got.tables[n], t)


def test_the_check_catches_the_host_paths():
    """The same check fails on the reference, on validate=True and on each kind of sync."""
    ids, counts, plan = _case()
    with pytest.raises(HostSyncError):
        with no_host_sync():
            osc.ordered_routes(ids, counts, plan.rank, plan.tile_m, plan.mgb, plan.layout,
                               plan.segment_capacity)
    with pytest.raises(HostSyncError):
        with no_host_sync():
            ordered_routes_device(ids, counts, plan, validate=True)
    x = torch.arange(6)
    for bad in (lambda: x.max().item(), lambda: int(x[0]), lambda: bool(x[1]),
                lambda: x.tolist(), lambda: x[x > 2], lambda: torch.nonzero(x),
                lambda: torch.unique(x), lambda: torch.bincount(x),
                lambda: torch.equal(x, x), lambda: x.repeat_interleave(x),
                lambda: x.to("meta"), lambda: x.numpy()):
        with pytest.raises(HostSyncError):
            with no_host_sync():
                bad()
    with no_host_sync():  # fixed-size work passes
        torch.sort(x).values.cumsum(0)[x.clamp(max=5)]
        x.repeat_interleave(x, output_size=15)


def test_device_path_runs_on_the_meta_device():
    """Every output size follows from the input shapes (no value read: meta tensors have
    none), and no tensor is made on another device (mixing devices raises)."""
    ids, counts, plan = _case()
    m = torch.device("meta")
    got = ordered_routes_device(ids.to(m), counts.to(m), plan.to(m), validate=False)
    T, k = ids.shape
    assert all(t.device == m for t in got.tables.values()) and got.seg_inc.device == m
    assert got.tables["dep_kind"].shape == (T * k,)
    assert got.seg_inc.shape == (4, plan.segment_capacity) and got.seg_count.shape == (4,)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the reference reads values
        osc.ordered_routes(ids.to(m), counts.to(m), 1, 64, 2, "auto", plan.segment_capacity)


# ------------------------------------------------------------------------ validation
def test_validate_raises_what_the_reference_raises():
    W, T, E, k = 2, 64, 8, 2
    ids, counts = world(W, T, E, k, "balanced", seed=1)
    plan = layer_plan(counts, 0, T, k, 64, 1, "auto", "remote_first")
    with pytest.raises(ValueError, match="do not match"):
        ordered_routes_device(ids[1], counts, plan)
    with pytest.raises(ValueError, match="do not match"):
        osc.ordered_routes(ids[1], counts, 0, 64, 1, "auto", plan.segment_capacity)
    bad = ids[0].clone()
    bad[3, 1] = E
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
        ordered_routes_device(bad, counts, plan)
    other = counts.clone()
    other[1] = torch.roll(other[1], 1)
    with pytest.raises(ValueError, match="not rank 0's plan"):
        ordered_routes_device(ids[0], counts, layer_plan(other, 0, T, k, 64, 1, "auto",
                                                          "remote_first"))
    # a sender receiving more rows than the capacity the owner's plan was made for: rank 1's
    # own rows grow, the owner's plan (at the rows it receives) stays the plan of these counts
    big = counts.clone()
    big[1, E // 2:] *= 10
    El = E // W
    small = plan_combine(big, 0, tile_m=64, mgb=1, max_rows=int(big[:, :El].sum()),
                         impl="torch")
    with pytest.raises(ValueError, match="receive capacity exceeded: rank 1"):
        ordered_routes_device(ids[0], big, small)
    # validate=False: the caller vouches; wrong inputs give wrong tables, no exception and no
    # index out of range (every gather clamped)
    ordered_routes_device(ids[1], counts, plan, validate=False)
    ordered_routes_device(bad, counts, plan, validate=False)
    ordered_routes_device(ids[0] * 0 - 5, counts, plan, validate=False)


def test_host_facts_are_checked_without_reading_data():
    ids, counts, plan = _case()
    with pytest.raises(TypeError, match="CombinePlan"):
        ordered_routes_device(ids, counts, None)
    with pytest.raises(ValueError, match=r"\[W=4, E=16\]"):
        ordered_routes_device(ids, counts[:2], plan)
    with pytest.raises(TypeError, match="integer"):
        ordered_routes_device(ids.float(), counts, plan)
    with pytest.raises(ValueError, match="tokens, topk"):
        ordered_routes_device(ids.reshape(-1), counts, plan)
    with pytest.raises(ValueError, match="one device"):
        ordered_routes_device(ids.to("meta"), counts, plan, validate=False)
    for tt in (0, True, 2.0):
        with pytest.raises(ValueError, match="tile_tokens"):
            ordered_routes_device(ids, counts, plan, tile_tokens=tt)
    with pytest.raises(ValueError, match="plan_impl"):
        ordered_routes_device(ids, counts, plan, plan_impl="cuda")


def test_sender_max_rows_reproduces_the_capacities():
    for W, E, tile_m, mr in [(2, 8, 64, 1000), (8, 64, 128, 8 * 8192 * 8), (4, 16, 256, 1)]:
        El = E // W
        counts = torch.zeros(W, E, dtype=torch.int64)
        p = plan_combine(counts, W - 1, tile_m=tile_m, max_rows=mr, impl="torch")
        m = sender_max_rows(p)
        assert m >= mr and band_capacity_for(m, El, W, tile_m) == p.band_capacity
        assert band_capacity_for(m + 1, El, W, tile_m) > p.band_capacity  # the largest


# ------------------------------------------------------------------------ the kernel's use
class PlanBounds(AssertionError):
    pass


def emulate_ordered_scale(tables, rows, weights, recv, y, deps, arrivals, W, Sc, B,
                          read_to_capacity=False):
    """The ordered kernel (combine/scale_ordered.py) on the CPU, as signals arrive: n_tiles from
    tile_start's length; tile j runs once every entry dep_start[j] .. dep_start[j + 1] has
    arrived (an entry outside the band / segment tables raises PlanBounds, as the kernel's
    ERR_PLAN_BOUNDS), and scales its tokens order[tile_start[j] .. tile_start[j + 1]]; each row
    it reads must have arrived (AssertionError otherwise). read_to_capacity: a broken kernel
    that reads a tile's entries up to the end of the arrays. Returns out bf16 [T, N]."""
    t = {n: v.tolist() for n, v in tables.items()}
    T = rows.shape[0]
    n_tiles = len(t["tile_start"]) - 1
    out = torch.full((T, recv.shape[1]), float("nan"), dtype=torch.bfloat16)
    done = torch.zeros(T, dtype=torch.int64)
    signal = list(zip(deps.kind.reshape(-1).tolist(), deps.source.reshape(-1).tolist(),
                      deps.index.reshape(-1).tolist()))
    arrived, pending = set(), list(range(n_tiles))

    def ready(j):
        end = len(t["dep_kind"]) if read_to_capacity else t["dep_start"][j + 1]
        for x in range(t["dep_start"][j], end):
            kind, src, idx = t["dep_kind"][x], t["dep_source"][x], t["dep_index"][x]
            ok = 0 <= idx < B if kind == LOCAL else (0 <= src < W and 0 <= idx < Sc)
            if not ok:
                raise PlanBounds(f"tile {j} entry {x}: {(kind, src, idx)}")
            if (kind, src, idx) not in arrived:
                return False
        return True
    for sig in list(arrivals) + [None]:
        if sig is not None:
            arrived.add(sig)
        for j in [j for j in pending if ready(j)]:
            tok = torch.tensor(t["order"][t["tile_start"][j]:t["tile_start"][j + 1]],
                               dtype=torch.int64)
            for a in (tok[:, None] * rows.shape[1] + torch.arange(rows.shape[1])).reshape(-1):
                assert signal[int(a)] in arrived, (j, int(a))  # the row is final
            out[tok] = scale_torch(recv, rows[tok], weights[tok], y)
            done[tok] += 1
            pending.remove(j)
    assert not pending and bool((done == 1).all())  # every token once, no tile left waiting
    return out


def _scale_setup(W, T, E, k, rank, mode, tile_tokens, seed=4):
    routed = [route(T, E, k, mode, seed=seed, rank=r) for r in range(W)]
    ids = [x[0] for x in routed]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plan = layer_plan(counts, rank, T, k, 64, 2, "auto", "remote_first")
    got, deps = ordered_routes_device(ids[rank], counts, plan, tile_tokens=tile_tokens,
                                      return_deps=True)
    ref = osc.ordered_routes(ids[rank], counts, rank, 64, 2, "auto", plan.segment_capacity,
                             tile_tokens=tile_tokens)
    rows, _ = prepare_routes_torch(ids[rank], E, W, rank, False, plan)
    g = torch.Generator().manual_seed(seed)
    N = 16
    data = dict(rows=rows, weights=routed[rank][1],
                recv=torch.randn(T * k, N, generator=g).to(torch.bfloat16),
                y=torch.randn(int(plan.total_rows) + 1, N, generator=g).to(torch.bfloat16))
    signals = sorted(set(zip(deps.kind.reshape(-1).tolist(), deps.source.reshape(-1).tolist(),
                             deps.index.reshape(-1).tolist())))
    perm = torch.randperm(len(signals), generator=g).tolist()
    dims = dict(W=W, Sc=plan.segment_capacity, B=plan.band_capacity)
    return got, ref, deps, data, [signals[i] for i in perm], dims


@pytest.mark.parametrize("W,T,rank,mode,tile_tokens", [(2, 150, 0, "balanced", 16),
                                                        (4, 97, 3, "stress_skew", 7),
                                                        (8, 64, 5, "moderate_skew", 64)])
def test_padded_tables_drive_the_kernel_to_the_exact_tables_output(W, T, rank, mode,
                                                                    tile_tokens):
    got, ref, deps, data, arrivals, dims = _scale_setup(W, T, 16, 3, rank, mode, tile_tokens)
    assert got.tables["dep_kind"].numel() > ref.tables["dep_kind"].numel()  # really padded
    out_pad = emulate_ordered_scale(got.tables, deps=deps, arrivals=arrivals, **data, **dims)
    out_exact = emulate_ordered_scale(ref.tables, deps=deps, arrivals=arrivals, **data, **dims)
    assert torch.equal(out_pad, out_exact)
    assert torch.equal(out_pad, scale_torch(data["recv"], data["rows"], data["weights"],
                                            data["y"]))


def test_the_emulation_catches_broken_tables():
    got, _, deps, data, arrivals, dims = _scale_setup(4, 97, 16, 3, 1, "stress_skew", 16)
    # a kernel reading past dep_start[j + 1] reaches the padding and reports it
    with pytest.raises(PlanBounds):
        emulate_ordered_scale(got.tables, deps=deps, arrivals=arrivals, read_to_capacity=True,
                              **data, **dims)
    # a tile whose list misses a signal (tile 0's first, arriving last) runs before one of its
    # rows arrived
    t = dict(got.tables)
    dropped = tuple(int(t[n][0]) for n in DEP_ARRAYS)
    for n in DEP_ARRAYS:
        t[n] = torch.cat([t[n][1:], t[n][-1:]])
    t["dep_start"] = torch.cat([t["dep_start"][:1], t["dep_start"][1:] - 1])
    late = [s for s in arrivals if s != dropped] + [dropped]
    emulate_ordered_scale(got.tables, deps=deps, arrivals=late, **data, **dims)  # intact: fine
    with pytest.raises(AssertionError, match=r"^\(0, "):
        emulate_ordered_scale(t, deps=deps, arrivals=late, **data, **dims)


def test_ordered_scale_check_takes_padded_tables():
    from moe_overlap.combine.scale_ordered import OrderedScale
    got, ref, deps, data, _, dims = _scale_setup(2, 64, 8, 2, 0, "balanced", 16)
    T = data["rows"].shape[0]
    seg = got.seg_inc
    good = dict(rows=data["rows"], weights=data["weights"],
                out=torch.zeros(T, 16, dtype=torch.bfloat16), tables=got.tables,
                band_ready=torch.zeros(dims["B"], dtype=torch.int32), seg_arrivals=seg.clone(),
                seg_expected=seg, queue=torch.zeros(1, dtype=torch.int32),
                err=torch.zeros(8, dtype=torch.int64), epoch=torch.zeros(1, dtype=torch.int32))
    sc = OrderedScale(2)
    sc.check(**good)
    sc.check(**dict(good, tables=ref.tables))  # exact tables too
    with pytest.raises(ValueError, match="dep_start"):
        sc.check(**dict(good, tables=dict(got.tables, dep_start=got.tables["dep_start"][:-1])))
    with pytest.raises(ValueError, match="equally long"):
        sc.check(**dict(good, tables=dict(got.tables, dep_index=got.tables["dep_index"][:-1])))
    assert sc._fn is None  # nothing compiled


# ------------------------------------------------------------------------ the layer's prepare
def test_prepare_ordered_uses_the_device_path_and_keeps_the_reference(monkeypatch):
    from test_ordered_wire_cpu import _fake_layer, _seg_cap, _world
    from moe_overlap.combine.overlap import OverlapCombine
    W, T, E, k, tile_m, mgb = 2, 300, 8, 2, 64, 2
    Sc = _seg_cap(W, T, E, k, tile_m)
    me = _fake_layer(monkeypatch, W, 1, Sc)
    me.world_size, me.num_experts, me.rank, me.device = W, E, 1, torch.device("cpu")
    ids, counts = _world(W, T, E, k, "stress_skew", seed=2)
    plan = plan_combine(counts, 1, tile_m=tile_m, mgb=mgb, max_rows=W * T * k, impl="torch",
                        order="expert")
    assert ORDERED_IMPLS == ("device", "host")
    with no_host_sync():
        dev = OverlapCombine._prepare_ordered(me, plan, ids[1], counts)
    host = OverlapCombine._prepare_ordered(me, plan, ids[1], counts, impl="host")
    assert torch.equal(dev["seg_inc"], host["seg_inc"])
    assert torch.equal(dev["seg_count"], host["seg_count"])
    nd = int(dev["tables"]["dep_start"][-1])
    for n, t in host["tables"].items():
        assert torch.equal(dev["tables"][n][:nd] if n in DEP_ARRAYS else dev["tables"][n], t), n
    with pytest.raises(ValueError, match="ordered_impl"):
        OverlapCombine._prepare_ordered(me, plan, ids[1], counts, impl="torch")


# ------------------------------------------------------------------------ add_seg_inc
def test_add_seg_inc_adds_each_senders_prefix_only():
    """What begin_call does per call: only seg_count[s] words of row s, whatever lies past them
    in seg_inc (the kernel path leaves that unwritten), the rest of seg_expected untouched."""
    from moe_overlap.combine.ordered_routes import add_seg_inc
    W, Sc = 4, 9
    g = torch.Generator().manual_seed(3)
    exp = torch.randint(0, 50, (W, Sc), generator=g)
    inc = torch.randint(0, 9, (W, Sc), generator=g)
    cnt = torch.tensor([0, 9, 3, 12], dtype=torch.int32)  # 12 > Sc: clamped
    want = exp.clone()
    for s, n in enumerate(cnt.tolist()):
        want[s, :min(n, Sc)] += inc[s, :min(n, Sc)]
    poisoned = inc.clone()
    for s, n in enumerate(cnt.tolist()):
        poisoned[s, min(n, Sc):] = -(1 << 40)  # never read
    add_seg_inc(exp, poisoned, cnt)
    assert torch.equal(exp, want)
    assert not torch.equal(want, exp.clone().add_(inc))  # the full add differs here


def test_add_seg_inc_refuses_mismatched_tables():
    from moe_overlap.combine.ordered_routes import add_seg_inc
    exp = torch.zeros(2, 5, dtype=torch.int64)
    cnt = torch.zeros(2, dtype=torch.int32)
    for bad in (dict(seg_inc=torch.zeros(2, 4, dtype=torch.int64)),
                dict(seg_inc=torch.zeros(2, 5, dtype=torch.int32)),
                dict(seg_count=torch.zeros(3, dtype=torch.int32)),
                dict(seg_expected=torch.zeros(5, 2, dtype=torch.int64).t())):
        args = dict(seg_expected=exp, seg_inc=torch.zeros(2, 5, dtype=torch.int64),
                    seg_count=cnt) | bad
        with pytest.raises(ValueError, match="add_seg_inc"):
            add_seg_inc(**args)
