"""The shared multi-process helper (tests/conftest.py spawn_ranks -> moe_overlap.launch.spawn):
a hung rank fails the run naming it, and hard_exit still hands back every result."""
import time

import pytest
import torch

from conftest import spawn_ranks


def _hang_on_rank1(rank, world):  # module level: spawn pickles it by name
    if rank == 1:
        time.sleep(600)
    return rank


def _value(rank, world, base):
    return base + rank


def test_join_timeout_names_the_hung_rank():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 still ran after 30 s"):
        spawn_ranks(_hang_on_rank1, 2, join_timeout_s=30)
    assert time.monotonic() - t0 < 120  # killed, not waited for


def test_hard_exit_returns_every_result():
    assert spawn_ranks(_value, 3, 10, hard_exit=True) == [10, 11, 12]


def test_init_failure_is_reported_with_its_traceback():
    # nccl on a machine without CUDA fails inside the rank's set-up, before fn runs
    from moe_overlap.launch import spawn
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (nccl set-up must fail)")
    with pytest.raises(RuntimeError, match=r"rank 0 failed:\nTraceback"):
        spawn(_value, 2, 10, backend="nccl", join_timeout_s=120)


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
