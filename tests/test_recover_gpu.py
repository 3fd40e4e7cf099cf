"""GPU checks of the host half of issue 21 on 2 GPUs (one NCCL rank each): errors reported by
default, collective ``reset()``, and the launch order under ``CUDA_LAUNCH_BLOCKING=1``.

- ``skip``: rank 0 skips one call (as an application that caught an exception before the call
  and carried on); rank 1's call times out (its scale / all-reduce waits for rank 0), returns
  without a sync, and rank 1's NEXT call raises ``OverlapError`` (``DeviceError`` for the FFN: rank, what timed out) before
  any launch; then ``reset()`` on both ranks and 100 correct calls (fp32 reference), with the
  error word clear at the end. For ``OverlapCombine`` (v1 and v2 consumers) and ``FusedFFN``.
- ``blocking``: with ``CUDA_LAUNCH_BLOCKING=1`` every call ends well under its timeout with a
  correct result or a clear error (the producer is launched before the kernel that waits for
  it, so no launch waits for a spin to time out).

Run: ``CUDA_MODULE_LOADING=EAGER NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest -q tests/test_recover_gpu.py``.
"""
import time

import pytest
import torch

from conftest import require_module, spawn_ranks, worker_error

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)

E, TOPK, K, N, TILE_M, T_MAX = 8, 2, 256, 512, 128, 256
P, O, NF, TF = 256, 1024, 256, 200  # the FFN: in, hidden (O / G = 512), out, tokens
CONFIGS = {"v1": dict(local_copy=True, copy="ldst"), "v2": dict(local_copy=False, copy="tma")}


def _case(ov, T, seed):
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.routing import route
    dev = ov.device
    ids, w = route(T, E, TOPK, mode="moderate_skew", seed=seed, rank=ov.rank, device=dev)
    plan = plan_combine(exchange_counts(ids, E), ov.rank, tile_m=TILE_M, mgb=2,
                        max_rows=ov.world_size * T_MAX * TOPK)
    g = torch.Generator(device=dev).manual_seed(seed * 10 + ov.rank)
    h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
    wd = (torch.randn(ov.experts_per_rank, K, N, device=dev, generator=g) / K ** 0.5).to(
        torch.bfloat16)
    return ids, w, plan, h, wd


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _combine_skip(rank, res, tag, opts):
    from moe_overlap.combine.overlap import OverlapCombine, OverlapError
    from moe_overlap.combine.reference import reference_combine
    ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N, topk=TOPK,
                        max_tokens_per_rank=T_MAX, tile_m=TILE_M, ccta=8, transport="nvlink",
                        timeout_s=0.5, **opts)
    ids, w, plan, h, wd = _case(ov, 150, 1)
    out = ov.forward(h, wd, plan, ids, w)
    res[f"{tag}_good_rel"] = _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w))
    ov.check_errors()
    # rank 0 skips a call: rank 1's scale waits for rank 0's rows until its timeout
    ids, w, plan, h, wd = _case(ov, 120, 2)  # collective (counts exchange): both ranks
    if rank == 1:
        t0 = time.perf_counter()
        ov.forward(h, wd, plan, ids, w)
        res[f"{tag}_failing_call_s"] = time.perf_counter() - t0  # no sync in the call
    torch.cuda.synchronize()
    torch.distributed.barrier()
    if rank == 1:
        try:
            ov.forward(h, wd, plan, ids, w)
            res[f"{tag}_next_raised"] = ""
        except OverlapError as e:
            res[f"{tag}_next_raised"] = str(e)
    ov.reset()
    worst = 0.0
    for i in range(100):
        ids, w, plan, h, wd = _case(ov, 32 + (i * 37) % 220, 100 + i)
        out = ov.forward(h, wd, plan, ids, w)
        if i % 10 == 0 or i == 99:
            ref = reference_combine(h.float(), wd.float(), plan, ids, w)
            worst = max(worst, _rel(out, ref))
    res[f"{tag}_reset_worst_rel"] = worst
    try:
        ov.check_errors()
        res[f"{tag}_reset_err"] = ""
    except OverlapError as e:
        res[f"{tag}_reset_err"] = str(e)


def _ffn_pair(rank, seed=0):
    from moe_overlap.ffn.layers import FusedFFN
    from moe_overlap.launch import rank_device
    dev = rank_device()
    g = torch.Generator().manual_seed(seed)  # the same weights on every rank
    W1 = (torch.randn(P, O, generator=g) / P ** 0.5).to(torch.bfloat16)
    b1 = (torch.randn(O, generator=g) * 0.1).to(torch.bfloat16)
    W2 = (torch.randn(O, NF, generator=g) / O ** 0.5).to(torch.bfloat16)
    b2 = (torch.randn(NF, generator=g) * 0.1).to(torch.bfloat16)
    fused = FusedFFN.from_full_weights(W1, b1, W2, b2, None, act1="gelu", backend="fused",
                                       ccta=8, device=dev)
    ref = FusedFFN.from_full_weights(W1, b1, W2, b2, None, act1="gelu", device=dev)
    return fused, ref


def _x(seed, T=TF):
    g = torch.Generator().manual_seed(seed)  # the same input on every rank
    return torch.randn(T, P, generator=g).to(torch.bfloat16).cuda()


def _ffn_skip(rank, res):
    # the fused FFN's device errors are DeviceError (README: Failures and recovery), not the
    # combine's OverlapError
    from moe_overlap.runtime.error_watch import DeviceError
    fused, ref = _ffn_pair(rank)
    with torch.no_grad():
        res["ffn_good_rel"] = _rel(fused(_x(1)), ref(_x(1)))
        fused.check_errors()
        fused._allreduce.timeout_ns = 300_000_000  # test only: a short device bound
        if rank == 1:  # rank 0 skips a call: rank 1's all-reduce times out
            t0 = time.perf_counter()
            fused(_x(2))
            res["ffn_failing_call_s"] = time.perf_counter() - t0
        torch.cuda.synchronize()
        torch.distributed.barrier()
        if rank == 1:
            try:
                fused(_x(3))
                res["ffn_next_raised"] = ""
            except DeviceError as e:
                res["ffn_next_raised"] = str(e)
        fused.reset()
        worst = 0.0
        for i in range(100):
            x = _x(100 + i, T=16 + (i * 29) % 240)
            y = fused(x)
            if i % 10 == 0 or i == 99:
                worst = max(worst, _rel(y, ref(x)))
        res["ffn_reset_worst_rel"] = worst
        try:
            fused.check_errors()
            res["ffn_reset_err"] = ""
        except DeviceError as e:
            res["ffn_reset_err"] = str(e)


def _guard(res, tag, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded, the other parts still run
        res[f"{tag}_error"] = worker_error(e)


def _skip_worker(rank, world):
    res = {}
    for tag, opts in CONFIGS.items():
        _guard(res, tag, _combine_skip, rank, res, tag, opts)
    _guard(res, "ffn", _ffn_skip, rank, res)
    return res


def _blocking_worker(rank, world):
    """CUDA_LAUNCH_BLOCKING=1 (set by the test before the spawn): timed calls."""
    import os
    from moe_overlap.combine.overlap import OverlapCombine, OverlapError
    from moe_overlap.combine.reference import reference_combine
    res = {"blocking": os.environ.get("CUDA_LAUNCH_BLOCKING")}

    def combine():
        ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N,
                            topk=TOPK, max_tokens_per_rank=T_MAX, tile_m=TILE_M, ccta=8,
                            transport="nvlink", timeout_s=10.0)
        worst, slowest, raised = 0.0, 0.0, ""
        for i in range(5):
            ids, w, plan, h, wd = _case(ov, 100 + 20 * i, 200 + i)
            t0 = time.perf_counter()
            try:
                out = ov.forward(h, wd, plan, ids, w, check=True)
            except OverlapError as e:
                raised = str(e)
                break
            finally:
                if i:  # the first call compiles
                    slowest = max(slowest, time.perf_counter() - t0)
            worst = max(worst, _rel(out, reference_combine(h.float(), wd.float(), plan, ids, w)))
        res.update(combine_worst_rel=worst, combine_slowest_s=slowest, combine_raised=raised)

    def ffn():
        from moe_overlap.combine.overlap import OverlapError as OE
        fused, ref = _ffn_pair(rank, seed=5)
        worst, slowest, raised = 0.0, 0.0, ""
        with torch.no_grad():
            for i in range(5):
                x = _x(300 + i)
                t0 = time.perf_counter()
                try:
                    y = fused(x)
                    fused.check_errors()
                except OE as e:
                    raised = str(e)
                    break
                finally:
                    if i:
                        slowest = max(slowest, time.perf_counter() - t0)
                worst = max(worst, _rel(y, ref(x)))
        res.update(ffn_worst_rel=worst, ffn_slowest_s=slowest, ffn_raised=raised)

    _guard(res, "combine", combine)
    _guard(res, "ffn", ffn)
    return res


@pytest.fixture(scope="module")
def skip_results():
    res = spawn_ranks(_skip_worker, 2, backend="nccl", join_timeout_s=540, hard_exit=True)
    print(res)
    return res


@pytest.mark.parametrize("tag", list(CONFIGS))
def test_combine_skipped_call_raises_next_then_reset_recovers(skip_results, tag):
    r0, r1 = skip_results
    for r in (r0, r1):
        assert f"{tag}_error" not in r, r[f"{tag}_error"]
        assert r[f"{tag}_good_rel"] < 1e-2, r
    assert r1[f"{tag}_failing_call_s"] < 0.4, r1  # the failing call itself did not wait
    msg = r1[f"{tag}_next_raised"]
    assert "rank 1" in msg and "timed out" in msg and "reset()" in msg, r1
    for r in (r0, r1):
        assert r[f"{tag}_reset_worst_rel"] < 1e-2 and r[f"{tag}_reset_err"] == "", r


def test_ffn_skipped_call_raises_next_then_reset_recovers(skip_results):
    r0, r1 = skip_results
    # every rank's error at once: a rank whose peer failed first reports only the lost peer
    errors = {rank: r["ffn_error"] for rank, r in enumerate(skip_results) if "ffn_error" in r}
    assert not errors, "\n".join(f"--- rank {k}: {v}" for k, v in errors.items())
    for r in (r0, r1):
        assert r["ffn_good_rel"] < 2e-2, r
    assert r1["ffn_failing_call_s"] < 0.25, r1
    msg = r1["ffn_next_raised"]
    assert "FusedFFN (rank 1)" in msg and "timed out" in msg, r1
    for r in (r0, r1):
        assert r["ffn_reset_worst_rel"] < 2e-2 and r["ffn_reset_err"] == "", r


def test_launch_blocking_never_spins_to_the_timeout(monkeypatch):
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    res = spawn_ranks(_blocking_worker, 2, backend="nccl", join_timeout_s=300, hard_exit=True)
    for r in res:
        assert r["blocking"] == "1", r
        for part in ("combine", "ffn"):
            assert f"{part}_error" not in r, r[f"{part}_error"]
            # a clear error or a correct result, and never the 10 s spin of a waiting kernel
            assert r[f"{part}_slowest_s"] < 5.0, r
            assert r[f"{part}_raised"] or r[f"{part}_worst_rel"] < 2e-2, r
