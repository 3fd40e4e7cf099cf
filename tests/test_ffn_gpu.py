"""FusedFFN / ShardedExperts reference backend on 2 GPUs (NCCL) against the float64 truth.
Skipped without 2 CUDA GPUs (the band all-reduce kernel has its own GPU test,
tests/test_switch_gpu.py)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

from conftest import gpu_ranks_available  # noqa: E402

if not gpu_ranks_available(2):
    pytest.skip("needs 2 CUDA GPUs, or one with MOE_OVERLAP_SHARE_GPU=1", allow_module_level=True)

from moe_overlap.ffn.validation import check_cases  # noqa: E402
from conftest import spawn_ranks  # noqa: E402

CASES = [dict(P=1024, O=4096, N=1024, T=257, act1=a, act2=b, dtype="bfloat16", device="cuda",
              seed=i) for i, (a, b) in enumerate([("gelu", None), ("silu", "relu"),
                                                 ("relu", "gelu_tanh"), ("gelu_tanh", "silu")])]
CASES.append(dict(experts=True, E=4, rows=[100, 0, 37, 64], P=512, O=1024, N=256, T=201,
                  act1="silu", dtype="bfloat16", device="cuda", bias=True, seed=9))


def test_reference_backend_on_two_gpus():
    for results in spawn_ranks(check_cases, 2, CASES, backend="nccl"):
        for case, r in zip(CASES, results):
            assert r["rel_err"] <= r["tol"], (case, r)
            assert r["rank_diff"] == 0.0, (case, r)
