"""MoEDispatch: the dispatch half of an MoE layer, sending each token once per destination rank.

`dispatch_to_plan` sends one row per (token, k) assignment, so a token whose top-k experts share
an owner crosses the wire once per such expert. Here the source sends every token once to each
rank that owns any of its experts, with its top-k ids; the owner expands it into the (token, k)
rows of its local experts in the plan layout. The result is bitwise `dispatch_to_plan`'s.

`dispatch_wire_bytes` counts, from the routings alone (no collective), the bytes each source
rank puts on the wire under both schemes (bench/bench_dispatch_bytes.py reports them on the
model routings).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.host_checks import require_tensors
from .checks import agree_on_call, as_int, backward_agreement, error_of
from .dispatch import _check_dispatch
from .plan import CombinePlan
from .reference import all_to_all, exchange, world

BACKENDS = ("auto", "reference", "overlap")
STAGE_SOURCES = ("auto", "always", "never")  # MoEDispatch(stage_source=)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
IDS_DTYPE = torch.int32  # the top-k ids sent with each token (and the per-destination counts)


class MoEDispatch(torch.nn.Module):
    """Dispatch for one MoE layer: tokens [T, D] -> this rank's expert inputs in the plan layout.

    num_experts: global experts E (E // world_size per rank, rank r owning r * E // W ...);
    hidden_size D: the model's hidden size, the tokens' width (HF ``hidden_size``; the columns
    of x and of the result); topk: experts per token; max_tokens_per_rank: the most tokens any
    rank routes in one call (checked; sizes the device path's receive buffer); group: the process
    group; backend: "reference", "overlap" or "auto" (resolved once here: "reference" until the
    device transport exists). validate: see `forward`.

    ``forward(x, topk_ids, plan, counts)`` returns the same tensor as
    ``dispatch_to_plan(x, topk_ids, plan, counts)`` (bitwise), moving each token once per
    destination rank instead of once per assignment.

    Reference backend (CPU and GPU, torch ops and host collectives through
    ``moe_overlap.runtime.collectives``): three all_to_all_single calls: the number of tokens for
    each destination (one int32 each), each sent token's top-k ids (int32 [tokens, k]), then the
    tokens (one row per destination rank that owns any of the token's experts, destination
    major, token order). The owner expands each received token into a row per slot j whose
    expert it owns, placed at plan row expert_row_start[e] + group_row_start[e, source] + its
    position among that (expert, source)'s rows in (token, k) order; padding rows are zero.
    Reads split sizes on the host. Differentiable in x: the token exchange's backward is the
    reverse exchange (collective: run the backward on every rank), so each token's gradient is
    the sum of its (token, k) rows' gradients (float rounding may differ from
    `dispatch_to_plan`'s backward, which sums in expert order).

    Overlap backend (CUDA, bf16 x with hidden_size % 8 == 0, int32 or int64 ids; issue 39 item
    1): device-only, no host sync, capturable in a CUDA graph with the plan. A send kernel on
    ``send_ctas`` CTAs (combine/dispatch_send.py) stores each token once per destination rank,
    with its int32 ids row, into that owner's receive slot for this source, then the count, the
    call tag and one arrival marker per CTA, by the CommBuffer's transport: "nvlink" (peer
    stores through its peer tables, the marker a sys-scope release) or "nvshmem" (NVSHMEM puts
    into the owner's symmetric slot, the tag and the marker as signals after a fence); the
    owner's wait + expand kernels (combine/dispatch_expand.py) wait for every source's markers
    (bounded; a peer's error word ends the wait), check the tags and copy each received token
    into its (token, k) rows of the plan layout, zero padding: bitwise the reference.
    Communication state: a ``CommBuffer`` of either transport (``comm_buffer=None``:
    ``CommBuffer.shared(group, "nvlink")``, the one ``MoECombine`` uses by default, so dispatch
    and combine calls alternate its slots under one epoch; an nvshmem one is shared the same
    way with an ``MoECombine`` of that transport; slot layout: combine/dispatch_index.py).
    Errors: recorded on the device, raised by the next call (or ``check_errors()``), cleared by
    ``reset()`` (collective), as the overlapped combine's. ``rows=None`` gives
    ``plan.row_capacity`` rows (no host read of ``plan.total_rows``): the reference's rows, then
    zero rows. Inference-only: raises under autograd. ``send_ctas`` and the buffer's transport
    must be the same on every rank (the validated call agrees on them).

    signal_arrival (overlap): the expand raises ``band_arrived[b] = epoch`` (int32 [band
    capacity], ``arrival_flags``) once band b's rows are written, for a consumer forked by
    ``forward(consumer=)`` (``GroupedGemm(wait_arrival=True)``). expand_wait (overlap): "all"
    (default: a wait kernel for every source, then the expand; flags per expert, after all W
    sources) or "per_source" (one kernel whose (expert, source) items each wait for their own
    source, this rank's first, then by rank distance; a band's flag as soon as the items
    writing it are done, so bands of sources already arrived go while others are in flight).
    "all" stays the default for a dispatch nothing consumes early: its expand holds no SM
    while it waits (W one-warp CTAs do) and then runs on every SM, where the per-source grid
    spins on the SMs it holds. expand_ctas (per_source): the most CTAs of its grid (None:
    2 per SM): where a persistent consumer holds the other SMs, the SMs left to the dispatch.

    stage_source (overlap, nvshmem transport; resolved once here, ``self.staged``): "always"
    copies x and the int32 ids into the CommBuffer's symmetric staging region on the stream
    before the send (two device copies, capturable, no host sync) and the send's puts read
    them there; "never" puts straight from x and ids; "auto" (default) stages exactly when
    some rank of the group has a peer without a P2P mapping (``CommBuffer.unreachable_anywhere``,
    one host all-reduce here: the region is a symmetric allocation, made on every rank or on
    none, so the ranks must agree). Why: x and ids are ordinary torch memory, which NVSHMEM's
    P2P transport reads with the GPU's threads but a network transport (IB between nodes)
    cannot read: its puts need a symmetric or registered source. The cost: one more copy of
    T x D bf16 (+ T x topk ids) per call, about T x D x 4 bytes of HBM traffic, so single-node
    groups (every peer P2P) do not pay it. "never" with an unreachable peer is refused here
    (its puts would fault); the nvlink transport never stages (its stores need every peer
    mapped: refused there as before) and refuses "always". Why the staging region is free to
    overwrite at call c: the copies of call c run on the stream after everything of call c - 1,
    whose send ended with ``quiet`` (each of its threads' puts complete at the source side,
    the region read) before the kernel ended; and the send of call c starts after the copies
    (same stream, kernel boundary), so its puts read this call's tokens. Layers sharing the
    buffer share the region under the buffer's rule (one call at a time on a stream).
    """

    def __init__(self, num_experts: int, hidden_size: int, topk: int,
                 max_tokens_per_rank: int, group=None, backend: str = "reference",
                 validate: bool = True, comm_buffer=None, send_ctas: int = 8,
                 timeout_s: float = 10.0, signal_arrival: bool = False,
                 expand_wait: str = "all", expand_ctas: int | None = None,
                 stage_source: str = "auto"):
        super().__init__()
        rank, W = world(group)
        ints = {}
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("topk", topk), ("max_tokens_per_rank", max_tokens_per_rank)):
            try:
                ints[name] = as_int(name, v, minimum=1)
            except ValueError:
                raise ValueError(f"{name} must be a positive int, got {v!r}") from None
        if ints["num_experts"] % W:
            raise ValueError(f"num_experts={num_experts} is not divisible by the world size {W}")
        if ints["topk"] > ints["num_experts"]:
            raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; choose from {BACKENDS}")
        self.group, self.rank, self.world_size = group, rank, W
        self.num_experts, self.experts_per_rank = ints["num_experts"], ints["num_experts"] // W
        self.hidden_size, self.topk = ints["hidden_size"], ints["topk"]
        self.max_tokens_per_rank = ints["max_tokens_per_rank"]
        if not isinstance(signal_arrival, bool):
            raise TypeError(f"signal_arrival must be a bool, got {signal_arrival!r}")
        if signal_arrival and backend != "overlap":
            raise ValueError(f"signal_arrival is an option of backend='overlap' (the expand "
                             f"kernel raises the flags), got backend={backend!r}")
        from .dispatch_expand import WAITS
        if expand_wait not in WAITS:
            raise ValueError(f"expand_wait={expand_wait!r}; choose from {WAITS}")
        if (expand_wait != "all" or expand_ctas is not None) and backend != "overlap":
            raise ValueError("expand_wait / expand_ctas are options of backend='overlap', got "
                             f"backend={backend!r}")
        if expand_ctas is not None:
            if expand_wait != "per_source":
                raise ValueError("expand_ctas bounds the per-source expand's grid: pass "
                                 "expand_wait='per_source'")
            expand_ctas = as_int("expand_ctas", expand_ctas, minimum=1)
        if stage_source not in STAGE_SOURCES:
            raise ValueError(f"stage_source={stage_source!r}; choose from {STAGE_SOURCES}")
        if stage_source != "auto" and backend != "overlap":
            raise ValueError(f"stage_source is an option of backend='overlap' (the nvshmem "
                             f"send's source), got backend={backend!r}")
        self.stage_source, self.staged = stage_source, False  # staged: resolved by the overlap
        self.signal_arrival, self.expand_wait = signal_arrival, expand_wait
        self.expand_ctas = expand_ctas
        # signal_arrival / per_source: made at the first call
        self.band_arrived = self.arrival_counts = None
        self.requested_backend = backend
        # "auto" resolves here, once: "reference" until the overlap backend has passed its GPU
        # tests (tests/test_dispatch_overlap_gpu.py, not run yet)
        self.backend = "overlap" if backend == "overlap" else "reference"
        self.validate = bool(validate)
        self._calls = 0  # validated calls entered: named in the agreement
        self.comm = None
        if self.backend == "overlap":
            self._build_overlap(comm_buffer, send_ctas, timeout_s)

    # ---- overlap backend ---------------------------------------------------------------------
    def _build_overlap(self, comm_buffer, send_ctas, timeout_s):
        """Collective (every rank builds its layers in the same order): attach to the buffer."""
        from .comm_buffer import CommBuffer
        from .dispatch_index import slot_layout
        if not torch.cuda.is_available():
            raise RuntimeError("MoEDispatch(backend='overlap') needs a CUDA GPU; use "
                               "backend='reference' (or 'auto') on a CPU")
        self.send_ctas = as_int("send_ctas", send_ctas, minimum=1)
        self.timeout_s = float(timeout_s)
        if comm_buffer is None:
            comm_buffer = CommBuffer.shared(self.group, "nvlink", torch.bfloat16)
        if not isinstance(comm_buffer, CommBuffer):
            raise TypeError(f"comm_buffer must be a CommBuffer, got {type(comm_buffer).__name__}")
        if comm_buffer.group is not self.group:
            raise ValueError("comm_buffer must be a CommBuffer of this process group")
        if comm_buffer.transport == "nvlink" and self.stage_source == "always":
            raise ValueError("stage_source='always' stages the nvshmem transport's source; the "
                             "nvlink transport stores from x with the GPU's threads through "
                             "P2P mappings and never stages (use transport='nvshmem')")
        self.layout = slot_layout(self.world_size, self.max_tokens_per_rank, self.hidden_size,
                                  self.topk)
        # the counts table too: the step's counts may be exchanged through this buffer
        attach = dict(counts_experts=self.num_experts)
        stage = dict(stage_x_bytes=self.max_tokens_per_rank * self.hidden_size * 2,
                     stage_ids_bytes=self.max_tokens_per_rank * self.topk * 4)
        comm_buffer.attach(self, 1, self.layout["slot_bytes"], **attach,
                           **(stage if self.stage_source == "always" else {}))
        if comm_buffer.transport == "nvlink":  # peer stores: every peer must be mapped
            comm_buffer.buffers.require_p2p("MoEDispatch(backend='overlap')")
        self.staged = self.stage_source == "always" or (
            comm_buffer.transport == "nvshmem" and self.stage_source == "auto"
            and comm_buffer.unreachable_anywhere())
        if comm_buffer.transport == "nvshmem" and self.stage_source == "never" and \
                comm_buffer.unreachable_anywhere():
            from ..runtime.nvshmem import NvshmemError
            raise NvshmemError(
                "MoEDispatch(stage_source='never') puts from x and topk_ids as passed (ordinary "
                "memory, read by the GPU's threads over P2P), but some rank of the group has a "
                f"peer without a P2P mapping (this rank: {list(comm_buffer.buffers.unreachable)}"
                "), which a network transport reaches only from symmetric memory: use "
                "stage_source='auto' or 'always'")
        if self.staged and self.stage_source == "auto":  # collective: the region alone
            comm_buffer.attach(self, 1, self.layout["slot_bytes"], **attach, **stage)
        self.comm = comm_buffer
        self.sender, self.expander = self.overlap_kernels(
            self.world_size, self.topk, self.send_ctas, timeout_s, self.signal_arrival,
            self.expand_wait, self.expand_ctas, transport=comm_buffer.transport)
        from ..runtime.device import num_sms
        self.num_sms = num_sms(comm_buffer.runtime.device)
        self._warm = False

    def _warmup(self):
        """Collective, at the first call outside a graph capture: compile, load and run the send
        and the wait + expand once with no effect (DispatchSend.warmup, DispatchExpand.warmup),
        then a barrier. Without it a rank's first call compiles for seconds while its peers'
        waits spin on its markers (a short timeout_s then times them out), and loads a module
        next to a spinning kernel."""
        dev = self.comm.runtime.device
        self.sender.warmup(dev)
        self.expander.warmup(dev, self.experts_per_rank, self.num_sms)
        self.comm.runtime.barrier("MoEDispatch's first call (its warm-up barrier: every rank "
                                  "makes that call)")
        self._warm = True

    @staticmethod
    def overlap_kernels(world_size: int, topk: int, send_ctas: int = 8,
                        timeout_s: float = 10.0, signal_arrival: bool = False,
                        expand_wait: str = "all", expand_ctas: int | None = None,
                      transport: str = "nvlink"):
        """The overlap backend's kernel objects (DispatchSend, DispatchExpand), not compiled:
        what a layer of these options launches (the compile-only tests build them here too).
        transport: the send's (the expand reads its own slot and counters either way)."""
        from .dispatch_expand import DispatchExpand
        from .dispatch_send import DispatchSend
        return (DispatchSend(world_size, topk, ctas=send_ctas, transport=transport),
                DispatchExpand(world_size, topk, timeout_ns=int(float(timeout_s) * 1e9),
                               signal_arrival=signal_arrival, wait=expand_wait,
                               max_ctas=expand_ctas))

    def _clear_band_flags(self):
        """CommBuffer.reset's hook for its layers: the arrival flags and counts (signal_arrival)
        restart at 0 with the epoch and the error word."""
        for t in (self.band_arrived, self.arrival_counts):
            if t is not None:
                t.zero_()

    def arrival_flags(self, plan: CombinePlan) -> torch.Tensor:
        """signal_arrival: the int32 [plan.band_capacity] flags (made zero once, kept; a plan of
        another capacity is refused: a captured consumer holds the address)."""
        if not self.signal_arrival:
            raise ValueError("arrival flags are raised with signal_arrival=True only")
        dev = self.comm.runtime.device
        if self.band_arrived is None:
            self.band_arrived = torch.zeros(plan.band_capacity, dtype=torch.int32, device=dev)
            self._expand_state(plan)
        elif self.band_arrived.numel() != plan.band_capacity:
            raise ValueError(f"plan has band capacity {plan.band_capacity}, this dispatch's "
                             f"arrival flags {self.band_arrived.numel()} (one max_rows per layer)")
        return self.band_arrived

    def _expand_state(self, plan: CombinePlan):
        """The expand's counts (0 between calls, kept): wait="all" with signal_arrival one per
        local expert; wait="per_source" its finished-CTA count and one writer count per band
        (``DispatchExpand.state_words``). None where the expand keeps none."""
        if self.arrival_counts is None:
            n = (self.expander.state_words(plan.band_capacity)
                 if self.expand_wait == "per_source" else
                 self.experts_per_rank if self.signal_arrival else 0)
            if n:
                self.arrival_counts = torch.zeros(n, dtype=torch.int32,
                                                  device=self.comm.runtime.device)
        return self.arrival_counts

    def exchange_counts(self, topk_ids: torch.Tensor, device: bool = True) -> torch.Tensor:
        """The step's routing counts, int64 [W, E] (``exchange_counts(topk_ids, num_experts,
        group, validate=self.validate)``): on the overlap backend with ``device`` through the
        communication buffer's counts table (device kernels, no host collective: captured in a
        CUDA graph on any process group), else the host all-gather. Bitwise the same counts.
        Collective."""
        from .dispatch import exchange_counts
        comm = self.comm if device and self.backend == "overlap" else None
        return exchange_counts(topk_ids, self.num_experts, self.group, validate=self.validate,
                               comm_buffer=comm, timeout_s=getattr(self, "timeout_s", 10.0))

    def check_errors(self):
        """Synchronize; OverlapError if a call on the communication buffer recorded a device
        error since construction or the last reset() (no-op on the reference backend)."""
        if self.comm is not None:
            self.comm.check_errors()

    def reset(self):
        """Collective, between calls: clear the communication buffer (errors, counters, tags,
        epoch) for every layer on it (CommBuffer.reset). No-op on the reference backend."""
        if self.comm is not None:
            self.comm.reset()

    def _forward_overlap(self, x, topk_ids, plan, counts, rows, consumer=None):
        from .comm_buffer import OverlapError
        if torch.is_grad_enabled() and x.requires_grad:
            raise OverlapError("MoEDispatch(backend='overlap') is inference-only (its kernels "
                               "have no backward), but x requires grad: use backend="
                               "'reference' to train, or call it under torch.no_grad() / "
                               "torch.inference_mode()")
        dev = self.comm.runtime.device
        rows = plan.row_capacity if rows is None else as_int("rows", rows, minimum=0)
        comm = self.comm
        comm.watch.poll()  # an earlier call's device error raises here, before any launch
        if not self._warm and not torch.cuda.is_current_stream_capturing():
            self._warmup()
        keep = (x, topk_ids)
        if self.staged:  # the send's symmetric source (class doc: stage_source)
            x_send, ids = comm.staged_source(topk_ids.shape[0], self.hidden_size, self.topk)
            x_send.copy_(x)
            ids.copy_(topk_ids)
        else:
            x_send = x.contiguous()
            ids = topk_ids.to(torch.int32).contiguous()
            keep = (x_send, ids)
        cnt = counts.to(dev, torch.int64).contiguous()
        out = torch.empty(rows, self.hidden_size, dtype=torch.bfloat16, device=dev)
        flags = self.arrival_flags(plan) if self.signal_arrival else None
        state = self._expand_state(plan)
        stream = torch.cuda.current_stream(dev)
        comm.note_call()
        comm.epoch.add_(1)  # the buffer's epoch: slot parity and tags count calls on it
        comm.expected.add_(self.send_ctas)  # one marker per sending CTA from every source
        if consumer is not None:
            consumer(out)
        b = comm.buffers
        self.sender.launch(x=x_send, ids=ids, experts_per_rank=self.experts_per_rank, rank=self.rank,
                           max_tokens=self.max_tokens_per_rank, recv_peers=b.recv_peers,
                           ctr_peers=b.ctr_peers, layout=self.layout,
                           slot_stride=comm.slot_bytes, epoch=comm.epoch,
                           fingerprint=plan.counts_fingerprint, err=comm.err, stream=stream)
        self.expander.launch(recv=b.recv, slot_stride=comm.slot_bytes, layout=self.layout,
                             max_tokens=self.max_tokens_per_rank, out=out, plan=plan,
                             counts=cnt, err=comm.err, epoch=comm.epoch, counters=b.counters,
                             expected=comm.expected, err_peers=comm.err_peers,
                             num_sms=self.num_sms, stream=stream,
                             arr_count=state, band_arrived=flags,
                             tile_m=plan.tile_m)
        if not torch.cuda.is_current_stream_capturing():
            for t in (*keep, cnt):
                t.record_stream(stream)
        comm.watch.after_call(stream)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"topk={self.topk}, max_tokens_per_rank={self.max_tokens_per_rank}, "
                f"world_size={self.world_size}, backend={self.backend!r}")

    def _check_local(self, x, topk_ids, plan):
        """Host facts only (shapes, dtypes, devices, the plan's rank): no data read."""
        require_tensors(dict(x=x, topk_ids=topk_ids))
        if not isinstance(plan, CombinePlan):
            raise TypeError(f"plan must be a CombinePlan, got {type(plan).__name__}")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.topk:
            raise ValueError(f"topk_ids must be [tokens, topk={self.topk}], got "
                             f"{tuple(topk_ids.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if x.dim() != 2 or tuple(x.shape) != (topk_ids.shape[0], self.hidden_size):
            raise ValueError(f"x must be [tokens={topk_ids.shape[0]}, hidden_size="
                             f"{self.hidden_size}], got {tuple(x.shape)}")
        if x.dtype not in _FLOAT:
            raise TypeError(f"x must be one of "
                            f"{', '.join(str(d).removeprefix('torch.') for d in _FLOAT)}, got "
                            f"{x.dtype}")
        if topk_ids.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"capacity exceeded: {topk_ids.shape[0]} tokens > "
                             f"max_tokens_per_rank={self.max_tokens_per_rank}")
        if plan.num_experts != self.num_experts:
            raise ValueError(f"plan has {plan.num_experts} experts, this layer "
                             f"{self.num_experts}")
        if (plan.rank, plan.world_size) != (self.rank, self.world_size):
            raise ValueError(f"plan is for rank {plan.rank} of {plan.world_size}, process group "
                             f"is rank {self.rank} of {self.world_size}")
        devs = {x.device, topk_ids.device, plan.device}
        if len(devs) != 1:
            raise ValueError(f"x, topk_ids and plan must be on one device, got "
                             f"{sorted(map(str, devs))}")
        if self.backend == "overlap" and (x.dtype != torch.bfloat16 or
                                          x.device != self.comm.runtime.device):
            raise TypeError(f"the overlap backend needs bf16 x on {self.comm.runtime.device}, "
                            f"got {x.dtype} on {x.device}")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, plan: CombinePlan,
                counts: torch.Tensor, rows: int | None = None, *,
                consumer=None) -> torch.Tensor:
        """This rank's expert inputs [rows, D] in the plan layout (x's dtype), padding rows zero;
        rows defaults to the plan's padded row count (plan.total_rows).

        x [T, D] this rank's tokens; topk_ids [T, topk] (int32 or int64) their experts; plan
        this rank's plan of `counts` (`MoECombine.plan` / `plan_combine`); counts [W, E] the
        all-gathered routing counts (`exchange_counts(topk_ids)` of this step). Collective:
        every rank calls it, also with 0 tokens.

        validate (constructor, default True): check shapes, dtypes, the capacity, expert ids in
        [0, E), that topk_ids match this rank's row of counts and that the plan was made from
        counts, and agree over the group (`checks.agree_on_call`, with the layer's sizes, the
        dtype, the backend and the whole counts matrix against every rank's topk_ids) before any
        data moves: bad input on one rank raises on every rank, naming it. The backward agrees
        too. validate=False: only the host facts are checked, locally; the caller vouches for
        the rest. consumer: overlap backend only, see the class doc."""
        if consumer is not None and self.backend != "overlap":
            raise ValueError("consumer= forks a consumer of the overlap backend's arrival flags; "
                             f"this dispatch has backend={self.backend!r}")
        backward_check = None
        if self.validate:
            self._calls += 1
            where = f"dispatch call #{self._calls}"
            result = {}

            def check():
                self._check_local(x, topk_ids, plan)
                row, fields = _check_dispatch(x, topk_ids, plan, counts, self.group, rows)
                fields.update({"hidden_size (D)": self.hidden_size, "topk": self.topk,
                               "max_tokens_per_rank": self.max_tokens_per_rank,
                               "backend": self.backend, "plan layout": plan.layout,
                               "plan tile_m": plan.tile_m,
                               "send_ctas": getattr(self, "send_ctas", None),
                               "transport": getattr(self.comm, "transport", None),
                               "signal_arrival": self.signal_arrival,
                               "expand_wait": self.expand_wait,
                               "expand_ctas": self.expand_ctas,
                               "staged source": self.staged})
                result["row"], result["fields"] = row, fields

            err = error_of(check)
            agree_on_call("MoEDispatch.forward", result.get("fields"), err, self.group,
                          routing=None if err else (result["row"], counts, "counts"),
                          where=where)
            backward_check = backward_agreement("backward of MoEDispatch.forward", self.group,
                                                where=where)
        else:
            self._check_local(x, topk_ids, plan)
        if self.backend == "overlap":
            return self._forward_overlap(x, topk_ids, plan, counts, rows, consumer)
        return dispatch_tokens_once(x, topk_ids, plan, self.group, rows, backward_check)


def dispatch_tokens_once(x: torch.Tensor, topk_ids: torch.Tensor, plan: CombinePlan, group=None,
                         rows: int | None = None, backward_check=None) -> torch.Tensor:
    """MoEDispatch's reference path, unchecked (the layer checks): see `MoEDispatch`."""
    rank, W = world(group)
    El = plan.experts_per_rank
    T, k = topk_ids.shape
    dev = x.device
    ids = topk_ids.to(torch.int64)
    # goes[t, r]: token t has an expert on rank r; the send order is destination, then token
    goes = torch.zeros(T, W, dtype=torch.bool, device=dev)
    goes.scatter_(1, ids // El, True)
    tok = goes.t().nonzero(as_tuple=True)[1]
    n_to = goes.sum(0).to(IDS_DTYPE)
    n_from = torch.empty_like(n_to)
    all_to_all(n_from, n_to, [1] * W, [1] * W, group)
    # the split sizes (and, without rows, the plan's row count) in one device-to-host copy
    host = torch.cat([n_to.to(torch.int64), n_from.to(torch.int64)] +
                     ([plan.total_rows.to(dev, torch.int64)] if rows is None else [])).tolist()
    in_splits, out_splits = host[:W], host[W:2 * W]
    rows = host[-1] if rows is None else int(rows)
    n_recv = sum(out_splits)
    recv_ids = torch.empty(n_recv, k, dtype=IDS_DTYPE, device=dev)
    all_to_all(recv_ids, ids.index_select(0, tok).to(IDS_DTYPE), out_splits, in_splits, group)
    # owner side: every (received token i, slot j) whose expert is local makes one plan row
    src_rank = torch.repeat_interleave(torch.arange(W, device=dev),
                                       torch.tensor(out_splits, device=dev), output_size=n_recv)
    local = recv_ids.to(torch.int64) - rank * El
    i, j = ((local >= 0) & (local < El)).nonzero(as_tuple=True)  # received row, then slot
    e, s = local[i, j], src_rank[i]
    key = e * W + s  # (expert, source) group; a stable sort keeps (token, k) order inside it
    order = torch.argsort(key, stable=True)
    n = torch.bincount(key, minlength=El * W)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=dev) - (torch.cumsum(n, 0) - n)[key[order]]
    dest_row = plan.expert_row_start.long()[e] + plan.group_row_start.long()[e, s] + pos
    # every plan row reads its received token or the zero row after them (as dispatch_to_plan)
    src = torch.full((rows,), n_recv, dtype=torch.long, device=dev)
    src.index_copy_(0, dest_row, i)
    recv = exchange(x.index_select(0, tok), out_splits, in_splits, group, zero_rows=1,
                    backward_check=backward_check)
    return recv.index_select(0, src)


# ---------------------------------------------------------------------------- wire accounting
@dataclass(frozen=True)
class WireBytes:
    """One source rank's dispatch traffic that leaves the rank (same-rank rows excluded).

    per_assignment: token bytes of `dispatch_to_plan` (one row per off-rank assignment; its
    split sizes come from the all-gathered counts, so it sends no index of its own).
    once / once_index: token bytes of `MoEDispatch` (one row per off-rank destination rank of
    each token) and its index bytes (each such token's top-k ids, int32, and one int32 token
    count per peer). counts_index: the counts all-gather both schemes need for the plan (this
    rank's int64 row of E to each peer), listed apart."""
    rank: int
    assignments: int  # off-rank (token, k) assignments
    tokens: int  # off-rank (token, destination rank) pairs
    per_assignment: int
    once: int
    once_index: int
    counts_index: int

    @property
    def saved(self) -> int:
        """Bytes MoEDispatch saves against per-assignment sending, its index included."""
        return self.per_assignment - self.once - self.once_index


def dispatch_wire_bytes(topk_ids_per_rank, experts_per_rank: int, hidden: int,
                        dtype_bytes: int) -> list[WireBytes]:
    """Per source rank, the dispatch bytes that leave it under both schemes (see `WireBytes`),
    counted from the routing itself; no collective.

    topk_ids_per_rank: the W ranks' topk_ids ([T_s, k] each, ids in [0, W * experts_per_rank);
    the same k on every rank); hidden: the tokens' width D; dtype_bytes: bytes per element of x
    (2 for bf16)."""
    W = len(topk_ids_per_rank)
    El = as_int("experts_per_rank", experts_per_rank, minimum=1)
    hidden, dtype_bytes = as_int("hidden", hidden, minimum=1), as_int("dtype_bytes", dtype_bytes,
                                                                       minimum=1)
    E = El * W
    out = []
    for s, ids in enumerate(topk_ids_per_rank):
        ids = torch.as_tensor(ids).to(torch.int64)
        if ids.dim() != 2:
            raise ValueError(f"rank {s}'s topk_ids must be [tokens, k], got {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
            raise ValueError(f"rank {s}'s expert ids must be in [0, {E})")
        T, k = ids.shape
        owner = ids // El
        assignments = int((owner != s).sum())
        hit = torch.zeros(T, W, dtype=torch.bool)
        hit.scatter_(1, owner, True)
        hit[:, s] = False
        tokens = int(hit.sum())
        row = hidden * dtype_bytes
        out.append(WireBytes(rank=s, assignments=assignments, tokens=tokens,
                             per_assignment=assignments * row, once=tokens * row,
                             once_index=tokens * k * IDS_DTYPE.itemsize
                             + (W - 1) * IDS_DTYPE.itemsize,
                             counts_index=(W - 1) * E * 8))
    return out
