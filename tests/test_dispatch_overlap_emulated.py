"""The overlapped dispatch's compiled PTX (combine/dispatch_send.py, combine/dispatch_expand.py)
run on the host (tests/ptx_emulator.py) for W emulated ranks whose buffers lie in one memory:
the peer tables point at the other ranks' receive slots, communication blocks and error words.
Per call, as ``MoEDispatch._forward_overlap`` launches them: every rank's epoch and expected
counts advance, every rank's send kernel runs, then every rank's wait kernel (its counters are
satisfied by then: no inter-CTA waiting) and expand kernel. Each rank's output must be bitwise
``MoEDispatch``'s reference backend (gloo ranks) on the same inputs; the error words stay 0;
the count words, call tags and arrival counters hold what the send kernel's docstring says; and
every word written lies where the protocol says (the rows and ids the owner will read, its count
word, tag and counter; the output): nothing else of the poisoned memory changes.

Two calls per case (slot parities 1 then 0, cumulative counters), a rank with 0 tokens, skewed
and duplicate routings, several send CTAs and batches, fewer expand CTAs than work items. The
negative cases: another counts fingerprint or epoch on one rank (ERR_EPOCH_MISMATCH, NaN
output; the sticky error then stops that rank's next send), a rank that never sends (timeout)
or has an error recorded (ERR_PEER_ERROR) while the others wait for it.

What this cannot see: real concurrency and memory ordering (the emulator runs CTAs and threads
one after another); those stay for tests/test_dispatch_overlap_gpu.py and the PTX order checks
of tests/test_dispatch_overlap_compile.py."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap import MoEDispatch  # noqa: E402
from moe_overlap.combine import exchange_counts  # noqa: E402
from moe_overlap.combine.dispatch_index import arrival_schedule, slot_layout  # noqa: E402
from moe_overlap.combine.plan import plan_combine  # noqa: E402
from moe_overlap.kernels.errors import (ERR_DISPATCH_TIMEOUT, ERR_EPOCH_MISMATCH,  # noqa: E402
                                        ERR_PEER_ERROR, ERR_WORDS, call_tag)
from moe_overlap.routing import route  # noqa: E402
from conftest import compile_ptx, spawn_ranks  # noqa: E402
from ptx_emulator import Emulator  # noqa: E402
from emulated_memory import Heap, tobytes as _tobytes  # noqa: E402

pytestmark = pytest.mark.compile

K, TILE_M = 2, 64
TIMEOUT_NS = 10_000_000_000
# W: (El, D, tokens per rank per call, routing per call, send threads, send CTAs, expand
# threads, expand CTAs)
CASES = {
    2: (3, 64, [(40, 0), (3, 37)], ["skew", "dup"], 32, 2, 32, 4),
    3: (2, 128, [(5, 0, 70), (0, 9, 2)], ["dup", "skew"], 64, 3, 32, 2),
    4: (2, 64, [(20, 0, 33, 7), (0, 12, 5, 40)], ["skew", "dup"], 32, 2, 32, 2),
}
_PTX = {}


def _ids(W, El, tokens, kind, seed):
    E = El * W
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, T in enumerate(tokens):
        if kind == "skew":
            ids = route(T, E, K, "stress_skew", seed=seed, rank=r)[0]
        else:  # independent draws: some tokens pick one expert twice
            ids = torch.randint(0, E, (T, K), generator=g)
        out.append(ids.reshape(T, K))
    return out


def _inputs(W, call):
    El, D, tokens, kinds = CASES[W][:4]
    ids = _ids(W, El, tokens[call], kinds[call], seed=10 * W + call)
    xs = [torch.randn(T, D, generator=torch.Generator().manual_seed(100 * call + r)).to(
        torch.bfloat16) for r, T in enumerate(tokens[call])]
    return xs, ids


def _layout_of(call):
    return ("aligned", "packed")[call % 2]


def _reference_worker(rank, W):
    El, D, tokens = CASES[W][:3]
    res = []
    for call in range(2):
        xs, ids = _inputs(W, call)
        counts = exchange_counts(ids[rank], El * W)
        plan = plan_combine(counts, rank, tile_m=TILE_M, layout=_layout_of(call))
        layer = MoEDispatch(El * W, D, K, max_tokens_per_rank=max(max(t) for t in tokens))
        res.append((counts, layer(xs[rank], ids[rank], plan, counts, rows=plan.row_capacity)))
    return res


def _ptx(W, nt_send, nt_exp, arrival=False, wait="all"):
    """(send PTX, expand PTX, its kernels' entry names: wait and expand, or the per-source
    kernel's alone)."""
    key = (W, nt_send, nt_exp, arrival, wait)
    if key not in _PTX:
        from moe_overlap.combine.dispatch_expand import build_dispatch_expand, expand_example_args
        from moe_overlap.combine.dispatch_send import build_dispatch_send, send_example_args
        send = compile_ptx(build_dispatch_send(W, K, nt_send), *send_example_args())
        exp = compile_ptx(build_dispatch_expand(W, K, nt_exp, signal_arrival=arrival, wait=wait),
                          *expand_example_args(arrival, wait))
        kernels = ("wait", "expand") if wait == "all" else ("per_source",)
        _PTX[key] = (send, exp, *(re.search(rf"\.entry\s+(\w*{n}_kernel\w*)", exp).group(1)
                                  for n in kernels))
    return _PTX[key]


class Ranks:
    """W emulated ranks' dispatch state in one memory (a CommBuffer's worth per rank: two
    receive slots, the communication block, the error word, the epoch, the expected counts,
    the peer tables) and per-call inputs; ``call`` launches the kernels as MoEDispatch does."""

    def __init__(self, W, Tmax, rows_max, timeout_ns=TIMEOUT_NS, arrival=False, wait="all",
                 grid_exp=None):
        self.W, self.arrival, self.wait = W, arrival, wait
        El, D, _, _, nt_send, ctas, nt_exp, grid = CASES[W]
        self.El, self.D, self.Tmax = El, D, Tmax
        self.nt_send, self.ctas, self.nt_exp = nt_send, ctas, nt_exp
        self.grid_exp = grid if grid_exp is None else grid_exp
        self.timeout_ns = timeout_ns
        self.lay = slot_layout(W, Tmax, D, K)
        self.stride = self.lay["slot_bytes"] + 64  # CommBuffer.slot_bytes may exceed the layout
        E = El * W
        h = self.h = Heap()
        for r in range(W):
            for name, n in (("x", Tmax * D * 2), ("ids", Tmax * K * 4),
                            ("recv", 2 * self.stride), ("block", 3 * W * 8),
                            ("err", ERR_WORDS * 8), ("epoch", 4), ("fp", 4),
                            ("expected", W * 8), ("recv_peers", W * 8), ("ctr_peers", W * 8),
                            ("err_peers", W * 8), ("ers", El * 4), ("grs", El * W * 4),
                            ("erows", El * 4), ("total", 4), ("counts", W * E * 8),
                            ("out", rows_max * D * 2), ("arr_count", El * 4),
                            ("band_arrived", rows_max // TILE_M * 4),
                            ("state", (1 + rows_max // TILE_M) * 4)):
                h.alloc((name, r), n)
        self.mem = h.make()
        for r in range(W):
            for name in ("block", "err", "expected", "arr_count", "band_arrived", "state"):
                h.put((name, r), bytes(h.regions[(name, r)][1]))
            h.put_words(("epoch", r), [0], 32)
            for table, name in (("recv_peers", "recv"), ("ctr_peers", "block"),
                                ("err_peers", "err")):
                h.put_words((table, r), [h[(name, d)] for d in range(W)])
        self.epoch = [0] * W
        self.writes = []  # (kernel, rank, {word address: CTAs})
        self.flags_before = {}  # rank -> band_arrived words as the expand found them
        self.hooks = {}  # rank -> {address: fn(emulator)}: the expand's load hooks
        self.flag_stores = {}  # rank -> [(band, value)]: the expand's band_arrived stores

    def set_inputs(self, xs, ids, counts, plans, rows):
        h, W = self.h, self.W
        self.T = [x.shape[0] for x in xs]
        self.rows = rows
        for r in range(W):
            h.put(("x", r), _tobytes(xs[r]))
            h.put(("ids", r), _tobytes(ids[r].to(torch.int32)))
            p = plans[r]
            h.put(("ers", r), _tobytes(p.expert_row_start))
            h.put(("grs", r), _tobytes(p.group_row_start))
            h.put(("erows", r), _tobytes(p.expert_rows))
            h.put(("total", r), _tobytes(p.total_rows))
            h.put(("fp", r), _tobytes(p.counts_fingerprint))
            h.put(("counts", r), _tobytes(counts.to(torch.int64)))

    def _emu(self, ptx, name=None):
        return Emulator(ptx, mem=self.mem, name=name, valid=self.h.ranges())

    def send(self, r):
        h, lay = self.h, self.lay
        ptx = _ptx(self.W, self.nt_send, self.nt_exp, self.arrival)[0]
        em = self._emu(ptx)
        em.launch(self.ctas, self.nt_send, [
            # a rank of 0 tokens passes address 0, as torch's empty CUDA tensors do
            h[("x", r)] if self.T[r] else 0, h[("ids", r)] if self.T[r] else 0, self.T[r],
            self.El, lay["row_bytes"], r, self.Tmax,
            h[("recv_peers", r)], h[("ctr_peers", r)], self.stride, lay["ids_offset"],
            lay["count_offset"], h[("epoch", r)], h[("fp", r)], h[("err", r)]])
        self.writes.append(("send", r, em.writers))

    def counter_addr(self, r, s):
        """Rank r's arrival counter of source s (the word its wait polls)."""
        return self.h[("block", r)] + 8 * s

    def _expand_args(self, r):
        h, lay = self.h, self.lay
        return [h[("recv", r)], self.stride, lay["ids_offset"], lay["count_offset"],
                lay["row_bytes"], self.Tmax, h[("out", r)], self.rows[r], self.El, r,
                h[("ers", r)], h[("grs", r)], h[("erows", r)], h[("counts", r)],
                h[("total", r)], h[("err", r)], h[("epoch", r)]]

    def wait_expand(self, r):
        if self.wait == "per_source":
            return self.expand_per_source(r)
        h, lay = self.h, self.lay
        _, ptx, wait_name, expand_name = _ptx(self.W, self.nt_send, self.nt_exp, self.arrival)
        em = Emulator(ptx, mem=self.mem, name=wait_name, load_hooks=self.hooks.get(r),
                      valid=self.h.ranges())
        em.launch(self.W, 32, [h[("block", r)], h[("expected", r)], r, h[("err", r)],
                               self.timeout_ns, h[("epoch", r)], h[("err_peers", r)],
                               h[("fp", r)]])
        self.writes.append(("wait", r, em.writers))
        self.flags_before[r] = self.flags(r)
        em = self._emu(ptx, expand_name)
        arrival = [h[("arr_count", r)], h[("band_arrived", r)], TILE_M] if self.arrival else []
        em.launch(self.grid_exp, self.nt_exp, [
            h[("recv", r)], self.stride, lay["ids_offset"], lay["count_offset"],
            lay["row_bytes"], self.Tmax, h[("out", r)], self.rows[r], self.El, r,
            h[("ers", r)], h[("grs", r)], h[("erows", r)], h[("counts", r)], h[("total", r)],
            h[("err", r)], h[("epoch", r)]] + arrival)
        self.writes.append(("expand", r, em.writers))

    def expand_per_source(self, r):
        """The one-kernel wait + expand (wait="per_source"), with this rank's load hooks;
        its band_arrived stores kept in ``flag_stores[r]``."""
        h = self.h
        _, ptx, name = _ptx(self.W, self.nt_send, self.nt_exp, self.arrival, "per_source")
        self.flags_before[r] = self.flags(r)
        fa, fn = h.regions[("band_arrived", r)]
        em = Emulator(ptx, mem=self.mem, name=name, load_hooks=self.hooks.get(r),
                      log_stores=(fa, fa + fn), valid=self.h.ranges())
        em.launch(self.grid_exp, self.nt_exp, self._expand_args(r) + [
            h[("block", r)], h[("expected", r)], self.timeout_ns, h[("err_peers", r)],
            h[("fp", r)], h[("state", r)], fa if self.arrival else 0,
            TILE_M if self.arrival else 1])
        self.flag_stores[r] = [((a - fa) // 4, v) for a, v, _ in em.stores]
        self.writes.append(("expand", r, em.writers))

    def advance(self, epoch_skew=None):
        """The host side of a call on every rank: epoch + 1, expected + send CTAs per source."""
        for r in range(self.W):
            self.epoch[r] += 1 + (epoch_skew or {}).get(r, 0)
            self.h.put_words(("epoch", r), [self.epoch[r]], 32)
            self.h.put_words(("expected", r), [w + self.ctas for w in
                                               self.h.words(("expected", r), self.W)])

    def call(self, senders=None, epoch_skew=None, owners=None):
        self.writes = []
        self.advance(epoch_skew)
        for r in range(self.W) if senders is None else senders:
            self.send(r)
        for r in range(self.W) if owners is None else owners:
            self.wait_expand(r)

    def out(self, r):
        return self.h.get(("out", r), self.rows[r] * self.D * 2)

    def err(self, r):
        return self.h.words(("err", r), ERR_WORDS)

    def flags(self, r):
        h = self.h
        return h.words(("band_arrived", r), h.regions[("band_arrived", r)][1] // 4, bits=32)


def _goes(ids, El, d):
    """The tokens of a source with any id owned by rank d (ids outside [0, E) never are)."""
    return ((ids // El) == d).any(1) if ids.numel() else torch.zeros(0, dtype=torch.bool)


def _allowed_writes(ranks, ids, parity):
    """The word-address ranges of one valid call: (rows, shared, expand). The send writes, in
    each owner's slot of this parity, its token rows and ids rows [0, n) of the tokens it sends
    there (``rows``: one CTA each), the count word, its call tag and its arrival counter
    (``shared``: every CTA); the expand writes its output."""
    W, El, lay, h = ranks.W, ranks.El, ranks.lay, ranks.h
    send, shared = [], []
    for s in range(W):
        for d in range(W):
            n = int(_goes(ids[s], El, d).sum())
            slot = h[("recv", d)] + parity * ranks.stride
            send.append((slot + s * ranks.Tmax * lay["row_bytes"],
                         slot + (s * ranks.Tmax + n) * lay["row_bytes"]))
            send.append((slot + lay["ids_offset"] + s * ranks.Tmax * K * 4,
                         slot + lay["ids_offset"] + (s * ranks.Tmax + n) * K * 4))
            count = slot + lay["count_offset"] + 4 * s
            blk = h[("block", d)]
            tag = blk + 8 * (W + parity * W + s)
            shared += [(count, count + 4), (blk + 8 * s, blk + 8 * s + 8), (tag, tag + 8)]
    expand = [(h[("out", r)], h[("out", r)] + ranks.rows[r] * ranks.D * 2) for r in range(W)]
    return send, shared, expand


def _outside(writers, ranges):
    return sorted(a for a in writers if not any(lo <= a < hi for lo, hi in ranges))


def _covered(writers, lo, hi):
    """Every word of [lo, hi) written."""
    return all(a in writers for a in range(lo, hi, 4))


_REF = {}


def _reference(W):
    if W not in _REF:
        _REF[W] = spawn_ranks(_reference_worker, W, timeout_s=60, join_timeout_s=180)
    return _REF[W]


def _expert_bands(plan):
    """The band indices (row // TILE_M) of the plan's local experts with rows."""
    return {b for e in range(plan.experts_per_rank)
            for b in range(int(plan.expert_row_start[e]) // TILE_M,
                           (int(plan.expert_row_start[e]) + int(plan.expert_rows[e])) // TILE_M)}


@pytest.mark.parametrize("wait", ["all", "per_source"])
@pytest.mark.parametrize("arrival", [False, True], ids=["plain", "signal_arrival"])
@pytest.mark.parametrize("W", [2, 3, 4])
def test_emulated_dispatch_kernels_are_bitwise_the_reference(W, arrival, wait):
    El, D, tokens = CASES[W][:3]
    assert any(0 in t for t in tokens) and all(sum(t) for t in tokens)  # a rank with none
    ref = _reference(W)
    Tmax = max(max(t) for t in tokens)
    plans_of = []
    for call in range(2):
        counts = ref[0][call][0]
        plans_of.append([plan_combine(counts, r, tile_m=TILE_M, layout=_layout_of(call))
                         for r in range(W)])
    ranks = Ranks(W, Tmax, max(p.row_capacity for ps in plans_of for p in ps), arrival=arrival,
                  wait=wait)
    # rows past a plan's total (zeroed by the expand's last item) occur
    assert any(p.row_capacity > int(p.total_rows) for ps in plans_of for p in ps)
    for call in range(2):
        xs, ids = _inputs(W, call)
        counts, plans = ref[0][call][0], plans_of[call]
        rows = [p.row_capacity for p in plans]
        assert all(torch.equal(ref[r][call][0], counts) for r in range(W))
        ranks.set_inputs(xs, ids, counts, plans, rows)
        ranks.call()
        epoch = call + 1
        parity = epoch & 1
        for r in range(W):
            want = _tobytes(ref[r][call][1])
            assert ranks.out(r) == want, (W, call, r, "output differs from the reference")
            assert ranks.err(r) == [0] * ERR_WORDS, (W, call, r, ranks.err(r))
            blk = ranks.h.words(("block", r), 3 * W)
            fp = int(plans[r].counts_fingerprint)
            # one marker per sending CTA and call from every source, this slot's tags
            assert blk[:W] == [ranks.ctas * epoch] * W, (W, call, r, blk)
            assert blk[W + parity * W:2 * W + parity * W] == [call_tag(epoch, fp)] * W
            slot_counts = ranks.h.words(("recv", r), W, parity * ranks.stride
                                        + ranks.lay["count_offset"], 32)
            assert slot_counts == [int(_goes(ids[s], El, r).sum()) for s in range(W)]
            if arrival:  # every band of every local expert with rows flagged by this expand
                bands = _expert_bands(plans[r])
                assert bands and len(bands) < len(ranks.flags(r))  # bands past the experts
                before, after = ranks.flags_before[r], ranks.flags(r)
                assert [b for b, f in enumerate(before) if f == epoch] == [], (W, call, r)
                assert [b for b, f in enumerate(after) if f == epoch] == sorted(bands), \
                    (W, call, r, after)
                assert all(after[b] == before[b] for b in range(len(after)) if b not in bands)
                assert ranks.h.words(("arr_count", r), El, bits=32) == [0] * El  # reset
                if wait == "per_source":  # each band's flag stored once, with the epoch
                    stores = ranks.flag_stores[r]
                    assert sorted(b for b, _ in stores) == sorted(bands), (W, call, r, stores)
                    assert {v for _, v in stores} == {epoch}
            if wait == "per_source":  # the finished-CTA and band writer counts back to 0
                words = ranks.h.regions[("state", r)][1] // 4
                assert ranks.h.words(("state", r), words, bits=32) == [0] * words
        rows_ok, shared_ok, expand_ok = _allowed_writes(ranks, ids, parity)
        for kernel, r, writers in ranks.writes:
            if kernel == "send":
                assert not _outside(writers, rows_ok + shared_ok), (W, call, r, "send wrote "
                                                                    "outside")
                # rows / ids: one CTA each; the count word, tag, counter: every CTA
                one = {a: c for a, c in writers.items() if not _outside([a], rows_ok)}
                assert all(len(c) == 1 for c in one.values()), (W, call, r)
                assert all(len(c) == ranks.ctas for a, c in writers.items() if a not in one)
            elif kernel == "wait":
                assert not writers, (W, call, r, "the wait wrote")
            else:
                out0 = ranks.h[("out", r)]
                ok = [expand_ok[r]]
                names = (("arr_count", "band_arrived") if arrival else ()) + (
                    ("state",) if wait == "per_source" else ())
                for name in names:  # and the arrival counts and flags, the kernel's state
                    a, n = ranks.h.regions[(name, r)]
                    ok.append((a, a + n))
                assert not _outside(writers, ok), (W, call, r, "expand wrote outside its "
                                                   "output")
                assert _covered(writers, out0, out0 + ranks.rows[r] * D * 2)
        # every word of those ranges was written (the rows and ids of the n tokens sent, count
        # words, tags and counters of every (source, owner) pair)
        written = set().union(*(w for k, _, w in ranks.writes if k == "send"))
        for lo, hi in rows_ok + shared_ok:
            assert _covered(written, lo, hi), (W, call, "a slot word not written", lo, hi)


def _small_ranks(W=2):
    """Ranks with one valid call's inputs (no reference needed: the negative cases)."""
    El = CASES[W][0]
    xs, ids = _inputs(W, 0)
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=El * W) for i in ids])
    plans = [plan_combine(counts, r, tile_m=TILE_M, layout="aligned") for r in range(W)]
    rows = [p.row_capacity for p in plans]
    return xs, ids, counts, plans, rows


NAN_ROW = 0x7FC0  # bf16 NaN, every element of every row after an error


def _all_nan(ranks, r):
    raw = ranks.out(r)
    return raw == NAN_ROW.to_bytes(2, "little") * (len(raw) // 2)


@pytest.mark.parametrize("wait", ["all", "per_source"])
@pytest.mark.parametrize("what", ["fingerprint", "epoch"])
def test_emulated_wait_records_a_call_tag_mismatch(what, wait):
    W = 2
    xs, ids, counts, plans, rows = _small_ranks(W)
    per_source = wait == "per_source"
    ranks = Ranks(W, max(x.shape[0] for x in xs), max(rows), arrival=per_source, wait=wait)
    ranks.set_inputs(xs, ids, counts, plans, rows)
    skew = None
    if what == "fingerprint":  # rank 0 made its plan from other counts
        ranks.h.put_words(("fp", 0), [int(plans[0].counts_fingerprint) ^ 0x10], 32)
    else:  # rank 0 two calls ahead: same slot parity, so only the tag tells
        skew = {0: 2}
    ranks.call(epoch_skew=skew)
    fp = [ranks.h.words(("fp", r), 1, bits=32)[0] for r in range(W)]
    tags = [call_tag(ranks.epoch[r], fp[r]) for r in range(W)]
    for r in range(W):
        other = 1 - r
        e = ranks.err(r)
        # code, rank, source, source again, its tag, this rank's tag
        assert e[:6] == [ERR_EPOCH_MISMATCH, r, other, other, tags[other], tags[r]], (r, e)
        assert _all_nan(ranks, r), r  # per_source: also the rows its own source's items wrote
        if per_source:  # raised before the error: only bands holding none of its rows
            flagged = {b for b, f in enumerate(ranks.flags(r)) if f == ranks.epoch[r]}
            assert flagged <= _expert_bands(plans[r]) - _source_bands(plans[r], other)
    # sticky: rank 0's next send stores nothing and posts no marker; rank 1 then times out
    ranks.writes = []
    ranks.advance()
    ranks.send(0)
    assert ranks.writes[-1][2] == {}


@pytest.mark.parametrize("wait", ["all", "per_source"])
def test_emulated_wait_times_out_or_sees_the_peer_error(wait):
    W = 2
    xs, ids, counts, plans, rows = _small_ranks(W)
    ranks = Ranks(W, max(x.shape[0] for x in xs), max(rows), timeout_ns=200_000, wait=wait)
    ranks.set_inputs(xs, ids, counts, plans, rows)
    # rank 0 never sends; rank 1 waits first (rank 0's error word is still clear then)
    ranks.call(senders=[1], owners=[1, 0])
    # rank 1 waits for rank 0, rank 0 for itself: both time out on source 0 (index), epoch 1,
    # counter 0 of the send CTAs expected
    for r in range(W):
        e = ranks.err(r)
        assert e[:6] == [ERR_DISPATCH_TIMEOUT, r, 0, 1, 0, ranks.ctas], (r, e)
        assert e[6] > 200_000
        assert _all_nan(ranks, r)
    # a peer's error word ends the wait before the timeout
    xs, ids, counts, plans, rows = _small_ranks(W)
    ranks = Ranks(W, max(x.shape[0] for x in xs), max(rows), timeout_ns=10_000_000, wait=wait)
    ranks.set_inputs(xs, ids, counts, plans, rows)
    ranks.h.put_words(("err", 0), [77])  # rank 0 has an error recorded: it sends nothing
    ranks.call()
    e1 = ranks.err(1)
    assert e1[:5] == [ERR_PEER_ERROR, 1, 0, 1, 77], e1
    assert e1[6] < 10_000_000
    assert _all_nan(ranks, 1)


def _source_bands(plan, s):
    """The band indices (row // TILE_M) holding any row of source s (the plan's own tables:
    group_row_start, the counts it was made from)."""
    El, r = plan.experts_per_rank, plan.rank
    out = set()
    for e in range(El):
        c = int(plan.source_counts[s, r * El + e])
        if c:
            a = int(plan.expert_row_start[e]) + int(plan.group_row_start[e, s])
            out |= set(range(a // TILE_M, (a + c - 1) // TILE_M + 1))
    return out


def _plan_rows(xs, ids, plan):
    """The owner's expert inputs by definition: source s's (token, k) rows of expert g in
    (token, k) order from row expert_row_start + group_row_start[e, s]; every other row 0."""
    El, r, D = plan.experts_per_rank, plan.rank, xs[0].shape[1]
    out = torch.zeros(plan.row_capacity, D, dtype=xs[0].dtype)
    for e in range(El):
        for s, (x, t) in enumerate(zip(xs, ids)):
            i, _ = (t == r * El + e).nonzero(as_tuple=True)  # row-major: (token, k) order
            a = int(plan.expert_row_start[e]) + int(plan.group_row_start[e, s])
            out[a:a + i.numel()] = x[i]
    return out


@pytest.mark.parametrize("wait", ["per_source", "all"])
@pytest.mark.parametrize("layout", ["aligned", "packed"])
@pytest.mark.parametrize("W", [2, 3])
def test_emulated_band_flag_comes_before_a_later_source_arrives(W, layout, wait):
    """Owner 1; source 0 (the farthest in rank distance from 1: the last the per-source
    kernel's items wait for, though the first in index order) sends only when the owner's
    expand first polls its counter, on one CTA (every earlier item has run then). At that moment
    the per-source kernel must have raised every band holding no row of source 0, and none
    holding one (the two-kernel path: none at all, its wait kernel polls every source before
    any expand item); after it, every band once, every output its rows by definition. Two
    calls (an old epoch's flags stay behind)."""
    El, D = CASES[W][:2]
    owner, late = 1, 0
    g = torch.Generator().manual_seed(5 + W)
    tokens = [70, 90, 40][:W]
    xs, ids = [], []
    for T in tokens:  # most picks on the owner's experts: bands of one source and of several
        own = torch.randint(owner * El, (owner + 1) * El, (T, K), generator=g)
        anyw = torch.randint(0, El * W, (T, K), generator=g)
        ids.append(torch.where(torch.rand(T, K, generator=g) < 0.8, own, anyw))
        xs.append(torch.randn(T, D, generator=g).to(torch.bfloat16))
    counts = torch.stack([torch.bincount(t.reshape(-1), minlength=El * W) for t in ids])
    plans = [plan_combine(counts, r, tile_m=TILE_M, layout=layout) for r in range(W)]
    rows = [p.row_capacity for p in plans]
    ranks = Ranks(W, max(tokens), max(rows), arrival=True, wait=wait, grid_exp=1)
    ranks.set_inputs(xs, ids, counts, plans, rows)
    p = plans[owner]
    bands = _expert_bands(p)
    holds_late = _source_bands(p, late)
    early = sorted(bands - holds_late)
    assert early and holds_late and holds_late <= bands  # the case has both kinds of band
    for epoch in (1, 2):
        seen = []

        def arrive(em):
            if not seen:
                seen.append([b for b, f in enumerate(ranks.flags(owner)) if f == epoch])
                ranks.send(late)
        ranks.writes = []
        ranks.advance()
        ranks.hooks[owner] = {ranks.counter_addr(owner, late): arrive}
        for r in range(W):
            if r != late:
                ranks.send(r)
        ranks.wait_expand(owner)
        for r in range(W):
            if r != owner:
                ranks.wait_expand(r)
        assert seen, "the owner's expand never polled the late source"
        assert seen[0] == (early if wait == "per_source" else []), (W, layout, seen[0], early)
        assert [b for b, f in enumerate(ranks.flags(owner)) if f == epoch] == sorted(bands)
        for r in range(W):
            assert ranks.err(r) == [0] * ERR_WORDS, (r, ranks.err(r))
            assert ranks.out(r) == _tobytes(_plan_rows(xs, ids, plans[r])), (W, layout, r)
        if wait == "per_source":  # one CTA: the flags in the up-projection's band order
            order = arrival_schedule(p, counts)[:int(p.num_bands)].tolist()
            assert [b for b, _ in ranks.flag_stores[owner]] == order


@pytest.mark.parametrize("rank", [0, 2])
def test_emulated_send_goes_to_owners_in_their_wait_order_each_marked_when_done(rank):
    """Each send CTA stores to destination (rank - k) mod W at step k (the k-th source every
    owner's per-source expand waits for is (owner + k) mod W), and posts that destination's
    marker after its rows, ids, count and tag and before any store to the next one."""
    W = 3
    El, D, tokens = CASES[W][:3]
    Tmax = max(max(t) for t in tokens)
    xs, ids = _inputs(W, 0)
    assert all((ids[rank] // El == d).any() for d in range(W))  # rows to every owner
    counts = exchange_counts_of(ids, El * W)
    plans = [plan_combine(counts, r, tile_m=TILE_M) for r in range(W)]
    ranks = Ranks(W, Tmax, max(p.row_capacity for p in plans))
    ranks.set_inputs(xs, ids, counts, plans, [p.row_capacity for p in plans])
    ranks.advance()
    h = ranks.h
    owner_of = []  # (start, end, owner, what) of every region a send may store to
    for d in range(W):
        owner_of.append((h[("recv", d)], h[("recv", d)] + 2 * ranks.stride, d, "slot"))
        blk = h[("block", d)]
        owner_of.append((blk + 8 * rank, blk + 8 * rank + 8, d, "marker"))
        owner_of.append((blk + 8 * W, blk + 8 * 3 * W, d, "tag"))
    ptx = _ptx(W, ranks.nt_send, ranks.nt_exp)[0]
    lo, hi = min(a for a, _, _, _ in owner_of), max(b for _, b, _, _ in owner_of)
    em = Emulator(ptx, mem=ranks.mem, log_stores=(lo, hi), valid=h.ranges())
    lay = ranks.lay
    em.launch(ranks.ctas, ranks.nt_send, [
        h[("x", rank)], h[("ids", rank)], ranks.T[rank], El, lay["row_bytes"], rank, Tmax,
        h[("recv_peers", rank)], h[("ctr_peers", rank)], ranks.stride, lay["ids_offset"],
        lay["count_offset"], h[("epoch", rank)], h[("fp", rank)], h[("err", rank)]])
    want = [(rank - k) % W for k in range(W)]
    for cta in range(ranks.ctas):
        seq = []
        for addr, _, c in em.stores:
            if c != cta:
                continue
            (d, what), = [(o, w) for a, b, o, w in owner_of if a <= addr < b]
            if not seq or seq[-1][0] != d:
                seq.append((d, []))
            seq[-1][1].append(what)
        assert [d for d, _ in seq] == want, (cta, [d for d, _ in seq])
        for d, whats in seq:  # one marker, last, after the tag
            assert whats.count("marker") == 1 and whats[-1] == "marker", (cta, d, whats)
            assert whats[-2] == "tag", (cta, d, whats)


def exchange_counts_of(ids, E):
    """[W, E] int64 counts of every rank's ids (what exchange_counts all-gathers)."""
    return torch.stack([torch.bincount(i.reshape(-1).to(torch.int64), minlength=E)
                        for i in ids])
