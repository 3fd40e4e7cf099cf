"""CPU checks of the overlapped dispatch's staged source (``MoEDispatch(stage_source=)``, issue 39:
the nvshmem send's puts read a symmetric copy of x and the ids where a peer has no P2P mapping;
combine/dispatch_dedup.py, combine/comm_buffer.py): how the option resolves at construction
(auto with and without an unreachable peer on this rank or another, never, always, the nvlink
transport), the agreement on real gloo ranks, and the CommBuffer's staging region (its size,
views, growth alone and with the buffer, reset, the capture rule). Symmetric memory is the CPU
stand-in of tests/fake_symmetric.py under the real NvshmemRuntime; the staged call itself runs in
tests/test_dispatch_overlap_launch_emulated.py (w2-nvshmem-staged), the GPU run in
tests/test_dispatch_stage_gpu.py."""
import pytest
import torch

from conftest import spawn_ranks
from fake_symmetric import fake_runtime
from moe_overlap import MoEDispatch
from moe_overlap.combine.comm_buffer import CommBuffer, CommBufferError
from moe_overlap.runtime.nvshmem import NvshmemError

E, D, K, T_MAX = 8, 64, 2, 16
X_BYTES, IDS_BYTES = T_MAX * D * 2, T_MAX * K * 4  # 2048, 128: multiples of 16 already


class _Layer:
    def _clear_band_flags(self):
        pass


@pytest.fixture
def overlap_host(monkeypatch):
    """The overlap backend's construction on the host: rank 0 of 2, a "GPU" of 132 SMs."""
    import moe_overlap.combine.dispatch_dedup as DD
    import moe_overlap.runtime.device as DV
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(DD, "world", lambda group: (0, 2))
    monkeypatch.setattr(DV, "num_sms", lambda device: 132)


def _peer_flag(monkeypatch, peer: int):
    """The group's all-reduce (max) with the other rank's flag ``peer``; returns the flags this
    rank contributed, one per call."""
    import moe_overlap.runtime.collectives as C
    calls = []

    def all_reduce(t, op=None, group=None):
        calls.append(int(t.item()))
        t.fill_(max(int(t.item()), peer))
        return t
    monkeypatch.setattr(C, "all_reduce", all_reduce)
    return calls


def _allocs(log):
    return [e[1] for e in log if e != "barrier" and e[0] == "alloc"]


@pytest.mark.parametrize("mine,peer", [((1,), 0), ((), 1), ((), 0)],
                         ids=["this-rank-unreachable", "other-rank-unreachable", "all-p2p"])
def test_auto_stages_exactly_when_some_rank_has_an_unreachable_peer(monkeypatch, overlap_host,
                                                                    mine, peer):
    log = []
    rt = fake_runtime(monkeypatch, log, unreachable=mine)
    calls = _peer_flag(monkeypatch, peer)
    comm = CommBuffer(None, "nvshmem", runtime=rt)
    ov = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm)
    staged = bool(mine) or bool(peer)
    assert ov.staged == staged and ov.stage_source == "auto"
    assert comm.buffers.unreachable == mine
    assert calls == [int(bool(mine))]  # one agreement, this rank's own flag in it
    stage_alloc = ((X_BYTES + IDS_BYTES) // 8,)
    if staged:
        assert (comm.stage_x_bytes, comm.stage_ids_bytes) == (X_BYTES, IDS_BYTES)
        assert _allocs(log)[-1] == stage_alloc and comm.growths == 0  # the region alone
        x, ids = comm.staged_source(T_MAX, D, K)
        assert x.data_ptr() == comm.stage.data_ptr()
        assert ids.data_ptr() == comm.stage.data_ptr() + X_BYTES
    else:
        assert comm.stage is None and stage_alloc not in _allocs(log)
    # a second layer on the buffer: no second agreement, the same resolution
    ov2 = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm)
    assert ov2.staged == staged and len(calls) == 1


def test_never_is_refused_where_some_rank_has_an_unreachable_peer(monkeypatch, overlap_host):
    comm = CommBuffer(None, "nvshmem", runtime=fake_runtime(monkeypatch))
    _peer_flag(monkeypatch, 1)
    with pytest.raises(NvshmemError, match=r"stage_source='never'.*this rank: \[\]"):
        MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm, stage_source="never")


def test_never_over_p2p_puts_from_x(monkeypatch, overlap_host):
    comm = CommBuffer(None, "nvshmem", runtime=fake_runtime(monkeypatch))
    _peer_flag(monkeypatch, 0)
    ov = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm, stage_source="never")
    assert not ov.staged and comm.stage is None


def test_always_stages_from_the_first_attach_without_a_collective(monkeypatch, overlap_host):
    log = []
    comm = CommBuffer(None, "nvshmem", runtime=fake_runtime(monkeypatch, log))
    calls = _peer_flag(monkeypatch, 0)
    ov = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm, stage_source="always")
    assert ov.staged and calls == []
    # one allocation pass: slots, block, counts table, staging region, error word
    allocs = _allocs(log)
    assert allocs[3] == ((X_BYTES + IDS_BYTES) // 8,) and len(allocs) == 5
    assert comm.heap_bytes() == comm.runtime.allocated_bytes()


def test_nvlink_never_stages(monkeypatch, overlap_host):
    calls = _peer_flag(monkeypatch, 1)
    comm = CommBuffer(None, "nvlink", runtime=fake_runtime(monkeypatch))
    with pytest.raises(ValueError, match="nvlink transport .* never stages"):
        MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm, stage_source="always")
    assert not comm.allocated  # refused before anything is allocated
    ov = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm)
    assert not ov.staged and comm.stage is None and calls == []
    unmapped = CommBuffer(None, "nvlink", runtime=fake_runtime(monkeypatch, unreachable=(1,)))
    with pytest.raises(NvshmemError, match=r"ranks \[1\] are not reachable"):
        MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=unmapped)


def test_option_checks():
    with pytest.raises(ValueError, match="stage_source='sometimes'"):
        MoEDispatch(E, D, K, T_MAX, stage_source="sometimes")
    with pytest.raises(ValueError, match="stage_source is an option of backend='overlap'"):
        MoEDispatch(E, D, K, T_MAX, backend="reference", stage_source="always")
    assert not MoEDispatch(E, D, K, T_MAX).staged


# ------------------------------------------------------------------------ the region
def test_staging_region_size_views_and_reset(monkeypatch):
    log = []
    rt = fake_runtime(monkeypatch, log)
    comm = CommBuffer(None, "nvshmem", runtime=rt)
    comm.attach(_Layer(), 8, 64, stage_x_bytes=100, stage_ids_bytes=30)
    assert (comm.stage_x_bytes, comm.stage_ids_bytes) == (112, 32)  # each rounded up to 16
    assert comm.stage.numel() * 8 == 144 and comm.heap_bytes() == rt.allocated_bytes()
    x, ids = comm.staged_source(3, 16, 2)  # 96 + 24 bytes
    assert x.shape == (3, 16) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert ids.shape == (3, 2) and ids.dtype == torch.int32 and ids.is_contiguous()
    x.copy_(torch.arange(48, dtype=torch.bfloat16).view(3, 16))
    ids.copy_(torch.tensor([[1, 2], [3, 4], [5, 6]]))
    raw = comm.stage.view(torch.uint8)
    assert torch.equal(raw[:96].view(torch.bfloat16).view(3, 16), x)
    assert raw[112:136].view(torch.int32).tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(CommBufferError, match="staging region holds 112 \\+ 32"):
        comm.staged_source(4, 16, 2)  # 128 bytes of rows
    with pytest.raises(CommBufferError, match="staging region"):
        comm.staged_source(3, 16, 3)  # 36 bytes of ids
    comm.reset()
    assert not comm.stage.any()  # no call's tokens outlive the reset
    plain = CommBuffer(None, "nvshmem", runtime=fake_runtime(monkeypatch))
    plain.attach(_Layer(), 8, 64)
    assert plain.stage is None
    with pytest.raises(CommBufferError, match="staging region holds 0 \\+ 0"):
        plain.staged_source(1, 16, 2)


def test_staging_region_grows_alone_and_with_the_buffer(monkeypatch):
    log = []
    rt = fake_runtime(monkeypatch, log)
    comm = CommBuffer(None, "nvshmem", runtime=rt)
    comm.attach(_Layer(), 8, 64)
    recv = comm.buffers.recv
    log.clear()
    comm.attach(_Layer(), 8, 64, stage_x_bytes=64, stage_ids_bytes=16)  # first: allocated only
    assert [e for e in log if e != "barrier"] == [("alloc", (10,))]
    assert comm.growths == 0 and comm.buffers.recv is recv
    comm.stage.fill_(7)
    log.clear()
    comm.attach(_Layer(), 8, 64, stage_x_bytes=32, stage_ids_bytes=32)  # ids part grows
    frees = [i for i, e in enumerate(log) if e[0] == "free"]
    assert [log[i] for i in frees] == [("free", (10,))]  # the old region alone
    assert "barrier" in log[:frees[0]]  # every rank's sends done with it before the free
    assert [e for e in log if e != "barrier"][-1] == ("alloc", (12,))
    assert comm.growths == 1 and comm.buffers.recv is recv
    assert (comm.stage_x_bytes, comm.stage_ids_bytes) == (64, 32) and not comm.stage.any()
    log.clear()
    comm.attach(_Layer(), 16, 64)  # the slots grow: the region is freed and made with them
    assert ("free", (12,)) in log and ("alloc", (12,)) in log and comm.growths == 2
    assert (comm.stage_x_bytes, comm.stage_ids_bytes) == (64, 32)
    assert comm.heap_bytes() == rt.allocated_bytes()


def test_staging_region_growth_is_refused_once_captured(monkeypatch):
    rt = fake_runtime(monkeypatch)
    comm = CommBuffer(None, "nvshmem", runtime=rt)
    comm.attach(_Layer(), 8, 64, stage_x_bytes=64, stage_ids_bytes=16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    comm.note_call()
    before = comm.stage
    with pytest.raises(CommBufferError, match="staging region of 96 bytes.*CUDA graph"):
        comm.attach(_Layer(), 8, 64, stage_x_bytes=80, stage_ids_bytes=16)
    assert comm.stage is before
    comm.attach(_Layer(), 8, 64, stage_x_bytes=32, stage_ids_bytes=16)  # what fits is fine


# ------------------------------------------------------------------------ agreement (gloo)
def _agreement_worker(rank, world):
    """Rank 0 has an unreachable peer, the others none: every rank must stage (the region is a
    symmetric allocation made on every rank or none) and allocate the same sequence."""
    import moe_overlap.runtime.device as DV
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(DV, "num_sms", lambda device: 132)
    log = []
    rt = fake_runtime(mp, log, world=world, rank=rank, unreachable=(1,) if rank == 0 else ())
    comm = CommBuffer(None, "nvshmem", runtime=rt)
    ov = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm)
    return {"staged": ov.staged, "allocs": [list(a) for a in _allocs(log)],
            "unreachable": list(comm.buffers.unreachable)}


def test_auto_agrees_over_the_group():
    res = spawn_ranks(_agreement_worker, 2)
    assert res[0]["unreachable"] == [1] and res[1]["unreachable"] == []
    assert [r["staged"] for r in res] == [True, True]
    assert res[0]["allocs"] == res[1]["allocs"]
    assert res[0]["allocs"][-1] == [(X_BYTES + IDS_BYTES) // 8]
