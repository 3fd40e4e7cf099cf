"""GPU checks of GroupedGemm(tile_fetch="dynamic") (skipped without CUDA / CuTe DSL): on rank 0's
plan of a skewed model routing (tests/test_grouped_gemm_gpu.py's MODEL_PLANS), y is bitwise the
static kernel's on every valid row (only which CTA computes a tile changes), rows of no band stay
NaN, every band's flag is at the epoch, the band counters are back to 0, the error word is clear,
and the work counter ends at exactly total_tiles / cluster_n (each unit handed out once, past the
first wave, plus one stop per cluster that fetched: that sum is the unit count whatever the
timing); twice in a row (the counter is zeroed before each launch), inside a CUDA graph, and with
part of the grid starting late (tests/sm_hold.py holds SMs when the producer launches)."""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

sys.path.insert(0, os.path.dirname(__file__))
from sm_hold import build_sm_hold  # noqa: E402
from test_grouped_gemm_gpu import K, N, _model_plan, _valid_rows  # noqa: E402

from moe_overlap.combine.grouped_gemm import GroupedGemm  # noqa: E402
from moe_overlap.runtime.device import num_sms  # noqa: E402

DEV = "cuda"
TILE_M, TILE_N = 128, 256
_GEMMS = {}


def _gemm(**kw):
    key = tuple(sorted(kw.items()))
    if key not in _GEMMS:
        _GEMMS[key] = GroupedGemm(tile_m=TILE_M, tile_n=TILE_N, **kw)
    return _GEMMS[key]


def _setup(name):
    plan, El = _model_plan(name, TILE_M)
    rows = int(plan.total_rows.item()) + TILE_M
    g = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(rows, K, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(El, K, N, device=DEV, generator=g) / K ** 0.5).to(torch.bfloat16)
    return plan, x, w, rows


def _run(gemm, plan, x, w, rows, epoch, ccta=0, stream=None):
    y = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=DEV)
    ep = torch.full((1,), epoch, dtype=torch.int32, device=DEV)
    gemm(x, w, y, plan.band_expert, plan.band_src_row, plan.schedule, plan.num_bands, ready, ep,
         ccta=ccta, stream=stream)
    return y, ready


def _check(gemm, plan, y, ready, y_ref, rows, epoch):
    """The properties of the module docstring for one dynamic launch."""
    nb = int(plan.num_bands.item())
    valid = _valid_rows(plan, TILE_M)[:rows]
    assert torch.equal(y[valid].view(torch.int16), y_ref[valid].view(torch.int16))
    assert torch.isnan(y[~valid].float()).all(), "rows of no band were written"
    if gemm.signal:
        sched = plan.schedule[:nb].long()
        assert bool((ready[sched] == epoch).all()) and int((ready != 0).sum()) == nb
    else:
        assert int((ready != 0).sum()) == 0, "a flag written by the kernel built without flags"
    assert int(gemm._counters[(y.device, plan.band_capacity)].abs().sum()) == 0
    assert int(gemm.error_word(y.device).abs().sum()) == 0, "error word set"
    cluster = gemm.cluster_for(N)
    units = nb * (N // TILE_N) // cluster
    counter = gemm._fetch_counters[(y.device, plan.band_capacity)]
    assert int(counter.item()) == units, "the work counter is not the unit count"


CASES = [  # (plan, GroupedGemm options besides tile_fetch, ccta)
    ("deepseek-v3@16384", dict(cluster_n=1), 0),
    ("deepseek-v3@16384", dict(cluster_n=2), 0),
    ("deepseek-v3@4096 W8", dict(cluster_n=2), 16),
    ("deepseek-v3@4096 W8", dict(cluster_n=1, group_by="expert"), 8),
    ("deepseek-v3@4096 W2 expert order", dict(cluster_n=2, group_by="expert"), 0),
    ("mixtral@16384", dict(cluster_n=2, flag_warp=False), 24),
    ("mixtral@16384", dict(cluster_n=1), 0),
    # the launch with no consumer (W = 1: every SM, no flags) with the GEMM's own clusters
    ("deepseek-v3@16384", dict(signal=False), 0),
    ("mixtral@16384", dict(signal=False), 0),
]


@pytest.mark.parametrize("name,extra,ccta", CASES)
def test_dynamic_fetch_is_bitwise_the_static_output(name, extra, ccta):
    plan, x, w, rows = _setup(name)
    y_ref, _ = _run(_gemm(**extra), plan, x, w, rows, 1, ccta)
    dyn = _gemm(tile_fetch="dynamic", **extra)
    for epoch in (1, 2):  # a second launch: the counter must start from 0 again
        y, ready = _run(dyn, plan, x, w, rows, epoch, ccta)
        torch.cuda.synchronize()
        _check(dyn, plan, y, ready, y_ref, rows, epoch)


@pytest.mark.parametrize("cluster_n", [1, 2])
def test_dynamic_fetch_in_a_cuda_graph(cluster_n):
    """Captured once, replayed twice: the counter's zeroing is a node of the graph."""
    plan, x, w, rows = _setup("deepseek-v3@4096 W8")
    y_ref, _ = _run(_gemm(cluster_n=cluster_n), plan, x, w, rows, 1)
    dyn = _gemm(tile_fetch="dynamic", cluster_n=cluster_n)
    y = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=DEV)
    ep = torch.ones(1, dtype=torch.int32, device=DEV)
    args = (x, w, y, plan.band_expert, plan.band_src_row, plan.schedule, plan.num_bands, ready,
            ep)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dyn(*args)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        dyn(*args)
    for epoch in (2, 3):
        y.fill_(float("nan"))
        ready.zero_()
        ep.fill_(epoch)
        graph.replay()
        torch.cuda.synchronize()
        _check(dyn, plan, y, ready, y_ref, rows, epoch)


@pytest.mark.parametrize("name,extra,held", [
    ("mixtral@16384", dict(cluster_n=2), 24), ("mixtral@16384", dict(cluster_n=1), 24),
    ("deepseek-v3@16384", dict(cluster_n=2), 17),
    ("deepseek-v3@4096 W8", dict(cluster_n=2, group_by="expert"), 31)])
def test_dynamic_fetch_with_part_of_the_grid_starting_late(name, extra, held):
    """A stand-in consumer holds ``held`` SMs for 5 ms when the producer (grid: every SM)
    launches, so its clusters on those SMs (and clusters of 2 that find no free pair) start
    after the hold; the dynamic output is still bitwise the static one (and the static one
    beside the same hold too). The makespans are printed (pytest -s), not asserted."""
    plan, x, w, rows = _setup(name)
    y_ref, _ = _run(_gemm(**extra), plan, x, w, rows, 1)
    torch.cuda.synchronize()
    import cuda.bindings.driver as cuda_drv
    import cutlass
    import cutlass.cute as cute
    hold = cute.compile(build_sm_hold(), cutlass.Int64(0), cutlass.Int64(1), cutlass.Int32(1),
                        cuda_drv.CUstream(0), cuda_drv.CUstream(0))
    assert held < num_sms(torch.device(DEV)) // 2
    hold_stream, stream = torch.cuda.Stream(), torch.cuda.Stream()
    times = {}
    for fetch in ("static", "dynamic"):
        gemm = _gemm(tile_fetch=fetch, **extra)
        for epoch in (1, 2):
            started = torch.zeros(1, dtype=torch.int32, device=DEV)
            torch.cuda.synchronize()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            hold(cutlass.Int64(started.data_ptr()), cutlass.Int64(5_000_000),
                 cutlass.Int32(held), cuda_drv.CUstream(hold_stream.cuda_stream),
                 cuda_drv.CUstream(stream.cuda_stream))
            with torch.cuda.stream(stream):
                t0.record()
                y, ready = _run(gemm, plan, x, w, rows, epoch, stream=stream)
                t1.record()
            torch.cuda.synchronize()
            assert int(started.item()) == held
            times[(fetch, epoch)] = t0.elapsed_time(t1)
            valid = _valid_rows(plan, TILE_M)[:rows]
            assert torch.equal(y[valid].view(torch.int16), y_ref[valid].view(torch.int16)), \
                (fetch, epoch)
            if fetch == "dynamic":
                _check(gemm, plan, y, ready, y_ref, rows, epoch)
    print(f"\n{name} {extra} held={held}: " + ", ".join(
        f"{f}#{e} {ms:.3f} ms" for (f, e), ms in times.items()))
