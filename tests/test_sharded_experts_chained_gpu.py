"""GPU checks of ``ShardedExperts(backend="fused", compute="chained")``: the grouped chained
compute kernel || the bf16 band all-reduce (b_out per row block: ``b2_per_band``) against
``backend="reference"`` and the float64 truth, two calls per module, rows past the experts' zero.

One GPU: a one-rank NCCL group (``spawn_ranks(..., 1, backend="nccl")``), every case; two GPUs
(``two_gpus``): the same worker on two ranks (outputs bitwise equal on every rank). Run with
``NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
(never multicast). With one GPU and ``MOE_OVERLAP_SHARE_GPU=1`` the two ranks share it: the
band all-reduce's symmetric buffer then comes from NVSHMEM (``symmetric="auto"``, checked)::

    python3 -m pytest -q -x tests/test_sharded_experts_chained_gpu.py
"""
import os

import pytest
import torch

from conftest import ranks_share_gpus, require_symmetric, spawn_ranks

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability(0)[0] != 9:
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

TOL = 8e-3
CASES = [  # (E, rows_per_expert, P, O, N, activation, bias, extra rows, group)
    (3, [100, 0, 250], 256, 512, 256, "silu", True, 5, "auto"),
    (3, [100, 0, 250], 256, 512, 256, "gelu", False, 0, 1),
    (4, [130, 1, 0, 640], 512, 1024, 512, "gelu", True, 3, 2),  # super-blocks across experts
    (2, [3000, 2100], 512, 1024, 768, "relu", True, 0, "auto"),  # 41 blocks
]


def _worker(rank, world):
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed as dist

    from moe_overlap.ffn import ShardedExperts
    from moe_overlap.ffn.reference import experts_truth
    from moe_overlap.launch import rank_device
    from moe_overlap.runtime import collectives
    dev = rank_device()
    torch.cuda.set_device(dev)
    group = dist.group.WORLD
    res = []
    for i, (E, rows, P, O, N, act, bias, extra, grp) in enumerate(CASES):
        g = torch.Generator().manual_seed(21 + i)  # same weights and x on every rank
        W_in = (torch.randn(E, P, O, generator=g) / P ** 0.5).to(torch.bfloat16).to(dev)
        W_out = (torch.randn(E, O, N, generator=g) / O ** 0.5).to(torch.bfloat16).to(dev)
        b_in = (torch.randn(E, O, generator=g) * 0.5).to(torch.bfloat16).to(dev) if bias \
            else None
        b_out = (torch.randn(E, N, generator=g) * 0.5).to(torch.bfloat16).to(dev) if bias \
            else None
        fused = ShardedExperts.from_full_weights(
            W_in, W_out, b_in, b_out, group, activation=act, backend="fused", ccta=8,
            compute="chained", compute_options=dict(group=grp))
        ref = ShardedExperts.from_full_weights(W_in, W_out, b_in, b_out, group, activation=act)
        assert fused._chained and fused._allreduce is None
        for call in range(2):
            x = torch.randn(sum(rows) + extra, P, generator=g).to(torch.bfloat16).to(dev)
            with torch.no_grad():
                y = fused(x, rows)
                yr = ref(x, rows)
            fused.check_errors()
            truth = experts_truth(x, rows, W_in, W_out, b_in, b_out, act).to(dev)
            scale = truth.abs().max().item()
            y0 = y.clone()
            collectives.broadcast(y0, 0, group=group)
            res.append(dict(
                case=i, call=call, world=world,
                b2_per_band=bool(fused._allreduce.b2_per_band),
                symmetric=fused._allreduce.symmetric,
                err_truth=((y.double() - truth).abs().max().item() / scale),
                err_ref=((y.double() - yr.double()).abs().max().item() / scale),
                nan=bool(torch.isnan(y).any().item()),
                tail_zero=bool((y[sum(rows):] == 0).all().item()),
                rank_diff=(y.float() - y0.float()).abs().max().item()))
    return res


def _check(results, world):
    # one rank, or ranks on GPUs of their own: torch symmetric memory; sharing a GPU: NVSHMEM
    want = "nvshmem" if world > 1 and ranks_share_gpus(world) else "torch"
    for rank_res in results:
        assert len(rank_res) == 2 * len(CASES)
        for r in rank_res:
            assert r["world"] == world and r["symmetric"] == want, r
            assert not r["nan"], r
            assert r["err_ref"] <= TOL, r
            assert r["err_truth"] <= TOL, r
            assert r["tail_zero"], r
            assert r["rank_diff"] == 0.0, r
            assert r["b2_per_band"] == CASES[r["case"]][6], r  # b_out -> per-block b2 variant


def test_sharded_experts_chained_one_rank():
    _check(spawn_ranks(_worker, 1, backend="nccl"), 1)


@pytest.mark.two_gpus
def test_sharded_experts_chained_two_gpus():
    require_symmetric(2)
    _check(spawn_ranks(_worker, 2, backend="nccl", hard_exit=True), 2)
