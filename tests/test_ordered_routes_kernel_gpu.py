"""The ordered scale's tables from the kernels (combine/ordered_routes_kernel.py,
``ordered_routes_device(impl="kernel")``) on CUDA against the torch path on the same device
(``impl="torch"``, itself bitwise the host reference on the CPU: tests/test_ordered_routes_cpu.py)
and, on part of the cases, against the host reference directly:

- every table bitwise, the dependency arrays' padding included, seg_count and each sender's
  prefix of seg_inc (nothing past it is written: the poison stays there), for W in
  {1, 2, 4, 8, 64}, both orders, every layout, tile_tokens 1 / 16 / 64, int32 and int64 ids,
  balanced and skewed routings and adversarial ones (empty experts, one hot expert, every token
  to one rank);
- with every output and workspace poisoned before the call (each word read is written);
- captured in a CUDA graph with the planner and prepare, replayed on a new routing;
- impl="kernel" refused where it cannot run, with the reason;
- OverlapCombine.prepare(scale="ordered") on a one-rank group: the rows the tables' path hands
  back, its tables, and the ordered layer's output bitwise the plain layer's.
"""
from types import SimpleNamespace

import pytest
import torch

from moe_overlap.combine import ordered_routes_kernel as ork
from moe_overlap.combine import ordered_scale as osc
from moe_overlap.combine.ordered_routes import ordered_routes_device
from moe_overlap.combine.plan import plan_combine
from moe_overlap.combine.routes import prepare_routes
from moe_overlap.routing import route

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

DEV = "cuda"


def _world(W, E, T, k, mode, seed):
    """ids of every rank ([T, k] int64 each) and the [W, E] counts."""
    if mode in ("balanced", "moderate_skew", "stress_skew"):
        ids = [route(T, E, k, mode, seed=seed, rank=r)[0] for r in range(W)]
    else:
        g = torch.Generator().manual_seed(seed)
        ids = []
        for r in range(W):
            if mode == "empty_experts":  # only even experts
                x = 2 * torch.randint(0, E // 2, (T, k), generator=g)
            elif mode == "one_hot":  # most rows to one expert, the rest to the next k - 1
                x = (torch.arange(k).repeat(T, 1) + (seed % E)) % E
            elif mode == "to_one_rank":  # every token to rank 0's experts
                El = E // W
                x = torch.stack([torch.randperm(El, generator=g)[:k] for _ in range(T)]) \
                    if El >= k else torch.randint(0, El, (T, k), generator=g)
            else:
                raise ValueError(mode)
            ids.append(x)
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    return ids, counts


def _diff(name, got, want, case):
    g, w = got.reshape(-1).cpu(), want.reshape(-1).cpu()
    if g.shape != w.shape or got.dtype != want.dtype:
        return f"{case}: {name} {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    bad = (g != w).nonzero()
    if not len(bad):
        return None
    i = int(bad[0])
    lo = max(0, i - 3)
    return (f"{case}: {name} differs at {len(bad)} of {g.numel()}, first {i}: kernel "
            f"{g[lo:i + 4].tolist()} torch {w[lo:i + 4].tolist()}")


def _seg_diff(got, want, case):
    """seg_count equal, and each sender's prefix of seg_inc (past it the kernel path writes
    nothing, so the poison stays there)."""
    gc, wc = got.seg_count.cpu(), want.seg_count.cpu()
    if gc.dtype != torch.int32 or not torch.equal(gc, wc):
        return f"{case}: seg_count {gc.dtype} {gc.tolist()} vs {wc.tolist()}"
    gi, wi = got.seg_inc.cpu(), want.seg_inc.cpu()
    if gi.shape != wi.shape or gi.dtype != torch.int64:
        return f"{case}: seg_inc {gi.dtype} {tuple(gi.shape)} vs {tuple(wi.shape)}"
    for s, n in enumerate(wc.tolist()):
        if not torch.equal(gi[s, :n], wi[s, :n]):
            return _diff(f"seg_inc[{s}, :{n}]", gi[s, :n], wi[s, :n], case)
    return None


def _poisoned(monkeypatch):
    def empty(n, dtype, device):
        return torch.full((n,), -0x5A5A5A5B if dtype == torch.int32 else -0x5A5A5A5A5A5A5A5B,
                          dtype=dtype, device=device)
    monkeypatch.setattr(ork, "_empty", empty)


def _check(W, E, T, k, mode, seed, rank, layout="auto", order="remote_first", tile_tokens=16,
           ids_dtype=torch.int64, host=False, with_rows=True):
    ids, counts = _world(W, E, T, k, mode, seed)
    case = (W, E, T, k, mode, seed, rank, layout, order, tile_tokens, ids_dtype)
    cd = counts.to(DEV)
    mine = ids[rank].to(DEV, ids_dtype)
    plan = plan_combine(cd, rank, tile_m=128, mgb=2, max_rows=W * T * k, validate=False,
                        layout=layout, impl="kernel", order=order)
    rows = None
    if with_rows:
        rows, _ = prepare_routes(mine, E, W, rank, False, plan, impl="kernel")
    got = ordered_routes_device(mine, cd, plan, tile_tokens=tile_tokens, validate=False,
                                impl="kernel", rows=rows)
    want = ordered_routes_device(mine, cd, plan, tile_tokens=tile_tokens, validate=True,
                                 impl="torch")
    if not with_rows:  # the kernel path computed prepare's rows (under the senders' plans)
        ref_rows, _ = prepare_routes(mine, E, W, rank, False, plan, impl="torch")
        assert torch.equal(got.rows, ref_rows), case
    bad = [_diff(n, got.tables[n], want.tables[n], case) for n in want.tables]
    bad.append(_seg_diff(got, want, case))
    bad = [b for b in bad if b]
    assert not bad, "\n".join(bad)
    if host:
        ref = osc.ordered_routes(ids[rank], counts, rank, 128, 2, plan.layout,
                                 plan.segment_capacity, tile_tokens=tile_tokens, order=order)
        nd = int(ref.tables["dep_start"][-1])
        for n, t in ref.tables.items():
            g = got.tables[n].cpu()
            assert torch.equal(g[:nd] if n.startswith("dep_") and n != "dep_start" else g, t), \
                (case, n)
        assert _seg_diff(got, ref, case) is None
    return got


@pytest.mark.parametrize("W,E,T,k", [(1, 8, 300, 2), (2, 64, 2048, 8), (4, 32, 1000, 4),
                                     (8, 256, 4096, 8), (64, 512, 1024, 8)])
@pytest.mark.parametrize("mode", ["balanced", "stress_skew", "empty_experts", "one_hot",
                                  "to_one_rank"])
def test_kernel_tables_equal_torch(W, E, T, k, mode, monkeypatch):
    _poisoned(monkeypatch)
    for rank in sorted({0, W - 1, W // 2}):
        _check(W, E, T, k, mode, seed=W + rank, rank=rank, host=(W <= 4 and rank == 0))


@pytest.mark.parametrize("layout", ["aligned", "packed", "auto"])
@pytest.mark.parametrize("order", ["remote_first", "expert"])
@pytest.mark.parametrize("tile_tokens", [1, 16, 64])
def test_kernel_tables_every_layout_order_tile(layout, order, tile_tokens, monkeypatch):
    _poisoned(monkeypatch)
    _check(4, 64, 1500, 8, "moderate_skew", 5, 1, layout=layout, order=order,
           tile_tokens=tile_tokens, host=True)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_rows", [True, False])
def test_kernel_tables_ids_dtype_and_own_rows(ids_dtype, with_rows, monkeypatch):
    _poisoned(monkeypatch)
    _check(8, 128, 3000, 6, "moderate_skew", 7, 3, ids_dtype=ids_dtype, with_rows=with_rows)


def test_kernel_tables_at_the_largest_shape(monkeypatch):
    """W = 64, 512 experts, 16384 tokens, top-8 (issue 20's goal shape), 4 chunks of the sort."""
    _poisoned(monkeypatch)
    _check(64, 512, 16384, 8, "balanced", 1, 63)


def test_kernel_tables_in_a_cuda_graph_on_a_new_routing():
    W, E, T, k, rank = 8, 256, 4096, 8, 2
    ids_a, counts_a = _world(W, E, T, k, "balanced", 1)
    ids_b, counts_b = _world(W, E, T, k, "stress_skew", 2)
    s_ids = ids_a[rank].to(DEV)
    s_counts = counts_a.to(DEV)

    def step():
        plan = plan_combine(s_counts, rank, tile_m=128, mgb=2, max_rows=W * T * k,
                            validate=False, layout="auto", impl="kernel")
        # rows=None: prepare_routes inside, the senders' plans forked onto a side stream
        return ordered_routes_device(s_ids, s_counts, plan, validate=False, impl="kernel")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    s_ids.copy_(ids_b[rank].to(DEV))
    s_counts.copy_(counts_b.to(DEV))
    g.replay()
    torch.cuda.synchronize()
    plan_b = plan_combine(counts_b.to(DEV), rank, tile_m=128, mgb=2, max_rows=W * T * k,
                          validate=False, layout="auto", impl="torch")
    want = ordered_routes_device(ids_b[rank].to(DEV), counts_b.to(DEV), plan_b, validate=True,
                                 impl="torch")
    for n, t in want.tables.items():
        assert torch.equal(out.tables[n], t), n
    assert _seg_diff(out, want, "graph") is None


def test_kernel_impl_refusals():
    W, E, T, k = 2, 16, 64, 4
    ids, counts = _world(W, E, T, k, "balanced", 0)
    cd = counts.to(DEV)
    plan = plan_combine(cd, 0, tile_m=128, mgb=2, max_rows=W * T * k, validate=False)
    mine = ids[0].to(DEV)
    with pytest.raises(ValueError, match="tile_tokens x topk"):
        ordered_routes_device(mine, cd, plan, tile_tokens=512, validate=False, impl="kernel")
    with pytest.raises(ValueError, match="return_deps"):
        ordered_routes_device(mine, cd, plan, validate=False, impl="kernel", return_deps=True)
    with pytest.raises(ValueError, match="rows must be"):
        ordered_routes_device(mine, cd, plan, validate=False, impl="kernel",
                              rows=torch.zeros(T, k + 1, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="impl="):
        ordered_routes_device(mine, cd, plan, validate=False, impl="cuda")


def _one_rank_worker(rank, world):
    """OverlapCombine.prepare(scale="ordered") on a one-rank group: the rows the tables' path
    hands back equal prepare_routes', the tables the torch path's; then the ordered layer's
    output equals the plain layer's bit for bit on fresh NaN-poisoned calls."""
    from moe_overlap import MoECombine
    from moe_overlap.combine.comm_buffer import CommBuffer
    from moe_overlap.combine.dispatch import exchange_counts
    E1, K1, N1, TOPK1, TMAX1 = 8, 256, 512, 2, 256
    dev = torch.device("cuda", torch.cuda.current_device())
    layers = {s: MoECombine(E1, K1, N1, TOPK1, TMAX1, tile_m=128, backend="overlap", ccta=8,
                            transport="nvlink", validate=False, scale=s,
                            comm_buffer=CommBuffer(None, "nvlink")) for s in ("plain", "ordered")}
    res = {"rows": [], "tables": [], "inc": [], "bitwise": []}
    for i in range(4):
        T = 64 + 37 * i
        ids, w = route(T, E1, TOPK1, mode="moderate_skew" if i % 2 else "balanced",
                       seed=900 + i, rank=rank, device=dev)
        counts = exchange_counts(ids, E1)
        plan = layers["ordered"].plan(counts)
        ro = layers["ordered"].prepare(plan, ids, counts)
        rp = layers["plain"].prepare(plan, ids)
        want_rows, _ = prepare_routes(ids, E1, 1, 0, False, plan, impl="torch")
        res["rows"].append(bool(torch.equal(ro.rows, want_rows)) and
                           bool(torch.equal(rp.rows, want_rows)))
        want = ordered_routes_device(ids, counts, plan, validate=True, impl="torch")
        res["tables"].append(all(torch.equal(ro.ordered["tables"][n], t)
                                 for n, t in want.tables.items())
                             and _seg_diff(SimpleNamespace(seg_inc=ro.ordered["seg_inc"],
                                                           seg_count=ro.ordered["seg_count"]),
                                           want, i) is None)
        res["inc"].append(bool(torch.equal(ro.expected_inc.cpu(),
                                           torch.ones(1, dtype=torch.int64))))
        g = torch.Generator(device=dev).manual_seed(40 + i)
        h = torch.randn(plan.row_capacity, K1, device=dev, generator=g).to(torch.bfloat16)
        wd = (torch.randn(E1, K1, N1, device=dev, generator=g) / K1 ** 0.5).to(torch.bfloat16)
        outs = []
        for s, r in (("plain", rp), ("ordered", ro)):
            impl = layers[s]._impl
            impl.buffers.recv.fill_(float("nan"))
            if impl._y is not None:
                impl._y.fill_(float("nan"))
            outs.append(layers[s](h, wd, plan, ids, w, routes=r))
        torch.cuda.synchronize()
        res["bitwise"].append(bool(torch.equal(outs[0], outs[1]))
                              and not bool(torch.isnan(outs[1].float()).any()))
    for layer in layers.values():
        layer.check_errors()
    return res


def test_overlap_prepare_ordered_on_one_rank():
    from conftest import spawn_ranks
    res = spawn_ranks(_one_rank_worker, 1, backend="nccl", join_timeout_s=300)[0]
    assert all(res["rows"]) and all(res["tables"]) and all(res["inc"]), res
    assert all(res["bitwise"]), res


@pytest.mark.parametrize("W,Sc", [(1, 5), (2, 1152), (8, 8704), (64, 66560)])
def test_seg_add_kernel_adds_each_senders_prefix_only(W, Sc):
    """begin_call's advance of seg_expected (``add_seg_inc``, one kernel on CUDA) against the
    CPU path: only seg_count[s] words of row s (clamped to [0, Sc]) are read and written; the
    poison past the prefix never reaches seg_expected, whose other words keep their values."""
    from moe_overlap.combine.ordered_routes import add_seg_inc
    g = torch.Generator().manual_seed(W)
    exp = torch.randint(0, 1 << 20, (W, Sc), generator=g)
    inc = torch.randint(0, 300, (W, Sc), generator=g)
    cnt = torch.randint(0, min(Sc, 3000) + 1, (W,), generator=g).to(torch.int32)
    cnt[0] = Sc
    if W > 2:
        cnt[1], cnt[2] = -4, Sc + 7  # clamped
    for s, n in enumerate(cnt.tolist()):
        inc[s, max(0, min(n, Sc)):] = -0x5A5A5A5A5A5A5A5B
    want = exp.clone()
    add_seg_inc(want, inc, cnt)
    got = exp.to(DEV)
    add_seg_inc(got, inc.to(DEV), cnt.to(DEV))
    add_seg_inc(want, inc, cnt)
    add_seg_inc(got, inc.to(DEV), cnt.to(DEV))  # twice: it accumulates
    assert torch.equal(got.cpu(), want)
    assert bool((want >= 0).all())  # no poison added anywhere
