"""Run a function on W local processes joined by a process group.

backend="gloo": CPU ranks. backend="nccl": rank r on GPU r (W GPUs needed). backend="cuda": GPU
ranks wherever the GPUs allow: one rank per GPU over NCCL where there are W GPUs, else the ranks
share the GPUs (rank r on GPU r % G, most often all on GPU 0) over gloo, since NCCL refuses two
ranks on one device; the library's host collectives stage CUDA tensors through host memory there
(``moe_overlap.runtime.collectives``). Ranks that share a GPU run side by side only under MPS
(``scripts/mps.sh start``): each rank then gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` =
100 // ranks-per-GPU, reads its share of SMs from the device and sizes its persistent grids
from it. Without MPS the GPU time-slices the ranks' contexts: cross-rank waits still progress,
at time-slice grain (milliseconds). What one GPU cannot show: NVLink speed and latency,
cross-GPU memory ordering (all ranks share one L2), multicast.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a GPU run go: ``devices[r]`` is rank r's GPU index, ``backend`` the
    process group's, ``ranks_per_gpu`` the most ranks on one GPU, ``thread_percentage`` the MPS
    share of each rank (None: one rank per GPU, the whole GPU)."""
    devices: tuple
    backend: str
    ranks_per_gpu: int
    thread_percentage: int | None

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1


def placement(world_size: int, gpus: int) -> Placement:
    """The placement of ``world_size`` GPU ranks on ``gpus`` visible GPUs (backend="cuda")."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if gpus < 1:
        raise ValueError("GPU ranks need a CUDA GPU (none visible)")
    if world_size <= gpus:
        return Placement(tuple(range(world_size)), "nccl", 1, None)
    per_gpu = -(-world_size // gpus)
    if per_gpu > 100:
        raise ValueError(f"{world_size} ranks on {gpus} GPU(s): {per_gpu} per GPU leaves each "
                         "less than 1 % of a GPU under MPS")
    return Placement(tuple(r % gpus for r in range(world_size)), "gloo", per_gpu,
                     100 // per_gpu)


def rank_device() -> torch.device:
    """This rank's CUDA device (the one spawn set current for it)."""
    return torch.device("cuda", torch.cuda.current_device())


def ranks_per_gpu() -> int:
    """How many ranks of this run share this rank's GPU (1 outside a shared run)."""
    return int(os.environ.get(RANKS_PER_GPU_ENV, "1"))


RANKS_PER_GPU_ENV = "MOE_OVERLAP_RANKS_PER_GPU"


def _place_rank(rank: int, place: Placement) -> None:
    """Before any CUDA call of the rank's own code: its device (its MPS share is in the
    environment it started with: ``rank_env``)."""
    os.environ.update(rank_env(place))
    torch.cuda.set_device(place.devices[rank])


def rank_env(place: Placement | None) -> dict:
    """The environment a rank of ``place`` must start with: how many ranks share its GPU and,
    where they do, its MPS share (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). MPS reads the share
    when the process first initialises CUDA, which a spawned rank may do while it unpickles its
    function, before any of its code runs (importing a module that asks for the device count),
    so the parent sets it around the start (``_start``)."""
    if place is None:
        return {}
    env = {RANKS_PER_GPU_ENV: str(place.ranks_per_gpu)}
    if place.thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(place.thread_percentage)
    return env


def _start(procs, env: dict) -> None:
    """Start ``procs`` with ``env`` added to the environment they inherit, the parent's own
    environment left as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(rank, world_size, port, backend, fn, args, results, timeout_s=None,
            hard_exit=False, place=None, expect_killed=()):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank the parent finds hung gets SIGUSR1 first: its threads' Python stacks go to stderr
    faulthandler.register(HUNG_STACK_SIGNAL, all_threads=True)
    torch.set_num_threads(1)  # W ranks share the machine's cores
    initialized = False
    try:
        if place is not None:
            _place_rank(rank, place)
            backend = place.backend
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kw)
        initialized = True
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - returned to the parent with the traceback (also
        # SystemExit or a pytest outcome: uncaught, rank 0 would wait for a result never sent)
        results[rank] = ("error", traceback.format_exc())
    finally:
        if hard_exit:  # e.g. after NVSHMEM: its and NCCL's teardown order can hang
            if rank == 0:
                _wait_for_all_results(results, world_size, timeout_s, expect_killed)
            os._exit(0)
        if initialized:
            dist.destroy_process_group()


HUNG_STACK_SIGNAL = signal.SIGUSR1


def _dump_stacks(procs, ranks, wait_s: float = 2.0) -> None:
    """Ask each of ``ranks`` for its Python stacks (faulthandler, registered by ``_worker``,
    writes them to the rank's stderr even while it blocks in C, e.g. a CUDA synchronize) and
    give them ``wait_s`` to write before they are killed."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, HUNG_STACK_SIGNAL)
        except (ProcessLookupError, TypeError):
            pass
    if ranks:
        time.sleep(wait_s)


def _wait_for_all_results(results, world_size, timeout_s, expect_killed=()):
    """Rank 0 hosts the rendezvous store: leaving while another rank is still inside
    init_process_group (gloo connects its pairs through the store after rank 0's init returned)
    resets that rank's connection and it dies without a result. Bounded: a rank that never
    reports is the parent's to name (join timeout or missing result). Ranks meant to be killed
    (``expect_killed``) never report and are not waited for."""
    deadline = time.monotonic() + (300.0 if timeout_s is None else timeout_s)
    waited = set(range(world_size)) - set(expect_killed)
    while not waited <= set(results.keys()) and time.monotonic() < deadline:
        time.sleep(0.01)


def spawn(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float | None = None,
          join_timeout_s: float | None = None, hard_exit: bool = False,
          expect_killed: tuple = ()):
    """fn(rank, world_size, *args) on world_size processes; returns the list of results.

    backend: "gloo" (CPU), "nccl" (rank r on GPU r) or "cuda" (GPU ranks, sharing GPUs where
    there are fewer than world_size: see the module's docstring and ``placement``).
    fn must be importable (module level). A failure on any rank raises with that rank's traceback.
    timeout_s: the process group's timeout for collectives (default: torch's).
    join_timeout_s: wall-clock bound of the whole run; ranks still running then are killed and
    named in the RuntimeError (a hang fails instead of blocking). hard_exit: each rank leaves
    with os._exit right after handing back its result (no process-group or NVSHMEM teardown).
    expect_killed: ranks a fault test kills with SIGKILL during the run (not rank 0, which hosts
    the rendezvous store): the other ranks do not wait for them, their result is None, and the
    run fails if one of them ends any other way (a result, another exit code)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    expect_killed = tuple(sorted(set(int(r) for r in expect_killed)))
    if any(not 0 < r < world_size for r in expect_killed):
        raise ValueError(f"expect_killed={expect_killed}: ranks in [1, {world_size - 1}] (rank 0 "
                         "hosts the rendezvous store)")
    place = None
    if backend == "nccl":
        place = Placement(tuple(range(world_size)), "nccl", 1, None)
    elif backend == "cuda":
        place = placement(world_size, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, results,
                                                   timeout_s, hard_exit, place, expect_killed))
                 for r in range(world_size)]
        _start(procs, rank_env(place))
        deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
        for p in procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        _dump_stacks(procs, hung)
        for r in hung:
            procs[r].kill()
            procs[r].join()
        out = dict(results)
    if hung:
        # what the finished ranks handed back tells why the others still wait (a rank that
        # failed and left while its peers wait for it in a collective); a traceback's end names
        # the error, a result's head is enough
        told = "".join(f"\n--- rank {r} ({out[r][0]}): "
                       + (str(out[r][1])[-3000:] if out[r][0] == "error" else str(out[r][1])[:1500])
                       for r in sorted(out))
        raise RuntimeError(f"ranks {hung} of {world_size} still ran after {join_timeout_s} s "
                           f"(hang?) and were killed (their Python stacks on stderr); finished: "
                           f"{sorted(out)}{told}")
    errors = [(r, out[r][1]) for r in sorted(out) if out[r][0] == "error"]
    if errors:
        # every failed rank's traceback, and the ranks that left none with their exit codes:
        # a rank whose peer died reports only the lost connection, the cause is on the peer
        silent = [f"rank {r}: no result, exit code {procs[r].exitcode}"
                  for r in range(world_size) if r not in out and r not in expect_killed]
        raise RuntimeError(f"ranks {[r for r, _ in errors]} failed:\n" + "\n".join(
            [f"--- rank {r}:\n{tb}" for r, tb in errors] + silent))
    not_killed = [r for r in expect_killed
                  if r in out or procs[r].exitcode != -signal.SIGKILL]
    if not_killed:
        raise RuntimeError(f"ranks {not_killed} were to be killed (SIGKILL) but ended otherwise "
                           f"(exit codes {[procs[r].exitcode for r in not_killed]}, result "
                           f"{[r in out for r in not_killed]})")
    missing = [r for r in range(world_size) if r not in out and r not in expect_killed]
    if missing:
        raise RuntimeError(f"ranks {missing} died without a result (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return [out[r][1] if r in out else None for r in range(world_size)]
