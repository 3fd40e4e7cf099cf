"""2-GPU: the race validation (moe_overlap.combine.race_check) passes on the overlapped combine and
fails on a deliberately broken ordering (MOE_OVERLAP_TEST_BROKEN_ORDER=flags_before_stores: the
torch stand-in producer raises every band flag before it stores the band's rows), so a flag race
would not go unseen. Also a short soak of CUDA-graph replays with new data, poisoned and checked."""
import os

import pytest
import torch

from conftest import require_module

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)

for _k, _v in (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
               ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("CUDA_MODULE_LOADING", "EAGER")):
    os.environ[_k] = _v

E, K, N, TOPK, T = 8, 256, 512, 2, 512


def _run(rank, world, producer, broken, local_copy, soak_calls):
    if broken:
        os.environ["MOE_OVERLAP_TEST_BROKEN_ORDER"] = "flags_before_stores"
    else:
        os.environ.pop("MOE_OVERLAP_TEST_BROKEN_ORDER", None)
    from moe_overlap.combine.overlap import OverlapCombine
    from moe_overlap.combine.race_check import soak, validate_calls
    ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N, topk=TOPK,
                        max_tokens_per_rank=T, tile_m=128, ccta=8, transport="nvlink",
                        producer=producer, local_copy=local_copy,
                        copy="ldst" if local_copy else "tma", timeout_s=10.0)
    out = {"producer": ov.producer_kind}
    res = validate_calls(ov, T, "moderate_skew", calls=6, routing_every=2, seed=5)
    out["validate"] = {k: v for k, v in res.items() if k != "records"}
    if soak_calls:
        out["soak"] = soak(ov, T, "balanced", calls=soak_calls, routing_every=5, seed=9)
    torch.cuda.synchronize()
    return out


def _spawn(*args):
    from conftest import spawn_ranks
    return spawn_ranks(_run, 2, *args, backend="nccl")


@pytest.mark.parametrize("local_copy", [True, False])
def test_validation_passes_on_the_product_path(local_copy):
    for r in _spawn(None, False, local_copy, 40):
        assert r["producer"] == "grouped_gemm", r
        v = r["validate"]
        assert v["calls"] == 6 and v["failures"] == 0 and v["all_bitwise"], v
        s = r["soak"]
        assert s["calls"] == 40 and s["failures"] == 0 and s["all_bitwise"], s
        # flat memory: replays allocate nothing that stays
        assert s["memory_allocated_after"] - s["memory_allocated_before"] < 64 << 20, s


@pytest.mark.parametrize("local_copy", [True, False])
def test_validation_passes_with_the_torch_producer(local_copy):
    for r in _spawn("torch", False, local_copy, 0):
        assert r["producer"] == "torch"
        assert r["validate"]["failures"] == 0, r


@pytest.mark.parametrize("local_copy", [True, False])
def test_validation_catches_flags_raised_before_the_stores(local_copy):
    results = _spawn("torch", True, local_copy, 0)
    for r in results:
        assert r["producer"] == "torch"
        # verdicts are agreed over ranks, so every rank sees the failure
        assert r["validate"]["failures"] > 0, r
