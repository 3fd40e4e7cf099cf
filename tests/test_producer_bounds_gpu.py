"""GPU checks of the producer GEMM's device bounds (issue 21, validate=False plans) on ONE GPU.
One spawned process (NCCL group of 1, NVSHMEM with 1 PE, for the OverlapCombine part) runs every
check in sequence and writes JSON that the tests read.

- ``gemm``: ``GroupedGemm`` alone on hand-made band tables, every buffer it writes (y, band_ready,
  band_counter, the error word) a slice of a larger one whose guard rows / words are poisoned. Per
  corruption (num_bands over the capacity or negative, schedule entries outside [0, num_bands),
  experts outside w, band rows past / before y, misaligned, or near 2^31): the error word holds
  ERR_PRODUCER_BOUNDS with the rank and one of the entries ``band_faults`` names (position,
  field, value, bound); exactly the bands the host mirror keeps are computed (bf16 vs the fp32
  reference) and flagged, the refused bands' rows keep their poison and their flags stay unset;
  band_counter is all zero again; every guard is intact; the launch ends; after clearing the
  word the same GEMM is correct again. Three launch shapes: clusters of 2 on every SM, clusters
  of 2 on 4 SMs and clusters of 1 on 2 SMs (each CTA then walks, and skips, several tiles).
- ``combine``: ``OverlapCombine`` (W=1, v1: local copy + thread copies, v2: local_copy=False +
  TMA) with a plan corrupted after planning (an expert outside w, num_bands past the capacity,
  a schedule entry outside the bands): the call ends long before the consumer's 10 s timeout
  (its band wait stops at the error word: the refused band's flag never comes), the error word
  names the producer's field, ``out`` is all NaN, ``check_errors()`` raises with the
  describe_error text; then ``reset()`` and a correct call.

Run: ``CUDA_MODULE_LOADING=EAGER python -m pytest -q tests/test_producer_bounds_gpu.py``.
"""
import json
import os
import time

import pytest
import torch

from conftest import require_module, single_rank_json, worker_error

pytestmark = pytest.mark.gpu

require_module(gpus=1)

# GroupedGemm alone
EL, GK, GN, GTM, NB, CAP = 3, 256, 512, 128, 6, 8
ROWS = NB * GTM
GUARD_ROWS, GUARD_WORDS = 128, 64
POISON = 0x7F81  # bf16 bit pattern (a NaN) of every row the GEMM must not write
RANK = 5  # the rank the wrapper is told to record
# OverlapCombine, as tests/test_faults_gpu.py
E, TOPK, K, N, TILE_M, T_MAX = 4, 2, 256, 512, 128, 256
CONFIGS = {"v1": dict(local_copy=True, copy="ldst"), "v2": dict(local_copy=False, copy="tma")}
TIMEOUT_S = 10.0


def _guarded(n, fill, dtype, guard, dev, shape_tail=()):
    """(whole buffer, the middle slice of n entries); the whole buffer is ``fill`` first."""
    big = torch.empty((n + 2 * guard,) + shape_tail, dtype=dtype, device=dev)
    if dtype == torch.bfloat16:
        big.view(torch.int16).fill_(fill)
    else:
        big.fill_(fill)
    return big, big[guard:guard + n]


# corruptions of the band tables (be, bs, sched, nb: host lists / int), by name
def _corrupt(name, be, bs, sched, nb):
    s = sched
    if name == "nb_over":
        nb = CAP + 1
    elif name == "nb_neg":
        nb = -3
    elif name == "sched_huge":
        s[1] = 1 << 20
    elif name == "sched_neg":
        s[4] = -1
    elif name == "sched_pad":
        s[2] = NB  # a padding band (< capacity, >= num_bands)
    elif name == "expert":
        be[s[3]] = EL
    elif name == "expert_neg":
        be[s[0]] = -5
    elif name == "rows_past":
        bs[s[0]] = ROWS
    elif name == "rows_tail":
        bs[s[5]] = ROWS - GTM // 2  # its last rows past y (and misaligned)
    elif name == "rows_neg":
        bs[s[2]] = -GTM
    elif name == "rows_huge":
        bs[s[2]] = (1 << 31) - GTM  # r + tile_m overflows int32
    elif name == "misaligned":
        bs[s[1]] = GTM + 64
    elif name == "two_bad":
        be[s[1]] = EL + 1
        s[4] = -7
    elif name != "good":
        raise ValueError(name)
    return be, bs, s, nb


GEMM_CASES = ["good", "nb_over", "nb_neg", "sched_huge", "sched_neg", "sched_pad", "expert",
              "expert_neg", "rows_past", "rows_tail", "rows_neg", "rows_huge", "misaligned",
              "two_bad"]


def _gemm_checks(res):
    from moe_overlap.combine.grouped_gemm import GroupedGemm, band_faults
    from moe_overlap.kernels import errors as Er
    from moe_overlap.runtime.device import num_sms
    dev = torch.device("cuda", 0)
    sms = num_sms(dev)
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(ROWS, GK, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(EL, GK, GN, device=dev, generator=g) / GK ** 0.5).to(torch.bfloat16)
    ref_all = torch.einsum("rk,ekn->ern", x.float(), w.float())  # every band under every expert
    i32 = dict(dtype=torch.int32, device=dev)
    shapes = {"c2_all": (dict(), 0), "c2_grid4": (dict(), sms - 4),
              "c1_grid2": (dict(cluster_n=1), sms - 2)}
    epoch = torch.zeros(1, **i32)
    for sname, (kw, ccta) in shapes.items():
        gemm = GroupedGemm(tile_m=GTM, tile_n=256, **kw)
        y_big, y = _guarded(ROWS, POISON, torch.bfloat16, GUARD_ROWS, dev, (GN,))
        rd_big, ready = _guarded(CAP, -7, torch.int32, GUARD_WORDS, dev)
        ct_big, counter = _guarded(CAP, -7, torch.int32, GUARD_WORDS, dev)
        er_big, err = _guarded(Er.ERR_WORDS, -7, torch.int64, 8, dev)
        for case in GEMM_CASES + ["good_after"]:
            be = [b % EL for b in range(NB)] + [-1] * (CAP - NB)
            bs = [b * GTM for b in range(NB)] + [-1] * (CAP - NB)
            sched = [3, 0, 5, 1, 4, 2] + [-1] * (CAP - NB)
            be, bs, sched, nb = _corrupt(case if case != "good_after" else "good", be, bs,
                                         sched, NB)
            t_be, t_bs, t_s = (torch.tensor(v, **i32) for v in (be, bs, sched))
            t_nb = torch.tensor([nb], **i32)
            y.view(torch.int16).fill_(POISON)
            ready.zero_()
            counter.zero_()
            err.zero_()
            epoch.add_(1)
            torch.cuda.synchronize(dev)
            t0 = time.time()
            gemm(x, w, y, t_be, t_bs, t_s, t_nb, ready, epoch, ccta=ccta, band_counter=counter,
                 err=err, rank=RANK)
            torch.cuda.synchronize(dev)
            r = {"s": time.time() - t0}
            faults = band_faults(t_be, t_bs, t_s, t_nb, GTM, ROWS, EL, ROWS)
            r["faults"] = [list(f) for f in faults]
            r["err"] = [int(v) for v in err.tolist()]
            kept = {} if faults and faults[0][0] < 0 else {
                sched[p]: be[sched[p]] for p in range(nb) if p not in {f[0] for f in faults}}
            worst, poison_ok = 0.0, True
            yb = y.view(torch.int16)
            for b in range(NB):
                rows = slice(b * GTM, (b + 1) * GTM)  # band b's rows of a valid plan
                if b in kept:
                    assert bs[b] == b * GTM  # a kept band has its own rows
                    ref = ref_all[kept[b], rows]
                    worst = max(worst, float((y[rows].float() - ref).norm() / ref.norm()))
                else:
                    poison_ok &= bool((yb[rows] == POISON).all())
            r["kept"] = sorted(kept)
            r["worst_rel"] = worst
            r["refused_rows_poisoned"] = poison_ok
            r["flags"] = [int(v) for v in ready.tolist()]
            r["epoch"] = int(epoch.item())
            r["counter_zero"] = bool((counter == 0).all())
            r["guards"] = {
                "y": bool((y_big.view(torch.int16)[:GUARD_ROWS] == POISON).all()
                          and (y_big.view(torch.int16)[GUARD_ROWS + ROWS:] == POISON).all()),
                "ready": bool((rd_big[:GUARD_WORDS] == -7).all()
                              and (rd_big[GUARD_WORDS + CAP:] == -7).all()),
                "counter": bool((ct_big[:GUARD_WORDS] == -7).all()
                                and (ct_big[GUARD_WORDS + CAP:] == -7).all()),
                "err": bool((er_big[:8] == -7).all() and (er_big[16:] == -7).all())}
            r["msg"] = Er.describe_error(r["err"]) or ""
            res[f"gemm_{sname}_{case}"] = r


def _case(ov, T, seed):
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.routing import route
    dev = ov.device
    ids, w = route(T, E, TOPK, mode="moderate_skew", seed=seed, rank=ov.rank, device=dev)
    plan = plan_combine(exchange_counts(ids, E), ov.rank, tile_m=TILE_M, mgb=2,
                        max_rows=ov.world_size * T_MAX * TOPK, validate=False)
    g = torch.Generator(device=dev).manual_seed(seed)
    h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(ov.experts_per_rank, K, N, device=dev, generator=g) / K ** 0.5).to(
        torch.bfloat16)
    return ids, w, plan, h, wd


def _rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _combine_checks(ov, res, tag):
    from moe_overlap.combine.overlap import OverlapError
    from moe_overlap.combine.reference import reference_combine
    from moe_overlap.kernels import errors as Er
    dev = ov.device
    ids, w, plan, h, wd = _case(ov, 200, 1)
    out = ov.forward(h, wd, plan, ids, w)
    res[f"{tag}_good_rel"] = _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w))
    res[f"{tag}_good_err"] = [int(v) for v in ov.err.tolist()]
    for what in ("expert", "num_bands", "schedule"):
        ids, w, plan, h, wd = _case(ov, 180, 2)
        b0 = int(plan.schedule[0].item())
        if what == "expert":
            plan.band_expert[b0] = ov.experts_per_rank
        elif what == "num_bands":
            plan.num_bands.fill_(plan.band_capacity + 1)
        else:
            plan.schedule[0] = 1 << 20
        torch.cuda.synchronize(dev)
        t0 = time.time()
        out = ov.forward(h, wd, plan, ids, w)
        torch.cuda.synchronize(dev)
        r = {"s": time.time() - t0, "err": [int(v) for v in ov.err.tolist()],
             "out_nan": bool(torch.isnan(out.float()).all())}
        try:
            ov.check_errors()
            r["raised"] = ""
        except OverlapError as e:
            r["raised"] = str(e)
        r["msg"] = Er.describe_error(r["err"]) or ""
        ov.reset()
        ids, w, plan, h, wd = _case(ov, 150, 3)
        out = ov.forward(h, wd, plan, ids, w)
        r["after_reset_rel"] = _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w))
        r["after_reset_err"] = [int(v) for v in ov.err.tolist()]
        res[f"{tag}_{what}"] = r


def _worker(rank, world, port, outdir):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    res = {}
    try:
        _gemm_checks(res)
    except Exception as e:
        res["gemm_error"] = worker_error(e)
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        from moe_overlap.combine.overlap import OverlapCombine
        for tag, opts in CONFIGS.items():
            try:
                ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N,
                                    topk=TOPK, max_tokens_per_rank=T_MAX, tile_m=TILE_M, ccta=8,
                                    transport="nvlink", timeout_s=TIMEOUT_S, **opts)
                _combine_checks(ov, res, tag)
            except Exception as e:
                res[f"{tag}_error"] = worker_error(e)
    except Exception as e:
        res["error"] = worker_error(e)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    os._exit(0)  # skip NCCL / NVSHMEM teardown ordering issues


@pytest.fixture(scope="module")
def results():
    r = single_rank_json(_worker)
    assert "error" not in r, r["error"]
    return r


@pytest.mark.parametrize("shape", ["c2_all", "c2_grid4", "c1_grid2"])
@pytest.mark.parametrize("case", GEMM_CASES + ["good_after"])
def test_gemm_refuses_bad_bands_and_stays_in_bounds(results, shape, case):
    from moe_overlap.kernels import errors as Er
    assert "gemm_error" not in results, results["gemm_error"]
    r = results[f"gemm_{shape}_{case}"]
    assert all(r["guards"].values()), r  # nothing written outside y / band_ready / counter / err
    assert r["counter_zero"], r
    assert r["refused_rows_poisoned"] and r["worst_rel"] < 1e-2, r
    flagged = [b for b, v in enumerate(r["flags"]) if v == r["epoch"]]
    assert flagged == r["kept"], r  # exactly the computed bands are flagged
    assert all(v in (0, r["epoch"]) for v in r["flags"]), r
    err = r["err"]
    if case.startswith("good"):
        assert not r["faults"] and err == [0] * 8 and r["kept"] == list(range(NB)), r
        return
    assert r["faults"], r  # the host mirror sees the corruption too
    assert err[0] == Er.ERR_PRODUCER_BOUNDS and err[1] == RANK, r
    assert err[2:6] in r["faults"], r  # one of the refused entries, exactly as named
    assert len(r["kept"]) == (0 if r["faults"][0][0] < 0 else NB - len(r["faults"])), r
    assert Er.PRODUCER_FIELDS[err[3]] in r["msg"], r


@pytest.fixture(params=list(CONFIGS))
def tag(request, results):
    assert f"{request.param}_error" not in results, results[f"{request.param}_error"]
    return request.param


def test_combine_good_call(results, tag):
    assert results[f"{tag}_good_rel"] < 1e-2 and results[f"{tag}_good_err"][0] == 0, results


@pytest.mark.parametrize("what,field", [("expert", 2), ("num_bands", 0), ("schedule", 1)])
def test_combine_bad_plan_ends_with_the_producer_error(results, tag, what, field):
    from moe_overlap.kernels import errors as Er
    r = results[f"{tag}_{what}"]
    # the consumer's band wait ends at the error word, not at its timeout
    assert r["s"] < TIMEOUT_S / 3, r
    assert r["err"][0] == Er.ERR_PRODUCER_BOUNDS and r["err"][3] == field, r
    assert r["out_nan"], r
    assert "producer GEMM refused" in r["raised"] and Er.PRODUCER_FIELDS[field] in r["raised"], r
    assert r["after_reset_err"][0] == 0 and r["after_reset_rel"] < 1e-2, r
