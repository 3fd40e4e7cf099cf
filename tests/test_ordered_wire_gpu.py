"""GPU check of ``CombineOptions(scale="ordered")`` on 2 GPUs (one NCCL rank each; issue 16 part
2, design A of bench/NOTES.md "Session 11": the ordered scale on the producer's stream after the
producer, per-segment arrivals from the consumers).

Two ``MoECombine`` layers of one shape, each on its own ``CommBuffer``: scale="plain" (the
default) and scale="ordered". CALLS fresh random routings and inputs; before every call both
ranks synchronize, NaN-poison the receive slots and the GEMM output of the layer about to run,
and meet at a barrier. Rank 1's consumer sleeps before every ordered call, so rank 0's ordered
scale starts long before rank 1's rows arrive and must wait for each segment. Every ordered
output must equal the plain one bit for bit (no NaN), and be within 8e-3 of the fp32 reference.

Broken variant (the test shows it fails): a third, ordered layer built with
MOE_OVERLAP_TEST_BROKEN_ORDER=seg_expected_frozen (begin_call does not advance seg_expected), the
same calls: rank 0's tiles then read rank 1's rows before they arrive (NaN-poisoned slots), so
some output differs from the plain one (or an error is raised).

Run: ``CUDA_MODULE_LOADING=EAGER NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest -q tests/test_ordered_wire_gpu.py``.
"""
import os

import pytest
import torch

from conftest import require_module, spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)

E, TOPK, K, N, TILE_M, T_MAX = 8, 2, 256, 512, 128, 256
CALLS = 6
SLEEP_CYCLES = 50_000_000  # ~25 ms at H200 clocks: far longer than the peer's whole call


def _layer(scale):
    from moe_overlap import MoECombine
    from moe_overlap.combine.comm_buffer import CommBuffer
    return MoECombine(E, K, N, TOPK, T_MAX, tile_m=TILE_M, backend="overlap", ccta=8,
                      transport="nvlink", validate=False, scale=scale,
                      comm_buffer=CommBuffer(None, "nvlink"))


def _cases(layer, rank, dev):
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.routing import route
    out = []
    for i in range(CALLS + 1):
        T = 64 + (i * 53 + 11) % (T_MAX - 63)
        ids, w = route(T, E, TOPK, mode="moderate_skew" if i % 2 else "balanced",
                       seed=500 + i, rank=rank, device=dev)
        counts = exchange_counts(ids, E)
        plan = layer.plan(counts)
        g = torch.Generator(device=dev).manual_seed(7000 + i * 10 + rank)
        h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
        wd = (torch.randn(E // 2, K, N, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
        out.append((h, wd, plan, ids, w, counts))
    return out


def _poison(layer):
    impl = layer._impl
    impl.buffers.recv.fill_(float("nan"))
    if impl._y is not None:
        impl._y.fill_(float("nan"))


def _run(layer, cases, routes):
    import torch.distributed as dist
    outs = []
    for i in range(1, CALLS + 1):
        h, wd, plan, ids, w, _ = cases[i]
        torch.cuda.synchronize()
        dist.barrier()  # no kernel of any rank runs: the poison lands before any row
        _poison(layer)
        torch.cuda.synchronize()
        dist.barrier()
        outs.append(layer(h, wd, plan, ids, w, routes=routes[i]))
    torch.cuda.synchronize()
    return outs


def _worker(rank, world):
    import torch.distributed as dist

    from moe_overlap.combine.comm_buffer import OverlapError
    from moe_overlap.combine.reference import reference_combine
    dev = torch.device("cuda", torch.cuda.current_device())
    res = {}
    plain, ordered = _layer("plain"), _layer("ordered")
    cases = _cases(plain, rank, dev)
    rp = [plain.prepare(c[2], c[3]) for c in cases]
    ro = [ordered.prepare(c[2], c[3], c[5]) for c in cases]
    res["ordered_impl"] = bool(ordered._impl.ordered) and not plain._impl.ordered
    res["seg_cap"] = ordered._impl.seg_cap
    for layer, routes in ((plain, rp), (ordered, ro)):  # warm-up: compiles, first barriers
        h, wd, plan, ids, w, _ = cases[0]
        layer(h, wd, plan, ids, w, routes=routes[0])
    torch.cuda.synchronize()
    dist.barrier()
    want = _run(plain, cases, rp)
    if rank == 1:
        ordered._impl._test_consumer_delay_cycles = SLEEP_CYCLES
    got = _run(ordered, cases, ro)
    res["bitwise"] = [bool(torch.equal(x, y)) for x, y in zip(got, want)]
    res["nan_free"] = [not bool(torch.isnan(x.float()).any()) for x in got]
    try:
        ordered.check_errors()
        res["err"] = ""
    except OverlapError as e:
        res["err"] = str(e)
    rel = 0.0
    for (h, wd, plan, ids, w, _), out in zip(cases[1:], got):
        ref = reference_combine(h.float(), wd.float(), plan, ids, w)
        rel = max(rel, float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)))
    res["worst_rel"] = rel
    _, exp = ordered._impl.comm.seg_tables(ordered._impl.seg_cap)
    res["seg_expected_total"] = int(exp.sum())
    # each call adds every sender's valid prefix of its routing's seg_inc (OrderedRoutes)
    res["seg_expected_want"] = sum(int(r.ordered["seg_inc"][s, :n].sum()) for r in ro
                                   for s, n in enumerate(r.ordered["seg_count"].tolist()))

    # the broken variant: seg_expected never advanced
    dist.barrier()
    os.environ["MOE_OVERLAP_TEST_BROKEN_ORDER"] = "seg_expected_frozen"
    try:
        broken = _layer("ordered")
        rb = [broken.prepare(c[2], c[3], c[5]) for c in cases]  # builds the backend (env read)
    finally:
        del os.environ["MOE_OVERLAP_TEST_BROKEN_ORDER"]
    h, wd, plan, ids, w, _ = cases[0]
    broken(h, wd, plan, ids, w, routes=rb[0])
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        broken._impl._test_consumer_delay_cycles = SLEEP_CYCLES
    try:
        bad = _run(broken, cases, rb)
        res["broken_bitwise"] = [bool(torch.equal(x, y)) for x, y in zip(bad, want)]
        broken.check_errors()
        res["broken_err"] = ""
    except OverlapError as e:  # a failure the device catches counts as failing loudly
        res["broken_err"] = str(e)
    return res


@pytest.fixture(scope="module")
def results():
    res = spawn_ranks(_worker, 2, backend="nccl", join_timeout_s=540, hard_exit=True)
    print(res)
    return res


def test_ordered_scale_bitwise_equal_to_the_plain_scale(results):
    for r in results:
        assert r["ordered_impl"], r
        assert r["err"] == "", r["err"]
        assert len(r["bitwise"]) == CALLS and all(r["bitwise"]), r
        assert all(r["nan_free"]), r
        assert r["worst_rel"] <= 8e-3, r
        # the cumulative expectation is the sum of every call's rows per segment (+ warm-up)
        assert r["seg_expected_total"] == r["seg_expected_want"] > 0, r


def test_frozen_seg_expected_gives_wrong_results(results):
    r0 = results[0]  # its peer's rows arrive late: the frozen expectation lets tiles run early
    assert r0["broken_err"] or not all(r0["broken_bitwise"]), r0
