"""CPU-only checks of the communication half: imports without CuTe DSL / nvshmem4py / CUDA, and
clear errors before any kernel runs."""
import pytest
import torch


def test_modules_import_without_gpu_stack():
    import moe_overlap.combine.overlap as ov
    import moe_overlap.runtime.nvshmem as rt
    import moe_overlap.combine.consumer as cons
    import moe_overlap.combine.scale as sc
    assert ov.TRANSPORTS == cons.TRANSPORTS == ("nvlink", "nvshmem")
    assert hasattr(rt, "NvshmemRuntime") and hasattr(sc, "Scale")


def test_runtime_needs_a_process_group():
    from moe_overlap.runtime.nvshmem import NvshmemError, NvshmemRuntime
    with pytest.raises(NvshmemError, match="torch.distributed"):
        NvshmemRuntime()


def test_consumer_rejects_bad_transport_before_compiling():
    from moe_overlap.combine.consumer import Consumer
    with pytest.raises(ValueError, match="transport"):
        Consumer("pigeon")


def test_gemm_options_are_checked_before_cuda():
    """OverlapCombine(gemm_options=...) reaches the producer GroupedGemm; unknown or reserved
    keys and bad values fail on any machine, before CUDA (or NVSHMEM) is touched."""
    from moe_overlap.combine.overlap import OverlapCombine, check_gemm_options
    assert check_gemm_options({"cluster_n": 1, "band_group": 2}, 128) == {"cluster_n": 1,
                                                                         "band_group": 2}
    assert check_gemm_options(None, 64) == {}
    for bad, msg in [({"tile_n": 128}, "reserved"), ({"signal": False}, "reserved"),
                     ({"clusters": 2}, "unknown"), ({"band_group": 0}, "band_group"),
                     ({"cluster_n": 3}, "cluster_n")]:
        with pytest.raises(ValueError, match=msg):
            OverlapCombine(gemm_options=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_overlap_needs_cuda():
    from moe_overlap.combine.overlap import OverlapCombine, OverlapError
    with pytest.raises(OverlapError, match="CUDA"):
        OverlapCombine()


@pytest.mark.parametrize("bad", [-1, 2.5, True, "64"])
def test_consumer_piece_rows_checked_before_cuda(bad):
    from moe_overlap.combine.overlap import OverlapCombine
    with pytest.raises(ValueError, match="consumer_piece_rows"):
        OverlapCombine(consumer_piece_rows=bad)


@pytest.mark.parametrize("W,E,topk,tile_m,mode", [(2, 8, 2, 128, "moderate_skew"),
                                                  (4, 16, 4, 64, "stress_skew"),
                                                  (3, 6, 2, 64, "balanced")])
@pytest.mark.parametrize("layout", ["aligned", "packed"])
def test_source_rows_match_the_local_cells(W, E, topk, tile_m, mode, layout):
    """local_copy=False: every local (t, k) assignment's y row (encoded -(y row) - 1) equals the
    row the plan's local cell puts it in (src_row + r - dest_row); remote assignments keep their
    receive row."""
    from types import SimpleNamespace
    from moe_overlap.combine.overlap import OverlapCombine
    from moe_overlap.combine.plan import plan_combine, recv_rows
    from moe_overlap.routing import route
    El = E // W
    Ts = [50 + 17 * r for r in range(W)]
    ids = [route(Ts[r], E, topk, mode=mode, seed=5, rank=r)[0] for r in range(W)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    for rank in range(W):
        plan = plan_combine(counts, rank, tile_m=tile_m, mgb=2, layout=layout)
        me = SimpleNamespace(num_experts=E, experts_per_rank=El, rank=rank)
        r = recv_rows(ids[rank], E)
        src = OverlapCombine.source_rows(me, ids[rank], r, plan)
        assert src.shape == ids[rank].shape
        nl = int(plan.num_local_cells)
        local_bands = list(zip(*(getattr(plan, "local_cell_" + k)[:nl].tolist()
                                 for k in ("dest_row", "rows", "src_row"))))
        for e_id, rr, s in zip(ids[rank].reshape(-1).tolist(), r.reshape(-1).tolist(),
                               src.reshape(-1).tolist()):
            if e_id // El != rank:
                assert s == rr
                continue
            hits = [s0 + rr - d0 for d0, v, s0 in local_bands if d0 <= rr < d0 + v]
            assert len(hits) == 1 and s == -hits[0] - 1, (rank, e_id, rr, s, hits)


def test_scale_torch_reads_y_for_negative_rows():
    from moe_overlap.combine.scale import scale_torch
    recv = torch.arange(12.0).view(6, 2).to(torch.bfloat16)
    y = -torch.arange(8.0).view(4, 2).to(torch.bfloat16)
    rows = torch.tensor([[0, -1], [-4, 5]], dtype=torch.int32)
    w = torch.tensor([[1.0, 2.0], [0.5, 1.0]])
    out = scale_torch(recv, rows, w, y=y).float()
    exp = torch.stack([recv[0].float() + 2 * y[0].float(), 0.5 * y[3].float() + recv[5].float()])
    assert torch.equal(out, exp.to(torch.bfloat16).float())


def test_overlap_options_checked_before_cuda():
    from moe_overlap.combine.consumer import Consumer
    with pytest.raises(ValueError, match="tma"):
        Consumer("nvshmem", copy="tma")
    with pytest.raises(ValueError, match="copy"):
        Consumer("nvlink", copy="dma")
