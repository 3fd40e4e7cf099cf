"""CPU checks of the combine's shared communication buffer (issue 21, "Memory";
moe_overlap/combine/comm_buffer.py): the heap sizes and the CLI report, the process-wide sharing
registry, growth rules, the epoch advancing per call ON THE BUFFER (not per layer), errors and
reset() of one layer reaching every layer on the buffer, and the full-heap message naming the
shared size. Symmetric memory is the CPU stand-in for nvshmem4py under the real NvshmemRuntime
(tests/fake_symmetric.py); every layer / buffer method under test is the product code. The GPU
half (two layers of different N interleaved on one buffer, bitwise): tests/test_comm_buffer_gpu.py.
"""
from types import SimpleNamespace

import pytest
import torch

from fake_symmetric import fake_runtime
from moe_overlap.combine.comm_buffer import (CommBuffer, CommBufferError, LayerShape,
                                             comm_block_bytes, heap_report, slot_bytes_for)
from moe_overlap.combine.overlap import OverlapCombine, OverlapError
from moe_overlap.kernels import errors as E
from moe_overlap.runtime.nvshmem import NvshmemError, symmetric_size_mib


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(CommBuffer, "_shared", {})


class _Layer:
    """What attach() needs of a layer: band flags to clear on reset."""

    def __init__(self):
        self._band_ready = torch.full((4,), 7, dtype=torch.int32)

    def _clear_band_flags(self):
        self._band_ready.zero_()


def _buffer(monkeypatch, log=None, **kw):
    rt = fake_runtime(monkeypatch, log, **kw)
    return CommBuffer(None, "nvlink", runtime=rt), rt


# ------------------------------------------------------------------------ sizing
def test_heap_report_of_the_issue_model():
    r = heap_report([(4096, 8, 7168, 60)], world_size=8)
    slot = 4096 * 8 * 7168 * 2
    assert r["slot_bytes"] == slot == slot_bytes_for(4096, 8, 7168)
    assert r["block_bytes"] == comm_block_bytes(8) == E.comm_block_words(8) * 8
    assert r["err_bytes"] == E.ERR_WORDS * 8  # the symmetric error word, one per buffer
    assert r["unshared_bytes"] == 60 * (2 * slot + 24 * 8 + 64)  # 0.94 GB a layer, 56 GB
    assert r["shared_bytes"] == 2 * slot + 24 * 8 + 64
    assert r["layers"] == 60
    mib = r["symmetric_size_mib"]
    assert r["symmetric_size"] == f"{mib}M" and mib == symmetric_size_mib(r["shared_bytes"])
    assert mib * 2 ** 20 >= r["shared_bytes"]  # the size to set holds the buffer


def test_heap_report_mixed_shapes_takes_the_largest_slot():
    r = heap_report([LayerShape(4096, 8, 2048, 3), (1024, 8, 7168), (8192, 2, 4096)], 2)
    slots = [4096 * 8 * 2048 * 2, 1024 * 8 * 7168 * 2, 8192 * 2 * 4096 * 2]
    assert r["slot_bytes"] == max(slots) and r["layers"] == 5
    per = 48 + 64  # block + error word of each buffer
    assert r["unshared_bytes"] == 3 * (2 * slots[0] + per) + 2 * slots[1] + per + 2 * slots[2] + per
    assert r["shared_bytes"] == 2 * max(slots) + per


@pytest.mark.parametrize("layers,W,msg", [
    ([], 2, "at least one layer"), ([(4096, 0, 7168)], 2, "topk=0"),
    ([(4096, 8, 7168)], 0, "world_size"), ([(4096.0, 8, 7168)], 2, "max_tokens_per_rank")])
def test_heap_report_rejects_bad_shapes(layers, W, msg):
    with pytest.raises(ValueError, match=msg):
        heap_report(layers, W)


def test_cli_heap_prints_both_sizes_and_the_variable(capsys):
    from moe_overlap.cli import main
    assert main(["heap", "--layer", "4096,8,7168,60", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    r = heap_report([(4096, 8, 7168, 60)], 8)
    assert str(r["unshared_bytes"]) in out and str(r["shared_bytes"]) in out
    assert f"NVSHMEM_SYMMETRIC_SIZE={r['symmetric_size']}" in out
    assert main(["heap", "--layer", "deepseek-v3@4096,2", "--world-size", "2"]) == 0
    assert str(heap_report([(4096, 8, 7168, 2)], 2)["shared_bytes"]) in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["heap", "--layer", "4096,8,7"])  # N not a multiple of 8


# ------------------------------------------------------------------------ sharing registry
def test_shared_registry_key_is_group_transport_dtype():
    a = CommBuffer.shared(None, "nvlink", torch.bfloat16)
    assert CommBuffer.shared(None, "nvlink", torch.bfloat16) is a
    assert CommBuffer.shared(None, "nvshmem", torch.bfloat16) is not a
    assert CommBuffer.shared(None, "nvlink", torch.float16) is not a
    group = object()  # another process group (any object: the key is its identity)
    b = CommBuffer.shared(group, "nvlink", torch.bfloat16)
    assert b is not a and b.group is group
    assert CommBuffer.shared(group, "nvlink", torch.bfloat16) is b
    with pytest.raises(ValueError, match="transport"):
        CommBuffer.shared(None, "nccl")
    with pytest.raises(ValueError, match="dtype"):
        CommBuffer(None, "nvlink", torch.float32)


def test_moe_combine_layers_share_the_default_buffer_and_reserve_the_largest():
    from moe_overlap import MoECombine
    a = MoECombine(8, 64, 256, 2, 32)  # auto backend, one CPU rank: nothing allocated
    b = MoECombine(8, 64, 1024, 4, 16, transport="nvlink")
    c = MoECombine(8, 64, 128, 2, 32, transport="nvshmem")
    assert a.comm_buffer is b.comm_buffer and a.comm_buffer is not c.comm_buffer
    assert a.comm_buffer.reserved_slot_bytes == max(32 * 2 * 256 * 2, 16 * 4 * 1024 * 2)
    assert not a.comm_buffer.allocated  # host only until the first overlapped call
    assert MoECombine(8, 64, 256, 2, 32, backend="reference").comm_buffer is None
    own = CommBuffer()
    assert MoECombine(8, 64, 256, 2, 32, comm_buffer=own).comm_buffer is own
    with pytest.raises(TypeError, match="CommBuffer"):
        MoECombine(8, 64, 256, 2, 32, comm_buffer="shared")
    with pytest.raises(ValueError, match="transport='nvshmem'"):
        MoECombine(8, 64, 256, 2, 32, transport="nvlink", comm_buffer=CommBuffer(
            transport="nvshmem"))
    MoECombine(8, 64, 20, 2, 32)  # an N the overlap path cannot run: not refused by "auto"


def test_overlap_combine_checks_comm_buffer_before_cuda():
    with pytest.raises(TypeError, match="CommBuffer"):
        OverlapCombine(comm_buffer=object())


# ------------------------------------------------------------------------ allocation, growth
def test_reserved_sizes_allocate_once_at_the_first_attach(monkeypatch):
    log = []
    buf, rt = _buffer(monkeypatch, log)
    buf.reserve(64, 512)
    buf.reserve(16, 2048 * 2)
    assert log == [] and not buf.allocated
    layers = [_Layer(), _Layer()]
    buf.attach(layers[0], 64, 512)
    assert buf.slot_bytes == 16 * 4096 and buf.growths == 0
    # receive slots, communication block, then the error word (symmetric, its own allocation)
    assert [e for e in log if e != "barrier"] == [("alloc", (16 * 4096,)), ("alloc", (6,)),
                                                  ("alloc", (8,))]
    assert rt.allocated_bytes() == buf.heap_bytes() == 2 * 16 * 4096 + 48 + 64
    assert buf.err.data_ptr() == rt._tensors[2].data_ptr() and buf.err_peers.numel() == 2
    buf.attach(layers[1], 16, 4096)  # fits: nothing allocated, no collective
    assert len(log) == 6 and buf.num_layers == 2
    del layers[1]
    assert buf.num_layers == 1  # a layer that is gone is not kept alive by its buffer


def test_a_larger_layer_grows_the_buffer_collectively(monkeypatch):
    log = []
    buf, rt = _buffer(monkeypatch, log)
    buf.attach(_Layer(), 8, 32)
    buf.epoch.fill_(5)
    buf.expected.fill_(9)
    buf.buffers.counters.fill_(9)
    buf.err[0] = 3
    log.clear()
    buf.attach(_Layer(), 8, 64)
    frees = [i for i, e in enumerate(log) if e[0] == "free"]
    assert len(frees) == 2 and "barrier" in log[:frees[0]]  # every rank quiet before the free
    assert log[-1] == "barrier"  # and every rank has the new memory before any ships
    assert buf.slot_bytes == 8 * 64 and buf.growths == 1
    # the old slots and block are freed; the error word is kept (not reallocated)
    assert rt.allocated_bytes() == buf.heap_bytes() == 2 * 8 * 64 + 48 + 64
    assert ("alloc", (8,)) not in log and int(buf.err[0]) == 3
    assert int(buf.epoch) == 5  # epoch kept (tags of the new block are 0 != any next epoch)
    assert not buf.expected.any() and not buf.buffers.block.any()  # expected = new counters
    assert buf.slots(8, 32).stride() == (256, 32, 1)  # old layer: same rows, new slot stride
    assert buf.slots(8, 32).data_ptr() == buf.buffers.recv.data_ptr()


def test_growth_is_refused_once_a_call_was_captured(monkeypatch):
    buf, rt = _buffer(monkeypatch)
    buf.attach(_Layer(), 8, 32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    buf.note_call()
    assert buf.captured and buf.calls == 1
    before = rt.allocated_bytes()
    with pytest.raises(CommBufferError, match=r"receive slots of 1024 bytes.*CUDA graph"):
        buf.attach(_Layer(), 16, 64)
    assert rt.allocated_bytes() == before and buf.slot_bytes == 256  # nothing reallocated
    buf.attach(_Layer(), 8, 16)  # what fits is still fine


def test_full_heap_error_names_the_shared_size(monkeypatch):
    buf, _ = _buffer(monkeypatch, heap_limit=1 << 20)
    buf.reserve(4096, 1024)  # 4 MiB slots, 8 MiB in all
    with pytest.raises(NvshmemError) as ei:
        buf.attach(_Layer(), 64, 1024)
    m = str(ei.value)
    need = 2 * 4096 * 1024 + comm_block_bytes(2) + 64
    assert "NVSHMEM_SYMMETRIC_SIZE=" in m and "out of symmetric memory" in m
    assert f"communication buffer needs {need / 2**20:.1f} MiB" in m
    assert "sharing one CommBuffer" in m and "moe-overlap heap" in m


def test_slots_of_layers_of_different_widths_share_the_slot_stride(monkeypatch):
    buf, _ = _buffer(monkeypatch)
    buf.attach(_Layer(), 16, 7168 * 2)
    buf.attach(_Layer(), 32, 2048 * 2)
    big, small = buf.slots(16, 7168), buf.slots(32, 2048)
    step = buf.slot_bytes // 2
    assert big.stride(0) == small.stride(0) == step
    assert big[1].data_ptr() == small[1].data_ptr() == buf.buffers.recv.data_ptr() + 2 * step
    small[1].fill_(1.0)  # the small layer's slot 1 stays inside slot 1
    flat = buf.buffers.recv
    assert not flat[:step].any() and int(flat[step:].count_nonzero()) == 32 * 2048
    with pytest.raises(CommBufferError, match="does not fit"):
        buf.slots(17, 7168)


# ------------------------------------------------------------------------ calls on the buffer
def _layer_on(buf, n):
    """An OverlapCombine on ``buf`` with only what begin_call / reset / the views read."""
    ov = object.__new__(OverlapCombine)
    ov.comm, ov.max_recv_rows, ov.out_features, ov._band_ready = buf, 8, n, None
    buf.attach(ov, ov.max_recv_rows, n * 2)
    ov._band_ready = torch.zeros(4, dtype=torch.int32)
    return ov


def _call(ov, inc):
    routes = SimpleNamespace(rows=torch.zeros(2, 2, dtype=torch.int32),
                             expected_inc=torch.tensor(inc, dtype=torch.int64))
    ov.begin_call(None, torch.ones(2, 2), routes=routes)
    return int(ov.epoch) & 1  # the slot this call receives into


def test_epoch_and_slot_parity_advance_per_call_on_the_buffer(monkeypatch):
    buf, _ = _buffer(monkeypatch)
    a, b = _layer_on(buf, 64), _layer_on(buf, 32)
    slots = [_call(ov, [1, 2]) for ov in (a, b, a, b, a)]
    # consecutive calls on the buffer alternate slots whatever layer makes them (per-layer
    # epochs would give A1 and B1 the same slot: [1, 1, 0, 0, 1])
    assert slots == [1, 0, 1, 0, 1]
    assert int(a.epoch) == int(b.epoch) == 5 and a.epoch is b.epoch is buf.epoch
    assert buf.expected.tolist() == [5, 10] and a.expected is b.expected  # one cumulative count
    assert buf.calls == 5 and not buf.captured
    assert a.recv_slot(2).data_ptr() == b.recv_slot(4).data_ptr()  # slot 0 of the buffer
    assert a.recv_slot(1).data_ptr() == b.recv_slot(3).data_ptr() == \
        buf.buffers.recv.data_ptr() + buf.slot_bytes


def test_an_error_of_one_layer_raises_in_the_next_call_of_another(monkeypatch):
    import contextlib
    from test_recover_cpu import _fake_combine, _Stream  # the recorders of the host-order tests
    log = []
    s0 = _Stream(log, "s0")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: s0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    a, args_a = _fake_combine(log, fail_call=1, monkeypatch=monkeypatch)
    b, args_b = _fake_combine(log, comm=a.comm, N=32, monkeypatch=monkeypatch)
    assert b.comm is a.comm and b.err is a.err and a.comm.num_layers == 2
    for ov in (a, b):
        ov._warm = ov._prod_warm = True
    a.forward(*args_a)  # its scale records a timeout (read back asynchronously)
    log.clear()
    with pytest.raises(OverlapError, match="shared by 2 layers.*scale timed out"):
        b.forward(*args_b)  # the other layer raises, before any launch
    assert log == [], log
    with pytest.raises(OverlapError):
        b.check_errors()
    a._band_ready.fill_(4)
    b._band_ready.fill_(4)
    b.reset()  # collective reset through either layer clears the buffer for both
    assert not a.err.any() and int(a.epoch) == 0 and not a.expected.any()
    assert not a._band_ready.any() and not b._band_ready.any()
    a.check_errors()
    b.forward(*args_b)
    a.forward(*args_a)
    assert int(a.epoch) == 2


def test_a_layer_that_has_not_run_yet_reports_and_resets_the_shared_buffer(monkeypatch):
    from moe_overlap import MoECombine
    buf, _ = _buffer(monkeypatch)
    other = _Layer()
    buf.attach(other, 8, 64)  # another layer's overlap backend allocated it
    layer = MoECombine(8, 64, 32, 2, 4, comm_buffer=buf)
    layer.check_errors()
    buf.err[0] = E.ERR_SCALE_TIMEOUT
    with pytest.raises(OverlapError, match="scale timed out"):
        layer.check_errors()
    buf.epoch.fill_(3)
    layer.reset()
    assert not buf.err.any() and int(buf.epoch) == 0 and not other._band_ready.any()
    layer.check_errors()


def test_runtime_free_returns_the_heap(monkeypatch):
    rt = fake_runtime(monkeypatch)
    t = rt.alloc((128,), torch.bfloat16)
    rt.peer_table(t)
    u = rt.alloc((16,), torch.int64)
    assert rt.allocated_bytes() == 256 + 128
    rt.free(t)
    assert rt.allocated_bytes() == 128 and len(rt._peer_views) == 0
    with pytest.raises(NvshmemError, match="not a symmetric tensor"):
        rt.free(torch.zeros(3))
    rt.free(u)
    assert rt.allocated_bytes() == 0


def test_heap_report_counts_the_ordered_scales_segment_words(monkeypatch):
    """A scale="ordered" layer's per-segment arrival words (W x its segment capacity, int64) are
    part of the heap: the report equals what a CommBuffer allocates for the same layers."""
    from moe_overlap.combine.comm_buffer import ordered_segment_capacity
    from moe_overlap.combine.plan import plan_combine
    W = 2
    plain, ordered = LayerShape(16, 4, 256), LayerShape(8, 4, 512, count=2, experts=8, tile_m=64)
    r = heap_report([plain, ordered], W)
    cap = ordered_segment_capacity(W, 8, 4, 4, 64)
    # the capacity is what plan_combine gives a plan at the layer's most rows
    counts = torch.full((W, 8), 8 * 4 // 8, dtype=torch.int64)
    assert plan_combine(counts, 0, tile_m=64, max_rows=W * 8 * 4).segment_capacity == cap
    assert r["seg_bytes"] == W * cap * 8 > 0
    assert heap_report([plain], W)["seg_bytes"] == 0
    assert r["shared_bytes"] == heap_report([plain, LayerShape(8, 4, 512, 2)], W)[
        "shared_bytes"] + r["seg_bytes"]
    assert r["unshared_bytes"] == heap_report([plain, LayerShape(8, 4, 512, 2)], W)[
        "unshared_bytes"] + 2 * r["seg_bytes"]
    log = []
    buf, rt = _buffer(monkeypatch, log)
    buf.attach(_Layer(), 16 * 4, 256 * 2)
    buf.attach(_Layer(), 8 * 4, 512 * 2, seg_words=W * cap)
    assert rt.allocated_bytes() == buf.heap_bytes() == r["shared_bytes"]
    with pytest.raises(ValueError, match="experts"):
        heap_report([LayerShape(8, 4, 512, experts=3)], W)


def test_cli_heap_with_the_ordered_scale(capsys):
    from moe_overlap.cli import main
    assert main(["heap", "--layer", "deepseek-v3@4096,60", "--world-size", "8", "--scale",
                 "ordered", "--json"]) == 0
    out = capsys.readouterr().out
    r = heap_report([LayerShape(4096, 8, 7168, 60, experts=256)], 8)
    assert r["seg_bytes"] > 0 and str(r["shared_bytes"]) in out and "per-segment" in out
    assert main(["heap", "--layer", "4096,8,7168,60,256", "--world-size", "8", "--scale",
                 "ordered"]) == 0
    assert str(r["shared_bytes"]) in capsys.readouterr().out
    with pytest.raises(SystemExit, match="experts"):
        main(["heap", "--layer", "4096,8,7168,60", "--scale", "ordered"])
