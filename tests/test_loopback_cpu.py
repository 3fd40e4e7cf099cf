"""The loopback peers of moe_overlap/combine/loopback.py on the CPU: the buffers are the sizes the
combine's own functions give (slot_bytes_for, comm_block_words, ordered_segment_capacity,
heap_report), every rank has its own copy and the peer tables point at them; check_loopback
passes a call shipped as the plan says and fails on each planted defect (a wrong row, a stray
row, a missing arrival or marker, a stale tag, a set error word). The consumer's effect is
written here by a plain reference shipper from the plan's tables."""
import pytest
import torch

from moe_overlap.combine.comm_buffer import (LayerShape, heap_report, ordered_segment_capacity,
                                             slot_bytes_for)
from moe_overlap.combine.loopback import (POISON_BITS, LoopbackRuntime, attach_layer,
                                          check_loopback, expected_arrivals,
                                          loopback_comm_buffer, loopback_copies, poison_slots)
from moe_overlap.combine.options import CombineFacts, CombineOptions
from moe_overlap.combine.plan import plan_combine
from moe_overlap.kernels.errors import call_tag, comm_block_words, epoch_tag_word
from moe_overlap.routing import routing_counts

W, T, TOPK, E, N, TILE_M = 4, 256, 2, 8, 64, 64


def _plan(layout="aligned", mgb=2):
    counts = routing_counts(W, T, E, TOPK, "moderate_skew", 3)
    return plan_combine(counts, 0, tile_m=TILE_M, mgb=mgb, max_rows=W * T * TOPK,
                        layout=layout)


@pytest.mark.parametrize("ordered", [False, True])
def test_loopback_buffers_are_the_combines_sizes_one_copy_per_rank(ordered, monkeypatch):
    seg = W * ordered_segment_capacity(W, T, TOPK, E // W, TILE_M) if ordered else 0
    buf = loopback_comm_buffer(W, "cpu")
    assert not buf.allocated  # nothing before a layer attaches, as CommBuffer
    keep = attach_layer(buf, T * TOPK, N * 2, seg)
    cp = loopback_copies(buf)
    assert len(cp["recv"]) == len(cp["block"]) == W
    for r in cp["recv"]:
        assert r.numel() * r.element_size() == 2 * slot_bytes_for(T, TOPK, N)
    for b in cp["block"]:
        assert b.dtype == torch.int64 and b.numel() == comm_block_words(W) + seg
    assert buf.slot_bytes == slot_bytes_for(T, TOPK, N)
    rt = buf.runtime
    # W copies of one rank's shared buffer (receive slots, block, error word): heap_report's
    shape = LayerShape(T, TOPK, N, experts=E if ordered else 0, tile_m=TILE_M)
    assert rt.allocated_bytes() == W * heap_report([shape], W)["shared_bytes"]
    # the peer tables hold every rank's copy, distinct memory; rank 0's copy is the local one
    assert buf.buffers.recv_peers.tolist() == [r.data_ptr() for r in cp["recv"]]
    assert buf.buffers.ctr_peers.tolist() == [b.data_ptr() for b in cp["block"]]
    assert len({r.data_ptr() for r in cp["recv"]}) == W
    assert cp["recv"][0] is buf.buffers.recv and cp["block"][0] is buf.buffers.block
    # a second, larger layer grows the buffer, as the combine's (all copies; its device
    # synchronize is the GPU's, a no-op here)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    keep2 = attach_layer(buf, 2 * T * TOPK, N * 2, seg)
    assert buf.slot_bytes == slot_bytes_for(2 * T, TOPK, N) and buf.growths == 1
    assert all(r.numel() * 2 == 2 * buf.slot_bytes for r in loopback_copies(buf)["recv"])
    assert buf.num_layers == 2 and keep and keep2


def test_loopback_runtime_refuses_what_it_did_not_allocate():
    rt = LoopbackRuntime(2, "cpu")
    t = rt.alloc((4,), torch.int64)
    assert len(rt.copies(t)) == 2 and rt.peer_tensor(t, 1) is rt.copies(t)[1]
    with pytest.raises(ValueError):
        rt.copies(torch.zeros(4))
    rt.free(t)
    with pytest.raises(ValueError):
        rt.free(t)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError):
            LoopbackRuntime(bad, "cpu")
    with pytest.raises(ValueError):
        LoopbackRuntime(2, "cpu", rank=2)


def _ship(plan, y, buf, epoch, local_copy, arrival="counter", seg_cap=0):
    """Reference of one consumer call of rank plan.rank into the loopback copies: each valid
    segment's rows to its destination's slot (epoch & 1), arrivals, call marker and tag."""
    cp = loopback_copies(buf)
    rank, rb = plan.rank, y.shape[1]
    par = epoch & 1
    slot_rows = buf.slot_bytes // (rb * 2)
    fp = int(plan.counts_fingerprint[0])
    for d in range(W):
        blk = cp["block"][d]
        blk[epoch_tag_word(W, par, rank)] = call_tag(epoch, fp)
        blk[rank] += 1

    def put(d, src, dst, n):
        view = cp["recv"][d][par * slot_rows * rb:(par + 1) * slot_rows * rb].view(slot_rows, rb)
        view[dst:dst + n] = y[src:src + n]
    for s in range(int(plan.num_segments[0])):
        d, src, dst, n = (int(t[s]) for t in (plan.segment_dest, plan.segment_src_row,
                                               plan.segment_dest_row, plan.segment_rows))
        put(d, src, dst, n)
        if arrival == "segment":
            cp["block"][d][3 * W + rank * seg_cap + s] += n
        else:
            cp["block"][d][rank] += n
    if local_copy:
        for c in range(int(plan.num_local_cells[0])):
            src, dst, n = (int(t[c]) for t in (plan.local_cell_src_row,
                                                plan.local_cell_dest_row, plan.local_cell_rows))
            put(rank, src, dst, n)
            cp["block"][rank][rank] += n


def _setup(plan, seg_cap=0, epoch=3):
    buf = loopback_comm_buffer(W, "cpu")
    keep = attach_layer(buf, T * TOPK, N * 2, W * seg_cap)
    rows = int(plan.total_rows)
    y = torch.randn(max(rows, 1), N).to(torch.bfloat16)
    poison_slots(buf)
    for b in loopback_copies(buf)["block"]:  # earlier calls' counts: the check takes deltas
        b[:W] = 5
    before = [b.clone() for b in loopback_copies(buf)["block"]]
    buf.epoch.fill_(epoch)
    return buf, keep, y, before


@pytest.mark.parametrize("layout,local_copy", [("aligned", False), ("packed", False),
                                               ("aligned", True)])
def test_check_passes_a_call_shipped_as_planned_and_fails_each_planted_defect(layout,
                                                                             local_copy):
    plan = _plan(layout)
    assert int(plan.num_segments[0]) >= 3  # remote segments to several ranks
    buf, keep, y, before = _setup(plan)
    _ship(plan, y, buf, 3, local_copy)
    ok = check_loopback(plan, y, buf, before, 3, local_copy)
    assert ok["ok"] and not ok["bad"], ok
    segs = int(plan.segment_rows[:int(plan.num_segments[0])].sum())
    cells = int(plan.local_cell_rows[:int(plan.num_local_cells[0])].sum()) if local_copy else 0
    assert ok["shipped_rows"] == segs + cells > 0
    exp = expected_arrivals(plan, local_copy)["counter"]
    assert sum(exp) == W + segs + cells  # one marker per rank, every row once
    cp = loopback_copies(buf)
    slot_rows = buf.slot_bytes // (N * 2)
    s0 = 1  # slot of epoch 3
    d0, r0 = int(plan.segment_dest[0]), int(plan.segment_dest_row[0])

    def slot(d):
        return cp["recv"][d][s0 * slot_rows * N:(s0 + 1) * slot_rows * N].view(slot_rows, N)
    # a wrong row in a shipped segment
    good = slot(d0)[r0].clone()
    slot(d0)[r0] = slot(d0)[r0] + 1
    bad = check_loopback(plan, y, buf, before, 3, local_copy)
    assert not bad["ok"] and not bad["rows_ok"] and bad["untouched_ok"], bad
    slot(d0)[r0] = good
    # a row written where no segment goes (a spare row of the slot past every segment)
    spare = slot_rows - 1
    slot(d0)[spare] = y[0]
    bad = check_loopback(plan, y, buf, before, 3, local_copy)
    assert not bad["ok"] and bad["rows_ok"] and not bad["untouched_ok"], bad
    slot(d0).view(torch.int16)[spare] = POISON_BITS
    # the rows in the other slot (a wrong parity) do not count
    bad = check_loopback(plan, y, buf, before, 2, local_copy)
    assert not bad["ok"] and not bad["rows_ok"] and not bad["tags_ok"]
    # a missing arrival (one row fewer counted) and a missing call marker
    cp["block"][d0][0] -= 1
    bad = check_loopback(plan, y, buf, before, 3, local_copy)
    assert not bad["ok"] and not bad["counters_ok"] and bad["rows_ok"], bad
    cp["block"][d0][0] += 1
    # a stale epoch tag
    w = epoch_tag_word(W, 1, 0)
    tag = int(cp["block"][d0][w])
    cp["block"][d0][w] = call_tag(1, int(plan.counts_fingerprint[0]))
    bad = check_loopback(plan, y, buf, before, 3, local_copy)
    assert not bad["ok"] and not bad["tags_ok"], bad
    cp["block"][d0][w] = tag
    # the error word set
    buf.err[0] = 1
    bad = check_loopback(plan, y, buf, before, 3, local_copy)
    assert not bad["ok"] and bad["error_word"], bad
    buf.err.zero_()
    assert check_loopback(plan, y, buf, before, 3, local_copy)["ok"]


def test_check_of_per_segment_arrivals():
    """scale="ordered": the rows go to the per-segment words, the counters carry markers."""
    plan = _plan("aligned")
    seg_cap = ordered_segment_capacity(W, T, TOPK, E // W, TILE_M)
    assert plan.segment_capacity == seg_cap  # the plan of MoECombine's max_rows
    buf, keep, y, before = _setup(plan, seg_cap)
    _ship(plan, y, buf, 3, False, "segment", seg_cap)
    ok = check_loopback(plan, y, buf, before, 3, False, "segment", seg_cap)
    assert ok["ok"], ok
    assert expected_arrivals(plan, False, "segment")["counter"] == [1] * W
    # checked as counter arrivals, the same call is wrong (rows not on the counters)
    assert not check_loopback(plan, y, buf, before, 3, False)["counters_ok"]
    blk = loopback_copies(buf)["block"][int(plan.segment_dest[1])]
    blk[3 * W + 1] -= 1  # segment 1's word one row short
    bad = check_loopback(plan, y, buf, before, 3, False, "segment", seg_cap)
    assert not bad["ok"] and not bad["counters_ok"] and bad["rows_ok"]


def test_consumer_for_is_the_combines_consumer_of_the_resolved_options():
    from moe_overlap.combine.consumer import DEFAULT_CHUNK, DEFAULT_STAGES
    from moe_overlap.combine.overlap import consumer_for
    facts = CombineFacts(world_size=4, hidden_size=256, out_features=512, experts_per_rank=2,
                         tile_m=128, rows=1024, num_sms=132)
    o = CombineOptions(ccta=8, mgb=2, order="remote_first").resolve(facts)
    c = consumer_for(o)
    assert (c.transport, c.copy, c.local_copy, c.arrival) == ("nvlink", "tma", False, "counter")
    assert c.options["stages"] == DEFAULT_STAGES and c.options["chunk_bytes"] == DEFAULT_CHUNK
    assert c.timeout_ns == int(o.timeout_s * 1e9)
    oo = CombineOptions(ccta=8, mgb=2, order="remote_first", scale="ordered",
                        consumer_threads=256, copy="ldst", timeout_s=2.0).resolve(facts)
    c = consumer_for(oo)
    assert (c.copy, c.arrival, c.threads, c.timeout_ns) == ("ldst", "segment", 256, 2 * 10**9)
    with pytest.raises(ValueError):
        consumer_for(CombineOptions())  # "auto" left: not what a layer launches
