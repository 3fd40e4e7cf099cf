"""Host side of the band all-reduce's emulated ranks (``BandAllReduce._emulated_rank``,
``EmulatedRanks``) and the bytes a call moves (``band_allreduce_traffic``), on the CPU: ranks built
on CPU buffers have the views and peer tables a GPU run gets, and ``BandAllReduce.__call__``
hands the kernel its arguments in ``ARG_NAMES`` order (a stand-in for the compiled kernel
records them). No GPU, no CuTe DSL."""
import sys
import types

import pytest
import torch

from moe_overlap.ffn import band_allreduce as B

CPU = torch.device("cpu")


def _ranks(G, max_rows, N, partial, **kw):
    total = B.symmetric_layout(max_rows, N, kw.get("band_rows", B.DEFAULT_BAND_ROWS), partial)[3]
    bufs = [torch.zeros(total, dtype=torch.uint8) for _ in range(G)]
    return bufs, [B.BandAllReduce._emulated_rank(r, bufs, CPU, 132, max_rows, N,
                                                  partial=partial, **kw) for r in range(G)]


@pytest.mark.parametrize("partial,G", [("bf16", 2), ("bf16", 4), ("fp32", 2), ("fp32", 4)])
def test_emulated_ranks_views_and_tables(partial, G):
    max_rows, N, band_rows = 300, 264, 32
    bufs, ranks = _ranks(G, max_rows, N, partial, band_rows=band_rows, ccta=5)
    data, flag_off, flag_bytes, _ = B.symmetric_layout(max_rows, N, band_rows, partial)
    base = [b.data_ptr() for b in bufs]
    for r, ar in enumerate(ranks):
        assert (ar.rank, ar.world, ar.backend, ar.ccta) == (r, G, "unicast", 5)
        assert (ar.threads, ar.unroll) == B.default_threads_unroll(partial, G)
        d = ar.partial if partial == "bf16" else ar.acc
        assert d is ar._data and tuple(d.shape) == (max_rows, N)
        assert d.dtype == (torch.bfloat16 if partial == "bf16" else torch.float32)
        assert d.data_ptr() == base[r]
        assert ar.arrive.data_ptr() == base[r] + flag_off
        assert ar.done.data_ptr() == base[r] + flag_off + flag_bytes
        assert ar.arrive.numel() == ar.done.numel() == ar.max_bands == -(-max_rows // band_rows)
        # every rank's table: all G buffers in rank order (data, arrive, done)
        assert ar._tables.tolist() == [base, [p + flag_off for p in base],
                                       [p + flag_off + flag_bytes for p in base]]
        assert ar._remote == tuple(int(ar._tables[i].data_ptr()) for i in range(3))
        assert ar.zero_acc == (partial == "fp32")
        for t in (ar.band_ready, ar.epoch, ar.expected, ar.err):  # per rank, not shared
            assert all(t.data_ptr() != getattr(o, n).data_ptr() for o in ranks if o is not ar
                       for n in ("band_ready", "epoch", "expected", "err"))


def _cuda_driver(monkeypatch):
    """cuda-python's driver module (``__call__`` wraps the stream in ``CUstream``); where the gpu
    extra is not installed, a stand-in with that one class, so the argument order is still
    checked on a ``.[dev]`` install."""
    try:
        import cuda.bindings.driver as driver
        return driver
    except ModuleNotFoundError:
        pass
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUstream = type("CUstream", (), {"__init__": lambda self, handle=0: None})
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings),
                      ("cuda.bindings.driver", driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    return driver


@pytest.mark.parametrize("producer", [False, True])
@pytest.mark.parametrize("b2_given", [False, True])
def test_call_passes_arg_names_in_order(monkeypatch, producer, b2_given):
    cuda = _cuda_driver(monkeypatch)
    G, max_rows, N, band_rows, ccta = 2, 300, 1024, 32, 4
    _, ranks = _ranks(G, max_rows, N, "bf16", band_rows=band_rows, ready_rows=128, ccta=ccta,
                      timeout_ns=123_000_000, b2_per_band=True)
    ar = ranks[1]
    calls = []
    ar._fn = lambda *a: calls.append(a)  # stands in for the compiled kernel
    M = 77
    out = torch.empty(M, N, dtype=torch.bfloat16)
    b2 = torch.zeros(*ar.b2_shape(M), dtype=torch.bfloat16) if b2_given else None
    ret = ar(M, b2=b2, out=out, producer=producer, bump_epoch=False,
             stream=types.SimpleNamespace(cuda_stream=0))
    assert ret is out and len(calls) == 1
    args = calls[0]
    assert len(args) == len(B.ARG_NAMES) + 1
    got = dict(zip(B.ARG_NAMES, args))
    for name in B.ARG_NAMES:  # python ints only (Int32 / Int64 at the kernel)
        assert type(got[name]) is int, (name, type(got[name]))
    want = dict(acc=ar.partial.data_ptr(), acc_remote=int(ar._tables[0].data_ptr()),
                out=out.data_ptr(), b2=(b2 if b2_given else ar._zero_b2).data_ptr(), M=M, N=N,
                band_rows=band_rows, ready_rows=128, band_ready=ar.band_ready.data_ptr(),
                arrive=ar.arrive.data_ptr(), arrive_remote=int(ar._tables[1].data_ptr()),
                done=ar.done.data_ptr(), done_remote=int(ar._tables[2].data_ptr()),
                expected=ar.expected.data_ptr(), epoch=ar.epoch.data_ptr(),
                err=ar.err.data_ptr(), timeout_ns=123_000_000, rank=1,
                wait_ready=int(producer), grid=min(ccta, -(-M // band_rows)))
    assert got == want
    assert isinstance(args[-1], cuda.CUstream)
    assert ar(0, out=torch.empty(0, N, dtype=torch.bfloat16),
              stream=types.SimpleNamespace(cuda_stream=0)).shape == (0, N)
    assert len(calls) == 1  # M = 0: no launch


def test_emulated_rank_refusals():
    with pytest.raises(ValueError, match="multiple of 8"):
        _ranks(2, 128, 68, "bf16")
    with pytest.raises(ValueError, match="b2_per_band needs partial='bf16'"):
        _ranks(2, 128, 64, "fp32", b2_per_band=True)
    with pytest.raises(ValueError, match=r"ccta=200 must be in \[1, 132\]"):
        _ranks(2, 128, 64, "fp32", ccta=200)
    small = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="symmetric buffer must be uint8"):
        B.BandAllReduce._emulated_rank(0, small, CPU, 132, 128, 64)


def test_emulated_ranks_refusals_before_cuda(monkeypatch):
    with pytest.raises(ValueError, match="world"):
        B.EmulatedRanks(0, 128, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        B.EmulatedRanks(2, 128, 68, partial="bf16")
    with pytest.raises(TypeError):
        B.EmulatedRanks(2, 128, 64, backend="switch")  # unicast only: no such option
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "2")
    with pytest.raises(RuntimeError, match="CUDA_DEVICE_MAX_CONNECTIONS=2"):
        B.EmulatedRanks(2, 128, 64)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            B.EmulatedRanks(2, 128, 64)


def test_traffic_by_hand():
    # bf16, G = 2, 300 x 1024, 128-row bands: 128 / 128 / 44 rows, 16384 / 16384 / 5632
    # vectors, chunks of 8192 / 8192 / 2816 per rank
    t = B.band_allreduce_traffic(300, 1024, 128, 2, "bf16")
    chunk = (8192 + 8192 + 2816) * 16
    for r in range(2):
        assert t[r]["step2_read"] == t[r]["step2_write"] == 2 * chunk
        assert t[r]["step2_peer_read"] == chunk
        assert t[r]["step3_read"] == t[r]["step3_write"] == 300 * 1024 * 2
        assert t[r]["b2_read"] == chunk
        assert t[r]["total"] == 4 * chunk + 2 * 300 * 1024 * 2
    # 1 row of 3 vectors over 2 ranks: chunks of 2 and 1 vectors
    t = B.band_allreduce_traffic(1, 24, 32, 2, "bf16")
    assert [x["step2_read"] for x in t] == [2 * 2 * 16, 2 * 1 * 16]
    # fp32: out is bf16 (8 bytes per vector of 4), zero_acc rewrites the band
    t = B.band_allreduce_traffic(1, 8, 32, 2, "fp32")
    assert t[0]["step3_read"] == 2 * 16 and t[0]["step3_write"] == 2 * 8 + 2 * 16
    t = B.band_allreduce_traffic(1, 8, 32, 2, "fp32", zero_acc=False)
    assert t[0]["step3_write"] == 2 * 8


@pytest.mark.parametrize("partial", ["bf16", "fp32"])
@pytest.mark.parametrize("G,M,N,band_rows", [(2, 300, 264, 32), (4, 77, 264, 32),
                                             (3, 1000, 512, 64), (8, 5, 8, 128)])
def test_traffic_totals(partial, G, M, N, band_rows):
    """Over all ranks, step 2 reads every vector from every buffer once and writes it into every
    buffer once (the models' coverage); each rank's step 3 reads the whole [M, N]."""
    elt = 2 if partial == "bf16" else 4
    t = B.band_allreduce_traffic(M, N, band_rows, G, partial)
    assert sum(x["step2_read"] for x in t) == sum(x["step2_write"] for x in t) == G * M * N * elt
    assert sum(x["step2_peer_read"] for x in t) == (G - 1) * M * N * elt
    assert all(x["step3_read"] == M * N * elt for x in t)


def _geometry_rank(rank, W, differ):
    from moe_overlap.ffn.band_allreduce import agree_on_geometry
    geo = dict(ccta=8 + (8 * rank if differ else 0), max_rows=1024, N=512, band_rows=32)
    try:
        agree_on_geometry(geo, None, "cpu")
    except ValueError as e:
        return str(e)
    return None


def test_ranks_with_different_launch_settings_all_refuse():
    from conftest import spawn_ranks
    assert spawn_ranks(_geometry_rank, 2, False) == [None, None]
    msgs = spawn_ranks(_geometry_rank, 3, True)
    assert len(set(msgs)) == 1 and "ccta from 8 to 24" in msgs[0], msgs
    assert "max_rows" not in msgs[0]  # only the fields that differ are named
