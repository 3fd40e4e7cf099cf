"""The overlapped combine's cross-rank protocol (issue 35) on the host: the PTX of the consumer
(combine/consumer.py, transport nvlink, copy="ldst", local_copy=False: OverlapCombine's nvlink
variant with the SIMT copy) and of the owner's wait + scale kernels (combine/scale.py, y_src)
run in tests/ptx_emulator.py for W emulated ranks whose buffers lie in one memory: the peer
tables point at the other ranks' receive slots, communication blocks and error words.

Per call, as ``OverlapCombine.forward`` orders it (overlap.py): every rank's ``begin_call``
(epoch + 1, expected += prepare's expected_inc), the producer on every rank (its torch
reference ``grouped_gemm_reference``: the WGMMA kernel cannot run here; it writes y's valid
bands and sets their flags to the epoch, as the kernel does), every rank's consumer, then every
rank's wait + scale (epoch tags checked, err_peers polled, y read for local assignments). So
the waits find their counters satisfied: CTAs and ranks run one after the other.

Bitwise reference: ``reference_combine`` (MoECombine's reference backend: torch GEMM, the
plan's segments and local cells, one all_to_all, fp32 weighted sum) on gloo ranks. Bitwise
defined because the GEMM is exact (small integer h and w: every y value an integer below 256,
so per-band and per-expert products agree) and the weights are bf16 values: each w * y is
exact in fp32, so the scale's fma chain (fma(w1, y1, w0 * y0)) and torch's mul then sum round
the same once, then bf16 round-to-nearest-even alike.

Negative cases, as the kernels see them: a skipped call (rank 0 calls with the next routing
at the epoch of the one it skipped: same epoch, another counts fingerprint:
ERR_EPOCH_MISMATCH on rank 0, ERR_PEER_ERROR naming it on rank 1), an overflow plan on one rank
(its producer's refusal recorded as the kernel records it; its consumer ships nothing and posts
no marker, its scale writes NaN; the peer's scale stops with ERR_PEER_ERROR naming it and code
9), a rank whose consumer never runs (the peer's scale times out naming it).

What this cannot see: concurrency and memory ordering (tests/test_overlap_gpu.py,
tests/test_ranks_faults_gpu.py and the PTX order checks of tests/test_consumer_compile.py)."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap.combine.grouped_gemm import band_faults, grouped_gemm_reference  # noqa: E402
from moe_overlap.combine.plan import plan_combine  # noqa: E402
from moe_overlap.combine.routes import prepare_routes_torch  # noqa: E402
from moe_overlap.kernels.errors import (ERR_EPOCH_MISMATCH, ERR_PEER_ERROR,  # noqa: E402
                                        ERR_PRODUCER_BOUNDS, ERR_SCALE_TIMEOUT, ERR_WORDS,
                                        call_tag)
from moe_overlap.routing import route  # noqa: E402
from conftest import compile_ptx, spawn_ranks  # noqa: E402
from emulated_memory import Heap, tobytes  # noqa: E402
from ptx_emulator import Emulator  # noqa: E402

pytestmark = pytest.mark.compile

TOPK, TILE_M, HID, N, EL = 2, 64, 32, 64, 2
CONSUMER_THREADS, CONSUMER_UNROLL, CCTA, PIECE_ROWS = 64, 2, 3, 24
SCALE_THREADS, SCALE_GRID = 64, 2
TIMEOUT_NS = 10_000_000_000
NAN2 = 0x7FC0  # the scale's bf16 NaN
# W: tokens per rank of each routing, the routing's kind
ROUTINGS = {
    2: [((60, 45), "skew"), ((30, 0), "dup"), ((90, 70), "skew"), ((20, 25), "dup")],
    3: [((40, 0, 33), "dup"), ((25, 50, 10), "skew")],
}
_PTX = {}


def routing(W, i):
    """(ids per rank, weights per rank, counts [W, E]) of routing i."""
    tokens, kind = ROUTINGS[W][i]
    E = EL * W
    g = torch.Generator().manual_seed(100 * W + i)
    ids, ws = [], []
    for r, T in enumerate(tokens):
        if kind == "skew":
            ids.append(route(T, E, TOPK, "stress_skew", seed=7 * i + 1, rank=r)[0].reshape(T, TOPK))
        else:  # independent draws: some tokens pick one expert twice
            ids.append(torch.randint(0, E, (T, TOPK), generator=g))
        # bf16 weights: w * y exact in fp32 (see the module doc)
        ws.append(torch.rand(T, TOPK, generator=g).to(torch.bfloat16).float())
    counts = torch.stack([torch.bincount(x.reshape(-1), minlength=E) for x in ids])
    return ids, ws, counts


def layout_of(i):
    return ("aligned", "packed")[i % 2]


def expert_inputs(W, i, rank, rows):
    """Rank's stacked h [rows, HID] and w_down [EL, HID, N]: small integers (exact GEMM)."""
    g = torch.Generator().manual_seed(1000 * W + 10 * i + rank)
    h = torch.randint(-2, 3, (rows, HID), generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (EL, HID, N), generator=g).to(torch.bfloat16)
    return h, w


def plan_of(W, i, rank):
    return plan_combine(routing(W, i)[2], rank, tile_m=TILE_M, layout=layout_of(i))


def _reference_worker(rank, W, calls):
    import torch.distributed as dist
    from moe_overlap.combine.reference import reference_combine
    out = []
    for i in calls:
        ids, ws, _ = routing(W, i)
        plan = plan_of(W, i, rank)
        h, w = expert_inputs(W, i, rank, plan.row_capacity)
        out.append(reference_combine(h, w, plan, ids[rank], ws[rank], group=dist.group.WORLD))
    return out


def _ptx():
    if not _PTX:
        from moe_overlap.combine.consumer import build_consumer, consumer_example_args
        from moe_overlap.combine.scale import build_scale, scale_example_args
        _PTX["consumer"] = compile_ptx(build_consumer(
            "nvlink", CONSUMER_THREADS, CONSUMER_UNROLL, local_copy=False, copy="ldst"),
            *consumer_example_args())
        _PTX["owner"] = s = compile_ptx(build_scale(TOPK, SCALE_THREADS, y_src=True),
                                        *scale_example_args())
        for n in ("wait", "scale"):
            _PTX[n + "_entry"] = re.search(rf"\.entry\s+(\w*{n}_kernel\w*)", s).group(1)
    return _PTX


PLAN_FIELDS = ("num_segments", "segment_start", "segment_bands", "segment_dest",
               "segment_src_row", "segment_dest_row", "segment_rows", "schedule",
               "num_local_cells", "local_cell_band", "local_cell_src_row", "local_cell_rows",
               "local_cell_dest_row", "counts_fingerprint")


class Ranks:
    """W emulated ranks of one OverlapCombine each (a CommBuffer's worth: two receive slots of
    ``slot_bytes``, the communication block of 3W words, the error word, epoch, expected counts,
    peer tables; y and band flags) in one memory. ``inputs[c][r]``: (ids, weights, plan, h, w)
    of rank r's call c (each rank may call with its own routing: the skip case)."""

    def __init__(self, W, inputs, timeout_ns=TIMEOUT_NS):
        self.W, self.inputs, self.timeout_ns = W, inputs, timeout_ns
        Tmax = max(max(t) for t, _ in ROUTINGS[W])  # the layer's max_tokens_per_rank
        self.slot_bytes = Tmax * TOPK * N * 2 + 256  # CommBuffer's slot may exceed the layer's
        self.row_bytes = N * 2
        h = self.h = Heap()
        ycap = max(p.row_capacity for call in inputs for _, _, p, _, _ in call) + 1
        fcap = max(p.band_capacity for call in inputs for _, _, p, _, _ in call)
        for r in range(W):
            for name, n in (("recv", 2 * self.slot_bytes), ("block", 3 * W * 8),
                            ("err", ERR_WORDS * 8), ("epoch", 4), ("expected", W * 8),
                            ("recv_peers", W * 8), ("ctr_peers", W * 8), ("err_peers", W * 8),
                            ("y", ycap * N * 2), ("band_ready", fcap * 4)):
                h.alloc((name, r), n)
            for c, call in enumerate(inputs):
                ids, _, plan, _, _ = call[r]
                T = ids.shape[0]
                for f in PLAN_FIELDS:
                    h.alloc((f, r, c), getattr(plan, f).numel() * 4)
                for name, n in (("rows", T * TOPK * 4), ("weights", T * TOPK * 4),
                                ("out", T * N * 2)):
                    h.alloc((name, r, c), n)
        self.mem = h.make()
        for r in range(W):
            for name in ("block", "err", "expected", "band_ready"):
                h.put((name, r), bytes(h.regions[(name, r)][1]))
            h.put_words(("epoch", r), [0], 32)
            for table, name in (("recv_peers", "recv"), ("ctr_peers", "block"),
                                ("err_peers", "err")):
                h.put_words((table, r), [h[(name, d)] for d in range(W)])
            for c, call in enumerate(inputs):
                ids, ws, plan, _, _ = call[r]
                for f in PLAN_FIELDS:
                    h.put((f, r, c), tobytes(getattr(plan, f).to(torch.int32)))
        self.epoch = [0] * W
        self.writes = []  # (kernel, rank, {word address: CTAs})

    # ---- the steps of one call ----------------------------------------------------------
    def begin_call(self, r, c):
        """OverlapCombine.begin_call: epoch += 1, expected += prepare's expected_inc; the scale's
        rows (prepare) and fp32 weights into memory."""
        ids, ws, plan, _, _ = self.inputs[c][r]
        rows, inc = prepare_routes_torch(ids, EL * self.W, self.W, r, False, plan)
        self.epoch[r] += 1
        h = self.h
        h.put_words(("epoch", r), [self.epoch[r]], 32)
        h.put_words(("expected", r), [a + int(b) for a, b in
                                      zip(h.words(("expected", r), self.W), inc)])
        h.put(("rows", r, c), tobytes(rows.to(torch.int32)))
        h.put(("weights", r, c), tobytes(ws.to(torch.float32)))

    def produce(self, r, c):
        """The producer's torch reference on this rank's y and flags, in place (what the GEMM
        kernel leaves: valid bands computed, their flags = epoch); a plan it refuses records
        ERR_PRODUCER_BOUNDS as the kernel does (word 2 the position, 3 the field, 4 / 5 value
        and bound)."""
        _, _, plan, hx, w = self.inputs[c][r]
        h = self.h
        yrows = plan.row_capacity + 1
        y = torch.frombuffer(bytearray(h.get(("y", r), yrows * N * 2)),
                             dtype=torch.bfloat16).view(yrows, N).clone()
        cap = plan.band_capacity
        flags = torch.tensor(h.words(("band_ready", r), cap, bits=32), dtype=torch.int32)
        grouped_gemm_reference(hx, w, y[:plan.row_capacity], plan.band_expert,
                               plan.band_src_row, plan.schedule, plan.num_bands, TILE_M,
                               band_ready=flags, epoch=torch.tensor([self.epoch[r]]))
        h.put(("y", r), tobytes(y))
        h.put(("band_ready", r), tobytes(flags))
        faults = band_faults(plan.band_expert, plan.band_src_row, plan.schedule, plan.num_bands,
                             TILE_M, hx.shape[0], w.shape[0], plan.row_capacity)
        if faults and not h.words(("err", r), 1)[0]:
            pos, field, value, bound = faults[0]
            h.put_words(("err", r), [ERR_PRODUCER_BOUNDS, r, pos, field, value, bound, 0, 0])

    def consume(self, r, c):
        _, _, plan, _, _ = self.inputs[c][r]
        h = self.h
        em = Emulator(_ptx()["consumer"], mem=self.mem, valid=self.h.ranges())
        em.launch(CCTA, CONSUMER_THREADS, [
            h[("y", r)], self.row_bytes, r, *(h[(f, r, c)] for f in PLAN_FIELDS[:13]),
            h[("band_ready", r)], h[("epoch", r)], h[("counts_fingerprint", r, c)],
            h[("recv_peers", r)], h[("ctr_peers", r)], 0, 0, h[("err", r)], self.timeout_ns,
            self.slot_bytes, self.W, PIECE_ROWS, plan.row_capacity + 1,
            plan.segment_rows.numel(), plan.local_cell_rows.numel(), plan.schedule.numel(),
            plan.band_capacity])
        self.writes.append(("consumer", r, em.writers))

    def scale(self, r, c):
        ids, _, plan, _, _ = self.inputs[c][r]
        h, p = self.h, _ptx()
        em = Emulator(p["owner"], mem=self.mem, name=p["wait_entry"], valid=self.h.ranges())
        em.launch(self.W, 32, [h[("block", r)], h[("expected", r)], self.W, r, h[("err", r)],
                               self.timeout_ns, h[("epoch", r)], 1, h[("err_peers", r)],
                               h[("counts_fingerprint", r, c)]])
        self.writes.append(("wait", r, em.writers))
        T = ids.shape[0]
        em = Emulator(p["owner"], mem=self.mem, name=p["scale_entry"], valid=self.h.ranges())
        em.launch(SCALE_GRID, SCALE_THREADS, [
            h[("recv", r)], h[("rows", r, c)], h[("weights", r, c)], h[("out", r, c)], T, N // 8,
            self.row_bytes, r, h[("err", r)], h[("epoch", r)], self.slot_bytes, h[("y", r)],
            plan.row_capacity + 1, self.slot_bytes // self.row_bytes])
        self.writes.append(("scale", r, em.writers))

    def call(self, c, producers=None, consumers=None, owners=None):
        """One call on every rank in OverlapCombine's order (see the module doc); producers /
        consumers / owners: the ranks whose step runs (default all)."""
        every = range(self.W)
        self.writes = []
        for r in every:
            self.begin_call(r, c)
        for r in every if producers is None else producers:
            self.produce(r, c)
        for r in every if consumers is None else consumers:
            self.consume(r, c)
        for r in every if owners is None else owners:
            self.scale(r, c)

    # ---- reading back -------------------------------------------------------------------
    def out(self, r, c):
        return self.h.get(("out", r, c))

    def all_nan(self, r, c):
        raw = self.out(r, c)
        return raw == NAN2.to_bytes(2, "little") * (len(raw) // 2)

    def err(self, r):
        return self.h.words(("err", r), ERR_WORDS)

    def block(self, r):
        return self.h.words(("block", r), 3 * self.W)

    def fingerprint(self, r, c):
        return int(self.inputs[c][r][2].counts_fingerprint)


def inputs_of(W, calls_per_rank):
    """inputs[c][r] for calls_per_rank[c][r] = the routing index rank r calls with."""
    out = []
    for per_rank in calls_per_rank:
        row = []
        for r, i in enumerate(per_rank):
            ids, ws, _ = routing(W, i)
            plan = plan_of(W, i, r)
            h, w = expert_inputs(W, i, r, plan.row_capacity)
            row.append((ids[r], ws[r], plan, h, w))
        out.append(row)
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_emulated_combine_is_bitwise_the_reference(W):
    calls = [0, 1]
    ref = spawn_ranks(_reference_worker, W, calls, timeout_s=60, join_timeout_s=180)
    # a rank with no tokens; both layouts; rows past the last band of a plan
    assert any(0 in ROUTINGS[W][i][0] for i in calls)
    ranks = Ranks(W, inputs_of(W, [[i] * W for i in calls]))
    for c, i in enumerate(calls):
        ranks.call(c)
        epoch, parity = c + 1, (c + 1) & 1
        ids = routing(W, i)[0]
        for r in range(W):
            assert ranks.err(r) == [0] * ERR_WORDS, (W, c, r, ranks.err(r))
            want = tobytes(ref[r][c])
            assert ranks.out(r, c) == want, (W, c, r, "output differs from reference_combine")
            # arrivals: the rows each expert owner s ships back to r (r's assignments to s's
            # experts; r's own not counted: read from y) + one call marker per call, cumulative;
            # this slot's tags are this call's
            blk = ranks.block(r)
            sent = [sum(int(((routing(W, j)[0][r] // EL) == s).sum()) for j in calls[:c + 1])
                    if s != r else 0 for s in range(W)]
            assert blk[:W] == [sent[s] + epoch for s in range(W)], (W, c, r, blk, sent)
            assert blk[:W] == ranks.h.words(("expected", r), W)
            assert blk[W + parity * W:2 * W + parity * W] == \
                [call_tag(epoch, ranks.fingerprint(r, c))] * W
        # the consumers wrote only into the peers' receive slots of this parity (rows the
        # plans name) and the communication blocks; the waits wrote nothing
        slots = [(ranks.h[("recv", d)] + parity * ranks.slot_bytes,
                  ranks.h[("recv", d)] + (parity + 1) * ranks.slot_bytes) for d in range(W)]
        blocks = [(ranks.h[("block", d)], ranks.h[("block", d)] + 3 * W * 8) for d in range(W)]
        for kind, r, writers in ranks.writes:
            if kind == "consumer":
                assert all(any(lo <= a < hi for lo, hi in slots + blocks) for a in writers)
                plan = ranks.inputs[c][r][2]
                nseg = int(plan.num_segments)
                rows = sum(int(plan.segment_rows[j]) for j in range(nseg))
                nrow = sum(1 for a in writers if any(lo <= a < hi for lo, hi in slots))
                assert nrow == rows * N * 2 // 4, (W, c, r, nrow, rows)  # each row once
                # r ships the rows of its experts' other-rank assignments
                assert rows == sum(int(((ids[s] // EL) == r).sum()) for s in range(W) if s != r)
            elif kind == "wait":
                assert not writers, (W, c, r)


def test_emulated_skipped_call_is_an_epoch_mismatch():
    """Rank 0 skips call 1 (routing 2, the larger): its next call (routing 3) runs at the epoch
    rank 1 makes call 1 with; the counters alone pass on rank 0 (it gets more of rank 1's rows
    than routing 3 needs), only the counts fingerprint in the tag tells."""
    W = 2
    rows = lambda i, s, d: int(((routing(W, i)[0][s] // EL) == d).sum())  # noqa: E731
    assert rows(2, 1, 0) >= rows(3, 1, 0) and rows(3, 0, 1) < rows(2, 0, 1)
    ranks = Ranks(W, inputs_of(W, [[0, 0], [3, 2]]))
    ranks.call(0)
    assert all(ranks.err(r) == [0] * ERR_WORDS for r in range(W))
    ranks.call(1)
    e0, e1 = ranks.err(0), ranks.err(1)
    tags = [call_tag(2, ranks.fingerprint(r, 1)) for r in range(W)]
    assert tags[0] != tags[1]
    # rank 0 (waits first): source 1's tag is not its own
    assert e0[:6] == [ERR_EPOCH_MISMATCH, 0, 1, 1, tags[1], tags[0]], e0
    # rank 1: rank 0 shipped fewer rows than routing 2 expects; its wait sees rank 0's code
    assert e1[:5] == [ERR_PEER_ERROR, 1, 1 - 1, 2, ERR_EPOCH_MISMATCH], e1
    assert ranks.all_nan(0, 1) and ranks.all_nan(1, 1)


def _overflow_plan(W, i, rank):
    """rank's plan of routing i's counts with its own count of one local expert far above the
    band capacity (validate=False): the overflow plan (num_bands outside [0, B])."""
    _, _, counts = routing(W, i)
    bad = counts.clone()
    bad[rank, rank * EL] += 100_000
    cap_rows = max(t for t in ROUTINGS[W][i][0]) * TOPK * W
    return plan_combine(bad, rank, tile_m=TILE_M, layout="aligned", max_rows=cap_rows,
                        validate=False)


def test_emulated_overflow_plan_stops_its_peer():
    W, bad_rank = 2, 1
    inputs = inputs_of(W, [[0, 0], [2, 2]])
    ids, ws, plan, h, w = inputs[1][bad_rank]
    over = _overflow_plan(W, 2, bad_rank)
    B = over.band_capacity
    assert not 0 <= int(over.num_bands) <= B and int(over.num_segments) == 0
    inputs[1][bad_rank] = (ids, ws, over, h[:over.row_capacity] if h.shape[0] >=
                           over.row_capacity else torch.zeros(over.row_capacity, HID,
                                                              dtype=torch.bfloat16), w)
    ranks = Ranks(W, inputs)
    ranks.call(0)
    assert all(ranks.err(r) == [0] * ERR_WORDS for r in range(W))
    blk_before = [ranks.block(r) for r in range(W)]
    ranks.call(1)
    e_bad = ranks.err(bad_rank)
    assert e_bad[:6] == [ERR_PRODUCER_BOUNDS, bad_rank, -1, 0, int(over.num_bands), B], e_bad
    # its consumer (sticky) ships nothing and posts no call marker; its scale writes NaN
    assert [wr for k, r, wr in ranks.writes if k == "consumer" and r == bad_rank] == [{}]
    peer = 1 - bad_rank
    assert ranks.block(peer)[bad_rank] == blk_before[peer][bad_rank]
    assert ranks.all_nan(bad_rank, 1)
    # the peer's wait for it ends on its code: ERR_PEER_ERROR naming it, its code 9
    e = ranks.err(peer)
    assert e[:6] == [ERR_PEER_ERROR, peer, bad_rank, 2, ERR_PRODUCER_BOUNDS,
                     blk_before[peer][bad_rank]], e
    assert e[6] < TIMEOUT_NS
    assert ranks.all_nan(peer, 1)


def test_emulated_missing_consumer_times_out_naming_it():
    W, silent = 2, 1
    ranks = Ranks(W, inputs_of(W, [[0, 0]]), timeout_ns=200_000)
    ranks.call(0, consumers=[0])
    exp = [ranks.h.words(("expected", r), W) for r in range(W)]
    for r in range(W):
        e = ranks.err(r)
        # rank 0 waits for rank 1's rows + marker; rank 1 for its own marker: both name rank 1
        assert e[:6] == [ERR_SCALE_TIMEOUT, r, silent, 1, ranks.block(r)[silent],
                         exp[r][silent]], (r, e)
        assert e[6] > 200_000
        assert ranks.all_nan(r, 0)
