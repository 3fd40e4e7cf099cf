"""GPU check of "fail loudly" (issue 21) on 2 GPUs (one NCCL rank each): a device error on one
rank stops its peers' waits at once and names it.

Rank 0 is given a plan corrupted after planning (``validate=False``): ``num_bands`` past the band
capacity (the producer GEMM refuses every band: ERR_PRODUCER_BOUNDS, code 9) or
``num_segments`` past the segment capacity (the consumer refuses the plan before its call
marker: ERR_PLAN_BOUNDS, code 5). Rank 0 then ships nothing; rank 1's plan is valid. Rank 1's
scale waits for rank 0's rows, sees rank 0's error code through the symmetric error word
(``CommBuffer.err_peers``) and stops: its call, synchronized, ends well under the 10 s timeout,
its error word holds ERR_PEER_ERROR naming rank 0 and code 9 / 5, its ``out`` is NaN, and
``check_errors()`` raises a message that names rank 0 as the rank that failed first, with rank
0's own text (read from rank 0's word through P2P). Rank 0 raises its own error. Then
``reset()`` on both ranks (it clears the peer-visible word) and 20 correct calls (fp32
reference), error words clear. For the v1 (local copy, thread copies) and v2 (local_copy=False,
TMA) consumers, one layer each: the consumer fault runs after the producer fault's reset.

Run: ``CUDA_MODULE_LOADING=EAGER NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest -q tests/test_peer_error_gpu.py``.
"""
import time

import pytest
import torch

from conftest import require_module, spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)

E, TOPK, K, N, TILE_M, T_MAX = 8, 2, 256, 512, 128, 256
TIMEOUT_S = 10.0  # the default bound: a peer that only timed out would take this long
CONFIGS = {"v1": dict(local_copy=True, copy="ldst"), "v2": dict(local_copy=False, copy="tma")}
FAULTS = ("producer", "consumer")


def _case(ov, T, seed):
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.routing import route
    dev = ov.device
    ids, w = route(T, E, TOPK, mode="moderate_skew", seed=seed, rank=ov.rank, device=dev)
    plan = plan_combine(exchange_counts(ids, E), ov.rank, tile_m=TILE_M, mgb=2,
                        max_rows=ov.world_size * T_MAX * TOPK, validate=False)
    g = torch.Generator(device=dev).manual_seed(seed * 10 + ov.rank)
    h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(ov.experts_per_rank, K, N, device=dev, generator=g) / K ** 0.5).to(
        torch.bfloat16)
    return ids, w, plan, h, wd


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _corrupt(plan, fault):
    if fault == "producer":
        plan.num_bands.fill_(plan.band_capacity + 1)  # ERR_PRODUCER_BOUNDS, PRF_NUM_BANDS
    else:
        plan.num_segments.fill_(plan.segment_rows.numel() + 1)  # ERR_PLAN_BOUNDS, PF_NSEG


def _run(ov, rank, res, tag, fault):
    from moe_overlap.combine.overlap import OverlapError
    from moe_overlap.combine.reference import reference_combine
    key = f"{tag}_{fault}"
    ids, w, plan, h, wd = _case(ov, 150, 1)
    out = ov.forward(h, wd, plan, ids, w)
    res[f"{key}_good_rel"] = _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w))
    ov.check_errors()
    ids, w, plan, h, wd = _case(ov, 120, 2)  # collective (counts exchange): both ranks
    if rank == 0:
        _corrupt(plan, fault)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    out = ov.forward(h, wd, plan, ids, w)
    torch.cuda.synchronize()
    res[f"{key}_failing_call_s"] = time.perf_counter() - t0
    res[f"{key}_err"] = [int(v) for v in ov.err.tolist()]
    res[f"{key}_out_nan"] = bool(torch.isnan(out.float()).all())
    try:
        ov.check_errors()
        res[f"{key}_raised"] = ""
    except OverlapError as e:
        res[f"{key}_raised"] = str(e)
    ov.reset()
    res[f"{key}_err_after_reset"] = [int(v) for v in ov.err.tolist()]
    worst = 0.0
    for i in range(20):
        ids, w, plan, h, wd = _case(ov, 32 + (i * 37) % 220, 100 + i)
        out = ov.forward(h, wd, plan, ids, w)
        if i % 5 == 0 or i == 19:
            worst = max(worst, _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w)))
    res[f"{key}_reset_worst_rel"] = worst
    try:
        ov.check_errors()
        res[f"{key}_reset_raised"] = ""
    except OverlapError as e:
        res[f"{key}_reset_raised"] = str(e)


def _worker(rank, world):
    from moe_overlap.combine.overlap import OverlapCombine
    res = {}
    for tag, opts in CONFIGS.items():
        ov = None
        for fault in FAULTS:  # one layer per config: the second fault follows the first's reset
            try:
                if ov is None:
                    ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N,
                                        topk=TOPK, max_tokens_per_rank=T_MAX, tile_m=TILE_M,
                                        ccta=8, transport="nvlink", timeout_s=TIMEOUT_S, **opts)
                _run(ov, rank, res, tag, fault)
            except Exception as e:  # noqa: BLE001 - recorded, the other parts still run
                import traceback
                res[f"{tag}_{fault}_error"] = (f"{type(e).__name__}: {e}\n"
                                               f"{traceback.format_exc()[-3000:]}")
    return res


@pytest.fixture(scope="module")
def results():
    res = spawn_ranks(_worker, 2, backend="nccl", join_timeout_s=540, hard_exit=True)
    print(res)
    return res


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("tag", list(CONFIGS))
def test_a_peer_error_stops_the_wait_and_names_the_first_failing_rank(results, tag, fault):
    from moe_overlap.kernels import errors as Er
    key = f"{tag}_{fault}"
    r0, r1 = results
    for r in (r0, r1):
        assert f"{key}_error" not in r, r[f"{key}_error"]
        assert r[f"{key}_good_rel"] < 1e-2, r
    code = Er.ERR_PRODUCER_BOUNDS if fault == "producer" else Er.ERR_PLAN_BOUNDS
    # rank 0: its own error, its own text
    assert r0[f"{key}_err"][0] == code and r0[f"{key}_err"][1] == 0, r0
    assert Er.ERR_NAMES[code] in r0[f"{key}_raised"], r0
    # rank 1: stopped at rank 0's code, well under the timeout, and says so
    err = r1[f"{key}_err"]
    assert err[0] == Er.ERR_PEER_ERROR and err[1] == 1 and err[2] == 0 and err[4] == code, r1
    assert r1[f"{key}_failing_call_s"] < TIMEOUT_S / 5, r1
    assert err[6] < TIMEOUT_S * 1e9 / 5, r1  # elapsed ns of the wait when it stopped
    assert r1[f"{key}_out_nan"], r1
    msg = r1[f"{key}_raised"]
    assert f"rank 1 saw rank 0's error (code {code}" in msg, msg
    assert "(rank 0 failed first)" in msg and Er.ERR_NAMES[code] in msg, msg
    assert "reset()" in msg, msg
    # reset() clears both words (the peer-visible one too); correct calls after it
    for r in (r0, r1):
        assert r[f"{key}_err_after_reset"] == [0] * 8, r
        assert r[f"{key}_reset_worst_rel"] < 1e-2 and r[f"{key}_reset_raised"] == "", r
