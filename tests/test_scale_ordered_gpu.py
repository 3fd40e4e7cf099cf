"""ONE GPU: the ordered scale kernel (moe_overlap/combine/scale_ordered.py) on an emulated W = 2
owner: y and the band flags written by torch (the producer's outputs), remote rows random in the
receive slot, per-segment counters set by the test.

- equal: bitwise equal to the default Scale (y_src) for several grids, with and without the band
  waits, two calls (epochs 1 and 2, the slot parity flips); the error word clear;
- segment_timeout / band_timeout: one dependency never satisfied: error 8 / 7 naming a tile that
  depends on it and the segment (source << 32 | segment) / band; every row of out either its
  correct value or NaN, and the named tile's rows NaN;
- sticky: an error already recorded: every row NaN;
- peer error: source 1's error word (a stand-in for the symmetric one) set while its segment or
  call marker is awaited: the wait ends at the peer poll with ERR_PEER_ERROR naming source 1.

Run: ``CUDA_MODULE_LOADING=EAGER python -m pytest -q tests/test_scale_ordered_gpu.py``.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap.combine import ordered_scale as osc  # noqa: E402
from moe_overlap.combine.ordered_scale import LOCAL, REMOTE  # noqa: E402
from moe_overlap.combine.routes import prepare_routes_torch  # noqa: E402
from moe_overlap.combine.scale import Scale  # noqa: E402
from moe_overlap.combine.scale_ordered import OrderedScale  # noqa: E402
from moe_overlap.kernels import errors as ERR  # noqa: E402
from moe_overlap.routing import route  # noqa: E402

DEV = torch.device("cuda", 0)
T, E, TOPK, N, TILE_M, W, RANK = 256, 8, 4, 512, 64, 2, 0


def setup(tile_tokens=16):
    routed = [route(T, E, TOPK, "moderate_skew", seed=3, rank=r) for r in range(W)]
    ids = [x[0] for x in routed]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plans = osc.sender_plans(counts, TILE_M, 2, "packed")
    deps = osc.row_dependencies(ids[RANK], counts, RANK, plans)
    flows = [osc.flow_times(p, N, 256, 8, osc.ScaleModel()) for p in plans]
    times = osc.dependency_times(deps, RANK, [f[0] for f in flows], [f[1] for f in flows])
    tiles = osc.token_tiles(deps, times, tile_tokens)
    plan = plans[RANK].to(DEV)
    rows, _ = prepare_routes_torch(ids[RANK].to(DEV), E, W, RANK, False, plan)
    nrows = int(plan.num_bands.item()) * TILE_M
    g = torch.Generator(device=DEV).manual_seed(7)
    max_rows = T * TOPK
    s = dict(
        deps=deps, tiles=tiles, tables=osc.tile_tables(tiles, DEV), rows=rows,
        weights=routed[RANK][1].to(DEV), max_rows=max_rows, slot_bytes=max_rows * N * 2,
        y=torch.randn(nrows + 1, N, device=DEV, generator=g).to(torch.bfloat16),
        recv=torch.randn(2 * max_rows, N, device=DEV, generator=g).to(torch.bfloat16),
        band_ready=torch.zeros(plan.band_capacity, dtype=torch.int32, device=DEV),
        nb=int(plan.num_bands.item()), epoch=torch.zeros(1, dtype=torch.int32, device=DEV),
        seg_expected=osc.seg_expected_inc(plans, RANK).to(DEV),
        queue=torch.zeros(1, dtype=torch.int32, device=DEV),
        err=torch.zeros(8, dtype=torch.int64, device=DEV),
        zeros=torch.zeros(W, dtype=torch.int64, device=DEV))
    s["seg_arrivals"] = s["seg_expected"].clone()
    return s


def next_call(s):
    s["epoch"].add_(1)
    s["band_ready"][:s["nb"]] = s["epoch"]  # the producer's flags of this call
    s["queue"].zero_()


def run(s, sc, out, grid, wait_bands):
    sc.launch(recv=s["recv"], rows=s["rows"], weights=s["weights"], out=out, y=s["y"],
              tables=s["tables"], band_ready=s["band_ready"], seg_arrivals=s["seg_arrivals"],
              seg_expected=s["seg_expected"], queue=s["queue"], counters=s["zeros"],
              expected=s["zeros"], rank=RANK, err=s["err"], epoch=s["epoch"],
              slot_bytes=s["slot_bytes"], grid=grid, wait_bands=wait_bands, check_tags=False)


def reference(s):
    out = torch.empty(T, N, dtype=torch.bfloat16, device=DEV)
    Scale(TOPK, y_src=True).launch(recv=s["recv"], rows=s["rows"], weights=s["weights"],
                                   out=out, counters=s["zeros"], expected=s["zeros"], rank=RANK,
                                   err=s["err"], epoch=s["epoch"], slot_bytes=s["slot_bytes"],
                                   num_sms=torch.cuda.get_device_properties(DEV)
                                   .multi_processor_count, y=s["y"])
    return out


@pytest.mark.parametrize("grid,wait_bands,threads", [(1, True, 256), (3, False, 256),
                                                      (264, False, 256), (8, True, 512)])
def test_equal_to_the_default_scale(grid, wait_bands, threads):
    s = setup()
    sc = OrderedScale(TOPK, threads=threads)
    for _ in range(2):  # epochs 1, 2: both slots
        next_call(s)
        out = torch.full((T, N), 7.0, dtype=torch.bfloat16, device=DEV)
        run(s, sc, out, grid, wait_bands)
        ref = reference(s)
        torch.cuda.synchronize()
        assert int(s["err"][0]) == 0, ERR.describe_error(s["err"].tolist())
        assert torch.equal(out, ref)
        assert int(s["queue"].item()) >= s["tiles"].num_tiles


def _rows_ok_or_nan(out, ref, tile_rows):
    nan_row = torch.isnan(out.float()).all(1)
    same = (out == ref).all(1)
    assert bool((nan_row | same).all())
    assert bool(nan_row[tile_rows].all())


def test_segment_timeout_names_tile_source_and_segment():
    s = setup()
    d = s["deps"]
    m = d.kind == REMOTE
    src, seg = int(d.source[m][0]), int(d.index[m][0])
    sc = OrderedScale(TOPK, timeout_ns=50_000_000)
    next_call(s)
    ref = reference(s)
    s["seg_arrivals"][src, seg] -= 1  # one row of that segment never arrives
    out = torch.empty(T, N, dtype=torch.bfloat16, device=DEV)
    run(s, sc, out, 2, True)
    torch.cuda.synchronize()
    e = s["err"].tolist()
    assert e[0] == ERR.ERR_TILE_SEGMENT_TIMEOUT and e[1] == RANK, ERR.describe_error(e)
    assert e[3] == ERR.segment_word(src, seg)
    assert e[4] == e[5] - 1 and e[6] >= 50_000_000
    t = s["tiles"]
    j = e[2]
    a, b = int(t.dep_start[j]), int(t.dep_start[j + 1])
    assert (REMOTE, src, seg) in set(zip(t.dep_kind[a:b].tolist(), t.dep_source[a:b].tolist(),
                                         t.dep_index[a:b].tolist()))
    _rows_ok_or_nan(out, ref, t.order[t.tile_start[j]:t.tile_start[j + 1]].to(DEV))


def test_band_timeout_names_tile_and_band():
    s = setup()
    d = s["deps"]
    band = int(d.index[d.kind == LOCAL][0])
    sc = OrderedScale(TOPK, timeout_ns=50_000_000)
    next_call(s)
    ref = reference(s)
    s["band_ready"][band] = s["epoch"] - 1  # that band is not final in this call
    out = torch.empty(T, N, dtype=torch.bfloat16, device=DEV)
    run(s, sc, out, 2, True)
    torch.cuda.synchronize()
    e = s["err"].tolist()
    assert e[0] == ERR.ERR_TILE_BAND_TIMEOUT and e[3] == band, ERR.describe_error(e)
    assert e[4] == e[5] - 1
    t = s["tiles"]
    j = e[2]
    a, b = int(t.dep_start[j]), int(t.dep_start[j + 1])
    assert (LOCAL, RANK, band) in set(zip(t.dep_kind[a:b].tolist(), t.dep_source[a:b].tolist(),
                                          t.dep_index[a:b].tolist()))
    _rows_ok_or_nan(out, ref, t.order[t.tile_start[j]:t.tile_start[j + 1]].to(DEV))


def test_sticky_error_gives_nan_everywhere():
    s = setup()
    next_call(s)
    s["err"][0] = ERR.ERR_SCALE_TIMEOUT
    out = torch.zeros(T, N, dtype=torch.bfloat16, device=DEV)
    run(s, OrderedScale(TOPK), out, 4, True)
    torch.cuda.synchronize()
    assert bool(torch.isnan(out.float()).all())
    assert int(s["err"][0]) == ERR.ERR_SCALE_TIMEOUT  # the first error is kept


def _peer_word(code):
    """A stand-in for source 1's symmetric error word (what ``CommBuffer.err_peers`` maps)."""
    word = torch.zeros(8, dtype=torch.int64, device=DEV)
    word[0], word[1] = code, 1
    return word


@pytest.mark.parametrize("what", ["segment", "marker"])
def test_peer_error_ends_the_wait_and_names_the_peer(what):
    """Source 1 has recorded an error (it ships nothing more): the wait for its segment / call
    marker ends within the peer poll, not at the 5 s bound, with ERR_PEER_ERROR naming source 1
    and its code; every row of out its correct value or NaN, some NaN."""
    import time
    s = setup()
    d = s["deps"]
    m = d.kind == REMOTE
    src, seg = int(d.source[m][0]), int(d.index[m][0])
    assert src == 1
    sc = OrderedScale(TOPK, timeout_ns=5_000_000_000)
    next_call(s)
    ref = reference(s)
    counters = torch.zeros(3 * W, dtype=torch.int64, device=DEV)
    expected = torch.zeros(W, dtype=torch.int64, device=DEV)
    epoch = int(s["epoch"])
    fp = torch.tensor([-0x2345679], dtype=torch.int32, device=DEV)  # a plan's counts fingerprint
    # both sources' tags right
    counters[W + (epoch & 1) * W:W + (epoch & 1) * W + W] = ERR.call_tag(epoch, int(fp))
    if what == "segment":
        s["seg_arrivals"][src, seg] -= 1  # a row of source 1's segment never arrives
    else:
        expected[1] = 1  # source 1's call marker never comes
    word = _peer_word(ERR.ERR_PRODUCER_BOUNDS)
    peers = torch.tensor([0, word.data_ptr()], dtype=torch.int64, device=DEV)
    out = torch.empty(T, N, dtype=torch.bfloat16, device=DEV)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sc.launch(recv=s["recv"], rows=s["rows"], weights=s["weights"], out=out, y=s["y"],
              tables=s["tables"], band_ready=s["band_ready"], seg_arrivals=s["seg_arrivals"],
              seg_expected=s["seg_expected"], queue=s["queue"], counters=counters,
              expected=expected, rank=RANK, err=s["err"], epoch=s["epoch"],
              slot_bytes=s["slot_bytes"], grid=4, wait_bands=True, check_tags=True,
              err_peers=peers, fingerprint=fp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    e = s["err"].tolist()
    assert e[0] == ERR.ERR_PEER_ERROR, ERR.describe_error(e)
    assert (e[1], e[2], e[3], e[4]) == (RANK, 1, epoch, ERR.ERR_PRODUCER_BOUNDS), e
    assert wall < 1.0, wall  # the poll, not the 5 s bound
    if what == "segment":
        _rows_ok_or_nan(out, ref, torch.zeros(0, dtype=torch.long, device=DEV))
        assert bool(torch.isnan(out.float()).all(1).any())


def test_peer_table_is_checked():
    s = setup()
    with pytest.raises(ValueError, match="err_peers"):
        OrderedScale(TOPK).launch(
            recv=s["recv"], rows=s["rows"], weights=s["weights"], out=torch.empty(
                T, N, dtype=torch.bfloat16, device=DEV), y=s["y"], tables=s["tables"],
            band_ready=s["band_ready"], seg_arrivals=s["seg_arrivals"],
            seg_expected=s["seg_expected"], queue=s["queue"], counters=s["zeros"],
            expected=s["zeros"], rank=RANK, err=s["err"], epoch=s["epoch"],
            slot_bytes=s["slot_bytes"], grid=1, wait_bands=True, check_tags=False,
            err_peers=torch.zeros(W + 1, dtype=torch.int64, device=DEV))
