"""GPU correctness of the producer grouped GEMM (skipped without CUDA / CuTe DSL).

Bands come from moe_overlap.combine.plan.plan_combine (falls back to a local band builder if the
planner is absent).  Each case: fresh random inputs, y poisoned with NaN, every row of every valid
band checked against an fp32 reference per expert, rows of no band untouched, every valid band's
flag == epoch after the call; two consecutive calls (epoch 1 then 2, no reset in between).
"""
import zlib

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap.combine.grouped_gemm import GroupedGemm  # noqa: E402

try:
    from moe_overlap.combine.plan import plan_combine
except ImportError:  # pragma: no cover
    plan_combine = None

DEV = "cuda"
N, K = 512, 256
_GEMMS = {}


def _gemm(tile_m, tile_n, **kw):
    key = (tile_m, tile_n, tuple(sorted(kw.items())))
    if key not in _GEMMS:
        _GEMMS[key] = GroupedGemm(tile_m=tile_m, tile_n=tile_n, **kw)
    return _GEMMS[key]


def _local_plan(local_counts, tile_m):
    """Fallback band builder: per local expert, ceil(c / tile_m) bands, stacked expert-major."""
    be, bs, start = [], [], 0
    for e, c in enumerate(local_counts):
        nb = (c + tile_m - 1) // tile_m
        for k in range(nb):
            be.append(e)
            bs.append(start + k * tile_m)
        start += nb * tile_m
    cap = len(be) + 3
    pad = lambda v: torch.tensor(v + [-1] * (cap - len(v)), dtype=torch.int32, device=DEV)
    sched = list(range(len(be)))[::-1]  # a non-trivial order
    return dict(band_expert=pad(be), band_src_row=pad(bs), schedule=pad(sched),
                num_bands=torch.tensor([len(be)], dtype=torch.int32, device=DEV),
                total_rows=start, cap=cap)


def _make_plan(counts, rank, tile_m, layout="aligned"):
    """counts: [W, E] int (host). Returns band tensors + host facts for rank's local experts."""
    W, E = counts.shape
    El = E // W
    if plan_combine is not None:
        p = plan_combine(counts.to(DEV), rank, tile_m=tile_m, layout=layout)
        return dict(band_expert=p.band_expert, band_src_row=p.band_src_row, schedule=p.schedule,
                    num_bands=p.num_bands, total_rows=int(p.total_rows.item()),
                    cap=p.band_capacity, El=El)
    local = counts[:, rank * El:(rank + 1) * El].sum(0).tolist()
    d = _local_plan(local, tile_m)
    d["El"] = El
    return d


def _counts(kind, W, El, gen):
    E = W * El
    if kind == "balanced":
        return torch.full((W, E), 96, dtype=torch.int64)
    if kind == "skew":  # stress skew: heavy-tailed, a few experts get most rows
        c = (torch.rand(W, E, generator=gen) ** 4 * 600).long()
        c[:, 0] += 700
        return c
    if kind == "zero_expert":
        c = torch.randint(1, 300, (W, E), generator=gen)
        c[:, 1] = 0
        return c
    if kind == "one_expert":
        c = torch.zeros(W, E, dtype=torch.int64)
        c[:, El - 1] = 333
        return c
    raise ValueError(kind)


CASES = [
    # (kind, W, El, tile_m, tile_n, ccta)
    ("balanced", 1, 4, 128, 256, 0),
    ("skew", 2, 4, 128, 256, 8),
    ("zero_expert", 8, 2, 64, 256, 24),
    ("one_expert", 2, 4, 64, 128, 0),
    ("skew", 8, 2, 128, 128, 24),
    ("balanced", 2, 3, 64, 256, 8),
    ("zero_expert", 1, 4, 128, 256, 24),
    ("one_expert", 8, 2, 128, 256, 8),
]


@pytest.mark.parametrize("kind,W,El,tile_m,tile_n,ccta", CASES)
def test_grouped_gemm_matches_reference(kind, W, El, tile_m, tile_n, ccta):
    _check_case(kind, W, El, tile_m, tile_n, ccta)


@pytest.mark.parametrize("kind,W,El,tile_m,tile_n,ccta", [c for c in CASES if c[1] > 1])
def test_grouped_gemm_on_packed_layout(kind, W, El, tile_m, tile_n, ccta):
    """The producer on packed plans (bands holding rows of several sources): same checks."""
    _check_case(kind, W, El, tile_m, tile_n, ccta, layout="packed")


@pytest.mark.parametrize("kind,W,El,tile_m,tile_n,ccta,extra", [
    ("skew", 2, 4, 128, 256, 0, dict(cluster_n=1, signal_k_tile=3)),
    ("zero_expert", 8, 2, 64, 256, 7, dict(cluster_n=2)),
    ("one_expert", 1, 4, 128, 128, 24, dict(cluster_n=2, epi_n=64, epi_stages=2)),
    ("balanced", 2, 4, 64, 128, 8, dict(cluster_n=1, signal_k_tile=-1)),
    ("skew", 1, 4, 128, 256, 8, dict(cluster_n=2, signal_k_tile=1)),
    ("skew", 2, 4, 128, 256, 0, dict(flag_warp=False)),
    ("zero_expert", 8, 2, 64, 128, 24, dict(flag_warp=False, cluster_n=1)),
    ("one_expert", 2, 4, 64, 256, 7, dict(flag_warp=False, epi_n=64, epi_stages=2)),
    ("skew", 2, 4, 128, 256, 0, dict(flag_warp=True)),
    ("zero_expert", 8, 2, 64, 128, 24, dict(flag_warp=True, cluster_n=1)),
    ("one_expert", 1, 4, 128, 256, 8, dict(flag_warp=True, signal_k_tile=-1)),
    ("skew", 2, 4, 128, 256, 0, dict(band_group=2)),
    ("balanced", 2, 3, 64, 128, 8, dict(band_group=2, cluster_n=1)),
    ("zero_expert", 8, 2, 128, 256, 24, dict(band_group=2, flag_warp=True)),
    ("skew", 2, 4, 128, 256, 8, dict(band_group=1, flag_warp=False)),
    ("skew", 2, 4, 128, 256, 0, dict(band_group=1)),
    ("balanced", 8, 2, 64, 128, 24, dict(band_group=3, cluster_n=1)),
    ("skew", 2, 4, 128, 256, 0, dict(group_by="expert")),
    ("zero_expert", 8, 2, 64, 128, 24, dict(group_by="expert", band_group=2, cluster_n=1)),
    ("one_expert", 2, 4, 128, 256, 8, dict(group_by="expert", band_group=3, cluster_n=1)),
])
def test_grouped_gemm_cluster_and_options(kind, W, El, tile_m, tile_n, ccta, extra):
    _check_case(kind, W, El, tile_m, tile_n, ccta, **extra)


def _check_case(kind, W, El, tile_m, tile_n, ccta, layout="aligned", **extra):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, W, El, tile_m, tile_n, ccta)).encode()))
    counts = _counts(kind, W, El, gen)
    rank = W - 1
    plan = _make_plan(counts, rank, tile_m, layout)
    nb = int(plan["num_bands"].item())
    total = plan["total_rows"]
    rows = total + 2 * tile_m  # rows past the last band must stay untouched
    g = _gemm(tile_m, tile_n, **extra)
    band_ready = torch.zeros(plan["cap"], dtype=torch.int32, device=DEV)
    epoch = torch.zeros(1, dtype=torch.int32, device=DEV)
    sched = plan["schedule"][:nb].tolist()
    be = plan["band_expert"].tolist()
    bs = plan["band_src_row"].tolist()
    for call in (1, 2):
        x = torch.randn(rows, K, device=DEV).to(torch.bfloat16)
        w = (torch.randn(El, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
        y = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        epoch.fill_(call)
        g(x, w, y, plan["band_expert"], plan["band_src_row"], plan["schedule"], plan["num_bands"],
          band_ready, epoch, ccta=ccta)
        torch.cuda.synchronize()
        covered = torch.zeros(rows, dtype=torch.bool, device=DEV)
        for e in range(El):
            rs = [bs[b] for b in sched if be[b] == e]
            if not rs:
                continue
            idx = torch.cat([torch.arange(r, r + tile_m, device=DEV) for r in rs])
            covered[idx] = True
            ref = x[idx].float() @ w[e].float()
            out = y[idx].float()
            assert not torch.isnan(out).any(), f"expert {e}: unwritten rows (call {call})"
            rel = ((out - ref).norm() / ref.norm().clamp_min(1e-6)).item()
            assert rel < 1e-2, f"expert {e}: rel err {rel:.3e} (call {call})"
        assert torch.isnan(y[~covered].float()).all(), "rows of no band were written"
        ready = band_ready.tolist()
        for b in sched:
            assert ready[b] == call, f"band {b}: flag {ready[b]} != epoch {call}"
        valid = set(sched)
        assert all(ready[b] == 0 for b in range(plan["cap"]) if b not in valid)
        cnt = g._counters[(x.device, band_ready.numel())]
        assert int(cnt.abs().sum()) == 0, "band tile counters must return to 0"


def test_no_flags_variant_and_empty_plan():
    tile_m = 128
    g = GroupedGemm(tile_m=tile_m, tile_n=256, signal=False)
    counts = torch.full((1, 4), 200, dtype=torch.int64)
    plan = _make_plan(counts, 0, tile_m)
    rows = plan["total_rows"]
    x = torch.randn(rows, K, device=DEV).to(torch.bfloat16)
    w = (torch.randn(4, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
    y = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    ready = torch.zeros(plan["cap"], dtype=torch.int32, device=DEV)
    epoch = torch.ones(1, dtype=torch.int32, device=DEV)
    g(x, w, y, plan["band_expert"], plan["band_src_row"], plan["schedule"], plan["num_bands"],
      ready, epoch)
    torch.cuda.synchronize()
    assert not torch.isnan(y.float()).any()
    assert int(ready.abs().sum()) == 0  # flags disabled at compile time
    # zero bands: nothing written, nothing hangs
    y.fill_(float("nan"))
    nb0 = torch.zeros(1, dtype=torch.int32, device=DEV)
    _gemm(tile_m, 256)(x, w, y, plan["band_expert"], plan["band_src_row"], plan["schedule"], nb0,
                       ready, epoch)
    torch.cuda.synchronize()
    assert torch.isnan(y.float()).all() and int(ready.abs().sum()) == 0


# ---- group_by="expert": band groups cut at expert boundaries --------------------------------
MODEL_PLANS = {  # name: (W, E, tokens per rank, topk, order): rank 0's plan of a skewed routing
    "deepseek-v3@16384": (1, 256, 16384, 8, "remote_first"),  # 4-5 bands per expert
    "deepseek-v3@4096 W8": (8, 256, 4096, 8, "remote_first"),  # 1-2 bands per expert
    "deepseek-v3@4096 W2 expert order": (2, 256, 4096, 8, "expert"),
    "mixtral@16384": (1, 8, 16384, 2, "remote_first"),  # ~32 bands per expert
}


def _model_plan(name, tile_m=128):
    W, E, tokens, topk, order = MODEL_PLANS[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    pop = torch.rand(E, generator=g) ** 2 + 0.2
    pop = pop / pop.sum()
    counts = torch.stack([torch.bincount(torch.multinomial(pop, tokens * topk, replacement=True,
                                                           generator=g), minlength=E)
                          for _ in range(W)])
    p = plan_combine(counts.to(DEV), 0, tile_m=tile_m, order=order)
    return p, E // W


def _valid_rows(plan, tile_m):
    nb = int(plan.num_bands.item())
    starts = plan.band_src_row[plan.schedule[:nb].long()].long()
    rows = (starts[:, None] + torch.arange(tile_m, device=DEV)).reshape(-1)
    mask = torch.zeros(int(plan.total_rows.item()) + tile_m, dtype=torch.bool, device=DEV)
    mask[rows] = True
    return mask


@pytest.mark.parametrize("name,G,ccta,extra", [
    ("deepseek-v3@16384", 8, 0, {}), ("deepseek-v3@16384", 8, 8, dict(cluster_n=1)),
    ("deepseek-v3@16384", 16, 0, dict(cluster_n=1)), ("deepseek-v3@4096 W8", 8, 0, {}),
    ("deepseek-v3@4096 W8", 4, 16, dict(cluster_n=1)),
    ("deepseek-v3@4096 W2 expert order", 8, 8, dict(cluster_n=1)),
    ("mixtral@16384", 8, 0, {}), ("mixtral@16384", 8, 24, dict(cluster_n=1, flag_warp=False)),
])
def test_group_by_expert_is_bitwise_the_fixed_groups_output(name, G, ccta, extra):
    """The producer with groups cut at expert boundaries computes every band's tiles as with
    fixed groups of 8 (only their order differs), so y is bitwise the same on every valid row;
    rows of no band stay untouched, every band's flag is raised, the counters return to 0; twice
    (the tables rebuilt each call), and once more with the tables passed in (made beforehand)."""
    from moe_overlap.combine.band_groups import band_groups, band_groups_torch
    tile_m, tile_n = 128, 256
    plan, El = _model_plan(name, tile_m)
    nb = int(plan.num_bands.item())
    rows = int(plan.total_rows.item()) + tile_m
    x = torch.randn(rows, K, device=DEV).to(torch.bfloat16)
    w = (torch.randn(El, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
    fixed = _gemm(tile_m, tile_n, **extra)
    ex = _gemm(tile_m, tile_n, group_by="expert", band_group=G, **extra)
    args = (plan.band_expert, plan.band_src_row, plan.schedule, plan.num_bands)
    valid = _valid_rows(plan, tile_m)[:rows]
    sched = plan.schedule[:nb].long()
    y0 = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    r0 = torch.zeros(plan.band_capacity, dtype=torch.int32, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    fixed(x, w, y0, *args, r0, one, ccta=ccta)
    made = band_groups(plan.schedule, plan.band_expert, plan.num_bands, G)
    for call, groups in ((1, None), (2, None), (3, made)):
        y1 = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        r1 = torch.zeros(plan.band_capacity, dtype=torch.int32, device=DEV)
        epoch = torch.full((1,), call, dtype=torch.int32, device=DEV)
        ex(x, w, y1, *args, r1, epoch, ccta=ccta, band_groups=groups)
        torch.cuda.synchronize()
        assert torch.equal(y1[valid].view(torch.int16), y0[valid].view(torch.int16)), call
        assert torch.isnan(y1[~valid].float()).all()
        assert bool((r1[sched] == call).all()) and int((r1 != 0).sum()) == nb
        cnt = ex._counters[(x.device, plan.band_capacity)]
        assert int(cnt.abs().sum()) == 0
    # the tables the wrapper built are the reference's
    f, s = band_groups_torch(plan.schedule, plan.band_expert, plan.num_bands, G)
    ws = ex._group_ws[(x.device, plan.band_capacity)]
    cap = plan.band_capacity
    assert torch.equal(ws[:cap], f) and torch.equal(ws[cap:2 * cap], s)


def _random_schedule(rng, cap_max, cap=None):
    cap = rng.randint(1, cap_max) if cap is None else cap
    nb = rng.randint(0, cap) if rng.random() > 0.05 else rng.choice([-1, cap + 1])
    m = min(max(nb, 0), cap)
    be, e, i = [-1] * cap, 0, 0
    while i < cap:
        L = rng.choice([1, 2, 3, 4, 5, 8, 9, 17, 40, rng.randint(1, 200)])
        be[i:i + L] = [e] * len(be[i:i + L])
        e += 1
        i += L
    sched = [-1] * cap
    order = list(range(m))
    if rng.random() < 0.3:
        rng.shuffle(order)
    sched[:m] = order
    for _ in range(rng.choice([0, 0, 2])):
        if m:
            sched[rng.randrange(m)] = rng.choice([-1, nb, 1 << 30])
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    return t(sched), t(be), t([nb]), rng.choice([1, 2, 4, 5, 8, 8, 16, rng.randint(1, 64)])


def test_band_groups_kernel_matches_torch():
    """The tables' CuTe DSL kernel against the torch reference, bit for bit, on random
    schedules (capacities past one round of 1024 positions, runs of 1..200, refused entries,
    num_bands outside the tables) and the planner's; every word of both tables written."""
    import random
    from moe_overlap.combine.band_groups import WORKSPACE_TABLES, band_groups, band_groups_torch
    rng = random.Random(36)
    cases = [_random_schedule(rng, 5000) for _ in range(60)]
    for name in MODEL_PLANS:
        p, _ = _model_plan(name)
        cases += [(p.schedule, p.band_expert, p.num_bands, G) for G in (4, 8, 16)]
    for sched, be, nb, G in cases:
        out = torch.full((WORKSPACE_TABLES * sched.numel(),), -7, dtype=torch.int32, device=DEV)
        f, s = band_groups(sched, be, nb, G, out=out, impl="kernel")
        rf, rs = band_groups_torch(sched, be, nb, G)
        assert torch.equal(f, rf) and torch.equal(s, rs), (sched.numel(), int(nb), G)


def test_band_groups_kernel_in_a_cuda_graph():
    """Captured once, replayed on new schedules written into the same buffers (as a captured
    plan rewrites its own): the tables follow, no host sync in the captured call."""
    import random
    from moe_overlap.combine.band_groups import WORKSPACE_TABLES, band_groups, band_groups_torch
    rng = random.Random(7)
    cap = 3000
    sched = torch.full((cap,), -1, dtype=torch.int32, device=DEV)
    be, nb = sched.clone(), torch.zeros(1, dtype=torch.int32, device=DEV)
    out = torch.empty(WORKSPACE_TABLES * cap, dtype=torch.int32, device=DEV)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        band_groups(sched, be, nb, 8, out=out, impl="kernel")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f, sz = band_groups(sched, be, nb, 8, out=out, impl="kernel")
    for _ in range(10):
        a, b, n, _ = _random_schedule(rng, cap, cap=cap)
        sched.copy_(a)
        be.copy_(b)
        nb.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        rf, rs = band_groups_torch(sched, be, nb, 8)
        assert torch.equal(f, rf) and torch.equal(sz, rs)


@pytest.mark.parametrize("field", ["first", "end"])
def test_group_table_entry_out_of_range_is_refused(field):
    """A group whose table entries are out of range (group_first < 0, or its end past
    num_bands: stale tables of another plan) is refused like a bad band: ERR_PRODUCER_BOUNDS
    naming the field, a position of that group, the value and the bound; its bands are not
    computed (rows untouched, flags unset) and, the tables being a partition, no band is half
    counted (the counters are all 0); every other band is bitwise the fixed-group output."""
    from moe_overlap.combine.band_groups import band_groups_torch
    from moe_overlap.kernels import errors as E
    tile_m, tile_n, G = 128, 256, 8
    plan, El = _model_plan("deepseek-v3@4096 W8", tile_m)
    nb = int(plan.num_bands.item())
    rows = int(plan.total_rows.item()) + tile_m
    x = torch.randn(rows, K, device=DEV).to(torch.bfloat16)
    w = (torch.randn(El, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
    args = (plan.band_expert, plan.band_src_row, plan.schedule, plan.num_bands)
    f, s = band_groups_torch(plan.schedule, plan.band_expert, plan.num_bands, G)
    p = nb // 2
    lo, hi = int(f[p]), int(f[p]) + int(s[p])
    if field == "first":
        f[lo:hi] = -1
        want = (E.PRF_GROUP_FIRST, -1)
    else:
        s[lo:hi] = nb + 3 - lo
        want = (E.PRF_GROUP_END, nb + 3)
    y0 = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    r0 = torch.zeros(plan.band_capacity, dtype=torch.int32, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    _gemm(tile_m, tile_n)(x, w, y0, *args, r0, one)
    y1 = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    r1 = torch.zeros_like(r0)
    cnt = torch.zeros_like(r0)
    err = torch.zeros(8, dtype=torch.int64, device=DEV)
    ex = _gemm(tile_m, tile_n, group_by="expert", band_group=G)
    ex(x, w, y1, *args, r1, one, band_counter=cnt, err=err, rank=3, band_groups=(f, s))
    torch.cuda.synchronize()
    code, rank, pos, fld, val, bound = err.tolist()[:6]
    assert (code, rank, fld, val) == (E.ERR_PRODUCER_BOUNDS, 3) + want
    assert lo <= pos < hi and bound == (pos if field == "first" else nb)
    refused = plan.schedule[lo:hi].long()
    kept = torch.cat([plan.schedule[:lo], plan.schedule[hi:nb]]).long()
    assert bool((r1[refused] == 0).all()) and bool((r1[kept] == 1).all())
    assert int(cnt.abs().sum()) == 0
    bs = plan.band_src_row.long()
    for b, want_rows in ((refused, False), (kept, True)):
        idx = (bs[b][:, None] + torch.arange(tile_m, device=DEV)).reshape(-1)
        if want_rows:
            assert torch.equal(y1[idx].view(torch.int16), y0[idx].view(torch.int16))
        else:
            assert torch.isnan(y1[idx].float()).all()
