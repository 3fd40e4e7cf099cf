"""The band all-reduce's symmetric allocation, torch symmetric memory or NVSHMEM (CPU, fakes).

Ranks that share a GPU cannot use torch symmetric memory (its rendezvous refuses allocations of
several ranks on one device), so the FFN's band all-reduce also allocates through the process's
``NvshmemRuntime``. Checked here without a GPU:
- the choice (``resolve_symmetric``, ``FFNOptions.symmetric``, the layers): auto is nvshmem
  exactly where ranks share a device (``runtime.device.ranks_share_device``, from every rank's
  GPU UUID), torch otherwise; switch (multicast) with nvshmem is refused;
- the allocation: for the same peer addresses, the NVSHMEM path (the real ``NvshmemRuntime``
  over a fake nvshmem4py, tests/fake_symmetric.py) hands the kernel the same buffer views and peer
  tables as the torch path (a fake torch symmetric-memory handle, the buffer at an offset inside
  its segment); an unmapped peer raises on every rank; ``release()`` frees the NVSHMEM buffer;
- one runtime per process: ``NvshmemRuntime.get`` takes None and the world group as one group
  (the combine's CommBuffer asks with None, the FFN may pass the world group).
"""
import types

import pytest
import torch

import moe_overlap.ffn.band_allreduce as B
import moe_overlap.ffn.layers as layers
import moe_overlap.runtime.collectives as collectives
import moe_overlap.runtime.device as device_mod
from moe_overlap.ffn import FusedFFN, ShardedExperts
from moe_overlap.ffn.options import FFNFacts, FFNOptions
from moe_overlap.runtime import nvshmem as N
from fake_symmetric import fake_runtime


# ------------------------------------------------------------------------ the choice
@pytest.mark.parametrize("shared,want", [(True, "nvshmem"), (False, "torch")])
def test_auto_is_nvshmem_exactly_where_ranks_share_a_device(shared, want):
    assert B.resolve_symmetric("auto", "unicast", shared) == want
    for given in ("torch", "nvshmem"):  # an explicit choice is kept
        assert B.resolve_symmetric(given, "unicast", shared) == given
    facts = FFNFacts(local_hidden=1024, num_sms=132, ranks_share_device=shared)
    r = FFNOptions().resolve(facts)
    assert r.symmetric == want and r.is_resolved
    assert r.resolve(facts) == r  # resolving is idempotent
    assert FFNOptions(symmetric="torch").resolve(facts).symmetric == "torch"


def test_switch_with_nvshmem_is_refused():
    with pytest.raises(ValueError, match="switch.*multicast.*symmetric='nvshmem', has none"):
        B.resolve_symmetric("nvshmem", "switch", False)
    with pytest.raises(ValueError, match="switch.*multicast.*symmetric='nvshmem', has none"):
        FFNOptions(comm="switch", symmetric="nvshmem")
    with pytest.raises(ValueError, match="switch.*cannot run with ranks that share a GPU"):
        FFNOptions(comm="switch").resolve(FFNFacts(local_hidden=1024, ranks_share_device=True))
    assert FFNOptions(comm="switch").resolve(FFNFacts(local_hidden=1024)).symmetric == "torch"
    with pytest.raises(ValueError, match="symmetric='cuda': choose from"):
        FFNOptions(symmetric="cuda")
    # BandAllReduce refuses it before anything else (no CUDA, no process group needed)
    with pytest.raises(ValueError, match="symmetric='nvshmem', has none"):
        B.BandAllReduce(128, 64, backend="switch", symmetric="nvshmem")
    with pytest.raises(ValueError, match="symmetric='mpi'"):
        B.BandAllReduce(128, 64, symmetric="mpi")


def _fake_group(monkeypatch, uuids, backend="gloo"):
    """ranks_share_device on rank 0 of len(uuids) ranks whose GPUs have these UUIDs."""
    monkeypatch.setattr(device_mod, "device_uuid", lambda idx: uuids[0])
    monkeypatch.setattr(collectives, "backend_of", lambda group=None: backend)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: len(uuids))
    seen = []

    def all_gather(parts, t, group=None):
        seen.append(t.device.type)
        assert bytes(t.numpy().tobytes()) == uuids[0]  # this rank sends its own UUID
        for p, u in zip(parts, uuids):
            p.copy_(torch.frombuffer(bytearray(u), dtype=torch.int64))
        return parts
    monkeypatch.setattr(collectives, "all_gather", all_gather)
    return seen


@pytest.mark.parametrize("uuids,shared", [
    ([b"A" * 16, b"A" * 16], True), ([b"A" * 16, b"B" * 16], False),
    ([b"A" * 16, b"B" * 16, b"C" * 16, b"B" * 16], True),  # two of four on one GPU
    ([b"A" * 16, b"B" * 16, b"C" * 16, b"D" * 16], False)])
def test_ranks_share_device_from_the_uuids(monkeypatch, uuids, shared):
    seen = _fake_group(monkeypatch, uuids)
    assert device_mod.ranks_share_device(None, torch.device("cuda", 0)) is shared
    assert seen == ["cpu"]  # gloo gathers host tensors


def test_one_rank_shares_nothing_and_asks_nobody(monkeypatch):
    seen = _fake_group(monkeypatch, [b"A" * 16])
    assert device_mod.ranks_share_device(None, 0) is False and seen == []


def _fused_on_cpu(monkeypatch, shared, world=2):
    """Fused layers built on this CPU machine as rank 0 of ``world``: the hardware check and the
    group are faked; ``ranks_share_device`` answers ``shared`` and logs its calls."""
    monkeypatch.setattr(layers, "_fused_requirements", lambda *a, **k: None)
    monkeypatch.setattr(layers, "num_sms", lambda device: 132)
    monkeypatch.setattr(layers, "_group_world", lambda group: (0, world))
    monkeypatch.setattr(layers, "_check_device_vs_group", lambda *a: None)
    asked = []

    def share(group, device):
        asked.append(group)
        return shared
    monkeypatch.setattr(layers, "ranks_share_device", share)
    return asked


@pytest.mark.parametrize("shared,want", [(True, "nvshmem"), (False, "torch")])
def test_layers_resolve_symmetric_once_at_construction(monkeypatch, shared, want):
    asked = _fused_on_cpu(monkeypatch, shared)
    ffn = FusedFFN(64, 256, 128, backend="fused", error_check="off")
    exp = ShardedExperts(2, 64, 256, 128, backend="fused", error_check="off")
    assert ffn.options.symmetric == want and exp.options.symmetric == want
    assert len(asked) == 2  # once per layer, at construction
    # an explicit choice asks nobody (no collective)
    asked.clear()
    assert FusedFFN(64, 256, 128, backend="fused", symmetric="torch").options.symmetric == \
        "torch"
    assert FusedFFN(64, 256, 128, backend="fused",
                    options=FFNOptions(symmetric="nvshmem")).options.symmetric == "nvshmem"
    assert asked == []
    with pytest.raises(ValueError, match="symmetric applies to backend='fused' only"):
        FusedFFN(64, 256, 128, symmetric="nvshmem")


def test_one_rank_layer_is_torch_without_asking(monkeypatch):
    asked = _fused_on_cpu(monkeypatch, True, world=1)
    assert FusedFFN(64, 256, 128, backend="fused").options.symmetric == "torch"
    assert asked == []


class _RecordingAllReduce:
    """Stands in for BandAllReduce in the layer: records its keywords and releases."""
    made = []

    def __init__(self, rows, N, group, **kw):
        self.max_rows, self.kw, self.released = rows, kw, False
        self.err = torch.zeros(B.ERR_WORDS, dtype=torch.int64)
        _RecordingAllReduce.made.append(self)

    def release(self):
        self.released = True


def test_layer_passes_its_choice_and_releases_on_growth(monkeypatch):
    _fused_on_cpu(monkeypatch, True)
    monkeypatch.setattr(B, "BandAllReduce", _RecordingAllReduce)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: object())
    _RecordingAllReduce.made = []
    m = FusedFFN(64, 256, 128, backend="fused", error_check="off")
    first = m.allreduce_for(100)
    assert first.kw["symmetric"] == "nvshmem"
    assert m.allreduce_for(100) is first and not first.released  # fits: reused
    second = m.allreduce_for(1000)  # grows: the old buffer is freed (collectively) first
    assert first.released and not second.released
    assert second.kw["symmetric"] == "nvshmem"


# ------------------------------------------------------------------------ the allocation
WORLD, RANK, SEG_OFF = 4, 2, 512
SHAPE = dict(max_rows=256, N=128, band_rows=32)


def _rank(partial):
    """A BandAllReduce of rank RANK of WORLD configured as __init__ does, nothing allocated."""
    ar = B.BandAllReduce.__new__(B.BandAllReduce)
    ar.group = None
    act2, ready = B._check_host_options(SHAPE["max_rows"], SHAPE["N"], "unicast", "silu",
                                        SHAPE["band_rows"], 64, partial, False)
    ar._configure(RANK, WORLD, SHAPE["max_rows"], SHAPE["N"], "unicast", act2,
                  SHAPE["band_rows"], ready, None, None, True, 10**9, True, partial, False,
                  False)
    return ar


class _Memory:
    """One set of addresses both allocators return: this rank's buffer (inside a larger
    segment, at SEG_OFF) and every peer's buffer as mapped here."""

    def __init__(self, total):
        self.total = total
        self.segment = torch.zeros(SEG_OFF + total + 256, dtype=torch.uint8)
        self.own = self.segment[SEG_OFF:SEG_OFF + total]
        self.peers = {q: torch.zeros(total, dtype=torch.uint8)
                      for q in range(WORLD) if q != RANK}

    def address(self, q):
        return (self.own if q == RANK else self.peers[q]).data_ptr()


def _torch_alloc(monkeypatch, mem):
    import torch.distributed._symmetric_memory as symm_mem
    # torch symmetric memory: buffer_ptrs are the segments' bases; ours sits SEG_OFF into it
    hdl = types.SimpleNamespace(buffer_ptrs=[mem.address(q) - SEG_OFF for q in range(WORLD)],
                                buffer_size=SEG_OFF + mem.total + 256)
    monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: mem.own)
    monkeypatch.setattr(symm_mem, "rendezvous", lambda buf, group: hdl)


def _nvshmem_alloc(monkeypatch, mem, unmapped=(), others_bad=0):
    """The real NvshmemRuntime over fake nvshmem4py calls (fake_symmetric) returning ``mem``'s
    buffers; ``unmapped`` peers have no load/store view; ``others_bad``: what the other ranks
    bring to the agreement on unmapped peers."""
    rt = fake_runtime(monkeypatch, world=WORLD, rank=RANK)
    rt._nc.tensor = lambda shape, dtype: (rt.log.append(("alloc", tuple(shape))),
                                          mem.own.view(dtype))[1]
    rt._nc.get_peer_tensor = lambda t, pe: None if pe in unmapped else \
        mem.peers[pe].view(t.dtype)
    monkeypatch.setattr(N.NvshmemRuntime, "get", classmethod(lambda cls, group=None: rt))

    def agree(t, op=None, group=None):
        t.fill_(max(int(t.item()), others_bad))
        return t
    monkeypatch.setattr(collectives, "all_reduce", agree)
    return rt


def _kernel_args(ar):
    """What the kernel wrapper receives from a call on 96 rows, by argument name."""
    got = {}
    ar._fn = lambda *args: got.update(zip(B.ARG_NAMES + ("stream",), args))
    ar(96, out=torch.empty(96, SHAPE["N"], dtype=torch.bfloat16),
       stream=types.SimpleNamespace(cuda_stream=0))
    return got


@pytest.mark.parametrize("partial", ["fp32", "bf16"])
def test_nvshmem_hands_the_kernel_what_torch_does(monkeypatch, partial):
    cpu = torch.device("cpu")
    total = B.symmetric_layout(SHAPE["max_rows"], SHAPE["N"], SHAPE["band_rows"], partial)[3]
    mem = _Memory(total)
    _torch_alloc(monkeypatch, mem)
    rt = _nvshmem_alloc(monkeypatch, mem)

    t = _rank(partial)
    buf, ptrs, mc = t._alloc_torch(total, cpu, "unicast")
    t._attach(buf, ptrs, cpu, 132, 8, multicast=mc)
    n = _rank(partial)
    buf, ptrs = n._alloc_nvshmem(total, None, cpu)
    n._attach(buf, ptrs, cpu, 132, 8)
    assert rt.log == [("alloc", (total // 8,)), "barrier"]  # one collective symmetric allocation
    assert n._runtime is rt and t._runtime is None

    # the peer tables: every rank's data / arrive / done address, in rank order
    _, flag_off, flag_bytes, _ = B.symmetric_layout(SHAPE["max_rows"], SHAPE["N"],
                                                    SHAPE["band_rows"], partial)
    want = [[mem.address(q) + off for q in range(WORLD)]
            for off in (0, flag_off, flag_off + flag_bytes)]
    assert t._tables.tolist() == want
    assert n._tables.tolist() == want
    # the call: the same local views and scalars; the table arguments point at those tables
    a_t, a_n = _kernel_args(t), _kernel_args(n)
    for name in ("acc", "arrive", "done", "M", "N", "band_rows", "ready_rows", "timeout_ns",
                 "rank", "wait_ready", "grid"):
        assert a_t[name] == a_n[name], name
    assert a_n["acc"] == mem.own.data_ptr() and a_n["arrive"] == mem.own.data_ptr() + flag_off
    for i, name in enumerate(("acc_remote", "arrive_remote", "done_remote")):
        assert a_n[name] == n._tables[i].data_ptr() and a_t[name] == t._tables[i].data_ptr()


@pytest.mark.parametrize("unmapped,others_bad,match", [
    ((0,), 0, r"rank 2 cannot reach ranks \[0\]"),
    ((), 1, "a rank of the group cannot reach all of its peers")])
def test_an_unmapped_peer_raises_on_every_rank_and_frees(monkeypatch, unmapped, others_bad,
                                                         match):
    total = B.symmetric_layout(SHAPE["max_rows"], SHAPE["N"], SHAPE["band_rows"])[3]
    rt = _nvshmem_alloc(monkeypatch, _Memory(total), unmapped=unmapped, others_bad=others_bad)
    with pytest.raises(N.NvshmemError, match=match):
        _rank("fp32")._alloc_nvshmem(total, None, torch.device("cpu"))
    assert rt.log[-2:] == ["barrier", ("free", (total // 8,))] and rt._tensors == []


def test_release_frees_the_nvshmem_buffer(monkeypatch):
    cpu = torch.device("cpu")
    total = B.symmetric_layout(SHAPE["max_rows"], SHAPE["N"], SHAPE["band_rows"])[3]
    rt = _nvshmem_alloc(monkeypatch, _Memory(total))
    ar = _rank("fp32")
    ar._attach(*ar._alloc_nvshmem(total, None, cpu), cpu, 132, 8)
    assert rt.allocated_bytes() == total
    ar.release()
    assert rt.log[-1] == ("free", (total // 8,)) and rt.allocated_bytes() == 0
    assert ar.acc is None
    with pytest.raises(RuntimeError, match="released"):
        ar(32, out=torch.empty(32, SHAPE["N"], dtype=torch.bfloat16))
    ar.release()  # twice: nothing more
    assert rt.log.count(("free", (total // 8,))) == 1


def test_release_leaves_torch_memory_to_the_object(monkeypatch):
    cpu = torch.device("cpu")
    total = B.symmetric_layout(SHAPE["max_rows"], SHAPE["N"], SHAPE["band_rows"])[3]
    mem = _Memory(total)
    _torch_alloc(monkeypatch, mem)
    ar = _rank("fp32")
    buf, ptrs, mc = ar._alloc_torch(total, cpu, "unicast")
    ar._attach(buf, ptrs, cpu, 132, 8, multicast=mc)
    ar.release()
    assert ar.acc is not None and _kernel_args(ar)["acc"] == mem.own.data_ptr()


# ------------------------------------------------------------------------ one runtime
def test_none_and_the_world_group_share_one_runtime(monkeypatch):
    world, other = object(), object()
    monkeypatch.setattr(N.dist, "group", types.SimpleNamespace(WORLD=world))
    rt = N.NvshmemRuntime.__new__(N.NvshmemRuntime)
    rt.group = None  # made by the combine's CommBuffer (group=None)
    monkeypatch.setattr(N.NvshmemRuntime, "_live", {id(rt): rt})
    assert N.NvshmemRuntime.get(world) is rt  # the FFN's band all-reduce (the world group)
    assert N.NvshmemRuntime.get(None) is rt
    with pytest.raises(N.NvshmemError, match="another process group"):
        N.NvshmemRuntime.get(other)
    rt.group = world
    assert N.NvshmemRuntime.get(None) is rt
