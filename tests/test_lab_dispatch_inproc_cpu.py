"""bench/lab_dispatch_inproc.py on the CPU: its reference rows are dispatch_host's (the send and
expand's host mirror), its launch queue runs every send before any expand in rank order and
launches at once outside the recording, and its runtime's peer tables hold every rank's
address of each allocation."""
import pytest
import torch

from conftest import load_bench
from moe_overlap.combine.dispatch_index import dispatch_host
from moe_overlap.combine.plan import plan_combine

L = load_bench("lab_dispatch_inproc")


@pytest.mark.parametrize("W,layout", [(2, "aligned"), (4, "packed")])
def test_reference_rows_are_dispatch_hosts(W, layout):
    El, D, K, T = 3, 16, 2, 40
    E = El * W
    g = torch.Generator().manual_seed(W)
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T - 7 * r)])
           for r in range(W)]
    xs = [torch.randn(i.shape[0], D, generator=g).to(torch.bfloat16) for i in ids]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plans = [plan_combine(counts, r, tile_m=64, layout=layout) for r in range(W)]
    rows = [p.row_capacity for p in plans]
    want = dispatch_host(xs, ids, plans, counts, T, rows)
    for r in range(W):
        got = L.expected_rows(xs, ids, plans[r], counts, r, rows[r], El, D, K)
        assert torch.equal(got.view(torch.int16), want[r].view(torch.int16)), r
    bad = [i.clone() for i in ids]
    bad[0][0, 0] = (bad[0][0, 0] + 1) % E  # the routing no longer matches the counts
    with pytest.raises(AssertionError):
        for r in range(W):
            L.expected_rows(xs, bad, plans[r], counts, r, rows[r], El, D, K)


def test_queue_runs_sends_first_in_rank_order():
    ran = []
    q = L.Queue(lambda fn: (lambda ints, s: ran.append((fn, ints))))
    send, expand = q.cache("send"), q.cache("expand")
    send((0,), 0)  # not recording: at once
    assert ran == [("send", (0,))]
    q.recording = True
    for r in (1, 0):
        q.rank = r
        q.kind = "send"
        send((r, 1), 0)
        q.kind = "expand"
        expand((r, 2), 0)
    assert len(ran) == 1
    done = q.run(type("S", (), {"cuda_stream": 0})())
    assert [x[1:] for x in ran[1:]] == [((0, 1),), ((1, 1),), ((0, 2),), ((1, 2),)]
    assert len(done) == 4 and q.items == []


def test_runtime_peer_tables_hold_every_ranks_allocation():
    world = L.World(3, torch.device("cpu"))
    rts = [L.Runtime(world, r) for r in range(3)]
    bufs = [rt.alloc((4,), torch.int64) for rt in rts]
    tables = [rt.peer_table(b)[0] for rt, b in zip(rts, bufs)]
    world.fill_tables()
    for t in tables:
        assert t.tolist() == [b.data_ptr() for b in bufs]
    with pytest.raises(RuntimeError):
        rts[0].free(bufs[0])
