"""CPU checks of the fault handling (issue 21): the combine's error word (layout, codes, texts),
the co-residency bound of the band all-reduce, and the NVSHMEM runtime's errors (heap full, no
P2P mapping) with a fake allocator. No GPU, no CuTe DSL, no NVSHMEM needed."""
import pytest
import torch

from moe_overlap.kernels import errors as E


def _word(code, rank=1, index=2, band=3, obs=4, exp=5, el=6_000_000):
    return [code, rank, index, band, obs, exp, el, 0]


def test_error_codes_are_distinct_and_named():
    codes = [E.ERR_CONSUMER_TIMEOUT, E.ERR_SCALE_TIMEOUT, E.ERR_COPY_TIMEOUT,
             E.ERR_EPOCH_MISMATCH, E.ERR_PLAN_BOUNDS, E.ERR_SCALE_BAD_ROW,
             E.ERR_TILE_BAND_TIMEOUT, E.ERR_TILE_SEGMENT_TIMEOUT,
             E.ERR_PRODUCER_BOUNDS, E.ERR_PEER_ERROR, E.ERR_DISPATCH_TIMEOUT,
             E.ERR_DISPATCH_BAD_ROUTE, E.ERR_ARRIVAL_TIMEOUT, E.ERR_COUNTS_TIMEOUT]
    assert len(set(codes)) == len(codes) and 0 not in codes
    assert E.ERR_PEER_ERROR == 10  # a new code: the existing ones keep their numbers
    assert (E.ERR_DISPATCH_TIMEOUT, E.ERR_DISPATCH_BAD_ROUTE) == (31, 32)  # past the FFN's
    assert set(E.ERR_NAMES) == set(codes)
    # the FFN's codes live in another range: one error word layout, no clash
    from moe_overlap.ffn import band_allreduce as B
    assert not set(codes) & {B.ERR_READY_TIMEOUT, B.ERR_ARRIVE_TIMEOUT, B.ERR_DONE_TIMEOUT}


def test_describe_error_names_what_and_where():
    assert E.describe_error([0] * 8) is None
    m = E.describe_error(_word(E.ERR_DISPATCH_TIMEOUT, rank=1, index=3, band=7, obs=16, exp=24))
    assert "dispatch" in m and "rank 1" in m and "source rank 3" in m and "epoch 7" in m
    assert "counter=16" in m and "expected>=24" in m
    m = E.describe_error(_word(E.ERR_ARRIVAL_TIMEOUT, rank=1, index=5, band=5, obs=6, exp=7))
    assert "band 5" in m and "band_arrived=6" in m and "epoch=7" in m and "6.0 ms" in m
    m = E.describe_error(_word(E.ERR_DISPATCH_BAD_ROUTE, rank=0, index=2, band=1, obs=9, exp=9))
    assert "source rank 2" in m and "past its (expert, source) group" in m
    m = E.describe_error(_word(E.ERR_EPOCH_MISMATCH, rank=0, index=1, band=1, obs=7, exp=9))
    assert "out of step" in m and "epoch 9" in m and "source rank 1" in m and "epoch 7" in m
    m = E.describe_error(_word(E.ERR_SCALE_TIMEOUT, rank=1, index=0, band=12, obs=3, exp=5))
    assert "source rank 0" in m and "epoch 12" in m and "counter=3" in m and "6.0 ms" in m
    m = E.describe_error(_word(E.ERR_PLAN_BOUNDS, rank=0, index=4, band=4, obs=900, exp=512))
    assert "segment destination rows outside the slot" in m and "900" in m and "512" in m
    m = E.describe_error(_word(E.ERR_SCALE_BAD_ROW, rank=0, index=11, band=1, obs=70, exp=64))
    assert "y row 70" in m and "[0, 64)" in m and "NaN" in m
    m = E.describe_error(_word(E.ERR_SCALE_BAD_ROW, rank=0, index=11, band=0, obs=-5, exp=64))
    assert "receive-slot row -5" in m
    m = E.describe_error(_word(E.ERR_TILE_BAND_TIMEOUT, rank=1, index=17, band=40, obs=3, exp=4))
    assert "tile 17" in m and "band 40" in m and "band_ready=3" in m and "epoch=4" in m
    w3 = E.segment_word(1, 23)
    assert (w3 >> 32, w3 & 0xFFFFFFFF) == (1, 23)
    m = E.describe_error(_word(E.ERR_TILE_SEGMENT_TIMEOUT, rank=0, index=5, band=w3, obs=64,
                               exp=128))
    assert "tile 5" in m and "source rank 1" in m and "segment 23" in m and "64" in m
    assert "device error code 99" in E.describe_error(_word(99))


def test_describe_peer_error_names_the_peer_and_its_code():
    m = E.describe_error(_word(E.ERR_PEER_ERROR, rank=1, index=0, band=7,
                               obs=E.ERR_PRODUCER_BOUNDS, exp=3, el=2_500_000))
    assert m.startswith("rank 1 saw rank 0's error (code 9: producer GEMM refused")
    assert "epoch 7" in m and "2.5 ms" in m and "instead of at the timeout" in m
    m = E.describe_error(_word(E.ERR_PEER_ERROR, rank=2, index=1, obs=E.ERR_PLAN_BOUNDS))
    assert "rank 2 saw rank 1's error (code 5: consumer refused a plan entry" in m
    m = E.describe_error(_word(E.ERR_PEER_ERROR, rank=2, index=1, obs=E.ERR_PEER_ERROR))
    assert "saw another rank's error" in m  # a second-hand error says so
    assert "device error code 42" in E.describe_error(_word(E.ERR_PEER_ERROR, obs=42))


def _peer_buffer(monkeypatch, world, rank, words_of):
    """A CommBuffer on the fake runtime whose peer views return ``words_of[pe]``."""
    from fake_symmetric import fake_runtime
    from moe_overlap.combine.comm_buffer import CommBuffer
    rt = fake_runtime(monkeypatch, world=world, rank=rank)
    buf = CommBuffer(None, "nvlink", runtime=rt)
    buf._test_layer = _NoFlags()  # attach keeps a weak reference only
    buf.attach(buf._test_layer, 8, 32)
    monkeypatch.setattr(rt, "peer_tensor", lambda t, pe: torch.tensor(words_of[pe]))
    return buf


class _NoFlags:
    def _clear_band_flags(self):
        pass


def test_host_message_follows_peer_errors_to_the_first_failing_rank(monkeypatch):
    from moe_overlap.combine.comm_buffer import OverlapError
    first = _word(E.ERR_PRODUCER_BOUNDS, rank=0, index=-1, band=E.PRF_NUM_BANDS, obs=99, exp=8)
    second = _word(E.ERR_PEER_ERROR, rank=1, index=0, obs=E.ERR_PRODUCER_BOUNDS)
    buf = _peer_buffer(monkeypatch, 3, 2, {0: first, 1: second})
    buf.err.copy_(torch.tensor(_word(E.ERR_PEER_ERROR, rank=2, index=1, obs=E.ERR_PEER_ERROR)))
    with pytest.raises(OverlapError) as ei:
        buf.check_errors()
    m = str(ei.value)
    assert "rank 2 saw rank 1's error" in m and "rank 1's error word: rank 1 saw rank 0's" in m
    assert "rank 0's error word: producer GEMM refused" in m and "(rank 0 failed first)" in m
    assert m.index("rank 1's error word") < m.index("rank 0's error word")


def test_host_message_without_a_readable_peer_word_keeps_the_local_text(monkeypatch):
    buf = _peer_buffer(monkeypatch, 2, 1, {})  # peer_tensor raises KeyError: not readable
    w = _word(E.ERR_PEER_ERROR, rank=1, index=0, obs=E.ERR_PLAN_BOUNDS)
    assert buf.describe_error(w) == E.describe_error(w)
    buf = _peer_buffer(monkeypatch, 2, 1, {0: [0] * 8})  # the peer was reset meanwhile
    assert buf.describe_error(w) == E.describe_error(w)
    # a cycle of ERR_PEER_ERROR words (cannot happen first-writer-wins, but never loop)
    buf = _peer_buffer(monkeypatch, 2, 1, {0: _word(E.ERR_PEER_ERROR, rank=0, index=1,
                                                    obs=E.ERR_PEER_ERROR)})
    assert buf.describe_error(w).count("error word") == 1
    # other codes: the word's own text only, no peer read
    w = _word(E.ERR_SCALE_TIMEOUT)
    assert buf.describe_error(w) == E.describe_error(w)


def test_reset_clears_the_peer_visible_word(monkeypatch):
    buf = _peer_buffer(monkeypatch, 2, 0, {})
    assert buf.err is buf.runtime._tensors[2]  # the symmetric allocation the peers map
    buf.err.copy_(torch.tensor(_word(E.ERR_PLAN_BOUNDS)))
    buf.reset()
    assert not buf.err.any()


def test_plan_field_codes_match_the_consumer():
    pytest.importorskip("cutlass", reason="the consumer module's constants only")
    from moe_overlap.combine import consumer as C
    fields = [C.PF_NSEG, C.PF_NCELL, C.PF_DEST, C.PF_SEG_SRC, C.PF_SEG_DST, C.PF_BAND,
              C.PF_CELL_SRC, C.PF_CELL_DST]
    from moe_overlap.combine import scale_ordered as SO
    fields += [SO.PF_TILE_BAND, SO.PF_TILE_SEGMENT]
    assert sorted(fields) == sorted(E.PLAN_FIELDS)
    assert "ordered scale" in E.PLAN_FIELDS[SO.PF_TILE_BAND]
    assert "num_segments" in E.PLAN_FIELDS[C.PF_NSEG]
    assert "local cell destination" in E.PLAN_FIELDS[C.PF_CELL_DST]


def test_primitives_reexport_the_one_definition():
    pytest.importorskip("cutlass", reason="primitives imports CuTe DSL")
    from moe_overlap.kernels import primitives as P
    assert P.describe_error is E.describe_error and P.ERR_EPOCH_MISMATCH == E.ERR_EPOCH_MISMATCH


def test_comm_block_layout():
    W = 4
    assert E.comm_block_words(W) == 3 * W
    words = {E.epoch_tag_word(W, p, s) for p in (0, 1) for s in range(W)}
    assert words == set(range(W, 3 * W))  # tags right after the W counters, no overlap


def test_call_tag_compare_is_wrap_safe():
    fp = 0x1234ABCD
    assert not E.call_tags_differ(E.call_tag(5, fp), E.call_tag(5, fp))
    assert E.call_tags_differ(E.call_tag(5, fp), E.call_tag(7, fp))
    # int32 epoch wraps from 2^31 - 1 to -2^31: the same epoch read both ways
    assert E.call_tag(-2**31, fp) == E.call_tag(2**31, fp)
    assert E.call_tags_differ(E.call_tag(2**31 - 1, fp), E.call_tag(-2**31, fp))


def test_call_tag_holds_epoch_and_fingerprint():
    """The tag is fingerprint << 32 | epoch (32 bits each), a signed int64 as the error word
    holds it; the same epoch with another routing's fingerprint is another tag."""
    for epoch, fp in [(0, 0), (6, 0xDEADBEEF), (-1, 0xFFFFFFFF), (2**31 - 1, 1), (-2**31, -1)]:
        t = E.call_tag(epoch, fp)
        assert -2**63 <= t < 2**63
        assert E.split_call_tag(t) == ((epoch + 2**31) % 2**32 - 2**31, fp & 0xFFFFFFFF)
        assert (t & 0xFFFFFFFF, (t >> 32) & 0xFFFFFFFF) == (epoch & 0xFFFFFFFF, fp & 0xFFFFFFFF)
    assert E.call_tags_differ(E.call_tag(6, 0x1111), E.call_tag(6, 0x2222))


def test_describe_epoch_mismatch_names_both_epochs_and_fingerprints():
    # a rank that skipped a call: the same epoch, another routing's fingerprint
    m = E.describe_error(_word(E.ERR_EPOCH_MISMATCH, rank=0, index=1, band=1,
                               obs=E.call_tag(6, 0x0A0B0C0D), exp=E.call_tag(6, 0xF1F2F3F4)))
    assert "rank 0 is at epoch 6" in m and "source rank 1" in m and "its epoch 6" in m
    assert "0xf1f2f3f4" in m and "0x0a0b0c0d" in m
    assert "out of step" in m and "skipped a call" in m and "another routing" in m
    # another call count: named as before
    m = E.describe_error(_word(E.ERR_EPOCH_MISMATCH, rank=1, index=0, band=0,
                               obs=E.call_tag(-3, 7), exp=E.call_tag(9, 7)))
    assert "epoch 9" in m and "its epoch -3" in m and "made a call the others did not" in m
    assert "skipped" not in m


# ---- band all-reduce co-residency -----------------------------------------------------------
def test_ctas_per_sm_bound():
    from moe_overlap.runtime.device import ctas_per_sm
    assert ctas_per_sm(64, 1024) == 1  # 64 K registers: exactly one CTA of 1024 x 64
    assert ctas_per_sm(32, 1024) == 2  # by threads (2048 per SM)
    assert ctas_per_sm(65, 1024) == 0  # 72 registers (rounded per warp): does not fit
    assert ctas_per_sm(32, 32) == 32  # by the CTA limit
    assert ctas_per_sm(32, 256, smem=120 * 1024) == 1  # by shared memory


def test_require_coresident_clear_errors():
    from moe_overlap.runtime.device import require_coresident
    require_coresident(16, 16, 1, "k")
    with pytest.raises(ValueError, match="does not fit on an SM"):
        require_coresident(1, 16, 0, "band all-reduce")
    with pytest.raises(ValueError, match="only 16 SMs x 1 CTAs per SM = 16"):
        require_coresident(17, 16, 1, "band all-reduce")


def test_cubin_resources_rejects_garbage():
    from moe_overlap.runtime.device import cubin_resources
    with pytest.raises(ValueError, match="ELF"):
        cubin_resources(b"not a cubin")


# ---- NVSHMEM runtime errors (fake allocator) ------------------------------------------------
def _fake_runtime(monkeypatch, tensor_fn=None, peer_fn=None, world=2, rank=0):
    import types
    from moe_overlap.runtime import nvshmem as N
    rt = N.NvshmemRuntime.__new__(N.NvshmemRuntime)
    rt.group, rt.rank, rt.world_size = None, rank, world
    rt.device = torch.device("cpu")
    rt._tensors, rt._buffers, rt._peer_views, rt._finalized = [], {}, [], False
    rt._nc = types.SimpleNamespace(tensor=tensor_fn, get_peer_tensor=peer_fn)
    monkeypatch.setattr(N.torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(N.dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(N.collectives, "bounded_barrier", lambda *a, **k: None)
    return rt


def test_full_heap_names_the_size_and_the_variable(monkeypatch):
    from moe_overlap.runtime.nvshmem import NvshmemError

    def tensor(shape, dtype):
        if shape[0] > 1000:
            raise RuntimeError("nvshmem_malloc failed: out of symmetric memory")
        return torch.zeros(shape, dtype=dtype)

    rt = _fake_runtime(monkeypatch, tensor_fn=tensor)
    rt.alloc((500, 1024), torch.bfloat16)  # 1 MB, fits
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1G")
    with pytest.raises(NvshmemError) as ei:
        rt.alloc((4096 * 8, 7168), torch.bfloat16)
    m = str(ei.value)
    need = 4096 * 8 * 7168 * 2
    assert f"allocation of {need} bytes" in m
    assert "NVSHMEM_SYMMETRIC_SIZE=" in m and "(now 1G)" in m
    assert "out of symmetric memory" in m  # the cause is kept
    # the suggested size holds what is already allocated plus the request
    suggested = int(m.split("NVSHMEM_SYMMETRIC_SIZE=")[1].split("M")[0]) << 20
    assert suggested >= need + 500 * 1024 * 2


def test_nvshmem_buffers_without_p2p(monkeypatch):
    """A peer without a load/store mapping: the buffers still build (entry 0), the load/store
    transport gets an error that does not tell it to use what it already uses."""
    from moe_overlap.runtime.nvshmem import NvshmemError
    rt = _fake_runtime(monkeypatch, tensor_fn=lambda shape, dtype: torch.zeros(shape,
                                                                               dtype=dtype),
                       peer_fn=lambda t, pe: None)
    b = rt.buffers(8, 16, key="x")
    assert b.unreachable == (1,)
    assert b.recv_peers.tolist()[1] == 0 and b.recv_peers.tolist()[0] == b.recv.data_ptr()
    assert b.block.numel() == E.comm_block_words(2) and b.counters.numel() == 2
    assert b.counters.data_ptr() == b.block.data_ptr()
    with pytest.raises(NvshmemError, match=r"transport='nvlink'.*ranks \[1\].*use "
                                           r"transport='nvshmem' \(it needs no P2P"):
        b.require_p2p()
    with pytest.raises(NvshmemError, match="only NVSHMEM calls"):
        rt.peer_tensor(b.recv, 1)


def test_nvshmem_buffers_with_p2p(monkeypatch):
    views = {}

    def peer(t, pe):
        views[pe] = torch.zeros_like(t)
        return views[pe]

    rt = _fake_runtime(monkeypatch, tensor_fn=lambda shape, dtype: torch.zeros(shape,
                                                                               dtype=dtype),
                       peer_fn=peer)
    b = rt.buffers(8, 16)
    assert b.unreachable == ()
    b.require_p2p()
    assert b.ctr_peers.tolist()[1] == views[1].data_ptr()
