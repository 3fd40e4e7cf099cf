"""GPU ranks as the library runs them (``moe_overlap.launch`` backend="cuda"): one per GPU over
NCCL, or, with ``MOE_OVERLAP_SHARE_GPU=1`` on one GPU, processes sharing it over gloo. Checks the
ground the multi-rank tests stand on, on every rank: the host collectives of
``moe_overlap.runtime.collectives`` on CUDA tensors (values, not only completion), the rank's SM
share as its kernels will read it (under MPS: its thread percentage of the GPU), and NVSHMEM
peers that read and write each other's symmetric memory."""
from __future__ import annotations

import os

import pytest

from conftest import require_module, spawn_ranks, worker_error

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)


def _worker(rank, world):
    import torch
    import torch.distributed as dist

    from moe_overlap.launch import rank_device, ranks_per_gpu
    from moe_overlap.runtime import collectives
    from moe_overlap.runtime.device import num_sms
    res = {"rank": rank}
    try:
        dev = rank_device()
        res["backend"] = collectives.backend_of()
        res["ranks_per_gpu"] = ranks_per_gpu()
        res["num_sms"] = num_sms(dev)
        res["device_sms"] = torch.cuda.get_device_properties(dev).multi_processor_count
        res["mps_percentage"] = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        # collectives on CUDA tensors: each checked against what every rank knows
        t = torch.full((5,), float(rank + 1), device=dev)
        collectives.all_reduce(t)
        res["all_reduce_ok"] = bool(torch.all(t == world * (world + 1) / 2))
        m = torch.tensor([rank], device=dev)
        collectives.all_reduce(m, op=dist.ReduceOp.MAX)
        res["all_reduce_max_ok"] = int(m) == world - 1
        parts = [torch.empty(3, dtype=torch.int64, device=dev) for _ in range(world)]
        collectives.all_gather(parts, torch.arange(3, device=dev) + 10 * rank)
        res["all_gather_ok"] = all(torch.equal(p.cpu(), torch.arange(3) + 10 * r)
                                   for r, p in enumerate(parts))
        b = torch.full((4,), float(rank), device=dev)
        collectives.broadcast(b, src=0)
        res["broadcast_ok"] = bool(torch.all(b == 0))
        # rank r sends r + 1 rows to every rank, each row holding (source, destination)
        inp = torch.tensor([[rank, d] for d in range(world) for _ in range(rank + 1)],
                           device=dev, dtype=torch.float32)
        out = torch.full((sum(s + 1 for s in range(world)), 2), float("nan"), device=dev)
        collectives.all_to_all_single(out, inp, [s + 1 for s in range(world)],
                                      [rank + 1] * world)
        want = torch.tensor([[s, rank] for s in range(world) for _ in range(s + 1)],
                            dtype=torch.float32)
        res["all_to_all_ok"] = bool(torch.equal(out.cpu(), want))
        # NVSHMEM peers: each rank writes its id into every peer's symmetric slot
        from moe_overlap.runtime.nvshmem import NvshmemRuntime
        rt = NvshmemRuntime(None)
        x = rt.alloc((world,), torch.int64)
        for pe in range(world):
            rt.peer_tensor(x, pe)[rank] = rank + 100
        rt.barrier()
        res["nvshmem_peers_ok"] = x.cpu().tolist() == [r + 100 for r in range(world)]
        rt.barrier()
    except Exception as e:  # noqa: BLE001 - recorded for the test to name
        res["error"] = worker_error(e)
    return res


def _whole_gpu_sms() -> int:
    """The GPU's SM count as a client with no thread percentage sees it (a fresh process: under
    MPS a rank's own device properties show its share once its context exists, so they cannot
    be the reference; this process stays free of CUDA)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda."
                          "get_device_properties(0).multi_processor_count)"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.fixture(scope="module")
def whole_gpu_sms():
    return _whole_gpu_sms()


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return spawn_ranks(_worker, request.param, backend="nccl", join_timeout_s=300,
                       hard_exit=True)


def test_collectives_and_peers_on_every_rank(results):
    for r in results:
        assert "error" not in r, r.get("error")
        for k in ("all_reduce_ok", "all_reduce_max_ok", "all_gather_ok", "broadcast_ok",
                  "all_to_all_ok", "nvshmem_peers_ok"):
            assert r[k], (r["rank"], k)


def test_sm_share_is_read_from_the_device(results, whole_gpu_sms):
    for r in results:
        assert "error" not in r, r.get("error")
        if r["ranks_per_gpu"] == 1:
            assert r["backend"] == "nccl" and r["mps_percentage"] is None
            continue
        assert r["backend"] == "gloo"
        assert int(r["mps_percentage"]) == 100 // r["ranks_per_gpu"]
        # the library sizes its grids from num_sms: under MPS the rank's share of the GPU (its
        # context's execution affinity), never more than the device has
        assert r["num_sms"] <= r["device_sms"] <= whole_gpu_sms
        if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            want = whole_gpu_sms * int(r["mps_percentage"]) // 100
            assert r["num_sms"] < whole_gpu_sms, (r, whole_gpu_sms)
            assert abs(r["num_sms"] - want) <= 2, (r, want)
