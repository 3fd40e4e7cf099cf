"""GPU check of the overlapped dispatch's staged source (``MoEDispatch(stage_source="always")``,
issue 39: the nvshmem send's puts read x and the ids from the CommBuffer's symmetric staging
region). Not run yet (written on a machine without a GPU).

W = 2 ranks over the nvshmem transport (2 GPUs, or one shared with MOE_OVERLAP_SHARE_GPU=1: P2P
there, so "always" is what exercises the staged path; across nodes "auto" picks it): per call,
the staged layer's output bitwise equal to the unstaged one's (stage_source="never", the same
buffer) and to the reference backend's, over uniform, skewed and duplicate routings with a rank
of 0 tokens, x given as a non-contiguous view (the staging copy takes it as it is); after each
staged call the region holds that call's tokens and ids; and a CUDA graph of the staged layer
(counts on the device) replayed with new routings written into its inputs, bitwise the reference
each time (the copies are captured with the kernels).

Run: ``MOE_OVERLAP_SHARE_GPU=1 CUDA_MODULE_LOADING=EAGER NVSHMEM_DISABLE_NVLS=1
python -m pytest -q tests/test_dispatch_stage_gpu.py``.
"""
import pytest
import torch

from conftest import bitwise_equal, require_module, spawn_over_transport

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)

from test_dispatch_overlap_gpu import (D, EL, K, T_MAX, TILE_M, _inputs,  # noqa: E402
                                       graph_replays)


def _worker(rank, W, transport):
    from moe_overlap import MoEDispatch
    from moe_overlap.combine import exchange_counts
    from moe_overlap.combine.comm_buffer import CommBuffer
    from moe_overlap.combine.plan import plan_combine
    res = {"calls": [], "graph": []}
    E = EL * W
    comm = CommBuffer(None, transport)
    staged = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm, timeout_s=2.0,
                         stage_source="always")
    direct = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm, timeout_s=2.0,
                         stage_source="never")
    ref = MoEDispatch(E, D, K, T_MAX, backend="reference")
    res["resolved"] = [staged.staged, direct.staged]
    comm.buffers.recv.fill_(float("nan"))  # poisoned slots: stale rows would show
    cases = [(T, kind) for kind in ("uniform", "skew", "dup")
             for T in ((0 if rank == 1 else 70), 1 + 29 * rank, T_MAX)]
    with torch.no_grad():
        for i, (T, kind) in enumerate(cases):
            x, ids = _inputs(rank, W, T, seed=i, kind=kind, strided=True)
            counts = exchange_counts(ids, E)
            plan = plan_combine(counts, rank, tile_m=TILE_M, max_rows=W * T_MAX * K)
            rows = plan.row_capacity
            got = staged(x, ids, plan, counts, rows=rows)
            sx, sids = comm.staged_source(T, D, K)
            held = bitwise_equal(sx, x) and bool(torch.equal(sids, ids.to(torch.int32)))
            plain = direct(x, ids, plan, counts, rows=rows)
            want = ref(x, ids, plan, counts, rows=rows)
            res["calls"].append((i, T, kind, bitwise_equal(got, plain),
                                 bitwise_equal(got, want), held))
        staged.check_errors()
        # a CUDA graph of the staged layer; a failed capture is recorded, not raised
        graph_replays(lambda: MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm,
                                          validate=False, stage_source="always"),
                      ref, comm, rank, W, 4, res, strided=True)
    res["transport"] = staged.sender.transport
    return res


@pytest.fixture(scope="module")
def results():  # spawn_ranks skips, naming why, where these GPU ranks cannot run
    return spawn_over_transport(_worker, (2, "nvshmem"))


def test_staged_send_is_bitwise_the_unstaged_one(results):
    for rank, r in enumerate(results):
        assert r["resolved"] == [True, False], rank
        bad = [c for c in r["calls"] if not all(c[3:])]
        assert len(r["calls"]) == 9 and not bad, (rank, bad)


def test_staged_graph_replays_with_new_routings(results):
    for rank, r in enumerate(results):
        assert "graph_error" not in r, (rank, r["graph_error"])
        assert len(r["graph"]) == 4 and all(r["graph"]), (rank, r["graph"])
