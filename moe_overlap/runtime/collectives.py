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
"""
from __future__ import annotations

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
