"""CPU checks of the host half of issue 21 (fail loudly, recover): the asynchronous error
read-back (``ErrorWatch``) and where the layers call it, the collective ``reset()``, the
combine's first-call barrier, and the launch order / host work of one overlapped call. The
kernels are replaced by fakes that record what the host does, in order; the device error word
is a CPU tensor (read synchronously). The GPU half: tests/test_recover_gpu.py."""
import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import spawn_ranks
from fake_symmetric import fake_runtime
from moe_overlap.combine.comm_buffer import CommBuffer
from moe_overlap.combine.options import CombineOptions
from moe_overlap.combine.overlap import OverlapCombine, OverlapError
from moe_overlap.runtime.error_watch import DeviceError, ErrorWatch
from moe_overlap.diagnostics import CombineDebug, FFNDebug
from moe_overlap.ffn import band_allreduce as B
from moe_overlap.ffn.options import FFNOptions
from moe_overlap.kernels import errors as E


def _timeout_word(rank=1):
    return torch.tensor([E.ERR_SCALE_TIMEOUT, rank, 0, 7, 3, 5, 2_000_000, 0], dtype=torch.int64)


# ------------------------------------------------------------------------ ErrorWatch alone
def test_error_watch_raises_on_the_next_call_then_clears():
    err = torch.zeros(8, dtype=torch.int64)
    w = ErrorWatch(err, E.describe_error, "OverlapCombine (rank 1)")
    w.poll()  # nothing read yet
    w.after_call()
    w.poll()  # clear
    err.copy_(_timeout_word())  # the call fails on the device ...
    w.after_call()  # ... and its read-back is started
    with pytest.raises(DeviceError) as ei:
        w.poll()  # the next call raises
    msg = str(ei.value)
    assert "rank 1" in msg and "source rank 0" in msg and "epoch 7" in msg and "reset()" in msg
    with pytest.raises(DeviceError):
        w.check()  # the explicit check reads the device word itself
    err.zero_()  # what reset() does to the word ...
    w.clear()  # ... and to the host copy
    w.poll()
    w.after_call()
    w.poll()
    w.check()


def test_error_watch_never_waits_for_a_read_in_flight():
    class Ev:
        done = False

        def query(self):
            return self.done

    err = torch.zeros(8, dtype=torch.int64)
    w = ErrorWatch(err, E.describe_error, "x")
    err.copy_(_timeout_word())
    w.after_call()
    ev = w._event = Ev()  # as a CUDA read-back whose copy has not completed
    w.poll()  # not done: no raise, no wait
    n = w.copies
    w.after_call()  # still in flight: no second copy into the busy buffer
    assert w.copies == n
    ev.done = True
    with pytest.raises(DeviceError):
        w.poll()


def test_error_watch_off_reads_only_on_check():
    err = _timeout_word()
    w = ErrorWatch(err, E.describe_error, "x", enabled=False)
    w.after_call()
    w.poll()
    assert w.copies == 0
    with pytest.raises(DeviceError):
        w.check()


def test_error_check_option_is_validated():
    assert CombineOptions().error_check == "async" and FFNOptions().error_check == "async"
    CombineOptions(error_check="off")
    FFNOptions(error_check="off")
    with pytest.raises(ValueError, match="error_check"):
        CombineOptions(error_check="sync")
    with pytest.raises(ValueError, match="error_check"):
        FFNOptions(error_check=True)


# ------------------------------------------------------------------------ fakes
class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


@pytest.fixture
def no_cuda(monkeypatch):
    """torch.cuda stream / sync functions as recorders, for host-order tests on the CPU."""
    log = []
    s0 = _Stream(log, "s0")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: s0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    return log


def _fake_combine(log, error_check="async", fail_call=None, comm=None, N=16, monkeypatch=None):
    """An OverlapCombine (rank 0 of 2) whose kernels are recorders, on a real CommBuffer (its
    own, or ``comm``) over the CPU stand-in for nvshmem4py (tests/fake_symmetric.py); the scale
    of its call number ``fail_call`` (1-based) records a timeout in the error word."""
    ov = object.__new__(OverlapCombine)
    W, T = 2, 4
    ov.rank, ov.world_size, ov.out_features, ov.device = 0, W, N, torch.device("cpu")
    ov.options = SimpleNamespace(ccta=4, local_copy=False, consumer_piece_rows=0)
    ov._debug = CombineDebug()
    if comm is None:
        comm = CommBuffer(None, "nvlink", runtime=fake_runtime(monkeypatch, log,
                                                               patch_sync=False))
    ov.comm, ov.max_recv_rows, ov._band_ready = comm, T * 2, None
    comm.attach(ov, ov.max_recv_rows, N * 2)
    ov._async_errors = error_check == "async"
    ov._band_ready = torch.zeros(4, dtype=torch.int32)
    ov._y = None
    ov.num_sms = 132
    ov._warm = ov._prod_warm = False
    ov.cs = _Stream(log, "cs")
    ov.rt = comm.runtime
    log.clear()  # construction's allocation barriers are not part of the call's order
    calls = {"n": 0}

    def warmup():
        log.append("warmup")
        ov._warm = True

    def scale_launch(**kw):
        log.append("scale")
        if calls["n"] == fail_call:
            ov.err.copy_(_timeout_word(rank=0))

    def begin_call(ids, w, plan, routes):
        calls["n"] += 1
        log.append("begin")
        return OverlapCombine.begin_call(ov, ids, w, routes=SimpleNamespace(
            rows=ids.int(), expected_inc=torch.ones(W, dtype=torch.int64)))

    ov.check_inputs = lambda *a: None
    ov.warmup = warmup
    ov.buffers_for = lambda h, plan: (torch.zeros(h.shape[0] + 1, N), ov._band_ready)
    ov.produce = lambda h, w, plan, y, flags, ccta=None: log.append(
        "produce" if flags is ov._band_ready else "produce(warm)")
    ov.ship = lambda *a, **k: log.append("ship")
    ov.begin_call = begin_call
    ov.scale = SimpleNamespace(launch=scale_launch)
    plan = SimpleNamespace(band_capacity=4,
                           counts_fingerprint=torch.tensor([-0x2345679], dtype=torch.int32))
    args = (torch.zeros(8, 8), torch.zeros(1, 8, N), plan, torch.zeros(T, 2, dtype=torch.int64),
            torch.ones(T, 2))
    return ov, args


def test_combine_first_call_warms_up_and_barriers_before_any_cross_rank_wait(no_cuda,
                                                                            monkeypatch):
    log = no_cuda
    ov, args = _fake_combine(log, monkeypatch=monkeypatch)
    ov.forward(*args)
    first_launch = min(log.index("ship"), log.index("produce"))
    assert log.index("warmup") < log.index("produce(warm)") < log.index("barrier") < first_launch
    log.clear()
    ov.forward(*args)
    assert "barrier" not in log and "warmup" not in log  # once


def test_combine_launches_the_producer_before_the_consumer(no_cuda, monkeypatch):
    log = no_cuda
    ov, args = _fake_combine(log, monkeypatch=monkeypatch)
    ov._warm = ov._prod_warm = True
    ov.forward(*args)
    # cs depends on s0 before the producer (begin_call only), the producer is launched first,
    # then the consumer, then (local_copy=False) cs waits for the producer and the scale runs
    assert log == ["begin", "cs waits s0", "produce", "ship", "cs waits s0", "scale",
                   "s0 waits cs"], log


def _scale_launch_of_one_call(log, monkeypatch):
    """(ov, args, the keywords of its scale's launch) after one warm forward of the fake
    combine."""
    ov, args = _fake_combine(log, monkeypatch=monkeypatch)
    ov._warm = ov._prod_warm = True
    kw = {}
    launch = ov.scale.launch
    ov.scale.launch = lambda **k: (kw.update(k), launch(**k))
    ov.forward(*args)
    return ov, args, kw


def test_combine_scale_polls_the_peers_symmetric_error_words(no_cuda, monkeypatch):
    """The call's scale gets the buffer's table of every rank's (symmetric) error word, so its
    arrival wait can stop at a peer's error (ERR_PEER_ERROR) instead of its timeout."""
    ov, args, kw = _scale_launch_of_one_call(no_cuda, monkeypatch)
    assert kw["err_peers"] is ov.comm.err_peers and kw["err"] is ov.comm.err
    assert ov.comm.err_peers.shape == (2,)
    assert any(t is ov.comm.err for t in ov.rt._tensors)  # a symmetric allocation


def test_combine_scale_checks_the_tags_against_the_calls_plan(no_cuda, monkeypatch):
    """The call's scale checks the epoch tags against this call's plan's counts fingerprint
    (every rank's plan of one call holds the same one; a rank that skipped a call ships with
    another routing's), beside the epoch."""
    ov, args, kw = _scale_launch_of_one_call(no_cuda, monkeypatch)
    assert kw["epoch_tags"] and kw["epoch"] is ov.epoch
    assert kw["fingerprint"] is args[2].counts_fingerprint


def test_combine_error_raises_on_the_next_call_before_any_launch(no_cuda, monkeypatch):
    log = no_cuda
    ov, args = _fake_combine(log, fail_call=2, monkeypatch=monkeypatch)
    ov._warm = ov._prod_warm = True
    ov.forward(*args)
    ov.forward(*args)  # its scale times out: returns (no sync in the call)
    log.clear()
    with pytest.raises(OverlapError, match="rank 0.*scale timed out"):
        ov.forward(*args)
    assert log == [], log  # raised before any device work
    with pytest.raises(OverlapError):
        ov.check_errors()
    assert ov.synchronize == ov.check_errors


def test_combine_error_check_off_does_not_raise_in_calls(no_cuda, monkeypatch):
    log = no_cuda
    ov, args = _fake_combine(log, error_check="off", fail_call=1, monkeypatch=monkeypatch)
    ov._warm = ov._prod_warm = True
    for _ in range(3):
        ov.forward(*args)
    with pytest.raises(OverlapError):
        ov.check_errors()


def test_combine_reset_clears_every_word_between_two_barriers(no_cuda, monkeypatch):
    log = no_cuda
    ov, args = _fake_combine(log, fail_call=1, monkeypatch=monkeypatch)
    ov._warm = ov._prod_warm = True
    ov.forward(*args)
    seen = []
    ov.comm.runtime.barrier = lambda what="": seen.append(
        [int(t.abs().sum()) for t in (ov.err, ov.buffers.block, ov.expected, ov.epoch,
                                      ov._band_ready)])
    for t in (ov.buffers.block, ov.expected, ov._band_ready):
        t.fill_(3)
    log.clear()
    ov.reset()
    assert len(seen) == 2 and all(seen[0]) and not any(seen[1]), seen
    assert log[0] == "sync" and log.count("sync") == 2
    ov.forward(*args)  # the error read back before the reset is forgotten
    ov.forward(*args)
    assert int(ov.epoch) == 2


# ------------------------------------------------------------------------ fused FFN
class _FakeAllReduce:
    def __init__(self, log, M, N, fail=False):
        self.log, self.max_rows, self.fail = log, M, fail
        self.acc = torch.zeros(M, N)
        self.arrive, self.done = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
        self.expected = torch.zeros(4, dtype=torch.int32)
        self.band_ready = torch.zeros(4, dtype=torch.int32)
        self.epoch = torch.zeros(1, dtype=torch.int32)
        self.err = torch.zeros(B.ERR_WORDS, dtype=torch.int64)

    def __call__(self, M, b2=None, out=None, producer=False, bump_epoch=True, stream=None):
        self.log.append(("allreduce", getattr(stream, "name", "current")))
        if self.fail:
            self.err.copy_(torch.tensor([B.ERR_ARRIVE_TIMEOUT, 0, 2, 0, 1, 2, 3_000_000, 0]))
        return out


class _FakeCompute:
    def __init__(self, log):
        self.log, self.counters = log, {}

    def counter_for(self, band_ready):
        self.log.append("counter_for")
        return self.counters.setdefault(id(band_ready), torch.zeros_like(band_ready))

    def __call__(self, x, w1, b1, w2, acc, ready, epoch, ccta=0, act1="gelu", stream=None):
        self.log.append(("compute", stream.name, b1))

    def grouped(self, x, w1, b1, w2, acc, ready, epoch, mte, ccta=0, act1="gelu", stream=None):
        self.log.append(("compute", stream.name, b1))


def _fake_fused(mod, log, M=256, fail=False):
    """Turn a reference-backend layer (CPU) into a fused one whose kernels are recorders."""
    mod.backend = "fused"
    mod.options = FFNOptions()
    mod.ccta, mod.tile_m, mod.max_tokens = 4, 64, None
    mod._debug = FFNDebug()
    mod._compute = _FakeCompute(log)
    mod._allreduce = _FakeAllReduce(log, M, mod.out_features, fail)
    mod._comm_stream = _Stream(log, "comm")
    mod._warm, mod._b1_cache = True, None
    mod._watch = ErrorWatch(mod._allreduce.err, B.describe_error,
                            f"{type(mod).__name__} (rank 0)")
    cur = _Stream(log, "cur")
    mod._streams = lambda device: (cur, mod._comm_stream)
    mod._keep_for = lambda t, s: log.append("keep")
    return mod


def _ffn(**kw):
    from moe_overlap.ffn.layers import FusedFFN
    return FusedFFN(64, 128, 128, act1="gelu", bias=True, **kw)


def test_fused_call_host_work_before_the_first_launch_and_compute_first():
    log = []
    mod = _fake_fused(_ffn(), log)
    with torch.no_grad():
        mod.b1.copy_(torch.arange(128.0))
        x = torch.zeros(8, 64, dtype=torch.bfloat16)
        mod(x)
        mod(x)
    launches = [e for e in log if isinstance(e, tuple)]
    assert [e[:2] for e in launches] == [("compute", "cur"), ("allreduce", "comm")] * 2, log
    i = log.index(launches[0])
    assert log[i + 1] == launches[1]  # nothing on the host between the two launches
    assert "counter_for" in log[:i]  # the scratch counter exists before the first launch
    b1a, b1b = launches[0][2], launches[2][2]
    assert b1a.dtype == torch.float32 and b1a is b1b  # converted once, not per call
    assert torch.equal(b1a, torch.arange(128.0))
    with torch.no_grad():
        mod.b1.fill_(2.0)  # a weight update: converted again
        mod(x)
    assert torch.equal([e for e in log if isinstance(e, tuple)][-2][2], torch.full((128,), 2.0))


def test_sharded_experts_fused_call_converts_b_in_once():
    from moe_overlap.ffn.layers import ShardedExperts
    log = []
    mod = _fake_fused(ShardedExperts(2, 64, 128, 128, bias=True), log)
    with torch.no_grad():
        x = torch.zeros(8, 64, dtype=torch.bfloat16)
        mod(x, [3, 2])
        mod(x, [3, 2])
    comp = [e for e in log if isinstance(e, tuple) and e[0] == "compute"]
    assert comp[0][2].dtype == torch.float32 and comp[0][2] is comp[1][2]


def test_fused_error_raises_on_the_next_call_naming_rank_and_band():
    log = []
    mod = _fake_fused(_ffn(), log, fail=True)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        mod(x)  # its all-reduce times out: no raise in the call itself
        n = len(log)
        with pytest.raises(RuntimeError, match=r"FusedFFN \(rank 0\).*band 2") as ei:
            mod(x)
    assert isinstance(ei.value, DeviceError)
    assert len(log) == n  # raised before any launch
    with pytest.raises(DeviceError):
        mod.check_fused()  # the old name still checks


# ------------------------------------------------------------------------ reset is collective
def _reset_worker(rank, world):
    from moe_overlap.combine.layer import MoECombine
    from moe_overlap.ffn.layers import ShardedExperts
    res = {}
    for name, mod in (("ffn", _ffn()), ("experts", ShardedExperts(2, 64, 128, 128, bias=True))):
        log = []
        _fake_fused(mod, log)
        ar = mod._allreduce
        for t in (ar.err, ar.acc, ar.arrive, ar.done, ar.expected, ar.band_ready, ar.epoch):
            t.fill_(5)
        cnt = mod._compute.counter_for(ar.band_ready)
        cnt.fill_(5)
        if rank == 1:
            time.sleep(1.0)
        t0 = time.perf_counter()
        mod.reset()
        res[name + "_s"] = time.perf_counter() - t0
        res[name + "_zero"] = all(not t.any() for t in (
            ar.err, ar.acc, ar.arrive, ar.done, ar.expected, ar.band_ready, ar.epoch, cnt))
    comb = MoECombine(8, 16, 16, 2, 4, backend="reference")
    if rank == 1:
        time.sleep(1.0)
    t0 = time.perf_counter()
    comb.reset()
    res["combine_s"] = time.perf_counter() - t0
    return res


def test_reset_is_collective_and_zeroes_the_fused_state():
    r0, r1 = spawn_ranks(_reset_worker, 2, join_timeout_s=120)
    for name in ("ffn", "experts"):
        assert r0[name + "_zero"] and r1[name + "_zero"], (r0, r1)
        assert r0[name + "_s"] > 0.8, r0  # rank 0 waited for rank 1 (a barrier)
    assert r0["combine_s"] > 0.8, r0


def test_fused_warmup_barriers_after_compiling_before_the_first_cross_rank_wait(no_cuda):
    log = no_cuda
    mod = _fake_fused(_ffn(), log)
    ar = mod._allreduce
    ar.compile = lambda: log.append("compile allreduce")
    ar.check = lambda: log.append("check")
    mod._barrier = lambda: log.append("barrier")
    mod._warm = False
    with torch.no_grad():
        mod(torch.zeros(8, 64, dtype=torch.bfloat16))
    names = [e if isinstance(e, str) else e[0] for e in log]
    first_ar = names.index("allreduce")  # the warm-up all-reduce: the first cross-rank wait
    assert names.index("compute") < names.index("compile allreduce") < names.index("barrier") \
        < first_ar, names
