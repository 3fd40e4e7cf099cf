"""Input checks shared by the combine's entry points.

- `as_int`: host integers (Python or numpy, never bool) as a plain int, with a clear error.
- `check_expert_ids`: every expert id in [0, E), naming the first bad value and its position.
- `agree_on_error`: a check that can fail on some ranks only (routing data, capacities, a stale
  plan, per-rank shapes) must not leave the other ranks waiting in the next collective until the
  process-group timeout. Every rank runs its local checks, then all ranks exchange one small
  error record, and every rank raises, naming the failing rank(s).
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

_MSG_BYTES = 400  # the failing rank's message, truncated, so the other ranks can print it


class PeerInputError(ValueError):
    """Raised on a rank whose own input was fine because another rank reported bad input."""


def as_int(name: str, value, minimum: int | None = None) -> int:
    """value as an int: any `numbers.Integral` (numpy integers too) except bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int, name: str = "topk_ids") -> None:
    """ValueError naming the first id outside [0, num_experts) and where it is (reads the ids:
    a host sync on CUDA)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {topk_ids.dtype}")
    if topk_ids.numel() == 0:
        return
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if not bool(bad.any()):
        return
    pos = tuple(int(i) for i in bad.nonzero()[0].tolist())
    value = int(topk_ids[pos])
    where = f"{name}[{', '.join(map(str, pos))}]"
    raise ValueError(f"expert ids must be in [0, {num_experts}): got {value} at {where} "
                     f"({int(bad.sum())} bad in all)")


def world(group=None) -> tuple[int, int]:
    """(rank, world size) of `group`; (0, 1) without an initialized process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_routing_matches(mine: torch.Tensor, counts_row: torch.Tensor, what: str,
                          hint: str) -> None:
    """ValueError naming the first expert whose assignment count in this rank's routing (`mine`,
    [E], from `count_assignments(topk_ids)`) differs from `counts_row` ([E], the counts the
    caller's plan or exchange was made from)."""
    mine = mine.to(counts_row.device)
    diff = (mine != counts_row.to(torch.int64)).nonzero()
    if diff.numel():
        e = int(diff[0, 0])
        raise ValueError(f"topk_ids do not match {what}: expert {e} gets {int(mine[e])} "
                         f"assignments from topk_ids, {what} says {int(counts_row[e])} ({hint})")


def _device(group) -> torch.device:
    """Where the error record lives: NCCL reduces CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_error(err: BaseException | None, group=None) -> None:
    """Collective over `group` (call it on every rank, at the same point): raise on every rank if
    `err` is not None on any rank. The failing rank raises its own error prefixed with its rank;
    the others raise PeerInputError naming the failing rank(s) and their messages. One all-reduce
    of W x 101 int32; none at world size 1 (err is raised as is)."""
    rank, W = world(group)
    if W == 1:
        if err is not None:
            raise err
        return
    rec = torch.zeros(W, 1 + _MSG_BYTES // 4, dtype=torch.int32)
    if err is not None:
        msg = f"{type(err).__name__}: {err}".encode()[:_MSG_BYTES]
        buf = bytearray(_MSG_BYTES)
        buf[:len(msg)] = msg
        rec[rank, 0] = 1
        rec[rank, 1:] = torch.frombuffer(buf, dtype=torch.int32)
    dev = _device(group)
    rec_d = rec.to(dev)
    dist.all_reduce(rec_d, op=dist.ReduceOp.SUM, group=group)
    rec = rec_d.cpu()
    failed = [r for r in range(W) if int(rec[r, 0])]
    if not failed:
        return

    def text(r):
        raw = rec[r, 1:].contiguous().numpy().tobytes()
        return raw.rstrip(b"\0").decode(errors="replace")

    if err is not None:
        others = [r for r in failed if r != rank]
        also = f" (bad input on rank{'s' if len(others) > 1 else ''} " \
               f"{', '.join(map(str, others))} too)" if others else ""
        try:
            new = type(err)(f"rank {rank}: {err}{also}")
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            raise err
        raise new from err
    if len(failed) == 1:
        raise PeerInputError(f"rank {failed[0]} reported bad input: {text(failed[0])}")
    raise PeerInputError(f"ranks {', '.join(map(str, failed))} reported bad input: "
                         + "; ".join(f"rank {r}: {text(r)}" for r in failed))


def error_of(check, *args, **kwargs) -> Exception | None:
    """The ValueError / TypeError / RuntimeError that `check(*args, **kwargs)` raises, or None:
    what a rank passes to `agree_on_error`."""
    try:
        check(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        return e
    return None
