"""CPU checks of scale="ordered" wired into the overlapped combine (issue 16 part 2; design A of
bench/NOTES.md "Session 11"): the option's checks, the per-segment arrival words of the
CommBuffer (size, views, growth, reset), the host bookkeeping of begin_call (seg_expected over
several calls = each call's rows per segment; the test-only frozen variant does not advance it)
and the host tables of prepare (the senders' plans rebuilt without max_rows ship the same
segments as the plans made at the layer's max rows; every tile's list covers its rows). The GPU
half: tests/test_ordered_wire_gpu.py.
"""
from types import SimpleNamespace

import pytest
import torch

from fake_symmetric import fake_runtime
from moe_overlap.combine import ordered_scale as osc
from moe_overlap.combine.comm_buffer import CommBuffer, CommBufferError
from moe_overlap.combine.options import CombineFacts, CombineOptions
from moe_overlap.combine.overlap import CombineRoutes, OverlapCombine
from moe_overlap.combine.plan import band_capacity_for, plan_combine
from moe_overlap.routing import route


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(CommBuffer, "_shared", {})


# ------------------------------------------------------------------------ options
def test_scale_option_default_and_values():
    assert CombineOptions().scale == "plain"
    o = CombineOptions(scale="ordered")
    assert o.scale == "ordered"
    facts = CombineFacts(world_size=2, hidden_size=256, out_features=256, experts_per_rank=4,
                         tile_m=128, rows=1024, num_sms=132)
    r = o.replace(ccta=8, mgb=1, producer="torch").resolve(facts)
    assert r.scale == "ordered" and r.local_copy is False and r.is_resolved
    with pytest.raises(ValueError, match="scale='fast'"):
        CombineOptions(scale="fast")


def test_scale_ordered_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="local_copy=False"):
        CombineOptions(scale="ordered", local_copy=True)
    with pytest.raises(ValueError, match="transport='nvlink'"):
        CombineOptions(scale="ordered", transport="nvshmem")
    with pytest.raises(ValueError, match="transport='nvlink'"):
        CombineOptions(scale="ordered").replace(transport="nvshmem")
    CombineOptions(scale="ordered", local_copy=False)  # explicit False is fine
    CombineOptions(scale="plain", transport="nvshmem")  # the default scale runs anywhere


# ------------------------------------------------------------------------ CommBuffer words
class _Layer:
    def __init__(self):
        self._band_ready = torch.full((4,), 7, dtype=torch.int32)

    def _clear_band_flags(self):
        self._band_ready.zero_()


def test_comm_buffer_segment_words(monkeypatch):
    W = 2
    rt = fake_runtime(monkeypatch, world=W)
    b = CommBuffer(None, "nvlink", runtime=rt)
    plain = _Layer()
    b.attach(plain, 64, 256)
    assert b.buffers.block.numel() == 3 * W and b.seg_words == 0 and b.seg_expected is None
    with pytest.raises(CommBufferError, match="per-segment"):
        b.seg_tables(5)
    ordered = _Layer()
    b.attach(ordered, 64, 256, seg_words=W * 5)  # grows: the block gets the words after 3W
    assert b.growths == 1 and b.buffers.block.numel() == 3 * W + W * 5
    arr, exp = b.seg_tables(5)
    assert arr.shape == (W, 5) and exp.shape == (W, 5)
    # the words the senders' consumers add to: 3W + s * Sc + i of the block
    arr[1, 2] = 9
    assert int(b.buffers.block[3 * W + 1 * 5 + 2]) == 9
    exp += 4
    assert int(b.seg_expected.sum()) == 4 * W * 5
    # a smaller capacity views the first W * Sc words (the same word mapping as its senders)
    a3, e3 = b.seg_tables(3)
    assert a3.data_ptr() == arr.data_ptr() and e3.data_ptr() == exp.data_ptr()
    with pytest.raises(CommBufferError):
        b.seg_tables(6)
    b.reset()  # zeroes the arrival words (in the block) and their expectation
    assert int(b.buffers.block.abs().sum()) == 0 and int(b.seg_expected.abs().sum()) == 0
    assert int(plain._band_ready.sum()) == 0 and int(ordered._band_ready.sum()) == 0
    exp += 1
    b.attach(_Layer(), 64, 256, seg_words=W * 7)  # growth: new words, expectation zeroed
    assert b.growths == 2 and b.seg_words == W * 7
    assert int(b.seg_expected.abs().sum()) == 0 and b.seg_expected.numel() == W * 7
    with pytest.raises(ValueError, match="seg_words"):
        b.attach(_Layer(), 64, 256, seg_words=-1)


# ------------------------------------------------------------------------ host bookkeeping
def _world(W, T, E, k, mode, seed):
    ids = [route(T, E, k, mode, seed=seed, rank=r)[0] for r in range(W)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    return ids, counts


def _seg_cap(W, T, E, k, tile_m):
    El = E // W
    return band_capacity_for(W * T * k, El, W, tile_m) + El * W


@pytest.mark.parametrize("order", ["remote_first", "expert"])
@pytest.mark.parametrize("W,T,E,k,tile_m,mgb,layout,mode", [
    (2, 300, 16, 4, 64, 2, "auto", "balanced"),
    (4, 200, 16, 2, 64, 1, "packed", "stress_skew"),
    (2, 257, 8, 2, 128, 2, "aligned", "moderate_skew"),
])
def test_rebuilt_sender_plans_ship_the_layers_segments(W, T, E, k, tile_m, mgb, layout, mode,
                                                        order):
    """prepare rebuilds every sender's plan without max_rows; the senders plan at the layer's
    max rows (MoECombine.plan). Their segments (the indices of seg_arrivals) must agree, and
    the layer's capacity is what OverlapCombine allocates and checks."""
    _, counts = _world(W, T, E, k, mode, seed=3)
    rebuilt = osc.sender_plans(counts, tile_m=tile_m, mgb=mgb, layout=layout, order=order)
    Sc = _seg_cap(W, T, E, k, tile_m)
    for s in range(W):
        p = plan_combine(counts, s, tile_m=tile_m, mgb=mgb, max_rows=W * T * k, layout=layout,
                         impl="torch", order=order)
        assert p.segment_capacity == Sc
        q = rebuilt[s]
        ns = int(p.num_segments)
        assert ns == int(q.num_segments) and ns <= Sc
        for f in ("segment_dest", "segment_rows", "segment_dest_row"):
            assert torch.equal(getattr(p, f)[:ns], getattr(q, f)[:ns]), f


class _OrderedSelf:
    """What OverlapCombine.begin_call / _prepare_ordered read of the layer (a plain object:
    CommBuffer.attach keeps a weak reference)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def _clear_band_flags(self):
        pass


def _fake_layer(monkeypatch, W, rank, Sc, broken=""):
    rt = fake_runtime(monkeypatch, world=W, rank=rank)
    comm = CommBuffer(None, "nvlink", runtime=rt)
    me = _OrderedSelf(ordered=True, _test_broken_order=broken, comm=comm, seg_cap=Sc,
                      queue=torch.full((1,), 5, dtype=torch.int32))
    comm.attach(me, 16, 256, seg_words=W * Sc)
    me.epoch, me.expected = comm.epoch, comm.expected
    return me


@pytest.mark.parametrize("broken", ["", "seg_expected_frozen"])
def test_begin_call_advances_seg_expected_by_each_calls_rows(monkeypatch, broken):
    W, T, E, k, tile_m, mgb, rank = 2, 200, 16, 4, 64, 2, 1
    Sc = _seg_cap(W, T, E, k, tile_m)
    me = _fake_layer(monkeypatch, W, rank, Sc, broken)
    want = torch.zeros(W, Sc, dtype=torch.int64)
    per_source = torch.zeros(W, dtype=torch.int64)
    for call, mode in enumerate(["balanced", "stress_skew", "moderate_skew"]):
        ids, counts = _world(W, T, E, k, mode, seed=10 + call)
        o = osc.ordered_routes(ids[rank], counts, rank, tile_m, mgb, "auto", Sc)
        # per segment, independently: how many of this rank's (t, k) the segment brings
        deps = osc.row_dependencies(ids[rank], counts, rank,
                                    osc.sender_plans(counts, tile_m, mgb, "auto"))
        for s in range(W):
            m = (deps.kind == osc.REMOTE) & (deps.source == s)
            want[s] += torch.bincount(deps.index[m], minlength=Sc)
            per_source[s] += int(((ids[rank] // (E // W)) == s).sum()) if s != rank else 0
        routes = CombineRoutes(rows=None, expected_inc=torch.ones(W, dtype=torch.int64),
                               plan=None, num_tokens=T,
                               ordered={"seg_inc": o.seg_inc, "seg_count": o.seg_count})
        OverlapCombine.begin_call(me, ids[rank], torch.rand(T, k), routes=routes)
        assert int(me.queue) == 0  # the tile queue restarts every call
        me.queue.fill_(3)
    _, exp = me.comm.seg_tables(Sc)
    assert int(me.epoch) == 3 and torch.equal(me.expected, torch.full((W,), 3))
    if broken:
        assert int(exp.abs().sum()) == 0  # the broken variant the GPU test must catch
    else:
        assert torch.equal(exp, want)
        assert torch.equal(exp.sum(1), per_source) and int(exp[rank].sum()) == 0
    me.comm.reset()
    assert int(exp.abs().sum()) == 0 and int(me.epoch) == 0


def test_begin_call_and_prepare_refuse_missing_ordered_inputs(monkeypatch):
    W, T, E, k, tile_m = 2, 64, 8, 2, 64
    Sc = _seg_cap(W, T, E, k, tile_m)
    me = _fake_layer(monkeypatch, W, 0, Sc)
    ids, counts = _world(W, T, E, k, "balanced", seed=1)
    with pytest.raises(ValueError, match="routes=prepare"):
        OverlapCombine.begin_call(me, ids[0], torch.rand(T, k))
    plain = CombineRoutes(rows=None, expected_inc=torch.ones(W, dtype=torch.int64), plan=None,
                          num_tokens=T)
    with pytest.raises(ValueError, match="without the ordered"):
        OverlapCombine.begin_call(me, ids[0], torch.rand(T, k), routes=plain)
    me.world_size, me.num_experts, me.rank, me.device = W, E, 0, torch.device("cpu")
    exact = plan_combine(counts, 0, tile_m=tile_m, impl="torch")  # no max_rows: other capacity
    with pytest.raises(ValueError, match="every rank's counts"):
        OverlapCombine._prepare_ordered(me, exact, ids[0], None)
    with pytest.raises(ValueError, match=r"\[2, 8\]"):
        OverlapCombine._prepare_ordered(me, exact, ids[0], counts[:1])
    with pytest.raises(ValueError, match="segment capacity"):
        OverlapCombine._prepare_ordered(me, exact, ids[0], counts)
    good = plan_combine(counts, 0, tile_m=tile_m, max_rows=W * T * k, impl="torch")
    o = OverlapCombine._prepare_ordered(me, good, ids[0], counts)
    assert o["seg_inc"].shape == (W, Sc) and o["tables"]["order"].numel() == T
    with pytest.raises(ValueError, match="capacity"):  # a sender's segments beyond Sc
        osc.ordered_routes(ids[0], counts, 0, tile_m, 1, "auto", 1)


def test_prepare_rebuilds_the_senders_plans_in_the_plans_order(monkeypatch):
    """An expert-ordered plan: _prepare_ordered rebuilds the senders' plans expert-ordered too,
    so its per-segment expectation is indexed by those plans' segments (with remote_first
    plans, another segment numbering: the rows' waits would name the wrong segments)."""
    W, T, E, k, tile_m, mgb = 2, 300, 8, 2, 64, 1
    Sc = _seg_cap(W, T, E, k, tile_m)
    me = _fake_layer(monkeypatch, W, 0, Sc)
    me.world_size, me.num_experts, me.rank, me.device = W, E, 0, torch.device("cpu")
    ids, counts = _world(W, T, E, k, "stress_skew", seed=2)  # experts' remote bands differ
    plan = plan_combine(counts, 0, tile_m=tile_m, mgb=mgb, max_rows=W * T * k, impl="torch",
                        order="expert")
    o = OverlapCombine._prepare_ordered(me, plan, ids[0], counts)
    want = osc.ordered_routes(ids[0], counts, 0, tile_m, mgb, plan.layout, Sc, order="expert")
    other = osc.ordered_routes(ids[0], counts, 0, tile_m, mgb, plan.layout, Sc)
    assert torch.equal(o["seg_inc"], want.seg_inc)
    assert not torch.equal(want.seg_inc, other.seg_inc)  # the orders number segments apart


@pytest.mark.parametrize("W,rank,mode", [(2, 0, "balanced"), (4, 3, "stress_skew")])
def test_every_tile_waits_for_all_its_rows(W, rank, mode):
    """Emulates the kernel's claim loop over the host tables: signals arrive in a random order;
    a tile may run once every entry of its own list is in, and then every row it reads must be
    in (remote: its segment arrived; local: its band final). Every token done once."""
    T, E, k, tile_m, mgb = 150, 16, 3, 64, 2
    ids, counts = _world(W, T, E, k, mode, seed=7)
    Sc = _seg_cap(W, T, E, k, tile_m)
    o = osc.ordered_routes(ids[rank], counts, rank, tile_m, mgb, "auto", Sc, tile_tokens=16)
    deps = osc.row_dependencies(ids[rank], counts, rank,
                                osc.sender_plans(counts, tile_m, mgb, "auto"))
    signals = sorted({(int(a), int(b), int(c)) for a, b, c in zip(
        deps.kind.reshape(-1), deps.source.reshape(-1), deps.index.reshape(-1))})
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(signals), generator=g).tolist()
    t = o.tables
    arrived, done = set(), torch.zeros(T, dtype=torch.int64)
    pending = list(range(t["tile_start"].numel() - 1))
    for i in perm:
        arrived.add(signals[i])
        for j in list(pending):
            a, b = int(t["dep_start"][j]), int(t["dep_start"][j + 1])
            need = {(int(t["dep_kind"][x]), int(t["dep_source"][x]), int(t["dep_index"][x]))
                    for x in range(a, b)}
            if need <= arrived:
                for tok in t["order"][int(t["tile_start"][j]):int(t["tile_start"][j + 1])]:
                    done[tok] += 1
                    for kk in range(k):
                        sig = (int(deps.kind[tok, kk]), int(deps.source[tok, kk]),
                               int(deps.index[tok, kk]))
                        assert sig in arrived, (j, int(tok), kk)
                pending.remove(j)
    assert not pending and torch.equal(done, torch.ones(T, dtype=torch.int64))


def test_moe_combine_keeps_the_counts_of_its_last_plan():
    """MoECombine.prepare / forward hand the ordered backend the counts of the plan they got
    (the plan itself holds only this rank's); another plan gets none (prepare then raises)."""
    from moe_overlap.combine import MoECombine
    layer = MoECombine(8, 64, 32, 2, 64, tile_m=64, backend="reference", scale="ordered")
    assert layer.options.scale == "ordered"
    _, counts = _world(1, 64, 8, 2, "balanced", seed=2)
    p1 = layer.plan(counts)
    assert layer._counts_of(p1, None) is counts
    other = torch.ones_like(counts)
    assert layer._counts_of(p1, other) is other  # given counts win
    p2 = layer.plan(counts.clone())
    assert layer._counts_of(p1, None) is None and layer._counts_of(p2, None) is not counts


def test_ordered_call_runs_on_s0_after_the_producer(monkeypatch):
    """Host order of one forward with scale="ordered" (the kernels are recorders, the streams
    too: test_recover_cpu's fakes): begin_call advances seg_expected and zeroes the queue, the
    consumer is launched on cs, the ordered scale on s0 after the producer (no band wait, the
    tag check on, every SM), s0 then waits cs; the plain scale is not launched."""
    import contextlib

    from test_recover_cpu import _fake_combine, _Stream
    log = []
    s0 = _Stream(log, "s0")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: s0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    ov, (h, w, plan, ids, tw) = _fake_combine(log, monkeypatch=monkeypatch)
    W, Sc = 2, 3
    ov.comm.attach(ov, ov.max_recv_rows, ov.out_features * 2, seg_words=W * Sc)
    ov.ordered, ov.seg_cap, ov._test_broken_order = True, Sc, ""
    ov.queue = torch.full((1,), 9, dtype=torch.int32)
    ov.oscale = SimpleNamespace(ctas_per_sm=4, launch=lambda **kw: log.append((
        "ordered", kw["stream"].name, kw["wait_bands"], kw["check_tags"], kw["grid"],
        int(kw["queue"]), kw["tables"]["order"], kw["err_peers"] is ov.comm.err_peers)))
    ov.scale = SimpleNamespace(launch=lambda **kw: log.append("plain scale"))

    def begin_call(ids_, w_, plan_, routes_):
        log.append("begin")
        return OverlapCombine.begin_call(ov, ids_, w_, routes=routes_)
    ov.begin_call = begin_call
    inc = torch.zeros(W, Sc, dtype=torch.int64)
    inc[1, 0], inc[1, 2] = 5, 3
    order = torch.arange(ids.shape[0], dtype=torch.int32)
    routes = CombineRoutes(rows=ids.int(), expected_inc=torch.ones(W, dtype=torch.int64),
                           plan=plan, num_tokens=ids.shape[0],
                           ordered={"tables": {"order": order}, "seg_inc": inc,
                                    "seg_count": torch.tensor([0, Sc], dtype=torch.int32)})
    with pytest.raises(ValueError, match="routes=prepare"):
        ov.forward(h, w, plan, ids, tw)  # refused before any launch
    assert not any(x in log for x in ("begin", "produce", "ship"))
    for call in (1, 2):
        log.clear()
        ov.forward(h, w, plan, ids, tw, routes=routes)
        call_log = log[log.index("begin"):]
        assert call_log[:4] == ["begin", "cs waits s0", "produce", "ship"], call_log
        # the peers' error words: a failed peer ends the waits at once, not at the timeout
        assert call_log[4] == ("ordered", "s0", False, True, 132 * 4, 0, order, True), call_log
        assert "s0 waits cs" in call_log[5:] and "plain scale" not in log
        _, exp = ov.comm.seg_tables(Sc)
        assert torch.equal(exp, call * inc) and int(ov.queue) == 0
