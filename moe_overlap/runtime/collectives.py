"""Host collectives of the library that work on every process group it runs on.

One rank per GPU uses NCCL, which takes CUDA tensors as they are. Several ranks sharing one GPU
(the one-GPU multi-rank mode, ``moe_overlap.launch.spawn(..., backend="cuda")``) cannot use NCCL
(it refuses two ranks on one device), so their group is gloo, whose support for CUDA tensors
differs by collective and version. These wrappers stage CUDA tensors through host memory when the
group is not NCCL, so every caller writes one call for both cases; on NCCL (and on CPU tensors)
they are the plain ``torch.distributed`` call. Staging synchronizes the host with the stream, so a
staged collective cannot be captured in a CUDA graph: the one-GPU mode captures only device work
(plan, prepare, the layers' kernels), as the captured paths of the library already do.

Every function is collective over ``group`` (default: the world group), like the call it wraps.
The bounded all-reduce and barrier at the end (the combine's agreement, the runtime's barriers)
give a rank left waiting an AgreementTimeoutError naming its call after
$MOE_OVERLAP_AGREE_TIMEOUT_S, not the process group's timeout.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def backend_of(group=None) -> str:
    """The process group's backend name ("nccl", "gloo", ...)."""
    return str(dist.get_backend(group))


def stages_cuda(group=None) -> bool:
    """True when CUDA tensors go through host memory on this group (any backend but NCCL)."""
    return backend_of(group) != "nccl"


def _staged(t: torch.Tensor, group) -> bool:
    return t.is_cuda and stages_cuda(group)


def _in_place(t: torch.Tensor, group, call) -> torch.Tensor:
    """``call(x)`` on ``t`` itself, or on a host copy of it written back (staged)."""
    if not _staged(t, group):
        call(t)
        return t
    h = t.detach().cpu()
    call(h)
    with torch.no_grad():
        t.copy_(h)
    return t


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce of ``t``; returns ``t``."""
    return _in_place(t, group, lambda x: dist.all_reduce(x, op=op, group=group))


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast of ``t`` from global rank ``src``; returns ``t``."""
    return _in_place(t, group, lambda x: dist.broadcast(x, src=src, group=group))


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """``parts[r]`` = rank r's ``t`` (same shape and dtype on every rank); returns ``parts``."""
    if not _staged(t, group):
        dist.all_gather(parts, t, group=group)
        return parts
    hp = [torch.empty(p.shape, dtype=p.dtype) for p in parts]
    dist.all_gather(hp, t.detach().cpu().contiguous(), group=group)
    with torch.no_grad():
        for p, h in zip(parts, hp):
            p.copy_(h)
    return parts


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits,
                      group=None) -> torch.Tensor:
    """``dist.all_to_all_single`` along dim 0 with explicit split sizes; returns ``out``."""
    out_splits, in_splits = [int(n) for n in out_splits], [int(n) for n in in_splits]
    if not _staged(inp, group):
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        return out
    h_out = torch.empty(out.shape, dtype=out.dtype)
    dist.all_to_all_single(h_out, inp.detach().cpu().contiguous(), out_splits, in_splits,
                           group=group)
    with torch.no_grad():
        out.copy_(h_out)
    return out


# ---------------------------------------------------------------- bounded: a named timeout, no hang
AGREE_TIMEOUT_ENV = "MOE_OVERLAP_AGREE_TIMEOUT_S"  # seconds; 0 or "none": no bound of its own
AGREE_TIMEOUT_DEFAULT_S = 300.0


class AgreementTimeoutError(RuntimeError):
    """Raised on a rank whose agreement got no answer from every rank in time, or failed in the
    process group (a rank skipped the call, is in another collective, or left)."""


def agree_timeout_s() -> float | None:
    """The agreement's own bound (None: the process group's), from $MOE_OVERLAP_AGREE_TIMEOUT_S."""
    raw = os.environ.get(AGREE_TIMEOUT_ENV, "").strip()
    if not raw:
        return AGREE_TIMEOUT_DEFAULT_S
    if raw.lower() == "none":
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{AGREE_TIMEOUT_ENV}={raw!r}: a number of seconds or 'none'") from None
    return v if v > 0 else None


def collective_device(group) -> torch.device:
    """Where a bounded collective's tensor lives: NCCL reduces CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bounded_all_reduce(rec: torch.Tensor, group, what: str) -> torch.Tensor:
    """Collective: the sum of ``rec`` over ``group`` (on the host), bounded by agree_timeout_s():
    the one all-reduce of the combine's agreement (``combine.checks``) and of bounded_barrier.
    A rank that never joins gives every waiting rank an AgreementTimeoutError naming ``what``."""
    dev = collective_device(group)
    rec_d = rec.to(dev)
    limit = agree_timeout_s()
    try:
        work = dist.all_reduce(rec_d, op=dist.ReduceOp.SUM, group=group, async_op=True)
        if limit is not None:
            deadline, pause = time.monotonic() + limit, 5e-5
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise AgreementTimeoutError(
                        f"{what}: no answer from every rank within {limit:g} s: a rank skipped "
                        "this collective call, is in another one or left (every rank must make "
                        "the same validated calls in the same order, loss.backward() too); "
                        f"this process group is out of step now. {AGREE_TIMEOUT_ENV} sets the "
                        "bound")
                time.sleep(pause)
                pause = min(2 * pause, 2e-3)
        work.wait()
    except AgreementTimeoutError:
        raise
    except RuntimeError as e:  # the process group's own timeout, or a peer that left
        raise AgreementTimeoutError(
            f"{what}: the agreement failed in the process group ({type(e).__name__}: "
            f"{str(e)[:300]}): a rank skipped this collective call, is in another one or "
            "left") from e
    return rec_d.cpu()


def bounded_barrier(group, what: str) -> None:
    """Collective: a barrier over ``group`` bounded like the agreement (agree_timeout_s(), the
    same all-reduce): a rank that never comes (it skipped the call that holds this barrier, is
    in another collective or left) gives every waiting rank an AgreementTimeoutError naming
    ``what`` instead of the process group's 30-minute hang. The library's runtime barriers (a
    layer's first call, CommBuffer.reset and attach) go through it."""
    bounded_all_reduce(torch.zeros(1, dtype=torch.int64), group, what)
