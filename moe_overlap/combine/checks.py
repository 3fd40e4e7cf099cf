"""Input checks shared by the combine's entry points.

- `as_int`: host integers (Python or numpy, never bool) as a plain int, with a clear error.
- `check_expert_ids`: every expert id in [0, E), naming the first bad value and its position.
- `agree_on_call` (and its call-less form `agree_on_error`): a check that can fail on some ranks
  only (routing data, capacities, a stale plan, per-rank shapes) must not leave the other ranks
  waiting in the next collective until the process-group timeout, and ranks that disagree on
  what they do (another call, other options, shapes, dtypes, counts of another routing) must not
  move data. Every rank runs its local checks, then all ranks exchange one fixed-size record (the
  call, its sequence number, the error, a hash of each field and of the counts), and every rank
  raises one error, naming the rank(s) and what differs.
"""
from __future__ import annotations

import hashlib
import numbers
import weakref

import torch
import torch.distributed as dist

# the agreement's bounded all-reduce and its names (re-exported: users catch
# AgreementTimeoutError from here and from moe_overlap.combine)
from ..runtime.collectives import (AGREE_TIMEOUT_DEFAULT_S, AGREE_TIMEOUT_ENV,  # noqa: F401
                                   AgreementTimeoutError, agree_timeout_s, bounded_barrier)
from ..runtime.collectives import bounded_all_reduce as _exchange

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


# ------------------------------------------------------------------------------- the agreement
_FIELDS = 24  # fields one call compares at most
_TEXT = 24  # bytes of a field's value shown to the other ranks
_LABEL = 96  # bytes of the call's name and sequence numbers, as shown in messages
# one rank's record, int64 words: header, the call's name, the error message, then per field its
# hash and its text. Its size never depends on the call or its fields, so ranks that disagree on
# everything still meet in one well-formed collective.
_ERR, _SEQ, _CALL, _SCHEMA, _ROW, _COUNTS, _HAS_ROW, _HAS_COUNTS = range(8)
_HEADER = 8
_LABEL_AT = _HEADER
_MSG_AT = _LABEL_AT + _LABEL // 8
_FIELDS_AT = _MSG_AT + _MSG_BYTES // 8
_SLOT = 1 + _TEXT // 8
_RECORD = _FIELDS_AT + _FIELDS * _SLOT


class RankMismatchError(ValueError):
    """Raised on every rank when the ranks disagree on what they are about to do: another call
    (a rank skipped or added one), other options, shapes or dtypes, or counts of another
    routing."""


class _Counter:
    def __init__(self):
        self.n = 0


_GROUP_CALLS: "weakref.WeakKeyDictionary[object, _Counter]" = weakref.WeakKeyDictionary()


def _group_calls(group) -> _Counter:
    """The validated calls this process entered on `group` (its agreement's sequence number)."""
    pg = group if group is not None else dist.group.WORLD
    return _GROUP_CALLS.setdefault(pg, _Counter())


def _digest(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's str hash is not)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu")
    if not (t.is_floating_point() or t.is_complex()):
        t = t.to(torch.int64)  # counts in int32 and int64 with the same values are the same
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fingerprint(value) -> tuple[int, str]:
    """(hash, short text) of one field's value: tensors by shape, dtype class and contents (a
    host read); dtypes by name; everything else by its repr."""
    if isinstance(value, torch.Tensor):
        h = _digest(f"tensor{tuple(value.shape)}".encode() + _tensor_bytes(value))
        return h, f"{list(value.shape)} #{h & 0xFFFFFFFF:08x}"
    text = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else repr(value)
    return _digest(f"{type(value).__name__}:{text}".encode()), text


def row_keys(counts: torch.Tensor) -> list[int]:
    """One hash per row of a counts matrix [W, E] (or of a single row [E]: one hash)."""
    rows = counts.detach().to("cpu", torch.int64)
    rows = rows.reshape(1, -1) if rows.dim() == 1 else rows
    return [_digest(_tensor_bytes(r)) for r in rows]


def _combine(keys: list[int]) -> int:
    return _digest(b"".join(k.to_bytes(8, "little", signed=True) for k in keys))


def _put_text(row: torch.Tensor, at: int, nbytes: int, text: str) -> None:
    raw = text.encode()[:nbytes]
    buf = bytearray(nbytes)
    buf[:len(raw)] = raw
    row[at:at + nbytes // 8] = torch.frombuffer(buf, dtype=torch.int64)


def _get_text(row: torch.Tensor, at: int, nbytes: int) -> str:
    raw = row[at:at + nbytes // 8].contiguous().numpy().tobytes()
    return raw.rstrip(b"\0").decode(errors="replace")


def _ranks(rs) -> str:
    rs = list(rs)
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def agree_on_call(call: str, fields: dict | None = None, err: BaseException | None = None,
                  group=None, routing: tuple | None = None, where: str = "") -> None:
    """Collective over `group` (every rank, at the same point, before any data moves): the ranks
    agree that they are in the same call, with the same fields, and that none found bad input.
    One all-reduce of a fixed-size int64 record per rank (whatever the call and its fields), so
    ranks that disagree meet in a well-formed collective and every rank raises one error:

    - ranks in different calls (one skipped or added a collective call) or out of step:
      RankMismatchError naming each rank's call and sequence number;
    - `err` (a local check's error) on some rank: that rank raises it prefixed with its rank,
      the others PeerInputError naming it (see `agree_on_error`);
    - `fields` ({name: value}: options, shapes, dtypes...; hashed by `fingerprint`) differing:
      RankMismatchError naming each differing field and the ranks' values;
    - routing = (own_row, counts, what): own_row [E] this rank's assignment counts from its
      topk_ids, counts [W, E] the counts it is about to use (`what` says whose, e.g. "the
      plan's counts"; None: not known). Every rank's counts must equal the matrix of every
      rank's own row: else RankMismatchError naming the ranks whose counts differ (and, on
      them, the rows), e.g. a plan of an earlier step reused on one rank.

    where: extra text for messages (e.g. the layer's call number). The wait is bounded by
    $MOE_OVERLAP_AGREE_TIMEOUT_S (default 300 s): AgreementTimeoutError naming this rank's call.
    World size 1: no collective, `err` is raised as is."""
    rank, W = world(group)
    if W == 1:
        if err is not None:
            raise err
        return
    fields = dict(fields or {})
    if len(fields) > _FIELDS:
        raise ValueError(f"agree_on_call({call!r}): {len(fields)} fields > {_FIELDS}")
    seq = _group_calls(group)
    seq.n += 1
    label = f"{call} ({where + ', ' if where else ''}validated call #{seq.n} on this group)"
    what = f"rank {rank}: {label}"
    rec = torch.zeros(W, _RECORD, dtype=torch.int64)
    me = rec[rank]
    me[_SEQ] = seq.n
    me[_CALL] = _digest(call.encode())
    names = list(fields)
    me[_SCHEMA] = _digest("\0".join(names).encode())
    _put_text(me, _LABEL_AT, _LABEL, label)
    matrix_rows = None
    if routing is not None:
        own_row, counts, _ = routing
        if own_row is not None:
            me[_ROW], me[_HAS_ROW] = row_keys(own_row)[0], 1
        if counts is not None:
            matrix_rows = row_keys(counts)
            me[_COUNTS], me[_HAS_COUNTS] = _combine(matrix_rows), 1
    for i, name in enumerate(names):
        h, text = fingerprint(fields[name])
        me[_FIELDS_AT + i * _SLOT] = h
        _put_text(me, _FIELDS_AT + i * _SLOT + 1, _TEXT, text)
    if err is not None:
        me[_ERR] = 1
        _put_text(me, _MSG_AT, _MSG_BYTES, f"{type(err).__name__}: {err}")
    rec = _exchange(rec, group, what)

    # 1. the same call, in step
    steps = [(int(rec[r, _CALL]), int(rec[r, _SEQ])) for r in range(W)]
    if len(set(steps)) > 1:
        seq.n = max(s for _, s in steps)  # resynchronized: the next calls can agree again
        groups: dict = {}
        for r in range(W):
            groups.setdefault(_get_text(rec[r], _LABEL_AT, _LABEL), []).append(r)
        raise RankMismatchError(
            "ranks are in different collective calls: "
            + "; ".join(f"{_ranks(rs)} in {lab}" for lab, rs in groups.items())
            + ". A rank skipped a collective call or made an extra one: every rank must make "
            "the same validated calls in the same order (the combine, the dispatch, "
            "loss.backward() too)")
    # 2. bad input somewhere
    failed = [r for r in range(W) if int(rec[r, _ERR])]
    if failed:
        _raise_failed(err, rank, failed, lambda r: _get_text(rec[r], _MSG_AT, _MSG_BYTES))
    # 3. the same fields
    if len({int(rec[r, _SCHEMA]) for r in range(W)}) > 1:
        raise RankMismatchError(f"{label}: the ranks compare different fields (another version "
                                "of moe_overlap on some rank?)")
    diffs = []
    for i, name in enumerate(names):
        at = _FIELDS_AT + i * _SLOT
        values: dict = {}
        for r in range(W):
            values.setdefault(int(rec[r, at]), (_get_text(rec[r], at + 1, _TEXT), []))[1] \
                .append(r)
        if len(values) > 1:
            diffs.append(f"{name} differs (" + " vs ".join(
                f"{text} on {_ranks(rs)}" for text, rs in values.values()) + ")")
    if diffs:
        raise RankMismatchError(
            f"ranks disagree in {label}: "
            + "; ".join(diffs) + ". Every rank must pass the same kind of input (layer "
            "options, shapes, dtypes) to each collective call")
    # 4. counts made from every rank's routing of this call
    if routing is not None and all(int(rec[r, _HAS_ROW]) for r in range(W)):
        rows = [int(rec[r, _ROW]) for r in range(W)]
        truth = _combine(rows)
        stale = [r for r in range(W) if int(rec[r, _HAS_COUNTS]) and int(rec[r, _COUNTS]) != truth]
        if stale:
            mine = ""
            if rank in stale and matrix_rows is not None and len(matrix_rows) == W:
                bad = [s for s in range(W) if matrix_rows[s] != rows[s]]
                mine = (f"; on rank {rank} they differ in the row{'s' if len(bad) > 1 else ''} "
                        f"of {_ranks(bad)}")
            raise RankMismatchError(
                f"{label}: {routing[2]} on "
                f"{_ranks(stale)} do not match the routing the ranks pass now (row s must be "
                f"rank s's counts of its topk_ids){mine}: a plan or counts of another step? "
                "Plan every step from exchange_counts(topk_ids) of that step, on every rank")


def backward_agreement(call: str, group=None, where: str = ""):
    """The `backward_check` of a validated exchange (`reference.exchange`): the ranks agree, at
    the start of the backward, that every rank runs this backward with a gradient of the same
    dtype and width (a rank that skipped it is named by the call it is in instead)."""
    def check(grad: torch.Tensor) -> None:
        agree_on_call(call, {"gradient dtype": grad.dtype,
                             "gradient features": grad.shape[-1] if grad.dim() else 1},
                      None, group, where=where)
    return check


def _raise_failed(err, rank, failed, text):
    if err is not None:
        others = [r for r in failed if r != rank]
        also = f" (bad input on {_ranks(others)} too)" if others else ""
        try:
            new = type(err)(f"rank {rank}: {err}{also}")
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            raise err
        raise new from err
    if len(failed) == 1:
        raise PeerInputError(f"rank {failed[0]} reported bad input: {text(failed[0])}")
    raise PeerInputError(f"ranks {', '.join(map(str, failed))} reported bad input: "
                         + "; ".join(f"rank {r}: {text(r)}" for r in failed))


def agree_on_error(err: BaseException | None, group=None) -> None:
    """Collective over `group` (call it on every rank, at the same point): raise on every rank if
    `err` is not None on any rank. The failing rank raises its own error prefixed with its rank;
    the others raise PeerInputError naming the failing rank(s) and their messages. The call-less
    form of `agree_on_call` (one all-reduce; none at world size 1: err is raised as is)."""
    agree_on_call("agree_on_error", None, err, group)


def error_of(check, *args, **kwargs) -> Exception | None:
    """The ValueError / TypeError / RuntimeError that `check(*args, **kwargs)` raises, or None:
    what a rank passes to `agree_on_error`."""
    try:
        check(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        return e
    return None
