"""The device counts exchange's compiled PTX (combine/counts_exchange.py, nvlink transport) run on
the host (tests/ptx_emulator.py) for W emulated ranks whose buffers lie in one poisoned memory:
the peer tables point at the other ranks' counts tables and error words. Per call every rank's
post kernel, then every rank's gather kernel, as ``CountsExchange.launch`` issues them; each
rank's output must be bitwise the host all-gather (``exchange_counts``' reference path of the
same counts) for W = 1, 2, 4, several calls in a row (both parities), a rank with no tokens and
ids outside [0, E) (not counted). Schedules: lockstep, and a fast rank whose next post lands
before the slow ranks' gather (what the two parities are for). Every word written lies where
the protocol says (the table's row and flag of this rank's parity on every rank, the output,
the epoch). The negative cases: a rank that never posts (timeout naming source and epoch), one
with an error recorded (ERR_PEER_ERROR), ranks out of step (ERR_EPOCH_MISMATCH).

What this cannot see: real concurrency and memory ordering (the emulator runs kernels one after
another); the PTX order checks of tests/test_counts_exchange_compile.py and the GPU runs of
tests/test_counts_exchange_gpu.py cover those."""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap.combine.dispatch import _count_unchecked  # noqa: E402
from moe_overlap.combine.reference import all_gather_counts  # noqa: E402
from moe_overlap.combine.counts_exchange import counts_table_words  # noqa: E402
from moe_overlap.kernels.errors import (ERR_COUNTS_TIMEOUT, ERR_EPOCH_MISMATCH,  # noqa: E402
                                        ERR_PEER_ERROR, ERR_WORDS, call_tag, describe_error)
from conftest import compile_ptx, spawn_ranks  # noqa: E402
from ptx_emulator import Emulator  # noqa: E402
from emulated_memory import Heap, POISON, tobytes  # noqa: E402

pytestmark = pytest.mark.compile

TIMEOUT_NS = 10_000_000_000
_PTX = {}


def _ptx(W, nt):
    if (W, nt) not in _PTX:
        from moe_overlap.combine.counts_exchange import (build_counts_exchange,
                                                         counts_exchange_example_args)
        ptx = compile_ptx(build_counts_exchange(W, nt), *counts_exchange_example_args())
        import re
        names = [re.search(rf"\.entry\s+(\w*{n}_kernel\w*)", ptx).group(1)
                 for n in ("post", "gather")]
        _PTX[(W, nt)] = (ptx, *names)
    return _PTX[(W, nt)]


class Ranks:
    """W emulated ranks' counts-exchange state in one memory (what a CommBuffer holds per rank:
    the symmetric counts table, zeroed as the buffer allocates it, its peer table, the error
    word and its peer table, the counts epoch) plus each rank's input counts and output."""

    def __init__(self, W, E, nt=32, timeout_ns=TIMEOUT_NS):
        """E: the table's capacity (the most experts of any call); a call may pass fewer."""
        self.W, self.E, self.nt, self.timeout_ns = W, E, nt, timeout_ns
        h = self.h = Heap()
        self.words = counts_table_words(W, E)
        for r in range(W):
            for name, n in (("counts", E * 8), ("out", W * E * 8), ("table", self.words * 8),
                            ("peers", W * 8), ("epoch", 8), ("err", ERR_WORDS * 8),
                            ("err_peers", W * 8)):
                h.alloc((name, r), n)
        self.mem = h.make()
        for r in range(W):
            h.put_words(("table", r), [0] * self.words)
            h.put_words(("err", r), [0] * ERR_WORDS)
            h.put_words(("epoch", r), [0])
            h.put_words(("peers", r), [h[("table", d)] for d in range(W)])
            h.put_words(("err_peers", r), [h[("err", d)] for d in range(W)])
        self.writes = []  # (kernel, rank, {word address: CTAs})

    def set_counts(self, r, counts):
        self.h.put(("counts", r), tobytes(counts.to(torch.int64)))

    def _emu(self, name):
        ptx = _ptx(self.W, self.nt)
        entry = ptx[1] if name == "post" else ptx[2]
        return Emulator(ptx[0], mem=self.mem, name=entry, valid=self.h.ranges())

    def post(self, r, E=None):
        h = self.h
        em = self._emu("post")
        em.launch(1, self.nt, [h[("counts", r)], E or self.E, self.E, r, h[("table", r)],
                               h[("peers", r)], h[("epoch", r)], h[("err", r)]])
        self.writes.append(("post", r, em.writers))

    def gather(self, r, E=None):
        h = self.h
        em = self._emu("gather")
        em.launch(1, self.nt, [h[("out", r)], E or self.E, self.E, r, h[("table", r)],
                               h[("epoch", r)], h[("err", r)], h[("err_peers", r)],
                               self.timeout_ns])
        self.writes.append(("gather", r, em.writers))

    def out(self, r, E=None):
        E = E or self.E
        return torch.tensor(self.h.words(("out", r), self.W * E)).view(self.W, E)

    def err(self, r):
        return self.h.words(("err", r), ERR_WORDS)

    def epoch(self, r):
        return self.h.words(("epoch", r), 1)[0]


def _host_counts(ids, E):
    """Per-expert counts of a routing in plain Python (ids outside [0, E) not counted)."""
    c = [0] * E
    for v in ids.reshape(-1).tolist():
        if 0 <= v < E:
            c[v] += 1
    return torch.tensor(c, dtype=torch.int64)


def _routing(W, E, call, seed=0):
    """Per rank int64 ids [T, 2]: some out of range (-1, E, E + 7), rank W - 1 with 0 tokens
    on odd calls, skewed draws."""
    g = torch.Generator().manual_seed(1000 * W + 10 * call + seed)
    out = []
    for r in range(W):
        T = 0 if (r == W - 1 and call % 2 == 1 and W > 1) else 5 + 7 * r + 3 * call
        ids = torch.randint(0, E, (T, 2), generator=g)
        if T:
            ids[0, 0] = -1
            ids[T - 1, 1] = E
            ids[T // 2, 0] = E + 7
            ids[:, 1][ids[:, 1] < E] //= 2  # skew toward the low experts
        out.append(ids)
    return out


def _allowed(ranks, parity):
    """Word ranges a call may write: on every rank d, row (parity, r) and flag (parity, r) of
    each source r (the posts); every rank's output and epoch (the gathers)."""
    W, E, h = ranks.W, ranks.E, ranks.h
    post, gather = [], []
    for d in range(W):
        t = h[("table", d)]
        for r in range(W):
            post.append((t + 8 * (parity * W + r), t + 8 * (parity * W + r) + 8))
            lo = t + 8 * (2 * W + (parity * W + r) * E)
            post.append((lo, lo + 8 * E))
        gather.append((h[("out", d)], h[("out", d)] + 8 * W * E))
        gather.append((h[("epoch", d)], h[("epoch", d)] + 8))
    return post, gather


def _inside(addrs, ranges):
    return all(any(lo <= a < hi for lo, hi in ranges) for a in addrs)


def _run_calls(W, E, calls, schedule, nt=32):
    ranks = Ranks(W, E, nt)
    inputs = [_routing(W, E, c) for c in range(calls)]
    outs = [[None] * W for _ in range(calls)]
    for c in range(calls):
        for r in range(W):
            assert ranks.epoch(r) == c
        ranks.writes = []
        for r in range(W):
            if not (schedule == "fast" and W > 1 and r == 0 and c > 0):  # posted ahead
                ranks.set_counts(r, _count_unchecked(inputs[c][r], E))
                ranks.post(r)
        if schedule == "fast" and W > 1:
            # rank 0 gathers, then posts call c + 1 into every table before the others gather
            ranks.gather(0)
            outs[c][0] = ranks.out(0)
            if c + 1 < calls:
                ranks.set_counts(0, _count_unchecked(inputs[c + 1][0], E))
                ranks.post(0)
            rest = range(1, W)
        else:
            rest = range(W)
        for r in rest:
            ranks.gather(r)
            outs[c][r] = ranks.out(r)
        post_ok, gather_ok = _allowed(ranks, (c + 1) & 1)
        if schedule == "fast" and c + 1 < calls:
            post_ok += _allowed(ranks, (c + 2) & 1)[0]
        for kind, r, w in ranks.writes:
            assert _inside(w, post_ok if kind == "post" else gather_ok), (c, kind, r)
        for r in range(W):
            assert ranks.err(r) == [0] * ERR_WORDS, (c, r, describe_error(ranks.err(r)))
    return ranks, inputs, outs


@pytest.mark.parametrize("schedule", ["lockstep", "fast"])
@pytest.mark.parametrize("W,E", [(1, 5), (2, 6), (4, 12), (8, 24)])
def test_emulated_exchange_is_the_host_all_gather(W, E, schedule):
    calls = 3
    ranks, inputs, outs = _run_calls(W, E, calls, schedule)
    for c in range(calls):
        want = torch.stack([_host_counts(inputs[c][r], E) for r in range(W)])
        if W == 1:  # the host path of one rank, in this process
            assert torch.equal(all_gather_counts(_count_unchecked(inputs[c][0], E)), want)
        for r in range(W):
            assert outs[c][r].dtype == torch.int64
            assert torch.equal(outs[c][r], want), (c, r, outs[c][r], want)
    assert inputs[1][W - 1].numel() == 0 or W == 1  # a rank with no tokens was exchanged
    for r in range(W):
        assert ranks.epoch(r) == calls
        # each source's flag of both parities holds the last call of that parity
        flags = ranks.h.words(("table", r), 2 * W)
        assert flags == [max(e for e in range(1, calls + 1) if e & 1 == p) for p in range(2)
                         for _ in range(W)], flags


def _host_worker(rank, W):
    """exchange_counts' host path (gloo all_gather, validate=False) of the emulated routings."""
    from moe_overlap.combine import exchange_counts
    E = 6
    return [exchange_counts(_routing(W, E, c)[rank], E, validate=False) for c in range(3)]


def test_emulated_exchange_is_bitwise_exchange_counts_over_gloo():
    W, E = 2, 6
    host = spawn_ranks(_host_worker, W, timeout_s=60, join_timeout_s=180)
    _, _, outs = _run_calls(W, E, 3, "lockstep")
    for c in range(3):
        for r in range(W):
            assert torch.equal(outs[c][r], host[r][c]), (c, r)


def test_emulated_nothing_outside_the_protocol_is_written():
    """Two ranks, one call: the whole memory after it differs from before only in the words the
    protocol names (every other byte still the poison or its initial value)."""
    W, E = 2, 6
    ranks = Ranks(W, E)
    ids = _routing(W, E, 0)
    for r in range(W):
        ranks.set_counts(r, _count_unchecked(ids[r], E))
    before = bytes(ranks.mem)
    for r in range(W):
        ranks.post(r)
    for r in range(W):
        ranks.gather(r)
    post_ok, gather_ok = _allowed(ranks, 1)
    changed = [a for a in range(0, len(before), 8) if ranks.mem[a:a + 8] != before[a:a + 8]]
    assert changed and _inside(changed, post_ok + gather_ok)
    assert POISON == ranks.mem[ranks.h[("out", 0)] + 8 * W * E]  # past the output: poison


def test_emulated_timeout_names_the_missing_source_and_epoch():
    W, E = 2, 4
    ranks = Ranks(W, E, timeout_ns=200_000)
    for r in range(W):
        ranks.set_counts(r, torch.arange(E) + r)
    ranks.post(1)  # rank 0 never posts
    for r in (1, 0):  # rank 1 first: rank 0's error word is still clear while it waits
        ranks.gather(r)
    for r in range(W):
        e = ranks.err(r)
        # code, rank, source 0, epoch 1, its flag 0, expected 1, elapsed past the bound
        assert e[:6] == [ERR_COUNTS_TIMEOUT, r, 0, 1, 0, 1], (r, e)
        assert e[6] > 200_000
        assert "source rank 0" in describe_error(e) and "epoch 1" in describe_error(e)
        assert torch.equal(ranks.out(r), torch.zeros(W, E, dtype=torch.int64))  # not read
        assert ranks.epoch(r) == 1
    # sticky: the next post of rank 1 stores nothing
    ranks.writes = []
    ranks.post(1)
    assert ranks.writes[-1][2] == {}


def test_emulated_peer_error_ends_the_wait_before_the_timeout():
    W, E = 2, 4
    ranks = Ranks(W, E, timeout_ns=10_000_000)
    ranks.h.put_words(("err", 0), [77])  # rank 0 has an error recorded: it posts nothing
    for r in range(W):
        ranks.set_counts(r, torch.arange(E))
        ranks.post(r)
    assert [w for k, r, w in ranks.writes if r == 0] == [{}]
    ranks.gather(1)
    e = ranks.err(1)
    assert e[:5] == [ERR_PEER_ERROR, 1, 0, 1, 77], e
    assert e[6] < 10_000_000
    assert torch.equal(ranks.out(1), torch.zeros(W, E, dtype=torch.int64))


def test_emulated_ranks_out_of_step_record_an_epoch_mismatch():
    """Rank 0 two calls ahead (same parity: only the flag's value tells): rank 1 sees its flag
    past the epoch."""
    W, E = 2, 4
    ranks = Ranks(W, E, timeout_ns=200_000)
    ranks.h.put_words(("epoch", 0), [2])
    for r in range(W):
        ranks.set_counts(r, torch.arange(E))
        ranks.post(r)
    ranks.gather(1)
    e = ranks.err(1)
    assert e[:6] == [ERR_EPOCH_MISMATCH, 1, 0, 0, call_tag(3, 0), call_tag(1, 0)], e
    assert torch.equal(ranks.out(1), torch.zeros(W, E, dtype=torch.int64))


def test_layers_of_different_expert_counts_share_the_table_with_a_fast_rank():
    """Two layers of E 4 and 8 on one table (its capacity 8): call 1 of the E = 4 layer, rank 1
    gathers it and posts call 2 of the E = 8 layer before rank 0 gathers call 1. Rows strided by
    the capacity keep the parities apart, so rank 0 still reads call 1's counts (strided by the
    call's E, the E = 8 row of parity 0 overlapped the E = 4 row of parity 1)."""
    W, E_small, E_cap = 2, 4, 8
    rk = Ranks(W, E_cap)
    small = [torch.arange(E_small, dtype=torch.int64) + 10 * (r + 1) for r in range(W)]
    for r in range(W):
        rk.set_counts(r, small[r])
        rk.post(r, E_small)
    rk.gather(1, E_small)
    assert torch.equal(rk.out(1, E_small), torch.stack(small))
    rk.set_counts(1, torch.full((E_cap,), 999, dtype=torch.int64))
    rk.post(1, E_cap)
    rk.gather(0, E_small)
    assert torch.equal(rk.out(0, E_small), torch.stack(small)), rk.out(0, E_small)
    assert rk.err(0)[0] == 0
