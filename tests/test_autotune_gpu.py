"""GPU checks of ``MoECombine.autotune`` with the real overlap backend on ONE GPU (a world of one
rank: NCCL group of 1, NVSHMEM with 1 PE), including ``CombineOptions(order="auto")``. One
spawned process runs every check in sequence and writes JSON that the tests read; the tune cache
is a fresh file (``$MOE_OVERLAP_TUNE_CACHE`` set in that process, so layers built there resolve
"auto" from it). Per consumer config (v1: local copy + thread copies, so the consumer copies this
rank's rows; v2: local_copy=False + TMA, the nvlink default, where the scale reads them straight
from the GEMM output):

- ``auto``: a layer with order="auto" tuned over 3 (ccta, mgb) candidates (none of them the
  analytic first guess) returns a candidate, sets ``options.order`` to one of the two orders,
  times every candidate in both orders (every plan the tuner timed is recorded: its order and
  mgb) and writes, under the key of the requested options (``|order=auto|``), an entry holding
  ccta, mgb and that order, whose ``tried`` has every (ccta, mgb, order) and whose pick is the
  fastest of them; tuning again finds the entry and times nothing;
- ``forward``: after tuning, forward on fresh random inputs (dispatched into the plan layout
  by ``dispatch_to_plan``) with the producer output y and the receive slots poisoned with NaN
  beforehand is finite, within 8e-3 (relative norm) of an fp32 reference computed here from the
  token rows (sum_k w[t, k] * x[t] @ w_down[e(t, k)], no plan), the same bits in two calls,
  bitwise equal to the same call made on the overlap backend directly into a NaN-poisoned
  ``out`` (every output row written), and bitwise equal to a layer of the same ccta / mgb and
  the other explicit order;
- ``resolve``: a new layer with order="auto" resolves ccta, mgb and order from the entry (and
  from an entry rewritten to the other order, that order);
- ``expert``: a layer with explicit order="expert" tunes under its own key (``|order=expert|``),
  times only expert-order plans, and writes an entry without an order (``tried`` keyed
  "ccta,mgb"); the order="auto" entry is left as it was.

What one rank cannot show (from the code; nothing here is skipped):
- ``MoECombine(backend="auto")`` runs the reference backend at W=1 (``backend_for``: overlap only
  with world_size > 1), so every layer here asks for backend="overlap".
- No band holds a remote row, so the remote_first schedule (remote bands first, then the rest by
  expert) is the band order itself: both orders give the same plan tensors (checked,
  ``test_orders_give_the_same_plan_at_one_rank``). The bitwise check between the orders proves
  the order is carried through (layer plans, the plan kernel's expert variant, the tune entry)
  without changing the sums, not that the expert-order schedule ships remote rows right (that
  needs 2 GPUs: sweep.py --order expert). For the same reason which order the tuner picks is
  timing noise here: the tests check that the pick is the fastest the entry records, not which.
- mgb cuts only remote segments, so at W=1 it changes the plan's mgb and nothing else; ccta
  changes the producer's grid (and, v1, the consumer CTAs of the local copy).

Run: ``CUDA_MODULE_LOADING=EAGER python -m pytest -q tests/test_autotune_gpu.py``.
"""
import math
import os

import pytest
import torch

from conftest import (bitwise_equal, record_single_rank, require_module, single_rank_json,
                      worker_error)

pytestmark = pytest.mark.gpu

require_module(gpus=1)

E, TOPK, K, N, TILE_M, T_MAX = 8, 2, 256, 512, 128, 256
T_TUNE, T_CHECK = 256, 200  # tokens of the tuning input and of the fresh input checked after
POOL = ((8, 2), (16, 1), (12, 4), (20, 2))  # (ccta, mgb) candidates: the first 3 not the guess
REPS = 2  # calls per timed CUDA graph
CONFIGS = {"v1": dict(local_copy=True, copy="ldst"), "v2": dict(local_copy=False, copy="tma")}
ORDERS = ("remote_first", "expert")  # moe_overlap.combine.options.ORDERS (checked in _run)

_TIMED = []  # (order, mgb) of every plan autotune timed (its plan_combine(validate=False) calls)


def _spy_timed_plans():
    """Wrap layer.py's plan_combine: the tuner's timed plans are its validate=False calls
    (``MoECombine.plan`` of these validate=True layers passes validate=True)."""
    import moe_overlap.combine.layer as layer_mod
    real = layer_mod.plan_combine

    def spy(*args, **kw):
        plan = real(*args, **kw)
        if kw.get("validate", True) is False:
            _TIMED.append([plan.order, plan.mgb])
        return plan

    layer_mod.plan_combine = spy


def _layer(cfg, **opts):
    from moe_overlap.combine import CombineOptions, MoECombine
    return MoECombine(E, K, N, TOPK, T_MAX, tile_m=TILE_M, backend="overlap",
                      options=CombineOptions(**cfg, **opts))


def _inputs(T, seed, dev):
    """(topk_ids, topk_weights, counts [1, E], token rows x [T, K], w_down [E, K, N])."""
    from moe_overlap.combine import exchange_counts
    from moe_overlap.routing import route
    ids, w = route(T, E, TOPK, mode="moderate_skew", seed=seed, rank=0, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(E, K, N, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
    return ids, w, exchange_counts(ids, E), x, wd


def _reference(x, wd, ids, w):
    """fp32 combine from the token rows, without the plan (W=1: every expert is local)."""
    y = torch.einsum("tk,ekn->ten", x.float(), wd.float())  # [T, E, N]
    picked = y.gather(1, ids.long()[..., None].expand(-1, -1, N))  # [T, topk, N]
    return (picked * w.float()[..., None]).sum(1)


def _rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))



def _poison(layer, h, plan):
    """NaN into the producer output y this call will use and into the receive slots."""
    impl = layer._overlap_impl(h.device)
    torch.cuda.synchronize()
    impl.buffers_for(h, plan)[0].fill_(float("nan"))
    impl.recv.fill_(float("nan"))
    return impl


def _forward(layer, h, wd, plan, ids, w):
    """Two poisoned calls (the first of a new layer also warms its producer up, which writes
    y before the call does): the second's output, and whether both gave the same bits."""
    outs = []
    for _ in range(2):
        _poison(layer, h, plan)
        outs.append(layer(h, wd, plan, ids, w))
        layer.check_errors()
    return outs[1], bitwise_equal(*outs)


def _config(tag, cfg, dev, res, cache):
    from moe_overlap.combine import dispatch_to_plan
    from moe_overlap.combine.tuning import TuneCache
    p = f"{tag}_"

    # ---- order="auto": both orders searched, the order cached with the pair ----
    a = _layer(cfg, order="auto")
    first = (a.ccta, a.mgb)
    res[p + "first"] = [a.ccta, a.mgb, a.options.order]
    cands = [cm for cm in POOL if cm != first][:3]
    res[p + "candidates"] = [list(cm) for cm in cands]
    res[p + "key"] = a.tune_key
    ids, w, counts, x, wd = _inputs(T_TUNE, 1, dev)
    h = dispatch_to_plan(x, ids, a.plan(counts), counts)
    _TIMED.clear()
    choice = a.autotune(h, wd, counts, ids, w, candidates=cands, reps=REPS, cache=cache)
    res[p + "choice"] = [int(choice[0]), int(choice[1]), a.options.order]
    res[p + "layer_after"] = [a.ccta, a.mgb, a.options.order, a.tune_key]
    res[p + "timed"] = list(_TIMED)
    res[p + "entry"] = TuneCache(cache.path).entry(a.tune_key)  # as written to the file
    _TIMED.clear()
    again = a.autotune(h, wd, counts, ids, w, candidates=cands, reps=REPS, cache=cache)
    res[p + "retune"] = [[int(v) for v in again], a.options.order, len(_TIMED)]

    # ---- forward on fresh inputs: fp32 reference, poisoned out, the other order bitwise ----
    ids2, w2, counts2, x2, wd2 = _inputs(T_CHECK, 2, dev)
    ref = _reference(x2, wd2, ids2, w2)
    plan_a = a.plan(counts2)
    res[p + "plan_a"] = [plan_a.order, plan_a.mgb]
    h2 = dispatch_to_plan(x2, ids2, plan_a, counts2)
    out_a, res[p + "repeat_bitwise_a"] = _forward(a, h2, wd2, plan_a, ids2, w2)
    res[p + "rel_a"] = _rel(out_a, ref)
    res[p + "finite_a"] = bool(torch.isfinite(out_a.float()).all())
    impl = _poison(a, h2, plan_a)
    direct = torch.full((T_CHECK, N), float("nan"), dtype=torch.bfloat16, device=dev)
    impl.forward(h2, wd2, plan_a, ids2, w2, out=direct, ccta=a.ccta)
    a.check_errors()
    res[p + "direct_bitwise"] = bitwise_equal(out_a, direct)

    other = ORDERS[1 - ORDERS.index(a.options.order)]
    b = _layer(cfg, ccta=a.ccta, mgb=a.mgb, order=other)
    plan_b = b.plan(counts2)
    res[p + "plan_b"] = [plan_b.order, plan_b.mgb, b.ccta]
    tb = plan_b.tensors()
    res[p + "plan_diff"] = [k for k, t in plan_a.tensors().items() if not torch.equal(t, tb[k])]
    h2b = dispatch_to_plan(x2, ids2, plan_b, counts2)
    out_b, res[p + "repeat_bitwise_b"] = _forward(b, h2b, wd2, plan_b, ids2, w2)
    res[p + "finite_b"] = bool(torch.isfinite(out_b.float()).all())
    res[p + "rel_b"] = _rel(out_b, ref)
    res[p + "other_bitwise"] = bitwise_equal(out_a, out_b)

    # ---- a new order="auto" layer resolves the tuned pair and order from the entry ----
    d = _layer(cfg, order="auto")
    plan_d = d.plan(counts2)
    res[p + "resolved"] = [d.ccta, d.mgb, d.options.order, d.tune_key, plan_d.order, plan_d.mgb]

    # ---- explicit order="expert": its own key, only expert-order plans timed ----
    xl = b if other == "expert" else _layer(cfg, ccta=a.ccta, mgb=a.mgb, order="expert")
    _TIMED.clear()
    cx = xl.autotune(h, wd, counts, ids, w, candidates=cands, reps=REPS, cache=cache)
    res[p + "x_choice"] = [int(cx[0]), int(cx[1]), xl.options.order, xl.plan(counts).order]
    res[p + "x_key"] = xl.tune_key
    res[p + "x_timed"] = list(_TIMED)
    disk = TuneCache(cache.path)
    res[p + "x_entry"] = disk.entry(xl.tune_key)
    res[p + "entry_after_x"] = disk.entry(a.tune_key)

    # ---- an entry holding the other order: a new order="auto" layer takes that order ----
    e = dict(res[p + "entry"])
    cache.put(a.tune_key, e.pop("ccta"), e.pop("mgb"), **dict(e, order=other))
    f = _layer(cfg, order="auto")
    res[p + "flipped"] = [other, f.options.order, f.ccta, f.mgb]


def _run(dev, res):
    from moe_overlap.combine.options import ORDERS as LIB_ORDERS
    from moe_overlap.combine.tuning import TuneCache
    res["orders"] = list(LIB_ORDERS)
    assert tuple(LIB_ORDERS) == ORDERS, LIB_ORDERS
    _spy_timed_plans()
    cache = TuneCache()  # $MOE_OVERLAP_TUNE_CACHE: the fresh file every layer here resolves from
    res["cache_path"] = cache.path
    for tag, cfg in CONFIGS.items():
        try:
            _config(tag, cfg, dev, res, cache)
        except Exception as e:
            res[f"{tag}_error"] = worker_error(e)
            try:  # the buffer is shared: a sticky device error would fail the next config too
                from moe_overlap.combine import CommBuffer
                CommBuffer.shared(None, "nvlink", torch.bfloat16).reset()
            except Exception as e2:  # noqa: BLE001 - recorded, the next config may still run
                res[f"{tag}_reset_error"] = f"{type(e2).__name__}: {e2}"


def _worker(rank, world, port, outdir):
    import tempfile

    def body(res):
        os.environ["MOE_OVERLAP_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(), "tune.json")
        _run(torch.device("cuda", rank), res)
    record_single_rank(rank, world, port, outdir, body)


@pytest.fixture(scope="module")
def results():
    r = single_rank_json(_worker)
    assert "error" not in r, r["error"]
    return r


@pytest.fixture(params=list(CONFIGS))
def tag(request, results):
    assert f"{request.param}_error" not in results, results[f"{request.param}_error"]
    return request.param


def _cands(r, tag):
    return [tuple(cm) for cm in r[f"{tag}_candidates"]]


def test_order_auto_tunes_both_orders_and_caches_the_order(results, tag):
    r, p = results, f"{tag}_"
    cands = _cands(r, tag)
    assert len(cands) == 3 and tuple(r[p + "first"][:2]) not in cands, r[p + "first"]
    c, m, order = r[p + "choice"]
    assert (c, m) in cands and order in ORDERS, r[p + "choice"]
    assert r[p + "layer_after"] == [c, m, order, r[p + "key"]]  # the key stays the requested one
    assert "|order=auto|" in r[p + "key"], r[p + "key"]
    # every candidate timed once in each order, each order with its own plans
    assert sorted(map(tuple, r[p + "timed"])) == sorted((o, mm) for o in ORDERS
                                                        for _, mm in cands), r[p + "timed"]
    e = r[p + "entry"]
    assert e is not None and (e["ccta"], e["mgb"], e.get("order")) == (c, m, order), e
    tried = e["tried"]
    assert set(tried) == {f"{cc},{mm},{o}" for cc, mm in cands for o in ORDERS}, tried
    assert all(math.isfinite(t) and t > 0 for t in tried.values()), tried
    assert e["ms"] == min(tried.values()) == tried[f"{c},{m},{order}"], e
    # a bucket found in the cache is not timed again
    assert r[p + "retune"] == [[c, m], order, 0], r[p + "retune"]


def test_tuned_forward_matches_the_other_order_bitwise_and_the_reference(results, tag):
    r, p = results, f"{tag}_"
    c, m, order = r[p + "choice"]
    other = ORDERS[1 - ORDERS.index(order)]
    assert r[p + "plan_a"] == [order, m] and r[p + "plan_b"] == [other, m, c], r
    assert r[p + "finite_a"] and r[p + "finite_b"], r
    assert r[p + "rel_a"] <= 8e-3 and r[p + "rel_b"] <= 8e-3, (r[p + "rel_a"], r[p + "rel_b"])
    assert r[p + "repeat_bitwise_a"] and r[p + "repeat_bitwise_b"], "two calls differ"
    assert r[p + "direct_bitwise"], "the call into a NaN-poisoned out differs from forward"
    assert r[p + "other_bitwise"], f"order={order} and order={other} outputs differ"


def test_new_auto_layer_resolves_pair_and_order_from_the_entry(results, tag):
    r, p = results, f"{tag}_"
    c, m, order = r[p + "choice"]
    assert r[p + "resolved"] == [c, m, order, r[p + "key"], order, m], r[p + "resolved"]
    assert (c, m) != tuple(r[p + "first"][:2])  # read from the entry, not the analytic guess
    other, got, fc, fm = r[p + "flipped"]
    assert got == other != order and (fc, fm) == (c, m), r[p + "flipped"]


def test_explicit_expert_order_times_only_expert_plans(results, tag):
    r, p = results, f"{tag}_"
    cands = _cands(r, tag)
    key, kx = r[p + "key"], r[p + "x_key"]
    assert kx != key and kx == key.replace("|order=auto|", "|order=expert|"), (key, kx)
    assert sorted(map(tuple, r[p + "x_timed"])) == sorted(("expert", mm) for _, mm in cands), \
        r[p + "x_timed"]
    cx, mx, ox, plan_order = r[p + "x_choice"]
    assert (cx, mx) in cands and ox == plan_order == "expert", r[p + "x_choice"]
    ex = r[p + "x_entry"]
    assert ex is not None and (ex["ccta"], ex["mgb"]) == (cx, mx) and "order" not in ex, ex
    assert set(ex["tried"]) == {f"{cc},{mm}" for cc, mm in cands}, ex
    assert r[p + "entry_after_x"] == r[p + "entry"]  # the order="auto" entry untouched


def test_orders_give_the_same_plan_at_one_rank(results, tag):
    """The premise of the docstring's W=1 note: no remote band, so the schedules coincide."""
    assert results[f"{tag}_plan_diff"] == [], results[f"{tag}_plan_diff"]
