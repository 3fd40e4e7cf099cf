"""GPU checks of the combine without a consumer (issue 36) on ONE GPU: a group of one rank (NCCL
group of 1, NVSHMEM with 1 PE), where no row leaves the rank. One spawned process runs every
check and writes JSON that the tests read.

- ``MoECombine(backend="overlap")`` with the default options resolves ccta to 0 (nvlink, no
  local copy); its calls launch no consumer kernel (the consumer's launcher is wrapped by a
  counter from construction on, warm-up included) and run the producer on every SM without
  band flags (the producer's launches are recorded);
- its output is bitwise equal to the same layer with a consumer (explicit ccta=8, the path every
  call took before), to that layer's non-overlapped call (``forward(overlap=False)``) and to a
  scale="ordered" layer of ccta 0, finite, within 8e-3 of an fp32 reference from the token rows;
  two calls with the output buffer poisoned give the same bits;
- the same call captured in a CUDA graph and replayed gives the same bits, with no consumer
  launch;
- a per-call ccta=8 on the ccta-0 layer (what the tuner does) after ccta-0 calls ships and
  returns the same bits without a timeout: the arrival counters and expected counts stayed in
  step; the error word is clear at the end.

Run: ``CUDA_MODULE_LOADING=EAGER python -m pytest -q tests/test_no_consumer_gpu.py``.
"""

import pytest
import torch

from conftest import bitwise_equal, record_single_rank, require_module, single_rank_json

pytestmark = pytest.mark.gpu

require_module(gpus=1)

E, TOPK, K, N, TILE_M, T_MAX, T = 8, 2, 512, 1024, 128, 512, 400



def _run(dev, res):
    from moe_overlap.combine import MoECombine, dispatch_to_plan, exchange_counts
    from moe_overlap.routing import route
    ids, gates = route(T, E, TOPK, mode="moderate_skew", seed=3, rank=0, device=dev)
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(T, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(E, K, N, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
    counts = exchange_counts(ids, E)
    y32 = torch.einsum("tk,ekn->ten", x.float(), wd.float())
    ref = (y32.gather(1, ids.long()[..., None].expand(-1, -1, N)) * gates.float()[..., None]
           ).sum(1)

    launches = {"consumer": 0, "producer": []}

    def layer(**kw):
        c = MoECombine(E, K, N, TOPK, T_MAX, tile_m=TILE_M, backend="overlap", validate=False,
                       **kw)
        impl = c._overlap_impl(dev)
        real_launch, real_produce = impl.consumer.launch, impl.produce

        def counted(*a, **k):
            launches["consumer"] += 1
            return real_launch(*a, **k)

        def produce(*a, ccta=None, flags=True, **k):
            launches["producer"].append([ccta, flags])
            return real_produce(*a, ccta=ccta, flags=flags, **k)
        impl.consumer.launch, impl.produce = counted, produce
        return c, impl

    # every layer built before the first call (they share the communication buffer, which a
    # captured call pins: README, Memory)
    alone, impl0 = layer()
    beside, impl8 = layer(ccta=8)
    ordered, _ = layer(scale="ordered")
    res["resolved"] = [alone.ccta, bool(alone.options.local_copy), impl0.ccta]
    plan = alone.plan(counts)
    h = dispatch_to_plan(x, ids, plan, counts)
    outs = []
    for _ in range(2):
        torch.cuda.synchronize()
        impl0.buffers_for(h, plan)[0].fill_(float("nan"))
        outs.append(alone(h, wd, plan, ids, gates).clone())
    alone.check_errors()
    res["alone_consumer_launches"] = launches["consumer"]
    res["alone_producer_launches"] = list(launches["producer"])
    res["alone_repeat_bitwise"] = bitwise_equal(*outs)
    res["alone_finite"] = bool(torch.isfinite(outs[0].float()).all())
    res["alone_rel"] = float((outs[0].float() - ref).norm() / ref.norm())

    # a CUDA graph of the call: replays give the same bits, still no consumer
    routes = alone.prepare(plan, ids)
    static = alone(h, wd, plan, ids, gates, routes=routes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = alone(h, wd, plan, ids, gates, routes=routes)
    static.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    alone.check_errors()
    res["graph_bitwise"] = bitwise_equal(static, outs[0])
    res["graph_consumer_launches"] = launches["consumer"]

    # the same layer with a per-call consumer (the tuner's candidates) after those calls
    launches["producer"].clear()
    per_call = alone._impl.forward(h, wd, plan, ids, gates, ccta=8)
    alone.check_errors()
    res["per_call_bitwise"] = bitwise_equal(per_call, outs[0])
    res["per_call_consumer_launches"] = launches["consumer"]  # warm-up + this call
    res["per_call_producer_launches"] = list(launches["producer"])

    # the path every call took before: a consumer beside the producer, and its reference
    launches["consumer"] = 0
    res["beside_ccta"] = beside.ccta
    plan8 = beside.plan(counts)
    h8 = dispatch_to_plan(x, ids, plan8, counts)
    out8 = beside(h8, wd, plan8, ids, gates)
    out8_seq = impl8.forward(h8, wd, plan8, ids, gates, overlap=False)
    beside.check_errors()
    res["beside_consumer_launches"] = launches["consumer"]
    res["beside_bitwise"] = bitwise_equal(out8, outs[0])
    res["beside_sequential_bitwise"] = bitwise_equal(out8_seq, outs[0])

    # scale="ordered" resolves to ccta 0 too: the same call, the same bits
    launches["consumer"] = 0
    res["ordered_ccta"] = ordered.ccta
    plan_o = ordered.plan(counts)
    out_o = ordered(dispatch_to_plan(x, ids, plan_o, counts), wd, plan_o, ids, gates)
    ordered.check_errors()
    res["ordered_bitwise"] = bitwise_equal(out_o, outs[0])
    res["ordered_consumer_launches"] = launches["consumer"]
    res["err_final"] = [int(v) for v in impl0.err.tolist()]


def _worker(rank, world, port, outdir):
    def body(res):
        with torch.inference_mode():
            _run(torch.device("cuda", rank), res)
    record_single_rank(rank, world, port, outdir, body)


@pytest.fixture(scope="module")
def results():
    r = single_rank_json(_worker)
    assert "error" not in r, r["error"]
    return r


def test_one_rank_resolves_to_no_consumer_and_launches_none(results):
    r = results
    assert r["resolved"] == [0, False, 0], r["resolved"]
    assert r["alone_consumer_launches"] == 0 and r["graph_consumer_launches"] == 0, r
    # every producer launch of those calls: every SM, no band flags (no warm-up pass needed:
    # nothing spins beside it)
    assert r["alone_producer_launches"] and all(
        p == [0, False] for p in r["alone_producer_launches"]), r["alone_producer_launches"]
    assert r["ordered_ccta"] == 0 and r["ordered_consumer_launches"] == 0, r
    assert r["beside_ccta"] == 8 and r["beside_consumer_launches"] >= 2, r  # warm-up + call


def test_output_bitwise_equal_to_the_call_with_a_consumer(results):
    r = results
    assert r["alone_finite"] and r["alone_rel"] <= 8e-3, r
    assert r["alone_repeat_bitwise"] and r["graph_bitwise"], r
    assert r["beside_bitwise"] and r["beside_sequential_bitwise"], r
    assert r["ordered_bitwise"], r


def test_per_call_consumer_after_calls_without_one_stays_in_step(results):
    r = results
    assert r["per_call_bitwise"], r
    assert r["per_call_consumer_launches"] == 2, r  # the consumer's warm-up, then the call
    assert [8, True] in r["per_call_producer_launches"], r["per_call_producer_launches"]
    assert r["err_final"][0] == 0, r["err_final"]
