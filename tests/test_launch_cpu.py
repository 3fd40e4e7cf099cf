"""The shared multi-process helper (tests/conftest.py spawn_ranks -> moe_overlap.launch.spawn):
a hung rank fails the run naming it, and hard_exit still hands back every result."""
import time

import pytest
import torch

from conftest import on_every_rank, spawn_ranks


def _hang_on_rank1(rank, world):  # module level: spawn pickles it by name
    if rank == 1:
        time.sleep(600)
    return rank


def _fail_then_peer_waits(rank, world):
    """Rank 1 fails and leaves; rank 0 goes on waiting (as for a peer in a collective whose
    process stays alive, so that the process group never sees it leave)."""
    if rank == 1:  # a traceback longer than the report keeps: its end, the error, must show
        try:
            raise ValueError("y" * 4000)
        except ValueError as e:
            raise RuntimeError("rank 1's own failure") from e
    time.sleep(600)


def _value(rank, world, base):
    return base + rank


def _fail_on(rank, world, bad):
    """A step that fails on rank ``bad`` only, agreed on, then a collective every rank enters
    only if the step passed everywhere (without the agreement rank 0 would wait in it)."""
    import torch.distributed as dist

    def step():
        if rank == bad:
            raise RuntimeError(f"capture failed on rank {rank}")
        return rank * 10
    try:
        got = on_every_rank(step)
    except Exception as e:  # noqa: BLE001 - the verdict is the test's
        return f"{type(e).__name__}: {e}"
    t = torch.tensor([got])
    dist.all_reduce(t)
    return int(t)


def test_join_timeout_names_the_hung_rank_and_dumps_where_it_hangs(capfd):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 still ran after 30 s") as e:
        spawn_ranks(_hang_on_rank1, 2, join_timeout_s=30)
    assert time.monotonic() - t0 < 120  # killed, not waited for
    assert "--- rank 0 (ok): 0" in str(e.value)  # what the finished rank handed back
    err = capfd.readouterr().err  # the hung rank's stack, written before the kill
    assert "_hang_on_rank1" in err and "test_launch_cpu.py" in err, err[-2000:]


def test_a_hang_behind_a_failed_rank_reports_that_rank_s_error():
    with pytest.raises(RuntimeError, match=r"ranks \[0\] of 2 still ran after 20 s") as e:
        spawn_ranks(_fail_then_peer_waits, 2, join_timeout_s=20)
    msg = str(e.value)
    assert "--- rank 1 (error): " in msg
    assert msg.rstrip().endswith("RuntimeError: rank 1's own failure"), msg[-300:]
    assert "y" * 3500 not in msg  # the head is what was cut


def test_hard_exit_returns_every_result():
    assert spawn_ranks(_value, 3, 10, hard_exit=True) == [10, 11, 12]


def test_init_failure_is_reported_with_its_traceback():
    # nccl on a machine without CUDA fails inside the rank's set-up, before fn runs
    from moe_overlap.launch import spawn
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (nccl set-up must fail)")
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] failed:\n--- rank 0:\nTraceback"):
        spawn(_value, 2, 10, backend="nccl", join_timeout_s=120)


def _fail_both(rank, world):
    raise RuntimeError("Connection closed by peer" if rank == 0 else "the cause, on rank 1")


def test_every_failed_rank_is_reported_not_only_the_first():
    # rank 0 often fails only because its peer died first: the peer's traceback must be there
    with pytest.raises(RuntimeError) as e:
        spawn_ranks(_fail_both, 2, join_timeout_s=120)
    msg = str(e.value)
    assert "ranks [0, 1] failed" in msg
    assert "--- rank 1:" in msg and "the cause, on rank 1" in msg, msg


def _killed_rank(rank, world, victim):
    import os
    import signal
    if rank == victim:  # a fault test's rank killed mid-call: no result, no teardown
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return rank


def test_an_expected_kill_is_not_a_failure_and_not_waited_for():
    # rank 0 (hard_exit) must not wait its 300 s for the killed rank's result
    t0 = time.monotonic()
    assert spawn_ranks(_killed_rank, 3, 2, hard_exit=True, expect_killed=(2,),
                       join_timeout_s=120) == [0, 1, None]
    assert time.monotonic() - t0 < 60


def test_a_rank_that_was_to_be_killed_but_returned_fails_the_run():
    with pytest.raises(RuntimeError, match=r"ranks \[1\] were to be killed \(SIGKILL\)"):
        spawn_ranks(_killed_rank, 2, -1, hard_exit=True, expect_killed=(1,), join_timeout_s=120)
    with pytest.raises(ValueError, match="rank 0 hosts the rendezvous store"):
        spawn_ranks(_killed_rank, 2, 0, expect_killed=(0,))


def test_hard_exit_under_load_returns_every_result():
    # rank 0 hosts the store: it must stay until every rank has reported (CI once lost ranks
    # 1 and 2 inside init_process_group when rank 0 left first)
    for _ in range(3):
        assert spawn_ranks(_value, 4, 0, hard_exit=True) == [0, 1, 2, 3]


def _json_rank(rank, world, port, outdir):  # the single-rank GPU tests' worker shape
    import json
    import os
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "port_ok": port > 0}, f)
    os._exit(0)


def _silent_rank(rank, world, port, outdir):
    import os
    os._exit(3)


def test_single_rank_json_returns_the_ranks_record(tmp_path, monkeypatch):
    from conftest import single_rank_json
    monkeypatch.setenv("MOE_TEST_OUT", str(tmp_path))
    assert single_rank_json(_json_rank, 120) == {"rank": 0, "world": 1, "port_ok": True}
    (tmp_path / "rank0.json").unlink()
    r = single_rank_json(_silent_rank, 120)
    assert "exit code 3" in r["error"]


# ------------------------------------------------------------- GPU ranks: placement on the GPUs
def test_placement_one_rank_per_gpu_uses_nccl():
    from moe_overlap.launch import placement
    p = placement(4, 8)
    assert p.devices == (0, 1, 2, 3) and p.backend == "nccl"
    assert not p.shared and p.thread_percentage is None


def test_placement_ranks_sharing_gpus_use_gloo_and_an_mps_share():
    from moe_overlap.launch import placement
    p = placement(4, 1)
    assert p.devices == (0, 0, 0, 0) and p.backend == "gloo" and p.shared
    assert p.ranks_per_gpu == 4 and p.thread_percentage == 25
    p = placement(3, 1)  # floor(100 / 3): the shares never sum past the GPU
    assert p.thread_percentage == 33 and 3 * p.thread_percentage <= 100
    p = placement(5, 2)  # round robin: GPU 0 holds 3 ranks, each gets a third
    assert p.devices == (0, 1, 0, 1, 0) and p.ranks_per_gpu == 3
    assert p.thread_percentage == 33


def test_placement_refusals():
    from moe_overlap.launch import placement
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        placement(2, 0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        placement(0, 1)
    with pytest.raises(ValueError, match="less than 1 %"):
        placement(101, 1)


def test_cuda_ranks_without_a_gpu_fail_before_any_rank_starts():
    from moe_overlap.launch import spawn
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        spawn(_value, 2, 10, backend="cuda", join_timeout_s=60)


def test_spawn_ranks_picks_gpu_ranks_only_where_they_can_run(monkeypatch):
    import conftest
    seen = {}

    def fake_spawn(fn, world, *args, backend, **kw):
        seen["backend"] = backend
        return [None] * world

    monkeypatch.setattr("moe_overlap.launch.spawn", fake_spawn)
    for gpus, share, world, want in ((0, False, 2, "skip"), (1, False, 2, "skip"),
                                     (1, True, 2, "cuda"), (2, False, 2, "nccl"),
                                     (2, True, 4, "cuda"), (0, True, 2, "skip")):
        monkeypatch.setattr(conftest, "_cuda_count", lambda g=gpus: g)
        monkeypatch.setenv(conftest.SHARE_GPU_ENV, "1" if share else "0")
        seen.clear()
        if want == "skip":
            with pytest.raises(pytest.skip.Exception, match="GPU ranks"):
                spawn_ranks(_value, world, 0, backend="nccl")
        else:
            spawn_ranks(_value, world, 0, backend="nccl")
            assert seen["backend"] == want, (gpus, share, world)
        # "auto": GPU ranks where they can run, else CPU ranks
        seen.clear()
        spawn_ranks(_value, world, 0, backend="auto")
        assert seen["backend"] == ("gloo" if want == "skip" else want), (gpus, share, world)


def test_sm_share_refusal_names_what_needs_the_sms():
    from moe_overlap.runtime.device import require_sm_share
    require_sm_share(66, 66, "x")
    with pytest.raises(ValueError, match=r"producer \+ consumer needs 70 SMs .* may use 66"):
        require_sm_share(66, 70, "producer + consumer")


def test_context_sm_count_is_none_without_a_driver_context():
    from moe_overlap.runtime.device import context_sm_count
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    try:
        r = context_sm_count(0)
    except (RuntimeError, AssertionError):  # torch refuses a CUDA call without CUDA
        r = None
    assert r is None


def test_a_shared_ranks_mps_share_is_in_its_environment_from_its_start():
    # MPS takes a process's share when it first initialises CUDA, which a spawned rank may do
    # while importing the module of its function, before its own code sets anything
    import os

    import torch.multiprocessing as mp
    from launch_env_child import env_at_import
    from moe_overlap.launch import _start, placement, rank_env
    env = rank_env(placement(2, 1))
    assert env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "MOE_OVERLAP_RANKS_PER_GPU": "2"}
    assert rank_env(placement(2, 2)) == {"MOE_OVERLAP_RANKS_PER_GPU": "1"}  # a GPU each
    before = {k: os.environ.get(k) for k in env}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=env_at_import, args=(q,))
    _start([p], env)
    seen = q.get(timeout=120)
    p.join(120)
    assert seen == env, seen
    assert {k: os.environ.get(k) for k in env} == before  # the parent's own left as it was


def _exit_on_rank1(rank, world):
    if rank == 1:
        raise SystemExit("rank 1 left through SystemExit")  # not an Exception: pytest.skip too
    return rank


def test_a_rank_raising_a_base_exception_is_reported_not_waited_for():
    # with hard_exit rank 0 waits for every result: a rank ending in a BaseException that the
    # worker does not record would leave it waiting its full 300 s
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)ranks \[1\] failed.*SystemExit: rank 1 left"):
        spawn_ranks(_exit_on_rank1, 2, hard_exit=True, join_timeout_s=200)
    assert time.monotonic() - t0 < 60


def test_a_step_failing_on_one_rank_raises_on_every_rank_instead_of_hanging():
    got = spawn_ranks(_fail_on, 3, 1, join_timeout_s=120)
    assert "capture failed on rank 1" in got[1]
    for r in (0, 2):  # the others name the failed rank, and leave no collective half-entered
        assert got[r].startswith("PeerInputError") and "rank 1" in got[r], got[r]
    assert spawn_ranks(_fail_on, 3, -1, join_timeout_s=120) == [30, 30, 30]
