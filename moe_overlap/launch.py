"""Run a function on W local processes joined by a process group (gloo on CPU, NCCL on CUDA)."""
from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, fn, args, results, timeout_s=None,
            hard_exit=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # W ranks share the machine's cores
    initialized = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kw)
        initialized = True
        results[rank] = ("ok", fn(rank, world_size, *args))
    except Exception:  # noqa: BLE001 - returned to the parent with the traceback
        results[rank] = ("error", traceback.format_exc())
    finally:
        if hard_exit:  # e.g. after NVSHMEM: its and NCCL's teardown order can hang
            if rank == 0:
                _wait_for_all_results(results, world_size, timeout_s)
            os._exit(0)
        if initialized:
            dist.destroy_process_group()


def _wait_for_all_results(results, world_size, timeout_s):
    """Rank 0 hosts the rendezvous store: leaving while another rank is still inside
    init_process_group (gloo connects its pairs through the store after rank 0's init returned)
    resets that rank's connection and it dies without a result. Bounded: a rank that never
    reports is the parent's to name (join timeout or missing result)."""
    deadline = time.monotonic() + (300.0 if timeout_s is None else timeout_s)
    while len(results) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


def spawn(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float | None = None,
          join_timeout_s: float | None = None, hard_exit: bool = False):
    """fn(rank, world_size, *args) on world_size processes; returns the list of results.

    fn must be importable (module level). A failure on any rank raises with that rank's traceback.
    timeout_s: the process group's timeout for collectives (default: torch's).
    join_timeout_s: wall-clock bound of the whole run; ranks still running then are killed and
    named in the RuntimeError (a hang fails instead of blocking). hard_exit: each rank leaves
    with os._exit right after handing back its result (no process-group or NVSHMEM teardown)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, results,
                                                   timeout_s, hard_exit))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
        for p in procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        out = dict(results)
    if hung:
        raise RuntimeError(f"ranks {hung} of {world_size} still ran after {join_timeout_s} s "
                           f"(hang?) and were killed; finished: {sorted(out)}")
    errors = [(r, out[r][1]) for r in sorted(out) if out[r][0] == "error"]
    if errors:
        r, tb = errors[0]
        raise RuntimeError(f"rank {r} failed:\n{tb}")
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise RuntimeError(f"ranks {missing} died without a result (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return [out[r][1] for r in range(world_size)]
