"""Planner and reference backend on CUDA: no host sync in the plan, NCCL end to end."""
import pytest
import torch

from moe_overlap.combine.plan import plan_combine
from moe_overlap.routing import ROUTER_MODES

# markers: skipped by tests/conftest.py without one / two GPUs
cuda = pytest.mark.gpu
two_gpus = pytest.mark.two_gpus


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("W,El,tile_m,mgb", [(2, 4, 128, 2), (8, 16, 64, 4), (1, 3, 256, 1)])
@pytest.mark.parametrize("layout", ["aligned", "packed", "auto"])
def test_plan_on_cuda_without_host_sync_matches_cpu(W, El, tile_m, mgb, layout):
    g = torch.Generator().manual_seed(W * 100 + El)
    counts = torch.randint(0, 700, (W, W * El), generator=g)
    counts[0, :El] = 0
    max_rows = int(counts.sum()) + 5
    cpu = plan_combine(counts, W - 1, tile_m=tile_m, mgb=mgb, max_rows=max_rows, layout=layout)
    dev_counts = counts.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = plan_combine(dev_counts, W - 1, tile_m=tile_m, mgb=mgb, max_rows=max_rows,
                           validate=False, layout=layout)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name, t in cpu.tensors().items():
        assert torch.equal(t, getattr(gpu, name).cpu()), name


@pytest.mark.gpu
@two_gpus
def test_reference_backend_on_two_gpus_nccl():
    from moe_overlap.combine.validation import LayerCase, check_layers, passed
    cases = [LayerCase(mode=m, dtype="bfloat16", tokens=300, num_experts=8, topk=2, hidden=256,
                       out_features=512, model_dim=128, tile_m=128, seed=i)
             for i, m in enumerate(ROUTER_MODES)]
    for case, res in zip(cases, check_layers(2, cases, device="cuda")):
        assert passed(res), (case.mode, [(r["rel_err"], r["rel_err_f64"]) for r in res])
