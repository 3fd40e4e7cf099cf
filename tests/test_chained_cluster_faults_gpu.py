"""GPU fault tests of the chained FFN kernel's 2-CTA cluster variant
(``ChainedFFNCompute(cluster=2)``): the two CTAs of the first cluster are made to diverge by the
private switch ``_test_cluster_fault`` (``compute_chained_sm90.ChainedFFNKernel.TEST_FAULTS``),
and every launch must still end, with ``check()`` naming the wait that noticed:

- ``stop_peer``: the peer's TMA warp stops taking tiles at its tile 2 without a record (its roles
  end), while the leader takes the tile and waits for the peer's weight halves and for stages the
  peer never frees: only the operand ring's own timeouts can end it, so ``check()`` must name an
  operand ring wait of cluster rank 0 (``ERR_RING_TIMEOUT``), within a few timeouts;
- ``stall_leader``: the leader's TMA warp stops for two timeouts before its tile 2, so the peer's
  wait for the post times out (``ERR_MAILBOX_TIMEOUT``, rank 1, the first error) and the peer ends
  its tiles while the leader goes on later: the divergence of bench/NOTES.md's "Known gap" (with
  the ring's waits unbounded the leader waits forever for stages of the peer).

Each runs on one cluster (``ccta = SMs - 2``: the first error is the cluster's own) and on the
whole grid (the other clusters' counter waits may see the error first). Every case runs in a
spawned process with a join timeout, so that a hang fails the test instead of stopping the run;
after the faulted launches a launch without the fault must be right and clear.

    CUDA_MODULE_LOADING=EAGER python -m pytest -q tests/test_chained_cluster_faults_gpu.py
"""
import json
import os
import tempfile

import pytest

from conftest import worker_error

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

TIMEOUT_MS = 200
SHAPE = (1024, 2048, 1024)  # P, hidden, N: k tiles (16, 32) well above the ring's 4 stages
JOIN_S = 420  # compiling two kernels and three launches; a hang is killed after this


def _fault_worker(fault, single_cluster, M, out_path):
    """One case in its own process: two launches with the fault (the first compiles), timed,
    each followed by check(); then a fresh instance without the fault. Writes JSON."""
    res = {}
    try:
        import time

        import torch

        from moe_overlap.ffn import compute_chained as mod
        P, hidden, N = SHAPE
        g = torch.Generator(device="cuda").manual_seed(7)
        bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
        x = torch.randn(M, P, **bf)
        w1 = torch.randn(P, hidden, **bf) / P ** 0.5
        b1 = torch.randn(hidden, **bf) * 0.5
        w2 = torch.randn(hidden, N, **bf) / hidden ** 0.5
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        ccta = sms - 2 if single_cluster else 0
        comp = mod.ChainedFFNCompute(cluster=2, group=2, timeout_ms=TIMEOUT_MS,
                                     _test_cluster_fault=fault)
        res["grid"] = comp.grid(M, hidden, N, x.device, ccta)
        errors, times = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            comp(x, w1, b1, w2, ccta=ccta)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            try:
                comp.check()
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        res["errors"], res["launch_s"] = errors, times[1]  # the second: compiled already
        good = mod.ChainedFFNCompute(cluster=2, group=2, timeout_ms=TIMEOUT_MS)
        out = good(x, w1, b1, w2, ccta=ccta)
        good.check()
        ref = mod.chained_ffn_reference(x, w1, b1, w2)
        res["good_rel"] = float((out.float() - ref).abs().max() / ref.abs().max())
    except BaseException as e:  # noqa: BLE001 - recorded for the test to report
        res["exception"] = worker_error(e)
    with open(out_path, "w") as f:
        json.dump(res, f)
    os._exit(0)


def _run(fault, single_cluster, M):
    import torch.multiprocessing as mp
    d = os.environ.get("MOE_TEST_OUT") or tempfile.mkdtemp()
    path = os.path.join(d, f"cluster_fault_{fault[0]}_{'one' if single_cluster else 'all'}.json")
    if os.path.exists(path):
        os.remove(path)
    p = mp.get_context("spawn").Process(target=_fault_worker,
                                        args=(fault, single_cluster, M, path))
    p.start()
    p.join(timeout=JOIN_S)
    hung = p.is_alive()
    if hung:
        p.kill()
        p.join()
    assert not hung, f"{fault}: the process did not end within {JOIN_S} s (a launch hung)"
    assert os.path.exists(path), f"{fault}: the worker died without a result ({p.exitcode})"
    res = json.load(open(path))
    print(json.dumps(res, indent=1))
    assert "exception" not in res, res["exception"]
    # the launch ends within a few timeouts (stall: two of its own, then the others give up)
    assert res["launch_s"] < 10 * TIMEOUT_MS / 1e3, res
    assert all(res["errors"]), f"{fault}: a faulted launch recorded no error: {res['errors']}"
    assert res["good_rel"] < 1e-2, res
    return res


@pytest.mark.parametrize("single_cluster,M", [(True, 4096), (False, 8192)],
                         ids=["one_cluster", "whole_grid"])
def test_stopped_peer_ends_and_names_the_ring(single_cluster, M):
    res = _run(("stop_peer", 2), single_cluster, M)
    if single_cluster:
        assert res["grid"] == 2
        for msg in res["errors"]:
            assert "operand ring wait timed out" in msg and "cluster rank 0" in msg, msg
            assert "block 0, cluster 0" in msg, msg
    else:
        for msg in res["errors"]:
            assert msg.startswith("chained FFN"), msg


@pytest.mark.parametrize("single_cluster,M", [(True, 4096), (False, 8192)],
                         ids=["one_cluster", "whole_grid"])
def test_stalled_leader_ends_after_the_peer_gave_up(single_cluster, M):
    res = _run(("stall_leader", 2), single_cluster, M)
    assert res["launch_s"] >= 2 * TIMEOUT_MS / 1e3, res  # the stall itself
    if single_cluster:
        for msg in res["errors"]:
            assert "mailbox slot" in msg and "cluster rank 1" in msg, msg
            assert "leader to post" in msg, msg
