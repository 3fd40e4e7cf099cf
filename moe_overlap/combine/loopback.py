"""Loopback peers: the combine's communication buffer for W ranks in one process on one GPU.

What it is for: a bench that runs the real consumer (moe_overlap/combine/consumer.py) beside the
producer on one GPU, without NVSHMEM or a process group (bench/bench_producer_models.py
``--beside consumer``). ``LoopbackRuntime`` is the symmetric allocator a ``CommBuffer`` takes
(``runtime=``): every allocation is made once per rank on this device, the copy of ``rank`` is
the "local" tensor, and a peer table holds the W copies' addresses. A consumer of rank ``rank``
that ships a segment to rank d therefore stores into copy d of the receive buffer and adds its
arrivals and call marker to copy d of the communication block, all in local memory. The sizes
are the CommBuffer's own (``attach``: two receive slots of the layer's rows x row bytes, the
3W-word block plus any per-segment arrival words, the error word), i.e. what the combine
allocates on each rank; the memory is W times one rank's.

nvlink transport only: its consumer stores through the peer table; the nvshmem consumer goes
through the NVSHMEM library, which has no loopback.

``expected_arrivals`` and ``check_loopback`` say what one consumer call must have left in the
copies (the plan's rows at the plan's receive rows, the counters and epoch tags), from the plan
alone.
"""
from __future__ import annotations

import torch

from ..kernels.errors import call_tag, describe_error, epoch_tag_word
from ..runtime.nvshmem import COMM_BLOCK_WORDS_PER_RANK
from .comm_buffer import CommBuffer

# receive rows outside every shipped segment are filled with this bf16 bit pattern (a NaN the
# producer never writes) before a checked call: a store to a wrong row shows up there
POISON_BITS = 0x7FC1
CHECK_ROWS = 4096  # rows compared per step (the temporaries stay small beside GB slots)


class LoopbackRuntime:
    """A ``CommBuffer`` runtime for W ranks in one process (see the module doc): ``alloc``
    makes W zeroed copies and returns rank ``rank``'s, ``peer_table`` gives every copy's
    address, ``copies`` the copies themselves (for checks), ``barrier`` does nothing (one
    process: no other rank to line up with)."""
    group = None

    def __init__(self, world_size: int, device, rank: int = 0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a positive int")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} out of range [0, {world_size})")
        self.world_size, self.rank = world_size, rank
        self.device = torch.device(device)
        self._copies: dict[int, list[torch.Tensor]] = {}  # id(local copy) -> every rank's copy

    def alloc(self, shape, dtype, note: str = "") -> torch.Tensor:
        copies = [torch.zeros(tuple(shape), dtype=dtype, device=self.device)
                  for _ in range(self.world_size)]
        self._copies[id(copies[self.rank])] = copies
        return copies[self.rank]

    def free(self, t: torch.Tensor):
        if self._copies.pop(id(t), None) is None:
            raise ValueError("free(): not a tensor of this loopback runtime")

    def copies(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of ``t`` (a tensor ``alloc`` returned), rank order."""
        c = self._copies.get(id(t))
        if c is None:
            raise ValueError("copies(): not a tensor of this loopback runtime")
        return c

    def peer_tensor(self, t: torch.Tensor, pe: int) -> torch.Tensor:
        return self.copies(t)[pe]

    def peer_table(self, t: torch.Tensor):
        """(int64 [W] table of the copies' addresses on this device, no unreachable rank)."""
        ptrs = [c.data_ptr() for c in self.copies(t)]
        return torch.tensor(ptrs, dtype=torch.int64, device=self.device), ()

    def allocated_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for cs in self._copies.values() for c in cs)

    def barrier(self, what: str = ""):
        pass  # one process holds every rank


class _Attached:
    """What a CommBuffer registers per attached layer (its band flags are cleared on reset)."""

    def __init__(self, band_ready=None):
        self.band_ready = band_ready

    def _clear_band_flags(self):
        if self.band_ready is not None:
            self.band_ready.zero_()


def loopback_comm_buffer(world_size: int, device, rank: int = 0) -> CommBuffer:
    """A nvlink ``CommBuffer`` of rank ``rank`` of ``world_size`` on a ``LoopbackRuntime``;
    nothing is allocated until a layer attaches (``attach_layer``)."""
    return CommBuffer(None, "nvlink", torch.bfloat16,
                      runtime=LoopbackRuntime(world_size, device, rank))


def attach_layer(buf: CommBuffer, rows: int, row_bytes: int, seg_words: int = 0,
                 band_ready=None):
    """Attach a layer to a loopback buffer as ``OverlapCombine`` attaches itself: ``rows`` x
    ``row_bytes`` receive rows (max_tokens_per_rank x topk rows of N x 2 bytes) and
    ``seg_words`` per-segment arrival words (W x ``ordered_segment_capacity`` with
    scale="ordered", else 0); the buffer grows to the largest layer, as the combine's does.
    Returns the registered object (keep it: the buffer holds layers weakly)."""
    layer = _Attached(band_ready)
    buf.attach(layer, rows, row_bytes, seg_words=seg_words)
    return layer


def loopback_copies(buf: CommBuffer) -> dict:
    """{"recv": W flat receive buffers (2 slots each), "block": W communication blocks} of a
    loopback buffer, rank order."""
    rt = buf.runtime
    return {"recv": rt.copies(buf.buffers.recv), "block": rt.copies(buf.buffers.block)}


def _host(t) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]


def plan_segments(plan) -> dict:
    """The plan's valid remote segments and local cells as host lists (segment: dest, src_row,
    dest_row, rows; cell: src_row, dest_row, rows)."""
    ns, nl = int(plan.num_segments.reshape(-1)[0]), int(plan.num_local_cells.reshape(-1)[0])
    segs = list(zip(_host(plan.segment_dest)[:ns], _host(plan.segment_src_row)[:ns],
                    _host(plan.segment_dest_row)[:ns], _host(plan.segment_rows)[:ns]))
    cells = list(zip(_host(plan.local_cell_src_row)[:nl], _host(plan.local_cell_dest_row)[:nl],
                     _host(plan.local_cell_rows)[:nl]))
    return {"segments": segs, "cells": cells}


def expected_arrivals(plan, local_copy: bool, arrival: str = "counter") -> dict:
    """What one consumer call of ``plan`` adds, per destination rank d, to copy d of the
    communication block: ``counter`` int [W] (word ``plan.rank``: the call marker, plus the
    rows shipped to d where arrival="counter", plus, on the own rank with local_copy, the local
    cells' rows) and ``segments`` {(d, s): rows} (arrival="segment": the per-segment arrival
    word rank x segment_capacity + s of copy d)."""
    if arrival not in ("counter", "segment"):
        raise ValueError(f"arrival={arrival!r}")
    W = plan.world_size
    t = plan_segments(plan)
    ctr = [1] * W  # every rank's call marker, the own rank's too
    seg = {}
    for s, (d, _, _, n) in enumerate(t["segments"]):
        if arrival == "counter":
            ctr[d] += n
        else:
            seg[(d, s)] = seg.get((d, s), 0) + n
    if local_copy:
        ctr[plan.rank] += sum(n for _, _, n in t["cells"])
    return {"counter": ctr, "segments": seg}


def _rows_index(spans, device):
    """(row indices, span of each row) of a list of (start, rows) spans."""
    starts = torch.tensor([a for a, _ in spans], dtype=torch.int64)
    lens = torch.tensor([n for _, n in spans], dtype=torch.int64)
    span = torch.repeat_interleave(torch.arange(len(spans)), lens)
    first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    idx = starts[span] + torch.arange(int(lens.sum())) - first
    return idx.to(device), span.to(device)


def check_loopback(plan, y: torch.Tensor, buf: CommBuffer, blocks_before: list, epoch: int,
                   local_copy: bool, arrival: str = "counter", seg_cap: int = 0) -> dict:
    """One consumer call of ``plan`` (epoch ``epoch``) into a loopback buffer, checked against
    the plan alone; the receive slots were filled with ``POISON_BITS`` before the call and
    ``blocks_before`` are the W blocks' contents before it (clones). Checks: every segment's
    (and with local_copy every local cell's) rows in its destination's slot ``epoch & 1``
    bitwise equal to y's rows; every other row of those slots still poison; each copy's
    counter word of ``plan.rank`` (and per-segment arrival words) advanced by
    ``expected_arrivals``; each copy's epoch tag of ``plan.rank`` = call_tag(epoch, the plan's
    fingerprint); the error word clear. Returns {rows_ok, untouched_ok, counters_ok, tags_ok,
    error_word, ok, shipped_rows, bad} (bad: the first few failures, text)."""
    W, rank = plan.world_size, plan.rank
    cp = loopback_copies(buf)
    row_bytes = y.shape[1] * y.element_size()
    slot_rows = buf.slot_bytes // row_bytes
    parity = epoch & 1
    t = plan_segments(plan)
    per_dest = {d: [] for d in range(W)}  # (dest_row, src_row, rows)
    for d, src, dst, n in t["segments"]:
        per_dest[d].append((dst, src, n))
    if local_copy:
        per_dest[rank].extend((dst, src, n) for src, dst, n in t["cells"])
    bad, rows_ok, untouched_ok, shipped = [], True, True, 0
    yb = y.view(torch.int16)
    for d in range(W):
        slot = cp["recv"][d].view(torch.int16)[parity * (buf.slot_bytes // 2):][
            :slot_rows * y.shape[1]].view(slot_rows, y.shape[1])
        spans = per_dest[d]
        touched = torch.zeros(slot_rows, dtype=torch.bool, device=slot.device)
        if spans:
            dst_idx, span = _rows_index([(a, n) for a, _, n in spans], slot.device)
            src_idx, _ = _rows_index([(s, n) for _, s, n in spans], slot.device)
            shipped += int(dst_idx.numel())
            for c in range(0, dst_idx.numel(), CHECK_ROWS):  # bounded temporaries
                eq = (slot[dst_idx[c:c + CHECK_ROWS]] == yb[src_idx[c:c + CHECK_ROWS]]).all(1)
                if not bool(eq.all()):
                    rows_ok = False
                    r = c + int((~eq).nonzero()[0, 0])
                    bad.append(f"rank {d}: receive row {int(dst_idx[r])} != y row "
                               f"{int(src_idx[r])} (span {int(span[r])})")
                    break
            touched[dst_idx] = True
        for c in range(0, slot_rows, CHECK_ROWS):
            clean = (slot[c:c + CHECK_ROWS] == POISON_BITS).all(1) | touched[c:c + CHECK_ROWS]
            if not bool(clean.all()):
                untouched_ok = False
                r = c + int((~clean).nonzero()[0, 0])
                bad.append(f"rank {d}: receive row {r} written, but no segment goes there")
                break
    exp = expected_arrivals(plan, local_copy, arrival)
    fp = int(plan.counts_fingerprint.reshape(-1)[0])
    counters_ok = tags_ok = True
    for d in range(W):
        before, after = _host(blocks_before[d]), _host(cp["block"][d])
        got = after[rank] - before[rank]
        if got != exp["counter"][d]:
            counters_ok = False
            bad.append(f"rank {d}: counter[{rank}] advanced by {got}, expected "
                       f"{exp['counter'][d]}")
        tag = after[epoch_tag_word(W, parity, rank)]
        if tag != call_tag(epoch, fp):
            tags_ok = False
            bad.append(f"rank {d}: epoch tag {tag}, expected {call_tag(epoch, fp)}")
    if arrival == "segment":
        base = COMM_BLOCK_WORDS_PER_RANK * W
        for (d, s), n in exp["segments"].items():
            w = base + rank * seg_cap + s
            got = _host(cp["block"][d][w:w + 1])[0] - _host(blocks_before[d][w:w + 1])[0]
            if got != n:
                counters_ok = False
                bad.append(f"rank {d}: segment {s}'s arrival word advanced by {got}, "
                           f"expected {n}")
    err = describe_error(_host(buf.err)) or ""
    if err:
        bad.append(f"error word: {err}")
    return dict(rows_ok=rows_ok, untouched_ok=untouched_ok, counters_ok=counters_ok,
                tags_ok=tags_ok, error_word=err, shipped_rows=shipped, bad=bad[:8],
                ok=rows_ok and untouched_ok and counters_ok and tags_ok and not err)


def poison_slots(buf: CommBuffer):
    """Fill every copy's receive slots with ``POISON_BITS`` (before a checked call)."""
    for r in loopback_copies(buf)["recv"]:
        r.view(torch.int16).fill_(POISON_BITS)
