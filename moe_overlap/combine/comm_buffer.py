"""CommBuffer: all communication state of the overlapped combine, one object that layers share.

One ``CommBuffer`` owns, on this rank:
- the symmetric receive buffer: two slots of ``slot_bytes`` each (slot ``epoch & 1`` receives a
  call's rows; a layer of width N uses ``rows x N x 2`` bytes from the start of a slot),
- the symmetric communication block ``int64 [3W]`` (arrival counters, then the per-source epoch
  tags of the two slots: moe_overlap/kernels/errors.py) and the peer address tables; with a
  layer of ``scale="ordered"`` attached, followed by its per-segment arrival words
  (``seg_arrivals``, ``seg_words`` of them: a layer of segment capacity Sc views the first
  W * Sc as [W, Sc], docs/CONTRACTS.md "Per-segment arrivals") and, on this rank only, their
  cumulative expectation ``seg_expected`` (int64 [seg_words], same word mapping),
- the error word (int64 [8], kernels/errors.py): a symmetric allocation of its own (not in the
  communication block, whose layout the kernels fix) with its peer address table
  ``err_peers``, so that the peers' scales see this rank's error code and stop waiting for rows
  it will not ship (ERR_PEER_ERROR); its asynchronous read-back (``ErrorWatch``),
- the call epoch (int32 [1]) and the cumulative expected arrivals (int64 [W]),
- with a dispatch of backend="overlap" attached, the routing counts table (symmetric int64,
  ``counts_table_words(W, E)`` for the most experts E of any layer on it, its peer table
  ``counts_peers``) and the counts exchange's own epoch (int64 [1], ``counts_epoch``: calls
  completed, advanced by its gather kernel): ``exchange_counts`` all-gathers the per-expert
  counts through it on the device (combine/counts_exchange.py), no host collective,
- with a dispatch that stages its source attached (``MoEDispatch(stage_source=)``, the nvshmem
  transport's puts where a peer has no P2P mapping), the staging region (symmetric, its own
  allocation ``stage``): ``stage_x_bytes`` for the most ``max_tokens_per_rank x D`` bf16 rows of
  any such layer, then ``stage_ids_bytes`` for their top-k int32 ids (each rounded up to 16
  bytes); a layer views them as [T, D] and [T, topk] (``staged_source``). Grown, freed and
  zeroed with the other regions (growth, ``reset``). Why symmetric: an NVSHMEM put over a
  network transport (IB between nodes) reads its source by RDMA, which reaches symmetric (or
  registered) memory only; over P2P the GPU's threads read any address.

Why the word itself is symmetric rather than a peer-visible mirror of its code: every kernel
that records an error (consumer, producer GEMM, scales) keeps writing the one word it is given,
with the same code, so none of them changes; a mirror would need a second store in each
``record_error`` and would have to stay first-writer-wins with the word. The peers read word 0
with ld.relaxed.sys through NVLink; the recording ``atom.cas`` (gpu scope) is performed in this
GPU's memory, where those loads read it.

Why one object: the slot parity, the epoch tags and the cumulative counters are protocol state
of the buffer, not of a layer. The slot-reuse argument of ``OverlapCombine`` (a peer cannot ship
call i+2 into a slot before this rank's scale of call i is done) and the tag check of
docs/CONTRACTS.md count calls on the receive buffer; so layers that share the memory must share
the epoch too. With the epoch advanced per call on the buffer, layers A, B, A, B, ... alternate
slots exactly as one layer's calls do.

Sharing. Layers of one process that share (group, transport, dtype) can share one buffer
(``CommBuffer.shared(group, transport, dtype)``, the default of ``MoECombine``), sized for the
largest ``rows x row bytes`` of any of them. The rule that makes it safe: **layers sharing a
buffer run one at a time** (a model runs its layers in sequence on one stream): a call of one
layer must not be in flight, on this rank, while another layer's call on the same buffer is
launched on another stream. Errors and ``reset()`` are the buffer's: a device error recorded by
any layer's call is sticky for every layer on the buffer (their kernels refuse to run and write
NaN), raises in the next call of any of them, and ``reset()`` of any of them (collective) clears
the buffer for all of them (their band flags too: the epoch restarts at 0).

Sizes and growth. ``reserve(rows, row_bytes)`` only records a size (host, no collective);
``MoECombine`` reserves at construction, so a model whose layers are all built before the first
call allocates once, at the largest size. The allocation itself happens when the first layer's
overlap backend is built (``attach``, collective: every rank builds layers in the same order). A
layer that needs more than the allocation grows it collectively at that point: synchronize,
barrier (no kernel of any rank uses the old memory), free, allocate the larger size, zero the
expected counts (the new counters start at 0; the epoch and the error word, a separate
allocation, are kept), barrier.
Growth is refused (``CommBufferError`` naming the bytes needed) once a call on the buffer was
captured in a CUDA graph: the graph holds the old addresses and would replay into freed memory.
Reserve the largest size before capturing, or pass a ``comm_buffer`` reserved for it.

The heap a model needs: ``heap_report`` (and ``moe-overlap heap``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..runtime.error_watch import ErrorWatch
from ..runtime.nvshmem import COMM_BLOCK_WORDS_PER_RANK, NvshmemError, symmetric_size_mib
from .counts_exchange import counts_table_bytes, counts_table_words
from .options import TRANSPORTS
from .plan import band_capacity_for

# 2-byte rows; the consumer and the scale of OverlapCombine move bf16 (the key keeps dtypes apart)
RECV_DTYPES = (torch.bfloat16, torch.float16)
ERR_WORDS = 8


class OverlapError(RuntimeError):
    """A device error of the overlapped combine, or a misuse of its communication buffer."""


class CommBufferError(OverlapError):
    """The communication buffer cannot serve a request (too small and no longer growable)."""


# ---------------------------------------------------------------------------- sizing (pure)
def _esize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


ERR_BYTES = ERR_WORDS * 8  # the symmetric error word, one per buffer


def comm_block_bytes(world_size: int) -> int:
    """Bytes of one rank's communication block (counters + the two slots' epoch tags)."""
    return COMM_BLOCK_WORDS_PER_RANK * world_size * 8


def slot_bytes_for(max_tokens_per_rank: int, topk: int, n: int, dtype=torch.bfloat16) -> int:
    """Bytes of one receive slot of a layer: max_tokens_per_rank x topk rows of N elements."""
    return max_tokens_per_rank * topk * n * _esize(dtype)


def ordered_segment_capacity(world_size: int, max_tokens_per_rank: int, topk: int,
                             experts_per_rank: int, tile_m: int) -> int:
    """Segment capacity of a ``scale="ordered"`` layer: that of a plan at the layer's most
    received rows (every token of every rank routed here), the row stride of its per-segment
    arrival words (W of them per segment)."""
    rows_max = world_size * max_tokens_per_rank * topk
    return band_capacity_for(rows_max, experts_per_rank, world_size, tile_m) \
        + experts_per_rank * world_size


@dataclass(frozen=True)
class LayerShape:
    """One combine layer's communication size: T_max (max_tokens_per_rank), topk, N; for a
    ``scale="ordered"`` layer also its experts (all ranks') and tile_m, which size its
    per-segment arrival words (experts=0: a plain-scale layer, none)."""
    max_tokens_per_rank: int
    topk: int
    n: int
    count: int = 1  # layers of this shape
    experts: int = 0  # > 0: scale="ordered", per-segment arrival words for this many experts
    tile_m: int = 128
    counts_experts: int = 0  # > 0: the counts table of a device counts exchange of E experts

    def slot_bytes(self, dtype=torch.bfloat16) -> int:
        return slot_bytes_for(self.max_tokens_per_rank, self.topk, self.n, dtype)

    def seg_words(self, world_size: int) -> int:
        """Per-segment arrival words (int64) the layer attaches (0 with the plain scale)."""
        if not self.experts:
            return 0
        return world_size * ordered_segment_capacity(
            world_size, self.max_tokens_per_rank, self.topk, self.experts // world_size,
            self.tile_m)


def heap_report(layers, world_size: int, dtype=torch.bfloat16) -> dict:
    """Symmetric heap the combine needs on each rank for ``layers`` (LayerShape or
    (T_max, topk, N[, count]) tuples) in one group of ``world_size`` ranks:
    ``unshared`` (every layer its own buffer: 2 slots + a block + an error word each, what
    OverlapCombine without a comm_buffer allocates), ``shared`` (one CommBuffer: 2 slots of the
    largest layer + one block + one error word; the block also holds the most per-segment
    arrival words of any ``scale="ordered"`` layer, ``seg_bytes``) and ``symmetric_size_mib`` /
    ``symmetric_size`` (the NVSHMEM_SYMMETRIC_SIZE to set for the shared buffer, with NVSHMEM's
    headroom), plus the inputs. Pure Python."""
    if dtype not in RECV_DTYPES:
        raise ValueError(f"dtype={dtype}: the combine's receive buffer is one of {RECV_DTYPES}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    shapes = []
    for s in layers:
        s = s if isinstance(s, LayerShape) else LayerShape(*s)
        for name in ("max_tokens_per_rank", "topk", "n", "count", "tile_m"):
            v = getattr(s, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layer {s}: {name}={v!r} must be a positive int")
        v = s.counts_experts
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"layer {s}: counts_experts={v!r} must be an int >= 0")
        if isinstance(s.experts, bool) or not isinstance(s.experts, int) or s.experts < 0 or \
                s.experts % world_size:
            raise ValueError(f"layer {s}: experts={s.experts!r} must be 0 (plain scale) or a "
                             f"positive multiple of world_size={world_size}")
        shapes.append(s)
    if not shapes:
        raise ValueError("heap_report needs at least one layer")
    block = comm_block_bytes(world_size) + ERR_BYTES
    num = sum(s.count for s in shapes)
    def counts(s):
        return counts_table_bytes(world_size, s.counts_experts) if s.counts_experts else 0

    unshared = sum(s.count * (2 * s.slot_bytes(dtype) + block + 8 * s.seg_words(world_size)
                              + counts(s)) for s in shapes)
    slot = max(s.slot_bytes(dtype) for s in shapes)
    seg = 8 * max(s.seg_words(world_size) for s in shapes)
    cnt = max(counts(s) for s in shapes)
    shared = 2 * slot + block + seg + cnt
    mib = symmetric_size_mib(shared)
    return {"layers": num, "world_size": world_size, "dtype": str(dtype).removeprefix("torch."),
            "slot_bytes": slot, "block_bytes": block - ERR_BYTES, "err_bytes": ERR_BYTES,
            "seg_bytes": seg, "counts_bytes": cnt, "unshared_bytes": unshared,
            "shared_bytes": shared, "symmetric_size_mib": mib,
            "symmetric_size": f"{mib}M",
            "unshared_symmetric_size": f"{symmetric_size_mib(unshared)}M"}


def format_heap_report(r: dict) -> str:
    gib = 2 ** 30
    return "\n".join([
        f"{r['layers']} combine layers, world size {r['world_size']}, {r['dtype']} rows",
        f"  without sharing: {r['unshared_bytes']} bytes ({r['unshared_bytes'] / gib:.3f} GiB) "
        f"of symmetric heap per rank (NVSHMEM_SYMMETRIC_SIZE={r['unshared_symmetric_size']})",
        f"  shared (one CommBuffer, the MoECombine default): {r['shared_bytes']} bytes "
        f"({r['shared_bytes'] / gib:.3f} GiB) = 2 slots x {r['slot_bytes']} + "
        f"{r['block_bytes']} block + "
        + (f"{r['seg_bytes']} per-segment arrival words (scale='ordered') + "
           if r.get("seg_bytes") else "")
        + (f"{r['counts_bytes']} counts table (device counts exchange) + "
           if r.get("counts_bytes") else "") + f"{r['err_bytes']} error word",
        f"  set NVSHMEM_SYMMETRIC_SIZE={r['symmetric_size']} on every rank before NVSHMEM "
        "starts (plus what other symmetric users, e.g. the fused FFN, need)"])


# ---------------------------------------------------------------------------- the buffer
class CommBuffer:
    """The combine's communication state on this rank (see the module doc); ``OverlapCombine``
    and ``MoECombine`` take it as ``comm_buffer=``.

    CommBuffer(group=None, transport="nvlink", dtype=torch.bfloat16, runtime=None): host only,
    nothing is allocated until the first layer attaches. ``runtime``: the symmetric allocator
    (``NvshmemRuntime.get(group)`` by default, created then): alloc / free / peer_table /
    barrier / device / rank / world_size.
    ``CommBuffer.shared(group, transport, dtype)``: the process-wide buffer of that key.
    """
    _shared: dict = {}  # (id(group), transport, dtype) -> CommBuffer

    def __init__(self, group=None, transport: str = "nvlink", dtype=torch.bfloat16,
                 runtime=None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}; choose from {TRANSPORTS}")
        if dtype not in RECV_DTYPES:
            raise ValueError(f"dtype={dtype}: the combine's receive buffer is one of "
                             f"{RECV_DTYPES}")
        self.group, self.transport, self.dtype = group, transport, dtype
        self._runtime = runtime
        self.reserved_slot_bytes = 0  # the largest slot any layer asked for
        self.slot_bytes = 0  # the allocated slot (0: not allocated)
        self.buffers = None  # runtime.nvshmem.CombineBuffers (recv: flat, 2 slots)
        self.epoch = self.expected = self.err = None  # device tensors, made with the memory
        self.err_peers = None  # int64 [W]: every rank's error word as mapped here (0: none)
        self.watch = None  # ErrorWatch of err
        self.calls = 0  # calls begun on this buffer (host count, eager and captured)
        self.captured = False  # a call was captured in a CUDA graph: the addresses are fixed
        self.growths = 0
        self.reserved_seg_words = 0  # the most per-segment arrival words any layer asked for
        self.seg_words = 0  # allocated per-segment arrival words (after the 3W)
        self.seg_expected = None  # int64 [seg_words] on this rank (None: seg_words == 0)
        self.reserved_counts_experts = 0  # the most experts any layer exchanges counts of
        self.counts_experts = 0  # the allocated counts table's experts (0: none)
        self.counts_table = self.counts_peers = None  # symmetric int64 table, its peer table
        self.counts_epoch = None  # int64 [1]: counts exchanges completed (device-advanced)
        self._counts_exchange = None  # CountsExchange of this buffer's (W, transport)
        self._counts_warm = False  # its kernels compiled, loaded and run once (collective)
        self.reserved_stage = (0, 0)  # the most (x bytes, ids bytes) any staging layer asked for
        self.stage_x_bytes = self.stage_ids_bytes = 0  # the allocated staging region's parts
        self.stage = None  # symmetric int64 words: x rows, then ids (None: no staging layer)
        self._unreachable_anywhere = None  # unreachable_anywhere()'s agreed answer, once
        self._layers = weakref.WeakSet()  # attached layers (their band flags on reset)

    @classmethod
    def shared(cls, group=None, transport: str = "nvlink", dtype=torch.bfloat16) -> "CommBuffer":
        """The process-wide buffer of (group, transport, dtype), created on first use."""
        key = (id(group), transport, dtype)
        b = cls._shared.get(key)
        if b is None or b.group is not group:
            b = cls._shared[key] = cls(group, transport, dtype)
        return b

    # ---- sizes --------------------------------------------------------------------------
    @property
    def runtime(self):
        if self._runtime is None:
            from ..runtime.nvshmem import NvshmemRuntime
            self._runtime = NvshmemRuntime.get(self.group)
        return self._runtime

    @property
    def allocated(self) -> bool:
        return self.buffers is not None

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def heap_bytes(self) -> int:
        """Symmetric bytes this buffer holds now (0 before the first attach)."""
        if not self.allocated:
            return 0
        return 2 * self.slot_bytes + self.buffers.block.numel() * 8 + self.err.numel() * 8 + \
            (0 if self.counts_table is None else self.counts_table.numel() * 8) + \
            (0 if self.stage is None else self.stage.numel() * 8)

    def reserve(self, rows: int, row_bytes: int) -> int:
        """Record that a layer will need slots of ``rows x row_bytes`` (host only, no
        collective; the memory follows at the next attach). Returns the slot bytes reserved."""
        for name, v in (("rows", rows), ("row_bytes", row_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if row_bytes % 16:
            raise ValueError(f"row_bytes={row_bytes} must be a multiple of 16 (16-byte rows)")
        need = rows * row_bytes
        self.reserved_slot_bytes = max(self.reserved_slot_bytes, need)
        return need

    # ---- attach / allocate / grow (collective) -----------------------------------------
    def attach(self, layer, rows: int, row_bytes: int, seg_words: int = 0,
               counts_experts: int = 0, stage_x_bytes: int = 0, stage_ids_bytes: int = 0):
        """Collective (every rank, same order): make the buffer hold slots of ``rows x
        row_bytes``, ``seg_words`` per-segment arrival words (W x the layer's segment
        capacity; 0 without scale="ordered"), a counts table of ``counts_experts`` experts
        (0: the layer exchanges no counts on the device) and a staging region of
        ``stage_x_bytes`` + ``stage_ids_bytes`` (each rounded up to 16; 0: the layer stages
        nothing) for ``layer`` (allocating, or growing as the module doc says) and register the
        layer (its ``_clear_band_flags()`` runs on reset)."""
        need = self.reserve(rows, row_bytes)
        for name, v in (("stage_x_bytes", stage_x_bytes), ("stage_ids_bytes", stage_ids_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        stage = (-(-stage_x_bytes // 16) * 16, -(-stage_ids_bytes // 16) * 16)
        self.reserved_stage = tuple(max(a, b) for a, b in zip(self.reserved_stage, stage))
        if isinstance(seg_words, bool) or not isinstance(seg_words, int) or seg_words < 0:
            raise ValueError(f"seg_words={seg_words!r} must be an int >= 0")
        if isinstance(counts_experts, bool) or not isinstance(counts_experts, int) or \
                counts_experts < 0:
            raise ValueError(f"counts_experts={counts_experts!r} must be an int >= 0")
        self.reserved_seg_words = max(self.reserved_seg_words, seg_words)
        self.reserved_counts_experts = max(self.reserved_counts_experts, counts_experts)
        if not self.allocated:
            self._allocate(self.reserved_slot_bytes)
        elif need > self.slot_bytes or seg_words > self.seg_words or \
                counts_experts > self.counts_experts:
            self._grow(max(self.reserved_slot_bytes, self.slot_bytes))
        elif stage[0] > self.stage_x_bytes or stage[1] > self.stage_ids_bytes:
            self._grow_stage()
        self._layers.add(layer)
        if self.watch is not None and len(self._layers) > 1:
            self.watch.what = (f"OverlapCombine (rank {self.runtime.rank}; communication "
                               f"buffer shared by {len(self._layers)} layers)")

    def _note(self, slot_bytes: int) -> str:
        rt = self.runtime
        block = comm_block_bytes(rt.world_size) + ERR_BYTES
        return (f"The {self.transport} combine's communication buffer needs "
                f"{(2 * slot_bytes + block) / 2**20:.1f} MiB (2 slots of {slot_bytes} bytes, "
                f"the largest max_tokens_per_rank x topk x N x {_esize(self.dtype)} of the "
                f"{max(1, self.num_layers)} layer(s) on it so far, plus the {block}-byte "
                "communication block and error word); layers sharing one CommBuffer (the "
                "MoECombine default) need it once, whatever their number; `moe-overlap heap` "
                "reports a model's total"
                + (f"; plus {sum(self.reserved_stage)} bytes of the dispatch's staged source "
                   "(MoEDispatch stage_source)" if any(self.reserved_stage) else ""))

    def _allocate(self, slot_bytes: int):
        from ..runtime.nvshmem import CombineBuffers
        rt = self.runtime
        W = rt.world_size
        note = self._note(slot_bytes)
        recv = rt.alloc((2 * slot_bytes // _esize(self.dtype),), self.dtype, note=note)
        try:
            block = rt.alloc((COMM_BLOCK_WORDS_PER_RANK * W + self.reserved_seg_words,),
                             torch.int64, note=note)
        except BaseException:
            rt.free(recv)
            raise
        counts = None
        if self.reserved_counts_experts:
            try:  # zeroed by alloc: no flag reaches an epoch before it is posted
                counts = rt.alloc((counts_table_words(W, self.reserved_counts_experts),),
                                  torch.int64, note=note)
            except BaseException:
                rt.free(block)
                rt.free(recv)
                raise
        stage = None
        if any(self.reserved_stage):
            try:  # zeroed by alloc, as reset leaves it
                stage = rt.alloc((sum(self.reserved_stage) // 8,), torch.int64, note=note)
            except BaseException:
                for t in (counts, block, recv):
                    if t is not None:
                        rt.free(t)
                raise
        self.stage = stage
        self.stage_x_bytes, self.stage_ids_bytes = self.reserved_stage if stage is not None \
            else (0, 0)
        (rp, bad), (cp, _) = rt.peer_table(recv), rt.peer_table(block)
        self.counts_table, self.counts_experts = counts, self.reserved_counts_experts
        self.counts_peers = None if counts is None else rt.peer_table(counts)[0]
        self.buffers = CombineBuffers(recv, block[:W], rp, cp, block=block, unreachable=bad)
        self.slot_bytes = slot_bytes
        self.seg_words = self.reserved_seg_words
        if self.seg_words and (self.seg_expected is None
                               or self.seg_expected.numel() != self.seg_words):
            # new arrival words start at 0, so must their expectation
            self.seg_expected = torch.zeros(self.seg_words, dtype=torch.int64, device=rt.device)
        if self.epoch is None:
            dev = rt.device
            # symmetric, once (growth keeps it): the peers' scales poll its code word
            try:
                self.err = rt.alloc((ERR_WORDS,), torch.int64, note=note)
            except BaseException:
                for t in (stage, counts, block, recv):
                    if t is not None:
                        rt.free(t)
                self.buffers = self.stage = self.counts_table = None
                self.stage_x_bytes = self.stage_ids_bytes = 0
                raise
            self.err_peers, self._err_unreachable = rt.peer_table(self.err)
            self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
            # a new table after growth is zero too, so the kept epoch stays valid: its flags
            # only ever hold epochs posted into it
            self.counts_epoch = torch.zeros(1, dtype=torch.int64, device=dev)
            self.expected = torch.zeros(W, dtype=torch.int64, device=dev)  # = fresh counters
            # every layer's read-back of the one word; a layer with error_check="off" skips
            # poll / after_call itself (OverlapCombine)
            self.watch = ErrorWatch(self.err, self.describe_error,
                                    f"OverlapCombine (rank {rt.rank})", exc=OverlapError)

    def _grow(self, slot_bytes: int):
        if self.captured:
            raise CommBufferError(
                f"a layer needs receive slots of {slot_bytes} bytes, but the shared "
                f"{self.transport} communication buffer has {self.slot_bytes} and a call on it "
                "was captured in a CUDA graph, whose replays use the current addresses: it "
                f"cannot grow. It needs {2 * slot_bytes + self.buffers.block.numel() * 8} "
                "bytes: build every layer (MoECombine reserves at construction) before the "
                "first capture, or pass comm_buffer=CommBuffer(...) after "
                f"reserve({slot_bytes} bytes) to the layers")
        rt = self.runtime
        torch.cuda.synchronize(rt.device)
        # no kernel of any rank uses the old memory past this point
        rt.barrier("CommBuffer growth (a layer attached with a larger size)")
        old = self.buffers
        self.buffers = None
        rt.free(old.recv)
        rt.free(old.block)
        if self.counts_table is not None:
            rt.free(self.counts_table)
            self.counts_table = self.counts_peers = None
        if self.stage is not None:
            rt.free(self.stage)
            self.stage = None
        self._allocate(slot_bytes)
        self.expected.zero_()  # the new counters start at 0; epoch and error word are kept
        if self.seg_expected is not None:
            self.seg_expected.zero_()
        self.growths += 1
        rt.barrier("CommBuffer growth (a layer attached with a larger size)")

    def _grow_stage(self):
        """The staging region alone, where nothing else needs growth (a layer that stages,
        attached after the buffer was allocated: MoEDispatch resolves stage_source="auto" from
        the allocated buffer's peer tables): a first one is just allocated (no kernel reads it
        yet); a larger one replaces the old as growth does (synchronize, barrier, free,
        allocate; refused once a call was captured: the graph holds its address)."""
        rt = self.runtime
        if self.stage is not None:
            if self.captured:
                raise CommBufferError(
                    f"a layer needs a staging region of {sum(self.reserved_stage)} bytes, the "
                    f"buffer has {self.stage_x_bytes + self.stage_ids_bytes} and a call on it "
                    "was captured in a CUDA graph, whose replays use the current address: build "
                    "every layer before the first capture")
            torch.cuda.synchronize(rt.device)
            # no send of any rank reads the old region past this point
            rt.barrier("CommBuffer growth of its staging region")
            rt.free(self.stage)
            self.stage = None
            self.stage_x_bytes = self.stage_ids_bytes = 0
            self.growths += 1
        self.stage = rt.alloc((sum(self.reserved_stage) // 8,), torch.int64,
                              note=self._note(self.slot_bytes))
        self.stage_x_bytes, self.stage_ids_bytes = self.reserved_stage

    def seg_tables(self, seg_cap: int):
        """(seg_arrivals, seg_expected) as a layer of segment capacity ``seg_cap`` sees them:
        int64 [W, seg_cap] views of the first W * seg_cap arrival words and of their
        expectation (the senders' consumers index them the same way: rank * seg_cap + i)."""
        W = self.runtime.world_size
        if not self.allocated or W * seg_cap > self.seg_words:
            raise CommBufferError(f"the communication buffer holds {self.seg_words} per-segment "
                                  f"arrival words, a layer needs {W * seg_cap} (attach with "
                                  "seg_words)")
        base = COMM_BLOCK_WORDS_PER_RANK * W
        return (self.buffers.block[base:base + W * seg_cap].view(W, seg_cap),
                self.seg_expected[:W * seg_cap].view(W, seg_cap))

    def staged_source(self, tokens: int, hidden: int, topk: int):
        """(x [tokens, hidden] bf16, ids [tokens, topk] int32): a staging layer's views of the
        staging region (x rows from its start, ids from ``stage_x_bytes``), the symmetric
        source of the nvshmem send's puts."""
        xb, ib = tokens * hidden * 2, tokens * topk * 4
        if self.stage is None or xb > self.stage_x_bytes or ib > self.stage_ids_bytes:
            raise CommBufferError(
                f"the staging region holds {self.stage_x_bytes} + {self.stage_ids_bytes} bytes, "
                f"[{tokens}, {hidden}] bf16 + [{tokens}, {topk}] int32 need {xb} + {ib} "
                "(attach with stage_x_bytes / stage_ids_bytes)")
        b = self.stage.view(torch.uint8)
        x = b[:xb].view(torch.bfloat16).view(tokens, hidden)
        ids = b[self.stage_x_bytes:self.stage_x_bytes + ib].view(torch.int32).view(tokens, topk)
        return x, ids

    def unreachable_anywhere(self) -> bool:
        """Collective once (every rank, same order; later calls return the kept answer):
        whether any rank of the group has a peer without a load/store (P2P) mapping
        (``buffers.unreachable`` of some rank), agreed by a host all-reduce (max) over the
        group, so that every rank takes the same decision from it (a symmetric allocation made
        on it must be made on every rank)."""
        if not self.allocated:
            raise CommBufferError("the communication buffer is not allocated yet (attach)")
        if self._unreachable_anywhere is None:
            flag = torch.tensor([1 if self.buffers.unreachable else 0], dtype=torch.int64,
                                device=self.runtime.device)
            if self.runtime.world_size > 1:
                import torch.distributed as dist
                from ..runtime.collectives import all_reduce
                all_reduce(flag, dist.ReduceOp.MAX, self.group)
            self._unreachable_anywhere = bool(int(flag.item()))
        return self._unreachable_anywhere

    # ---- calls ------------------------------------------------------------------------
    def note_call(self):
        """A call (or a lone consumer launch) on the buffer is being issued."""
        self.calls += 1
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.captured = True

    def slots(self, rows: int, n: int) -> torch.Tensor:
        """The two receive slots as a layer of ``rows`` x ``n`` sees them: a [2, rows, n]
        view (slot stride: the buffer's slot, not rows x n)."""
        if not self.allocated:
            raise CommBufferError("the communication buffer is not allocated yet (attach)")
        if rows * n * _esize(self.dtype) > self.slot_bytes:
            raise CommBufferError(f"[{rows}, {n}] does not fit a slot of {self.slot_bytes} "
                                  "bytes")
        step = self.slot_bytes // _esize(self.dtype)
        return torch.as_strided(self.buffers.recv, (2, rows, n), (step, n, 1))

    def exchange_counts(self, counts: torch.Tensor, timeout_s: float = 10.0) -> torch.Tensor:
        """Collective on the device (every rank of the group, same E): this rank's per-expert
        counts (int64 [E] on this rank's GPU) -> every rank's, int64 [W, E] (row s: rank s's),
        bitwise the host all-gather; through the counts table (combine/counts_exchange.py):
        no host collective and no host synchronization, so a CUDA graph captures it, on any
        process group (gloo, ranks sharing a GPU). Needs a table of E experts or more (a layer
        attached with ``counts_experts``). A source that does not post within ``timeout_s``
        records ERR_COUNTS_TIMEOUT (naming it and the epoch) in the error word, raised by the
        next call on the buffer (its rows read here are zero)."""
        E = int(counts.numel())
        if counts.dim() != 1 or counts.dtype != torch.int64:
            raise ValueError(f"counts must be int64 [E], got {counts.dtype} "
                             f"{tuple(counts.shape)}")
        if not self.allocated or self.counts_table is None or E > self.counts_experts:
            raise CommBufferError(
                f"the communication buffer has a counts table of {self.counts_experts} experts, "
                f"the exchange needs {E}: attach a layer with counts_experts (MoEDispatch("
                "backend='overlap') does) before the first exchange")
        rt = self.runtime
        if self._counts_exchange is None:
            from .counts_exchange import CountsExchange
            self._counts_exchange = CountsExchange(rt.world_size, self.transport)
        ex = self._counts_exchange
        self.watch.poll()  # an earlier call's device error raises here, before any launch
        capturing = torch.cuda.is_current_stream_capturing()
        if not self._counts_warm and not capturing:
            # collective, once: compiled and loaded before any peer spins on this rank's flag
            ex.warmup(rt.device, E)
            rt.barrier("the device counts exchange's first call (its warm-up barrier)")
            self._counts_warm = True
        self.note_call()
        counts = counts.contiguous()
        out = torch.empty(rt.world_size, E, dtype=torch.int64, device=counts.device)
        stream = torch.cuda.current_stream(counts.device)
        ex.launch(counts=counts, out=out, rank=rt.rank, table=self.counts_table,
                  table_peers=self.counts_peers, epoch=self.counts_epoch, err=self.err,
                  err_peers=self.err_peers, timeout_ns=int(float(timeout_s) * 1e9),
                  stream=stream)
        self.watch.after_call(stream)
        return out

    # ---- errors / reset -----------------------------------------------------------------
    def peer_error_word(self, pe: int):
        """Rank pe's error word as a host list (read through its load/store mapping; None if
        there is none or the read fails). Error path only: a synchronous device read."""
        if self.err is None or not 0 <= pe < self.runtime.world_size or \
                pe in getattr(self, "_err_unreachable", ()):
            return None
        try:
            t = self.err if pe == self.runtime.rank else self.runtime.peer_tensor(self.err, pe)
            return [int(v) for v in t.tolist()]
        except Exception:  # a peer gone or unmapped: the local text stands alone
            return None

    def describe_error(self, words):
        """describe_error of this rank's word; for ERR_PEER_ERROR also the peer's own word,
        followed along ERR_PEER_ERROR links to the rank that failed first (read on the error
        path only, when the host raises: the peers' words are sticky until the reset)."""
        from ..kernels.errors import ERR_PEER_ERROR, describe_error
        text = describe_error(words)
        if not text or int(words[0]) != ERR_PEER_ERROR:
            return text
        seen = {int(words[1])}
        pe = int(words[2])
        for _ in range(self.runtime.world_size):
            if pe in seen:
                break
            seen.add(pe)
            peer = self.peer_error_word(pe)
            if peer is None or int(peer[0]) == 0:
                break
            text += f"; rank {pe}'s error word: {describe_error(peer)}"
            if int(peer[0]) != ERR_PEER_ERROR:
                text += f" (rank {pe} failed first)"
                break
            pe = int(peer[2])
        return text

    def check_errors(self):
        """Synchronize; OverlapError if any call on this buffer (any layer) recorded an error
        since construction or the last reset()."""
        if self.watch is not None:
            self.watch.check()

    def reset(self):
        """Collective (every rank, between calls, not under capture): clear the buffer for every
        layer on it. Synchronizes, barrier (no kernel of any rank runs past it), zeroes the
        error word (the symmetric one the peers' scales poll: cleared on every rank before the
        second barrier, so no rank's next call sees a peer's old error), the whole
        communication block (counters and epoch tags: only the peers' consumers write it, and
        none runs now), the expected counts, the epoch and every attached layer's band flags
        (an old flag would equal a new epoch), the per-segment arrival words (part of the
        block) and their expectation, forgets the host
        read-back, barrier again. Every rank restarts at epoch 0."""
        if not self.allocated:
            return
        rt = self.runtime
        torch.cuda.synchronize(rt.device)
        rt.barrier("CommBuffer.reset (its first barrier)")
        self.err.zero_()
        self.buffers.block.zero_()
        self.expected.zero_()
        if self.seg_expected is not None:
            self.seg_expected.zero_()  # the arrival words after the 3W were zeroed with the block
        self.epoch.zero_()
        if self.counts_table is not None:  # its flags would pass the restarted epoch
            self.counts_table.zero_()
        if self.stage is not None:  # no call's tokens outlive the reset
            self.stage.zero_()
        self.counts_epoch.zero_()
        for layer in list(self._layers):
            layer._clear_band_flags()
        self.watch.clear()
        torch.cuda.synchronize(rt.device)
        rt.barrier("CommBuffer.reset (its second barrier)")

    def __repr__(self):
        return (f"CommBuffer(transport={self.transport!r}, slot_bytes={self.slot_bytes}, "
                f"reserved={self.reserved_slot_bytes}, layers={self.num_layers}, "
                f"calls={self.calls})")


__all__ = ["CommBuffer", "CommBufferError", "LayerShape", "NvshmemError", "OverlapError",
           "comm_block_bytes", "format_heap_report", "heap_report", "slot_bytes_for"]
